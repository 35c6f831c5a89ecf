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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["VARIANTS", "context_attention", "context_positions", "unzigzag", "zigzag"]

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
    return jnp.concatenate([chunks[c] for c in _zigzag_order(cp)], axis=axis)


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
    return jnp.split(x, 2 * cp, axis=axis)


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
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"q has {q.shape[2]} heads and k {k.shape[2]}: the key/value heads must divide them."
        )
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    cp, device, length = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name), q.shape[1]
    q_pos = _positions(device, length, cp, balanced)
    state = _empty(q)
    if variant == "all_gather":
        keys = jax.lax.all_gather(k, axis_name, axis=1, tiled=True)
        values = jax.lax.all_gather(v, axis_name, axis=1, tiled=True)
        k_pos = jnp.concatenate([_positions(j, length, cp, balanced) for j in range(cp)])
        state = _block(state, q, keys, values, q_pos, k_pos, causal, scale)
    else:
        shift = [(j, (j + 1) % cp) for j in range(cp)]
        for step in range(cp):
            source = (device - step) % cp
            k_pos = _positions(source, length, cp, balanced)
            state = _block(state, q, k, v, q_pos, k_pos, causal, scale)
            if step < cp - 1:
                k, v = jax.lax.ppermute((k, v), axis_name, shift)
    _, total, out = state
    return (out / total[..., None]).astype(q.dtype)


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
