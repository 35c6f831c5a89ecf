"""Pipeline schedules side by side: idle fraction, permutes, step memory and time.

For GPipe (with and without stage remat), 1F1B and circular (2 rounds), on 4 stages x 2 data
devices, with microbatches of a fixed size and M = S, 2S, 4S, 8S, it reports the idle fraction
counted from the schedule next to its formula, the collective-permutes of one step (ops in the
compiled loop bodies x loop trips, and their bytes per device), the compiled step's temp bytes
per device, whether any gradient reduction sits inside a loop body, and the median step time.

Run: ``python benchmarks/pipeline.py [--size tiny] [--output-dir DIR]``; writes
``pipeline.json`` and ``pipeline.md``.
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

from substrax.hlo import collectives, while_bodies
from substrax.mesh import DeviceMeshManager, PipelineParallelStrategy
from substrax.pipeline import Pipeline

SIZES = {
    "full": {"width": 256, "layers": 16, "rows": 8},
    "tiny": {"width": 16, "layers": 8, "rows": 2},
}
SCHEDULES = {
    "gpipe": {"schedule": "gpipe"},
    "gpipe + remat": {"schedule": "gpipe", "remat": True},
    "1f1b": {"schedule": "1f1b"},
    "circular x2": {"schedule": "circular", "repeats": 2},
}


def layer_fn(p, x):
    return x + jnp.tanh(x @ p["w"])


def loss_fn(y, t):
    return jnp.mean((y - t) ** 2)


def formula(schedule: str, stages: int, micro: int, repeats: int) -> float:
    if schedule == "1f1b":
        return 2 * (stages - 1) / (micro + 2 * (stages - 1))
    return (stages - 1) / (repeats * micro + stages - 1)


def measure(mesh, label, options, micro, size, repeats_timing):
    stages = dict(mesh.shape)["pipe"]
    pipe = Pipeline(layer_fn, loss_fn, mesh, PipelineParallelStrategy("pipe", 0, stages),
                    num_microbatches=micro, data_axes=("data",), **options)  # fmt: skip
    width, rows = size["width"], size["rows"]
    params = {"w": jax.random.normal(jax.random.key(0), (size["layers"], width, width)) / width}
    padded, mask = pipe.stack(params)
    x = jax.random.normal(jax.random.key(1), (micro * rows * 2, width))
    xs, ts = pipe.microbatch(x), pipe.microbatch(jnp.sin(x))
    step = jax.jit(pipe.loss_and_grads, static_argnames="microbatched")
    compiled = step.lower(padded, mask, xs, ts, microbatched=True).compile()
    text = compiled.as_text()
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
        "| schedule | M | idle (formula) | permutes / step | permute KiB / step | "
        "reductions in loops | step temp KiB | step ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['schedule']} | {r['microbatches']} | {r['idle_measured']:.3f} "
            f"({r['idle_formula']:.3f}) | {r['permutes_per_step']} | "
            f"{r['permute_bytes_per_step'] / 1024:.1f} | {r['reductions_in_loops']} | "
            f"{r['temp_bytes'] / 1024:.1f} | {1000 * r['median_step_s']:.1f} |"
        )
    return "\n".join(lines) + (
        f"\n\n{stages} stages x 2 data devices (8 simulated CPU devices), jax {jax.__version__}; "
        "microbatches of a fixed size, so the batch grows with M.\n"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    parser.add_argument(
        "--factors", type=int, nargs="*", default=[1, 2, 4, 8],
        help="microbatches per configuration, as multiples of the 4 stages",
    )  # fmt: skip
    parser.add_argument("--output-dir", type=pathlib.Path, default=pathlib.Path("benchmarks"))
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
    print(table)
    return rows


if __name__ == "__main__":
    main()
