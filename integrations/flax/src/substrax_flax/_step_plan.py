"""The step plan: every decision of a training step, made before the step is traced, and shown.

:class:`StepPlan` is to the step what :class:`~substrax_flax.ModelPlan` is to the parameters:
one immutable value, computed from the model's plan, the step's options and the shapes of a
batch. The step executes it; ``print(step.plan_for(model, optimizer, batch))`` shows it, one
line per decision with its reason, then each parameter's specs: stored, where used, how its
gradient is reduced and where its optimizer state lives.

The gradient path is one of:

* ``"manual"``: each device computes the loss of its own rows inside ``shard_map`` over the
  batch axes; FSDP parameters are all-gathered and their gradients reduce-scattered.
* ``"xla"``: XLA partitions the whole step; it all-reduces the gathered gradients.

``data_parallel="auto"`` chooses ``"manual"`` unless an obstacle is in the way (see
:func:`choose_path`), and then says which, and what it costs, in a ``ShardingWarning``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType, PartitionSpec

from substrax.mesh import as_axes
from substrax.spmd import (
    OBSERVED_ON,
    PRECISIONS,
    MixedPrecision,
    as_precision,
    looped_region_obstacle,
    region_obstacle,
    scatter_stages,
)
from substrax_flax._per_device import batch_stat_obstacle, synced_stats
from substrax_flax._plan import ModelPlan
from substrax_flax._report_table import group_by_layer
from substrax_flax._resolve import without_axes
from substrax_flax._state import values_by_path, variables
from substrax_flax._streams import RowDraws
from substrax_flax._traced import Traced

__all__ = [
    "Decision",
    "ParamStep",
    "StepPlan",
    "choose_path",
    "pipeline_plan",
    "region_stages",
    "remat_decision",
    "scatter_decision",
    "step_mesh",
]


@dataclasses.dataclass(frozen=True)
class Decision:
    """One decision of a step plan.

    Attributes:
      name: What was decided (``"path"``, ``"mesh"``, ``"region"``, ``"precision"``, ...).
      value: The choice, as text.
      reason: Why.
    """

    name: str
    value: str
    reason: str


@dataclasses.dataclass(frozen=True)
class ParamStep:
    """What the step does with one differentiated parameter.

    Attributes:
      path: The parameter's path, ``/``-joined.
      stored: Its planned spec (how it is stored between steps).
      used: Its spec where the loss uses it (the stored spec without the gathered axes).
      gradient: How its gradient is reduced: ``"reduce-scatter over (...)"``,
        ``"all-reduce over (...)"``, or ``"none"`` (nothing splits the batch).
      optimizer: The spec of its optimizer state (sharded further under ZeRO).
    """

    path: str
    stored: PartitionSpec
    used: PartitionSpec
    gradient: str
    optimizer: PartitionSpec


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """Every decision of a training step, made before it is traced.

    Attributes:
      path: The gradient path: ``"manual"``, ``"xla"`` or ``"pipeline"``.
      reason: Why this path.
      mesh: The mesh the step runs on: the model's, or its Auto twin for a model written for
        Auto axes placed on a mesh with Explicit axes.
      batch_axes: The mesh axes of the batch's leading dimension.
      region_axes: The axes the manual region spans (empty outside one).
      seq_axes: The axes the batch's sequences are split over (context parallelism).
      precision: The mixed-precision policy.
      remat: The remat policy's name.
      microbatches: Gradient-accumulation slices per device.
      gather: ``"keep"`` or ``"regather"``.
      extra_bytes: Traffic per device per step this path moves beyond the manual step
        (0 on the manual step, and where XLA's step costs nothing more).
      params: One :class:`ParamStep` per differentiated parameter.
      decisions: One :class:`Decision` per line of the plan.
      advice: What would put the step on the manual path ("" when it is there, or nothing
        the model could change would).
      check_state: Whether the non-finite guard also checks the updated state (float16
        state; see the ``guard`` decision).
      draws: How the manual step's random draws split with the rows (None: no draw from the
        model's streams, one block of rows, or not the manual path).
      scatter_stages: ``(outer, inner)`` where a gradient's reduce-scatter over every device
        goes in two stages (:func:`substrax.spmd.scatter_stages`; the ``scatter`` decision),
        else None.
      movers: On the manual path, how each differentiated parameter moves in the region
        (a pure dict of the adapter's ``Mover``: its spec over the batch axes, its compute
        sharding, the precision's gather and reduction dtypes, its gradient's spec, the
        scatter's stages), what :attr:`params` prints; None elsewhere.
      scatter_each: Whether accumulated gradients are reduce-scattered slice by slice
        (ZeRO-2) rather than once per step.
    """

    path: str
    reason: str
    mesh: jax.sharding.Mesh
    batch_axes: tuple[str, ...]
    region_axes: tuple[str, ...]
    seq_axes: tuple[str, ...]
    precision: MixedPrecision
    remat: str
    microbatches: int
    gather: str
    extra_bytes: int
    params: tuple[ParamStep, ...]
    decisions: tuple[Decision, ...]
    advice: str = ""
    check_state: bool = False
    draws: RowDraws | None = None
    scatter_stages: tuple[int, int] | None = None
    movers: Any = None
    scatter_each: bool = False

    def __str__(self) -> str:
        return self.text()

    def text(self, full: bool = False) -> str:
        """The plan as lines: each decision with its reason, then each parameter's specs.

        Args:
          full: One line per parameter; by default parameters that differ only in a layer
            number and are moved alike share a line (``blocks/0-5/up``), as the sharding
            report groups them.

        Returns:
          The text ``print(plan)`` shows.
        """
        width = max(len(d.name) for d in self.decisions)
        lines = ["Step plan:"]
        lines += [f"  {d.name:<{width}}  {d.value}: {d.reason}" for d in self.decisions]
        if self.params:
            lines.append("  parameter: stored -> used; gradient; optimizer state")
            groups = (
                [(p.path, [p]) for p in self.params]
                if full
                else group_by_layer(self.params, lambda p: p.path, _moved)
            )
            lines += [
                f"    {path}: {_spec(p.stored)} -> {_spec(p.used)}; {p.gradient}; "
                f"{_spec(p.optimizer)}"
                for path, (p, *_) in groups
            ]
        return "\n".join(lines)


def region_stages(mesh: jax.sharding.Mesh, region: tuple[str, ...]) -> tuple[int, int] | None:
    """The stages of a reduce-scatter over a manual region's every axis, where it needs them.

    :func:`substrax.spmd.scatter_stages` for the platform of the mesh's devices (a TPU
    slice's when compiling for one from this machine); None outside a region.
    """
    platform = mesh.devices.flat[0].platform
    return scatter_stages(dict(mesh.shape), region, platform) if region else None


def remat_decision(remat: str, mesh: jax.sharding.Mesh, how: str = "as asked") -> Decision:
    """The plan's remat line: the policy, and where the mesh's platform does not honour all of it.

    Remat ``"offload"`` on XLA:CPU keeps the products on the device (no separate host
    memory): the step is ``"selective"``'s there, and the line says so.
    """
    platform = mesh.devices.flat[0].platform
    if remat == "offload" and platform == "cpu":
        how += (
            "; XLA:CPU has no separate host memory, so the products stay on the device "
            "(the memory of 'selective')"
        )
    return Decision("remat", remat, how)


def scatter_decision(
    mesh: jax.sharding.Mesh, stages: tuple[int, int] | None, params: tuple[ParamStep, ...]
) -> tuple[tuple[int, int] | None, Decision | None]:
    """``stages`` and the plan's line for them, or ``(None, None)`` where no gradient uses them."""
    if stages is None or not any(" in 2 stages " in p.gradient for p in params):
        return None, None
    return stages, Decision(
        "scatter",
        f"2 stages ({stages[0]} x {stages[1]} devices)",
        f"XLA:{mesh.devices.flat[0].platform.upper()} compiles a reduce-scatter over every "
        "device as an all-reduce, twice its bytes; two over index groups stay reduce-scatters "
        f"(observed on jax {OBSERVED_ON})",
    )


def _moved(param: ParamStep) -> tuple:
    return tuple(param.stored), tuple(param.used), param.gradient, tuple(param.optimizer)


def _spec(spec: PartitionSpec) -> str:
    return "P(" + ", ".join(repr(e) if e is not None else "None" for e in spec) + ")"


def step_mesh(plan: ModelPlan) -> tuple[jax.sharding.Mesh, Decision]:
    """The mesh the step runs on, with why.

    A model written for Auto axes (no spec in its variables' types) placed on a mesh with
    Explicit axes (``jax.make_mesh`` makes one) runs on the mesh's Auto twin: the same devices
    and names with Auto axes, where XLA propagates shardings through code that was not written
    to say them (``nnx.Embed``'s gather). Arrays move between the two without a copy. The
    train step then checks the twin (its loss must trace there) and keeps the Explicit mesh
    for code that only traces on it (``TrainStep._explicit_if_needed``).
    """
    types = tuple(plan.mesh.axis_types)
    if AxisType.Explicit not in types:
        return plan.mesh, Decision("mesh", "as placed", "its axes are Auto")
    if plan.explicit_code:
        return plan.mesh, Decision(
            "mesh", "Explicit axes", "the model's variables carry their specs in their types"
        )
    twin = plan.mesh.update(axis_types=(AxisType.Auto,) * len(types))
    return twin, Decision(
        "mesh",
        "Auto twin of the Explicit mesh",
        "the model is written for Auto axes (no spec in its variables' types); same devices, "
        "no copy",
    )


@dataclasses.dataclass(frozen=True)
class Path:
    """A chosen gradient path: ``"manual"`` or ``"xla"``, why, and what would change it."""

    name: str
    reason: str
    advice: str = ""
    extra_bytes: int = 0


def choose_path(
    asked: str,
    model: nnx.Module,
    plan: ModelPlan,
    mesh: jax.sharding.Mesh,
    split: tuple[str, ...],
    precision: MixedPrecision,
    microbatches: int,
    traced: Callable[[], Traced],
    wrt: Any,
    draws: Callable[[], RowDraws | None] = lambda: None,
) -> Path:
    """The gradient path for ``data_parallel=asked``, decided before the step is traced.

    In order: ``"xla"`` asked; nothing to split (one replica, no accumulation); what this
    jax cannot compile (:func:`substrax.spmd.region_obstacle`, the planner's list too); batch
    statistics outside an ``nnx.BatchNorm``; then what the loss's trace shows (a draw from a
    key that is not an ``nnx.Rngs`` stream, a sharding that names a batch axis).

    Args:
      asked: ``"auto"``, ``"manual"`` or ``"xla"``.
      model: The model.
      plan: Its plan.
      mesh: The step's mesh.
      split: The batch axes of size > 1 a manual region would span.
      precision: The step's policy.
      microbatches: Gradient-accumulation slices (above 1 needs the manual step).
      traced: ``traced()`` is the loss's :class:`~substrax_flax._traced.Traced`.
      wrt: The differentiated variables.
      draws: ``draws()`` is how the loss's draws split with the rows; it raises
        ``ValueError`` saying why they cannot (an obstacle).

    Returns:
      The :class:`Path`.

    Raises:
      ValueError: If ``"manual"`` (or ``microbatches`` above 1) was asked where an obstacle
        is in the way.
    """
    if asked == "xla":
        return Path("xla", "data_parallel='xla' was asked")
    forced = asked == "manual" or microbatches > 1
    if not split:
        if microbatches > 1:
            return Path("manual", "gradient accumulation: the slices run one after the other")
        if forced:
            return Path("manual", "data_parallel='manual' was asked; one replica, no region")
        return Path("xla", "one replica: no batch axis of size > 1 to split")
    found = _obstacle(model, mesh, split, precision, traced, wrt, plan, draws)
    if found is None:
        return Path("manual", "each device computes its own rows; nothing needs XLA's step")
    obstacle, advice = found
    if forced:
        what, instead = "data_parallel='manual'", "data_parallel='xla' (or 'auto')"
        if asked != "manual":
            what, instead = f"microbatches={microbatches}", "microbatches=1 (XLA's step)"
        raise ValueError(
            f"{what} computes each device's loss on its own rows, but {obstacle}. Use {instead}."
        )
    return Path("xla", obstacle, advice, all_reduce_extra(plan, split, wrt, model))


def _compute_dtype(model: nnx.Module, precision: MixedPrecision) -> Any:
    """The dtype the step computes in: the policy's, else the narrowest stored parameter's.

    A policy that casts nothing (``"f32"``) computes in the parameters' own dtype: a model
    stored in bfloat16 computes, gathers and reduces in bfloat16.
    """
    if precision.compute_dtype is not None:
        return precision.compute_dtype
    floats = [leaf.dtype for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))
              if jnp.issubdtype(leaf.dtype, jnp.floating)]  # fmt: skip
    return min(floats, key=lambda d: jnp.dtype(d).itemsize) if floats else None


