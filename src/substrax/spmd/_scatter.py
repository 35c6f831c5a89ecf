"""A sharded value's collectives inside a ``shard_map`` region: gathered whole, scattered back.

:func:`gather_shard` and :func:`scatter_shard` are the one pair every substrax step uses to
move a parameter between its stored shard and its whole form (the flat step's manual region,
a pipeline's stages): the gradient of a gather is a reduce-scatter, then a sum over the
replicas. :func:`reduce_scatter` does one dimension's reduce-scatter, in one collective or in
two stages. XLA:TPU compiles a reduce-scatter whose group is every device of the program as an
all-reduce and a slice, twice the bytes (:func:`~substrax.spmd.scatter_stages` says when).
The same sum then goes in two reduce-scatters over index groups of the same axes: the first
over ``outer`` devices ``inner`` apart, which leaves each device the block of ``inner`` chunks
its neighbours will share, the second over those ``inner`` neighbours. Each device ends with
the chunk a single reduce-scatter gives it, and the two together move a single ring's bytes.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import PartitionSpec

__all__ = ["gather_shard", "reduce_scatter", "scatter_shard"]


def reduce_scatter(
    x: jax.Array, axes: str | tuple[str, ...], *, dimension: int, stages: tuple[int, int] | None
) -> jax.Array:
    """``x`` summed over ``axes`` and split along ``dimension``, this device's chunk kept.

    Equal to ``jax.lax.psum_scatter(x, axes, scatter_dimension=dimension, tiled=True)``.

    Args:
      x: This device's addend, inside a region manual over ``axes``.
      axes: The mesh axes to sum over (one name or a tuple, as ``psum_scatter`` takes).
      dimension: The dimension to split; its size must divide by the devices over ``axes``.
      stages: ``(outer, inner)`` with ``outer x inner`` the devices over ``axes``: two
        reduce-scatters over index groups; None for one.

    Returns:
      This device's chunk of the sum.

    Raises:
      ValueError: If ``stages`` does not multiply to the devices over ``axes``.
    """
    if stages is None:
        return jax.lax.psum_scatter(x, axes, scatter_dimension=dimension, tiled=True)
    outer, inner = stages
    size = jax.lax.axis_size(axes)
    if outer * inner != size:
        raise ValueError(
            f"stages {stages} must multiply to the {size} devices over {axes!r}, e.g. "
            f"(1, {size}) or None for one reduce-scatter."
        )
    ids = np.arange(size).reshape(outer, inner)
    apart = [[int(i) for i in column] for column in ids.T]  # outer devices, inner apart
    neighbours = [[int(i) for i in row] for row in ids]
    for groups in (apart, neighbours):
        x = jax.lax.psum_scatter(
            x, axes, scatter_dimension=dimension, tiled=True, axis_index_groups=groups
        )
    return x


def gather_shard(x: jax.Array, spec: PartitionSpec) -> jax.Array:
    """This device's shard of a value stored by ``spec``, gathered whole over those axes.

    Args:
      x: The shard, inside a region manual over ``spec``'s axes.
      spec: How the value is split over the region's axes (an entry per dimension, None for
        a whole one).

    Returns:
      The value whole along every dimension ``spec`` splits.
    """
    for dim, entry in enumerate(spec):
        if entry is not None:
            x = jax.lax.all_gather(x, entry, axis=dim, tiled=True)
    return x


def scatter_shard(
    g: jax.Array,
    spec: PartitionSpec,
    *,
    replicas: tuple[str, ...] = (),
    stages: tuple[int, int] | None = None,
) -> jax.Array:
    """A whole addend (a gradient) summed over the devices into the shard ``spec`` stores.

    The transpose of :func:`gather_shard`, then a sum over the replica axes: each split
    dimension is reduce-scattered (the last first), then the shard, a fraction of the
    whole, is all-reduced over ``replicas``.

    Args:
      g: This device's whole addend, inside a region manual over ``spec``'s axes and
        ``replicas``.
      spec: How the sum is stored over the region's axes.
      replicas: Axes the stored value is whole on, whose devices' addends are summed too.
      stages: Two stages for the reduce-scatter of a dimension split over that many devices
        (:func:`reduce_scatter`); others take one.

    Returns:
      This device's shard of the sum.
    """
    for dim in reversed(range(len(spec))):
        entry = spec[dim]
        if entry is not None:
            whole = stages is not None and math.prod(stages) == jax.lax.axis_size(entry)
            g = reduce_scatter(g, entry, dimension=dim, stages=stages if whole else None)
    return jax.lax.psum(g, replicas) if replicas else g
