"""Mixtures of experts: what dispatch costs, and expert parallelism on the example decoder.

* **Dispatch against expert count** (8 to 256 experts, top 8, 4096 tokens, width 256, expert
  hidden 128): one mixture-of-experts layer's step (forward and backward) compiled on one
  device, its temporaries (``memory_analysis``) and matrix FLOPs (``substrax.hlo.dot_flops``)
  for sorted dispatch, one-hot dispatch (capacity factor 1.25) and the active dense compute
  (every routed row through one expert-sized MLP, as if routing cost nothing); and under
  ``fsdp 2 x ep 4`` (width 64) the forward all-to-all bytes per device: one-hot's from the
  compiled program, sorted's from its rounds (``ExpertStats.moved``) beside the rows routed
  to other devices (``ExpertStats.sent``).
* **Parameters**: the expert weights' bytes per device under ``fsdp`` over 8 (experts split on
  ``embed`` only), ``fsdp+ep`` on ``data=2, expert=4`` and ``ep`` on ``data=1, expert=8``,
  against the ideal (all expert bytes / devices holding distinct experts).
* **Traffic** (one-hot dispatch, capacity factor 1.25): the forward pass of the model under
  each layout, its parameters gathered first as the train step gathers them, compiled; its
  ``all-to-all`` ops (two per layer: dispatch and combine) and their bytes per device against
  the theory,
  2 x experts x capacity x features x 4 bytes x (ep - 1) / ep per layer.
* **Routing**: on one batch of the example's data through the first layer's router, the share
  of tokens each expert gets and the share of choices dropped, for capacity factors 0.5 to 2
  and no-drop (``--plot`` draws both).

Run: ``python benchmarks/experts.py [--plot FILE] [--routing-plot FILE] [--output-dir DIR]``;
writes ``experts.json`` and ``experts.md``.
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

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from layouts import MIB, gpt, write_results  # puts examples/ on the path

import substrax_flax as sf
from substrax.hlo import dot_flops, traffic_by_kind
from substrax.layout import Layout
from substrax.spmd import expert_capacity, experts, use_rules

CONFIG = gpt.Config(vocab=256, d_model=128, heads=4, mlp=256, layers=2, seq=64, moe_experts=8,
                    capacity_factor=1.25)  # fmt: skip
EXPERT_COUNTS = (8, 16, 32, 64, 128, 256)
DISPATCH = {"top_k": 8, "tokens": 4096, "features": 256, "hidden": 128}
EXCHANGE_FEATURES = 64
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


def _arrays(count, tokens, features, hidden, key=0):
    keys = jax.random.split(jax.random.key(key), 4)
    x = jax.random.normal(keys[0], (1, tokens, features))
    router = 0.1 * jax.random.normal(keys[1], (features, count))
    w_in = jax.random.normal(keys[2], (count, features, hidden)) / features**0.5
    w_out = jax.random.normal(keys[3], (count, hidden, features)) / hidden**0.5
    return x, router, w_in, w_out


def dispatch_cost(dispatch: str, count: int, *, top_k: int, tokens: int, features: int,
                  hidden: int) -> dict:  # fmt: skip
    """One layer's step on one device, compiled: temporaries (bytes) and matrix FLOPs.

    ``dispatch`` is ``"sorted"``, ``"one-hot"`` (capacity factor 1.25) or ``"active"``: every
    routed row (``tokens x top_k``) through one expert-sized MLP, the work routing selects.
    """
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype)
              for a in _arrays(count, tokens, features, hidden)]  # fmt: skip
    if dispatch == "active":
        shapes[2] = jax.ShapeDtypeStruct((features, hidden), jnp.float32)
        shapes[3] = jax.ShapeDtypeStruct((hidden, features), jnp.float32)

        def loss(x, router, w_in, w_out):
            rows = jnp.repeat(x.reshape(tokens, features), top_k, axis=0)
            y = jax.nn.gelu(rows @ w_in) @ w_out
            return jnp.sum(y.reshape(tokens, top_k, features).sum(1) ** 2)
    else:
        factor = 1.25 if dispatch == "one-hot" else None

        def loss(x, router, w_in, w_out):
            y, stats = experts(x, router, w_in, w_out, top_k=top_k, dispatch=dispatch,
                               capacity_factor=factor)  # fmt: skip
            return jnp.sum(y**2) + stats.aux_loss

    compiled = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3))).lower(*shapes).compile()
    return {
        "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
        "flops": dot_flops(compiled.as_text()),
    }


def exchange_bytes(dispatch: str, count: int, *, top_k: int, tokens: int,
                   features: int = EXCHANGE_FEATURES) -> dict:  # fmt: skip
    """The forward all-to-all bytes per device of one layer under ``fsdp 2 x ep 4``.

    One-hot: the compiled program's (two ops of ``experts x capacity x features``). Sorted:
    its rounds' (``ExpertStats.moved``, rows there and back) and the rows routed to other
    devices (``ExpertStats.sent``), float32 rows of ``features``, per device. The router's
    columns have one norm, so every expert is as likely (a balanced router: an uneven one
    pads every pair of devices to the busiest pair's rows).
    """
    layout = Layout.named("fsdp+ep", {"data": 2, "expert": 4})
    mesh = layout.make_mesh()
    _, router, w_in, w_out = _arrays(count, 1, features, features)
    router = router / jnp.linalg.norm(router, axis=0)  # every expert equally likely
    x = jax.random.normal(jax.random.key(1), (8, tokens, features))
    factor = 1.25 if dispatch == "one-hot" else None

    def forward(x, router, w_in, w_out):
        return experts(x, router, w_in, w_out, top_k=top_k, dispatch=dispatch,
                       capacity_factor=factor)  # fmt: skip

    with use_rules(mesh, layout.compute_rules):
        args = (jax.device_put(x, NamedSharding(mesh, P(layout.batch_axes))), router, w_in,
                w_out)  # fmt: skip
        lowered = jax.jit(forward).lower(*args)
        if dispatch == "one-hot":
            moved = traffic_by_kind(lowered.compile().as_text(), 8)["all-to-all"]["bytes"]
            return {"bytes": moved, "sent_bytes": None}
        _, stats = lowered.compile()(*args)
    row = features * 4 / 8  # bytes per row, per device
    return {"bytes": 2 * float(stats.moved) * row, "sent_bytes": 2 * float(stats.sent) * row}


def dispatch_sweep(counts=EXPERT_COUNTS, sizes=None) -> list[dict]:
    """Temporaries, FLOPs and all-to-all bytes against the expert count, per dispatch."""
    sizes = dict(DISPATCH, **(sizes or {}))
    active = dispatch_cost("active", counts[0], **sizes)
    rows = []
    for count in counts:
        row = {"experts": count, "active": active}
        for dispatch in ("sorted", "one-hot"):
            row[dispatch] = dispatch_cost(dispatch, count, **sizes)
            row[dispatch].update(exchange_bytes(dispatch, count, top_k=sizes["top_k"],
                                                tokens=sizes["tokens"]))  # fmt: skip
        rows.append(row)
    return rows


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
        route = jax.jit(lambda x, *weights, factor=factor: experts(
            x, *weights, dispatch="one-hot", capacity_factor=factor)[1])  # fmt: skip
        stats = route(x, moe.router[...], moe.w_in[...], moe.w_out[...])
        rows.append({"capacity_factor": factor, "dropped": float(stats.dropped),
                     "load": np.asarray(stats.load).tolist()})  # fmt: skip
    return rows


def _sweep_table(sweep: list[dict]) -> str:
    active = sweep[0]["active"]
    lines = [
        f"Active dense compute: {active['temp_bytes'] / MIB:.1f} MiB temp, "
        f"{active['flops'] / 1e9:.2f} GFLOP.",
        "",
        "| experts | sorted temp MiB (x active) | sorted GFLOP (x active) | one-hot temp MiB "
        "(x active) | one-hot GFLOP (x active) | sorted all-to-all MiB / device (rows sent) "
        "| one-hot all-to-all MiB / device |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in sweep:
        cells = [str(row["experts"])]
        for dispatch in ("sorted", "one-hot"):
            cost = row[dispatch]
            cells.append(f"{cost['temp_bytes'] / MIB:.1f} "
                         f"({cost['temp_bytes'] / active['temp_bytes']:.2f}x)")  # fmt: skip
            cells.append(f"{cost['flops'] / 1e9:.2f} ({cost['flops'] / active['flops']:.2f}x)")
        sorted_, one_hot = row["sorted"], row["one-hot"]
        cells.append(f"{sorted_['bytes'] / MIB:.2f} ({sorted_['sent_bytes'] / MIB:.2f})")
        cells.append(f"{one_hot['bytes'] / MIB:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


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


def plot_sweep(sweep: list[dict], path: pathlib.Path) -> None:
    """Temporaries, FLOPs and all-to-all bytes against the expert count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = [row["experts"] for row in sweep]
    figure, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    panels = (("temp_bytes", MIB, "step temp MiB"), ("flops", 1e9, "step GFLOP"),
              ("bytes", MIB, "forward all-to-all MiB / device"))  # fmt: skip
    for axis, (key, unit, label) in zip(axes, panels, strict=True):
        for dispatch, style in (("sorted", "o-"), ("one-hot", "s--")):
            axis.plot(counts, [row[dispatch][key] / unit for row in sweep], style, label=dispatch)
        if key != "bytes":
            axis.axhline(sweep[0]["active"][key] / unit, color="gray", linestyle=":",
                         label="active dense")  # fmt: skip
        else:
            axis.plot(counts, [row["sorted"]["sent_bytes"] / unit for row in sweep], ":",
                      color="gray", label="rows sent")  # fmt: skip
        axis.set(xscale="log", yscale="linear" if key == "bytes" else "log", xlabel="experts",
                 ylabel=label)  # fmt: skip
        if key == "bytes":
            axis.set_ylim(bottom=0)
        axis.set_xticks(counts, [str(c) for c in counts])
        axis.legend()
    figure.suptitle(
        f"One MoE layer, top {DISPATCH['top_k']}, {DISPATCH['tokens']} tokens per device"
    )
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


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
    parser.add_argument("--plot", type=pathlib.Path, default=None,
                        help="write the dispatch sweep's PNG here")  # fmt: skip
    parser.add_argument("--routing-plot", type=pathlib.Path, default=None,
                        help="write the routing's PNG here")  # fmt: skip
    parser.add_argument("--output-dir", type=pathlib.Path, default=pathlib.Path("benchmarks"))
    parser.add_argument("--experts", type=int, nargs="+", default=list(EXPERT_COUNTS),
                        help="the expert counts of the sweep")  # fmt: skip
    parser.add_argument("--tokens", type=int, default=DISPATCH["tokens"],
                        help="tokens per device in the sweep")  # fmt: skip
    parser.add_argument("--sweep-only", action="store_true",
                        help="leave out the example decoder's layouts and routing")  # fmt: skip
    args = parser.parse_args(argv)
    sweep = dispatch_sweep(tuple(args.experts), {"tokens": args.tokens})
    layouts = [] if args.sweep_only else [layout_row(k, *c) for k, c in CASES.items()]
    routes = [] if args.sweep_only else routing()
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "jax": jax.__version__,
        "dispatch": dict(DISPATCH, tokens=args.tokens, exchange_features=EXCHANGE_FEATURES),
        "sweep": sweep,
        "config": dataclasses.asdict(CONFIG),
        "batch_size": BATCH,
        "layouts": layouts,
        "routing": routes,
    }
    text = (
        f"# Mixtures of experts: {jax.device_count()} {jax.devices()[0].platform} devices\n\n"
        f"Measured {report['date']} with jax {jax.__version__} (`python "
        "benchmarks/experts.py`).\n\n"
        f"## Dispatch against expert count\n\nOne layer, top {DISPATCH['top_k']}, "
        f"{args.tokens} tokens, width {DISPATCH['features']}, expert hidden "
        f"{DISPATCH['hidden']}: the step on one device; the all-to-all bytes under fsdp 2 x ep "
        f"4 at width {EXCHANGE_FEATURES}, {args.tokens} tokens per device.\n\n"
        + _sweep_table(sweep)
        + f"\n\n## Expert parallelism on the example decoder\n\n{CONFIG}, batch {BATCH}, "
        "one-hot dispatch. Routing: the first layer's router at initialisation on one batch "
        "of the example's data.\n\n" + _table(layouts, routes) + "\n"
    )
    write_results(args.output_dir, "experts", report, text)
    if args.plot is not None:
        plot_sweep(sweep, args.plot)
    if args.routing_plot is not None:
        plot(routes, args.routing_plot)
    return report


if __name__ == "__main__":
    main()