def stacked_experts_obstacle(plan: ModelPlan, mesh, split: tuple[str, ...]) -> str | None:
    """Why stacked layers' own regions keep the step off the manual region, or None.

    Experts in a stacked layer (an ``nnx.scan`` over the ``layers`` axis) enter their own
    region over the expert axes inside the loop, and ring attention in a stacked layer its
    region over the context axes; where those axes are left to XLA by the manual region
    (``fsdp+ep``, ``fsdp+cp``: the region spans the data axes), this jax cannot compile it
    (:func:`substrax.spmd.looped_region_obstacle`).
    """
    sizes = dict(mesh.shape)
    for row in plan.rows:
        names = row.logical_names or ()
        if "layers" not in names or "expert" not in names:
            continue
        entry = row.spec[names.index("expert")] if names.index("expert") < len(row.spec) else None
        axes = as_axes(entry)
        free = tuple(a for a in axes if sizes[a] > 1 and a not in split)
        found = looped_region_obstacle(f"the stacked experts ({row.path})", free)
        if found is not None:
            return found
    context = plan.layout.context_axes if plan.layout is not None else ()
    free = tuple(a for a in context if sizes[a] > 1 and a not in split)
    stacked = [row.path for row in plan.rows if "layers" in (row.logical_names or ())]
    if stacked and free:
        return looped_region_obstacle(
            f"the stacked layers ({stacked[0]}, ...) run ring attention, which would", free
        )
    return None


