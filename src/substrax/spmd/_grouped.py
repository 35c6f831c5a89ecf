"""Grouped matrix products: rows grouped by expert, each group times its own weight.

A mixture of experts sorts its routed rows by expert and multiplies each expert's rows by that
expert's weight: ``y[r] = x[r] @ w[group(r)]``. On TPU and GPU the rows are packed for
``jax.lax.ragged_dot``: XLA:TPU compiles it to a grouped kernel (the weights' gradient, which
it would compile densely, runs tile by tile instead: :func:`_ragged`); XLA:GPU (jax 0.11.2) to a
dense product under a mask (``groups`` times the work, ``[groups, rows, d]`` temporaries), which
on one H200 still ran 1.9x faster than the loop below at 64 groups (``benchmarks/gpu_check.py``).
On XLA:CPU, whose ``ragged_dot`` is dense and slow, each group is padded to a
multiple of ``block`` rows and a loop multiplies one block at a time by its group's weight:
``(rows + groups x (block - 1)) x d x h`` multiply-adds at most, never ``rows x groups``.

The blocked loop also reads its rows from an ungrouped array (``source``: a token chosen
``top_k`` times is read ``top_k`` times, never copied) and adds its products into an
ungrouped result (``target``), so neither the ``[rows, d]`` input nor output of a mixture of
experts is ever held: its memory is the experts' hidden activations, as a dense MLP's.

:func:`group_rows` places the rows (:class:`Groups`); :func:`grouped_matmul` multiplies.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from substrax.spmd._blocks import auto_block, blocked_size
from substrax.spmd._constrain import active_rules
from substrax.spmd._region import reduce_as, vary_as

__all__ = ["Groups", "active_platform", "group_rows", "grouped_matmul", "native_grouped_matmul",
           "segment_of"]  # fmt: skip


def native_grouped_matmul(platform: str | None = None) -> bool:
    """Whether the platform compiled for packs grouped products for ``jax.lax.ragged_dot``.

    The platform is the target's, not this machine's: a step compiled here for a TPU slice
    (the Flax adapter's ``compile_for``) uses the TPU's kernel.

    Args:
      platform: ``"cpu"``, ``"gpu"`` or ``"tpu"``; None: the platform of the mesh that
        :func:`~substrax.spmd.use_rules` made active (inside a substrax step, the step's), or
        else jax's default backend.

    Returns:
      True on TPU (a grouped kernel) and GPU (dense under a mask, yet faster than the loop:
      see the module's docstring); False on XLA:CPU, where :func:`grouped_matmul` runs its
      own loop over blocks.
    """
    return (platform or active_platform()) in ("gpu", "cuda", "rocm", "tpu")


def active_platform() -> str:
    """The platform programs are compiled for: the active mesh's devices', else jax's default.

    Returns:
      The platform name of the devices of the mesh :func:`~substrax.spmd.use_rules` made
      active (a step's), or ``jax.default_backend()`` outside one.
    """
    active = active_rules()
    if active is not None and isinstance(active[0], jax.sharding.Mesh) and active[0].devices.size:
        return active[0].devices.flat[0].platform
    return jax.default_backend()


class Groups(NamedTuple):
    """Where grouped rows live in the buffer :func:`grouped_matmul` multiplies.

    Attributes:
      position: Each input row's place in the buffer ``[rows]``; ``size`` for a row that
        belongs to no group (it is left out).
      slots: The input row at each place of the buffer ``[size]``; ``rows`` for padding.
      sizes: Rows per group ``[groups]``.
      block_group: The group of each block ``[size // block]`` (blocked layout), or None
        (packed layout for ``ragged_dot``).
      used: The blocks that hold rows (a traced count; the loop stops there), or None.
      size: The buffer's rows (static).
      block: Rows per block (1 in the packed layout).
    """

    position: jax.Array
    slots: jax.Array
    sizes: jax.Array
    block_group: jax.Array | None
    used: jax.Array | None
    size: int
    block: int


def group_rows(group: jax.Array, groups: int, *, block: int | None = None,
               native: bool | None = None, ragged: bool = False) -> Groups:  # fmt: skip
    """Places rows by group: sorted, and padded to whole blocks where the kernel is blocked.

    Args:
      group: Each row's group ``[rows]`` (int); ``groups`` or more marks a row to leave out.
      groups: The number of groups.
      block: Rows per block of the blocked kernel; None for the largest power of two from 8
        to 64 whose padding, ``groups x (block - 1)`` rows at most, is within 1/16 of the
        rows.
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
    block = auto_block(rows, groups) if block is None else block
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
        size = blocked_size(rows, groups, block)
        blocks = (sizes + block - 1) // block
        padded_start = (jnp.cumsum(blocks) - blocks) * block
        ends = jnp.cumsum(blocks)
        block_group = jnp.minimum(segment_of(ends, size // block), groups - 1)
        used = ends[-1] if ragged else None
    place = jnp.take(padded_start, sorted_group, mode="fill", fill_value=0) + rank
    place = jnp.where(sorted_group < groups, place, size)
    position = jnp.zeros(rows, jnp.int32).at[order].set(place.astype(jnp.int32))
    slots = jnp.full(size, rows, jnp.int32).at[position].set(jnp.arange(rows, dtype=jnp.int32),
                                                             mode="drop")  # fmt: skip
    return Groups(position, slots, sizes, block_group, used, size, block)


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


def grouped_matmul(
    x: jax.Array,
    w: jax.Array,
    groups: Groups,
    *,
    source: jax.Array | None = None,
    target: jax.Array | None = None,
    rows: int | None = None,
) -> jax.Array:
    """``y[slot] = x[slot] @ w[group of slot]`` over grouped rows.

    Args:
      x: The grouped buffer ``[groups.size, d]``; with ``source``, ungrouped rows ``[n, d]``.
      w: One weight per group ``[groups, d, h]``.
      groups: The rows' :class:`Groups`.
      source: The row of ``x`` each place of the buffer reads ``[groups.size]`` (``n`` or
        more for none: a zero row), or None.
      target: The row of the result each place's product is added to ``[groups.size]``
        (``rows`` or more for none), or None for the grouped buffer itself.
      rows: The result's rows with ``target``.

    Returns:
      ``[groups.size, h]``, or ``[rows, h]`` with ``target`` (float32 there: sums of
      products), in ``x``'s dtype otherwise; padding gives 0.

    Raises:
      ValueError: If ``target`` is given without ``rows``.
    """
    if target is not None and rows is None:
        raise ValueError("grouped_matmul with a target needs rows, the result's row count.")
    if groups.block_group is None:
        xs = x if source is None else jnp.take(x, source, axis=0, mode="fill", fill_value=0)
        ragged = _ragged if active_platform() == "tpu" else jax.lax.ragged_dot
        y = ragged(xs, w.astype(x.dtype), groups.sizes.astype(jnp.int32))
        if target is None:
            return y
        out = jnp.zeros((rows, w.shape[2]), jnp.float32)
        return out.at[target].add(y.astype(jnp.float32), mode="drop")
    return _blocked(x, w, groups.block_group, groups.used, source, target, groups.block, rows)


def _run(x, w, block_group, used, source, target, block, rows, *, transpose=False):
    """The blocked loop: each block's rows times its group's weight.

    The rows are sliced, or read from ``source``; the products are written as blocks (``scan``
    outputs, or a buffer updated in place over a traced trip count) or added into
    ``target``'s rows.
    """
    width = w.shape[1] if transpose else w.shape[2]
    blocks = block_group.shape[0]

    def product(i):
        rows_in = _block_rows(x, source, i, block)
        weight = jax.lax.dynamic_index_in_dim(w, block_group[i], keepdims=False)
        weight = weight.T if transpose else weight
        return jnp.dot(rows_in, weight.astype(x.dtype), preferred_element_type=jnp.float32)

    if target is not None:

        def add(out, i):
            index = jax.lax.dynamic_slice_in_dim(target, i * block, block)
            return out.at[index].add(product(i), mode="drop")

        out = vary_as(jnp.zeros((rows, width), jnp.float32), x, w, block_group, target)
        if used is None:
            return jax.lax.scan(lambda out, i: (add(out, i), None), out, jnp.arange(blocks))[0]
        return jax.lax.fori_loop(0, used, lambda i, out: add(out, i), out)
    if used is None:
        _, out = jax.lax.scan(lambda _, i: (None, product(i).astype(x.dtype)), None,
                              jnp.arange(blocks))  # fmt: skip
        return out.reshape(blocks * block, width)

    def body(i, out):
        return jax.lax.dynamic_update_slice_in_dim(out, product(i).astype(x.dtype), i * block, 0)

    out = vary_as(jnp.zeros((blocks * block, width), x.dtype), x, w, block_group)
    return jax.lax.fori_loop(0, used, body, out)


def _block_rows(array, index, i, block):
    """Block ``i``'s rows of ``array``: sliced, or read at ``index``'s rows (0 where none)."""
    if index is None:
        return jax.lax.dynamic_slice_in_dim(array, i * block, block)
    at = jax.lax.dynamic_slice_in_dim(index, i * block, block)
    return jnp.take(array, at, axis=0, mode="fill", fill_value=0)


def _blocked(x, w, block_group, used, source, target, block, rows):
    return _run(x, w, block_group, used, source, target, block, rows)


def _blocked_forward(x, w, block_group, used, source, target, block, rows):
    out = _run(x, w, block_group, used, source, target, block, rows)
    return out, (x, w, block_group, used, source, target)


def _blocked_backward(block, rows, residuals, dy):
    x, w, block_group, used, source, target = residuals
    dy = dy.astype(x.dtype)
    # the input's gradient: the same loop, reading dy where the forward wrote, writing where
    # it read, with each weight transposed
    dx = _run(dy, w, block_group, used, target, source, block, x.shape[0], transpose=True)

    def add(dw, i):
        product = jnp.dot(_block_rows(x, source, i, block).T, _block_rows(dy, target, i, block),
                          preferred_element_type=jnp.float32)  # fmt: skip
        return _add_to_group(dw, block_group[i], product)

    dw = vary_as(jnp.zeros(w.shape, jnp.float32), x, dy, block_group)
    if used is None:
        dw = jax.lax.scan(lambda dw, i: (add(dw, i), None), dw, jnp.arange(block_group.shape[0]))[0]
    else:
        dw = jax.lax.fori_loop(0, used, lambda i, dw: add(dw, i), dw)
    dx = dx.astype(x.dtype)
    return reduce_as(dx, x), reduce_as(dw.astype(w.dtype), w), None, None, None, None


def _add_to_group(dw: jax.Array, group: jax.Array, product: jax.Array) -> jax.Array:
    """``dw[group] += product``, in place in a loop's carry."""
    current = jax.lax.dynamic_index_in_dim(dw, group, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(dw, current + product, group, 0)


_blocked = jax.custom_vjp(_blocked, nondiff_argnums=(6, 7))
_blocked.defvjp(_blocked_forward, _blocked_backward)


#: Rows per tile of :func:`_ragged`'s weight gradient.
_TILE = 512


@jax.custom_vjp
def _ragged(xs: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """``jax.lax.ragged_dot`` whose weights' gradient runs tile by tile, not densely.

    XLA:TPU (libtpu 0.0.42.1) compiles ``ragged_dot`` to a grouped kernel, and the input's
    gradient (a ``ragged_dot`` by the transposed weights) too; the weights' gradient, which
    contracts over the grouped rows, it compiles as a dense product over every group
    (``groups`` times the work). Here it is a loop over the pairs of a tile of rows and a
    group it meets: at most ``tiles + groups - 1`` products of ``tile`` rows, the rows of
    other groups masked (megablox's ``tgmm`` schedule, in JAX).
    """
    return jax.lax.ragged_dot(xs, w, sizes)


def _ragged_forward(xs, w, sizes):
    return jax.lax.ragged_dot(xs, w, sizes), (xs, w, sizes)


def _ragged_backward(residuals, dy):
    xs, w, sizes = residuals
    dy = dy.astype(xs.dtype)
    dxs = jax.lax.ragged_dot(dy, jnp.swapaxes(w, 1, 2), sizes).astype(xs.dtype)
    dw = _tiled_weight_grad(xs, dy, sizes, w.shape[0])
    return reduce_as(dxs, xs), reduce_as(dw.astype(w.dtype), w), None


_ragged.defvjp(_ragged_forward, _ragged_backward)


def _tiled_weight_grad(xs: jax.Array, dy: jax.Array, sizes: jax.Array, groups: int) -> jax.Array:
    """``dw[g] = xs[rows of g].T @ dy[rows of g]`` (float32), one tile and group at a time."""
    rows = xs.shape[0]
    tile = min(_TILE, rows)
    tiles = -(-rows // tile)
    if tiles * tile != rows:  # whole tiles; the padding belongs to no group
        pad = ((0, tiles * tile - rows), (0, 0))
        xs, dy = jnp.pad(xs, pad), jnp.pad(dy, pad)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first = starts // tile
    counts = jnp.where(sizes > 0, (ends - 1) // tile - first + 1, 0)
    reach = jnp.cumsum(counts)  # the pairs of groups up to each, inclusive
    pair = jnp.arange(tiles + groups - 1)
    # a count, not jnp.searchsorted: that asserts inside jax on rows varying over a manual axis
    group = jnp.sum(reach[None, :] <= pair[:, None], axis=1)
    valid = group < groups
    group = jnp.minimum(group, groups - 1)
    at = jnp.where(valid, first[group] + pair - (reach - counts)[group], 0)

    def add(dw, item):
        g, t, ok = item
        place = t * tile + jnp.arange(tile)
        inside = ok & (place >= starts[g]) & (place < ends[g])
        x = jnp.where(inside[:, None], jax.lax.dynamic_slice_in_dim(xs, t * tile, tile), 0)
        d = jax.lax.dynamic_slice_in_dim(dy, t * tile, tile)
        product = jnp.dot(x.T, d, preferred_element_type=jnp.float32)
        return _add_to_group(dw, g, product), None

    dw = vary_as(jnp.zeros((groups, xs.shape[1], dy.shape[1]), jnp.float32), xs, dy, sizes)
    return jax.lax.scan(add, dw, (group, at, valid))[0]
