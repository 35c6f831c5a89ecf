"""``python -m substrax.planner``: rank the layouts of a model on a device count, without devices.

    python -m substrax.planner --model llama3-70b --devices 512 --hardware h100
        --batch-tokens 4M --seq 8192 [--json plan.json]

Prints the ranked candidates, the chosen layout's memory breakdown and its warnings. Without
``--remat`` / ``--microbatches``, each layout gets the cheapest setting that fits. A framework
adapter plans its users' own models through :func:`main`'s ``load_factory``, which adds
``--factory module:function`` to the command line (the core never imports an adapter).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import pathlib
import sys
from collections.abc import Callable, Sequence

from substrax.layout import LAYOUTS, Layout
from substrax.pipeline import SCHEDULES
from substrax.planner._architectures import ARCHITECTURES, Leaf, config_from_leaves
from substrax.planner._efficiency import CALIBRATED, CALIBRATION_RUNS, ROOFLINE, SPREAD
from substrax.planner._estimate import (
    GATHER,
    PRECISION_BYTES,
    Hardware,
    Workload,
    schedule_of,
)
from substrax.planner._hardware import HARDWARE
from substrax.planner._layouts import STRATEGIES
from substrax.planner._rank import plan
from substrax.spmd import REMAT

__all__ = ["main"]

_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}  # fmt: skip


def _parse(text: str | int | float, suffix: str, what: str) -> int:
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        raw = str(text).strip().upper().replace(" ", "")
        raw = raw[: -len(suffix)] if suffix and raw.endswith(suffix) else raw
        number = raw.rstrip("KMGTI")
        unit = raw[len(number) :]
        if unit not in _UNITS or not number:
            raise ValueError(
                f"Cannot read {what} {text!r}: use a number with an optional K, M, G or T "
                f"(or Ki, Mi, Gi, Ti){' and ' + suffix if suffix else ''}, e.g. '80GB'."
            )
        try:
            value = float(number) * _UNITS[unit]
        except ValueError:
            raise ValueError(f"Cannot read {what} {text!r}: {number!r} is not a number.") from None
    if value <= 0 or not math.isfinite(value):
        raise ValueError(f"{what} must be positive, got {text!r}.")
    return int(value)


def parse_bytes(text: str | int) -> int:
    """``"80GB"`` -> 80e9, ``"80GiB"`` -> 80 * 2**30 (K/M/G/T decimal, Ki/Mi/Gi/Ti binary).

    Raises:
      ValueError: For anything else, or a count that is not positive.
    """
    return _parse(text, "B", "memory")


def parse_count(text: str | int) -> int:
    """``"4M"`` -> 4_000_000 (tokens, devices, ...).

    Raises:
      ValueError: For anything else, or a count that is not positive.
    """
    return _parse(text, "", "count")


def _gib(value: float) -> str:
    return f"{value / 2**30:.2f}"


def _table(result, top: int, timed: bool) -> str:
    shown = result.candidates[:top]
    width = max([len("layout"), *(len(c.layout.label) for c in shown)])
    head = (
        f"{'#':>3}  {'layout':{width}} {'remat':>9} {'micro':>5} {'gather':>8} {'schedule':>14} "
        f"{'idle':>5} "
        f"{'params/dev':>14} {'peak GiB':>9} {'fits':>5} {'time s':>8}"
    )
    lines = [head, "-" * len(head)]
    for rank, c in enumerate(shown, 1):
        time = f"{c.time_s:>8.3f}" if timed else f"{'-':>8}"
        lines.append(
            f"{rank:>3}  {c.layout.label:{width}} {c.workload.remat:>9} "
            f"{c.workload.microbatches:>5} {_gather_name(c):>8} {_schedule_name(c):>14} "
            f"{c.bubble:>5.2f} "
            f"{c.params_per_device:>14,} {_gib(c.bytes_per_device['peak']):>9} "
            f"{'yes' if c.fits else 'no':>5} {time}"
        )
    return "\n".join(lines)


def _gather_name(candidate) -> str:
    """The candidate's ``gather`` as the table shows it (``-`` without FSDP)."""
    return (candidate.workload.gather or "keep") if candidate.layout.fsdp > 1 else "-"


