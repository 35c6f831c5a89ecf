"""make_train_step: one jitted, donated training step that keeps the planned shardings."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec

from substrax.mesh import MeshRules
from substrax.spmd import shard_batch, use_rules
from substrax_flax._optimizer import optimizer_rows
from substrax_flax._plan import _plan_state, shardings_of
from substrax_flax._resolve import Resolver, Rules, Strategy, as_rules
from substrax_flax._state import constrain_state

__all__ = ["TrainStep", "make_train_step"]

Gather = Literal["keep", "regather"]
_GATHERED = "substrax_gathered_param"


class _JittedStep:
    """What every substrax step shares: batch placement, the call, lowering, the jit cache.

    Subclasses set ``mesh``, ``data_axes`` and ``_compiled`` and implement ``_build``.
    """

    mesh: jax.sharding.Mesh
    data_axes: Any
    _compiled: dict

    def _build(self, model: nnx.Module, optimizer: nnx.Optimizer) -> Any:
        raise NotImplementedError

    def _jitted(self, model: nnx.Module, optimizer: nnx.Optimizer) -> Any:
        key = (nnx.graphdef(model), nnx.graphdef(optimizer))
        if key not in self._compiled:
            self._compiled[key] = self._build(model, optimizer)
        return self._compiled[key]

    def _batch(self, batch: Any) -> Any:
        if all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(batch)):
            return batch
        return shard_batch(batch, self.mesh, self.data_axes)

    def __call__(self, model: nnx.Module, optimizer: nnx.Optimizer, batch: Any) -> dict:
        """Runs one step and updates ``model`` and ``optimizer`` in place.

        Args:
          model: The model (its state is donated and replaced).
          optimizer: Its ``nnx.Optimizer`` (likewise).
          batch: Host arrays (sharded over the data axes here; in a multi-process run each
            process passes its local slice) or ``jax.Array``s already on the mesh.

        Returns:
          The metrics: ``{"loss": ...}`` plus ``loss_fn``'s aux (a dict's items, or ``"aux"``).
        """
        jitted = self._jitted(model, optimizer)
        model_state, opt_state, metrics = jitted(
            nnx.state(model), nnx.state(optimizer), self._batch(batch)
        )
        nnx.update(model, model_state)
        nnx.update(optimizer, opt_state)
        return metrics

    def lower(self, model: nnx.Module, optimizer: nnx.Optimizer, batch: Any) -> jax.stages.Lowered:
        """Lowers the step without running it.

        Args:
          model: The model.
          optimizer: Its optimizer.
          batch: A batch, as for a call.

        Returns:
          The lowered step; ``.compile()`` gives ``memory_analysis()``, ``cost_analysis()`` and
          ``as_text()`` (the partitioned HLO).
        """
        jitted = self._jitted(model, optimizer)
        return jitted.lower(nnx.state(model), nnx.state(optimizer), self._batch(batch))


class TrainStep(_JittedStep):
    """A jitted training step; build it with :func:`make_train_step`.

    Calling ``step(model, optimizer, batch)`` runs one step, updates ``model`` and
    ``optimizer`` in place and returns the metrics. ``step.lower(model, optimizer, batch)``
    returns the lowered computation (``.compile()`` it for ``memory_analysis()`` and the HLO).
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        mesh: jax.sharding.Mesh,
        resolver: Resolver,
        compute_rules: MeshRules | None,
        *,
        has_aux: bool,
        wrt: Any,
        gather: Gather,
        data_axes: Sequence[str] | str | None,
        donate: bool,
    ):
        """Stores the configuration; compilation happens on the first call.

        Args:
          loss_fn: ``loss_fn(model, batch)`` returning a scalar or ``(scalar, aux)``.
          mesh: The device mesh.
          resolver: Plans the parameter shardings (rules, strategy).
          compute_rules: Rules for activations and for parameters at the point of use.
          has_aux: Whether ``loss_fn`` returns ``(loss, aux)``.
          wrt: The variables that are differentiated and updated.
          gather: ``"keep"`` or ``"regather"`` (see :func:`make_train_step`).
          data_axes: Mesh axes of the batch's leading dimension.
          donate: Donate the model and optimizer buffers to the step.
        """
        self.loss_fn = loss_fn
        self.mesh = mesh
        self.resolver = resolver
        self.compute_rules = compute_rules
        self.has_aux = has_aux
        self.wrt = wrt
        self.gather = gather
        self.data_axes = data_axes
        self.donate = donate
        self._compiled: dict[Any, Any] = {}

    def _shardings(self, model: nnx.Module, optimizer: nnx.Optimizer) -> tuple[Any, Any, Any]:
        """Planned shardings of the model state, the optimizer state, and compute shardings."""
        model_state = nnx.state(model)
        rows, model_shardings = _plan_state(model_state, self.resolver)
        opt_state = nnx.state(optimizer)
        opt_rows = optimizer_rows(opt_state, rows, self.mesh)
        opt_shardings = shardings_of(opt_rows, opt_state, self.mesh)
        params = nnx.state(model, self.wrt)
        if self.compute_rules is None:
            return model_shardings, opt_shardings, None
        compute = Resolver(self.mesh, self.compute_rules, self.resolver.strategy)
        return model_shardings, opt_shardings, _plan_state(params, compute)[1]

    def _step_fn(self, model_def, opt_def, compute_shardings, model_sh, opt_sh):
        def loss_of(params, rest, batch):
            if compute_shardings is not None:
                params = constrain_state(params, compute_shardings)
                params = jax.tree.map(lambda p: checkpoint_name(p, _GATHERED), params)
            model = nnx.merge(model_def, params, rest)
            out = self.loss_fn(model, batch)
            loss, aux = out if self.has_aux else (out, None)
            return loss, (aux, nnx.state(model, nnx.Not(self.wrt)))

        if self.gather == "regather":
            policy = jax.checkpoint_policies.save_anything_except_these_names(_GATHERED)
            loss_of = jax.checkpoint(loss_of, policy=policy)

        def step(model_state, opt_state, batch):
            with use_rules(self.mesh, self.compute_rules or self.resolver.rules):
                model = nnx.merge(model_def, model_state)
                _, params, rest = nnx.split(model, self.wrt, ...)
                grad_fn = jax.value_and_grad(loss_of, has_aux=True)
                (loss, (aux, rest)), grads = grad_fn(params, rest, batch)
                nnx.update(model, rest)
                optimizer = nnx.merge(opt_def, opt_state)
                optimizer.update(model, grads)
                metrics = {"loss": loss}
                if aux is not None:
                    metrics.update(aux if isinstance(aux, dict) else {"aux": aux})
                return (
                    constrain_state(nnx.state(model), model_sh),
                    constrain_state(nnx.state(optimizer), opt_sh),
                    metrics,
                )

        return step

    def _build(self, model: nnx.Module, optimizer: nnx.Optimizer) -> Any:
        model_def, opt_def = nnx.graphdef(model), nnx.graphdef(optimizer)
        model_sh, opt_sh, compute_sh = self._shardings(model, optimizer)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        return jax.jit(
            self._step_fn(model_def, opt_def, compute_sh, model_sh, opt_sh),
            in_shardings=(model_sh, opt_sh, None),
            out_shardings=(model_sh, opt_sh, replicated),
            donate_argnums=(0, 1) if self.donate else (),
        )


