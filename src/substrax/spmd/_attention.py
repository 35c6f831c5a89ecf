"""Attention over a sequence split across devices: ring and all-gather context parallelism.

Inside ``jax.shard_map`` with the sequence dimension of queries, keys and values split over a
manual mesh axis (the context axis), :func:`context_attention` computes exact attention without
holding the whole sequence's keys and values on one device (``variant="ring"``: key/value blocks
travel around the ring with ``ppermute``, softmax computed online, as in Liu et al. 2023's Ring
Attention) or by gathering them first (``variant="all_gather"``, for short contexts).

Causal attention gives the device with the last chunk the most work. :func:`zigzag` reorders a
sequence so that device ``i`` holds chunks ``i`` and ``2 cp - 1 - i`` (an early and a late one),
which evens the work out; pass ``balanced=True`` for sequences laid out that way
(:func:`unzigzag` restores the order).

Model code calls :func:`attention` instead: it reads the context axes from the active rules
(the logical name ``seq``, which a context-parallel :class:`~substrax.layout.Layout` maps to its
``context`` axes), enters ``shard_map`` over them itself and runs the ring, on a sequence that
substrax's steps lay out in zigzag order; :func:`positions` gives the tokens' positions in that
order. Without context axes both are one device's computation: :func:`attention` over whole
rows, or with ``block`` in flash attention's blocks, which keep no ``[T, T]`` score square.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from substrax._warnings import ShardingWarning, warn_user
from substrax.mesh._resolve import spec_entry
from substrax.spmd._region import (
    axes_size,
    free_axes,
    recomputed_region,
    reduce_as,
    region_mesh,
    vary_as,
)

__all__ = [
    "VARIANTS",
    "attention",
    "context_attention",
    "context_axes",
    "context_positions",
    "decode_attention",
    "positions",
    "unzigzag",
    "zigzag",
]

VARIANTS = ("ring", "all_gather")
"""The context-parallel attention variants of :func:`context_attention`."""


def zigzag(x: jax.Array, cp: int, axis: int = 1) -> jax.Array:
    """Reorders a sequence so that its ``i``-th of ``cp`` parts holds chunks ``i`` and ``2cp-1-i``.

    Split the result evenly over ``cp`` devices along ``axis`` and each device gets an early and
    a late chunk: causal attention's work is then the same on every device.

    Args:
      x: The array, its sequence on ``axis`` (a multiple of ``2 cp`` long).
      cp: The context-parallel degree.
      axis: The sequence axis.

    Returns:
      ``x`` with its sequence reordered.

    Raises:
      ValueError: If the sequence does not split into ``2 cp`` chunks.
    """
    chunks = _chunks(x, cp, axis)
    xp = np if isinstance(x, np.ndarray) else jnp  # host batches stay on the host
    return xp.concatenate([chunks[c] for c in _zigzag_order(cp)], axis=axis)


def unzigzag(x: jax.Array, cp: int, axis: int = 1) -> jax.Array:
    """Undoes :func:`zigzag`.

    Args:
      x: A sequence in zigzag order on ``axis``.
      cp: The context-parallel degree.
      axis: The sequence axis.

    Returns:
      ``x`` in its natural order.

    Raises:
      ValueError: If the sequence does not split into ``2 cp`` chunks.
    """
    chunks = _chunks(x, cp, axis)
    order = _zigzag_order(cp)
    return jnp.concatenate([chunks[order.index(c)] for c in range(2 * cp)], axis=axis)


def _zigzag_order(cp: int) -> list[int]:
    """The chunks in zigzag order: 0, 2cp-1, 1, 2cp-2, ..."""
    return [c for i in range(cp) for c in (i, 2 * cp - 1 - i)]


def _chunks(x: jax.Array, cp: int, axis: int) -> list[jax.Array]:
    if x.shape[axis] % (2 * cp):
        raise ValueError(
            f"A sequence of {x.shape[axis]} does not split into 2 x cp = {2 * cp} chunks; "
            f"use a length that is a multiple of {2 * cp}."
        )
    return (np if isinstance(x, np.ndarray) else jnp).split(x, 2 * cp, axis=axis)


def context_axes() -> tuple[str, ...]:
    """The mesh axes the sequence is split over under the active rules (``seq``'s), or ().

    Axes of size 1 and axes that are already manual (inside ``shard_map``) are left out.

    Returns:
      The context axes.
    """
    return free_axes("seq")


def positions(length: int) -> jax.Array:
    """The positions of a sequence of ``length`` tokens as the active layout orders it.

    Under a context-parallel layout substrax's steps put the sequence in :func:`zigzag` order
    (so causal attention's work is even over the devices); position embeddings and rotary
    angles must then use these positions instead of ``jnp.arange(length)``. Without context
    axes this is ``jnp.arange(length)``.

    Args:
      length: The sequence length (the whole sequence, as model code sees it).

    Returns:
      ``int32`` positions ``[length]``.
    """
    natural = jnp.arange(length, dtype=jnp.int32)
    cp = axes_size(context_axes())
    return natural if cp == 1 else zigzag(natural[None], cp)[0]


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    variant: str = "ring",
    scale: float | None = None,
    block: int | None = None,
) -> jax.Array:
    """Attention for model code: context parallel where the active layout splits ``seq``.

    Takes the whole sequence as model code sees it (``[batch, length, heads, head_dim]``, as
    ``jax.nn.dot_product_attention``). Under a layout with context axes (inside substrax's
    train steps, or any :func:`~substrax.spmd.use_rules` context whose rules map ``seq``), it
    runs :func:`context_attention` in ``shard_map`` over those axes, on a sequence in
    :func:`zigzag` order (the order substrax's steps give the batch), each device on its own
    rows and (where the layout splits ``heads`` and they divide) its own heads. Otherwise it
    is one device's attention: over whole rows, or with ``block``, flash attention's blocks
    (online softmax, ``block`` queries by ``block`` keys, the blocks above a causal diagonal
    skipped; only the output and a float32 log-sum-exp per query are kept for the backward
    pass, which recomputes each block's probabilities). Whole rows hold the ``[T, T]`` score
    square, in float32, through the backward pass (at 8192 tokens and 32 heads, 8 GiB per
    sequence and layer); blocks hold one ``[block, block]`` square at a time, for more, smaller
    products. Either way scores and softmax are float32.

    Args:
      q: Queries ``[B, T, H, D]``.
      k: Keys ``[B, T, Hkv, D]`` (``Hkv`` divides ``H``: grouped-query attention).
      v: Values ``[B, T, Hkv, D]``.
      causal: Each token attends to itself and earlier tokens only (by :func:`positions`).
      variant: ``"ring"`` or ``"all_gather"`` (see :func:`context_attention`).
      scale: The score scale (default ``1 / sqrt(D)``).
      block: Without context axes, the block size of flash-style attention (a divisor of the
        queries' and keys' lengths); None (the default) for whole rows. Under context axes
        the ring holds one chunk pair's square per step and ``block`` does not apply.

    Returns:
      The output ``[B, T, H, D]`` in ``q``'s dtype.

    Raises:
      ValueError: For an unknown variant, heads that do not group, a length that does not
        split into ``2 x cp`` chunks, or a ``block`` that does not divide the lengths.

    Warns:
      ShardingWarning: Where the layout splits ``heads`` over tensor axes that the query or
        key/value heads do not divide: the heads then stay whole in the region.
    """
    axes = context_axes()
    if not axes:
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}.")
        _check_heads(q, k)
        if block is None:
            return _plain(q, k, v, causal, _scale(q, scale))
        _check_block(block, q, k, causal)
        return _blocked(q, k, v, causal, _scale(q, scale), block)
    cp = axes_size(axes)
    if q.shape[1] % (2 * cp):
        raise ValueError(
            f"A sequence of {q.shape[1]} tokens does not split into 2 x cp = {2 * cp} chunks "
            f"over the context axes {axes}; use a length that is a multiple of {2 * cp}."
        )
    # Each device's own rows and heads: XLA may not regroup them around the region.
    rows, heads = free_axes("batch"), free_axes("heads")
    if q.shape[2] % axes_size(heads) or k.shape[2] % axes_size(heads):
        warn_user(
            f"substrax.spmd.attention: {q.shape[2]} query and {k.shape[2]} key/value heads do "
            f"not split over the tensor axes {heads} ({axes_size(heads)} devices), so every "
            "device of those axes computes the attention of every head of its rows (their "
            "work repeated, and the heads gathered around the region). Use a head count the "
            "tensor axes divide, or a layout with fewer tensor devices.",
            ShardingWarning,
        )
        heads = ()
    spec = PartitionSpec(spec_entry(rows), spec_entry(axes), spec_entry(heads))
    ring = functools.partial(context_attention, axis_name=spec_entry(axes), causal=causal,
                             balanced=True, variant=variant, scale=scale)  # fmt: skip
    every = rows + axes + heads
    region = recomputed_region(ring, region_mesh(every), (spec,) * 3, spec, set(every))
    return region(q, k, v)


def context_positions(length: int, axis_name: str, *, balanced: bool = False) -> jax.Array:
    """The global positions of this device's ``length`` tokens along the context axis.

    Call inside ``shard_map`` where ``axis_name`` is manual (for position embeddings, masks).

    Args:
      length: This device's tokens.
      axis_name: The context axis.
      balanced: Whether the sequence is in :func:`zigzag` order.

    Returns:
      An ``int32`` array of ``length`` positions.
    """
    return _positions(jax.lax.axis_index(axis_name), length, jax.lax.axis_size(axis_name), balanced)


def _positions(device: jax.Array, length: int, cp: int, balanced: bool) -> jax.Array:
    local = jnp.arange(length, dtype=jnp.int32)
    if not balanced:
        return device * length + local
    half = length // 2
    late = (2 * cp - 1 - device) * half + local - half
    return jnp.where(local < half, device * half + local, late)


def context_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    axis_name: str,
    causal: bool = False,
    balanced: bool = False,
    variant: str = "ring",
    scale: float | None = None,
) -> jax.Array:
    """Exact attention of this device's queries over the whole sequence split on ``axis_name``.

    Call inside ``jax.shard_map`` where ``axis_name`` is manual and every device holds an equal
    chunk of the sequence (``[batch, length, heads, head_dim]``, as ``jax.nn.dot_product_attention``
    takes). Grouped-query attention: ``k`` and ``v`` may have fewer heads, a divisor of ``q``'s.
    The softmax is computed online in float32, so the result differs from one device's by
    rounding only.

    Args:
      q: Queries ``[B, T, H, D]`` of this device's tokens.
      k: Keys ``[B, T, Hkv, D]``.
      v: Values ``[B, T, Hkv, D]``.
      axis_name: The context axis.
      causal: Each token attends to itself and earlier tokens only.
      balanced: The sequence is in :func:`zigzag` order (for causal load balance).
      variant: ``"ring"`` (keys and values passed around the ring, one block held at a time)
        or ``"all_gather"`` (gathered first).
      scale: The score scale (default ``1 / sqrt(D)``).

    Returns:
      The attention output ``[B, T, H, D]`` in ``q``'s dtype.

    Raises:
      ValueError: For an unknown variant, or heads that do not group.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}.")
    _check_heads(q, k)
    scale = _scale(q, scale)
    if variant == "all_gather":
        cp, device, length = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name), q.shape[1]
        q_pos = _positions(device, length, cp, balanced)
        keys = jax.lax.all_gather(k, axis_name, axis=1, tiled=True)
        values = jax.lax.all_gather(v, axis_name, axis=1, tiled=True)
        k_pos = jnp.concatenate([_positions(j, length, cp, balanced) for j in range(cp)])
        state = _block(_empty(q), q, keys, values, q_pos, k_pos, causal, scale)
        return _normalised(state, q.dtype)
    return _ring(q, k, v, axis_name, causal, balanced, scale)


def _shift(cp: int) -> list[tuple[int, int]]:
    return [(j, (j + 1) % cp) for j in range(cp)]


def _ring_forward(q, k, v, axis_name, causal, balanced, scale):
    """The ring's output and each query's log-sum-exp (float32), one K/V block at a time."""
    cp, device, length = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name), q.shape[1]
    q_pos, state = _positions(device, length, cp, balanced), _empty(q)
    for step in range(cp):
        k_pos = _positions((device - step) % cp, length, cp, balanced)
        state = _block(state, q, k, v, q_pos, k_pos, causal, scale)
        if step < cp - 1:
            k, v = jax.lax.ppermute((k, v), axis_name, _shift(cp))
    maximum, total, _ = state
    return _normalised(state, q.dtype), maximum + jnp.log(total)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _ring(q, k, v, axis_name, causal, balanced, scale):
    """Ring attention whose backward pass is a ring too (Liu et al. 2023's blockwise form)."""
    return _ring_forward(q, k, v, axis_name, causal, balanced, scale)[0]


def _ring_saving(q, k, v, axis_name, causal, balanced, scale):
    out, lse = _ring_forward(q, k, v, axis_name, causal, balanced, scale)
    return out, (q, k, v, out, lse)


def _ring_backward(axis_name, causal, balanced, scale, saved, g):
    """Gradients block by block: each K/V block travels the ring with its gradients' sums.

    Per block, the probabilities are recomputed from the saved log-sum-exp (flash attention's
    backward), so one block's scores are held at a time; after ``cp`` steps the key and value
    gradients are back on the device that holds the block.
    """
    q, k, v, out, lse = saved
    cp, device, length = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name), q.shape[1]
    q_pos = _positions(device, length, cp, balanced)
    g32, delta = _cotangent(g, out)
    dq = jnp.zeros(q.shape, jnp.float32)
    dk, dv = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
    for step in range(cp):
        k_pos = _positions((device - step) % cp, length, cp, balanced)
        grads = _block_grads(q, k, v, g32, lse, delta, q_pos, k_pos, causal, scale)
        dq, dk, dv = dq + grads[0], dk + grads[1], dv + grads[2]
        if step < cp - 1:
            k, v, dk, dv = jax.lax.ppermute((k, v, dk, dv), axis_name, _shift(cp))
        else:  # home: the block's gradients return to the device that holds it
            dk, dv = jax.lax.ppermute((dk, dv), axis_name, _shift(cp))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _cotangent(g: jax.Array, out: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The output's cotangent in float32 and flash attention's ``delta`` (its dot with out)."""
    g32 = g.astype(jnp.float32)
    return g32, jnp.sum(g32 * out.astype(jnp.float32), axis=-1)  # [b, t, h]


def _block_grads(q, k, v, g32, lse, delta, q_pos, k_pos, causal, scale):
    """One query block's and one key/value block's share of the gradients (float32).

    The block's probabilities are recomputed from the queries' saved log-sum-exp ``lse``;
    ``delta`` is :func:`_cotangent`'s. Returns ``(dq, dk, dv)`` of the blocks' shapes.
    """
    groups = q.shape[2] // k.shape[2]
    keys, values = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bqhk", q, keys, preferred_element_type=jnp.float32)
    probs = jnp.exp(scores * scale - lse[..., None])
    if causal:
        visible = q_pos[:, None] >= k_pos[None, :]
        probs = jnp.where(visible[None, :, None, :], probs, 0.0)
    dprobs = jnp.einsum("bqhd,bkhd->bqhk", g32, values.astype(jnp.float32))
    dscores = probs * (dprobs - delta[..., None]) * scale
    dq = jnp.einsum("bqhk,bkhd->bqhd", dscores, keys.astype(jnp.float32))
    dk = _group_sum(jnp.einsum("bqhk,bqhd->bkhd", dscores, q.astype(jnp.float32)), groups)
    dv = _group_sum(jnp.einsum("bqhk,bqhd->bkhd", probs, g32), groups)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _blocked(q, k, v, causal, scale, block):
    """One device's attention ``block`` queries by ``block`` keys (flash attention's blocking).

    Loops run over the pairs of query and key blocks that have visible keys (under a causal
    mask, those on and below the diagonal: half the products, as a flash kernel executes
    them; :func:`_over_pairs`), so one block's square is live at a time; only the output and
    each query's log-sum-exp are kept for the backward pass, loops over the same pairs that
    recompute each block's probabilities.
    """
    return _blocked_forward(q, k, v, causal, scale, block)[0]


def _over_pairs(body, carry, q_len: int, k_len: int, block: int, causal: bool):
    """Folds ``body(carry, row, col, masked)`` over the block pairs that have visible keys.

    ``row`` and ``col`` are the pair's first query and key positions. Under a causal mask,
    one loop runs the pairs below the diagonal (unmasked) and one the diagonal's (each the
    same lower triangle, a constant); the blocks above it are not run.
    """
    n_q, n_k = q_len // block, k_len // block
    if causal:
        groups = [([(i, j) for i in range(n_q) for j in range(i)], False),
                  ([(i, i) for i in range(n_q)], True)]  # fmt: skip
    else:
        groups = [([(i, j) for i in range(n_q) for j in range(n_k)], False)]
    for pairs, masked in groups:
        if pairs:
            starts = np.array(pairs, np.int32).T * block
            step = lambda c, pair, m=masked: (body(c, pair[0], pair[1], m), None)  # noqa: E731
            carry, _ = jax.lax.scan(step, carry, tuple(starts))
    return carry


def _take(x: jax.Array, start: jax.Array, block: int) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(x, start, block, axis=1)


def _put(x: jax.Array, start: jax.Array, update: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(x, update, start, axis=1)


def _blocked_forward(q, k, v, causal, scale, block):
    here = jnp.arange(block)  # positions within a block: a diagonal block's are its keys'

    def fold(state, row, col, masked):
        part = tuple(_take(x, row, block) for x in state)
        kv = _take(k, col, block), _take(v, col, block)
        part = _block(part, _take(q, row, block), *kv, here, here, masked, scale)
        return tuple(_put(x, row, y) for x, y in zip(state, part, strict=True))

    empty = tuple(vary_as(x, q, k, v) for x in _empty(q))  # inside shard_map: as the blocks vary
    state = _over_pairs(fold, empty, q.shape[1], k.shape[1], block, causal)
    maximum, total, _ = state
    return _normalised(state, q.dtype), maximum + jnp.log(total)


def _blocked_saving(q, k, v, causal, scale, block):
    out, lse = _blocked_forward(q, k, v, causal, scale, block)
    return out, (q, k, v, out, lse)


def _blocked_backward(causal, scale, block, saved, g):
    q, k, v, out, lse = saved
    g32, delta = _cotangent(g, out)
    here = jnp.arange(block)

    def accumulate(grads, row, col, masked):
        qb, gb, lb, db = (_take(x, row, block) for x in (q, g32, lse, delta))
        kb, vb = _take(k, col, block), _take(v, col, block)
        parts = _block_grads(qb, kb, vb, gb, lb, db, here, here, masked, scale)
        return tuple(
            _put(x, start, _take(x, start, block) + d)
            for x, start, d in zip(grads, (row, col, col), parts, strict=True)
        )

    zeros = tuple(vary_as(jnp.zeros(x.shape, jnp.float32), q, k, v, g) for x in (q, k, v))
    grads = _over_pairs(accumulate, zeros, q.shape[1], k.shape[1], block, causal)
    return tuple(reduce_as(d, x).astype(x.dtype) for d, x in zip(grads, (q, k, v), strict=True))


_blocked.defvjp(_blocked_saving, _blocked_backward)


def _group_sum(x: jax.Array, groups: int) -> jax.Array:
    """``[b, t, h, d]`` summed over each group of ``groups`` query heads: ``[b, t, h/g, d]``."""
    b, t, h, d = x.shape
    return x.reshape(b, t, h // groups, groups, d).sum(axis=3)


_ring.defvjp(_ring_saving, _ring_backward)


def decode_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, start: jax.Array | int, *, scale: float | None = None
) -> jax.Array:
    """Causal attention of new tokens over a key/value cache, for decoding.

    The queries are the tokens at positions ``start, start + 1, ...``; the keys and values
    are the cache's ``max_length`` positions (the new tokens' already written at ``start``).
    Each query sees the cached positions up to its own; the rest of the cache, not yet
    written, is masked. Over a prompt written at ``start = 0`` it equals
    :func:`attention` with ``causal=True``.

    Args:
      q: Queries ``[B, T, H, D]``.
      k: The cached keys ``[B, max_length, Hkv, D]`` (``Hkv`` divides ``H``).
      v: The cached values ``[B, max_length, Hkv, D]``.
      start: The position of the first query (the cache's fill before these tokens).
      scale: The score scale (default ``1 / sqrt(D)``).

    Returns:
      The output ``[B, T, H, D]`` in ``q``'s dtype.

    Raises:
      ValueError: If the key/value heads do not divide the query heads.
    """
    _check_heads(q, k)
    return _plain(q, k, v, True, _scale(q, scale), start)


def _plain(q, k, v, causal, scale, start=0) -> jax.Array:
    """One device's attention: the softmax over whole rows (no online state to keep).

    The queries sit at positions ``start + i`` among the keys' (``start = 0``: the same
    positions).
    """
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    if causal:
        position = start + jnp.arange(q.shape[1])
        visible = jnp.arange(k.shape[1])[None, :] <= position[:, None]
        scores = jnp.where(visible, scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v).astype(q.dtype)


def _check_heads(q: jax.Array, k: jax.Array) -> None:
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"q has {q.shape[2]} heads and k {k.shape[2]}: the key/value heads must divide them."
        )


def _check_block(block: Any, q: jax.Array, k: jax.Array, causal: bool) -> None:
    lengths = (q.shape[1], k.shape[1])
    if (
        isinstance(block, bool)
        or not isinstance(block, int)
        or block < 1
        or any(n % block for n in lengths)
    ):
        raise ValueError(
            f"block must be a positive int that divides the query and key lengths {lengths}, "
            f"got {block!r}; use None for whole rows."
        )
    if causal and lengths[0] != lengths[1]:
        raise ValueError(
            f"Causal blocked attention takes queries and keys of one length, got {lengths}."
        )


def _scale(q: jax.Array, scale: float | None) -> float:
    return q.shape[-1] ** -0.5 if scale is None else scale


def _normalised(state, dtype) -> jax.Array:
    _, total, out = state
    return (out / total[..., None]).astype(dtype)


def _empty(q: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    b, t, h, d = q.shape
    return (
        jnp.full((b, t, h), -jnp.inf, jnp.float32),
        jnp.zeros((b, t, h), jnp.float32),
        jnp.zeros((b, t, h, d), jnp.float32),
    )


def _block(state, q, k, v, q_pos, k_pos, causal, scale):
    """Folds one key/value block into the online softmax ``(max, sum, weighted values)``."""
    maximum, total, out = state
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bqhk", q, k, preferred_element_type=jnp.float32) * scale
    if causal:
        visible = q_pos[:, None] >= k_pos[None, :]
        scores = jnp.where(visible[None, :, None, :], scores, -jnp.inf)
    new_max = jnp.maximum(maximum, scores.max(axis=-1))
    safe = jnp.where(jnp.isfinite(new_max), new_max, 0.0)  # rows with nothing visible yet
    weights = jnp.exp(scores - safe[..., None])
    correction = jnp.exp(maximum - safe)
    total = total * correction + weights.sum(axis=-1)
    values = jnp.einsum("bqhk,bkhd->bqhd", weights, v.astype(jnp.float32))
    return new_max, total, out * correction[..., None] + values
