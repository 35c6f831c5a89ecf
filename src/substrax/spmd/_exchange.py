"""Rows to the devices of their experts and back, sized by counts exchanged first.

A device holds its routed rows sorted by destination (``counts[j]`` rows for device ``j`` of
the expert axes). The counts go first, with one small ``all_to_all``; the rows follow in
rounds of ``chunk`` rows per pair of devices, as many rounds as the largest count needs, so
what moves is the rows routed plus at most one partial chunk per pair and the imbalance
between pairs (XLA:CPU has no ``ragged-all-to-all``; :class:`Exchange` reports the rows
moved beside those routed). Nothing is dropped: a device receives into a buffer for the
worst case, every row of every device routed to it.

:func:`send` and :func:`send_back` are linear and each other's transpose, which is how each
one's gradient is the other.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from substrax.mesh._resolve import as_axes
from substrax.spmd._region import reduce_as, vary_as

__all__ = ["Exchange", "plan_exchange", "send", "send_back"]


class Exchange(NamedTuple):
    """One exchange's sizes, agreed by every device of the expert axes.

    Attributes:
      counts: Rows this device sends to each device ``[devices]``.
      received: The counts each device sent this one, as :func:`plan_exchange` was given
        them (``[devices, ...]``: rows per source, or per source and expert).
      rounds: Chunks per pair (traced; the same on every device).
      chunk: Rows per pair per round (static).
      capacity: The receive buffer's rows per source (static, a multiple of ``chunk``).
    """

    counts: jax.Array
    received: jax.Array
    rounds: jax.Array
    chunk: int
    capacity: int


def plan_exchange(counts: jax.Array, rows: int, axes, chunk: int) -> Exchange:
    """Exchanges the counts and agrees on the rounds.

    Args:
      counts: Rows for each device of ``axes`` ``[devices, ...]`` (int; trailing dimensions,
        such as rows per expert of that device, are summed for the device and sent as they
        are).
      rows: The rows this device holds (static; the most it can send one device).
      axes: The expert mesh axes (a name or a tuple of names).
      chunk: Rows per pair per round.

    Returns:
      The :class:`Exchange`.
    """
    received = jax.lax.all_to_all(counts, _key(axes), 0, 0, tiled=True)
    counts = counts.reshape(counts.shape[0], -1).sum(1)
    rounds = (jax.lax.pmax(jnp.max(counts), _key(axes)) + chunk - 1) // chunk
    return Exchange(counts, received, rounds, chunk, chunk * math.ceil(rows / chunk))


def _send(rows, counts, rounds, axes, chunk, capacity):
    devices = counts.shape[0]
    start = jnp.cumsum(counts) - counts

    def body(r, out):
        place = r * chunk + jnp.arange(chunk)
        index = jnp.where(place < counts[:, None], start[:, None] + place, rows.shape[0])
        part = jnp.take(rows, index, axis=0, mode="fill", fill_value=0)  # [devices, chunk, d]
        got = jax.lax.all_to_all(part, axes, 0, 0, tiled=True)
        return jax.lax.dynamic_update_slice_in_dim(out, got, r * chunk, 1)

    out = vary_as(
        jnp.zeros((devices, capacity, rows.shape[1]), rows.dtype), rows, axes=as_axes(axes)
    )
    return jax.lax.fori_loop(0, rounds, body, out)


def _send_back(received, counts, rounds, axes, chunk, rows):
    start = jnp.cumsum(counts) - counts

    def body(r, out):
        part = jax.lax.dynamic_slice_in_dim(received, r * chunk, chunk, 1)
        got = jax.lax.all_to_all(part, axes, 0, 0, tiled=True)  # [devices, chunk, d]
        place = r * chunk + jnp.arange(chunk)
        index = jnp.where(place < counts[:, None], start[:, None] + place, rows)
        return out.at[index.reshape(-1)].set(got.reshape(-1, got.shape[-1]), mode="drop")

    out = vary_as(
        jnp.zeros((rows, received.shape[-1]), received.dtype), received, axes=as_axes(axes)
    )
    return jax.lax.fori_loop(0, rounds, body, out)


def send(rows: jax.Array, exchange: Exchange, axes) -> jax.Array:
    """Sends each device its rows.

    Args:
      rows: ``[rows, features]``, sorted by destination (``exchange.counts``).
      exchange: The :class:`Exchange`.
      axes: The expert mesh axes.

    Returns:
      ``[devices, capacity, features]``: from each source, its rows first, then zeros.
    """
    sizes = (exchange.chunk, exchange.capacity, rows.shape[0])
    return _forth(rows, exchange.counts, exchange.rounds, _key(axes), sizes)


def send_back(received: jax.Array, exchange: Exchange, axes, rows: int) -> jax.Array:
    """Returns rows to their sources: :func:`send`'s transpose.

    Args:
      received: ``[devices, capacity, features]``, laid out as :func:`send` returned them.
      exchange: The :class:`Exchange` of the :func:`send`.
      axes: The expert mesh axes.
      rows: The rows the source sent (its buffer's size).

    Returns:
      ``[rows, features]`` in the order they were sent.
    """
    sizes = (exchange.chunk, exchange.capacity, rows)
    return _back(received, exchange.counts, exchange.rounds, _key(axes), sizes)


def _key(axes):
    return tuple(axes) if isinstance(axes, (tuple, list)) else axes


def _forth(rows, counts, rounds, axes, sizes):
    chunk, capacity, _ = sizes
    return _send(rows, counts, rounds, axes, chunk, capacity)


def _back(received, counts, rounds, axes, sizes):
    chunk, _, rows = sizes
    return _send_back(received, counts, rounds, axes, chunk, rows)


def _forth_fwd(rows, counts, rounds, axes, sizes):
    return _forth(rows, counts, rounds, axes, sizes), (counts, rounds, rows)


def _forth_bwd(axes, sizes, residuals, cotangent):
    counts, rounds, rows = residuals
    return reduce_as(_back(cotangent, counts, rounds, axes, sizes), rows), None, None


def _back_fwd(received, counts, rounds, axes, sizes):
    return _back(received, counts, rounds, axes, sizes), (counts, rounds, received)


def _back_bwd(axes, sizes, residuals, cotangent):
    counts, rounds, received = residuals
    return reduce_as(_forth(cotangent, counts, rounds, axes, sizes), received), None, None


_forth = jax.custom_vjp(_forth, nondiff_argnums=(3, 4))
_forth.defvjp(_forth_fwd, _forth_bwd)
_back = jax.custom_vjp(_back, nondiff_argnums=(3, 4))
_back.defvjp(_back_fwd, _back_bwd)
