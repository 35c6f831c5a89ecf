"""make_train_step: one jitted, donated training step that keeps the planned shardings."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from substrax import ShardingWarning, warn_user
from substrax.layout import Layout
from substrax.mesh import MeshRules, as_axes
from substrax.spmd import (
    MixedPrecision,
    as_precision,
    check_rows,
    checkpoint_policy,
    is_replicated_leaf,
    use_rules,
)
from substrax_flax._jitted import (
    Built,
    Gradient,
    JittedStep,
    Update,
    jit_step,
    optimizer_shardings,
    rehome,
)
from substrax_flax._manual import (
    at_use,
    manual_movers,
    manual_rules,
    manual_value_and_grad,
)
from substrax_flax._nonfinite import NonFinite, check_policy, guard_decision
from substrax_flax._optimizer import check_owner
from substrax_flax._per_device import sync_batch_norms
from substrax_flax._pipeline_step import PipelineTrainStep, Stages, pipelined_step
from substrax_flax._plan import LayoutLike, ModelPlan, model_plan, shardings_of
from substrax_flax._remat import Marked, use_remat
from substrax_flax._resolve import Resolver, Rules, Strategy, as_rules
from substrax_flax._state import check_filter, shape_and_dtype, variables
from substrax_flax._step_plan import (
    Decision,
    StepPlan,
    choose_path,
    param_steps,
    precision_name,
    region_stages,
    remat_decision,
    scatter_decision,
    step_mesh,
)
from substrax_flax._streams import RowDraws, row_draws, threefry_obstacle
from substrax_flax._traced import Traced, is_key, trace

__all__ = ["TrainStep", "make_train_step"]

Gather = Literal["keep", "regather"]
DATA_PARALLEL = ("auto", "manual", "xla")


@dataclasses.dataclass(frozen=True)
class Route:
    """Where a step splits the batch and how (:meth:`TrainStep._route`), before tracing."""

    mesh: jax.sharding.Mesh
    decision: Decision
    batch_axes: tuple[str, ...]
    split: tuple[str, ...]
    traced: Callable[..., Traced]
    path: Any
    region: tuple[str, ...]
    drawn: RowDraws | None
    seq_axes: tuple[str, ...]


class TrainStep(JittedStep):
    """A jitted training step; build it with :func:`make_train_step`.

    Calling ``step(model, optimizer, batch)`` runs one step, updates ``model`` and
    ``optimizer`` in place and returns the metrics. ``step.lower(model, optimizer, batch)``
    returns the lowered computation (``.compile()`` it for ``memory_analysis()`` and the HLO).
    The model's shardings come from the plan it remembers (see :func:`make_train_step`).
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        *,
        mesh: jax.sharding.Mesh | None,
        rules: Rules,
        layout: LayoutLike,
        strategy: Strategy,
        compute_rules: MeshRules | None,
        has_aux: bool,
        wrt: Any,
        gather: Gather,
        batch_axes: tuple[str, ...] | None,
        donate: bool,
        on_nonfinite: NonFinite = "skip",
        remat: str = "none",
        data_parallel: str = "auto",
        microbatches: int = 1,
        precision: MixedPrecision | None = None,
        plan: ModelPlan | None = None,
    ):
        """Stores the configuration; compilation happens on the first call.

        Args:
          loss_fn: ``loss_fn(model, batch)`` returning a scalar or ``(scalar, aux)``.
          mesh: The mesh, for a model substrax did not place (else None).
          rules: The rules, for a model substrax did not place (else None).
          layout: The layout, for a model substrax did not place (else None).
          strategy: The strategy, for a model substrax did not place (else None).
          compute_rules: Rules for parameters at the point of use and activations (an
            override; None derives them from the plan).
          has_aux: Whether ``loss_fn`` returns ``(loss, aux)``.
          wrt: The variables that are differentiated and updated.
          gather: ``"keep"`` or ``"regather"`` (see :func:`make_train_step`).
          batch_axes: Mesh axes of the batch's leading dimension (None: the plan's).
          donate: Donate the model and optimizer buffers to the step.
          on_nonfinite: ``"skip"``, ``"raise"`` or ``"apply"`` (see :func:`make_train_step`).
          remat: One of :data:`substrax.spmd.REMAT` (see :func:`make_train_step`).
          data_parallel: ``"auto"``, ``"manual"`` or ``"xla"`` (see :func:`make_train_step`).
          microbatches: Gradient-accumulation slices (see :func:`make_train_step`).
          precision: The mixed-precision policy (see :func:`make_train_step`).
          plan: The plan every model must be laid out by (None: each model's own).
        """
        super().__init__(on_nonfinite)
        self.remat = remat
        self.data_parallel = data_parallel
        self.microbatches = microbatches
        self.precision = precision or MixedPrecision()
        self.loss_fn, self.has_aux, self.wrt = loss_fn, has_aux, wrt
        self.mesh, self.rules, self.layout, self.strategy = mesh, rules, layout, strategy
        self.compute_rules, self.gather = compute_rules, gather
        self.batch_axes, self.donate = batch_axes, donate
        self._given = plan
        self._entry = "make_train_step"

    def _compute(self, plan: ModelPlan, params: Any) -> tuple[Any, MeshRules]:
        """Parameter shardings at the point of use, and the rules for activations."""
        if self.compute_rules is None:
            return plan.compute_shardings(params), plan.compute_rules
        with warnings.catch_warnings():  # the plan already warned about its own parameters
            warnings.simplefilter("ignore", ShardingWarning)
            resolver = Resolver(
                plan.mesh, self.compute_rules, plan.strategy, unknown_names=plan.unknown_names
            )
            compute = ModelPlan(params, resolver).shardings
        return compute, self.compute_rules

    def _loss_fn(self, model_def, compute_shardings, rest_def, region=(), placed=False):
        """The differentiated function: parameters at the point of use, the rest as arrays.

        ``region`` is the manual region's batch axes (empty outside one). ``placed``: the
        parameters arrive at their point of use already (the manual region's movers lay them
        out, cast and name them, and keep them for the backward pass or not).
        """

        def loss_of(params, rest_leaves, batch):
            if not placed:
                params = at_use(params, compute_shardings, self.precision)
            # The other state (rng counts, batch statistics, counters) enters as plain arrays
            # and becomes Variables here, at the trace level that may mutate them.
            rest = jax.tree.unflatten(rest_def, rest_leaves)
            model = nnx.merge(model_def, params, rest)
            if region:  # batch norms reduce their moments over the devices' rows
                sync_batch_norms(model, region)
            out = self.loss_fn(model, self.precision.cast_to_compute(batch))
            loss, aux = _loss_and_aux(out, self.has_aux, bool(region))
            loss, aux = self.precision.cast_to_output((loss, aux))
            return loss, (aux, nnx.state(model, nnx.Not(self.wrt)))

        return loss_of

    def _gradient(self, model_def, compute_shardings, manual, mesh) -> Gradient:
        """The flat step's gradient function: XLA's partitioning, or the manual region.

        ``manual`` is None, or ``(batch axes, movers, scatter_each, draws)`` for the manual
        region over the batch axes.
        """
        region = manual[0] if manual else ()

        def gradient(model_state, batch):
            model = nnx.merge(model_def, model_state)
            _, params, rest = nnx.split(model, self.wrt, ...)
            rest_leaves, rest_def = jax.tree.flatten(rest)
            loss_of = self._loss_fn(model_def, compute_shardings, rest_def, region, bool(manual))
            with use_remat(self.remat) as marked:
                if manual:
                    (loss, (aux, rest)), grads = manual_value_and_grad(
                        loss_of, params, rest_leaves, batch, mesh=mesh, batch_axes=region,
                        movers=manual[1], microbatches=self.microbatches,
                        scatter_each=manual[2], draws=manual[3],
                        regather=self.gather == "regather",
                    )  # fmt: skip
                else:
                    grad_fn = jax.value_and_grad(loss_of, has_aux=True)
                    (loss, (aux, rest)), grads = grad_fn(params, rest_leaves, batch)
            _check_marked(marked)
            return Update(loss, aux, rest, grads)

        return gradient

    def _build(self, model: nnx.Module, optimizer: nnx.Optimizer, batch: Any) -> Built:
        if self._given is not None:
            self._given.adopt(model, "make_train_step(plan=...)")
            plan = self._given
        else:
            plan = model_plan(
                model, self.mesh, self.rules, self.strategy, self.layout, what="make_train_step"
            )
        compute_sh, rules = self._compute(plan, nnx.state(model, self.wrt))
        step_plan, traced = self._step_plan(model, optimizer, batch, plan, compute_sh, rules)
        self._warn_path(step_plan)
        _check_experts(plan, traced)
        mesh = step_plan.mesh
        model_sh = _on(mesh, shardings_of(plan.rows, nnx.state(model), plan.mesh))
        opt_sh = _on(mesh, optimizer_shardings(optimizer, plan))
        used = _on(mesh, compute_sh)
        manual = None
        if step_plan.path == "manual":  # everything the manual region does is in the plan
            manual = (step_plan.region_axes, step_plan.movers, step_plan.scatter_each,
                      step_plan.draws)  # fmt: skip
        self._guard.state_checked = step_plan.check_state
        # Inside the manual region the batch axes are manual: activations and parameters are
        # constrained over the other axes only.
        region = manual[0] if manual else ()
        active = manual_rules(rules, region) if manual else rules
        jitted = jit_step(
            self._gradient(nnx.graphdef(model), used, manual, mesh),
            lambda: use_rules(mesh, active, manual_batch_axes=region),
            (nnx.graphdef(model), nnx.graphdef(optimizer)), (model_sh, opt_sh), mesh,
            on_nonfinite=self._guard.on_nonfinite, check_state=step_plan.check_state,
            donate=self.donate,
        )  # fmt: skip
        home = plan.mesh if mesh is not plan.mesh else None
        return Built(jitted, mesh, step_plan.batch_axes, step_plan.path, step_plan.seq_axes,
                     step_plan, home)  # fmt: skip

    def _step_plan(
        self,
        model: nnx.Module,
        optimizer: nnx.Optimizer,
        batch: Any,
        plan: ModelPlan,
        compute_sh: Any,
        rules: MeshRules,
    ) -> tuple[StepPlan, Callable[[], Traced]]:
        """Every decision of the step, before it is traced; and the loss's trace, on demand.

        ``compute_sh`` and ``rules`` are the parameters' shardings where used and the rules
        for activations (:meth:`_compute`).
        """
        check_owner(optimizer, model, "The train step")
        _check_differentiable(model, self.wrt)
        _check_param_dtype(model, self.wrt, self.precision)
        route = self._route(model, batch, plan, compute_sh, rules, self._row_draws)
        mesh, mesh_decision, batch_axes, split = (
            route.mesh,
            route.decision,
            route.batch_axes,
            route.split,
        )
        traced, path, region, drawn = route.traced, route.path, route.region, route.drawn
        seq_axes = route.seq_axes
        stages = region_stages(mesh, region)
        params = param_steps(plan, nnx.state(model, self.wrt), compute_sh, path.name, split,
                             stages)  # fmt: skip
        stages, scatter_line = scatter_decision(mesh, stages, params)
        states = (nnx.state(model, self.wrt), nnx.state(optimizer))
        check_state, guard_value, guard_reason = guard_decision(states, self._guard.on_nonfinite)
        decisions = (
            Decision("path", path.name, path.reason),
            mesh_decision,
            Decision("batch axes", str(tuple(batch_axes)), _batch_reason(self.batch_axes, plan)),
            Decision("region", str(region) if region else "none",
                     "manual over the batch axes of size > 1 (expert axes stay with XLA)"
                     if region else "XLA partitions the whole step"),
            Decision("precision", precision_name(self.precision), "as asked"),
            remat_decision(self.remat, mesh),
            Decision("microbatches", str(self.microbatches), "as asked"),
            Decision("gather", self.gather,
                     _gather_reason(self.gather, self.microbatches, path.name)),
            Decision("guard", guard_value, guard_reason),
        )  # fmt: skip
        if scatter_line is not None:
            decisions += (scatter_line,)
        if drawn is not None:
            share = "each device computes its rows' share of the whole batch's"
            decisions += (Decision("random", "one device's draws", f"{drawn.describe()}; {share}"),)
        if path.extra_bytes:
            more = "more traffic per device per step than the manual step"
            decisions += (Decision("cost", _megabytes(path.extra_bytes), more),)
        movers, scatter_each = None, False
        if path.name == "manual":  # the region may be empty: accumulation on one replica
            check_global_rows(batch, mesh, region, self.microbatches)
            rows = {row.path: row for row in plan.rows}
            movers = manual_movers(nnx.state(model, self.wrt), rows, region,
                                   _on(mesh, compute_sh), self.precision, plan.layout,
                                   stages)  # fmt: skip
            scatter_each = plan.layout is not None and plan.layout.zero == 2
        step_plan = StepPlan(
            path.name, path.reason, mesh, tuple(batch_axes), region, seq_axes, self.precision,
            self.remat, self.microbatches, self.gather, path.extra_bytes, params, decisions,
            path.advice, check_state, drawn, stages, movers, scatter_each,
        )  # fmt: skip
        return step_plan, traced

    def _route(self, model, batch, plan, compute_sh, rules, row_draws) -> Route:
        """Where the batch is split and how: the mesh, the region, the path, and why.

        ``row_draws(model, mesh, batch, split, traced)`` says how the loss's draws split with
        the rows (or raises ``ValueError`` saying why not).
        """
        batch_axes = self.batch_axes or plan.batch_axes
        if not batch_axes:
            raise ValueError(
                f"{self._entry} needs the batch's mesh axes: pass batch_axes=..., a layout, or "
                f"rules whose 'data' maps to mesh axes (mesh axes: {tuple(plan.mesh.axis_names)})."
            )
        mesh, mesh_decision = step_mesh(plan)
        # The manual region spans the batch axes parameters are whole on where used; expert
        # axes also split the batch, but stay with XLA (the expert layer enters its own region).
        experts = plan.layout.expert_axes if plan.layout is not None else ()
        split = tuple(a for a in batch_axes if dict(mesh.shape)[a] > 1 and a not in experts)
        traced = self._tracer(model, mesh, batch, compute_sh, rules, split)
        if mesh is not plan.mesh:  # the Auto twin: does the model's code run on Auto axes?
            mesh, mesh_decision, traced = self._explicit_if_needed(
                (mesh, mesh_decision, traced), (model, plan.mesh, batch, compute_sh, rules, split)
            )  # fmt: skip
        draws = functools.cache(functools.partial(row_draws, model, mesh, batch, split, traced))
        path = choose_path(self.data_parallel, model, plan, mesh, split, self.precision,
                           self.microbatches, traced, self.wrt, draws)  # fmt: skip
        region = split if path.name == "manual" else ()
        drawn = draws() if path.name == "manual" else None
        seq_axes = plan.layout.context_axes if plan.layout is not None else ()
        _check_sequence_slices(seq_axes, dict(mesh.shape), traced)
        return Route(mesh, mesh_decision, tuple(batch_axes), split, traced, path, region, drawn,
                     seq_axes)  # fmt: skip

    def _warn_path(self, step_plan: StepPlan) -> None:
        """Says, at the user's line, what the step does not do as asked.

        Where ``"auto"`` left the manual step at a cost, and where XLA's step cannot do the
        ``gather`` asked.
        """
        if self.gather == "regather" and step_plan.path == "xla":
            warn_user(
                "make_train_step(gather='regather') is not done on XLA's step "
                f"({step_plan.reason}): it keeps the gathered parameters for the backward "
                "pass, as under 'keep' (a checkpoint policy that refuses their name saves the "
                "unnamed layout they are made from). The manual step gathers them again: "
                "data_parallel='manual', or 'auto' where it keeps the numbers.",
                ShardingWarning,
            )
        if self.data_parallel != "auto" or step_plan.path != "xla" or not step_plan.extra_bytes:
            return  # a switch that costs nothing (no sharded gradient) goes unsaid
        advice = step_plan.advice
        silence = f"{advice}, or pass" if advice else "Pass"
        warn_user(
            f"make_train_step(data_parallel='auto'): {step_plan.reason}; this step runs "
            "XLA's partitioning of the whole batch (it equals one device), which "
            "all-reduces the gradients instead of reduce-scattering them: "
            f"{_megabytes(step_plan.extra_bytes)} more per device per step. {silence} "
            "data_parallel='xla' to silence this.",
            ShardingWarning,
        )

    def _tracer(self, model, mesh, batch, compute_sh, rules, split) -> Callable[..., Traced]:
        """:meth:`_trace` on ``mesh``, cached: ``tracer()`` on the batch, ``tracer(rows)``."""
        return functools.cache(functools.partial(
            self._trace, model, mesh, batch, _on(mesh, compute_sh), rules, split
        ))  # fmt: skip

    def _explicit_if_needed(self, twin, args):
        """The Explicit mesh, for a model whose loss traces there but not on the Auto twin.

        A model written for Explicit axes without specs in its variables' types (specs in
        ``out_sharding`` metadata, ``out_sharding=`` and ``jax.sharding.reshard`` in its
        code, as published models write them) names axes that an Auto mesh refuses. Tried
        in that order, before the step is traced; the plan's ``mesh`` line says which and why.

        Args:
          twin: ``(mesh, decision, traced)`` on the Auto twin.
          args: :meth:`_tracer`'s arguments on the Explicit mesh.

        Returns:
          ``(mesh, decision, traced)``: ``twin`` when its trace succeeds.

        Raises:
          Exception: The twin's error, when the loss traces on neither.
        """
        try:
            twin[2]()
            return twin
        except Exception as error:  # the user's code refused Auto axes, or is wrong
            refused = type(error).__name__
            explicit = self._tracer(*args)
            try:
                explicit()
            except Exception:
                raise error from None
        return args[1], Decision(
            "mesh", "Explicit axes",
            f"the loss traces on the Explicit mesh and not on its Auto twin ({refused}): "
            "the model's code is written for Explicit axes",
        ), explicit  # fmt: skip

    def _row_draws(
        self,
        model: nnx.Module,
        mesh: jax.sharding.Mesh,
        batch: Any,
        split: tuple[str, ...],
        traced: Callable[..., Traced],
    ) -> RowDraws | None:
        """How the loss's draws split with the rows of the manual step's blocks, or None.

        None when the loss draws nothing or the batch is one block. The loss is traced again
        on one block's rows (a device's, or its accumulation slice's) and its draws paired
        with the whole batch's.

        Raises:
          ValueError: Saying why the draws cannot be split with the rows (the step plan then
            keeps XLA's step, which draws one device's numbers by itself).
        """
        whole = traced().draw_shapes
        blocks = math.prod(dict(mesh.shape)[a] for a in split) * self.microbatches
        rows = _global_rows(batch, mesh)
        if not whole or blocks == 1 or rows is None or rows % blocks:
            return None  # no draw, one block, or rows the step refuses by itself
        rest = nnx.state(model, nnx.Not(self.wrt))
        found = threefry_obstacle(jax.tree.leaves(rest))
        if found is not None:
            raise ValueError(found)
        local = traced(rows // blocks).draw_shapes
        kinds = jax.tree.leaves(rest, is_leaf=lambda x: isinstance(x, nnx.Variable))
        counts = [isinstance(v, nnx.RngCount) for v in kinds]
        return row_draws(whole, local, blocks, counts)

    def _trace(
        self,
        model: nnx.Module,
        mesh: jax.sharding.Mesh,
        batch: Any,
        compute: Any,
        rules: MeshRules,
        split: tuple[str, ...],
        rows: int | None = None,
    ) -> Traced:
        """The loss traced (not run) on the global batch, under the manual step's rules.

        substrax's own constraints then leave out the batch axes ``split``, as they do in the
        manual region, so a batch axis a sharding in the trace still names is the model's.
        ``rows``, when given, replaces the batch's rows (the trace :meth:`_row_draws` pairs).
        """
        _, params, rest = nnx.split(model, self.wrt, ...)
        rest_leaves, rest_def = jax.tree.flatten(rest)
        loss_of = self._loss_fn(nnx.graphdef(model), compute, rest_def)
        processes = len({d.process_index for d in mesh.devices.flat})
        abstract = jax.tree.map(functools.partial(_global_leaf, processes), batch)
        if rows is not None:
            abstract = jax.tree.map(functools.partial(_with_rows, rows), abstract)
        params = rehome(params, mesh)
        rules = manual_rules(rules, split) if split else rules
        with use_rules(mesh, rules), jax.set_mesh(mesh), nnx.use_eager_sharding(False):
            streams = (jax.tree.map(lambda _: False, params), [is_key(x) for x in rest_leaves],
                       jax.tree.map(lambda _: False, abstract))  # fmt: skip
            rows = (jax.tree.map(lambda _: False, params), [False] * len(rest_leaves),
                    jax.tree.map(lambda _: True, abstract))  # fmt: skip
            try:
                return trace(loss_of, params, rehome(rest_leaves, mesh), abstract, streams=streams,
                             batch=rows)  # fmt: skip
            except Exception as error:  # the user's loss failed: say how substrax called it
                shapes = jax.tree.map(lambda x: f"{x.dtype}{list(x.shape)}", abstract)
                error.add_note(
                    f"substrax: the train step calls loss_fn(model, batch), with model the "
                    f"{type(model).__name__} and batch {shapes}; it returns the scalar loss "
                    "(or (loss, aux) with has_aux=True)."
                )
                raise

    def data_parallel_for(self, model: nnx.Module, optimizer: nnx.Optimizer, batch: Any) -> str:
        """How this step splits the batch for ``model``: ``"manual"`` or ``"xla"``.

        Args:
          model: The model.
          optimizer: Its optimizer.
          batch: A batch as passed to the step.

        Returns:
          ``step.plan_for(model, optimizer, batch).path``.
        """
        return self.plan_for(model, optimizer, batch).path


def check_global_rows(batch: Any, mesh: Any, split: tuple[str, ...], k: int) -> None:
    """:func:`substrax.spmd.check_rows` for the global batch over ``split``'s devices, ``k`` slices.

    The manual region's ``shard_map`` would raise too, naming its own internals instead.
    """
    rows = _global_rows(batch, mesh)
    if rows is not None:
        devices = math.prod(dict(mesh.shape)[a] for a in split)
        check_rows(rows, devices, split, microbatches=k)


def _global_rows(batch: Any, mesh: jax.sharding.Mesh) -> int | None:
    """The global batch's rows (None for a batch of 0-d leaves only)."""
    processes = len({d.process_index for d in mesh.devices.flat})
    leaves = [x for x in jax.tree.leaves(batch) if not is_replicated_leaf(x)]
    return _global_leaf(processes, leaves[0]).shape[0] if leaves else None


def _with_rows(rows: int, leaf: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    """``leaf`` with ``rows`` rows (0-d leaves, replicated, unchanged)."""
    if not leaf.shape:
        return leaf
    return jax.ShapeDtypeStruct((rows, *leaf.shape[1:]), leaf.dtype)


def _global_leaf(processes: int, leaf: Any) -> jax.ShapeDtypeStruct:
    """A batch leaf's global shape and dtype.

    A host array's rows are this process's slice; a ``jax.Array`` or ``ShapeDtypeStruct``
    is the global leaf already (as :func:`substrax.spmd.shard_batch` reads them).
    """
    shape = tuple(np.shape(leaf))
    if shape and not isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
        shape = (shape[0] * processes, *shape[1:])
    return jax.ShapeDtypeStruct(shape, leaf.dtype)


def _check_sequence_slices(seq_axes, sizes, traced: Callable[[], Traced]) -> None:
    """Raises if the loss slices the batch's sequence where context axes split it.

    Raises:
      ValueError: Naming the slices: each device holds chunks of the sequence (in zigzag
        order), so shifting targets inside the loss shifts each chunk, not the sequence.
    """
    split = tuple(a for a in seq_axes if sizes[a] > 1)
    found = traced().sequence_slices if split else ()
    if found:
        raise ValueError(
            f"The loss slices the batch along its sequence ({', '.join(found)}), but the "
            f"context axes {split} split each row's sequence before the loss runs (each device "
            "holds chunks of it, in zigzag order): the slice would shift each chunk, not the "
            "sequence, and the losses would be silently wrong. Shift before the step: pass "
            "{'inputs': rows[:, :-1], 'targets': rows[:, 1:]} and use them as they are."
        )


def _check_experts(plan: ModelPlan, traced: Callable[[], Traced]) -> None:
    """Warns when expert weights are sharded over expert axes but computed gathered.

    Only code that sends tokens to their experts (``all_to_all``, as
    :func:`substrax.spmd.experts` does) computes an expert where it is stored; a model with
    its own expert einsums has XLA gather the weights over the expert axes every step.
    """
    layout = plan.layout
    sizes = dict(plan.mesh.shape)
    axes = tuple(a for a in (layout.expert_axes if layout is not None else ()) if sizes[a] > 1)
    used = {r.path: plan.compute_spec(r) for r in plan.rows}
    rows = [r for r in plan.rows if set(axes) & {a for e in used[r.path] for a in as_axes(e)}]
    if not rows or traced().dispatches_tokens:
        return
    degree = math.prod(sizes[a] for a in axes)
    moved = 2 * sum(row.bytes_per_device * (degree - 1) for row in rows)
    names = ", ".join(row.path for row in rows[:4]) + (", ..." if len(rows) > 4 else "")
    warn_user(
        f"The layout shards expert weights ({names}) over the expert axes {axes}, but the loss "
        "never sends tokens to their experts (no all_to_all in its trace): XLA gathers the "
        f"weights to compute them and reduces their gradients back, about "
        f"{_megabytes(moved)} per device per step that an expert-parallel step does not move. "
        "Compute the experts with substrax.spmd.experts (or substrax_flax.MixtureOfExperts), "
        "see docs/experts.md, or use a layout without expert axes.",
        ShardingWarning,
    )


def _on(mesh: jax.sharding.Mesh, shardings: Any) -> Any:
    """``shardings`` with each ``NamedSharding`` on ``mesh`` (the step's: maybe a twin)."""

    def move(sharding):
        if isinstance(sharding, NamedSharding) and sharding.mesh != mesh:
            return NamedSharding(mesh, sharding.spec)
        return sharding

    return jax.tree.map(move, shardings)


def _gather_reason(gather: str, microbatches: int, path: str) -> str:
    """What ``gather`` does in this step, and what it costs."""
    if path == "xla":
        kept = "XLA's step keeps the gathered parameters for the backward pass"
        return f"as asked: {kept}" if gather == "keep" else f"not done: {kept} (see warning)"
    if gather == "keep":
        kept = "as asked: each parameter gathered where used, kept for the backward pass"
        return kept + (f" and for all {microbatches} slices" if microbatches > 1 else "")
    again = "as asked: gathered again in the backward pass (twice the all-gathers)"
    if microbatches > 1:
        again += f"; FSDP parameters per slice ({microbatches}x the collectives of one slice)"
    return again


def _batch_reason(asked: tuple[str, ...] | None, plan: ModelPlan) -> str:
    if asked:
        return "batch_axes as asked"
    if plan.layout is not None:
        return f"the {plan.layout.name} layout's batch axes"
    return "the rules' 'batch' / 'data' axes"


def _megabytes(count: int) -> str:
    return f"{count / 2**20:.1f} MiB"


def _check_marked(marked: Marked) -> None:
    """Warns when a remat policy was asked for but no block was marked to apply it to."""
    if marked.remat != "none" and marked.blocks == 0:
        warn_user(
            f"make_train_step(remat={marked.remat!r}) found no block marked with "
            "@substrax_flax.remat: nothing is recomputed. Decorate your blocks' __call__.",
            RuntimeWarning,
        )


def _loss_and_aux(out: Any, has_aux: bool, manual: bool = False) -> tuple[jax.Array, Any]:
    """``(loss, aux)`` from what ``loss_fn`` returned, with errors that say what is wrong.

    Raises:
      TypeError: If ``out`` does not match ``has_aux``, or the loss is not a scalar.
    """
    if has_aux and not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise TypeError(
            f"has_aux=True, so loss_fn must return (loss, aux); it returned {_describe(out)}. "
            "Return a pair, or leave has_aux out."
        )
    if not has_aux and isinstance(out, (tuple, list)):
        raise TypeError(
            f"loss_fn returned {_describe(out)}; for (loss, aux) pass has_aux=True to "
            "make_train_step, else return the scalar loss alone."
        )
    loss, aux = out if has_aux else (out, None)
    if isinstance(loss, (int, float)):
        raise TypeError(
            f"loss_fn returned a Python {type(loss).__name__} ({loss!r}): a constant, with no "
            "gradient. Return the loss as a jax scalar computed from the model's output (for "
            "example jnp.mean(...)), not float(...) of one."
        )
    if getattr(loss, "shape", None) != ():
        where = " (on one device's rows: the step is data_parallel='manual')" if manual else ""
        raise TypeError(f"The loss must be a scalar; loss_fn returned {_describe(loss)}{where}.")
    return loss, aux


def check_takes_model_and_batch(fn: Callable[..., Any], name: str, what: str) -> None:
    """Raises now, not at the first step, if ``fn`` cannot be called as ``fn(model, batch)``.

    A function whose signature Python cannot read (a builtin, a C extension) is not checked.

    Raises:
      TypeError: Naming ``fn``'s signature and the call the step makes, with the fix.
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(None, None)
    except TypeError:
        label = getattr(fn, "__name__", type(fn).__name__)
        raise TypeError(
            f"{what} calls {name}(model, batch) with the batch as one pytree; {label}{signature} "
            f"cannot be called so. Take the batch whole, e.g. lambda model, batch: "
            f"{label}(model, batch['x'], batch['y'])."
        ) from None


def _describe(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    if hasattr(value, "shape"):
        return f"an array of shape {tuple(value.shape)} and dtype {value.dtype}"
    return f"a {type(value).__name__}"


def _dtypes(model: nnx.Module, wrt: Any) -> list[tuple[str, Any]]:
    """``(path, dtype)`` of every variable of ``model`` that ``wrt`` selects."""
    return [(path, shape_and_dtype(v)[1]) for path, v in variables(nnx.state(model, wrt))]


def _check_differentiable(model: nnx.Module, wrt: Any) -> None:
    """Raises if a variable to differentiate is not floating point (jax's error lacks its name).

    Raises:
      TypeError: Naming each such variable, and what to do.
    """
    bad = [
        f"{path} ({dtype})"
        for path, dtype in _dtypes(model, wrt)
        if not jax.numpy.issubdtype(dtype, jax.numpy.inexact)
    ]
    if bad:
        name = getattr(wrt, "__name__", repr(wrt))
        raise TypeError(
            f"These variables are differentiated (wrt={name}) but are not floating point: "
            f"{', '.join(bad)}. Hold integer state in an nnx.Variable subclass other than "
            "nnx.Param (or pass a wrt that leaves it out)."
        )


def _check_param_dtype(model: nnx.Module, wrt: Any, precision: MixedPrecision) -> None:
    """Raises if the policy names a parameter dtype the stored parameters do not have.

    Raises:
      TypeError: Naming the first parameter of another dtype.
    """
    if precision.param_dtype is None:
        return
    for path, dtype in _dtypes(model, wrt):
        if dtype != precision.param_dtype:
            raise TypeError(
                f"The precision policy stores parameters in {precision.param_dtype.name}, but "
                f"{path} is {dtype}. Create the model with param_dtype="
                f"{precision.param_dtype.name}, or pass precision='mixed' (float32 master "
                "weights, bfloat16 compute) or a policy with param_dtype=None."
            )


def _axes(value: Sequence[str] | str | None) -> tuple[str, ...] | None:
    """``batch_axes`` as a tuple (None stays None).

    Raises:
      TypeError: If it is not a mesh axis name or a sequence of them.
    """
    if value is None:
        return None
    axes = as_axes(value) if isinstance(value, (str, Sequence)) else None
    if axes is None or not all(isinstance(a, str) for a in axes):
        raise TypeError(
            f"batch_axes must be a mesh axis name or a sequence of them, such as ('data',); "
            f"got {value!r}."
        )
    return tuple(axes)


def make_train_step(
    loss_fn: Callable[..., Any] | Stages,
    mesh: jax.sharding.Mesh | None = None,
    rules: Rules = None,
    *,
    layout: LayoutLike = None,
    strategy: Strategy = None,
    compute_rules: Rules = None,
    has_aux: bool = False,
    wrt: Any = nnx.Param,
    gather: Gather = "keep",
    batch_axes: Sequence[str] | str | None = None,
    donate: bool = True,
    on_nonfinite: NonFinite = "skip",
    remat: str = "none",
    data_parallel: str = "auto",
    microbatches: int = 1,
    precision: MixedPrecision | str | None = None,
    plan: ModelPlan | None = None,
) -> TrainStep | PipelineTrainStep:
    """Builds a jitted training step that realises the model's layout, at its best by default.

    One step for every layout: given a loss function it splits the batch (XLA's partitioning
    or the manual region, :attr:`TrainStep.plan` says which and why); given :class:`Stages`
    (``make_train_step(Stages(embed, layer, head, stack="blocks"), microbatches=4)``) it runs
    the model's layer stack as a pipeline over the stage axis (a ``pp`` layout), the
    embedding and head data parallel; both are the same step body around another gradient
    function.

    The step differentiates ``loss_fn`` with respect to ``wrt``, applies the optimizer, and
    returns the whole new state, so no update is lost (the trap of a ``jax.jit`` step that
    returns only the model). Parameters and optimizer state are pinned to their planned
    shardings on the way in and out, so they do not drift, and their buffers are donated.

    The shardings come from the plan the model remembers (a model from
    :func:`create_sharded_model` or :func:`shard_model`): ``make_train_step(loss_fn)`` needs
    nothing else. ``mesh``, ``rules``, ``layout`` and ``strategy`` are for a model substrax did
    not place (given for a model with a plan, they must agree with it).

    Each parameter is used in its compute layout: its planned spec without the batch axes.
    A parameter sharded over an axis that also splits the batch (FSDP, HSDP, FSDP + TP) is
    thus gathered once per step and its gradient reduced back to its shard, whether the model
    is annotated or planned by a strategy; tensor-parallel and stage axes are kept.
    :func:`substrax.spmd.constrain` in model code resolves through the matching compute rules
    (the parameter rules gathered over the batch axes).

    Args:
      loss_fn: ``loss_fn(model, batch)`` returning a scalar loss, or ``(loss, aux)`` with
        ``has_aux=True``; or the model's :class:`Stages` for a pipelined step (whose
        ``head`` returns the loss; ``strategy``, ``compute_rules``, ``gather`` and
        ``data_parallel`` are the flat step's alone).
      mesh: For a model substrax did not place: the device mesh.
      rules: For a model substrax did not place: its parameter rules.
      layout: For a model substrax did not place: its layout (or layout name).
      strategy: For a model substrax did not place: its strategy.
      compute_rules: An override: rules for parameters at the point of use and for
        activations, instead of the plan's gathered rules.
      has_aux: Whether ``loss_fn`` returns ``(loss, aux)``.
      wrt: The variables to differentiate and update, as for ``nnx.Optimizer``.
      gather: ``"keep"`` keeps gathered parameters from the forward pass for the backward pass
        (less traffic); ``"regather"`` gathers them again in the backward pass (less memory).
        Either way the manual step gathers each parameter where the loss uses it, a stacked
        one layer by layer inside the scan that runs it (see docs/step.md).
      batch_axes: The mesh axes of the batch's leading dimension; by default the layout's
        :attr:`~substrax.layout.Layout.batch_axes` (its data, FSDP and expert axes: the
        name is the layout's, whose ``data_axes`` are its replica axes only), or the rules'
        ``batch`` / ``data`` axes.
      donate: Donate the model and optimizer buffers to the step.
      on_nonfinite: What a step whose loss or gradients hold a NaN or inf does; it always
        returns ``metrics["finite"] == False``. ``"skip"`` (the default) leaves the model
        and optimizer state unchanged and emits a :class:`NonFiniteWarning` naming the step
        (once the flag is ready, at the latest during the next call, so the host never waits
        for the device); ``"raise"`` leaves them unchanged, waits for the flag and raises
        ``FloatingPointError``; ``"apply"`` applies the update anyway and warns (for a run
        that handles non-finite values itself, such as dynamic loss scaling). The guard runs
        the update inside ``lax.cond``: measured, it costs no temporary memory and no
        traffic beyond one all-reduced flag.

      remat: Which activations of the blocks marked with :func:`remat` the backward pass
        keeps, as the planner names it: ``"none"`` (all: no recomputation, the fastest),
        ``"selective"`` (the outputs of products with the weights; element-wise work and
        attention scores are recomputed) or ``"full"`` (only each block's input: the block
        is recomputed). Blocks are recomputed one at a time. With no marked block a
        ``RuntimeWarning`` says that nothing is recomputed. A pipeline applies it per stage
        (GPipe, circular) or per layer (the split schedules).
      data_parallel: How the batch axes are split. ``"manual"``: each device computes the
        loss of its own rows inside ``shard_map`` over the batch axes, gathers FSDP
        parameters with ``all_gather`` and reduce-scatters their gradients (on every
        backend: FSDP over 8 moves 35.0 MiB per step on the benchmark decoder instead of
        52.5; FSDP 2 + TP 4 24.5 instead of 27.1); the loss is the mean of the devices'
        losses, as in PyTorch's DDP and FSDP: exact for a loss that is a mean over rows, not
        for one normalised by a count over the whole batch (a token-weighted mean over a
        padded batch), for which pass ``"xla"``. ``"xla"``: XLA partitions the whole step
        (the loss is the whole batch's; the gradients are all-reduced). ``"auto"`` (the
        default) is ``"manual"`` unless that would change the model's numbers -- batch
        statistics outside ``nnx.BatchNorm`` (a BatchNorm's moments are reduced over the
        devices, so it stays manual), random draws from a key that is not an ``nnx.Rngs``
        stream (each device would draw the same numbers; an ``nnx.Rngs`` stream's draw is
        split with the rows, each device computing its share of one device's draw, so
        dropout stays manual), or a mesh with Explicit axes -- and
        then ``"xla"``, with a warning where it costs traffic;
        :meth:`TrainStep.data_parallel_for` says which.
      microbatches: Gradient accumulation (in the manual step): each device runs its rows as
        this many slices, one after the other, and the gradients are reduced once per step
        (the reductions do not grow with it; activations are held for one slice; ``zero2``
        layouts reduce each slice's). The loss is the mean of the slices' losses. With one
        replica (batch axes of size 1) the slices run without a manual region. For
        :class:`Stages`, the pipeline's microbatches: with a split schedule activation
        memory is bounded by the stages, not by them, and more of them shrink the bubble.
      precision: A :class:`substrax.spmd.MixedPrecision` policy or a name of
        :data:`substrax.spmd.PRECISIONS`, as the planner names them: ``"mixed"`` (float32
        master weights and optimizer state, bfloat16 gathers, compute and gradient
        reductions, float32 loss), ``"bf16"`` (parameters stored in bfloat16 too) or
        ``"f32"`` / None (as stored). Parameters and floating-point batch leaves are cast
        at the point of use; the optimizer sees gradients in the stored dtype. In the
        manual step the gathers and reductions run in the policy's dtypes (bf16 halves
        their traffic); with ``data_parallel="xla"`` XLA chooses where to cast, and its
        collectives may stay in the stored dtype.
      plan: The :class:`ModelPlan` the step runs, instead of the one each model remembers
        (a copy of a placed model whose plan is gone, for one); every model the step is
        called with must be laid out by it. Not with ``mesh``, ``rules``, ``layout`` or
        ``strategy``, which the plan holds.

    Returns:
      A :class:`TrainStep`, or a :class:`PipelineTrainStep` for :class:`Stages`.

    Raises:
      TypeError: If ``loss_fn`` is not callable (nor :class:`Stages`), a flat step's option
        comes with :class:`Stages`, or ``plan`` comes with ``mesh``, ``rules``,
        ``layout`` or ``strategy``; on the first call, if ``loss_fn``'s result
        does not match ``has_aux`` or is not a scalar, or a differentiated variable is not
        floating point.
      ValueError: If ``gather`` is not ``"keep"`` or ``"regather"``, ``on_nonfinite`` is not
        ``"skip"``, ``"raise"`` or ``"apply"``, ``remat`` is not one of ``REMAT``,
        ``data_parallel`` is not one of ``DATA_PARALLEL``, ``microbatches`` is not a positive
        integer (or is above 1 with ``data_parallel="xla"``), or no data axes are known
        (here when ``rules`` are given, else at the first call); on the first call, if
        ``"manual"`` or ``microbatches`` above 1 would change the model's numbers, the
        manual step's batch rows do not split evenly over its batch axes (and each device's
        into ``microbatches``), or ``precision`` names a parameter dtype the parameters do
        not have (TypeError).
    """
    if isinstance(loss_fn, Stages):
        flat = {"strategy": strategy, "compute_rules": compute_rules}
        flat = [name for name, value in flat.items() if value is not None]
        flat += ["gather"] if gather != "keep" else []
        flat += ["data_parallel"] if data_parallel != "auto" else []
        flat += ["plan"] if plan is not None else []
        if flat:
            raise TypeError(
                f"make_train_step(Stages(...)) runs a pipeline; {', '.join(flat)} are the flat "
                "step's options: leave them out."
            )
        return pipelined_step(
            loss_fn, mesh, rules, layout=layout, microbatches=microbatches, remat=remat,
            batch_axes=batch_axes, on_nonfinite=on_nonfinite, precision=precision,
            donate=donate, has_aux=has_aux, wrt=wrt,
        )  # fmt: skip
    if not callable(loss_fn):
        raise TypeError(
            f"loss_fn must be a function loss_fn(model, batch) -> loss, got "
            f"{type(loss_fn).__name__} {loss_fn!r:.80}."
        )
    check_takes_model_and_batch(loss_fn, "loss_fn", "make_train_step")
    if gather not in ("keep", "regather"):
        raise ValueError(f"gather must be 'keep' or 'regather', got {gather!r}.")
    given = {"mesh": mesh, "rules": rules, "layout": layout, "strategy": strategy}
    given = sorted(name for name, value in given.items() if value is not None)
    if plan is not None and given:
        raise TypeError(
            f"make_train_step: plan= holds the {', '.join(given)}; pass the plan or "
            f"{', '.join(given)}, not both."
        )
    check_filter(wrt)
    check_policy(on_nonfinite)
    checkpoint_policy(remat)  # raises for an unknown name
    if data_parallel not in DATA_PARALLEL:
        raise ValueError(f"data_parallel must be one of {DATA_PARALLEL}, got {data_parallel!r}.")
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise ValueError(f"microbatches must be a positive integer, got {microbatches!r}.")
    if microbatches > 1 and data_parallel == "xla":
        raise ValueError(
            f"microbatches={microbatches} runs in the manual data-parallel step; "
            "data_parallel='xla' has none. Pass data_parallel='auto' or 'manual'."
        )
    compute = as_rules(compute_rules, mesh) if compute_rules is not None else None
    axes = _axes(batch_axes)
    if axes is None and rules is not None and layout is None:
        table = as_rules(rules, mesh).as_dict()
        if not (table.get("batch") or table.get("data")):
            raise ValueError(
                "make_train_step needs the batch's mesh axes: pass batch_axes=..., a layout, or "
                "rules whose 'data' maps to mesh axes"
                + (f" (mesh axes: {tuple(mesh.axis_names)})." if mesh is not None else ".")
            )
    if isinstance(layout, Layout) and mesh is not None:
        layout.check_mesh(mesh)
    return TrainStep(
        loss_fn, mesh=mesh, rules=rules, layout=layout, strategy=strategy, compute_rules=compute,
        has_aux=has_aux, wrt=wrt, gather=gather, batch_axes=axes, donate=donate,
        on_nonfinite=on_nonfinite, remat=remat, data_parallel=data_parallel,
        microbatches=microbatches, precision=as_precision(precision), plan=plan,
    )  # fmt: skip
