"""Random draws that do not depend on the layout: one device's bits, each device its rows.

jax's threefry (partitionable, jax's default) computes each element of a draw of shape ``G``
from the key and the element's position in ``G``. So the bits a device needs for its rows of
the whole batch's draw are the threefry of the key at those positions, which it can compute on
its own. Inside the manual data-parallel region (:mod:`substrax_flax._manual`) each device, and
each gradient-accumulation slice, holds one block of rows; its draws from the model's
``nnx.Rngs`` streams go through a PRNG implementation (:func:`rows_impl`) that computes, for a
draw of local shape ``L`` split with the rows along dimension ``d``, the bits of block ``q`` of
the whole batch's draw along ``d``. Draws whose shape does not depend on the batch (a noise of
a parameter's shape) are the key's own bits, the same on every device, as on one device.

Which dimension of each draw is split with the rows is read before the step is traced: the
loss is traced on the whole batch and on one block's rows, and the shapes of its draws are
paired in order (:func:`row_draws`). The cost is the threefry itself, computed once per element
as on one device, plus a few integer operations per element for the position.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.random as jex_random
import jax.numpy as jnp
import numpy as np

from substrax_flax._traced import is_key

__all__ = [
    "RowDraws", "off_rows", "on_rows", "row_counts", "row_draws", "rows_impl", "rows_loss",
    "threefry_obstacle",
]  # fmt: skip

_THREEFRY = jex_random.threefry_prng_impl
_U32 = np.uint32


@dataclasses.dataclass(frozen=True)
class RowDraws:
    """How the loss's random draws split with the rows of the batch.

    Attributes:
      dims: ``(local shape, dimension)`` for each shape a draw takes on one block's rows:
        the dimension split with the rows, or None for a draw that does not depend on them.
      blocks: The blocks of rows the whole batch is cut into: devices over the batch axes
        times gradient-accumulation slices.
      counts: For each leaf of the model's other state, whether it is an ``nnx.Rngs``
        stream's count: every accumulation slice starts from the step's counts, so the
        streams advance once per step, as on one device.
      stride: The rows' stride in the whole batch: 1 when a block holds contiguous rows;
        ``M`` in a pipeline, whose microbatch ``m`` holds rows ``m, m + M, ...`` (the key's
        phase is then ``m``). Block ``q``'s row ``i`` is the batch's row
        ``(q * rows + i) * stride + phase``.
    """

    dims: tuple[tuple[tuple[int, ...], int | None], ...]
    blocks: int
    counts: tuple[bool, ...] = ()
    stride: int = 1

    def dim(self, shape: Sequence[int]) -> int | None:
        """The dimension of a draw of local ``shape`` split with the rows (None: not split).

        Raises:
          ValueError: For a shape the loss did not draw when it was traced.
        """
        for known, dim in self.dims:
            if known == tuple(shape):
                return dim
        raise ValueError(
            f"the loss drew random numbers of shape {tuple(shape)} in the step, a shape its "
            f"trace before the step did not draw (traced: {[d[0] for d in self.dims]}); its "
            "draws must not depend on anything but the batch's shape"
        )

    def describe(self) -> str:
        """One line for the step plan: how many draw shapes split with the rows, how many not."""
        split = sorted({d for _, d in self.dims if d is not None})
        whole = sum(d is None for _, d in self.dims)
        dims = ", ".join(map(str, split)) or "-"
        return (
            f"draws of {len(self.dims) - whole} shape(s) split with the rows (dimension "
            f"{dims}), of {whole} not; {self.blocks * self.stride} blocks of rows"
        )


def row_draws(
    whole: Sequence[tuple[int, ...]],
    local: Sequence[tuple[int, ...]],
    blocks: int,
    counts: Sequence[bool] = (),
    stride: int = 1,
) -> RowDraws:
    """Pairs the loss's draws on the whole batch with its draws on one block's rows.

    Args:
      whole: The shape of each draw on the whole batch, in trace order.
      local: The same on ``1 / blocks`` of the rows.
      blocks: The blocks of rows (devices over the batch axes times slices).
      counts: See :attr:`RowDraws.counts`.
      stride: See :attr:`RowDraws.stride`; ``local`` is then ``1 / (blocks * stride)`` of
        the rows.

    Returns:
      The :class:`RowDraws`.

    Raises:
      ValueError: Naming the draw that does not split with the rows: a different number of
        draws, a shape that changes in more than one dimension or not by ``blocks``, or one
        local shape that two draws would split differently.
    """
    draws, blocks = blocks, blocks * stride  # the local shapes are 1 / blocks of the rows
    if len(whole) != len(local):
        raise ValueError(
            f"the loss draws random numbers {len(whole)} times on the whole batch but "
            f"{len(local)} times on 1/{blocks} of its rows, so its draws cannot be split with "
            "the rows"
        )
    dims: dict[tuple[int, ...], int | None] = {}
    for g, shape in zip(whole, local, strict=True):
        changed = [d for d, (a, b) in enumerate(zip(g, shape, strict=False)) if a != b]
        ok = len(g) == len(shape) and len(changed) <= 1
        ok = ok and all(g[d] == shape[d] * blocks for d in changed)
        if not ok:
            raise ValueError(
                f"the loss draws random numbers of shape {tuple(g)} on the whole batch and "
                f"{tuple(shape)} on 1/{blocks} of its rows, not one dimension split {blocks} "
                "ways, so one device cannot compute its rows' share of the draw"
            )
        dim = changed[0] if changed else None
        if dims.setdefault(tuple(shape), dim) != dim:
            raise ValueError(
                f"the loss draws random numbers of shape {tuple(shape)} on 1/{blocks} of its "
                f"rows both split with the rows (dimension {dims[tuple(shape)]} or {dim}) and "
                "not, so one device cannot tell which share of the draw is its own"
            )
    return RowDraws(tuple(dims.items()), draws, tuple(counts), stride)


def _mul_wide(x: jax.Array, c: int) -> tuple[jax.Array, jax.Array]:
    """``x * c`` for uint32 ``x`` and a constant ``c < 2**32``, as ``(high, low)`` uint32."""
    x_hi, x_lo = x >> 16, x & 0xFFFF
    c_hi, c_lo = _U32(c >> 16), _U32(c & 0xFFFF)
    low, high = x_lo * c_lo, x_hi * c_hi
    a, b = x_hi * c_lo, x_lo * c_hi
    middle = a + b
    carry_middle = (middle < a).astype(_U32)
    lo = low + (middle << 16)
    carry = (lo < low).astype(_U32)
    return high + (middle >> 16) + (carry_middle << 16) + carry, lo


def _strided_iota(shape: tuple[int, ...], dims: range, stride_of: Callable[[int], int]):
    total = jnp.zeros(shape, _U32)
    for i in dims:
        total = total + jax.lax.broadcasted_iota(_U32, shape, i) * _U32(stride_of(i))
    return total


def row_counts(
    shape: tuple[int, ...],
    dim: int,
    blocks: int,
    block: Any,
    stride: int = 1,
    phase: Any = 0,
) -> tuple[jax.Array, jax.Array]:
    """Threefry's counters, ``(high, low)``, of block ``block`` of a draw split along ``dim``.

    The whole draw has ``shape`` with dimension ``dim`` ``blocks * stride`` times larger, and
    the block's row ``i`` is its row ``(block * rows + i) * stride + phase``; an element's
    counter is its row-major position there, as jax's partitionable threefry counts.

    Raises:
      ValueError: If a block's share or its outer positions exceed 32-bit counts.
    """
    rows, after = shape[dim], math.prod(shape[dim + 1 :])
    outer = math.prod(shape[:dim])
    if rows * after >= 2**32 or outer * rows * blocks * stride >= 2**32:
        raise ValueError(
            f"a random draw of shape {shape} on one device is too large to split with the "
            f"rows ({rows * after} elements from dimension {dim} on; at most 2**32 - 1)"
        )
    rank = len(shape)
    # the whole batch's row of each outer position and row, on those dimensions only
    row_shape = (*shape[: dim + 1], *(1,) * (rank - dim - 1))
    a = _strided_iota(row_shape, range(dim), lambda i: math.prod(shape[i + 1 : dim]))
    i = jax.lax.broadcasted_iota(_U32, row_shape, dim)
    u32 = functools.partial(jnp.asarray, dtype=_U32)
    row = (u32(block) * _U32(rows) + i) * _U32(stride) + u32(phase)
    hi, lo = _mul_wide(a * _U32(blocks * stride * rows) + row, after)
    # plus the position after the row, per element, as jax's own counters are built
    r = _strided_iota(shape, range(dim + 1, rank), lambda i: math.prod(shape[i + 1 :]))
    lo_r = lo + r
    return jnp.broadcast_to(hi, shape) + (lo_r < lo).astype(_U32), lo_r


def _bits(data: jax.Array, bit_width: int, counts: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Threefry bits at ``counts`` in jax's partitionable threefry's widths."""
    b1, b2 = jex_random.threefry2x32_p.bind(data[0], data[1], *counts)
    dtype = {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}[bit_width]
    if bit_width == 64:
        hi = jax.lax.convert_element_type(b1, dtype)
        return jax.lax.shift_left(hi, jnp.asarray(32, dtype)) | jax.lax.convert_element_type(
            b2, dtype
        )
    return jax.lax.convert_element_type(b1 ^ b2, dtype)


