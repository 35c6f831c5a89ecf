"""An 8B-class decoder compiled for a TPU v5p slice by the real TPU compiler, layout by layout.

For each layout this compiles (deviceless, ``libtpu``; see ``substrax.target``) the training
step of the example's stacked decoder at Llama 3 8B's shapes, three ways:

* ``substrax``: the default path, ``substrax_flax.compile_for(factory, tx, loss_fn, batch,
  target=..., layout=...)``;
* ``flax``: Flax's own recipe for the same model (``nnx.logical_axis_rules`` with the layout's
  rules, ``jax.set_mesh``, an abstract ``nnx.Optimizer``, an ``nnx.jit`` step), the program
  its guide writes, compiled for the same slice;
* ``limit``: what the layout must move, from the plan: each parameter gathered once over the
  axes it is sharded on and its gradient reduce-scattered back once, then the gradient shard
  all-reduced once over the replica axes (ZeRO: reduce-scattered and the update gathered),
  all in float32.

It reports per chip: traffic over the data axes (the layout's parameter and gradient
collectives, against the limit) and over the tensor and pipeline axes (activations, which have
no closed form), peak memory, FLOPs, and compile time. All figures are XLA:TPU's own
(``memory_analysis``, ``cost_analysis``, collectives read off the compiled HLO).

Run: ``python benchmarks/tpu.py [--size tiny] [--target v5p-64] [--output-dir DIR]``; it writes
``tpu.json`` and ``tpu.md``. The 8B rows take about a minute of compile each on 2 cores.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compiled for the slice, run nowhere

import argparse
import contextlib
import dataclasses
import math
import pathlib
import platform
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))

import gpt
from layouts import write_results

import substrax_flax as sf
from substrax.hlo import argument_bytes, compiled_flops, peak_bytes, traffic_by_axes
from substrax.layout import Layout
from substrax.mesh import as_axes
from substrax.target import CompileTarget

SIZES = {
    "8b": dataclasses.replace(gpt.LLAMA3_8B, seq=1024),
    "tiny": gpt.Config(
        vocab=256, d_model=128, heads=4, kv_heads=4, mlp=256, layers=2, seq=32, gated=True
    ),
}
#: Layout label -> (named layout, mesh over 32 chips; scaled to the target's chips).
CASES = {
    "FSDP 32": ("fsdp", {"data": 32}),
    "FSDP 8 x DP 4": ("hsdp", {"data": 4, "model": 8}),
    "FSDP 8 x TP 4": ("fsdp+tp", {"data": 8, "model": 4}),
    "TP 4 x DP 8": ("tp", {"data": 8, "model": 4}),
    "ZeRO-1 32": ("zero1", {"data": 32}),
    "PP 4 x DP 8": ("pp", {"pipe": 4, "data": 8}),
}
MIB = 2**20


def _scaled(sizes: dict[str, int], chips: int) -> dict[str, int]:
    """The case's mesh on ``chips`` chips: the largest axis halved (or doubled) until it fits."""
    sizes = dict(sizes)
    while math.prod(sizes.values()) != chips:
        largest = max(sizes, key=sizes.get)
        if math.prod(sizes.values()) > chips:
            sizes[largest] //= 2
        else:
            sizes[largest] *= 2
    return sizes


def limit_bytes(plan, model_rows, axis_sizes: dict[str, int]) -> float:
    """The layout's parameter and gradient traffic per chip per step, in float32.

    Per parameter with ``U`` bytes per chip where used: its gather over the ``g`` chips it is
    sharded over and the gradient's reduce-scatter back, ``2 U (g - 1) / g``; then the
    gradient shard's all-reduce over the ``d`` replica chips, ``2 (U / g) (d - 1) / d``
    (ZeRO's reduce-scatter and gather of the update move the same).
    """
    total = 0.0
    by_path = {r.path: r for r in model_rows}
    for param in plan.params:
        row = by_path[param.path]
        used = row.bytes_total / _degree(param.used, axis_sizes)
        g = _degree(param.stored, axis_sizes) // _degree(param.used, axis_sizes)
        spanned = {a for e in param.stored for a in as_axes(e)}
        d = math.prod(axis_sizes[a] for a in plan.batch_axes if a not in spanned)
        total += 2 * used * (g - 1) / g + 2 * (used / g) * (d - 1) / d
    return total


def _degree(spec, axis_sizes) -> int:
    return math.prod(axis_sizes[a] for e in spec for a in as_axes(e))


def split_traffic(collectives, data_axes: set[str]) -> tuple[float, float]:
    """``(bytes over the data axes only, bytes over any other axis)`` of a collectives table."""
    data = other = 0.0
    for (_, axes), row in collectives.items():
        if axes is not None and set(axes) <= data_axes:
            data += row["bytes"]
        else:
            other += row["bytes"]
    return data, other


