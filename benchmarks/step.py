"""The train step at the communication limit: mixed precision and gradient accumulation.

On the example decoder over 8 simulated devices, with the default ``make_train_step``:

* **precision**: for FSDP over 8 and FSDP 4 x DP 2, the traffic per device of the step in f32
  and with ``precision="mixed"``, read off the lowered program (XLA's CPU compiler widens bf16
  collectives to f32; accelerators run them in bf16, see :mod:`substrax.hlo`), its ratio, and
  the compiled step's peak; then ``--steps`` steps of each, and the largest relative
  difference of the mixed losses from the f32 ones;
* **accumulation**: FSDP over 8 with ``microbatches`` K = 1, 2, 4, 8 on one batch: the
  compiled step's temp and peak bytes, its collectives (counts do not grow with K), and the
  losses of three steps against K = 1;
* **against Flax**: FSDP 4 x DP 2 and TP 4 x DP 2, the default step side by side with Flax's
  own recipe (``layouts.measure``: interleaved steps, alternating order): median step times and
  their ratio, the compiled step's traffic against the limit (FSDP 4 x DP 2: one all-gather and
  one reduce-scatter over the FSDP axis, one all-reduce of the shard over the data axis), its
  peak, and the minor page faults each step takes; under glibc's default allocator settings or,
  with ``--allocator kept``, with freed memory kept as accelerators' pools keep it
  (:mod:`allocator`); each allocator's rows are kept apart in ``step.json``;
* **paths**: FSDP over 8 with the default step, for the decoder as benchmarked, with two
  ``nnx.Dropout(0.1)`` per block, and each on a ``jax.make_mesh`` mesh (Explicit axes): the
  path the step plan names, the compiled step's traffic against the bound of 1.05 x (one
  all-gather and one reduce-scatter of the parameters), and the losses of three steps;
* **non-finite guard**: FSDP 8 and FSDP 4 x DP 2, the default step (``on_nonfinite="skip"``:
  the loss, the gradients and the state the update would write are checked) against
  ``on_nonfinite="apply"`` (no guard) on the same model: median step times of interleaved
  steps, the compiled FLOPs and peak.

Run: ``python benchmarks/step.py [--size tiny] [--steps 100] [--flax-steps 40]
[--guard-steps 40] [--sections guard ...] [--allocator glibc|kept] [--output-dir DIR]``;
writes ``step.json`` and ``step.md`` (with ``--sections``, the other sections are kept from
the existing ``step.json``).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)

import argparse
import dataclasses
import json
import pathlib
import time

import allocator
import numpy as np
from flax import nnx
from layouts import (  # layouts puts examples/ on the path
    CASES,
    MIB,
    SIZES,
    compiled_stats,
    gpt,
    measure,
    write_results,
)

import substrax_flax as sf
from substrax.hlo import KINDS, traffic_by_kind
from substrax.layout import Layout
from substrax.mesh import DeviceMeshManager

PRECISION_CASES = {
    "FSDP 8": ("fsdp", {"data": 8}),
    "FSDP 4 x DP 2": ("hsdp", {"data": 2, "model": 4}),
}
MICROBATCHES = (1, 2, 4, 8)
AGAINST_FLAX = ("FSDP 4 x DP 2", "TP 4 x DP 2")


def _setup(config, layout, mesh_shape, **options):
    mesh = DeviceMeshManager.create_device_mesh(mesh_shape)
    model = sf.create_sharded_model(
        lambda: gpt.GPT(config, nnx.Rngs(0)), mesh, layout=Layout.named(layout, mesh)
    )
    optimizer = sf.create_sharded_optimizer(model, gpt.optimizer())
    return model, optimizer, sf.make_train_step(gpt.loss_fn, **options)


def precision_row(config, label, batch_size, steps) -> dict:
    """f32 and mixed (bf16 compute) on one layout: program traffic, compiled peak, losses."""
    layout, mesh_shape = PRECISION_CASES[label]
    row = {"layout": label}
    for precision in ("f32", "mixed"):
        model, optimizer, step = _setup(config, layout, mesh_shape, precision=precision)
        lowered = step.lower(model, optimizer, gpt.batch_at(0, batch_size, config.seq))
        traffic = traffic_by_kind(lowered.as_text(), 8)
        stats = compiled_stats(lowered.compile(), 8)
        losses = [
            float(step(model, optimizer, gpt.batch_at(i, batch_size, config.seq))["loss"])
            for i in range(steps)
        ]
        row[precision] = {
            "program_traffic_bytes": sum(kind["bytes"] for kind in traffic.values()),
            "program_collectives": traffic,
            "compiled_traffic_bytes": stats["traffic_bytes"],
            "peak_bytes": stats["peak_bytes"],
            "losses": losses,
        }
    f32, bf16 = np.array(row["f32"]["losses"]), np.array(row["mixed"]["losses"])
    row["traffic_ratio"] = (
        row["mixed"]["program_traffic_bytes"] / row["f32"]["program_traffic_bytes"]
    )
    relative = np.abs(bf16 - f32) / np.abs(f32)
    row["max_relative_loss_difference"] = float(np.max(relative))
    row["max_relative_loss_difference_first_half"] = float(np.max(relative[: max(steps // 2, 1)]))
    tail = max(steps // 10, 1)
    row["mean_of_last_losses"] = {"steps": tail, "f32": float(f32[-tail:].mean()),
                                  "mixed": float(bf16[-tail:].mean())}  # fmt: skip
    return row


def accumulation_rows(config, batch_size, microbatches=MICROBATCHES) -> list[dict]:
    """FSDP over 8 with K microbatches: memory, collectives, losses against K = 1."""
    rows = []
    batches = [gpt.batch_at(i, batch_size, config.seq) for i in range(3)]
    for k in microbatches:
        model, optimizer, step = _setup(config, "fsdp", {"data": 8}, microbatches=k)
        stats = compiled_stats(step.lower(model, optimizer, batches[0]).compile(), 8)
        losses = [float(step(model, optimizer, b)["loss"]) for b in batches]
        rows.append({"microbatches": k, **stats, "losses": losses})
    for row in rows:
        row["max_loss_difference"] = float(
            np.max(np.abs(np.array(row["losses"]) - np.array(rows[0]["losses"])))
        )
    return rows


def flax_rows(config, batch_size, steps) -> list[dict]:
    """The default step against Flax's recipe on :data:`AGAINST_FLAX`: time, traffic, peak."""
    rows = []
    for label in AGAINST_FLAX:
        print(f"against Flax: {label} ...", flush=True)
        layout, mesh_shape = CASES[label]
        measured = measure(config, label, layout, mesh_shape, steps, batch_size, with_xla=False)
        ours, flax = measured["substrax"], measured["flax"]
        rows.append({
            "layout": label,
            "substrax_step_s": ours["median_step_s"],
            "flax_step_s": flax["median_step_s"],
            "time_ratio": ours["median_step_s"] / flax["median_step_s"],
            "traffic_bytes": ours["traffic_bytes"],
            "flax_traffic_bytes": flax["traffic_bytes"],
            "limit_bytes": measured["theory_traffic_bytes"],
            "peak_bytes": ours["peak_bytes"],
            "flax_peak_bytes": flax["peak_bytes"],
            "page_faults": ours["median_page_faults"],
            "flax_page_faults": flax["median_page_faults"],
            "max_loss_difference": measured["max_loss_difference"],
        })  # fmt: skip
    return rows