def make_train_step(
    loss_fn: Callable[..., Any],
    mesh: jax.sharding.Mesh,
    rules: Rules = None,
    *,
    strategy: Strategy = None,
    compute_rules: Rules = None,
    has_aux: bool = False,
    wrt: Any = nnx.Param,
    gather: Gather = "keep",
    data_axes: Sequence[str] | str | None = None,
    donate: bool = True,
) -> TrainStep:
    """Builds a jitted training step that realises the layout the rules describe.

    The step differentiates ``loss_fn`` with respect to ``wrt``, applies the optimizer, and
    returns the whole new state, so no update is lost (the trap of a ``jax.jit`` step that
    returns only the model). Parameters and optimizer state are pinned to their planned
    shardings on the way in and out, so they do not drift, and their buffers are donated.

    With ``compute_rules``, each parameter is constrained to its compute layout before use,
    so that XLA gathers FSDP-sharded parameters once per step (and reduce-scatters their
    gradients) rather than choosing a pattern of its own. :func:`substrax.spmd.constrain` in
    model code resolves through the compute rules (through ``rules`` when there are none).

    Args:
      loss_fn: ``loss_fn(model, batch)`` returning a scalar loss, or ``(loss, aux)`` with
        ``has_aux=True``.
      mesh: The device mesh.
      rules: The parameter rules the model was planned with (see :func:`plan_model`).
      strategy: The strategy the model was planned with.
      compute_rules: Rules for activations and for parameters at the point of use; for FSDP,
        the parameter rules with the FSDP axis removed from weight dimensions.
      has_aux: Whether ``loss_fn`` returns ``(loss, aux)``.
      wrt: The variables to differentiate and update, as for ``nnx.Optimizer``.
      gather: ``"keep"`` keeps gathered parameters from the forward pass for the backward pass
        (less traffic); ``"regather"`` gathers them again in the backward pass (less memory).
        Only meaningful with ``compute_rules``.
      data_axes: The mesh axes of the batch's leading dimension; by default the rules'
        ``data`` axes.
      donate: Donate the model and optimizer buffers to the step.

    Returns:
      A :class:`TrainStep`.

    Raises:
      ValueError: If ``gather`` is not ``"keep"`` or ``"regather"``, or no data axes are
        known.
    """
    if gather not in ("keep", "regather"):
        raise ValueError(f"gather must be 'keep' or 'regather', got {gather!r}.")
    resolver = Resolver(mesh, rules, strategy)
    compute = as_rules(compute_rules, mesh) if compute_rules is not None else None
    data_axes = data_axes if data_axes is not None else (compute or resolver.rules).data
    if data_axes is None:
        raise ValueError(
            "make_train_step needs the batch's mesh axes: pass data_axes=..., or rules whose "
            f"'data' maps to mesh axes (mesh axes: {tuple(mesh.axis_names)})."
        )
    return TrainStep(
        loss_fn,
        resolver.mesh,
        resolver,
        compute,
        has_aux=has_aux,
        wrt=wrt,
        gather=gather,
        data_axes=data_axes,
        donate=donate,
    )
