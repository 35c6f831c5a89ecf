"""Mixture-of-experts feed-forward layers, with experts sharded over expert axes.

:func:`experts` routes each token to its ``top_k`` experts (:func:`~substrax.spmd.route`) and
combines their outputs. Under a layout with expert axes (the logical name ``expert``, see
:class:`~substrax.layout.Layout`) it enters ``shard_map`` over the batch axes, so each device
routes the tokens it holds (a group) and the expert weights stay sharded over the expert axes;
the backward pass recomputes the layer in a region of its own.

Two dispatches:

* ``"sorted"`` (the default) drops nothing. A group's choices are sorted by expert and each
  expert's rows multiplied by its weights (:func:`~substrax.spmd.grouped_matmul`), then put
  back in token order: memory and work grow as ``tokens x top_k x features``, with no term in
  ``experts x capacity``. Over expert axes the counts per expert travel first, then the rows,
  in rounds of ``chunk`` rows per pair of devices: what moves is the rows routed plus the
  rounding, both in :class:`ExpertStats`.
* ``"one-hot"`` (Switch Transformer, GShard) einsums tokens into ``capacity`` slots per
  expert, ``capacity = ceil(capacity_factor x tokens x top_k / experts)``; places go to first
  choices first, then in token order, and a choice past its expert's capacity is dropped (it
  adds nothing; the residual connection carries the token). ``capacity_factor=None`` keeps
  every choice with ``experts x tokens`` slots. Two ``all_to_all`` per layer forward over the
  expert axes, of the whole ``[experts, capacity, features]``.

The load-balancing loss is Switch Transformer's, ``experts x sum_e f_e p_e`` (``f_e`` the share
of choices routed to expert ``e``, ``p_e`` its mean router probability), and the z-loss
ST-MoE's, the mean squared ``logsumexp`` of the logits; both over the whole batch, so the same
on any number of devices.
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
from substrax.spmd._exchange import plan_exchange, send, send_back
from substrax.spmd._grouped import group_rows, grouped_matmul, segment_of
from substrax.spmd._region import axes_size, free_axes, recomputed_region, region_mesh
from substrax.spmd._routing import ROUTINGS, route

__all__ = ["DISPATCHES", "ExpertStats", "experts", "expert_capacity"]

#: The dispatches :func:`experts` takes.
DISPATCHES = ("sorted", "one-hot")


class ExpertStats(NamedTuple):
    """What routing did, over the whole batch.

    Attributes:
      aux_loss: The load-balancing loss (1.0 for a perfectly even router; add it to the loss
        with a small weight, 0.01 in Switch Transformer).
      z_loss: The router z-loss, the mean squared ``logsumexp`` of the logits (ST-MoE adds it
        with weight 0.001).
      load: The share of the choices routed to each expert ``[experts]`` (before dropping).
      dropped: The share of choices dropped for want of capacity (0 for ``"sorted"``).
      counts: The choices routed to each expert ``[experts]``: ``tokens x top_k`` in all.
      sent: Rows the forward dispatch sent to other devices (all devices together).
      moved: Rows the forward dispatch's ``all_to_all`` carried to other devices, padding
        included (``moved - sent`` is the padding; 0 without expert axes).
    """

    aux_loss: jax.Array
    z_loss: jax.Array
    load: jax.Array
    dropped: jax.Array
    counts: jax.Array
    sent: jax.Array
    moved: jax.Array


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
    routing: str = "softmax",
    normalize: bool = True,
    router_bias: jax.Array | None = None,
    dispatch: str = "sorted",
    capacity_factor: float | None = None,
    activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu,
    block: int | None = None,
    chunk: int | None = None,
) -> tuple[jax.Array, ExpertStats]:
    """A mixture-of-experts feed-forward layer: ``x`` through its ``top_k`` experts.

    Model code passes the whole batch as it sees it. Under rules that map ``batch`` (inside
    substrax's steps) each device routes its own rows (a group); where ``expert`` maps to mesh
    axes the expert weights stay sharded over them and tokens travel to their experts.

    Args:
      x: Tokens ``[batch, length, features]``.
      router: Router weights ``[features, experts]`` (computed in float32).
      w_in: Expert input weights ``[experts, features, hidden]``.
      w_out: Expert output weights ``[experts, hidden, features]``.
      w_gate: Gate weights shaped as ``w_in`` for gated experts (SwiGLU:
        ``activation(x @ w_gate) * (x @ w_in)``, with ``activation=jax.nn.silu``), or None.
      top_k: Experts per token.
      routing: The router's scoring, one of :data:`~substrax.spmd.ROUTINGS`.
      normalize: Renormalise the chosen experts' weights to sum to 1.
      router_bias: A bias ``[experts]`` that moves the choice but not the weights (load
        balancing without an auxiliary loss), or None.
      dispatch: ``"sorted"`` (no capacity, nothing dropped) or ``"one-hot"`` (capacity
        slots; see the module).
      capacity_factor: ``"one-hot"`` only: slots per expert relative to an even load; None
        drops nothing.
      activation: The experts' activation.
      block: ``"sorted"`` on XLA:CPU: rows per block of the grouped product (each expert's
        rows are padded to whole blocks); None for :func:`~substrax.spmd.group_rows`'
        default (padding within 1/16 of the rows).
      chunk: ``"sorted"`` over expert axes: rows per pair of devices per round of the
        exchange; None for 1/64 of an even share (the rounding then costs at most
        1/64 of an even share per pair; the busiest pair sets the rounds).

    Returns:
      ``(y, stats)``: the output ``[batch, length, features]`` in ``x``'s dtype and the
      :class:`ExpertStats`.

    Raises:
      ValueError: If ``top_k`` is not in ``[1, experts]``, ``routing`` or ``dispatch`` is
        unknown, a capacity factor is given to ``"sorted"`` or is not positive, the shapes
        disagree, the experts do not divide over the expert axes, or the expert axes do not
        split the batch.
    """
    count = router.shape[-1]
    weights = (w_in, w_out) if w_gate is None else (w_in, w_out, w_gate)
    _check(x, router, *weights[:2], top_k, dispatch, capacity_factor, routing, router_bias)
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
    bias = jnp.zeros((count,), jnp.float32) if router_bias is None else router_bias
    options = _Options(top_k, routing, normalize, dispatch, capacity_factor, activation, block,
                       chunk, expert, tokens)  # fmt: skip

    def group(x, router, bias, weights):
        return _group(x, router, bias, weights, options)

    if tokens:
        rows, sharded = PartitionSpec(spec_entry(tokens)), PartitionSpec(spec_entry(expert))
        specs = (rows, PartitionSpec(), PartitionSpec(), (sharded,) * len(weights))
        group = recomputed_region(group, region_mesh(tokens), specs, (rows, PartitionSpec()),
                                  set(tokens))  # fmt: skip
    y, sums = group(x, router, jax.lax.stop_gradient(bias), weights)
    bound = set(jax.sharding.get_abstract_mesh().manual_axes)
    outer = tuple(a for a in manual_batch_axes() if a in bound)
    if outer:  # the step's region: every device holds its own rows
        sums = jax.lax.psum(sums, outer)
    return y, _stats(sums, count, top_k)


class _Options(NamedTuple):
    top_k: int
    routing: str
    normalize: bool
    dispatch: str
    capacity_factor: float | None
    activation: Callable
    block: int
    chunk: int | None
    expert: tuple[str, ...]
    tokens: tuple[str, ...]


def _check(x, router, w_in, w_out, top_k, dispatch, capacity_factor, routing, bias) -> None:
    features, count = router.shape
    if not isinstance(top_k, int) or not 1 <= top_k <= count:
        raise ValueError(f"top_k must be an integer in [1, {count}] (the experts), got {top_k!r}.")
    if dispatch not in DISPATCHES:
        raise ValueError(f"dispatch must be one of {DISPATCHES}, got {dispatch!r}.")
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}.")
    if dispatch == "sorted" and capacity_factor is not None:
        raise ValueError(
            f"capacity_factor={capacity_factor!r} applies to dispatch='one-hot'; 'sorted' has "
            "no capacity and drops nothing (pass capacity_factor=None)."
        )
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be positive or None, got {capacity_factor!r}.")
    if bias is not None and tuple(bias.shape) != (count,):
        raise ValueError(f"router_bias has shape {tuple(bias.shape)}; it needs ({count},).")
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


def _group(x, router, bias, weights, options: _Options):
    """One group's tokens through their experts; also the routing's sums (see :func:`_stats`)."""
    batch, length, features = x.shape
    flat = x.reshape(batch * length, features)
    count = router.shape[-1]
    logits = flat.astype(jnp.float32) @ router.astype(jnp.float32)
    routed = route(logits, options.top_k, options.routing, normalize=options.normalize,
                   bias=bias)  # fmt: skip
    weights = tuple(w.astype(x.dtype) for w in weights)
    if options.dispatch == "sorted":
        y, kept, sent, moved = _sorted(flat, routed, weights, count, options)
    else:
        y, kept, sent, moved = _one_hot(flat, routed, weights, count, options)
    chosen = jnp.zeros((count,), jnp.float32).at[routed.index.reshape(-1)].add(1.0)
    scalars = jnp.stack([jnp.sum(routed.z**2), sent, moved]).astype(jnp.float32)
    sums = jnp.concatenate([chosen, routed.probs.sum(0), kept, scalars])
    if options.tokens:
        sums = jax.lax.psum(sums, options.tokens)
    return y.astype(x.dtype).reshape(x.shape), sums


def _ffn(x, weights, groups, source, gate, target, rows, activation):
    """The experts' feed-forward on grouped rows.

    Each output is scaled by its choice's gate and added into ``target``'s rows (float32).
    """
    w_in, w_out, *w_gate = weights
    hidden = grouped_matmul(x, w_in, groups, source=source)
    if w_gate:
        hidden = activation(grouped_matmul(x, w_gate[0], groups, source=source)) * hidden
    else:
        hidden = activation(hidden)
    if gate is not None:
        hidden = (hidden.astype(jnp.float32) * gate[:, None]).astype(x.dtype)
    return grouped_matmul(hidden, w_out, groups, target=target, rows=rows)


def _sorted(flat, routed, weights, count, options: _Options):
    """Dropless dispatch.

    Returns the combined output ``[tokens, features]`` (float32), the kept choices per
    expert, and the rows sent and moved.
    """
    tokens, top_k = routed.index.shape
    choices = routed.index.reshape(-1)
    token = jnp.arange(tokens * top_k) // top_k
    kept = jnp.zeros((count,), jnp.float32).at[choices].add(1.0)
    if options.expert:
        y, sent, moved = _exchanged(flat, choices, token, routed.gates, weights, count, options)
        return y, kept, sent, moved
    groups = group_rows(choices, count, block=options.block)
    at = jnp.take(token, groups.slots, mode="fill", fill_value=tokens)
    gate = jnp.take(routed.gates.reshape(-1), groups.slots, mode="fill", fill_value=0)
    y = _ffn(flat, weights, groups, at, gate, at, tokens, options.activation)
    zero = jnp.zeros((), jnp.float32)
    return y, kept, zero, zero


def _exchanged(flat, choices, token, gates, weights, count, options: _Options):
    """Choices to the devices of their experts, through them, back, and combined."""
    axes = spec_entry(options.expert)
    devices = axes_size(options.expert)
    local = count // devices
    rows = choices.shape[0]
    order = jnp.argsort(choices, stable=True)
    per_expert = jnp.bincount(choices, length=count).reshape(devices, local)
    chunk = options.chunk or max(1, math.ceil(rows / devices / 64))
    exchange = plan_exchange(per_expert, rows, axes, chunk)
    received = send(jnp.take(flat, token[order], axis=0), exchange, axes)
    group = segment_of(jnp.cumsum(exchange.received, axis=1), exchange.capacity)
    groups = group_rows(group.reshape(-1), local, block=options.block, ragged=True)
    buffer = received.reshape(-1, flat.shape[-1])
    out = _ffn(buffer, weights, groups, groups.slots, None, groups.slots, buffer.shape[0],
               options.activation)  # fmt: skip
    back = send_back(out.astype(flat.dtype).reshape(received.shape), exchange, axes, rows)
    weighted = back.astype(jnp.float32) * gates.reshape(-1)[order][:, None]
    y = jnp.zeros((flat.shape[0], flat.shape[1]), jnp.float32).at[token[order]].add(weighted)
    me = jax.lax.axis_index(axes)
    sent = (rows - exchange.counts[me]).astype(jnp.float32)
    moved = (exchange.rounds * chunk * (devices - 1)).astype(jnp.float32)
    return y, sent, moved


def _one_hot(flat, routed, weights, count, options: _Options):
    """Capacity dispatch: the combined output, kept choices per expert, sent and moved rows."""
    capacity = expert_capacity(flat.shape[0], count, options.top_k, options.capacity_factor)
    dispatch, combine = _slots(routed, count, capacity)
    slots = jnp.einsum("tec,td->ecd", dispatch.astype(flat.dtype), flat)
    devices = axes_size(options.expert)
    if options.expert:  # [experts, capacity] -> [local experts, devices x capacity]
        slots = jax.lax.all_to_all(slots, spec_entry(options.expert), 0, 1, tiled=True)
    w_in, w_out, *gate = weights
    hidden = jnp.einsum("ecd,edh->ech", slots, w_in)
    if gate:
        hidden = options.activation(jnp.einsum("ecd,edh->ech", slots, gate[0])) * hidden
    else:
        hidden = options.activation(hidden)
    out = jnp.einsum("ech,ehd->ecd", hidden, w_out)
    if options.expert:
        out = jax.lax.all_to_all(out, spec_entry(options.expert), 1, 0, tiled=True)
    y = jnp.einsum("tec,ecd->td", combine.astype(flat.dtype), out)
    kept = dispatch.sum((0, 2))
    if not options.expert:
        zero = jnp.zeros((), jnp.float32)
        return y, kept, zero, zero
    home = jnp.arange(count) // (count // devices) == jax.lax.axis_index(spec_entry(options.expert))
    sent = jnp.sum(jnp.where(home, 0.0, kept))
    moved = jnp.asarray(count * capacity * (devices - 1) / devices, jnp.float32)
    return y, kept, sent, moved


def _slots(routed, count: int, capacity: int):
    """Dispatch ``[tokens, experts, capacity]`` (0/1) and combine weights."""
    choice = jax.nn.one_hot(routed.index.T, count, dtype=jnp.int32)  # [k, tokens, experts]
    # A choice's place in its expert's queue: first choices first, then token order.
    order = choice.reshape(-1, count)
    place = (jnp.cumsum(order, axis=0) - 1).reshape(choice.shape)
    kept = choice * (place < capacity)
    slot = jax.nn.one_hot(jnp.where(kept > 0, place, capacity), capacity, dtype=jnp.float32)
    dispatch = (kept[..., None] * slot).sum(0)  # [tokens, experts, capacity]
    combine = (routed.gates.T[:, :, None, None] * kept[..., None] * slot).sum(0)
    return dispatch, combine


def _stats(sums: jax.Array, count: int, top_k: int) -> ExpertStats:
    chosen, probs, kept = sums[:count], sums[count : 2 * count], sums[2 * count : 3 * count]
    z, sent, moved = sums[3 * count :]
    tokens = chosen.sum() / top_k
    load = chosen / (tokens * top_k)
    aux = count * jnp.sum(load * probs / tokens)
    dropped = 1.0 - kept.sum() / (tokens * top_k)
    return ExpertStats(aux, z / tokens, load, dropped, chosen, sent, moved)