#: Label -> (dropout rate, whether the mesh comes from jax.make_mesh).
PATH_CASES = {
    "as benchmarked": (0.0, False),
    "dropout 0.1": (0.1, False),
    "jax.make_mesh": (0.0, True),
    "dropout 0.1, jax.make_mesh": (0.1, True),
}


def path_rows(config, batch_size) -> list[dict]:
    """The default step's path and traffic for the decoder with dropout and Explicit meshes."""
    rows = []
    batches = [gpt.batch_at(i, batch_size, config.seq) for i in range(3)]
    for label, (dropout, make_mesh) in PATH_CASES.items():
        print(f"paths: {label} ...", flush=True)
        case = dataclasses.replace(config, dropout=dropout)
        if make_mesh:
            mesh = jax.make_mesh((8,), ("data",))
        else:
            mesh = DeviceMeshManager.create_device_mesh({"data": 8})
        model = sf.create_sharded_model(lambda c=case: gpt.GPT(c, nnx.Rngs(0)), mesh,
                                        layout="fsdp")  # fmt: skip
        optimizer = sf.create_sharded_optimizer(model, gpt.optimizer())
        step = sf.make_train_step(gpt.loss_fn)
        plan = step.plan_for(model, optimizer, batches[0])
        compiled = step.lower(model, optimizer, batches[0]).compile()
        params = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        rows.append({
            "case": label,
            "path": plan.path,
            "mesh": next(d.value for d in plan.decisions if d.name == "mesh"),
            "traffic_bytes": compiled_stats(compiled, 8)["traffic_bytes"],
            "bound_bytes": 1.05 * 2 * params * 7 / 8,
            "losses": [float(step(model, optimizer, b)["loss"]) for b in batches],
        })  # fmt: skip
    return rows