@functools.cache
def rows_impl(draws: RowDraws) -> Any:
    """The PRNG implementation of keys that know their block of rows.

    A key's data is threefry's two words, the block and the phase (see
    :attr:`RowDraws.stride`); folding and splitting keep the last two, and a draw split with
    the rows (:meth:`RowDraws.dim`) is that block's share of the whole batch's draw.
    """

    def random_bits(data, bit_width, shape):
        dim = draws.dim(shape)
        if dim is None:
            return _THREEFRY.random_bits(data[:2], bit_width, shape)
        counts = row_counts(tuple(shape), dim, draws.blocks, data[2], draws.stride, data[3])
        return _bits(data, bit_width, counts)

    def fold_in(data, value):
        return jnp.concatenate([_THREEFRY.fold_in(data[:2], value), data[2:]])

    def split(data, shape):
        keys = _THREEFRY.split(data[:2], shape)
        block = jnp.broadcast_to(data[2:], (*keys.shape[:-1], 2))
        return jnp.concatenate([keys, block], axis=-1)

    def seed(_):
        raise TypeError("substrax's row keys are made from a stream's key, not from a seed")

    return jex_random.define_prng_impl(
        key_shape=(4,), seed=seed, split=split, random_bits=random_bits, fold_in=fold_in,
        name="substrax_rows", tag="srows",
    )  # fmt: skip


