"""Placing host batches on a mesh: sharded along the leading dimension, or replicated."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from substrax.mesh._resolve import as_axes
from substrax.spmd._attention import zigzag

__all__ = [
    "batch_sharding",
    "check_batch",
    "check_rows",
    "is_replicated_leaf",
    "replicate",
    "shard_batch",
]

BatchAxes = str | Sequence[str]


def _axes(batch_axes: BatchAxes, mesh: Mesh | None = None, seq_axes=()) -> tuple[str, ...]:
    """``batch_axes`` as a tuple, checked against ``mesh``'s axes (and ``seq_axes`` too).

    Raises:
      ValueError: If it names no axis, or an axis ``mesh`` lacks (naming the mesh's axes).
    """
    axes = as_axes(batch_axes)
    if not axes or not all(isinstance(a, str) and a for a in axes):
        raise ValueError(f"batch_axes must name one or more mesh axes, got {batch_axes!r}.")
    if mesh is not None:
        for name, given in (("batch_axes", axes), ("seq_axes", tuple(seq_axes))):
            unknown = [a for a in given if a not in mesh.axis_names]
            if unknown:
                raise ValueError(
                    f"{name} {given!r} names {unknown!r}, which the mesh lacks; its axes are "
                    f"{tuple(mesh.axis_names)!r}."
                )
    return axes


def batch_sharding(
    mesh: Mesh, batch_axes: BatchAxes = "data", seq_axes: Sequence[str] = ()
) -> NamedSharding:
    """The sharding of a batch: leading dimension over ``batch_axes``, the rest replicated.

    Args:
      mesh: The device mesh.
      batch_axes: The mesh axis, or axes, the batch is split over.
      seq_axes: Mesh axes the second dimension (the sequence) is split over: context
        parallelism (none by default).

    Returns:
      ``NamedSharding(mesh, P(batch_axes))``, or ``P(batch_axes, seq_axes)``.

    Raises:
      ValueError: If an axis is not in the mesh or is named twice.
    """
    axes, seq = _axes(batch_axes), tuple(seq_axes)
    every = axes + seq
    missing = [a for a in every if a not in mesh.axis_names]
    if missing or len(set(every)) != len(every):
        raise ValueError(
            f"batch_axes {axes} and seq_axes {seq} must be distinct axes of the mesh; its axes "
            f"are {tuple(mesh.axis_names)}."
        )
    entries = [axes if len(axes) > 1 else axes[0]]
    if seq:
        entries.append(seq if len(seq) > 1 else seq[0])
    return NamedSharding(mesh, PartitionSpec(*entries))


def is_replicated_leaf(leaf: Any) -> bool:
    """Whether a batch leaf is the same on every device rather than split into rows.

    A 0-d array is: a typed key (``jax.random.key(seed)``), a step number, a scalar schedule
    value. Every array with a leading dimension holds rows.

    Args:
      leaf: A batch leaf.

    Returns:
      True for a 0-d array.
    """
    return np.ndim(leaf) == 0


def check_batch(batch: Any) -> int:
    """The number of rows of a batch, after checking that it is one.

    A batch is a pytree (dict, tuple, list, dataclass, ...) of arrays (numpy or jax) that
    share a leading batch dimension of at least one row; ``jax.ShapeDtypeStruct`` leaves give
    only the shapes, for a step that is compiled and never run. 0-d leaves (a typed key from
    ``jax.random.key``, a step number, a scalar schedule value) are replicated to every
    device instead (:func:`is_replicated_leaf`); a raw ``jax.random.PRNGKey`` has a leading
    dimension of 2, so pass a typed key (``jax.random.key``) instead.

    Args:
      batch: The batch.

    Returns:
      The shared leading size (this process's rows, in a multi-process run).

    Raises:
      TypeError: If a leaf is not an array (a string, a Python number, a list of rows: convert
        those with ``np.asarray``), or the batch has no leaves.
      ValueError: If the leaves' leading sizes differ, or the batch has no rows (no leaf with
        a leading dimension, or a leading size of 0).
    """
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    if not leaves:
        raise TypeError(f"The batch holds no arrays: got {type(batch).__name__} {batch!r}.")
    sizes: dict[str, int] = {}
    for path, leaf in leaves:
        where = f"Batch leaf {jax.tree_util.keystr(path)}" if path else "The batch"
        if not isinstance(leaf, (np.ndarray, np.generic, jax.Array, jax.ShapeDtypeStruct)):
            raise TypeError(
                f"{where} is a {type(leaf).__name__} ({leaf!r:.60}), not an array. A batch is a "
                "pytree of arrays with a leading batch dimension; convert rows or lists with "
                "np.asarray."
            )
        if not is_replicated_leaf(leaf):
            sizes[jax.tree_util.keystr(path) or "batch"] = np.shape(leaf)[0]
    if not sizes:
        raise ValueError(
            "The batch has no rows: every leaf is 0-d (replicated). Add the leaves that hold "
            "the rows, each with a leading batch dimension."
        )
    if len(set(sizes.values())) > 1:
        raise ValueError(
            f"The batch's leaves have different leading sizes {sizes}; every leaf needs the "
            "same number of rows. 0-d leaves (a typed key from jax.random.key, a step number) "
            "are replicated to every device; a raw jax.random.PRNGKey has shape (2,), so pass "
            "jax.random.key(seed) instead."
        )
    rows = next(iter(sizes.values()))
    if rows == 0:
        raise ValueError(f"The batch has 0 rows (leading sizes {sizes}); pass at least one row.")
    return rows


def shard_batch(
    batch: Any, mesh: Mesh, batch_axes: BatchAxes = "data", *, seq_axes: Sequence[str] = ()
) -> Any:
    """Puts a host batch on the mesh, split along its leading dimension.

    Each process passes the part of the global batch it loaded (its local slice, as
    ``jax.make_array_from_process_local_data`` expects); with one process that is the whole
    batch. The global batch is the processes' slices stacked in process order.

    With ``seq_axes`` (context parallelism) every leaf of two or more dimensions is a sequence
    along its second: it is put in :func:`~substrax.spmd.zigzag` order for the ``cp`` devices
    of ``seq_axes`` and split over them, so each device holds an early and a late chunk
    (:func:`~substrax.spmd.attention` and :func:`~substrax.spmd.positions` expect that order).
    Shift next-token targets before this: a split sequence has no next token at a chunk's end.

    Args:
      batch: A pytree of arrays (numpy or jax) with a common leading batch dimension, and
        0-d leaves, which are replicated (see :func:`check_batch`).
      mesh: The device mesh.
      batch_axes: The mesh axis, or axes, the batch is split over.
      seq_axes: Mesh axes the sequence (second dimension) is split over, in zigzag order.

    Returns:
      The same pytree of global ``jax.Array``s, sharded along their leading dimension (and
      their sequence). A ``jax.ShapeDtypeStruct`` leaf describes the global leaf (a step
      compiled for a target, never run): it comes back as one with that sharding.

    Raises:
      TypeError: If a leaf is not an array (see :func:`check_batch`).
      ValueError: If ``batch_axes`` or ``seq_axes`` names an axis the mesh lacks, the
        leaves' leading sizes differ, the batch has no rows, the global batch size does not
        divide the product of the data axes' sizes, or a sequence does not split into
        ``2 x cp`` chunks.
    """
    check_batch(batch)
    axes, seq = _axes(batch_axes, mesh, seq_axes), tuple(seq_axes)
    devices = math.prod(dict(mesh.shape)[a] for a in axes)
    cp = math.prod(dict(mesh.shape)[a] for a in seq)
    processes = len({d.process_index for d in mesh.devices.flat})

    def place(path, leaf):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            return _abstract_leaf(path, leaf, mesh, axes, seq, devices, cp)
        if is_replicated_leaf(leaf):
            return replicate(leaf, mesh)
        local = np.asarray(leaf)
        global_size = local.shape[0] * processes
        check_rows(global_size, devices, axes, leaf=_leaf(path, (global_size, *local.shape[1:])))
        split = seq if local.ndim > 1 else ()
        if split and cp > 1:
            _check_sequence(path, local.shape, cp, seq)
            local = zigzag(local, cp)
        return jax.make_array_from_process_local_data(
            batch_sharding(mesh, axes, split), local, (global_size, *local.shape[1:])
        )

    return jax.tree_util.tree_map_with_path(place, batch)


def _abstract_leaf(path, leaf, mesh, axes, seq, devices, cp) -> jax.ShapeDtypeStruct:
    """The global leaf ``leaf`` describes, with the sharding a host leaf would get."""
    if not leaf.shape:
        return jax.ShapeDtypeStruct((), leaf.dtype, sharding=NamedSharding(mesh, PartitionSpec()))
    check_rows(leaf.shape[0], devices, axes, leaf=_leaf(path, leaf.shape))
    split = seq if len(leaf.shape) > 1 else ()
    if split and cp > 1:
        _check_sequence(path, leaf.shape, cp, seq)
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=batch_sharding(mesh, axes, split))


def check_rows(
    rows: int, devices: int, axes: tuple[str, ...], *, microbatches: int = 1, leaf: str = ""
) -> None:
    """Raises unless ``rows`` split evenly over ``devices`` and each device's into microbatches.

    The one check of a batch's rows against its batch axes: :func:`shard_batch` makes it
    for each leaf it places, and the train and eval steps for the global batch before they
    trace (a ``shard_map`` would name its own argument instead).

    Args:
      rows: The global batch's rows.
      devices: The number of devices of ``axes`` (the data-parallel replicas).
      axes: The batch axes, named in the message.
      microbatches: Slices of each device's rows (gradient accumulation).
      leaf: The leaf, as the message names it in parentheses (``"leaf ['x'] of shape
        (6, 2)"``), if one.

    Raises:
      ValueError: If ``rows`` is not a multiple of ``devices``, or a device's rows not a
        multiple of ``microbatches``; it names both and the multiple of rows that would do.
    """
    ours = f"batch's {rows} rows" + (f" ({leaf})" if leaf else "")
    slices = f" (microbatches={microbatches} slices each device's rows)" if microbatches > 1 else ""
    if rows % devices:
        raise ValueError(
            f"The {ours} do not split evenly over the {devices} devices of its batch axes "
            f"{axes}; pass a batch of a multiple of {devices * microbatches} rows{slices}."
        )
    if (rows // devices) % microbatches:
        raise ValueError(
            f"microbatches={microbatches} slices each device's rows, but the {ours} over "
            f"{devices} data-parallel replicas ({axes}) give {rows // devices} per device; pass "
            f"a batch of a multiple of {devices * microbatches} rows or a microbatches that "
            f"divides {rows // devices}."
        )


def _leaf(path, shape) -> str:
    """A batch leaf as :func:`check_rows` names it."""
    name = jax.tree_util.keystr(path)
    return f"leaf {name} of shape {tuple(shape)}" if name else f"shape {tuple(shape)}"


def _check_sequence(path, shape, cp: int, seq) -> None:
    if shape[1] % (2 * cp):
        raise ValueError(
            f"Leaf {jax.tree_util.keystr(path)} (shape {shape}) has a sequence of "
            f"{shape[1]}, which does not split into 2 x cp = {2 * cp} chunks over "
            f"the context axes {seq}; use a length that is a multiple of {2 * cp}."
        )


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Puts every leaf of ``tree`` on every device of ``mesh``.

    Args:
      tree: A pytree of arrays. In a multi-process run every process must pass the same
        values.
      mesh: The device mesh.

    Returns:
      The pytree of fully replicated ``jax.Array``s.
    """
    sharding = NamedSharding(mesh, PartitionSpec())

    def place(leaf):
        if isinstance(leaf, jax.Array):  # a typed key has no numpy form
            return jax.device_put(leaf, sharding)
        return jax.make_array_from_process_local_data(sharding, np.asarray(leaf))

    return jax.tree.map(place, tree)
