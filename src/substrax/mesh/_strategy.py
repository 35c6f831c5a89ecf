"""ShardingStrategy: the interface that every sharding strategy implements."""

from __future__ import annotations

import abc
import numbers
import warnings
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from substrax._warnings import ShardingWarning

__all__ = ["INDIVISIBLE", "ShardingStrategy", "axis_size"]

#: The phrase every note about a dimension left replicated for divisibility contains.
INDIVISIBLE = "is not divisible by"

#: A spec and, for every dimension left replicated that a strategy would shard, why.
SpecAndNotes = tuple[PartitionSpec, tuple[str, ...]]


def axis_size(mesh: Any, axis_name: str) -> int:
    """Size of ``axis_name`` in ``mesh`` (a ``Mesh`` or ``AbstractMesh``).

    Raises:
      ValueError: If the mesh has no such axis.
    """
    if axis_name not in mesh.axis_names:
        raise ValueError(
            f"Mesh axis {axis_name!r} is not in the mesh; its axes are {tuple(mesh.axis_names)}."
        )
    return int(dict(mesh.shape)[axis_name])


class ShardingStrategy(abc.ABC):
    """Abstract base class for sharding strategies.

    Defines the interface that all sharding strategies must implement for consistent handling
    of different parallelism types. A strategy shards along one mesh axis, ``axis_name``, which
    is axis number ``mesh_axis`` of the meshes it is used with.

    Subclasses implement :meth:`get_partition_spec` (from dimension names) and
    :meth:`_shard_dims` (from a concrete shape); :meth:`spec_for_shape` adds the divisibility
    check and :meth:`apply_sharding` places an array.
    """

    def __init__(self, axis_name: str, mesh_axis: int):
        """Initialize sharding strategy.

        Args:
          axis_name: Name of the mesh axis for this strategy.
          mesh_axis: Index of the mesh axis.

        Raises:
          ValueError: If ``axis_name`` is empty or ``mesh_axis`` is not a non-negative integer.
        """
        if not isinstance(axis_name, str) or not axis_name:
            raise ValueError(f"axis_name must be a non-empty mesh axis name, got {axis_name!r}.")
        is_int = isinstance(mesh_axis, numbers.Integral) and not isinstance(mesh_axis, bool)
        if not is_int or mesh_axis < 0:
            raise ValueError(f"mesh_axis must be a non-negative integer, got {mesh_axis!r}.")
        self.axis_name = axis_name
        self.mesh_axis = int(mesh_axis)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(axis_name={self.axis_name!r}, mesh_axis={self.mesh_axis})"

    @abc.abstractmethod
    def get_partition_spec(self, tensor_shape: tuple[str, ...]) -> PartitionSpec:
        """Get partition specification for a tensor with given shape names.

        Args:
          tensor_shape: Tuple of dimension names for the tensor.

        Returns:
          PartitionSpec defining how to shard the tensor.
        """

    @abc.abstractmethod
    def apply_sharding(self, array: jax.Array, mesh: Mesh) -> jax.Array:
        """Apply sharding to an array using the given mesh.

        Args:
          array: JAX array to shard.
          mesh: Device mesh for sharding.

        Returns:
          Sharded array.
        """

    def _shard_dims(self, shape: tuple[int, ...], name: str | None) -> tuple[tuple[int, ...], str]:
        """Dimensions of a parameter of ``shape`` that this strategy shards, or why none.

        Returns:
          The dimension indices to shard over ``axis_name`` (empty when none), and the reason
          when none is sharded (empty string otherwise).
        """
        del shape, name
        return (), ""

    def spec_for_shape(
        self, shape: Sequence[int], mesh: Any, *, name: str | None = None
    ) -> SpecAndNotes:
        """The spec of a parameter of ``shape`` under this strategy on ``mesh``.

        A dimension that the strategy would shard but that does not divide the axis size is left
        replicated, and a note says so.

        Args:
          shape: The parameter's shape.
          mesh: The mesh (a ``Mesh`` or ``AbstractMesh``) that has ``axis_name``.
          name: The parameter's path, such as ``"layers/0/attn/out/kernel"``; strategies that
            tell layers apart by name use it.

        Returns:
          ``(spec, notes)``: a PartitionSpec and a tuple of strings, one for each dimension
          that was left replicated although the strategy would shard it, or why nothing is
          sharded.

        Raises:
          ValueError: If the mesh lacks ``axis_name`` or has it at another index than
            ``mesh_axis``.
        """
        spec, reason, indivisible = self._spec_parts(shape, mesh, name)
        return spec, ((reason,) if reason else ()) + indivisible

    def _spec_parts(
        self, shape: Sequence[int], mesh: Any, name: str | None
    ) -> tuple[PartitionSpec, str, tuple[str, ...]]:
        """The spec, why nothing is sharded by design, and which dimensions did not divide."""
        size = self._check_mesh(mesh)
        shape = tuple(int(d) for d in shape)
        dims, reason = self._shard_dims(shape, name)
        entries: list[str | None] = [None] * len(shape)
        indivisible = []
        for dim in dims:
            if shape[dim] % size:
                indivisible.append(
                    f"dimension {dim} of shape {shape} ({shape[dim]}) {INDIVISIBLE} mesh "
                    f"axis {self.axis_name!r} of size {size}: replicated"
                )
            else:
                entries[dim] = self.axis_name
        return PartitionSpec(*entries), reason, tuple(indivisible)

    def _check_mesh(self, mesh: Any) -> int:
        size = axis_size(mesh, self.axis_name)
        if tuple(mesh.axis_names).index(self.axis_name) != self.mesh_axis:
            raise ValueError(
                f"{self!r} expects {self.axis_name!r} at mesh axis {self.mesh_axis}, but the mesh "
                f"has it at {tuple(mesh.axis_names).index(self.axis_name)} "
                f"(axes {tuple(mesh.axis_names)})."
            )
        return size

    def _place(self, array: jax.Array, mesh: Mesh, spec: PartitionSpec) -> jax.Array:
        return jax.device_put(array, NamedSharding(mesh, spec))

    def _place_param(self, array: jax.Array, mesh: Mesh) -> jax.Array:
        """Places a parameter by :meth:`spec_for_shape`, warning where it replicates."""
        spec, _, indivisible = self._spec_parts(array.shape, mesh, None)
        for note in indivisible:
            warnings.warn(f"{type(self).__name__}: {note}.", ShardingWarning, stacklevel=3)
        return self._place(array, mesh, spec)