@functools.cache
def _threefry_dtype() -> Any:
    """The dtype of a threefry2x32 key array (``key<fry>``)."""
    return jax.eval_shape(lambda: jax.random.key(0, impl="threefry2x32")).dtype


def _is_threefry(leaf: Any) -> bool:
    """Whether ``leaf`` is a threefry key array, concrete or abstract (``compile_for``'s)."""
    return is_key(leaf) and leaf.dtype == _threefry_dtype()


def _impl_name(leaf: Any) -> str:
    """The PRNG implementation's name of a key array or of its ``ShapeDtypeStruct``."""
    names = []
    jax.eval_shape(lambda key: names.append(str(jax.random.key_impl(key))), leaf)
    return names[0]


def on_rows(leaves: Sequence[Any], draws: RowDraws, block: Any, phase: Any = 0) -> list[Any]:
    """``leaves`` with each threefry key made a row key of ``block`` and ``phase``.

    Other leaves are kept as they are.
    """

    def wrap(key):
        data = jax.random.key_data(key)
        words = jnp.stack([jnp.asarray(block, _U32), jnp.asarray(phase, _U32)])
        index = jnp.broadcast_to(words, (*data.shape[:-1], 2))
        return jax.random.wrap_key_data(
            jnp.concatenate([data, index], axis=-1), impl=rows_impl(draws)
        )

    return [wrap(x) if _is_threefry(x) else x for x in leaves]


def off_rows(tree: Any) -> Any:
    """``tree`` with each row key back as the threefry key it was made from."""

    def unwrap(x):
        if not is_key(x) or _is_threefry(x):
            return x
        data = jax.random.key_data(x)
        if data.shape[-1] != 4:
            return x
        return jax.random.wrap_key_data(data[..., :2], impl="threefry2x32")

    return jax.tree.map(unwrap, tree)


def rows_loss(loss_of: Callable, draws: RowDraws, block: Any) -> Callable:
    """``loss_of`` drawing block ``block``'s share of the whole batch's random numbers.

    Args:
      loss_of: ``loss_of(params, rest_leaves, batch) -> (loss, (aux, new_rest))``.
      draws: The loss's :class:`RowDraws`.
      block: This device's (and slice's) block of rows, a uint32 scalar.

    Returns:
      ``loss_of`` with the stream keys among ``rest_leaves`` made row keys on the way in; the
      stored keys come back unchanged (a stream advances its count, not its key), so they
      stay the same on every device.
    """

    def on_block(params, rest_leaves, batch):
        loss, (aux, new_rest) = loss_of(params, on_rows(rest_leaves, draws, block), batch)
        leaves, treedef = jax.tree.flatten(new_rest)
        if len(leaves) != len(rest_leaves):  # the state changed its structure
            return loss, (aux, off_rows(new_rest))
        pairs = zip(leaves, rest_leaves, strict=True)
        kept = [old if _is_threefry(old) else new for new, old in pairs]
        return loss, (aux, jax.tree.unflatten(treedef, kept))

    return on_block


def threefry_obstacle(leaves: Sequence[Any]) -> str | None:
    """Why the stream keys among ``leaves`` cannot draw one device's bits per block, or None."""
    keys = [x for x in leaves if is_key(x)]
    others = sorted({_impl_name(x) for x in keys if not _is_threefry(x)})
    if others:
        return (
            f"the model's random streams use the PRNG implementation(s) {others}, whose bits "
            "substrax cannot compute a block of rows at a time (only threefry2x32's)"
        )
    if keys and not jax.config.jax_threefry_partitionable:
        return (
            "jax_threefry_partitionable is off, so a draw's bits depend on its whole shape "
            "and no device can compute its rows' share"
        )
    return None
