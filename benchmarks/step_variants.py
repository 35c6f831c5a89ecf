"""What of the default step's time against Flax's recipe is the guard, donation or the path.

Runs, interleaved on one layout, Flax's recipe and substrax's step with and without each of
its defaults that Flax's recipe lacks: the non-finite guard (``on_nonfinite="apply"`` turns
it off), donation (``donate=False``) and the manual region (``data_parallel="xla"``); and
Flax's recipe donating as substrax's step does. Prints each one's median step time over
Flax's and the kernels its compiled program launches (fusions, in every computation: on
XLA:CPU each costs a launch on every device whatever its size), its temporaries per device
(what glibc's defaults fault in again on each call) and the minor page faults a
step takes (``--allocator kept`` keeps freed memory, as accelerators' pools do: see
:mod:`allocator`). docs/benchmarks.md quotes runs::

    .venv/bin/python benchmarks/step_variants.py --layout "TP 4 x DP 2" --steps 50
    .venv/bin/python benchmarks/step_variants.py --layout "TP 4 x DP 2" --steps 50 --allocator kept
"""

from __future__ import annotations

import argparse
import pathlib
import re
import statistics
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))

import allocator  # noqa: E402
import gpt  # noqa: E402
from layouts import CASES, SIZES, FlaxRecipe, Substrax  # noqa: E402

import substrax_flax as sf  # noqa: E402
from substrax.mesh import DeviceMeshManager  # noqa: E402

#: Label -> make_train_step's options (the default step first).
VARIANTS = {
    "default": {},
    "no guard": {"on_nonfinite": "apply"},
    "no guard, undonated": {"on_nonfinite": "apply", "donate": False},
    "undonated": {"donate": False},
    "xla's step, no guard": {"data_parallel": "xla", "on_nonfinite": "apply"},
}


def _runner(config, mesh, layout, options):
    runner = Substrax(config, mesh, layout)
    runner.step_fn = sf.make_train_step(gpt.loss_fn, **options)
    return runner


def kernels(hlo_text: str) -> int:
    """The fusions in a compiled program's text, in every computation (a branch's included)."""
    return len(re.findall(r"^\s*%\S+ = .*? fusion\(", hlo_text, re.MULTILINE))


def plain_dots(hlo_text: str) -> int:
    """The dots XLA:CPU left outside its fusions (YNNPACK's among them), in every computation.

    In the manual region XLA's algebraic simplifier folds the transpose its dot
    canonicalisation puts after each weight gradient's dot into the dot (no all-reduce stands
    between them there, as one does in XLA's partitioned step), giving a dot whose left
    operand contracts its first dimension, which XLA:CPU's YNNPACK fusions do not take
    (docs/benchmarks.md).
    """
    return len(re.findall(r"^\s*%\S+ = \S+ dot\(", hlo_text, re.MULTILINE))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=list(CASES), default="TP 4 x DP 2")
    parser.add_argument("--steps", type=int, default=50, help="interleaved steps of each")
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--allocator", choices=allocator.CHOICES, default="glibc",
                        help="kept: glibc keeps freed memory, for this whole process")  # fmt: skip
    args = parser.parse_args(argv)
    allocator.use(args.allocator)
    layout, shape = CASES[args.layout]
    mesh = DeviceMeshManager.create_device_mesh(shape)
    config = SIZES[args.size]
    runners = {name: _runner(config, mesh, layout, options) for name, options in VARIANTS.items()}
    runners["flax, donated"] = FlaxRecipe(config, mesh, layout, donate=True)
    runners["flax"] = FlaxRecipe(config, mesh, layout)
    times = {name: [] for name in runners}
    faults = {name: [] for name in runners}
    counts, dots, temps = {}, {}, {}
    for name, runner in runners.items():  # compiled, and a few steps to settle
        batch = jax.device_put(gpt.batch_at(0, 16, config.seq), runner.data_sharding)
        compiled = runner.lower_step(batch).compile()
        text = compiled.as_text()
        counts[name], dots[name] = kernels(text), plain_dots(text)
        temps[name] = int(compiled.memory_analysis().temp_size_in_bytes)
        for _ in range(3):
            jax.block_until_ready(runner.step(batch))
    order = list(runners.items())
    for i in range(args.steps):
        batch = gpt.batch_at(i + 1, 16, config.seq)
        for name, runner in order if i % 2 else order[::-1]:  # alternating order
            placed = jax.device_put(batch, runner.data_sharding)
            _, seconds, taken = allocator.timed(runner.step, placed)
            times[name].append(seconds)
            faults[name].append(taken)
    flax = statistics.median(times["flax"])
    ratios = {name: statistics.median(t) / flax for name, t in times.items()}
    page_faults = {name: statistics.median(f) for name, f in faults.items()}
    print(f"{args.layout}, median of {args.steps} interleaved steps, allocator "
          f"{args.allocator}, Flax's recipe {flax * 1e3:.0f} ms:")  # fmt: skip
    for name, ratio in ratios.items():
        print(f"  {name:<24} {ratio:.3f}x Flax's time, {counts[name]:5d} kernels "
              f"({dots[name]} plain dots), {temps[name] / 2**20:.2f} MiB of temporaries, "
              f"{page_faults[name]:,.0f} page faults")  # fmt: skip
    return {"ratios": ratios, "kernels": counts, "plain_dots": dots, "page_faults": page_faults,
            "temp_bytes": temps}  # fmt: skip


if __name__ == "__main__":
    main()
