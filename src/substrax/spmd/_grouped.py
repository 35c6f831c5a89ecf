"""Grouped matrix products: rows grouped by expert, each group times its own weight.

A mixture of experts sorts its routed rows by expert and multiplies each expert's rows by that
expert's weight: ``y[r] = x[r] @ w[group(r)]``. Where the backend has a grouped kernel
(``jax.lax.ragged_dot`` on GPU and TPU) the rows are packed; on XLA:CPU, whose ``ragged_dot``
is a dense product over every group (``groups`` times the work), each group is padded to a
multiple of ``block`` rows and a loop multiplies one block at a time by its group's weight:
``(rows + groups x (block - 1)) x d x h`` multiply-adds at most, never ``rows x groups``.

:func:`group_rows` places the rows (:class:`Groups`); :func:`grouped_matmul` multiplies.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from substrax.spmd._region import reduce_as, vary_as

__all__ = [
    "Groups",
    "gather_rows",
    "group_rows",
    "grouped_matmul",
    "native_grouped_matmul",
    "scatter_rows",
    "segment_of",
]


def native_grouped_matmul() -> bool:
    """Whether the default backend has a grouped kernel (``ragged_dot`` not lowered densely)."""
    return jax.default_backend() in ("gpu", "tpu")


class Groups(NamedTuple):
    """Where grouped rows live in the buffer :func:`grouped_matmul` multiplies.

    Attributes:
      position: Each input row's place in the buffer ``[rows]``; ``size`` for a row that
        belongs to no group (it is left out).
      sizes: Rows per group ``[groups]``.
      block_group: The group of each block ``[size // block]`` (blocked layout), or None
        (packed layout for ``ragged_dot``).
      used: The blocks that hold rows (a traced count; the loop stops there), or None.
      size: The buffer's rows (static).
      block: Rows per block (1 in the packed layout).
    """

    position: jax.Array
    sizes: jax.Array
    block_group: jax.Array | None
    used: jax.Array | None
    size: int
    block: int


def group_rows(group: jax.Array, groups: int, *, block: int = 64, native: bool | None = None,
               ragged: bool = False) -> Groups:  # fmt: skip
    """Places rows by group: sorted, and padded to whole blocks where the kernel is blocked.

    Args:
      group: Each row's group ``[rows]`` (int); ``groups`` or more marks a row to leave out.
      groups: The number of groups.
      block: Rows per block of the blocked kernel.
      native: Use the packed layout for ``ragged_dot`` (default: where the backend has a
        grouped kernel, :func:`native_grouped_matmul`).
      ragged: Stop the blocked loop at the blocks in use (a traced trip count, for buffers
        sized for the worst case, such as rows received from other devices); otherwise the
        loop runs over the static bound.

    Returns:
      The :class:`Groups`.
    """
    rows = group.shape[0]
    native = native_grouped_matmul() if native is None else native
    valid = group < groups
    key = jnp.where(valid, group, groups)
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=groups + 1)[:groups]
    start = jnp.cumsum(sizes) - sizes
    sorted_group = key[order]
    rank = jnp.arange(rows) - jnp.take(start, sorted_group, mode="fill", fill_value=0)
    if native:
        size, padded_start, block_group, used, block = rows, start, None, None, 1
    else:
        size = block * ((rows + groups * (block - 1)) // block)
        blocks = (sizes + block - 1) // block
        padded_start = (jnp.cumsum(blocks) - blocks) * block
        ends = jnp.cumsum(blocks)
        block_group = jnp.minimum(segment_of(ends, size // block), groups - 1)
        used = ends[-1] if ragged else None
    place = jnp.take(padded_start, sorted_group, mode="fill", fill_value=0) + rank
    place = jnp.where(sorted_group < groups, place, size)
    position = jnp.zeros(rows, jnp.int32).at[order].set(place.astype(jnp.int32))
    return Groups(position, sizes, block_group, used, size, block)


def segment_of(ends: jax.Array, size: int) -> jax.Array:
    """For each place ``0..size-1``, the segments that end at or before it.

    Args:
      ends: Segment ends ``[..., segments]``, non-decreasing along the last axis.
      size: The places.

    Returns:
      ``[..., size]`` int32: the segment each place falls in (``segments`` past the last).
    """
    marks = jnp.zeros((*ends.shape[:-1], size), jnp.int32)
    lead = jnp.indices(ends.shape)[:-1]
    marks = marks.at[(*lead, ends)].add(1, mode="drop")
    return jnp.cumsum(marks, axis=-1)


def gather_rows(x: jax.Array, groups: Groups, source: jax.Array | None = None) -> jax.Array:
    """The grouped buffer :func:`grouped_matmul` takes.

    Args:
      x: Rows ``[n, features]``.
      groups: The :class:`Groups` of the rows to place.
      source: Which row of ``x`` each placed row is (``[rows]``; a token chosen ``top_k``
        times is placed ``top_k`` times), or None for row ``i`` of ``x`` itself.

    Returns:
      ``[size, features]``: each row at its place, padding rows 0.
    """
    index = jnp.arange(groups.position.shape[0]) if source is None else source
    fill = x.shape[0]
    where = jnp.full(groups.size, fill, jnp.int32).at[groups.position].set(index, mode="drop")
    return jnp.take(x, where, axis=0, mode="fill", fill_value=0)


def scatter_rows(y: jax.Array, groups: Groups) -> jax.Array:
    """The rows of a grouped buffer back in their input order.

    Args:
      y: A grouped buffer ``[size, features]`` (:func:`grouped_matmul`'s output).
      groups: The rows' :class:`Groups`.

    Returns:
      ``[rows, features]``: each placed row's result, 0 for a row left out.
    """
    return jnp.take(y, groups.position, axis=0, mode="fill", fill_value=0)


def grouped_matmul(x: jax.Array, w: jax.Array, groups: Groups) -> jax.Array:
    """``y[r] = x[r] @ w[group of r]`` over a grouped buffer.

    Args:
      x: The grouped buffer ``[size, d]`` (:func:`gather_rows`).
      w: One weight per group ``[groups, d, h]``.
      groups: The rows' :class:`Groups`.

    Returns:
      ``[size, h]`` in ``x``'s dtype; padding rows are 0.
    """
    if groups.block_group is None:
        return jax.lax.ragged_dot(x, w, groups.sizes.astype(jnp.int32))
    return _blocked(x, w, groups.block_group, groups.used, groups.block)


def _blocked(x, w, block_group, used, block):
    return _blocks(x, w, block_group, used, block, transpose=False)


def _blocks(x, w, block_group, used, block, *, transpose):
    """One block's rows times its group's weight (``w`` transposed for the input gradient)."""
    out = jnp.zeros((x.shape[0], w.shape[1] if transpose else w.shape[2]), x.dtype)
    out = vary_as(out, x, w, block_group)

    def body(i, out):
        rows = jax.lax.dynamic_slice_in_dim(x, i * block, block)
        weight = jax.lax.dynamic_index_in_dim(w, block_group[i], keepdims=False)
        weight = weight.T if transpose else weight
        product = jnp.dot(rows, weight.astype(x.dtype), preferred_element_type=jnp.float32)
        return jax.lax.dynamic_update_slice_in_dim(out, product.astype(x.dtype), i * block, 0)

    return jax.lax.fori_loop(0, _trips(x, used, block), body, out)


def _trips(x, used, block):
    """The loop's trips: the blocks in use (traced) or every block (static)."""
    return x.shape[0] // block if used is None else used


def _blocked_forward(x, w, block_group, used, block):
    return _blocked(x, w, block_group, used, block), (x, w, block_group, used)


def _blocked_backward(block, residuals, dy):
    x, w, block_group, used = residuals
    dx = _blocks(dy, w, block_group, used, block, transpose=True)

    def body(i, dw):
        rows = jax.lax.dynamic_slice_in_dim(x, i * block, block)
        grads = jax.lax.dynamic_slice_in_dim(dy, i * block, block)
        product = jnp.dot(rows.T, grads, preferred_element_type=jnp.float32)
        group = block_group[i]
        current = jax.lax.dynamic_index_in_dim(dw, group, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(dw, current + product, group, 0)

    dw = vary_as(jnp.zeros(w.shape, jnp.float32), x, dy, block_group)
    dw = jax.lax.fori_loop(0, _trips(x, used, block), body, dw)
    return reduce_as(dx, x), reduce_as(dw.astype(w.dtype), w), None, None


_blocked = jax.custom_vjp(_blocked, nondiff_argnums=(4,))
_blocked.defvjp(_blocked_forward, _blocked_backward)
