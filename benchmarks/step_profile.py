"""Where a layout's step spends its time on XLA:CPU: substrax's default step beside Flax's recipe.

Traces ``--steps`` calls of each (``jax.profiler.trace``, a Perfetto trace) and prints, per
step, the time in collectives (by HLO op), in waiting for the other devices' threads to
arrive at them (``Rendezvous``) and in the largest fusions, so two programs with the same
FLOPs and traffic can be told apart::

    .venv/bin/python benchmarks/step_profile.py --layout "TP 4 x DP 2"

Thread times are summed over the 8 simulated devices' threads (CPU milliseconds per step),
and tracing slows both steps: compare the two columns, not the absolute figures.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import pathlib
import sys
import tempfile

import jax

jax.config.update("jax_num_cpu_devices", 8)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))

import gpt  # noqa: E402
from layouts import CASES, SIZES, FlaxRecipe, Substrax  # noqa: E402

from substrax.mesh import DeviceMeshManager  # noqa: E402


def profile(runner, batch, steps: int) -> collections.Counter:
    """CPU milliseconds per step in each traced event name, summed over threads."""
    for _ in range(3):
        jax.block_until_ready(runner.step(batch))
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder, create_perfetto_trace=True):
            for _ in range(steps):
                jax.block_until_ready(runner.step(batch))
        (trace,) = pathlib.Path(folder).rglob("perfetto_trace.json.gz")
        with gzip.open(trace) as file:
            events = json.load(file)
    events = events["traceEvents"] if isinstance(events, dict) else events
    times: collections.Counter = collections.Counter()
    for event in events:
        if event.get("ph") == "X" and "dur" in event:
            times[event["name"]] += event["dur"] / 1e3 / steps
    return times


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=list(CASES), default="TP 4 x DP 2")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    args = parser.parse_args(argv)
    layout, shape = CASES[args.layout]
    mesh = DeviceMeshManager.create_device_mesh(shape)
    config = SIZES[args.size]
    result = {}
    for runner in (Substrax(config, mesh, layout), FlaxRecipe(config, mesh, layout)):
        batch = jax.device_put(gpt.batch_at(0, 16, config.seq), runner.data_sharding)
        times = profile(runner, batch, args.steps)
        collective = {n: t for n, t in times.items() if n.split(".")[0] in COLLECTIVES}
        result[runner.name] = {
            "collectives_ms": sum(collective.values()),
            "rendezvous_ms": times.get("Rendezvous", 0.0),
            "largest_collectives": sorted(collective.items(), key=lambda i: -i[1])[: args.top],
        }
    for name, row in result.items():
        print(f"{name}: collectives {row['collectives_ms']:.1f} ms, waiting at them "
              f"{row['rendezvous_ms']:.1f} ms per step (thread time)")  # fmt: skip
        for op, ms in row["largest_collectives"]:
            print(f"    {op:<28} {ms:8.1f}")
    return result


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

if __name__ == "__main__":
    main()
