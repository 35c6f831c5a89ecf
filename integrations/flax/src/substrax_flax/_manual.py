"""Manual data parallelism: each device's loss on its own rows, gradients reduce-scattered.

Inside ``jax.shard_map`` over the batch axes (the other mesh axes stay with XLA), each
parameter is gathered over the batch axes it is stored sharded on with ``all_gather``, whose
transpose is ``psum_scatter``: the backward pass reduce-scatters each FSDP gradient straight
into its shard (one reduce-scatter, on every backend), and all-reduces the gradients of
parameters that are replicated over the batch axes. The loss is the mean of the devices' losses
(``pmean``), which equals the loss of the whole batch for a loss that is a mean over rows, each
device holding as many rows.

What changes against the default (XLA-partitioned) step, and is therefore opt-in: code that
couples rows across devices sees only its device's rows -- batch statistics (refused here),
a loss normalised by a count over the whole batch (token-weighted means: the mean of the
devices' means differs), dropout masks (each device draws from the same stream).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from jax.sharding import PartitionSpec

from substrax_flax._state import map_variables, variables

__all__ = ["check_manual", "manual_specs", "manual_value_and_grad"]


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def manual_specs(params: Any, rows: dict, batch_axes: tuple[str, ...]) -> Any:
    """Each parameter's spec over the batch axes only (the shard_map's view of it).

    Args:
      params: The differentiated state.
      rows: The plan's rows by path.
      batch_axes: The mesh axes of the batch.

    Returns:
      A pure dict (``nnx.to_pure_dict`` layout) of ``PartitionSpec``s.
    """

    def spec(path, _):
        entries = [tuple(a for a in _axes(e) if a in batch_axes) for e in rows[path].spec]
        return PartitionSpec(*[e if len(e) > 1 else (e[0] if e else None) for e in entries])

    return nnx.to_pure_dict(map_variables(spec, params))


def check_manual(model: nnx.Module) -> None:
    """Raises if the model holds batch statistics, which would become per device.

    Raises:
      ValueError: Naming the first batch statistic.
    """
    for path, variable in variables(nnx.state(model)):
        if isinstance(variable, nnx.BatchStat):
            raise ValueError(
                f"data_parallel='manual' computes each device's loss on its own rows, so the "
                f"batch statistics of this model ({path}, an nnx.BatchStat) would be per "
                "device. Use data_parallel='auto' (the default)."
            )


def _gather(x: jax.Array, spec: PartitionSpec, batch_axes: tuple[str, ...]) -> jax.Array:
    """The parameter gathered over its batch axes, varying over all of them first.

    Marking the shard as varying before the gather puts the transpose of that mark (a sum over
    the replica axes, HSDP's all-reduce) on the shard, after the reduce-scatter, instead of on
    the whole gradient.
    """
    sharded = {a for entry in spec if entry is not None for a in _axes(entry)}
    replicas = tuple(a for a in batch_axes if a not in sharded)
    if replicas:
        x = jax.lax.pcast(x, replicas, to="varying")
    for dim, entry in enumerate(spec):
        if entry is not None:
            x = jax.lax.all_gather(x, entry, axis=dim, tiled=True)
    return x


def manual_value_and_grad(
    loss_of: Callable[[Any, Any, Any], tuple[jax.Array, tuple[Any, Any]]],
    params: Any,
    rest_leaves: list,
    batch: Any,
    *,
    mesh: jax.sharding.Mesh,
    batch_axes: tuple[str, ...],
    specs: Any,
    microbatches: int = 1,
) -> tuple[tuple[jax.Array, tuple[Any, Any]], Any]:
    """``value_and_grad(loss_of, has_aux=True)`` with the batch axes handled by hand.

    With ``microbatches`` K > 1 each device splits its rows into K slices and runs forward and
    backward on one slice at a time (``lax.scan``), summing the gradients of the gathered
    parameters on the device; they are reduce-scattered once, after the scan, so the
    reductions per step do not grow with K while activations are held for one slice only.

    Args:
      loss_of: ``loss_of(params, rest_leaves, batch) -> (loss, (aux, new_rest))`` on one
        device's rows and the gathered parameters.
      params: The differentiated state, stored sharded.
      rest_leaves: The other state's leaves (replicated over the batch axes).
      batch: The batch, sharded over the batch axes.
      mesh: The mesh.
      batch_axes: The batch axes (made manual).
      specs: :func:`manual_specs` of ``params``.
      microbatches: Slices of each device's rows, run one after the other (K must divide
        them).

    Returns:
      ``((loss, (aux, new_rest)), grads)`` as ``jax.value_and_grad`` would, the loss and the
      floating-point aux averaged over the devices.
    """
    template = params

    def local(pure, rest_leaves, batch):
        def objective(pure):
            gathered = jax.tree.map(
                lambda x, spec: _gather(x, spec, batch_axes), pure, specs, is_leaf=_is_spec
            )
            state = jax.tree.map(lambda x: x, template)
            nnx.replace_by_pure_dict(state, gathered)
            loss, (aux, new_rest) = loss_of(state, rest_leaves, batch)
            return jax.lax.pmean(loss, batch_axes), (_mean(aux, batch_axes), new_rest)

        if microbatches > 1:
            return _accumulate(loss_of, template, pure, rest_leaves, batch, specs,
                               batch_axes, microbatches)  # fmt: skip
        return jax.value_and_grad(objective, has_aux=True)(pure)

    spec_batch = PartitionSpec(batch_axes if len(batch_axes) > 1 else batch_axes[0])
    mapped = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(specs, PartitionSpec(), spec_batch),
        out_specs=((PartitionSpec(), PartitionSpec()), specs),
        axis_names=set(batch_axes),
    )
    (loss, extra), grads_pure = mapped(nnx.to_pure_dict(params), rest_leaves, batch)
    grads = jax.tree.map(lambda x: x, template)
    nnx.replace_by_pure_dict(grads, grads_pure)
    return (loss, extra), grads


def _scatter(g: jax.Array, spec: PartitionSpec, batch_axes: tuple[str, ...]) -> jax.Array:
    """The transpose of :func:`_gather`: reduce-scatter each gathered dimension, sum the rest."""
    for dim in reversed(range(len(spec))):
        if spec[dim] is not None:
            g = jax.lax.psum_scatter(g, spec[dim], scatter_dimension=dim, tiled=True)
    sharded = {a for entry in spec if entry is not None for a in _axes(entry)}
    replicas = tuple(a for a in batch_axes if a not in sharded)
    return jax.lax.psum(g, replicas) if replicas else g


def _accumulate(loss_of, template, pure, rest_leaves, batch, specs, batch_axes, k):
    """Forward and backward slice by slice on this device, one reduction at the end."""
    gathered = jax.tree.map(
        lambda x, spec: _gather(x, spec, batch_axes), pure, specs, is_leaf=_is_spec
    )
    slices = jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch)

    def one(gathered, rest_leaves, rows):
        state = jax.tree.map(lambda x: x, template)
        nnx.replace_by_pure_dict(state, gathered)
        loss, (aux, new_rest) = loss_of(state, rest_leaves, rows)
        return loss, (aux, jax.tree.leaves(new_rest), new_rest)

    shapes = jax.eval_shape(one, gathered, rest_leaves, jax.tree.map(lambda x: x[0], slices))
    rest_def = jax.tree.structure(shapes[1][2])

    def body(carry, rows):
        total, rest = carry
        grad = jax.value_and_grad(one, has_aux=True)
        (loss, (aux, rest, _)), grads = grad(gathered, rest, rows)
        return (jax.tree.map(jax.numpy.add, total, grads), rest), (loss, aux)

    zeros = jax.tree.map(jax.numpy.zeros_like, gathered)
    (total, rest), (losses, auxes) = jax.lax.scan(body, (zeros, list(rest_leaves)), slices)
    count = k * math.prod(jax.lax.axis_size(a) for a in batch_axes)
    grads = jax.tree.map(
        lambda g, spec: _scatter(g, spec, batch_axes) / count, total, specs, is_leaf=_is_spec
    )
    loss = jax.lax.pmean(losses.mean(), batch_axes)
    aux = _mean(jax.tree.map(lambda a: a.mean(0), auxes), batch_axes)
    return (loss, (aux, jax.tree.unflatten(rest_def, rest))), grads


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def _mean(tree: Any, axes: tuple[str, ...]) -> Any:
    def mean(x):
        return jax.lax.pmean(x, axes) if jax.numpy.issubdtype(x.dtype, jax.numpy.inexact) else x

    return jax.tree.map(mean, tree)