def _schedule_name(candidate) -> str:
    """The candidate's pipeline schedule as the table shows it (``-`` without a pipeline)."""
    work = candidate.workload
    if candidate.layout.pp == 1:
        return "-"
    return work.schedule + (f" x{work.chunks}" if work.chunks > 1 else "")


def _leaf_table(candidate, workload) -> str:
    width = PRECISION_BYTES[workload.precision][0]
    lines = [f"{'path':24} {'logical names':36} {'spec':30} {'MiB/device':>11}  why"]
    for leaf in candidate.leaves:
        spec = str(tuple("x".join(axes) or None for axes in leaf.spec))
        lines.append(
            f"{leaf.path:24} {leaf.names!s:36} {spec:30} "
            f"{leaf.params_per_device * width / 2**20:>11.2f}  {leaf.why}"
        )
    return "\n".join(lines)


def _breakdown(candidate, searched: list[str], what: str = "chosen") -> str:
    parts = ", ".join(
        f"{k} {_gib(v)}" + (" (in the host's memory, not in the peak)" if k == "host" else "")
        for k, v in candidate.bytes_per_device.items()
    )
    work = candidate.workload
    setting = f"remat {work.remat}, {work.microbatches} microbatches, gather {work.gather}"
    if candidate.layout.pp > 1:
        setting += f", schedule {_schedule_name(candidate)} (idle {candidate.bubble:.3f})"
    if searched:
        named = " and ".join([", ".join(searched[:-1]), searched[-1]] if len(searched) > 1
                             else searched)  # fmt: skip
        setting += f" ({named} chosen by the planner)"
    return (
        f"{what}: {candidate.layout.label} (mesh {candidate.layout.shape}), {setting}; "
        f"GiB per device: {parts}"
    )


def estimate_line(candidate, hardware: Hardware) -> str:
    """The candidate's step time with the calibration's spread (or that it is a roofline).

    Args:
      candidate: A timed planner candidate.
      hardware: The hardware it was estimated on.

    Returns:
      Such as ``"11.9 s per step (+-33%, calibrated on 9 published runs)"``.
    """
    seconds = f"{candidate.time_s:.3g} s per step"
    if hardware.efficiency == CALIBRATED:
        return (f"{seconds} (+-{SPREAD:.0%}, calibrated on {CALIBRATION_RUNS} published "
                "runs; docs/planning.md)")  # fmt: skip
    if hardware.efficiency == ROOFLINE:
        return f"{seconds} (a roofline: every FLOP at peak, uncalibrated)"
    return f"{seconds} (with the efficiencies given, uncalibrated)"


def explain(candidate) -> str:
    """The candidate's step time in parts, largest first, with their shares.

    Args:
      candidate: A timed planner candidate.

    Returns:
      Such as ``"compute 1.89 s (84%), attention 0.36 s (16%), ..."``.
    """
    parts = sorted(candidate.time_breakdown.items(), key=lambda kv: -kv[1])
    total = candidate.time_s or 1.0
    shown = [f"{name.replace('/', ' ')} {t:.3g} s ({t / total:.0%})" for name, t in parts]
    return ", ".join(shown)


def how_to_run(candidate) -> list[str]:
    """The chosen layout as code, and as the example's flags where a named layout is it.

    Args:
      candidate: A planner candidate.

    Returns:
      ``"layout: Layout.from_degrees(...)"``, then ``"example: python ..."`` when
      :meth:`~substrax.layout.Layout.named` builds the same layout on the same mesh.
    """
    layout, work = candidate.layout, candidate.workload
    degrees = {"pp": layout.pp, "dp": layout.dp, "fsdp": layout.fsdp, "ep": layout.ep,
               "cp": layout.cp, "tp": layout.tp}  # fmt: skip
    given = [f"{k}={v}" for k, v in degrees.items() if v > 1]
    given += [f"zero={layout.zero}"] if layout.zero else []
    lines = [f"layout: substrax.layout.Layout.from_degrees({', '.join(given)})"]
    mesh = dict(zip(layout.axis_names, layout.axis_sizes, strict=True))
    try:
        same = layout.name in LAYOUTS and Layout.named(layout.name, mesh).label == layout.label
    except ValueError:  # a layout the named ones do not build on this mesh
        same = False
    if same:
        flags = ",".join(f"{axis}={size}" for axis, size in mesh.items())
        lines.append(
            f"example: python examples/fsdp_training.py --strategy {layout.name} --mesh {flags} "
            f"--remat {work.remat} --microbatches {work.microbatches}"
            + (f" --gather {work.gather}" if work.gather not in (None, "keep") else "")
        )
    return lines