def _stats(compiled, axis_sizes) -> dict:
    memory = compiled.memory_analysis()
    text = compiled.as_text()
    table = traffic_by_axes(text, axis_sizes, trips=True)
    return {
        "peak_bytes": peak_bytes(memory, "tpu"),
        "temp_bytes": int(memory.temp_size_in_bytes),
        "argument_data_bytes": argument_bytes(text),
        "flops": compiled_flops(compiled, text),
        "collectives": [
            {"kind": k, "axes": list(a) if a else a, **row} for (k, a), row in table.items()
        ],
        "_table": table,
    }


def run_substrax(config, target, layout, mesh, batch, gather="keep"):
    start = time.perf_counter()

    def factory():
        return gpt.StackedGPT(config, nnx.Rngs(0))

    if layout == "pp":
        stages = sf.Stages(gpt.pipeline_embed, gpt.pipeline_block, gpt.pipeline_head,
                           stack="blocks")  # fmt: skip
        step = sf.make_train_step(stages, mesh, microbatches=4)
        report = sf.compile_for(factory, gpt.optimizer(), step, batch, target=target,
                                layout=layout, mesh=mesh)  # fmt: skip
    else:
        report = sf.compile_for(factory, gpt.optimizer(), gpt.loss_fn, batch, target=target,
                                layout=layout, mesh=mesh, gather=gather)  # fmt: skip
    return report, time.perf_counter() - start


def run_flax(config, target, layout, mesh, batch, donate=False):
    """Flax's recipe: rules in context, an abstract model and optimizer, an ``nnx.jit`` step.

    As the guide writes it, the step donates nothing; ``donate`` donates the model and
    optimizer, as substrax's step does.
    """
    start = time.perf_counter()
    named = Layout.named(layout, mesh)
    stack = contextlib.ExitStack()
    stack.enter_context(jax.set_mesh(mesh))
    stack.enter_context(nnx.logical_axis_rules(named.param_rules.to_pairs()))
    with stack:

        def create():
            model = gpt.StackedGPT(config, nnx.Rngs(0))
            return model, nnx.Optimizer(model, gpt.optimizer(), wrt=nnx.Param)

        model, optimizer = nnx.eval_shape(create)

        @nnx.jit(donate_argnums=(0, 1) if donate else ())
        def train_step(model, optimizer, batch):
            loss, grads = nnx.value_and_grad(gpt.loss_fn)(model, batch)
            optimizer.update(model, grads)
            return loss

        placed = jax.ShapeDtypeStruct(
            batch.shape, batch.dtype, sharding=NamedSharding(mesh, P(named.batch_axes))
        )
        with target.compiling():
            compiled = train_step.lower(model, optimizer, placed).compile()
    return compiled, time.perf_counter() - start


def measure(config, target, label, layout, sizes, rows, gather="keep"):
    mesh = target.make_mesh(sizes)
    batch = jax.ShapeDtypeStruct((rows, config.seq + 1), jnp.int32)
    try:
        report, seconds = run_substrax(config, target, layout, mesh, batch, gather)
    except sf.CompileRefused as error:  # the compiler's refusal (out of memory), recorded
        return {"layout": label, "strategy": layout, "mesh": sizes,
                "substrax": {"refused": str(error).splitlines()[0][:300]}}  # fmt: skip
    named = Layout.named(layout, mesh)
    data_axes = set(named.batch_axes) | set(named.fsdp_axes)
    plan = report.plan
    model_rows = sf.plan_model(lambda: gpt.StackedGPT(config, nnx.Rngs(0)), mesh,
                               layout=layout).rows  # fmt: skip
    limit = limit_bytes(plan, model_rows, sizes)
    data, other = split_traffic(report.collectives, data_axes)
    row = {
        "layout": label,
        "strategy": layout,
        "mesh": sizes,
        "path": plan.path,
        "limit_bytes": limit,
        "substrax": {
            "peak_bytes": report.step.peak,
            "temp_bytes": report.step.temporaries,
            "state_bytes": report.state_bytes,
            "argument_data_bytes": report.step.argument_data,
            "flops": report.flops,
            "data_bytes": data,
            "other_bytes": other,
            "collectives": report.to_json()["collectives"],
            "compile_s": seconds,
        },
    }
    if layout != "pp":  # Flax has no pipeline of its own
        row["flax"] = _flax_row(config, target, layout, mesh, batch, sizes, data_axes, False)
    if "peak_bytes" in row.get("flax", {}):  # donated too, where the guide's step fits
        row["flax donated"] = _flax_row(config, target, layout, mesh, batch, sizes, data_axes,
                                        True)  # fmt: skip
    return row


def _flax_row(config, target, layout, mesh, batch, sizes, data_axes, donate):
    try:
        compiled, seconds = run_flax(config, target, layout, mesh, batch, donate)
    except (ValueError, jax.errors.JaxRuntimeError) as error:  # the compiler's refusal
        return {"refused": str(error).splitlines()[0][:300]}
    stats = _stats(compiled, sizes)
    data, other = split_traffic(stats.pop("_table"), data_axes)
    return {**stats, "data_bytes": data, "other_bytes": other, "compile_s": seconds}