def _obstacle(model, mesh, split, precision, traced, wrt, plan, draws) -> tuple[str, str] | None:
    platform = mesh.devices.flat[0].platform
    dtype = _compute_dtype(model, precision)
    found = region_obstacle(dict(mesh.shape), split, dtype, platform)
    if found is not None:
        return found, ""
    found = stacked_experts_obstacle(plan, mesh, split)
    if found is not None:
        return found, ""
    found = batch_stat_obstacle(model)
    if found is not None:
        return found, ""
    found = traced_obstacle(traced(), split) or _state_from_batch(model, traced(), wrt)
    if found is not None:
        return found
    try:
        draws()
    except ValueError as error:
        return str(error), "Draw from an nnx.Rngs stream with shapes that split with the rows"
    return None


def _state_from_batch(model: nnx.Module, traced: Traced, wrt: Any) -> tuple[str, str] | None:
    """The model state (not differentiated) that the loss computes from the batch, if any.

    The loss's trace returns it last; in the manual step each device would compute it from
    its own rows. Batch norms substrax syncs are whole-batch already.
    """
    others = list(variables(nnx.state(model, nnx.Not(wrt))))
    marks = traced.from_batch[len(traced.from_batch) - len(others) :] if others else ()
    if len(marks) != len(others):
        return None
    synced = synced_stats(model)
    found = [f"{path} ({type(v).__name__})" for (path, v), mark in zip(others, marks, strict=True)
             if mark and path not in synced]  # fmt: skip
    if not found:
        return None
    return (
        f"the loss updates model state from the batch ({', '.join(found[:3])}"
        f"{', ...' if len(found) > 3 else ''}), which each device would compute from its own "
        "rows",
        "Make it an nnx.BatchStat of an nnx.BatchNorm (substrax averages those over the "
        "devices), or update it outside the loss, to get the manual step",
    )