def _inputs(args, result, hardware, workload, speeds: str) -> list[str]:
    """What the planner was asked, with every conversion it made, as lines to print."""
    tokens, seq = workload.batch_tokens, workload.seq
    rows = f"{workload.batch:,} sequences of {seq:,} tokens"
    if workload.batch * seq != tokens:
        rows += f" ({tokens:,} / {seq:,} rounded to the nearest sequence)"
    memory = hardware.memory_bytes
    lines = [
        f"inputs: {result.model} on {result.devices:,} devices",
        f"  memory per device: {args.memory or args.hardware} = {memory:,.0f} bytes = "
        f"{memory / 2**30:.2f} GiB",
        f"  batch: {args.batch_tokens} tokens = {tokens:,} = {rows}",
        f"  precision {workload.precision}, optimizer {workload.optimizer}, remat "
        f"{workload.remat or 'searched'}, microbatches {workload.microbatches or 'searched'}, "
        f"gather {workload.gather or 'searched'}, schedule {workload.schedule or 'searched'}"
        + (", sequence parallel" if workload.sequence_parallel else ""),
    ]
    if hardware.flops:
        intra, inter = hardware.intra_host_bandwidth / 1e9, hardware.inter_host_bandwidth / 1e9
        host = (f"{hardware.host_bandwidth / 1e9:,.0f} GB/s" if hardware.host_bandwidth
                else "unknown (remat offload not searched)")  # fmt: skip
        lines.append(
            f"  speeds: {hardware.flops / 1e12:,.0f} TFLOP/s, {intra:,.0f} GB/s within a host "
            f"of {hardware.devices_per_host}, {inter:,.0f} GB/s across hosts, {host} to host "
            f"memory: {speeds}"
        )
    else:
        lines.append("  speeds: none given, so layouts are ranked by FLOPs, not time")
    return lines


def _shown(result, label: str):
    """The candidate whose label is ``label`` (spaces aside), and its rank."""
    wanted = " ".join(label.split())
    for rank, candidate in enumerate(result.candidates, 1):
        if candidate.layout.label == wanted:
            return candidate, rank
    raise ValueError(
        f"--show {label!r} is none of the {len(result.candidates)} candidates' layouts; copy "
        f"one from the table, such as {result.best.layout.label!r}."
    )


def _share(text: str) -> float:
    """``"10%"`` or ``"0.1"`` as 0.1.

    Raises:
      ValueError: For anything else.
    """
    value = str(text).strip()
    try:
        return float(value[:-1]) / 100 if value.endswith("%") else float(value)
    except ValueError:
        raise ValueError(f"--headroom {text!r}: expected a share such as 10% or 0.1.") from None


def _optional(text: str, unit: bool = False) -> float:
    if str(text).strip() in ("", "0"):
        return 0.0
    return float(parse_bytes(text) if unit else parse_count(text))


