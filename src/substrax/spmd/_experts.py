"""Mixture-of-experts feed-forward layers, with experts sharded over expert axes.

:func:`experts` routes each token to its ``top_k`` experts and combines their outputs. Under a
layout with expert axes (the logical name ``expert``, see :class:`~substrax.layout.Layout`) it
enters ``shard_map`` over the batch axes, so each device routes the tokens it holds; tokens
travel to the devices of their experts with one ``all_to_all`` over the expert axes and come
back with another: two per layer forward; the backward pass recomputes the layer in its own
region (two more) and sends the cotangents back (two more).

Routing follows Switch Transformer / GShard: a softmax over the experts, the ``top_k`` largest
chosen and their weights renormalised to sum to 1 (Mixtral's gating). Each expert takes at most
``capacity = ceil(capacity_factor x tokens x top_k / experts)`` tokens of a device's group;
places are given first choices first (every token's first choice before any second choice),
then in token order. A choice past its expert's capacity is dropped: it adds nothing to the
token's output, whose residual connection carries it. ``capacity_factor=None`` is the no-drop
mode (capacity = every token of the group), exact but with ``experts x tokens`` slots.

The load-balancing loss is Switch Transformer's, ``experts x sum_e f_e p_e`` (``f_e`` the share
of choices routed to expert ``e``, ``p_e`` its mean router probability), with ``f`` and ``p``
taken over the whole batch, so it is the same on any number of devices.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from substrax.mesh._resolve import spec_entry
from substrax.spmd._constrain import manual_batch_axes
from substrax.spmd._region import axes_size, free_axes, recomputed_region, region_mesh

__all__ = ["ExpertStats", "experts", "expert_capacity"]


class ExpertStats(NamedTuple):
    """What routing did, over the whole batch.

    Attributes:
      aux_loss: The load-balancing loss (1.0 for a perfectly even router; add it to the loss
        with a small weight, 0.01 in Switch Transformer).
      load: The share of the choices routed to each expert ``[experts]`` (before dropping).
      dropped: The share of choices dropped for want of capacity.
    """

    aux_loss: jax.Array
    load: jax.Array
    dropped: jax.Array


def expert_capacity(tokens: int, experts: int, top_k: int, capacity_factor: float | None) -> int:
    """Slots per expert for a group of ``tokens``: ``ceil(factor x tokens x top_k / experts)``.

    Args:
      tokens: The tokens of one group (one device's).
      experts: The number of experts.
      top_k: Experts per token.
      capacity_factor: The factor, or None for no dropping (``tokens`` slots).

    Returns:
      The capacity, at least 1 and at most ``tokens``.
    """
    if capacity_factor is None:
        return tokens
    return max(1, min(tokens, math.ceil(capacity_factor * tokens * top_k / experts)))


def experts(
    x: jax.Array,
    router: jax.Array,
    w_in: jax.Array,
    w_out: jax.Array,
    *,
    w_gate: jax.Array | None = None,
    top_k: int = 2,
    capacity_factor: float | None = 1.25,
    activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu,
) -> tuple[jax.Array, ExpertStats]:
    """A mixture-of-experts feed-forward layer: ``x`` through its ``top_k`` experts.

    Model code passes the whole batch as it sees it. Under rules that map ``batch`` (inside
    substrax's steps) each device routes its own rows (a group); where ``expert`` maps to mesh
    axes the expert weights stay sharded over them and tokens move with ``all_to_all``.

    Args:
      x: Tokens ``[batch, length, features]``.
      router: Router weights ``[features, experts]`` (computed in float32).
      w_in: Expert input weights ``[experts, features, hidden]``.
      w_out: Expert output weights ``[experts, hidden, features]``.
      w_gate: Gate weights shaped as ``w_in`` for gated experts (Mixtral's SwiGLU:
        ``activation(x @ w_gate) * (x @ w_in)``, with ``activation=jax.nn.silu``), or None.
      top_k: Experts per token.
      capacity_factor: Slots per expert relative to an even load (see the module); None
        drops nothing.
      activation: The experts' activation.

    Returns:
      ``(y, stats)``: the output ``[batch, length, features]`` in ``x``'s dtype and the
      :class:`ExpertStats`.

    Raises:
      ValueError: If ``top_k`` is not in ``[1, experts]``, the capacity factor is not
        positive, the shapes disagree, the experts do not divide over the expert axes, or
        the expert axes do not split the batch.
    """
    count = router.shape[-1]
    weights = (w_in, w_out) if w_gate is None else (w_in, w_out, w_gate)
    _check(x, router, *weights[:2], top_k, capacity_factor)
    if w_gate is not None and w_gate.shape != w_in.shape:
        raise ValueError(f"w_gate has shape {w_gate.shape}; it needs w_in's, {w_in.shape}.")
    tokens, expert = free_axes("batch"), free_axes("expert")
    size = axes_size(expert)
    if not set(expert) <= set(tokens):
        raise ValueError(
            f"The expert axes {expert} must also split the batch (rules map 'batch' to "
            f"{tokens}): tokens reach their experts within the devices that hold them. A "
            "Layout with an expert role does both."
        )
    if count % size:
        raise ValueError(
            f"{count} experts do not divide over the {size} devices of the expert axes "
            f"{expert}; use a multiple of {size} experts."
        )

    def group(x, router, weights):
        return _group(x, router, weights, top_k, capacity_factor, activation, expert, tokens)

    if tokens:
        rows, sharded = PartitionSpec(spec_entry(tokens)), PartitionSpec(spec_entry(expert))
        specs = (rows, PartitionSpec(), (sharded,) * len(weights))
        group = recomputed_region(group, region_mesh(tokens), specs, (rows, PartitionSpec()),
                                  set(tokens))  # fmt: skip
    y, sums = group(x, router, weights)
    outer = manual_batch_axes()
    if outer:  # the step's region: every device holds its own rows
        sums = jax.lax.psum(sums, outer)
    return y, _stats(sums, count, top_k)


def _check(x, router, w_in, w_out, top_k, capacity_factor) -> None:
    features, count = router.shape
    if not isinstance(top_k, int) or not 1 <= top_k <= count:
        raise ValueError(f"top_k must be an integer in [1, {count}] (the experts), got {top_k!r}.")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be positive or None, got {capacity_factor!r}.")
    if x.ndim != 3 or x.shape[-1] != features:
        raise ValueError(
            f"x has shape {x.shape}; a router of {router.shape} takes [batch, length, {features}]."
        )
    hidden = w_in.shape[-1]
    for name, array, shape in (("w_in", w_in, (count, features, hidden)),
                               ("w_out", w_out, (count, hidden, features))):  # fmt: skip
        if tuple(array.shape) != shape:
            raise ValueError(
                f"{name} has shape {tuple(array.shape)}; with a router of {router.shape} and "
                f"w_in {tuple(w_in.shape)} it needs {shape}."
            )


def _group(x, router, weights, top_k, capacity_factor, activation, expert, tokens):
    """One group's tokens through their experts; also ``[choices, probabilities, kept]`` sums."""
    batch, length, features = x.shape
    flat = x.reshape(batch * length, features)
    count = router.shape[-1]
    capacity = expert_capacity(flat.shape[0], count, top_k, capacity_factor)
    probs = jax.nn.softmax(flat.astype(jnp.float32) @ router.astype(jnp.float32), axis=-1)
    dispatch, combine, chosen = _route(probs, top_k, capacity)
    slots = jnp.einsum("tec,td->ecd", dispatch.astype(x.dtype), flat)
    if expert:  # [experts, capacity] -> [local experts, devices x capacity]
        slots = jax.lax.all_to_all(slots, spec_entry(expert), 0, 1, tiled=True)
    w_in, w_out, *gate = (w.astype(x.dtype) for w in weights)
    hidden = jnp.einsum("ecd,edh->ech", slots, w_in)
    if gate:
        hidden = activation(jnp.einsum("ecd,edh->ech", slots, gate[0])) * hidden
    else:
        hidden = activation(hidden)
    out = jnp.einsum("ech,ehd->ecd", hidden, w_out)
    if expert:
        out = jax.lax.all_to_all(out, spec_entry(expert), 1, 0, tiled=True)
    y = jnp.einsum("tec,ecd->td", combine.astype(x.dtype), out).reshape(x.shape)
    sums = jnp.stack([chosen.sum(0), probs.sum(0), dispatch.sum((0, 2))])
    if tokens:
        sums = jax.lax.psum(sums, tokens)
    return y, sums


def _route(probs: jax.Array, top_k: int, capacity: int):
    """Dispatch ``[tokens, experts, capacity]`` (0/1), combine weights, and choices per expert."""
    gates, index = jax.lax.top_k(probs, top_k)  # [tokens, k]
    gates = gates / gates.sum(-1, keepdims=True)
    count = probs.shape[-1]
    choice = jax.nn.one_hot(index.T, count, dtype=jnp.int32)  # [k, tokens, experts]
    # A choice's place in its expert's queue: first choices first, then token order.
    order = choice.reshape(-1, count)
    place = (jnp.cumsum(order, axis=0) - 1).reshape(choice.shape)
    kept = choice * (place < capacity)
    slot = jax.nn.one_hot(jnp.where(kept > 0, place, capacity), capacity, dtype=jnp.float32)
    dispatch = (kept[..., None] * slot).sum(0)  # [tokens, experts, capacity]
    combine = (gates.T[:, :, None, None] * kept[..., None] * slot).sum(0)
    return dispatch, combine, choice.sum(0).astype(jnp.float32)


def _stats(sums: jax.Array, count: int, top_k: int) -> ExpertStats:
    chosen, probs, kept = sums
    tokens = chosen.sum() / top_k
    load = chosen / (tokens * top_k)
    aux = count * jnp.sum(load * probs / tokens)
    return ExpertStats(aux, load, 1.0 - kept.sum() / (tokens * top_k))
