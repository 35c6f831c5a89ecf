"""The pipelined training step: a Flax NNX model whose layer stack runs as a pipeline.

``make_train_step(Stages(embed, layer, head, stack="blocks"), microbatches=M)`` builds it:
the one step body (:func:`~substrax_flax._jitted.jit_step`) around a pipeline schedule's
gradient function.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from substrax import ShardingWarning, warn_user
from substrax.mesh import PipelineParallelStrategy, as_axes, check_mesh
from substrax.pipeline import Pipeline, microbatch_index
from substrax.spmd import MixedPrecision, as_precision, use_rules
from substrax_flax._jitted import (
    Built,
    JittedStep,
    Update,
    aux_metrics,
    jit_step,
    optimizer_shardings,
)
from substrax_flax._manual import manual_rules
from substrax_flax._nonfinite import NonFinite, check_policy, guard_decision
from substrax_flax._plan import LayoutLike, model_plan, shardings_of
from substrax_flax._resolve import Rules, without_axes
from substrax_flax._state import check_filter, map_variables, variables
from substrax_flax._step_plan import pipeline_plan
from substrax_flax._streams import RowDraws, on_rows, row_draws, threefry_obstacle
from substrax_flax._traced import is_key, trace

__all__ = ["PipelineTrainStep", "Stages", "pipelined_step"]


def _check_state(state: Any, what: str) -> None:
    """Parameters and random streams run through stages; other state is refused.

    Raises:
      ValueError: Naming the other variables' types (batch statistics, caches).
    """
    leaves = jax.tree.leaves(state, is_leaf=_is_variable)
    kinds = {type(v).__name__ for v in leaves if not isinstance(v, (nnx.Param, nnx.RngState))}
    if kinds:
        raise ValueError(
            f"The pipelined step runs models whose {what} holds nnx.Param variables and "
            f"random streams (nnx.Rngs, nnx.Dropout); found {sorted(kinds)}, state that a "
            "stage would have to update per microbatch (batch statistics: use a LayerNorm "
            "or RMSNorm in the stack, or train with make_train_step, which reduces them "
            "over the batch)."
        )


def _on_microbatch_rows(state: Any, draws: RowDraws | None, batch_axes: Sequence[str]) -> Any:
    """Inside a stage: the stream keys drawing this microbatch's and device's rows' share.

    Microbatch ``m`` holds the batch's rows ``m, m + M, ...``, split over the batch axes, so
    the keys' block is the device's position there and their phase ``m``.
    """
    index = microbatch_index()
    if index is None or draws is None:
        return state  # a shape check, or no draws
    block = jax.lax.axis_index(tuple(batch_axes)) if batch_axes else 0
    leaves, treedef = jax.tree.flatten(state)
    return jax.tree.unflatten(treedef, on_rows(leaves, draws, block, index))


def _split(state: nnx.State, wrt: Any) -> tuple[nnx.State, nnx.State]:
    """``(the variables wrt selects, the others)`` of ``state``."""
    return nnx.filter_state(state, wrt, ...)


def _is_variable(node: Any) -> bool:
    return isinstance(node, nnx.Variable)


@dataclasses.dataclass(frozen=True)
class Stages:
    """A model's pipeline: the parts :func:`~substrax_flax.make_train_step` runs as stages.

    ``make_train_step(Stages(embed, layer, head, stack="blocks"), microbatches=4)`` runs the
    model's layer stack through a :class:`substrax.pipeline.Pipeline`: ``embed`` on every
    device (data parallel), the stack over the stage axis, ``head`` on the last stage for
    each microbatch.

    Attributes:
      embed: ``embed(model, batch) -> (inputs, targets)``: what enters the stack, and the
        targets the head needs (both with the batch's leading dimension).
      layer: ``layer(layer_module, x) -> x`` with ``layer_module`` one layer of the stack.
      head: ``head(model, y, targets) -> loss`` (or ``(loss, aux)`` with ``has_aux=True``):
        a microbatch's mean loss from the stack's output.
      stack: The model attribute holding the stacked layers (``nnx.vmap`` with
        ``transform_metadata={nnx.PARTITION_NAME: "layers"}``).
      schedule: One of :data:`substrax.pipeline.SCHEDULES`: ``"gpipe"``, ``"1f1b"``,
        ``"circular"``, ``"interleaved"`` or ``"zb-h1"`` (see
        :class:`substrax.pipeline.Pipeline`; the plan's ``schedule`` line shows its idle
        share and the activations it holds). The default, ZB-H1, idles least of the
        schedules with one chunk per stage (about a third of 1F1B's bubble) and holds one
        microbatch more than 1F1B, flat in the microbatches; GPipe holds every microbatch.
      repeats: Chunks of layers per stage: rounds of the ring for ``"circular"``, virtual
        stages per device for ``"interleaved"``.
      num_layers: The real layer count of a stack stored padded: a stack whose layers do
        not divide the stages cannot be sharded over the stage axis, so build it with
        :meth:`PipelineTrainStep.num_slots` layers (126 layers on 16 stages: 128) and give
        ``num_layers``; the padding slots are masked (identity, zero gradients). None: every
        stored layer is real.
      stage_axis: The mesh axis of the pipeline stages.

    Raises:
      TypeError: If a function is not callable or ``stack`` is not a str.
      ValueError: If ``repeats`` is not a positive integer.
    """

    embed: Callable[[nnx.Module, Any], tuple[jax.Array, jax.Array]]
    layer: Callable[[nnx.Module, jax.Array], jax.Array]
    head: Callable[[nnx.Module, jax.Array, jax.Array], Any]
    stack: str
    schedule: str = "zb-h1"
    repeats: int = 1
    num_layers: int | None = None
    stage_axis: str = "pipe"

    def __post_init__(self):
        for name in ("embed", "layer", "head"):
            fn = getattr(self, name)
            if not callable(fn):
                raise TypeError(f"{name} must be a function, got {type(fn).__name__} {fn!r:.80}.")
        if not isinstance(self.stack, str):
            raise TypeError(
                f"stack must name the model's attribute holding the layer stack (a str such "
                f"as 'blocks'), got {self.stack!r}."
            )
        _check_count("repeats", self.repeats)


def _check_count(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")


class PipelineTrainStep(JittedStep):
    """A jitted training step whose layer stack runs through a :class:`substrax.pipeline.Pipeline`.

    Build it with :func:`~substrax_flax.make_train_step` and :class:`Stages`; call it like a
    :class:`TrainStep`. Each model (graph definition) gets its own immutable
    :class:`~substrax.pipeline.Pipeline`, built with that model's layer and head functions.
    """

    def __init__(
        self,
        stages: Stages,
        *,
        mesh: jax.sharding.Mesh | None,
        rules: Rules,
        layout: LayoutLike,
        microbatches: int,
        remat: bool | str = "none",
        batch_axes: Sequence[str] | None = None,
        on_nonfinite: NonFinite = "skip",
        precision: MixedPrecision | None = None,
        donate: bool = True,
        has_aux: bool = False,
        wrt: Any = nnx.Param,
    ):
        """Stores the configuration; see :func:`~substrax_flax.make_train_step`.

        Args:
          stages: The model's pipeline parts.
          mesh: The mesh (None: the model's plan's, at the first call).
          rules: The rules, for a model substrax did not place.
          layout: The layout, for a model substrax did not place.
          microbatches: Microbatches per batch.
          remat: One of :data:`substrax.spmd.REMAT`.
          batch_axes: Mesh axes of the batch (None: the plan's batch axes but the stage axis).
          on_nonfinite: ``"skip"``, ``"raise"`` or ``"apply"`` (see :func:`make_train_step`).
          precision: The mixed-precision policy.
          donate: Donate the model and optimizer buffers to the step.
          has_aux: Whether the head returns ``(loss, aux)``.
          wrt: The variables that are differentiated and updated.
        """
        super().__init__(on_nonfinite)
        self.stages = stages
        self.precision = precision or MixedPrecision()
        self.embed_fn, self.user_layer_fn, self.head_fn = stages.embed, stages.layer, stages.head
        self.mesh, self.rules, self.layout = mesh, rules, layout
        self.stack, self.stage_axis, self.num_layers = (
            stages.stack,
            stages.stage_axis,
            stages.num_layers,
        )
        self.microbatches, self.remat = microbatches, remat
        self.batch_axes = tuple(batch_axes) if batch_axes is not None else None
        self.donate, self.has_aux, self.wrt = donate, has_aux, wrt
        self._runners: dict[tuple, tuple[Callable[..., Pipeline], tuple]] = {}
        if mesh is not None:
            self._runner(mesh)  # checks the stages against the mesh now

    def _runner(
        self, mesh: jax.sharding.Mesh, forward: bool = False
    ) -> tuple[Callable[..., Pipeline], tuple]:
        """``(make_pipeline, settings)`` on ``mesh``: the runner's factory and the plan lines.

        ``forward``: the runner of an evaluation, whose schedule runs the forward pass alone
        (:meth:`forward_schedule`).

        Raises:
          ValueError: If ``mesh`` has no stage axis, or as :class:`substrax.pipeline.Pipeline`.
        """
        check_mesh(mesh)
        if (mesh, forward) not in self._runners:
            schedule = self.forward_schedule() if forward else self.stages.schedule
            self._runners[mesh, forward] = self._make_runner(mesh, schedule)
        return self._runners[mesh, forward]

    def forward_schedule(self) -> str:
        """The schedule an evaluation runs: the training schedule's forward pass.

        One chunk of layers per stage: GPipe's forward (every schedule with one chunk stores
        the stack alike). Several chunks: circular's forward, for ``"circular"`` itself and
        for ``"interleaved"``, which lays the chunks out as circular does (chunk ``c`` of
        stage ``s`` holds virtual stage ``c S + s``); like circular's, it needs at least as
        many microbatches as stages.

        Returns:
          The schedule's name: ``"gpipe"`` or ``"circular"``.
        """
        return "gpipe" if self.stages.repeats == 1 else "circular"

    def _make_runner(
        self, mesh: jax.sharding.Mesh, schedule: str
    ) -> tuple[Callable[..., Pipeline], tuple]:
        axis = self.stage_axis
        if axis not in mesh.axis_names:
            raise ValueError(
                f"stage_axis {axis!r} is not a mesh axis; the mesh has {tuple(mesh.axis_names)}."
            )
        strategy = PipelineParallelStrategy(axis, tuple(mesh.axis_names).index(axis),
                                            dict(mesh.shape)[axis])  # fmt: skip
        options = dict(num_microbatches=self.microbatches, schedule=schedule,
                       repeats=self.stages.repeats, remat=self.remat)  # fmt: skip
        batch_axes = self.batch_axes or tuple(a for a in mesh.axis_names if a != axis)
        timetable = Pipeline(lambda p, x: x, lambda y, t: 0.0, mesh, strategy,
                             batch_axes=batch_axes, **options).timetable  # fmt: skip

        def make_pipeline(layer_fn, loss_fn, **extra):
            return Pipeline(layer_fn, loss_fn, mesh, strategy, **options, **extra)

        repeats = self.stages.repeats
        settings = (
            ("stages", f"{strategy.num_stages} on {axis!r}", "the mesh's stage axis"),
            ("schedule", f"{schedule}" + (f" x {repeats} chunks" if repeats > 1 else ""),
             f"as asked: idle {timetable.idle_fraction():.3f} of the stages' ticks, "
             f"{timetable.held()} microbatch chunks of activations held per stage"),
            ("microbatches", str(self.microbatches), "as asked"),
        )  # fmt: skip
        return make_pipeline, settings

    def num_slots(self, num_layers: int) -> int:
        """The layers a stack of ``num_layers`` is stored with on this step's stages.

        Args:
          num_layers: The real layer count.

        Returns:
          ``Pipeline.num_slots(num_layers)``: ``num_layers`` when the stages divide it, else
          the padded count to build the stack with (then pass ``num_layers`` to
          :class:`Stages`).

        Raises:
          ValueError: If there are fewer layers than stages (or chunks, for circular), or the
            step was made without a mesh (the stage count comes from it).
        """
        if self.mesh is None:
            raise ValueError(
                "num_slots needs the stage count: make the step with mesh=... (the stack's "
                "size is chosen before the model exists)."
            )
        make_pipeline, _ = self._runner(self.mesh)
        return make_pipeline(lambda p, x: x, lambda y, t: 0.0).num_slots(num_layers)

    def _parts(self, model: nnx.Module):
        state = nnx.state(model)
        if self.stack not in state:
            raise ValueError(
                f"The model has no attribute {self.stack!r} holding the layer stack; its "
                f"top-level attributes are {sorted(state)}."
            )
        stack = state[self.stack]
        return stack, self._rest(state)

    def _rest(self, state: nnx.State) -> nnx.State:
        """Every top-level attribute of the model's state but the stack."""
        return nnx.State({k: v for k, v in state.items() if k != self.stack})

    def _build(self, model: nnx.Module, optimizer: nnx.Optimizer | None, batch: Any,
               forward: bool = False):  # fmt: skip
        """The training step's program, or with ``forward`` (no optimizer) an evaluation's.

        An evaluation runs the embedding, the stack through :meth:`forward_schedule`'s
        forward pass and the head, and returns the head's loss (and aux) averaged over the
        microbatches: no gradient, no update, nothing moved back.
        """
        stack, rest = self._parts(model)
        model_def = nnx.graphdef(model)
        layer_def = nnx.graphdef(getattr(model, self.stack))
        _check_state(stack, f"stack {self.stack!r}")
        _check_state(rest, "other attributes")
        stored = jax.tree.leaves(stack)[0].shape[0]
        num_layers = self.num_layers or stored
        plan = model_plan(model, self.mesh, self.rules, None, self.layout,
                          what="make_train_step(Stages(...))")  # fmt: skip
        make_pipeline, settings = self._runner(plan.mesh, forward)
        model_shardings = shardings_of(plan.rows, nnx.state(model), plan.mesh)
        batch_axes = self.batch_axes
        if batch_axes is None:  # the plan's batch axes
            batch_axes = tuple(a for a in plan.batch_axes if a != self.stage_axis)
        grad_dims = _grad_dims(plan, self.stack, stack, batch_axes)
        fsdp_axis, fsdp_dims = _fsdp(plan, self.stack, batch_axes)
        # ZeRO's scatter dimensions of the trained leaves: the pipeline differentiates those
        trained_dims = None if grad_dims is None else _split(grad_dims, self.wrt)[0]
        outer = plan.compute_rules  # the embedding runs on the global batch, with XLA
        # inside the pipeline's map the stage and data axes are manual: rules without them
        manual = (self.stage_axis, *batch_axes)
        inner = manual_rules(outer, manual)

        compute = self.precision.cast_to_compute

        def merged(stack_state, rest_state):
            full = nnx.State({**dict(rest_state), self.stack: stack_state})
            return nnx.merge(model_def, full)

        def in_stage():
            return use_rules(plan.mesh, inner, manual_batch_axes=batch_axes)

        def layer_fn(layer_state, x):
            # with frozen variables (wrt leaves some out) a layer's state comes in two parts
            parts = layer_state if frozen_stack else (layer_state,)
            parts = (*parts[:1], *(_on_microbatch_rows(p, draws, batch_axes) for p in parts[1:]))
            with in_stage():
                layer = nnx.merge(layer_def, *(compute(part) for part in parts))
                y = self.user_layer_fn(layer, x)
            return compute(y)  # a layer with its own dtype: back to the policy's at the boundary

        def loss_fn(rest_frozen, y, targets, rest_state):
            with in_stage():
                held = _on_microbatch_rows(rest_frozen, draws, batch_axes)
                rest = compute(nnx.merge_state(rest_state, held))
                out = self.head_fn(merged(stack_template, rest), y, targets)
            return self.precision.cast_to_output(_loss_and_aux(out, self.has_aux))

        def make(rest_frozen=None):
            return make_pipeline(
                layer_fn, functools.partial(loss_fn, rest_frozen), batch_axes=batch_axes,
                fsdp_axis=fsdp_axis, fsdp_dims=fsdp_dims, has_aux=self.has_aux,
            )  # fmt: skip

        def flat(stack_state, rest_state, batch):
            """The model on one device: embedding, every layer in turn, head."""
            model = merged(stack_state, rest_state)
            inputs, targets = self.embed_fn(model, batch)

            def one(x, layer_state):
                return self.user_layer_fn(nnx.merge(layer_def, layer_state), x), None

            y, _ = jax.lax.scan(one, inputs, stack_state)
            return self.head_fn(merged(stack_template, rest_state), y, targets)

        def advanced(stack_state, rest_state, batch):
            """The streams' counts after one step on one device (XLA keeps only these).

            The embedding, each layer and the head run once, as one device runs them.
            """
            model = merged(stack_state, rest_state)
            inputs, targets = self.embed_fn(model, batch)
            self.head_fn(model, inputs, targets)
            x = inputs[: inputs.shape[0] // pipeline.num_microbatches]

            def one(layer_state):
                layer = nnx.merge(layer_def, layer_state)
                self.user_layer_fn(layer, x)
                return nnx.state(layer)

            layers = jax.vmap(one)(stack_state)
            return nnx.state(merged(layers, self._rest(nnx.state(model))), nnx.RngCount)

        frozen_stack = bool(jax.tree.leaves(_split(stack, self.wrt)[1]))
        pipeline = make()
        _check_stack(pipeline, stored, num_layers, self.num_layers)
        # The head sees the model with placeholders for the stack: it must not read the stack.
        stack_template = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), stack)
        with use_rules(plan.mesh, outer), nnx.use_eager_sharding(False):
            draws = _row_draws(flat, stack, rest, batch, plan.mesh, batch_axes, pipeline)

        rest_stored = self._rest(model_shardings)

        def evaluate(model_state, batch):
            """The head's loss (and aux) over the batch, the stack run forward only."""
            rest = _gathered(self._rest(model_state), rest_stored, batch_axes)
            rest_trained, rest_frozen = _split(rest, self.wrt)
            stack_state = model_state[self.stack]
            model = merged(stack_state, compute(rest))
            inputs, targets = self.embed_fn(model, compute(batch))
            padded, mask = pipeline.stack(stack_state, num_layers)
            value = make(rest_frozen).loss(padded, mask, compute(inputs), targets,
                                           rest_trained)  # fmt: skip
            loss, aux = value if self.has_aux else (value, None)
            return {"loss": loss, **aux_metrics(aux)}

        if forward:
            if draws is not None:
                raise ValueError(
                    "the evaluation draws random numbers (a model in training mode?): "
                    "model.eval() turns dropout off"
                )
            jitted = jax.jit(_under(evaluate, lambda: use_rules(plan.mesh, outer)),
                             in_shardings=(model_shardings, None))  # fmt: skip
            return Built(jitted, plan.mesh, batch_axes, "pipeline", plan=None)
        opt_shardings = optimizer_shardings(optimizer, plan)
        opt_def = nnx.graphdef(optimizer)
        guard = guard_decision((nnx.state(model, self.wrt), nnx.state(optimizer)),
                               self._guard.on_nonfinite)  # fmt: skip
        self._guard.state_checked = guard[0]

        def gradient(model_state, batch):
            stack_state = model_state[self.stack]
            # the embedding and head: whole over the batch axes, gathered once (an FSDP axis)
            rest = _gathered(self._rest(model_state), rest_stored, batch_axes)
            # only what wrt selects is differentiated; the rest is held, used and left alone
            stack_trained, stack_frozen = _split(stack_state, self.wrt)
            rest_trained, rest_frozen = _split(rest, self.wrt)
            held = (stack_frozen, rest_frozen)  # in the stages, each microbatch's rows' keys
            loss, aux, grads = gradients((stack_state, stack_trained, rest_trained, held), batch)
            counts = advanced(stack_state, rest, batch) if draws is not None else None
            return Update(loss, aux, counts, grads)

        def gradients(parts, batch):
            """The loss, aux and gradients of ``batch``, summed over its microbatches."""
            stack_state, stack_trained, rest_trained, (stack_frozen, rest_frozen) = parts

            def embed(rest_params):
                model = merged(stack_state, compute(nnx.merge_state(rest_params, rest_frozen)))
                inputs, targets = self.embed_fn(model, compute(batch))
                return compute(inputs), targets  # the stages' activations in the compute dtype

            inputs, embed_vjp, targets = jax.vjp(embed, rest_trained, has_aux=True)
            padded, mask = pipeline.stack(stack_trained, num_layers)
            still = pipeline.stack(stack_frozen, num_layers)[0] if frozen_stack else None
            value, (dpadded, dhead, dinputs) = make(rest_frozen).value_and_grad(
                padded, mask, inputs, targets, rest_trained, grad_dims=trained_dims,
                frozen=still,
            )  # fmt: skip
            loss, aux = value if self.has_aux else (value, None)
            (dembed,) = embed_vjp(dinputs)
            drest = jax.tree.map(lambda a, b: a + b, dhead, dembed)
            dstack = pipeline.unstack(dpadded, num_layers, keep_padding=stored != num_layers)
            return loss, aux, nnx.State({**dict(drest), self.stack: dstack})

        jitted = jit_step(
            gradient, lambda: use_rules(plan.mesh, outer), (model_def, opt_def),
            (model_shardings, opt_shardings), plan.mesh, on_nonfinite=self._guard.on_nonfinite,
            check_state=guard[0], donate=self.donate,
        )  # fmt: skip
        trained = {path for path, _ in variables(nnx.state(model, self.wrt))}
        step_plan = pipeline_plan(
            plan, self.stack, batch_axes, pipeline, self.precision, settings, grad_dims,
            trained, guard, draws,
        )  # fmt: skip
        return Built(jitted, plan.mesh, batch_axes, "pipeline", plan=step_plan)


def _row_draws(flat, stack, rest, batch, mesh, batch_axes, pipeline) -> RowDraws | None:
    """How the pipelined model's draws split with a microbatch's rows on a device, or None.

    ``flat(stack, rest, batch)`` (the model on one device) is traced on the whole batch and on
    one device's share of a microbatch, and its draws paired (:func:`row_draws`).

    Raises:
      ValueError: Naming a draw that does not split with the rows, or streams of another
        PRNG implementation than threefry.
    """
    leaves = jax.tree.leaves((stack, rest))
    if not any(is_key(x) for x in leaves):
        return None
    found = threefry_obstacle(leaves)
    if found is not None:
        raise ValueError(f"The pipelined step draws one device's random numbers, but {found}.")
    devices = math.prod(dict(mesh.shape)[a] for a in batch_axes)
    micro = pipeline.num_microbatches

    def shapes(rows):
        def leaf(x):
            shape = np.shape(x)
            return jax.ShapeDtypeStruct((rows, *shape[1:]) if shape else shape, np.result_type(x))

        return trace(flat, stack, rest, jax.tree.map(leaf, batch)).draw_shapes

    first = next(x for x in jax.tree.leaves(batch) if np.ndim(x))
    processes = (
        1 if isinstance(first, jax.Array) else len({d.process_index for d in mesh.devices.flat})
    )
    whole = np.shape(first)[0] * processes  # host rows are this process's slice
    try:
        return row_draws(shapes(whole), shapes(whole // (devices * micro)), devices,
                         stride=micro)  # fmt: skip
    except ValueError as error:
        raise ValueError(
            f"The pipelined step draws one device's random numbers, but {error}."
        ) from None


def _gathered(state: nnx.State, stored: nnx.State, batch_axes: Sequence[str]) -> nnx.State:
    """``state`` with each leaf whole over ``batch_axes``; its gradient goes back as stored.

    The gradient's sharding is the stored one, so XLA reduce-scatters it over an FSDP axis
    (a plain constraint's transpose would all-reduce it whole).
    """

    def gather(x, sharding):
        used = NamedSharding(sharding.mesh, without_axes(sharding.spec, set(batch_axes)))
        if used.spec == sharding.spec:
            return x

        @jax.custom_vjp
        def whole(x):
            return jax.lax.with_sharding_constraint(x, used)

        def backward(_, g):
            return (jax.lax.with_sharding_constraint(g, sharding),)

        whole.defvjp(lambda x: (whole(x), None), backward)
        return whole(x)

    return jax.tree.map(gather, state, stored)


def _grad_dims(plan: Any, name: str, stack: Any, batch_axes: Sequence[str]) -> Any:
    """Under ZeRO, each stack leaf's per-layer dimension its optimizer state is sharded on.

    The pipeline then reduce-scatters the layers' gradients along it (None: all-reduce), as
    the default step does from the same rows; it needs the replicas to be exactly the
    pipeline's data axes.
    """
    layout = plan.layout
    if layout is None or not layout.zero:
        return None
    sizes = layout.shape
    if {a for a in layout.optimizer_axes if sizes[a] > 1} != {a for a in batch_axes
                                                             if sizes[a] > 1}:  # fmt: skip
        return None

    rows = {row.path: row for row in plan.rows}

    def dim(path: str, _) -> int | None:
        row = rows[f"{name}/{path}"]
        spec = tuple(row.spec) + (None,) * (len(row.shape) - len(row.spec))
        zero, _ = layout.optimizer_spec(PartitionSpec(*spec), row.shape)
        moved = [d for d, (a, b) in enumerate(zip(spec, zero, strict=True)) if a != b]
        return moved[0] - 1 if moved and moved[0] > 0 else None

    return map_variables(dim, stack)


def _under(fn: Callable, context: Callable) -> Callable:
    """``fn`` run inside ``context()`` and without Flax's eager sharding (traced in ``jit``)."""

    def run(*args):
        with context(), nnx.use_eager_sharding(False):
            return fn(*args)

    return run


def _loss_and_aux(out: Any, has_aux: bool) -> Any:
    """What ``head_fn`` returned, checked against ``has_aux``.

    Raises:
      TypeError: If it is not a pair with ``has_aux``, or is a pair without.
    """
    pair = isinstance(out, (tuple, list)) and len(out) == 2
    if has_aux and not pair:
        raise TypeError("has_aux=True, so head_fn must return (loss, aux); it returned "
                        f"{type(out).__name__}. Return a pair, or leave has_aux out.")  # fmt: skip
    if not has_aux and isinstance(out, (tuple, list)):
        raise TypeError("the head returned a pair; for (loss, aux) pass has_aux=True to "
                        "make_train_step, else return the scalar loss alone.")  # fmt: skip
    return tuple(out) if has_aux else out


def _fsdp(plan: Any, name: str, batch_axes: Sequence[str]) -> tuple[str | None, dict]:
    """The layout's FSDP axis for the stack, and where the plan put it on each layer shape.

    Raises:
      ValueError: If the layout has more than one FSDP axis of size > 1, or one that is not a
        data axis of the pipeline.
    """
    layout = plan.layout
    sizes = dict(plan.mesh.shape)
    axes = [a for a in (layout.fsdp_axes if layout is not None else ()) if sizes[a] > 1]
    if not axes:
        return None, {}
    if len(axes) > 1 or axes[0] not in batch_axes:
        raise ValueError(
            f"The pipelined step gathers a stage's layers over one FSDP axis among its data "
            f"axes {tuple(batch_axes)}; the layout has {tuple(axes)}. Use a layout with one "
            "FSDP axis (Layout.from_degrees(pp=..., fsdp=...))."
        )
    dims: dict = {}
    for row in plan.rows:
        if not row.path.startswith(f"{name}/"):
            continue
        spec = tuple(row.spec) + (None,) * (len(row.shape) - len(row.spec))
        on = [d for d, entry in enumerate(spec) if axes[0] in as_axes(entry)]
        dims.setdefault(tuple(row.shape[1:]), on[0] - 1 if on and on[0] > 0 else None)
    return axes[0], dims


def _check_stack(pipeline: Pipeline, stored: int, num_layers: int, given: int | None) -> None:
    """A padded stack must have the pipeline's slot count; an uneven one is named."""
    slots = pipeline.num_slots(num_layers)
    if given is not None and stored not in (num_layers, slots):
        raise ValueError(
            f"num_layers={given}: the stack stores {stored} layers, but {given} layers take "
            f"{slots} padded slots on {pipeline.num_stages} stages (x {pipeline.repeats} "
            f"repeats); store {slots}, or {given} and leave num_layers out."
        )
    if stored != slots:
        warn_user(
            f"The stack's {stored} layers do not divide {pipeline.num_stages} pipeline stages, "
            "so its parameters cannot be sharded over the stage axis: every stage stores "
            f"the whole stack. Build it with step.num_slots({stored}) = {slots} layers and "
            f"pass num_layers={stored}; its last {slots - stored} slot(s) are masked.",
            ShardingWarning,
        )


def pipelined_step(
    stages: Stages,
    mesh: jax.sharding.Mesh | None,
    rules: Rules,
    *,
    layout: LayoutLike,
    microbatches: int,
    remat: bool | str,
    batch_axes: Sequence[str] | None,
    on_nonfinite: NonFinite,
    precision: MixedPrecision | str | None,
    donate: bool,
    has_aux: bool,
    wrt: Any,
) -> PipelineTrainStep:
    """:func:`~substrax_flax.make_train_step` for :class:`Stages`, its options checked.

    Raises:
      ValueError: As :func:`~substrax_flax.make_train_step` and
        :class:`substrax.pipeline.Pipeline` (checked now where ``mesh`` is given, else on
        the first call).
    """
    _check_count("microbatches", microbatches)
    check_filter(wrt)
    check_policy(on_nonfinite)
    return PipelineTrainStep(
        stages, mesh=mesh, rules=rules, layout=layout, microbatches=microbatches, remat=remat,
        batch_axes=batch_axes, on_nonfinite=on_nonfinite, precision=as_precision(precision),
        donate=donate, has_aux=has_aux, wrt=wrt,
    )  # fmt: skip
