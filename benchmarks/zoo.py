"""The zoo: models written the way people write them, under substrax's named layouts.

For every gallery model (``examples/gallery.py``) and layout (fsdp, fsdp+tp on a 2 x 4 mesh of
8 simulated devices) this measures, through the default path (``create_sharded_model(factory,
layout=...)``, ``create_sharded_optimizer``, ``make_train_step``):

* parameters + optimizer state per device over the ideal (total / the mesh's devices);
* the share of bytes left fully replicated;
* the compiled step's collective traffic per device (``substrax.hlo``).

And for the unannotated real-size shapes (``examples/real_shapes.py``: Qwen3-0.6B-like,
Gemma3-1B-like, ResNet-50, ViT-B/16), planned abstractly under the fsdp layout on 8 and 64
devices: bytes per device over the ideal, next to the reference FSDP strategy's (first
dimension, at least 1024).

Run: ``python benchmarks/zoo.py [--output-dir DIR]``; it writes ``zoo.json`` and ``zoo.md``.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)

import argparse
import json
import pathlib
import time
import warnings

import optax
from flax import nnx
from jax.sharding import AbstractMesh, AxisType

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))

import gallery
import real_shapes

import substrax_flax as sf
from substrax import ShardingWarning
from substrax.hlo import traffic_by_kind
from substrax.layout import Layout
from substrax.mesh import FSDPStrategy

MESH = {"data": 2, "model": 4}
LAYOUTS = ("fsdp", "fsdp+tp")
KIB = 2**10


def measure_gallery(name: str, layout_name: str) -> dict:
    entry = gallery.GALLERY[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardingWarning)
        model = sf.create_sharded_model(entry.factory, layout=Layout.named(layout_name, MESH))
    optimizer = sf.create_sharded_optimizer(model, optax.adamw(1e-3))
    step = sf.make_train_step(entry.loss)
    compiled = step.lower(model, optimizer, entry.batch(0)).compile()
    traffic = traffic_by_kind(compiled.as_text(), 8)
    model_report, opt_report = sf.sharding_report(model), sf.sharding_report(optimizer)
    total = model_report.bytes_total + opt_report.bytes_total
    per_device = model_report.bytes_per_device + opt_report.bytes_per_device
    replicated = model_report.replicated_bytes + opt_report.replicated_bytes
    return {
        "model": name,
        "layout": layout_name,
        "bytes_total": total,
        "bytes_per_device": per_device,
        "ratio_to_ideal": per_device / (total / 8),
        "replicated_share": replicated / total,
        "traffic_bytes": sum(kind["bytes"] for kind in traffic.values()),
        "loss": float(step(model, optimizer, entry.batch(0))["loss"]),
    }


def measure_real(name: str, devices: int) -> dict:
    mesh = AbstractMesh((devices,), ("data",), axis_types=(AxisType.Auto,))
    factory = real_shapes.REAL[name][0]

    def ratio(**how):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ShardingWarning)
            plan = sf.plan_model(lambda: factory(nnx.Rngs(0)), mesh, **how)
        return sf.sharding_report(plan)

    layout = ratio(layout=Layout.named("fsdp", {"data": devices}))
    first = ratio(rules=[("data", "data")], strategy=FSDPStrategy("data", 0))
    return {
        "model": name,
        "devices": devices,
        "params_bytes": layout.bytes_total,
        "ratio_to_ideal": layout.ratio_to_ideal,
        "reference_fsdp_ratio": first.ratio_to_ideal,
        "target": real_shapes.REAL[name][1],
    }


def markdown(report: dict) -> str:
    lines = [
        "| model | layout | params+opt KiB / device (x ideal) | replicated share | "
        "step traffic KiB / device | first loss |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["gallery"]:
        lines.append(
            f"| {r['model']} | {r['layout']} | {r['bytes_per_device'] / KIB:.1f} "
            f"({r['ratio_to_ideal']:.2f}) | {r['replicated_share']:.0%} | "
            f"{r['traffic_bytes'] / KIB:.1f} | {r['loss']:.4f} |"
        )
    lines += [
        "",
        "| unannotated model | devices | params MiB | fsdp layout (x ideal) | target | "
        "reference FSDPStrategy (x ideal) |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["real"]:
        lines.append(
            f"| {r['model']} | {r['devices']} | {r['params_bytes'] / 2**20:.0f} | "
            f"{r['ratio_to_ideal']:.3f} | <= {r['target']} | {r['reference_fsdp_ratio']:.2f} |"
        )
    lines.append(
        f"\nMeasured {report['date']} on {os.cpu_count()} CPU cores, 8 simulated devices (a "
        f"2 x 4 mesh) for the gallery, abstract meshes for the real-size shapes; jax "
        f"{report['jax']}. Ideal: total bytes over the mesh's devices. The gallery's widths "
        "are tiny, so some dimensions do not divide 8 and stay replicated (their share shows)."
    )
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=pathlib.Path, default=pathlib.Path("benchmarks"))
    parser.add_argument("--models", nargs="*", default=sorted(gallery.GALLERY))
    args = parser.parse_args(argv)
    rows = []
    for name in args.models:
        for layout_name in LAYOUTS:
            print(f"measuring {name} under {layout_name} ...", flush=True)
            rows.append(measure_gallery(name, layout_name))
    real = [measure_real(name, n) for name in real_shapes.REAL for n in (8, 64)]
    report = {"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "gallery": rows,
              "real": real}  # fmt: skip
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "zoo.json").write_text(json.dumps(report, indent=2))
    table = markdown(report)
    (args.output_dir / "zoo.md").write_text(table)
    print(table)
    return report


if __name__ == "__main__":
    main()
