"""Expert parallelism on the example decoder with mixture-of-experts MLPs.

* **Parameters**: the expert weights' bytes per device under ``fsdp`` over 8 (experts split on
  ``embed`` only), ``fsdp+ep`` on ``data=2, expert=4`` and ``ep`` on ``data=1, expert=8``,
  against the ideal (all expert bytes / devices holding distinct experts).
* **Traffic**: the forward pass of the model under each layout, its parameters gathered first
  as the train step gathers them, compiled; its ``all-to-all`` ops (two per layer: dispatch
  and combine) and their bytes per device against the theory,
  2 x experts x capacity x features x 4 bytes x (ep - 1) / ep per layer.
* **Routing**: on one batch of the example's data through the first layer's router, the share
  of tokens each expert gets and the share of choices dropped, for capacity factors 0.5 to 2
  and no-drop (``--plot`` draws both).

Run: ``python benchmarks/experts.py [--plot FILE] [--output-dir DIR]``; writes
``experts.json`` and ``experts.md``.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)

import argparse
import dataclasses
import math
import pathlib
import time

import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from layouts import MIB, gpt, write_results  # puts examples/ on the path

import substrax_flax as sf
from substrax.hlo import traffic_by_kind
from substrax.layout import Layout
from substrax.spmd import expert_capacity, experts, use_rules

CONFIG = gpt.Config(vocab=256, d_model=128, heads=4, mlp=256, layers=2, seq=64, moe_experts=8)
BATCH = 16
CASES = {
    "FSDP 8": ("fsdp", {"data": 8}),
    "FSDP 2 x EP 4": ("fsdp+ep", {"data": 2, "expert": 4}),
    "EP 8": ("ep", {"data": 1, "expert": 8}),
}
FACTORS = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0, None)


def layout_row(label: str, name: str, shape: dict) -> dict:
    """Expert bytes per device and the forward's all-to-all traffic under one layout."""
    layout = Layout.named(name, shape)
    factory = lambda: gpt.GPT(CONFIG, nnx.Rngs(0))  # noqa: E731
    model = sf.create_sharded_model(factory, layout=layout)
    report = sf.sharding_report(model)
    expert_rows = [r for r in report.rows if r.path.endswith(("w_in", "w_out"))]
    per_device = sum(r.bytes_per_device for r in expert_rows)
    total = sum(math.prod(r.shape) * 4 for r in expert_rows)
    mesh = layout.make_mesh()
    tokens = gpt.batch_at(0, BATCH, CONFIG.seq, 0)[:, :-1]
    tokens = jax.device_put(tokens, NamedSharding(mesh, P(layout.batch_axes)))
    used = sf.plan_model(factory, layout=layout).compute_shardings(nnx.state(model, nnx.Param))

    def forward(model, tokens):  # parameters gathered first, as the train step does
        nnx.update(model, jax.lax.with_sharding_constraint(nnx.state(model, nnx.Param), used))
        return model(tokens)

    with use_rules(mesh, layout.compute_rules):
        forward = jax.jit(forward)
        traffic = traffic_by_kind(forward.lower(model, tokens).compile().as_text(), 8)
    local = BATCH * CONFIG.seq // layout.devices
    capacity = expert_capacity(local, CONFIG.moe_experts, 2, CONFIG.capacity_factor)
    slots = CONFIG.moe_experts * capacity * CONFIG.d_model * 4
    return {
        "layout": label, "ep": layout.ep, "expert_bytes_per_device": per_device,
        "expert_bytes": total, "ideal_bytes_per_device": total / layout.devices,
        "all_to_all": traffic["all-to-all"],
        "all_to_all_theory": 2 * CONFIG.layers * slots * (layout.ep - 1) / layout.ep,
    }  # fmt: skip


def routing(factors=FACTORS) -> list[dict]:
    """Tokens per expert and the dropped share through the first layer's router."""
    with nnx.use_eager_sharding(False):  # one device, no mesh
        model = gpt.GPT(CONFIG, nnx.Rngs(0))
    tokens = gpt.batch_at(0, BATCH, CONFIG.seq, 0)[:, :-1]
    block = model.blocks[0]
    x = gpt._rms_norm(model.embedding[...][tokens], block.mlp_norm[...])
    moe = block.moe
    rows = []
    for factor in factors:
        _, stats = experts(x, moe.router[...], moe.w_in[...], moe.w_out[...],
                           capacity_factor=factor)  # fmt: skip
        rows.append({"capacity_factor": factor, "dropped": float(stats.dropped),
                     "load": np.asarray(stats.load).tolist()})  # fmt: skip
    return rows


def _table(layouts: list[dict], routes: list[dict]) -> str:
    lines = [
        "| layout | expert params MiB / device (of all) | share | ideal | all-to-all ops | "
        "all-to-all MiB / device (forward) | theory MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in layouts:
        moved = row["all_to_all"]
        lines.append(
            f"| {row['layout']} | {row['expert_bytes_per_device'] / MIB:.2f} "
            f"({row['expert_bytes'] / MIB:.2f}) | "
            f"1/{row['expert_bytes'] / row['expert_bytes_per_device']:.0f} | "
            f"{row['ideal_bytes_per_device'] / MIB:.2f} | {moved['count']} | "
            f"{moved['bytes'] / MIB:.3f} | {row['all_to_all_theory'] / MIB:.3f} |"
        )
    lines += [
        "",
        "| capacity factor | dropped share | tokens per expert (share) |",
        "|---|---|---|",
    ]
    for row in routes:
        factor = "no drop" if row["capacity_factor"] is None else row["capacity_factor"]
        load = " ".join(f"{share:.3f}" for share in row["load"])
        lines.append(f"| {factor} | {row['dropped']:.3f} | {load} |")
    return "\n".join(lines)


def plot(routes: list[dict], path: pathlib.Path) -> None:
    """Tokens per expert, and the dropped share against the capacity factor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    load = routes[-1]["load"]
    left.bar(range(len(load)), load)
    left.axhline(1 / len(load), color="gray", linestyle="--", label="even")
    left.set(xlabel="expert", ylabel="share of choices", title="Tokens per expert (top 2)")
    left.legend()
    capped = [r for r in routes if r["capacity_factor"] is not None]
    right.plot([r["capacity_factor"] for r in capped], [r["dropped"] for r in capped], "o-")
    right.set(xlabel="capacity factor", ylabel="dropped share of choices",
              title="Dropped choices vs capacity")  # fmt: skip
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", type=pathlib.Path, default=None, help="write a PNG here")
    parser.add_argument("--output-dir", type=pathlib.Path, default=pathlib.Path("benchmarks"))
    args = parser.parse_args(argv)
    layouts = [layout_row(label, *case) for label, case in CASES.items()]
    routes = routing()
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "jax": jax.__version__,
        "config": dataclasses.asdict(CONFIG),
        "batch_size": BATCH,
        "layouts": layouts,
        "routing": routes,
    }
    text = (
        f"# Expert parallelism: {jax.device_count()} {jax.devices()[0].platform} devices\n\n"
        f"The example decoder with mixture-of-experts MLPs ({CONFIG}), batch {BATCH}, measured "
        f"{report['date']} with jax {jax.__version__} (`python benchmarks/experts.py`). Routing: "
        "the first layer's router at initialisation on one batch of the example's data.\n\n"
        + _table(layouts, routes)
        + "\n"
    )
    write_results(args.output_dir, "experts", report, text)
    if args.plot is not None:
        plot(routes, args.plot)
    return report


if __name__ == "__main__":
    main()