GUARD_CASES = ("FSDP 8", "FSDP 4 x DP 2")


def guard_rows(config, batch_size, steps) -> list[dict]:
    """The guarded default step against ``on_nonfinite="apply"``: time, FLOPs, peak."""
    rows = []
    for label in GUARD_CASES:
        print(f"non-finite guard: {label} ...", flush=True)
        layout, mesh_shape = PRECISION_CASES[label]
        model, optimizer, guarded = _setup(config, layout, mesh_shape)
        unguarded = sf.make_train_step(gpt.loss_fn, on_nonfinite="apply")
        steps_by_policy = {"skip": guarded, "apply": unguarded}
        row, times = {"layout": label}, {policy: [] for policy in steps_by_policy}
        batch = gpt.batch_at(0, batch_size, config.seq)
        for policy, step in steps_by_policy.items():
            stats = compiled_stats(step.lower(model, optimizer, batch).compile(), 8)
            row[policy] = {"flops": stats["flops"], "peak_bytes": stats["peak_bytes"],
                           "temp_bytes": stats["temp_bytes"]}  # fmt: skip
            jax.block_until_ready(step(model, optimizer, batch)["loss"])  # compiled, warm
        for i in range(steps):
            order = list(steps_by_policy) if i % 2 else list(reversed(steps_by_policy))
            batch = gpt.batch_at(i + 1, batch_size, config.seq)
            for policy in order:
                start = time.perf_counter()
                jax.block_until_ready(steps_by_policy[policy](model, optimizer, batch)["loss"])
                times[policy].append(time.perf_counter() - start)
        for policy in steps_by_policy:
            row[policy]["median_step_s"] = float(np.median(times[policy]))
        row["time_ratio"] = row["skip"]["median_step_s"] / row["apply"]["median_step_s"]
        row["flops_ratio"] = row["skip"]["flops"] / row["apply"]["flops"]
        rows.append(row)
    return rows


