"""Pipeline: runs a layer stack's schedule (GPipe, 1F1B, circular, ...) in one ``shard_map``.

A :class:`Pipeline` splits a stack of layers (parameters with a leading layer axis) over the
stage axis of a :class:`~substrax.mesh.PipelineParallelStrategy`, splits each batch into
microbatches and runs them through the stages, moving activations forward and cotangents back
with ``lax.ppermute`` along the strategy's own communication patterns. Other mesh axes given as
``batch_axes`` split each microbatch (data parallelism, FSDP); the gradient is reduced over them
once,
after the pipeline loop. Mesh axes that are neither stay Auto, for XLA to shard inside a stage.

Schedules, for ``S`` stages and ``M`` microbatches (a tick runs one stage step on every stage):

* ``"gpipe"``: all forwards, then all backwards (``jax.grad`` through a scan of ``M + S - 1``
  ticks); activation memory grows with ``M``.
* ``"circular"``: each stage holds ``repeats`` chunks of layers and every microbatch goes round
  the ring ``repeats`` times (``repeats * M + S - 1`` ticks, needs ``M >= S``); the bubble
  shrinks by ``repeats``.
* ``"1f1b"``, ``"interleaved"`` (``repeats`` chunks per stage, as circular lays them out) and
  ``"zb-h1"``: the split schedules. Each tick a stage runs one op of its own: a forward, the
  backward for the input's gradient, or the weight gradient (``lax.switch`` per device: an idle
  stage computes nothing). Residuals wait in ring slots for the microbatches the schedule
  holds, so activation memory is bounded by ``S``, not ``M``; the tables and their idle
  fractions are in ``substrax.pipeline._schedule``, the loop in ``substrax.pipeline._split``.

Uneven layer counts are padded with masked identity layers whose gradients are exactly zero.
A stack to be sharded over the stage axis while it is stored (a model's parameters) must
already have :meth:`Pipeline.num_slots` rows, since a sharded dimension must divide its axis;
:meth:`Pipeline.stack` takes such a stack with its real ``num_layers``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from substrax.mesh import PipelineParallelStrategy, spec_entry
from substrax.pipeline._layout import StageLayout
from substrax.pipeline._microbatch import computing
from substrax.pipeline._schedule import Schedule, ScheduleSlot
from substrax.pipeline._split import run_split
from substrax.spmd import checkpoint_policy, gather_shard, lay_out, scatter_shard

__all__ = ["Pipeline"]


def _remat_name(remat: bool | str) -> str:
    """A remat setting as a name of :data:`~substrax.spmd.REMAT` (True: ``"full"``)."""
    if isinstance(remat, bool):
        return "full" if remat else "none"
    checkpoint_policy(remat)  # raises for an unknown name
    return remat


def _or_minus_one(dim: int | None) -> int:
    return -1 if dim is None else dim


class Pipeline:
    """Runs a layer stack as a pipeline over a mesh's stage axis.

    Build one per configuration; :meth:`stack` places the layer stack, :meth:`loss_and_grads`
    runs a step, :meth:`unstack` gives gradients their layer axis back.
    """

    def __init__(
        self,
        layer_fn: Callable[[Any, jax.Array], jax.Array],
        loss_fn: Callable[[jax.Array, jax.Array], jax.Array],
        mesh: Mesh,
        strategy: PipelineParallelStrategy,
        *,
        num_microbatches: int,
        schedule: str = "gpipe",
        repeats: int = 1,
        remat: bool | str = False,
        batch_axes: Sequence[str] = (),
        fsdp_axis: str | None = None,
        fsdp_dims: Mapping[tuple[int, ...], int | None] | None = None,
        has_aux: bool = False,
    ):
        """Validates the configuration.

        Args:
          layer_fn: ``layer_fn(layer_params, x) -> x`` for one layer; a stage applies its
            layers in order. Its output must have its input's shape and dtype.
          loss_fn: ``loss_fn(y, target) -> scalar``: the loss of one microbatch of the last
            stage's output (a mean over its rows).
          mesh: The mesh; it has the strategy's stage axis.
          strategy: Names the stage axis and the number of stages.
          num_microbatches: How many microbatches each batch is split into.
          schedule: One of :data:`~substrax.pipeline.SCHEDULES`: ``"gpipe"``, ``"1f1b"``,
            ``"circular"``, ``"interleaved"`` or ``"zb-h1"``.
          repeats: Chunks of layers per stage: the rounds of the ring for ``"circular"``,
            the virtual stages per device for ``"interleaved"`` (1 otherwise).
          remat: Which of a stage's activations the backward pass keeps, a name of
            :data:`substrax.spmd.REMAT` as every substrax step takes it: ``"none"`` (all),
            ``"selective"`` (the products with the weights; the rest is recomputed),
            ``"offload"`` (those products, in the host's memory) or ``"full"`` (the
            stage's input: the stage is recomputed). True is ``"full"``,
            False ``"none"``. The split schedules apply it per layer, and recompute in both
            halves of the backward (input and weight gradients) what it leaves out.
          batch_axes: Mesh axes that split each microbatch (data parallelism).
          fsdp_axis: One of ``batch_axes`` over which the layer parameters are also sharded
            (FSDP): each stage gathers its layers once before the loop and reduce-scatters
            their gradients once after it. A parameter is sharded on its first per-layer
            dimension that the axis size divides; one with none stays whole.
          fsdp_dims: Per-layer shape -> the dimension FSDP shards it on (None: whole), where
            a model's plan decided it; other shapes follow ``fsdp_axis``'s rule.
          has_aux: Whether ``loss_fn`` returns ``(loss, aux)``, ``aux`` a pytree of scalars
            (a microbatch's means); the pipeline then returns ``(loss, aux)`` with both
            averaged over every microbatch, as the loss is.

        Raises:
          ValueError: For an unknown schedule or remat name, a stage count that differs
            from the mesh's stage axis, ``repeats`` other than 1 outside ``"circular"`` and
            ``"interleaved"``, a circular schedule with fewer microbatches than stages, data
            axes that are not mesh axes, or an ``fsdp_axis`` that is not one of them.
        """
        stage_size = dict(mesh.shape).get(strategy.axis_name)
        if stage_size != strategy.num_stages:
            raise ValueError(
                f"The strategy has {strategy.num_stages} stages but mesh axis "
                f"{strategy.axis_name!r} has size {stage_size} (mesh axes {dict(mesh.shape)})."
            )
        timetable = Schedule(schedule, strategy.num_stages, num_microbatches, repeats)
        batch_axes = tuple(batch_axes)
        bad = [a for a in batch_axes if a not in mesh.axis_names or a == strategy.axis_name]
        if bad:
            raise ValueError(
                f"batch_axes {batch_axes} must be mesh axes other than the stage axis "
                f"{strategy.axis_name!r}; the mesh has {tuple(mesh.axis_names)}."
            )
        if fsdp_axis is not None and fsdp_axis not in batch_axes:
            raise ValueError(f"fsdp_axis {fsdp_axis!r} must be one of batch_axes {batch_axes}.")
        fields = {
            "layer_fn": layer_fn,
            "loss_fn": loss_fn,
            "mesh": mesh,
            "strategy": strategy,
            "stage_axis": strategy.axis_name,
            "num_stages": strategy.num_stages,
            "num_microbatches": num_microbatches,
            "schedule": schedule,
            "repeats": repeats,
            "remat": _remat_name(remat),
            "batch_axes": batch_axes,
            "fsdp_axis": fsdp_axis,
            "has_aux": bool(has_aux),
            "batch_devices": math.prod(dict(mesh.shape)[a] for a in batch_axes),
            "timetable": timetable,
            "layout": StageLayout(
                mesh, strategy, repeats, fsdp_axis, tuple((fsdp_dims or {}).items())
            ),
        }
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"A Pipeline is immutable (tried to set {name!r}); build a new one for other "
            "functions or settings."
        )

    # --- layer assignment (StageLayout) -------------------------------------------------------

    def layer_counts(self, num_layers: int) -> list[list[int]]:
        """Layers per stage and repeat: ``counts[stage][repeat]``.

        With one repeat this is the strategy's ``assign_layers_to_stages``; a circular schedule
        splits the layers into ``stages * repeats`` balanced chunks, chunk ``r * S + s`` going
        to stage ``s`` for round ``r``.

        Args:
          num_layers: Layers in the stack.

        Returns:
          The counts.

        Raises:
          ValueError: If there are fewer layers than chunks.
        """
        return self.layout.layer_counts(num_layers)

    def num_slots(self, num_layers: int) -> int:
        """Slots a padded stack of ``num_layers`` layers has: ``S x R x Lc``.

        A stack that does not divide the stages is padded: 126 layers on 16 stages take 128
        slots, 8 per stage, and the last two stages hold 7 layers and one masked slot each.
        Store a stack with this many layers (in slot order, see :meth:`unstack`) to shard it
        over the stage axis, which needs a size the axis divides; give ``num_layers`` to
        :meth:`stack`.

        Args:
          num_layers: Layers in the stack.

        Returns:
          The slot count (``num_layers`` itself when the stages divide it evenly).

        Raises:
          ValueError: If there are fewer layers than stages (or chunks, for circular).
        """
        return self.layout.num_slots(num_layers)

    def stack(self, params: Any, num_layers: int | None = None) -> tuple[Any, jax.Array]:
        """Pads and places a layer stack for the pipeline.

        Args:
          params: A pytree whose leaves have a leading layer axis: the ``L`` layers, or their
            :meth:`num_slots` padded slots in slot order (stage-major, as :meth:`unstack`
            with ``keep_padding=True`` returns them), which is only a reshape.
          num_layers: The real layer count ``L`` of a padded stack (None: the leading axis).

        Returns:
          ``(padded, mask)``: leaves of shape ``[S, R, Lc, ...]`` sharded over the stage axis
          (padding slots hold copies of layer 0, or whatever a padded stack stores there, and
          are masked out), and the ``[S, R, Lc]`` mask.

        Raises:
          ValueError: If the leaves disagree on the layer count, or it is neither
            ``num_layers`` nor ``num_slots(num_layers)``.
        """
        return self.layout.stack(params, num_layers)

    def fsdp_dim(self, layer_shape: Sequence[int]) -> int | None:
        """The per-layer dimension that FSDP shards for a parameter of ``layer_shape``.

        Args:
          layer_shape: One layer's shape of the parameter.

        Returns:
          The first dimension the ``fsdp_axis`` size divides (substrax's one resolver decides),
          or None (kept whole, or no FSDP).
        """
        return self.layout.fsdp_dim(layer_shape)

    def unstack(self, padded: Any, num_layers: int, *, keep_padding: bool = False) -> Any:
        """The inverse of :meth:`stack`: ``[S, R, Lc, ...]`` back to ``[L, ...]``.

        Args:
          padded: A pytree like the first result of :meth:`stack` (such as its gradients).
          num_layers: Layers in the stack.
          keep_padding: Keep the padding slots: leaves of :meth:`num_slots` rows in slot
            order (the gradients of a padded stack; a padding slot's are exactly zero).

        Returns:
          The pytree with leading layer axis ``L`` (padding slots dropped) or, with
          ``keep_padding``, ``S x R x Lc``.
        """
        return self.layout.unstack(padded, num_layers, keep_padding)

    # --- schedules (Schedule) ---------------------------------------------------------------

    @property
    def num_ticks(self) -> int:
        """Ticks of the pipeline loop."""
        return self.timetable.num_ticks

    def schedule_table(self) -> list[ScheduleSlot]:
        """Every unit of work of the schedule, in tick order.

        GPipe and circular list their forward ticks (their backward is the reversed loop).

        Returns:
          The slots.
        """
        return self.timetable.table()

    def idle_fraction(self) -> float:
        """The share of (stage, tick) slots with no work, counted from the schedule table.

        Every tick costs about the same on every stage (the loop runs in lock step), so this
        is the share of compute spent idle: ``(S-1)/(M+S-1)`` for GPipe, ``(S-1)/(R*M+S-1)``
        for circular; the split schedules count a tick per forward, backward and weight op:
        at 4 stages and 8 microbatches 0.200 for 1F1B (textbook 0.273), 0.111 for interleaved
        with 2 chunks (textbook 0.158) and for ZB-H1 (``(S-1)/(3M+S-1)``).

        Returns:
          The idle fraction.
        """
        return self.timetable.idle_fraction()

    # --- running ----------------------------------------------------------------------------

    def microbatch(self, x: jax.Array) -> jax.Array:
        """Splits a batch into microbatches: ``[B, ...]`` to ``[M, B / M, ...]``.

        The batch is reshaped to ``[B / M, M, ...]`` and transposed, which keeps its data
        sharding on the rows of each microbatch (reshaping straight to ``[M, B / M]`` would
        move it onto the microbatch index). Microbatch ``m`` holds rows ``m, m + M, ...``.

        Args:
          x: The batch.

        Returns:
          The microbatches.

        Raises:
          ValueError: If ``B`` is not a multiple of ``M`` times the batch axes' size.
        """
        micro, rows = self.num_microbatches, x.shape[0]
        if rows % (micro * self.batch_devices):
            raise ValueError(
                f"A batch of {rows} rows does not split into {micro} microbatches of "
                f"{self.batch_devices} batch shards each; use a multiple of "
                f"{micro * self.batch_devices}."
            )
        return jnp.swapaxes(x.reshape(rows // micro, micro, *x.shape[1:]), 0, 1)

    def _split(self, x: jax.Array, microbatched: bool) -> jax.Array:
        if not microbatched:
            return self.microbatch(x)
        if x.shape[0] != self.num_microbatches or x.shape[1] % self.batch_devices:
            raise ValueError(
                f"Microbatched inputs must be [{self.num_microbatches}, rows, ...] with rows a "
                f"multiple of {self.batch_devices}, got shape {x.shape}."
            )
        return x

    def _check_layer(self, padded: Any, xs: jax.Array, frozen: Any = None) -> None:
        def one(tree):
            return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[3:], a.dtype), tree)

        layer = one(padded) if frozen is None else (one(padded), one(frozen))
        rows = xs.shape[1] // self.batch_devices
        sample = jax.ShapeDtypeStruct((rows, *xs.shape[2:]), xs.dtype)
        out = jax.eval_shape(self.layer_fn, layer, sample)
        if (out.shape, out.dtype) != (sample.shape, sample.dtype):
            raise ValueError(
                f"layer_fn must keep its input's shape and dtype: {sample.shape} {sample.dtype} "
                f"became {out.shape} {out.dtype}."
            )

    def _stage(
        self, params: Any, mask: jax.Array, x: jax.Array, frozen: Any = None, index: Any = None
    ) -> jax.Array:
        """The stage's layers in order; ``layer_fn`` gets ``(params, frozen)`` with frozen.

        ``index`` is the microbatch's, for :func:`~substrax.pipeline.microbatch_index`.
        """

        def body(x, layer):
            layer_params, keep, layer_frozen = layer
            args = layer_params if frozen is None else (layer_params, layer_frozen)
            return jnp.where(keep, self.layer_fn(args, x), x), None

        with computing(index):
            return jax.lax.scan(body, x, (params, mask, frozen))[0]

    def _specs(self, padded: Any) -> tuple[Any, PartitionSpec, PartitionSpec]:
        data = self.batch_axes if len(self.batch_axes) != 1 else self.batch_axes[0]
        param_spec = jax.tree.map(lambda a: self.layout.param_spec(a.shape[3:]), padded)
        return param_spec, PartitionSpec(self.stage_axis), PartitionSpec(None, data or None)

    def _boundary(self, x: jax.Array) -> jax.Array:
        """An activation or cotangent about to cross a stage boundary, split over the rest.

        Its last dimension is split over the mesh's other axes (tensor parallelism) where they
        divide it. Each device of a tensor-parallel group then sends its own part, not a
        replica of the whole (Megatron's scatter-gather): ``1 / tp`` of the boundary's bytes
        cross the stage axis, and XLA gathers them over the model axis, within a host, where
        they are used.
        """
        manual = {self.stage_axis, *self.batch_axes}
        others = tuple(a for a in self.mesh.axis_names if a not in manual)
        size = math.prod(dict(self.mesh.shape)[a] for a in others)
        if size == 1 or x.ndim < 2 or x.shape[-1] % size:
            return x
        spec = PartitionSpec(*([None] * (x.ndim - 1)), others if len(others) > 1 else others[0])
        return lay_out(x, NamedSharding(self.mesh, spec))

    def _vary(self, tree: Any) -> Any:
        """Marks parameters as varying over the batch axes, so gradients reduce after the loop."""

        def cast(x):
            have = set(jax.typeof(x).manual_axis_type.varying)
            missing = tuple(a for a in self.batch_axes if a not in have)
            return jax.lax.pcast(x, missing, to="varying") if missing else x

        return jax.tree.map(cast, tree)

    def _varying(self, tree: Any) -> Any:
        """Marks a scan's initial carry as varying over every manual axis, as its output is."""
        axes = (self.stage_axis, *self.batch_axes)

        def cast(x):
            have = set(jax.typeof(x).manual_axis_type.varying)
            missing = tuple(a for a in axes if a not in have)
            return jax.lax.pcast(x, missing, to="varying") if missing else x

        return jax.tree.map(cast, tree)

    def _reduce_grad(self, grad: jax.Array, scatter: int = -1, lead: int = 1) -> jax.Array:
        """Sums a gradient over the batch axes, scattering it back over FSDP.

        The gradient has ``lead`` slot dimensions (``[Lc, ...]``: 1) before a layer's and is
        whole along its FSDP dimension (the layers were gathered), so its shape is the global
        one the FSDP dimension was chosen from. It is reduce-scattered over the FSDP axis
        first, then its shard all-reduced over the other batch axes
        (:func:`~substrax.spmd.scatter_shard`). ``scatter`` >= 0 names a per-layer dimension
        to reduce-scatter it along over every batch axis instead (ZeRO).
        """
        if scatter >= 0:
            return scatter_shard(grad, _along(lead + scatter, spec_entry(self.batch_axes)))
        dim = self.fsdp_dim(grad.shape[lead:])
        if dim is None:
            return jax.lax.psum(grad, self.batch_axes) if self.batch_axes else grad
        others = tuple(a for a in self.batch_axes if a != self.fsdp_axis)
        return scatter_shard(grad, _along(lead + dim, self.fsdp_axis), replicas=others)

    def _mean(self, value: jax.Array) -> jax.Array:
        value = jax.lax.psum(value, self.stage_axis) / self.num_microbatches
        return jax.lax.pmean(value, self.batch_axes) if self.batch_axes else value

    def _loss(
        self, y: jax.Array, target: jax.Array, head: Any, index: Any = None
    ) -> tuple[jax.Array, Any]:
        """``(loss, aux)`` of microbatch ``index`` (``aux`` is ``()`` without ``has_aux``)."""
        with computing(index):
            out = self.loss_fn(y, target) if head is None else self.loss_fn(y, target, head)
        return out if self.has_aux else (out, ())

    def _read_by_loss(self, x: jax.Array, target: jax.Array, head: Any) -> Any:
        """A tree like ``head`` of bools: whether ``loss_fn`` reads each leaf at all."""
        leaves, tree = jax.tree.flatten(head)
        closed = jax.make_jaxpr(lambda h: self._loss(x, target, jax.tree.unflatten(tree, h)))(
            leaves
        )
        jaxpr = closed.jaxpr
        read = {id(v) for eqn in jaxpr.eqns for v in eqn.invars}
        read |= {id(v) for v in jaxpr.outvars}
        return jax.tree.unflatten(tree, [id(v) in read for v in jaxpr.invars])

    def _aux_zeros(self, x: jax.Array, target: jax.Array, head: Any) -> Any:
        """Zeros shaped like a microbatch's aux: the start of its sum."""
        shapes = jax.eval_shape(self._loss, x, target, head)[1]
        return jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes)

    def _out(self, value: jax.Array, aux: Any) -> Any:
        """The loss, or ``(loss, aux)`` with ``has_aux``."""
        return (value, aux) if self.has_aux else value

    def _shard_map(self, body, padded, head, out_specs, frozen=None, **options):
        param_spec, mask_spec, batch_spec = self._specs(padded)
        frozen_spec = self._specs(frozen)[0] if frozen is not None else None
        head_spec = jax.tree.map(lambda _: PartitionSpec(), head)
        if callable(out_specs):
            out_specs = out_specs(param_spec, head_spec, batch_spec)

        def fsdp_dims(tree):
            # from the global shapes (a local shard's shape can divide differently)
            return jax.tree.map(lambda a: _or_minus_one(self.fsdp_dim(a.shape[3:])), tree)

        dims = fsdp_dims(padded)
        frozen_dims = fsdp_dims(frozen) if frozen is not None else None
        return jax.shard_map(
            functools.partial(body, dims=dims, frozen_dims=frozen_dims, **options),
            mesh=self.mesh,
            in_specs=(param_spec, mask_spec, batch_spec, batch_spec, head_spec, frozen_spec),
            out_specs=out_specs,
            axis_names={self.stage_axis, *self.batch_axes},
        )

    def loss(
        self,
        padded: Any,
        mask: jax.Array,
        inputs: jax.Array,
        targets: jax.Array,
        head: Any = None,
        *,
        microbatched: bool = False,
        frozen: Any = None,
    ) -> Any:
        """The pipelined loss (GPipe or circular), differentiable with ``jax.grad``.

        Args:
          padded: Parameters from :meth:`stack`.
          mask: The mask from :meth:`stack`.
          inputs: The batch ``[B, ...]`` entering the first layer.
          targets: The targets ``[B, ...]`` for ``loss_fn``.
          head: Parameters of the loss (an output layer, say), replicated on every stage and
            passed as ``loss_fn(y, target, head)``; None calls ``loss_fn(y, target)``.
          microbatched: Whether ``inputs`` and ``targets`` are already ``[M, rows, ...]``
            (from :meth:`microbatch`).
          frozen: Layer parameters that are not trained, from :meth:`stack` like
            ``padded`` (None: none): each stage holds and gathers them as it does ``padded``,
            ``layer_fn`` then receives ``(params, frozen)`` of its layer, and no gradient is
            computed or reduced for them.

        Returns:
          The mean loss over every microbatch (with ``has_aux``: ``(loss, aux)``, each the
          mean over every microbatch).

        Raises:
          ValueError: For a split schedule (use :meth:`value_and_grad`), a batch that does
            not split, or a ``layer_fn`` that changes shapes.
        """
        if self.timetable.split:
            raise ValueError(
                f"The {self.schedule!r} schedule computes its own backward: use value_and_grad."
            )
        xs, ts = self._split(inputs, microbatched), self._split(targets, microbatched)
        self._check_layer(padded, xs, frozen)
        run = self._shard_map(self._forward_loop, padded, head, PartitionSpec(), frozen)
        return self._out(*run(padded, mask, xs, ts, head, frozen))

    def _gather(self, params: Any, dims: Any) -> Any:
        """Inside the map: each parameter whole along its FSDP dimension (-1: none), once."""

        def gather(a, dim):
            return a if dim < 0 else gather_shard(a, _along(3 + dim, self.fsdp_axis))

        if params is None:
            return None
        return jax.tree.map(gather, params, dims)

    def _forward_loop(self, params, mask, xs, targets, head, frozen=None, *, dims, frozen_dims):
        params = self._vary(jax.tree.map(lambda a: a[0], self._gather(params, dims)))
        # varying before the loop, so their gradients are summed once after it, not per tick
        xs, head = self._varying(xs), self._varying(head)
        frozen = jax.tree.map(lambda a: a[0], self._gather(frozen, frozen_dims))
        mask, stages, micro, repeats = mask[0], self.num_stages, self.num_microbatches, self.repeats
        stage = jax.lax.axis_index(self.stage_axis)
        pattern = self.strategy.get_forward_communication_pattern()
        if repeats > 1:
            pattern = [*pattern, (stages - 1, 0)]
        policy = checkpoint_policy(self.remat)
        apply = jax.checkpoint(self._stage, policy=policy) if policy else self._stage

        def tick(carry, t):
            received, ring, total, aux = carry
            item = jnp.clip(t - stage, 0, repeats * micro - 1)
            index, rnd = item % micro, item // micro
            first = xs[index] if repeats == 1 else jnp.where(rnd == 0, xs[index], ring[index])
            x = jnp.where(stage == 0, first, received)
            layers = jax.tree.map(lambda a: a[rnd], params)
            y = apply(layers, mask[rnd], x, jax.tree.map(lambda a: a[rnd], frozen), index)
            done = (stage == stages - 1) & (t - stage >= 0) & (rnd == repeats - 1)
            loss, extra = self._loss(y, targets[index], head, index)
            total = total + jnp.where(done, loss, 0.0)
            aux = jax.tree.map(lambda a, e: a + jnp.where(done, e, 0.0), aux, extra)
            sent = jax.lax.ppermute(self._boundary(y), self.stage_axis, pattern)
            if repeats > 1:  # stage 0 keeps what comes back round the ring, by microbatch
                back = jnp.clip(t - (stages - 1), 0, repeats * micro - 1) % micro
                ring = jnp.where((stage == 0) & (t >= stages - 1), ring.at[back].set(sent), ring)
            return (sent, ring, total, aux), None

        start = jnp.zeros_like(xs[0])
        ring = jnp.zeros_like(xs) if repeats > 1 else jnp.zeros((), xs.dtype)
        aux = self._aux_zeros(xs[0], targets[0], head)
        carry = self._varying((start, ring, jnp.zeros((), jnp.float32), aux))
        (_, _, total, aux), _ = jax.lax.scan(tick, carry, jnp.arange(self.num_ticks))
        return self._mean(total), jax.tree.map(self._mean, aux)

    def value_and_grad(
        self,
        padded: Any,
        mask: jax.Array,
        inputs: jax.Array,
        targets: jax.Array,
        head: Any = None,
        *,
        microbatched: bool = False,
        grad_dims: Any = None,
        frozen: Any = None,
    ) -> tuple[jax.Array, tuple[Any, Any, jax.Array]]:
        """The loss, and the gradients of the layers, the loss's parameters and the inputs.

        The layers' gradients are summed over the batch axes once, after the loop: all-reduced,
        or, for a leaf whose ``grad_dims`` entry names a per-layer dimension, reduce-scattered
        along it over the batch axes (ZeRO: each replica keeps the slice its optimizer state
        updates, and the step moves half the bytes of an all-reduce).

        Args:
          padded: Parameters from :meth:`stack`.
          mask: The mask from :meth:`stack`.
          inputs: The batch ``[B, ...]`` (or ``[M, rows, ...]`` when ``microbatched``).
          targets: The targets, shaped like ``inputs``.
          head: Parameters of the loss (see :meth:`loss`), or None.
          microbatched: Whether ``inputs`` and ``targets`` are already microbatched.
          grad_dims: None, or a pytree like ``padded`` of per-layer dimensions (an int, or
            None to all-reduce that leaf) to reduce-scatter each gradient along.
          frozen: Layer parameters that are not trained (see :meth:`loss`).

        Returns:
          ``(loss, (grads, head_grads, input_grads))`` (with ``has_aux``, ``loss`` is
          ``(loss, aux)``): ``grads`` shaped like ``padded``
          (padding slots exactly zero) and sharded like it, plus the batch axes on a
          ``grad_dims`` dimension; ``head_grads`` like ``head`` (None without one),
          ``input_grads`` like ``inputs``, for backpropagating into what produced them.

        Raises:
          ValueError: For a batch that does not split, a ``layer_fn`` that changes shapes,
            ``grad_dims`` with an ``fsdp_axis``, or a dimension the batch axes do not divide.
        """
        if not self.timetable.split and grad_dims is None:  # jax.grad reduces the gradients
            loss = functools.partial(self.loss, microbatched=microbatched, frozen=frozen)
            if head is None:
                value, (grads, dx) = jax.value_and_grad(loss, argnums=(0, 2), has_aux=self.has_aux)(
                    padded, mask, inputs, targets
                )
                return value, (grads, None, dx)
            grad_fn = jax.value_and_grad(loss, argnums=(0, 2, 4), has_aux=self.has_aux)
            value, (grads, dx, dhead) = grad_fn(padded, mask, inputs, targets, head)
            return value, (grads, dhead, dx)
        scatter = self._scatter_dims(padded, grad_dims)
        xs, ts = self._split(inputs, microbatched), self._split(targets, microbatched)
        self._check_layer(padded, xs, frozen)
        body = self._split_schedule if self.timetable.split else self._grads_in_map
        specs = jax.tree.map(self._grad_spec, padded, scatter)
        run = self._shard_map(
            body, padded, head,
            lambda params, head_spec, batch: (PartitionSpec(), specs, head_spec, batch),
            frozen, scatter=scatter,
        )  # fmt: skip
        value, grads, dhead, dxs = run(padded, mask, xs, ts, head, frozen)
        if not microbatched:  # [M, rows] back to the batch's row order
            dxs = jnp.swapaxes(dxs, 0, 1).reshape(inputs.shape)
        return self._out(*value), (grads, dhead, dxs)

    def _scatter_dims(self, padded: Any, grad_dims: Any) -> Any:
        """``grad_dims`` checked, as a tree like ``padded`` of ints (-1: all-reduce)."""
        if grad_dims is None:
            return jax.tree.map(lambda _: -1, padded)
        if self.fsdp_axis is not None:
            raise ValueError("grad_dims reduce-scatter over the batch axes; not with fsdp_axis.")
        dims = jax.tree.leaves(grad_dims, is_leaf=lambda d: d is None)
        scatter = jax.tree.unflatten(jax.tree.structure(padded), map(_or_minus_one, dims))
        for leaf, dim in zip(jax.tree.leaves(padded), jax.tree.leaves(scatter), strict=True):
            if dim >= 0 and leaf.shape[3 + dim] % self.batch_devices:
                raise ValueError(
                    f"grad_dims: dimension {dim} of a layer of shape {leaf.shape[3:]} does not "
                    f"divide over the {self.batch_devices} devices of the batch axes "
                    f"{self.batch_axes}."
                )
        return scatter

    def _grad_spec(self, padded: jax.Array, scatter: int) -> PartitionSpec:
        spec = list(self.layout.param_spec(padded.shape[3:]))
        if scatter < 0:
            return PartitionSpec(*spec)
        spec += [None] * (padded.ndim - len(spec))
        spec[3 + scatter] = self.batch_axes if len(self.batch_axes) != 1 else self.batch_axes[0]
        return PartitionSpec(*spec)

    def _grads_in_map(self, params, mask, xs, targets, head, frozen=None, *, dims, frozen_dims,
                      scatter):  # fmt: skip
        """GPipe and circular differentiated inside the map, so the reduction is explicit.

        The parameters are marked as varying over the batch axes first: their per-device
        gradients then stay apart (the loss's mean has already divided them by the replicas)
        and are reduce-scattered, not implicitly all-reduced.
        """
        varied = self._vary(params)

        def loss(p, x, h):
            return self._forward_loop(p, mask, x, targets, h, frozen, dims=dims,
                                      frozen_dims=frozen_dims)  # fmt: skip

        grad_fn = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
        value, (grads, dxs, dhead) = grad_fn(varied, xs, head)
        if self.batch_axes:
            grads = jax.tree.map(lambda g, d: self._reduce_grad(g, d, lead=3), grads, scatter)
        return value, grads, dhead, dxs

    def loss_and_grads(
        self,
        padded: Any,
        mask: jax.Array,
        inputs: jax.Array,
        targets: jax.Array,
        *,
        microbatched: bool = False,
    ) -> tuple[jax.Array, Any]:
        """The loss and the gradients of the padded layer parameters.

        Args:
          padded: Parameters from :meth:`stack`.
          mask: The mask from :meth:`stack`.
          inputs: The batch ``[B, ...]``.
          targets: The targets ``[B, ...]``.
          microbatched: Whether ``inputs`` and ``targets`` are already ``[M, rows, ...]``.

        Returns:
          ``(loss, grads)``, the gradients shaped and sharded like ``padded`` (padding slots
          exactly zero); :meth:`unstack` gives them the layer axis back.

        Raises:
          ValueError: For a batch that does not split, or a ``layer_fn`` that changes shapes.
        """
        value, (grads, _, _) = self.value_and_grad(
            padded, mask, inputs, targets, microbatched=microbatched
        )
        return value, grads

    def _split_schedule(self, params, mask, xs, targets, head, frozen=None, *, dims,
                        frozen_dims, scatter):  # fmt: skip
        return run_split(self, params, mask, xs, targets, head, frozen, dims=dims,
                         frozen_dims=frozen_dims, scatter=scatter)  # fmt: skip

    def _split_results(self, grads, dhead, dxs, total, aux, scatter, lead, used):
        """A split schedule's sums, reduced once after its loop.

        Over the batch axes (the layers' gradients reduce-scattered where FSDP or ``grad_dims``
        say), and the head's and inputs' gradients over the stages, which each hold their own.
        """
        data = self.batch_devices
        if self.batch_axes:
            grads = jax.tree.map(
                lambda g, d: self._reduce_grad(g, d, lead=lead) / data, grads, scatter
            )
        # one all-reduce over every stage and replica (the last stage holds the sums); a
        # parameter the loss never reads (an embedding passed with the head) has none to reduce
        everywhere = (*self.batch_axes, self.stage_axis)

        def reduce(g, read):
            return jax.lax.psum(g, everywhere) / data if read else jnp.zeros(g.shape, g.dtype)

        dhead = jax.tree.map(reduce, dhead, used)
        dxs = jax.lax.psum(dxs, self.stage_axis) / data
        grads = jax.tree.map(lambda g: g[None], grads)
        return (self._mean(total), jax.tree.map(self._mean, aux)), grads, dhead, dxs

    def reference_loss(
        self, params: Any, inputs: jax.Array, targets: jax.Array, head: Any = None
    ) -> jax.Array:
        """The same loss without a pipeline: every layer in order, the same microbatches.

        Args:
          params: The unpadded stack ``[L, ...]``.
          inputs: The batch ``[B, ...]``.
          targets: The targets ``[B, ...]``.
          head: Parameters of the loss, as for :meth:`loss`.

        Returns:
          The mean loss over the microbatches (equal to the pipelined one up to rounding).
        """
        xs, ts = self.microbatch(inputs), self.microbatch(targets)

        def one(x, t):
            y = jax.lax.scan(lambda h, p: (self.layer_fn(p, h), None), x, params)[0]
            return self._loss(y, t, head)[0]

        return jnp.mean(jax.vmap(one)(xs, ts))


def _along(dim: int, entry: Any) -> PartitionSpec:
    """The spec of a value split along dimension ``dim`` over the axes ``entry``."""
    return PartitionSpec(*(None,) * dim, entry)