def traced_obstacle(traced: Traced, split: tuple[str, ...]) -> tuple[str, str] | None:
    """Why the traced loss cannot run in the manual region, and what would let it, or None.

    Draws from a key that is not an ``nnx.Rngs`` stream would repeat on every device (a
    stream's are one device's, each device computing its rows' share); a sharding in model
    code that names a batch axis cannot be traced where that axis is manual.
    """
    draws = traced.foreign_draws
    if draws:
        return (
            f"the loss draws random numbers from a key that is not an nnx.Rngs stream "
            f"({', '.join(draws)} in its trace), so each device would draw the same numbers "
            "for different rows",
            "Draw from an nnx.Rngs stream the model holds to get the manual step",
        )
    named = traced.naming(split)
    if named:
        return (
            f"the model's code names the batch axes {split} in a sharding "
            f"({', '.join(named)} in its trace), which the manual data-parallel step cannot "
            "trace",
            "Constrain activations with substrax.spmd.constrain and logical names to get the "
            "manual step",
        )
    return None


def all_reduce_extra(plan: ModelPlan, split: tuple[str, ...], wrt: Any, model: nnx.Module) -> int:
    """Bytes per device an all-reduced step moves beyond a reduce-scattered one.

    A gradient sharded over ``n`` devices of ``split`` is reduce-scattered in
    ``(n - 1) x shard`` bytes and all-reduced in twice that.
    """
    sizes = dict(plan.mesh.shape)
    paths = {path for path, _ in variables(nnx.state(model, wrt))}
    extra = 0
    for row in plan.rows:
        axes = {a for entry in row.spec for a in as_axes(entry)} & set(split)
        if row.path in paths and axes:
            extra += row.bytes_per_device * (math.prod(sizes[a] for a in axes) - 1)
    return extra