def markdown(report: dict) -> str:
    lines = [
        "### Mixed precision (`make_train_step(loss_fn, precision=...)`)\n",
        "| layout | f32 traffic MiB | mixed traffic MiB | ratio | f32 / mixed peak MiB | "
        f"largest relative loss difference, first {max(report['steps'] // 2, 1)} / all "
        f"{report['steps']} steps | mean loss of the last steps, f32 / mixed |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in report["precision"]:
        tail = row["mean_of_last_losses"]
        lines.append(
            f"| {row['layout']} | {row['f32']['program_traffic_bytes'] / MIB:.1f} | "
            f"{row['mixed']['program_traffic_bytes'] / MIB:.1f} | {row['traffic_ratio']:.3f} | "
            f"{row['f32']['peak_bytes'] / MIB:.1f} / {row['mixed']['peak_bytes'] / MIB:.1f} | "
            f"{row['max_relative_loss_difference_first_half']:.1e} / "
            f"{row['max_relative_loss_difference']:.1e} | "
            f"{tail['f32']:.3f} / {tail['mixed']:.3f} (last {tail['steps']}) |"
        )
    lines += [
        "",
        f"### Gradient accumulation (FSDP 8, batch {report['accumulation_batch']}, "
        "`microbatches=K`)\n",
        "| K | temp MiB | peak MiB | collectives (count) | traffic MiB | GFLOP / device | "
        "largest loss difference from K = 1 |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in report["accumulation"]:
        kinds = ", ".join(
            f"{kind} {row['collectives'][kind]['count']}"
            for kind in KINDS
            if row["collectives"][kind]["count"]
        )
        lines.append(
            f"| {row['microbatches']} | {row['temp_bytes'] / MIB:.1f} | "
            f"{row['peak_bytes'] / MIB:.1f} | {kinds} | {row['traffic_bytes'] / MIB:.1f} | "
            f"{row['flops'] / 1e9:.2f} | {row['max_loss_difference']:.1e} |"
        )
    lines += [
        "",
        f"### Against Flax's recipe (median of {report.get('flax_steps')} interleaved steps, "
        f"measured {report.get('flax_date', report.get('date'))})\n",
        "`glibc`: the C library's default allocator settings, under which XLA:CPU's temporary "
        "buffers are handed back to the system after each call and faulted in again; `kept`: "
        "freed memory kept for the next call, as accelerators' memory pools keep it "
        "(`--allocator kept`, `benchmarks/allocator.py`).\n",
        "| layout | allocator | substrax ms | Flax ms | ratio | page faults per step, "
        "substrax / Flax | traffic MiB, substrax / Flax (limit) | "
        "peak MiB, substrax / Flax | largest loss difference |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    by_allocator = report.get("against_flax", {})
    for kind, row in sorted(
        ((kind, row) for kind, rows in by_allocator.items() for row in rows),
        key=lambda item: (AGAINST_FLAX.index(item[1]["layout"]), allocator.CHOICES.index(item[0])),
    ):
        limit = "-" if row["limit_bytes"] is None else f"{row['limit_bytes'] / MIB:.1f}"
        lines.append(
            f"| {row['layout']} | {kind} | {row['substrax_step_s'] * 1e3:.0f} | "
            f"{row['flax_step_s'] * 1e3:.0f} | {row['time_ratio']:.3f} | "
            f"{row['page_faults']:,.0f} / {row['flax_page_faults']:,.0f} | "
            f"{row['traffic_bytes'] / MIB:.1f} / {row['flax_traffic_bytes'] / MIB:.1f} "
            f"({limit}) | {row['peak_bytes'] / MIB:.1f} / {row['flax_peak_bytes'] / MIB:.1f} | "
            f"{row['max_loss_difference']:.1e} |"
        )
    lines += [
        "",
        "### The default step's path (FSDP 8, `make_train_step(loss_fn)`)\n",
        "| decoder | path | mesh | traffic MiB | bound MiB (1.05 x gather + scatter) | "
        "losses of 3 steps |",
        "|---|---|---|---|---|---|",
    ]
    for row in report.get("paths", []):
        losses = ", ".join(f"{loss:.4f}" for loss in row["losses"])
        lines.append(
            f"| {row['case']} | {row['path']} | {row['mesh']} | "
            f"{row['traffic_bytes'] / MIB:.1f} | {row['bound_bytes'] / MIB:.1f} | {losses} |"
        )
    lines += [
        "",
        f"### The non-finite guard (median of {report.get('guard_steps')} interleaved steps)\n",
        'The default `on_nonfinite="skip"` checks the loss, the gradients and the state the '
        "update would write in one check (computing the update once more, elementwise; its "
        "commit takes the update's scalars, such as a global norm, from the check) and "
        'skips an update that is not finite; `"apply"` checks the loss and the gradients for '
        "its `finite` metric and applies every update; "
        f"allocator: `{report.get('guard_allocator', 'glibc')}`.\n",
        "| layout | skip ms | apply ms | time ratio | GFLOP / device, skip / apply | "
        "peak MiB, skip / apply |",
        "|---|---|---|---|---|---|",
    ]
    for row in report.get("guard", []):
        skip, apply = row["skip"], row["apply"]
        lines.append(
            f"| {row['layout']} | {skip['median_step_s'] * 1e3:.0f} | "
            f"{apply['median_step_s'] * 1e3:.0f} | {row['time_ratio']:.3f} | "
            f"{skip['flops'] / 1e9:.3f} / {apply['flops'] / 1e9:.3f} | "
            f"{skip['peak_bytes'] / MIB:.1f} / {apply['peak_bytes'] / MIB:.1f} |"
        )
    lines.append(
        f"\nMeasured {report['date']}, {report['devices']} simulated CPU devices, jax "
        f"{report['jax']}; model {report['config']}. Traffic for precision is the lowered "
        "program's (XLA's CPU compiler widens bf16 collectives to f32: compiled, both rows "
        "move the f32 bytes, and the peaks are alike); the f32 and mixed runs see the same "
        "batches, and their trajectories part as rounding accumulates; for accumulation, the "
        "compiled program's, whose FLOPs count the "
        "scan over the K slices once (one slice's work)."
    )
    return "\n".join(lines) + "\n"


SECTIONS = ("precision", "accumulation", "flax", "paths", "guard")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--steps", type=int, default=100, help="steps per precision")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--accumulation-batch", type=int, default=64)
    parser.add_argument("--microbatches", type=int, nargs="*", default=list(MICROBATCHES))
    parser.add_argument("--layouts", nargs="*", default=list(PRECISION_CASES),
                        choices=list(PRECISION_CASES))  # fmt: skip
    parser.add_argument("--flax-steps", type=int, default=40,
                        help="interleaved steps against Flax (0: no such section)")  # fmt: skip
    parser.add_argument("--guard-steps", type=int, default=40,
                        help="interleaved steps of each guard policy")  # fmt: skip
    parser.add_argument("--no-paths", dest="paths", action="store_false",
                        help="leave out the paths section")  # fmt: skip
    parser.add_argument("--sections", nargs="*", choices=SECTIONS, default=list(SECTIONS),
                        help="measure these; keep the rest from step.json")  # fmt: skip
    parser.add_argument("--allocator", choices=allocator.CHOICES, default="glibc",
                        help="kept: glibc keeps freed memory, for this whole process")  # fmt: skip
    parser.add_argument("--output-dir", type=pathlib.Path, default=pathlib.Path("benchmarks"))
    args = parser.parse_args(argv)
    allocator.use(args.allocator)
    config = SIZES[args.size]
    previous = args.output_dir / "step.json"
    report = json.loads(previous.read_text()) if set(args.sections) != set(SECTIONS) else {}
    if previous.exists() and report:
        print(f"keeping {sorted(set(SECTIONS) - set(args.sections))} from {previous}")
    report.update({"devices": jax.device_count(), "jax": jax.__version__, "config": str(config)})
    report.setdefault("date", time.strftime("%Y-%m-%d"))
    if "precision" in args.sections:
        report["steps"], report["precision"] = args.steps, []
        for label in args.layouts:
            print(f"precision: {label} ...", flush=True)
            report["precision"].append(precision_row(config, label, args.batch_size, args.steps))
    if "accumulation" in args.sections:
        print("accumulation ...", flush=True)
        report["accumulation_batch"] = args.accumulation_batch
        report["accumulation"] = accumulation_rows(
            config, args.accumulation_batch, args.microbatches
        )
    if "flax" in args.sections:
        report["flax_steps"] = args.flax_steps
        report["flax_date"] = time.strftime("%Y-%m-%d")
        by_allocator = report.get("against_flax")
        report["against_flax"] = by_allocator if isinstance(by_allocator, dict) else {}
        report["against_flax"][args.allocator] = (
            flax_rows(config, args.batch_size, args.flax_steps) if args.flax_steps else []
        )
    if "paths" in args.sections:
        report["paths"] = path_rows(config, args.batch_size) if args.paths else []
    if "guard" in args.sections:
        report["guard_steps"] = args.guard_steps
        report["guard_date"] = time.strftime("%Y-%m-%d")
        report["guard_allocator"] = args.allocator
        report["guard"] = guard_rows(config, args.batch_size, args.guard_steps)
    write_results(args.output_dir, "step", report, markdown(report))
    return report


if __name__ == "__main__":
    main()
