"""What changes when each device computes its own rows, and what cannot.

Inside the manual data-parallel region (:mod:`substrax_flax._manual`) each device sees its own
rows. ``nnx.BatchNorm`` layers reduce their moments over the batch axes
(:func:`sync_batch_norms`), so they are the whole batch's; random draws from the model's
``nnx.Rngs`` streams are folded with the device's position (:func:`per_device_streams`), so
masks differ across devices and repeat for a seed and layout. Batch statistics of the model's
own cannot be made the whole batch's (:func:`batch_stat_obstacle`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from substrax_flax._experts import MixtureOfExperts
from substrax_flax._state import variables
from substrax_flax._traced import is_key

__all__ = [
    "batch_stat_obstacle", "fold_key", "per_device_streams", "sync_batch_norms", "synced_stats",
]  # fmt: skip


def batch_stat_obstacle(model: nnx.Module) -> str | None:
    """The first batch statistic outside an ``nnx.BatchNorm`` substrax can sync, or None.

    Such statistics would be computed from each device's rows in a manual region, so they
    would differ from one device's.
    """
    synced = synced_stats(model)
    for path, variable in variables(nnx.state(model)):
        if isinstance(variable, nnx.BatchStat) and path not in synced:
            return (
                f"the model has batch statistics ({path}, an nnx.BatchStat) outside an "
                "nnx.BatchNorm whose axis_name substrax can set, so the step would not match "
                "one device's"
            )
    return None


def synced_stats(model: nnx.Module) -> set[str]:
    """Paths of the batch statistics the manual step reduces over the batch axes.

    Those of every ``nnx.BatchNorm`` without an ``axis_name`` of its own: inside the manual
    region :func:`sync_batch_norms` gives it the batch axes, so its moments are the whole
    batch's (``lax.pmean`` over the devices, each holding as many rows) and its running
    averages are the same on every device, as on one device. Also the router bias of a
    :class:`~substrax_flax.MixtureOfExperts`, updated from whole-batch routing counts.
    """
    synced = set()
    for path, module in nnx.iter_modules(model):
        prefix = "/".join(map(str, path))
        if isinstance(module, nnx.BatchNorm) and module.axis_name is None:
            synced.update(f"{prefix}/{name}" if prefix else name for name in ("mean", "var"))
        if isinstance(module, MixtureOfExperts) and hasattr(module, "router_bias"):
            # its update reads the routing counts, summed over the batch axes by experts()
            synced.add(f"{prefix}/router_bias" if prefix else "router_bias")
    return synced


def sync_batch_norms(model: nnx.Module, batch_axes: tuple[str, ...]) -> None:
    """Gives every ``nnx.BatchNorm`` of ``model`` without an ``axis_name`` the batch axes.

    Call on the model merged inside the manual region (its moments are then reduced over the
    devices); the stored model is not changed.
    """
    for _, module in nnx.iter_modules(model):
        if isinstance(module, nnx.BatchNorm) and module.axis_name is None:
            module.axis_name = batch_axes


def fold_key(key: jax.Array, data: Any) -> jax.Array:
    """``jax.random.fold_in`` of every key in a typed key array of any shape.

    A stream of layers stacked with ``nnx.vmap`` holds one key per layer.
    """
    if not key.ndim:
        return jax.random.fold_in(key, data)
    folded = jax.vmap(jax.random.fold_in, in_axes=(0, None))(key.reshape(-1), data)
    return folded.reshape(key.shape)


def per_device_streams(loss_of: Callable, batch_axes: tuple[str, ...]) -> Callable:
    """``loss_of`` drawing each device's random numbers from its own streams.

    Every typed key among the other state's leaves (an ``nnx.Rngs`` stream's key) enters the
    loss folded with the device's linear position over ``batch_axes``
    (``jax.random.fold_in(key, axis_index)``), so dropout masks differ across devices and
    repeat for a given seed and layout, as in other data-parallel frameworks; the stored keys
    come back unchanged (the counts advance as on one device). Inside a manual region only.

    Args:
      loss_of: ``loss_of(params, rest_leaves, batch) -> (loss, (aux, new_rest))``.
      batch_axes: The manual batch axes.

    Returns:
      The wrapped ``loss_of``.
    """

    def folded(params, rest_leaves, batch):
        keys = [is_key(x) for x in rest_leaves]
        if not any(keys):
            return loss_of(params, rest_leaves, batch)
        index = jax.lax.axis_index(batch_axes)
        pairs = zip(rest_leaves, keys, strict=True)
        leaves = [fold_key(x, index) if k else x for x, k in pairs]
        loss, (aux, new_rest) = loss_of(params, leaves, batch)
        new_leaves, new_def = jax.tree.flatten(new_rest)
        if len(new_leaves) == len(keys):  # the state kept its structure: restore the keys
            triples = zip(new_leaves, rest_leaves, keys, strict=True)
            new_leaves = [x if k else n for n, x, k in triples]
            new_rest = jax.tree.unflatten(new_def, new_leaves)
        return loss, (aux, new_rest)

    return folded