def param_steps(
    plan: ModelPlan,
    params: Any,
    used: Any,
    path: str,
    split: tuple[str, ...],
    stages: tuple[int, int] | None = None,
) -> tuple[ParamStep, ...]:
    """Each differentiated parameter's specs and gradient reduction on ``path``.

    Args:
      plan: The model's plan.
      params: The differentiated state.
      used: Its shardings where the loss uses them.
      path: ``"manual"`` or ``"xla"``.
      split: The batch axes of size > 1.
      stages: The manual step's stages for a reduce-scatter over every batch axis.
    """
    rows = {row.path: row for row in plan.rows}
    used_by_path = values_by_path(used)
    steps = []
    for name, _ in variables(params):
        row = rows[name]
        optimizer, kept = plan.optimizer_spec_and_reason(row)
        on = tuple(a for e in optimizer for a in as_axes(e) if a in split)
        rest = tuple(a for a in split if a not in on)
        if not split:
            gradient = "none"
        elif path == "xla":
            gradient = f"all-reduce over {split} (XLA)"
        elif on and rest:
            gradient = f"reduce-scatter over {on}, all-reduce over {rest}"
        elif on:
            gradient = f"reduce-scatter over {on}"
            if stages is not None and path == "manual" and set(on) == set(split):
                gradient += f" in 2 stages ({stages[0]} x {stages[1]})"
        else:
            gradient = f"all-reduce over {split}"
        if kept and split and path != "xla":  # ZeRO asked for a slice it could not take
            gradient += f" ({kept})"
        used_spec = used_by_path[name].spec
        steps.append(ParamStep(name, row.spec, used_spec, gradient, optimizer))
    return tuple(steps)


