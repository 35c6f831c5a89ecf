"""The train step's remat policies on the example decoder: peak memory, FLOPs, losses.

For each policy of ``substrax.spmd.REMAT`` (``make_train_step(..., remat=...)``, blocks marked
with ``@substrax_flax.remat``), with the blocks in a Python loop and in one ``nnx.scan``, on
FSDP over 8 simulated devices, this compiles one step and reads XLA's memory analysis (temp
bytes, and the peak: arguments + outputs - donated aliases + temp) and cost analysis (FLOPs
per device; XLA counts a scan's body once), then trains a few steps and compares the losses
with ``remat="none"``.

Run: ``python benchmarks/remat.py [--size tiny] [--batch-size 16] [--output-dir DIR]``; writes
``remat.json`` and ``remat.md``.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)

import argparse
import dataclasses
import pathlib
import time

from layouts import (  # layouts puts examples/ on the path
    SIZES,
    compiled_stats,
    gpt,
    write_results,
)

import substrax_flax as sf
from substrax.layout import Layout
from substrax.mesh import DeviceMeshManager
from substrax.spmd import REMAT


def measure(config: gpt.Config, remat: str, batch_size: int, steps: int, stacked: bool) -> dict:
    """One policy's compiled step: memory, FLOPs, and the losses of ``steps`` steps."""
    mesh = DeviceMeshManager.create_device_mesh({"data": 8})
    layout = Layout.named("fsdp", mesh)
    model_class = gpt.StackedGPT if stacked else gpt.GPT
    model = sf.create_sharded_model(
        lambda: model_class(config, gpt.nnx.Rngs(0)), mesh, layout=layout
    )
    optimizer = sf.create_sharded_optimizer(model, gpt.optimizer(3e-3))
    step = sf.make_train_step(gpt.loss_fn, remat=remat)
    batch = gpt.batch_at(0, batch_size, config.seq, 0)
    stats = compiled_stats(step.lower(model, optimizer, batch).compile(), mesh.devices.size)
    losses = [
        float(step(model, optimizer, gpt.batch_at(i, batch_size, config.seq, 0))["loss"])
        for i in range(steps)
    ]
    return {
        "blocks": "nnx.scan" if stacked else "python loop",
        "remat": remat,
        "temp_bytes": stats["temp_bytes"],
        "peak_bytes": stats["peak_bytes"],
        "flops": stats["flops"],
        "losses": losses,
    }


def _table(rows: list[dict]) -> str:
    lines = [
        "| blocks | remat | step temp MiB | step peak MiB | peak vs none | GFLOP / device "
        "| FLOPs vs none | max loss difference vs none |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        base = next(r for r in rows if r["blocks"] == row["blocks"] and r["remat"] == "none")
        difference = max(abs(a - b) for a, b in zip(row["losses"], base["losses"], strict=True))
        lines.append(
            f"| {row['blocks']} | {row['remat']} | {row['temp_bytes'] / 2**20:.1f} | "
            f"{row['peak_bytes'] / 2**20:.1f}"
            f" | {row['peak_bytes'] / base['peak_bytes']:.2f} | {row['flops'] / 1e9:.2f} | "
            f"{row['flops'] / base['flops']:.2f} | {difference:.1e} |"
        )
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--output-dir", type=pathlib.Path, default=pathlib.Path("benchmarks"))
    args = parser.parse_args(argv)
    config = SIZES[args.size]
    rows = [
        measure(config, remat, args.batch_size, args.steps, stacked)
        for stacked in (False, True)
        for remat in REMAT
    ]
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "jax": jax.__version__,
        "devices": jax.device_count(),
        "config": dataclasses.asdict(config),
        "batch_size": args.batch_size,
        "layout": "fsdp over 8",
        "rows": rows,
    }
    text = (
        f"# Remat policies: FSDP over {jax.device_count()} {jax.devices()[0].platform} devices\n\n"
        f"The example decoder ({config}), batch {args.batch_size}, measured "
        f"{report['date']} with jax {jax.__version__} (`python benchmarks/remat.py`).\n\n"
        + _table(rows)
        + "\n"
    )
    write_results(args.output_dir, "remat", report, text)
    return report


if __name__ == "__main__":
    main()
