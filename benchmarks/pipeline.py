"""Pipeline schedules side by side: idle fraction, hidden work, permutes, step memory and time.

For GPipe (with and without stage remat), circular (2 rounds), 1F1B, interleaved 1F1B (2
chunks) and ZB-H1, on 4 stages x 2 data devices, with microbatches of a fixed size and M = S,
2S, 4S, 8S, it reports the idle fraction counted from the schedule's table next to the textbook
formula, the compiled step's matrix FLOPs per device against the useful ones (one device's
gradient of the same batch over the 8 devices: a ratio of ``1 / (1 - idle)`` means no hidden
work in the bubble), the collective-permutes of one step (ops in the compiled loop bodies x
loop trips, and their bytes per device), the compiled step's temp bytes per device, whether any
gradient reduction sits inside a loop body, and the median step time.

Run: ``python benchmarks/pipeline.py [--size tiny] [--plot FILE] [--output-dir DIR]``; writes
``pipeline.json`` and ``pipeline.md`` (and, with ``--plot``, idle against temp memory).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)

import argparse
import json
import pathlib
import statistics
import time

import jax.numpy as jnp

from substrax.hlo import collectives, dot_flops, while_bodies
from substrax.mesh import DeviceMeshManager, PipelineParallelStrategy
from substrax.pipeline import Pipeline

SIZES = {
    "full": {"width": 256, "layers": 16, "rows": 8},
    "tiny": {"width": 16, "layers": 8, "rows": 2},
}
SCHEDULES = {
    "gpipe": {"schedule": "gpipe"},
    "gpipe + remat": {"schedule": "gpipe", "remat": True},
    "circular x2": {"schedule": "circular", "repeats": 2},
    "1f1b": {"schedule": "1f1b"},
    "interleaved x2": {"schedule": "interleaved", "repeats": 2},
    "zb-h1": {"schedule": "zb-h1"},
}


def layer_fn(p, x):
    return x + jnp.tanh(x @ p["w"])


def loss_fn(y, t):
    return jnp.mean((y - t) ** 2)


def formula(schedule: str, stages: int, micro: int, repeats: int) -> float:
    """The textbook idle: (S-1)/(vM+S-1) (1F1B and GPipe: v = 1), ZB-H1 (S-1)/(3M+S-1)."""
    if schedule == "zb-h1":
        return (stages - 1) / (3 * micro + stages - 1)
    return (stages - 1) / (repeats * micro + stages - 1)


def measure(mesh, label, options, micro, size, repeats_timing):
    stages = dict(mesh.shape)["pipe"]
    pipe = Pipeline(layer_fn, loss_fn, mesh, PipelineParallelStrategy("pipe", 0, stages),
                    num_microbatches=micro, batch_axes=("data",), **options)  # fmt: skip
    width, rows = size["width"], size["rows"]
    params = {"w": jax.random.normal(jax.random.key(0), (size["layers"], width, width)) / width}
    padded, mask = pipe.stack(params)
    x = jax.random.normal(jax.random.key(1), (micro * rows * 2, width))
    xs, ts = pipe.microbatch(x), pipe.microbatch(jnp.sin(x))
    step = jax.jit(pipe.loss_and_grads, static_argnames="microbatched")
    compiled = step.lower(padded, mask, xs, ts, microbatched=True).compile()
    text = compiled.as_text()
    reference = jax.jit(jax.grad(pipe.reference_loss)).lower(params, x, jnp.sin(x)).compile()
    useful = dot_flops(reference.as_text()) / mesh.size
    bodies, ops = while_bodies(text), collectives(text)
    permutes = [op for op in ops if op.kind == "collective-permute" and op.computation in bodies]
    trips = pipe.num_ticks
    times = []
    for _ in range(repeats_timing + 1):
        start = time.perf_counter()
        jax.block_until_ready(step(padded, mask, xs, ts, microbatched=True))
        times.append(time.perf_counter() - start)
    return {
        "schedule": label,
        "microbatches": micro,
        "idle_measured": pipe.idle_fraction(),
        "idle_formula": formula(pipe.schedule, stages, micro, pipe.repeats),
        "flops_over_useful": dot_flops(text) / useful,
        "idle_flops_over_useful": dot_flops(text, branch=min) / useful,
        "permutes_per_step": len(permutes) * trips,
        "permute_bytes_per_step": sum(op.traffic_bytes for op in permutes) * trips,
        "reductions_in_loops": sum(
            op.kind in ("all-reduce", "reduce-scatter") and op.computation in bodies for op in ops
        ),
        "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
        "median_step_s": statistics.median(times[1:]),
    }


def markdown(rows, stages) -> str:
    lines = [
        "| schedule | M | idle (textbook) | FLOPs / useful (1/(1-idle)) | permutes / step | "
        "permute KiB / step | reductions in loops | step temp KiB | step ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['schedule']} | {r['microbatches']} | {r['idle_measured']:.3f} "
            f"({r['idle_formula']:.3f}) | {r['flops_over_useful']:.3f} "
            f"({1 / (1 - r['idle_measured']):.3f}) | {r['permutes_per_step']} | "
            f"{r['permute_bytes_per_step'] / 1024:.1f} | {r['reductions_in_loops']} | "
            f"{r['temp_bytes'] / 1024:.1f} | {1000 * r['median_step_s']:.1f} |"
        )
    return "\n".join(lines) + (
        f"\n\n{stages} stages x 2 data devices (8 simulated CPU devices), jax {jax.__version__}; "
        "microbatches of a fixed size, so the batch grows with M. Idle counts a tick per op "
        "(split schedules: forward, backward, weight); FLOPs are the compiled step's matrix "
        "products per device (a conditional's costliest branch) over one device's gradient of "
        "the same batch / 8; the split schedules' idle ticks run no product "
        "(`dot_flops(text, branch=min)` is 0 in the loop). Step times are CPU times of 8 "
        "simulated devices on 2 cores, where every device's work is serialised: they show "
        "overheads, not the bubble.\n"
    )


def plot(rows, path: pathlib.Path) -> None:
    """Idle fraction against step temp memory, one line per schedule over M."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for label in dict.fromkeys(r["schedule"] for r in rows):
        mine = [r for r in rows if r["schedule"] == label]
        axes.plot([r["temp_bytes"] / 2**20 for r in mine], [r["idle_measured"] for r in mine],
                  "o-", label=label)  # fmt: skip
        for r in mine:
            axes.annotate(f"M={r['microbatches']}", (r["temp_bytes"] / 2**20, r["idle_measured"]),
                          fontsize=6)  # fmt: skip
    axes.set(xlabel="step temp memory (MiB / device)", ylabel="idle share of the ticks",
             xscale="log", title="Pipeline schedules: bubble against memory")  # fmt: skip
    axes.legend(fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    parser.add_argument(
        "--factors", type=int, nargs="*", default=[1, 2, 4, 8],
        help="microbatches per configuration, as multiples of the 4 stages",
    )  # fmt: skip
    parser.add_argument("--output-dir", type=pathlib.Path, default=pathlib.Path("benchmarks"))
    parser.add_argument("--plot", type=pathlib.Path, default=None, help="write a PNG here")
    args = parser.parse_args(argv)
    mesh = DeviceMeshManager.create_device_mesh({"pipe": 4, "data": 2})
    rows = [
        measure(mesh, label, options, factor * 4, SIZES[args.size], args.steps)
        for label, options in SCHEDULES.items()
        for factor in args.factors
    ]
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "pipeline.json").write_text(json.dumps(rows, indent=2))
    table = markdown(rows, 4)
    (args.output_dir / "pipeline.md").write_text(table)
    if args.plot:
        plot(rows, args.plot)
    print(table)
    return rows


if __name__ == "__main__":
    main()