def _gather_words(report) -> str:
    if report.get("gather", "keep") == "keep":
        return ""
    return f'with `gather="{report["gather"]}"` '


def _mib(value):
    return (
        "-"
        if value is None
        else f"{value / MIB:,.0f}"
        if value > 100 * MIB
        else (f"{value / MIB:,.1f}")
    )


def markdown(report: dict) -> str:
    head = (
        "| layout | | data-axes traffic MiB (x limit) | tensor/pipeline traffic MiB | "
        "peak MiB (x Flax), fits | TFLOP / chip | compile s |\n" + "|---" * 7 + "|\n"
    )
    lines = []
    for row in report["rows"]:
        limit = row.get("limit_bytes")
        flax = row.get("flax")
        for name in ("substrax", "flax", "flax donated"):
            r = row.get(name)
            if r is None:
                continue
            first = row["layout"] if name == "substrax" else ""
            if "refused" in r:
                lines.append(f"| {first} | {name} | refused: {r['refused']} | | | | |")
                continue
            peak = f"{_mib(r['peak_bytes'])}"
            if name != "flax" and flax and "peak_bytes" in flax:
                peak += f" ({r['peak_bytes'] / flax['peak_bytes']:.2f})"
            peak += ", fits" if r["peak_bytes"] <= report["memory_bytes"] else ", over HBM"
            lines.append(
                f"| {first} | {name} | {_mib(r['data_bytes'])} ({r['data_bytes'] / limit:.2f}) | "
                f"{_mib(r['other_bytes'])} | {peak} | {r['flops'] / 1e12:.2f} | "
                f"{r['compile_s']:.0f} |"
            )
        if limit is not None:
            lines.append(f"| | limit | {_mib(limit)} | | | | |")
    footer = (
        f"\nCompiled {report['date']} for {report['target']} ({report['chips']} chips, "
        f"{report['memory_bytes'] / 1e9:.0f} GB of HBM each) by "
        f"XLA:TPU (libtpu {report['libtpu']}, jax {report['jax']}, flax {report['flax']}) on "
        f"{report['cpus']} CPU cores, no TPU; model {report['params']:,} parameters (Llama 3 "
        f"8B's shapes, stacked, SwiGLU, grouped-query attention), batch {report['batch_rows']} x "
        f"{report['config']['seq']} tokens, float32 parameters, adamw, no remat. substrax: "
        "the default step, `compile_for(factory, tx, loss_fn, batch, target=..., layout=...)`"
        f" {_gather_words(report)}(PP: ZB-H1, 4 microbatches); flax: the same model under "
        "Flax's recipe, whose step donates nothing, as the guide writes it (flax donated: the"
        " same step donating the model and optimizer, as substrax's does, where the guide's "
        "fits). Data-axes traffic is every collective over the data and FSDP axes alone; the "
        "limit is float32 (each parameter gathered once, its gradient reduce-scattered once, "
        "the shard all-reduced over the replicas). The peak is what XLA:TPU allocates, its "
        "heap peak (`substrax.hlo.peak_bytes`). A refusal is the compiler's own; it counts "
        "95.74G of HBM, so a peak it accepts may exceed the chip's 95 GB: `over HBM`.\n"
    )
    return head + "\n".join(lines) + "\n" + footer


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="8b")
    parser.add_argument("--target", default="v5p-64")
    parser.add_argument("--rows", type=int, default=0, help="global batch rows (0: 1 per chip)")
    parser.add_argument("--layouts", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument(
        "--gather",
        choices=("keep", "regather"),
        default="keep",
        help="substrax's gather= (the default keeps the forward's gathers)",
    )
    parser.add_argument("--output-dir", type=pathlib.Path, default=pathlib.Path("benchmarks"))
    args = parser.parse_args(argv)
    config, target = SIZES[args.size], CompileTarget.parse(args.target)
    rows_per_step = args.rows or target.chips
    rows = []
    for label in args.layouts:
        layout, sizes = CASES[label]
        sizes = _scaled(sizes, target.chips)
        print(f"compiling {label} on {sizes} ...", flush=True)
        rows.append(measure(config, target, label, layout, sizes, rows_per_step, args.gather))
    import flax
    import libtpu

    report = {
        "date": time.strftime("%Y-%m-%d"),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "target": target.name,
        "chips": target.chips,
        "memory_bytes": target.memory_bytes,
        "jax": jax.__version__,
        "flax": flax.__version__,
        "libtpu": getattr(libtpu, "__version__", "0.0.42"),
        "config": dataclasses.asdict(config),
        "params": sum(
            math.prod(r.shape)
            for r in sf.plan_model(lambda: gpt.StackedGPT(config, nnx.Rngs(0))).rows
        ),
        "batch_rows": rows_per_step,
        "gather": args.gather,
        "rows": rows,
    }
    write_results(args.output_dir, "tpu", report, markdown(report))
    return report


if __name__ == "__main__":
    main()
