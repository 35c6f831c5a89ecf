"""Placing host batches on a mesh: sharded along the leading dimension, or replicated."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = ["batch_sharding", "replicate", "shard_batch"]

DataAxes = str | Sequence[str]


def _axes(data_axes: DataAxes) -> tuple[str, ...]:
    axes = (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)
    if not axes or not all(isinstance(a, str) and a for a in axes):
        raise ValueError(f"data_axes must name one or more mesh axes, got {data_axes!r}.")
    return axes


def batch_sharding(mesh: Mesh, data_axes: DataAxes = "data") -> NamedSharding:
    """The sharding of a batch: leading dimension over ``data_axes``, the rest replicated.

    Args:
      mesh: The device mesh.
      data_axes: The mesh axis, or axes, the batch is split over.

    Returns:
      ``NamedSharding(mesh, P(data_axes))``.

    Raises:
      ValueError: If an axis is not in the mesh or is named twice.
    """
    axes = _axes(data_axes)
    missing = [a for a in axes if a not in mesh.axis_names]
    if missing or len(set(axes)) != len(axes):
        raise ValueError(
            f"data_axes {axes} must be distinct axes of the mesh; its axes are "
            f"{tuple(mesh.axis_names)}."
        )
    return NamedSharding(mesh, PartitionSpec(axes if len(axes) > 1 else axes[0]))


def shard_batch(batch: Any, mesh: Mesh, data_axes: DataAxes = "data") -> Any:
    """Puts a host batch on the mesh, split along its leading dimension.

    Each process passes the part of the global batch it loaded (its local slice, as
    ``jax.make_array_from_process_local_data`` expects); with one process that is the whole
    batch. The global batch is the processes' slices stacked in process order.

    Args:
      batch: A pytree of arrays (numpy or jax) with a common leading batch dimension.
      mesh: The device mesh.
      data_axes: The mesh axis, or axes, the batch is split over.

    Returns:
      The same pytree of global ``jax.Array``s, sharded along their leading dimension.

    Raises:
      ValueError: If a leaf is a scalar, or the global batch size does not divide the product
        of the data axes' sizes.
    """
    sharding = batch_sharding(mesh, data_axes)
    axes = _axes(data_axes)
    devices = math.prod(dict(mesh.shape)[a] for a in axes)
    processes = len({d.process_index for d in mesh.devices.flat})

    def place(path, leaf):
        local = np.asarray(leaf)
        if local.ndim == 0:
            raise ValueError(
                f"Batch leaf {jax.tree_util.keystr(path)} is a scalar; every leaf needs a "
                "leading batch dimension (replicate scalars with substrax.spmd.replicate)."
            )
        global_size = local.shape[0] * processes
        if global_size % devices:
            raise ValueError(
                f"Global batch size {global_size} of leaf {jax.tree_util.keystr(path)} "
                f"(shape {local.shape}) does not divide the {devices} devices of mesh axes "
                f"{axes}; use a multiple of {devices}."
            )
        return jax.make_array_from_process_local_data(
            sharding, local, (global_size, *local.shape[1:])
        )

    return jax.tree_util.tree_map_with_path(place, batch)


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
    return jax.tree.map(
        lambda leaf: jax.make_array_from_process_local_data(sharding, np.asarray(leaf)), tree
    )