def _parser(prog: str, factories: bool) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help=f"one of {', '.join(ARCHITECTURES)}")
    if factories:
        source.add_argument("--factory", help="module:function building your model")
    parser.add_argument("--devices", required=True)
    parser.add_argument(
        "--hardware", choices=sorted(HARDWARE), help="a named device: fills the next seven"
    )
    parser.add_argument("--memory", help="per device, e.g. 80GB or 96GiB")
    parser.add_argument("--batch-tokens", required=True, help="tokens per step, e.g. 4M")
    parser.add_argument("--seq", required=True)
    parser.add_argument("--devices-per-host", default=None, help="default 8")
    parser.add_argument("--flops", default=None, help="peak FLOP/s per device, e.g. 989T")
    parser.add_argument("--intra-host-bandwidth", default=None, help="bytes/s, e.g. 450GB")
    parser.add_argument("--inter-host-bandwidth", default=None, help="bytes/s, e.g. 50GB")
    parser.add_argument(
        "--host-bandwidth", default=None,
        help="bytes/s each way to the host's memory (remat offload), e.g. 64GB",
    )  # fmt: skip
    parser.add_argument(
        "--host-memory", default=None,
        help="the host's memory per device for remat offload's bytes, e.g. 250GB (0: unchecked)",
    )  # fmt: skip
    parser.add_argument(
        "--precision", default="bf16", choices=sorted(PRECISION_BYTES),
        help="as make_train_step(precision=...) names it; mixed: f32 master weights, bf16 "
        "gathers, activations and reductions",
    )  # fmt: skip
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument(
        "--remat", default=None, help=f"one of {', '.join(REMAT)}; searched when left out"
    )
    parser.add_argument(
        "--gather", default=None, choices=GATHER,
        help="make_train_step(gather=...) on FSDP layouts; searched when left out",
    )  # fmt: skip
    parser.add_argument(
        "--sequence-parallel", action="store_true",
        help="split the h-wide activations over the tensor devices, as Megatron-LM and "
        "torchtitan run tensor parallelism (substrax's layouts do not)",
    )  # fmt: skip
    parser.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="pipeline microbatches, or gradient-accumulation steps without a pipeline; "
        "searched when left out",
    )
    parser.add_argument(
        "--schedule", default=None, choices=SCHEDULES,
        help="the pipeline schedule; searched (with its chunks) when left out",
    )  # fmt: skip
    parser.add_argument(
        "--chunks", type=int, default=None,
        help="chunks of layers per stage for interleaved and circular; searched when left out",
    )  # fmt: skip
    parser.add_argument(
        "--headroom", default="10%",
        help="device memory to keep free when a layout within 3%% of the fastest allows it, "
        "e.g. 10%% or 0.1",
    )  # fmt: skip
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument(
        "--show",
        default=None,
        help="a layout from the table: its breakdown, warnings and pipeline schedule's table",
    )
    parser.add_argument("--leaves", action="store_true", help="per-parameter table of the best")
    parser.add_argument(
        "--explain", action="store_true",
        help="the chosen layout's time in parts: compute, attention, bubble, and exposed "
        "communication by mesh axis",
    )  # fmt: skip
    parser.add_argument("--json", type=pathlib.Path, default=None)
    return parser


#: The speeds the planner times layouts with when the command line names no hardware.
DEFAULT_PROFILE = "h100"


def _hardware(args) -> tuple[Hardware, str]:
    """The device: a named profile, with any figure given on the command line instead.

    Without ``--hardware`` and without ``--flops``, the speeds are :data:`DEFAULT_PROFILE`'s
    (the memory is ``--memory``), so that layouts are ranked by an estimated time.

    Returns:
      ``(hardware, where its speeds come from)``.

    Raises:
      ValueError: Without ``--memory`` or ``--hardware``, or for a figure that is not valid.
    """
    speeds = "as given"
    if args.hardware is not None:
        base, speeds = HARDWARE[args.hardware], f"the {args.hardware} profile"
    elif args.flops is None:
        base = HARDWARE[DEFAULT_PROFILE]
        speeds = (f"the {DEFAULT_PROFILE} profile (no --hardware given: pass --hardware, or "
                  "--flops and the bandwidths, for your devices)")  # fmt: skip
    else:  # speeds as given, the rest of the default profile (its memory is --memory's)
        base = dataclasses.replace(
            HARDWARE[DEFAULT_PROFILE], flops=0.0, intra_host_bandwidth=0.0,
            inter_host_bandwidth=0.0, host_bandwidth=0.0, host_memory_bytes=0,
        )  # fmt: skip
    if args.memory is None and args.hardware is None:
        raise ValueError(
            f"give the memory per device: --memory (e.g. 80GB) or --hardware (one of "
            f"{', '.join(sorted(HARDWARE))})."
        )

    def given(text, default, parse):
        return default if text is None else parse(text)

    return Hardware(
        efficiency=base.efficiency,
        flash_attention=base.flash_attention,
        memory_bytes=given(args.memory, base.memory_bytes, parse_bytes),
        devices_per_host=given(args.devices_per_host, base.devices_per_host, parse_count),
        flops=given(args.flops, base.flops, _optional),
        intra_host_bandwidth=given(
            args.intra_host_bandwidth, base.intra_host_bandwidth, lambda t: _optional(t, True)
        ),
        inter_host_bandwidth=given(
            args.inter_host_bandwidth, base.inter_host_bandwidth, lambda t: _optional(t, True)
        ),
        host_bandwidth=given(
            args.host_bandwidth, base.host_bandwidth, lambda t: _optional(t, True)
        ),
        host_memory_bytes=given(
            args.host_memory, base.host_memory_bytes, lambda t: int(_optional(t, True))
        ),
    ), speeds


