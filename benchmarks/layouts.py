"""substrax side by side with Flax's own recipe, for each layout of the example decoder.

For every layout (DP, FSDP over all 8, FSDP on 4 x DP on 2, TP on 4 x DP on 2, FSDP + TP, ZeRO-1
and ZeRO-2 over 8; Flax's recipe for a ZeRO layout is its data-parallel one) this
measures, for substrax and for Flax's "Scale up on multiple devices" recipe (annotations,
``nnx.logical_axis_rules``, an ``nnx.jit`` init under ``jax.set_mesh``, ``nnx.Optimizer``, an
``nnx.jit`` step):

* bytes per device of params + optimizer state, and the ratio to the ideal;
* the compiled init's temp and output bytes per device, and full-size parameter buffers in it;
* the compiled step's collectives by kind (count, bytes per device), next to theory;
* the compiled step's temp bytes, its peak (arguments + outputs - donated aliases + temp) and
  FLOPs per device (a donated step reuses its inputs for its outputs, so XLA needs temp
  buffers where an undonated one writes fresh outputs: compare peaks, not temps);
* median step time over interleaved runs, time to first step, and the losses of both.

Run: ``python benchmarks/layouts.py [--size tiny] [--steps 10] [--output-dir DIR]``.
It writes ``layouts.json`` and ``layouts.md`` into the output directory.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)

import argparse
import dataclasses
import json
import math
import pathlib
import platform
import statistics
import time

import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))

import gpt
from allocator import timed

import substrax_flax as sf
from substrax.hlo import KINDS, peak_bytes, traffic_by_kind
from substrax.layout import Layout
from substrax.mesh import DeviceMeshManager

SIZES = {
    "full": gpt.Config(),
    "tiny": gpt.Config(vocab=256, d_model=64, heads=4, mlp=128, layers=2, seq=16),
}
#: Layout label -> (named layout, mesh shape).
CASES = {
    "DP 8": ("dp", {"data": 8}),
    "FSDP 8": ("fsdp", {"data": 8}),
    "FSDP 4 x DP 2": ("hsdp", {"data": 2, "model": 4}),
    "TP 4 x DP 2": ("tp", {"data": 2, "model": 4}),
    "FSDP 2 + TP 4": ("fsdp+tp", {"data": 2, "model": 4}),
    "ZeRO-1 8": ("zero1", {"data": 8}),
    "ZeRO-2 8": ("zero2", {"data": 8}),
}
MIB = 2**20


_HLO_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64"}


def _hlo_shape(dtype: str, shape) -> str:
    return f"{_HLO_DTYPES.get(dtype, dtype)}[{','.join(map(str, shape))}]"


def full_buffers(hlo: str, rows, mesh) -> list[str]:
    """Sharded parameters whose global shape, in their dtype, appears in compiled HLO text.

    A global shape that equals some parameter's shard shape is not counted: it legitimately
    appears as that shard (the check cannot tell the two apart).
    """
    shards = {
        _hlo_shape(row.dtype, NamedSharding(mesh, row.spec).shard_shape(row.shape)) for row in rows
    }
    return [
        row.path
        for row in rows
        if any(entry is not None for entry in row.spec)
        and _hlo_shape(row.dtype, row.shape) not in shards
        and _hlo_shape(row.dtype, row.shape) in hlo
    ]


def theory_bytes(
    layout: str, param_bytes: int, mesh_shape: dict, *, manual: bool = False
) -> float | None:
    """Ring-algorithm traffic per device of a layout's parameter/gradient collectives.

    DP: one gradient all-reduce. FSDP: with ``manual`` (the manual data-parallel step) one
    parameter all-gather and one gradient reduce-scatter; without (XLA's partitioning) the
    gradient all-reduce counts as two passes. FSDP on ``model`` x DP on ``data``: the same
    over ``model``, plus an all-reduce of the gradient shards over ``data``. TP layouts move
    activations, whose volume depends on the model: no closed form is given for them.
    """
    n = math.prod(mesh_shape.values())
    passes = 2 if manual else 3  # full-size parameter or gradient passes over the FSDP axes
    if layout in ("dp", "zero1", "zero2"):  # ZeRO: a reduce-scatter and an all-gather
        return 2 * param_bytes * (n - 1) / n
    if layout == "fsdp":
        return passes * param_bytes * (n - 1) / n
    if layout == "hsdp":
        fsdp, dp = mesh_shape["model"], mesh_shape["data"]
        return passes * param_bytes * (fsdp - 1) / fsdp + 2 * (param_bytes / fsdp) * (dp - 1) / dp
    return None


#: Layouts also measured with ``data_parallel="xla"``, next to the default (manual) step.
WITH_XLA = ("dp", "fsdp", "hsdp", "fsdp+tp")


def compiled_stats(compiled, num_devices: int) -> dict:
    """Temp and peak bytes, FLOPs and collectives per device of a compiled step."""
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    traffic = traffic_by_kind(compiled.as_text(), num_devices)
    peak = peak_bytes(memory, jax.devices()[0].platform)
    return {
        "temp_bytes": int(memory.temp_size_in_bytes),
        "peak_bytes": int(peak),
        "flops": float(cost.get("flops", 0.0)),
        "collectives": traffic,
        "traffic_bytes": sum(kind["bytes"] for kind in traffic.values()),
    }


def _state_bytes(model, optimizer) -> dict:
    model_report, opt_report = sf.sharding_report(model), sf.sharding_report(optimizer)
    total = model_report.bytes_total + opt_report.bytes_total
    per_device = model_report.bytes_per_device + opt_report.bytes_per_device
    sharded_over = max(model_report.devices_sharded_over, opt_report.devices_sharded_over)
    return {
        "bytes_per_device": per_device,
        "ideal_bytes_per_device": total / sharded_over,
        "ratio_to_ideal": per_device / (total / sharded_over),
    }


class Substrax:
    """The layout through substrax's default path: the named layout, nothing else.

    ``plan_model(factory, mesh, layout=name)``, ``create_sharded_optimizer(model, tx)`` and
    ``make_train_step(loss_fn)``: no rules, no compute rules written by hand.
    """

    name = "substrax"

    def __init__(self, config, mesh, layout):
        start = time.perf_counter()
        self.plan = sf.plan_model(lambda: gpt.GPT(config, nnx.Rngs(0)), mesh, layout=layout)
        self.init_compiled = self.plan.compile_init()
        self.model = self.plan.create()
        self.optimizer = sf.create_sharded_optimizer(self.model, gpt.optimizer())
        self.step_fn = sf.make_train_step(gpt.loss_fn)
        self.data_sharding = NamedSharding(mesh, P(self.plan.batch_axes))
        self.start = start

    def lower_step(self, batch):
        return self.step_fn.lower(self.model, self.optimizer, batch)

    def step(self, batch):
        return self.step_fn(self.model, self.optimizer, batch)["loss"]


class SubstraxXla(Substrax):
    """The default path with XLA partitioning the step: ``data_parallel="xla"``."""

    name = "substrax xla"

    def __init__(self, config, mesh, layout):
        super().__init__(config, mesh, layout)
        self.step_fn = sf.make_train_step(gpt.loss_fn, data_parallel="xla")


class FlaxRecipe:
    """The same layout written as Flax's guide shows, from its documented API.

    As the guide writes it, the step donates nothing; ``donate`` donates the model and the
    optimizer, as substrax's step does.
    """

    name = "flax"

    def __init__(self, config, mesh, layout, donate=False):
        start = time.perf_counter()
        named = Layout.named(layout, mesh)
        self.mesh, self.pairs = mesh, named.param_rules.to_pairs()
        with self._context():
            self.init_compiled = (
                jax.jit(lambda: nnx.state(gpt.GPT(config, nnx.Rngs(0)))).lower().compile()
            )
            self.model = nnx.jit(lambda: gpt.GPT(config, nnx.Rngs(0)))()
            self.optimizer = nnx.Optimizer(self.model, gpt.optimizer(), wrt=nnx.Param)

        @nnx.jit(donate_argnums=(0, 1) if donate else ())
        def train_step(model, optimizer, batch):
            loss, grads = nnx.value_and_grad(gpt.loss_fn)(model, batch)
            optimizer.update(model, grads)
            return loss

        self.train_step = train_step
        self.data_sharding = NamedSharding(mesh, P(named.batch_axes))
        self.start = start

    def _context(self):
        import contextlib

        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self.mesh))
        stack.enter_context(nnx.logical_axis_rules(self.pairs))
        return stack

    def lower_step(self, batch):
        with self._context():
            return self.train_step.lower(self.model, self.optimizer, batch)

    def step(self, batch):
        with self._context():
            return self.train_step(self.model, self.optimizer, batch)


def _shardings(runner) -> list:
    """The specs of every model and optimizer array, normalised (P() == P(None, None))."""
    arrays = jax.tree.leaves((nnx.state(runner.model), nnx.state(runner.optimizer)))
    return [tuple(a.sharding.spec) + (None,) * (a.ndim - len(a.sharding.spec)) for a in arrays]


def measure(config, label, layout, mesh_shape, steps, batch_size, with_xla=True):
    """The layout's default step, Flax's recipe and (``with_xla``, layouts in
    :data:`WITH_XLA`) the step with ``data_parallel="xla"``, timed interleaved."""
    mesh = DeviceMeshManager.create_device_mesh(mesh_shape)
    n = mesh.devices.size
    results, losses, times, faults_per_step = {}, {}, {}, {}
    runners = []
    xla = with_xla and layout in WITH_XLA
    classes = (Substrax, SubstraxXla, FlaxRecipe) if xla else (Substrax, FlaxRecipe)
    for cls in classes:
        runner = cls(config, mesh, layout)
        batch = jax.device_put(gpt.batch_at(0, batch_size, config.seq), runner.data_sharding)
        compiled = runner.lower_step(batch).compile()
        loss = runner.step(batch)
        jax.block_until_ready(loss)
        first_step = time.perf_counter() - runner.start
        init_memory = runner.init_compiled.memory_analysis()
        results[runner.name] = {
            **_state_bytes(runner.model, runner.optimizer),
            "init_temp_bytes": int(init_memory.temp_size_in_bytes),
            "init_output_bytes": int(init_memory.output_size_in_bytes),
            **compiled_stats(compiled, n),
            "time_to_first_step_s": first_step,
        }
        losses[runner.name], times[runner.name] = [float(loss)], []
        faults_per_step[runner.name] = []
        runners.append(runner)
    rows = runners[0].plan.rows
    for runner in runners:
        results[runner.name]["full_size_init_buffers"] = full_buffers(
            runner.init_compiled.as_text(), rows, mesh
        )
        runner.initial_shardings = _shardings(runner)
    for i in range(1, steps + 1):
        batch = gpt.batch_at(i, batch_size, config.seq)
        for runner in runners if i % 2 else runners[::-1]:  # interleave, alternating order
            placed = jax.device_put(batch, runner.data_sharding)
            loss, seconds, faults = timed(runner.step, placed)
            times[runner.name].append(seconds)
            faults_per_step[runner.name].append(faults)
            losses[runner.name].append(float(loss))
    param_bytes = sum(row.bytes_total for row in rows)
    for runner in runners:
        results[runner.name]["shardings_stable"] = runner.initial_shardings == _shardings(runner)
    for name in results:
        results[name]["median_step_s"] = statistics.median(times[name]) if times[name] else None
        results[name]["median_page_faults"] = (
            statistics.median(faults_per_step[name]) if faults_per_step[name] else None
        )
        results[name]["losses"] = losses[name]
    return {
        "layout": label,
        "strategy": layout,
        "mesh": mesh_shape,
        "param_bytes": param_bytes,
        "theory_traffic_bytes": theory_bytes(layout, param_bytes, mesh_shape, manual=True),
        "theory_xla_traffic_bytes": theory_bytes(layout, param_bytes, mesh_shape),
        "max_loss_difference": float(
            np.max(np.abs(np.array(losses["substrax"]) - np.array(losses["flax"])))
        ),
        "max_xla_loss_difference": float(
            np.max(np.abs(np.array(losses["substrax"]) - np.array(losses["substrax xla"])))
        )
        if "substrax xla" in losses
        else None,
        **results,
    }


def write_results(output_dir: pathlib.Path, name: str, report, table: str) -> None:
    """Writes ``<name>.json`` and ``<name>.md`` into ``output_dir`` and prints the table."""
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / f"{name}.json").write_text(json.dumps(report, indent=2))
    (output_dir / f"{name}.md").write_text(table)
    print(table)


def _mib(value):
    return "-" if value is None else f"{value / MIB:.1f}"


def markdown(report: dict) -> str:
    head = (
        "| layout | | params+opt / device MiB (x ideal) | init temp MiB | full-size init "
        "buffers | step temp / peak MiB | traffic MiB (theory) | collectives | GFLOP / device | "
        "step ms | first step s | shardings stable |\n" + "|---" * 12 + "|\n"
    )
    lines = []
    for row in report["rows"]:
        for name in ("substrax", "substrax xla", "flax"):
            if name not in row:
                continue
            r = row[name]
            theory = row[
                "theory_traffic_bytes" if name == "substrax" else "theory_xla_traffic_bytes"
            ]
            kinds = ", ".join(
                f"{kind} {r['collectives'][kind]['count']}x {_mib(r['collectives'][kind]['bytes'])}"
                for kind in KINDS
                if r["collectives"][kind]["count"]
            )
            step_ms = "-" if r["median_step_s"] is None else f"{1000 * r['median_step_s']:.0f}"
            lines.append(
                f"| {row['layout'] if name == 'substrax' else ''} | {name} | "
                f"{_mib(r['bytes_per_device'])} ({r['ratio_to_ideal']:.3f}) | "
                f"{_mib(r['init_temp_bytes'])} | {len(r['full_size_init_buffers'])} | "
                f"{_mib(r['temp_bytes'])} / {_mib(r['peak_bytes'])} | {_mib(r['traffic_bytes'])} "
                f"({_mib(theory)}) | {kinds or '-'} | "
                f"{r['flops'] / 1e9:.2f} | {step_ms} | {r['time_to_first_step_s']:.1f} | "
                f"{'yes' if r['shardings_stable'] else 'no'} |"
            )
    machine = report["machine"]
    footer = (
        f"\nMeasured {report['date']} on {machine['cpus']} CPU cores ({machine['machine']}), "
        f"{report['devices']} simulated {report['platform']} devices, jax {report['jax']}, "
        f"flax {report['flax']}; model {report['params']:,} parameters, batch "
        f"{report['batch_size']} x {report['config']['seq']}, {report['steps']} timed steps. "
        "Largest loss difference substrax vs Flax: "
        f"{max(row['max_loss_difference'] for row in report['rows']):.2e}; substrax vs substrax "
        f"xla: {max(row['max_xla_loss_difference'] or 0.0 for row in report['rows']):.2e}. "
        "`substrax` is the default `make_train_step(loss_fn)`, which chose the manual "
        'data-parallel step on every layout here; `substrax xla` is `data_parallel="xla"`.\n'
    )
    return head + "\n".join(lines) + "\n" + footer


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per runner")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--layouts", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--output-dir", type=pathlib.Path, default=pathlib.Path("benchmarks"))
    args = parser.parse_args(argv)
    config = SIZES[args.size]
    rows = []
    for label in args.layouts:
        layout, mesh_shape = CASES[label]
        print(f"measuring {label} ...", flush=True)
        rows.append(measure(config, label, layout, mesh_shape, args.steps, args.batch_size))
    import flax

    report = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpus": os.cpu_count(), "machine": platform.machine()},
        "platform": jax.devices()[0].platform,
        "devices": jax.device_count(),
        "jax": jax.__version__,
        "flax": flax.__version__,
        "config": dataclasses.asdict(config),
        "params": rows[0]["param_bytes"] // 4,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "rows": rows,
    }
    write_results(args.output_dir, "layouts", report, markdown(report))
    return report


if __name__ == "__main__":
    main()