def pipeline_plan(
    plan: ModelPlan,
    stack: str,
    batch_axes: tuple[str, ...],
    pipeline: Any,
    precision: MixedPrecision,
    settings: tuple[tuple[str, str, str], ...],
    grad_dims: Any,
    trained: set[str] | None = None,
    guard: tuple[bool, str, str] = (False, "loss and gradients", "as asked"),
    draws: RowDraws | None = None,
) -> StepPlan:
    """The plan of a pipelined step: its stages, schedule and each parameter's reduction.

    Args:
      plan: The model's plan.
      stack: The attribute holding the layer stack.
      batch_axes: The pipeline's data axes.
      pipeline: The :class:`~substrax.pipeline.Pipeline` that runs the stack.
      precision: The step's policy.
      settings: ``(name, value, reason)`` of the pipeline's options.
      grad_dims: Under ZeRO, the stack leaves' scatter dimensions (None: none).
      trained: The paths ``wrt`` selects (None: every parameter).
      guard: ``(check the updated state, value, reason)`` of the non-finite guard
        (:func:`~substrax_flax._nonfinite.guard_decision`).
      draws: How the model's draws split with a microbatch's rows (None: no streams).
    """
    sizes = dict(plan.mesh.shape)
    split = tuple(a for a in batch_axes if sizes[a] > 1)
    fsdp = pipeline.fsdp_axis
    zero = grad_dims is not None
    steps = []
    for row in plan.rows:
        in_stack = row.path.startswith(f"{stack}/")
        optimizer = plan.optimizer_spec(row)
        on = tuple(a for e in row.spec for a in as_axes(e) if a == fsdp)
        if trained is not None and row.path not in trained:
            gradient = "none: not in wrt (held, never differentiated)"
        elif not split:
            gradient = "none"
        elif in_stack and on:
            rest = tuple(a for a in split if a != fsdp)
            gradient = f"reduce-scatter over {on}" + (f", all-reduce over {rest}" if rest else "")
        elif in_stack and zero:
            gradient = f"reduce-scatter over {split} (ZeRO)"
        elif in_stack:
            gradient = f"all-reduce over {split}"
        else:
            gradient = f"all-reduce over {split} (XLA, outside the stages)"
        used = without_axes(row.spec, set(on) | set(plan.gather_axes))
        steps.append(ParamStep(row.path, row.spec, used, gradient, optimizer))
    decisions = (
        Decision("path", "pipeline", f"the layer stack {stack!r} runs as a pipeline"),
        *(Decision(*line) for line in settings),
        remat_decision(pipeline.remat, plan.mesh,
                       "as asked, per layer: both halves of the split backward recompute what it "
                       "leaves out" if pipeline.timetable.split else "as asked, per stage"),
        Decision("batch axes", str(tuple(batch_axes)), "split each microbatch"),
        Decision("fsdp", repr(fsdp) if fsdp else "none",
                 "each stage gathers its layers once and reduce-scatters their gradients"
                 if fsdp else "the layout has no FSDP axis"),
        Decision("precision", precision_name(precision), "as asked"),
        Decision("guard", guard[1], guard[2]),
    )  # fmt: skip
    if draws is not None:
        share = "each stage computes its microbatch rows' share of the whole batch's"
        decisions += (Decision("random", "one device's draws", f"{draws.describe()}; {share}"),)
    return StepPlan(
        "pipeline", decisions[0].reason, plan.mesh, tuple(batch_axes), (), (), precision,
        pipeline.remat, pipeline.num_microbatches, "keep", 0, tuple(steps), decisions, "",
        guard[0], draws,
    )  # fmt: skip


def precision_name(policy: MixedPrecision) -> str:
    """The name of :data:`~substrax.spmd.PRECISIONS` that ``policy`` is, else its repr."""
    for name in PRECISIONS:
        if as_precision(name) == policy:
            return name
    return repr(policy)