def _model(args, load_factory) -> tuple:
    """The architecture name (and no leaves), or a factory's config and leaves."""
    if args.model:
        return args.model, None
    module_name, sep, function = args.factory.partition(":")
    if not sep or not module_name or not function:
        raise ValueError(f"--factory {args.factory!r}: expected module:function.")
    sys.path.insert(0, str(pathlib.Path.cwd()))
    try:
        factory = getattr(importlib.import_module(module_name), function)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"--factory {args.factory!r}: {error}") from None
    leaves = load_factory(factory)
    return config_from_leaves(leaves), leaves


def main(
    argv: Sequence[str] | None = None,
    *,
    load_factory: Callable[[Callable[[], object]], list[Leaf]] | None = None,
    prog: str = "python -m substrax.planner",
) -> int:
    """The command line.

    Args:
      argv: The arguments (``sys.argv[1:]`` when None).
      load_factory: Turns a model factory into the planner's leaves; given by an adapter
        (the Flax adapter's ``planner`` module), it adds ``--factory module:function``.
      prog: The program name shown in usage lines.

    Returns:
      The exit status: 0, or 2 for bad input (one line on stderr).
    """
    args = _parser(prog, load_factory is not None).parse_args(argv)
    try:
        hardware, speeds = _hardware(args)
        workload = Workload(
            batch_tokens=parse_count(args.batch_tokens),
            seq=parse_count(args.seq),
            precision=args.precision,
            optimizer=args.optimizer,
            remat=args.remat,
            microbatches=args.microbatches,
            gather=args.gather,
            schedule=args.schedule,
            chunks=args.chunks,
            sequence_parallel=args.sequence_parallel,
        )
        strategies = tuple(args.strategies.split(","))
        model, leaves = _model(args, load_factory)
        devices = parse_count(args.devices)
        result = plan(model, devices, hardware, workload, strategies=strategies, leaves=leaves,
                      headroom=_share(args.headroom))  # fmt: skip
        shown = _shown(result, args.show) if args.show else None
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    searched = [name for name in ("remat", "microbatches", "gather", "schedule")
                if getattr(args, name) is None]  # fmt: skip
    for line in _inputs(args, result, hardware, workload, speeds):
        print(line)
    print(
        f"{result.model}: {result.total_params:,} parameters on {result.devices} devices, "
        f"{len(result.candidates)} candidates"
    )
    print(_table(result, args.top, timed=hardware.flops > 0))
    if hardware.flops:
        print(f"estimate: {estimate_line(result.best, hardware)}")
    print(_breakdown(result.best, searched))
    if args.explain and hardware.flops:
        print(f"time: {explain(result.best)}")
    print(f"why: {result.why}")
    for line in how_to_run(result.best):
        print(line)
    message = result.no_fit_message()
    if message:
        print(f"warning: {message}")
    for warning in result.best.warnings:
        print(f"warning: {warning}")
    if shown:
        candidate, rank = shown
        print(_breakdown(candidate, searched, f"#{rank}, fits" if candidate.fits else f"#{rank}"))
        for warning in candidate.warnings:
            print(f"warning: {warning}")
        schedule = schedule_of(candidate.layout, candidate.workload)
        if schedule is not None:
            print(schedule.render())
    if args.leaves:
        print(_leaf_table(result.best, workload))
    if args.json:
        args.json.write_text(json.dumps(result.as_dict(), indent=2))
        print(f"wrote {args.json}")
    return 0
