"""ShardingStrategy: the interface that every sharding strategy implements."""

from __future__ import annotations

import abc
import numbers
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from substrax._warnings import ShardingWarning
from substrax.mesh._resolve import Reason, Resolution, axis_sizes, resolve_axes

if TYPE_CHECKING:  # imported where an array is placed: the planner runs without jax
    import jax
    from jax.sharding import Mesh, PartitionSpec

__all__ = ["ShardingStrategy", "axis_size"]

#: The dimensions a strategy shards, and why it shards none (None when it shards some).
ShardDims = tuple[tuple[int, ...], Reason | None]


def axis_size(mesh: Any, axis_name: str) -> int:
    """Size of ``axis_name`` in ``mesh`` (a ``Mesh``, ``AbstractMesh`` or ``{axis: size}``).

    Raises:
      ValueError: If the mesh has no such axis.
    """
    sizes = axis_sizes(mesh)
    if axis_name not in sizes:
        raise ValueError(
            f"Mesh axis {axis_name!r} is not in the mesh; its axes are {tuple(sizes)}."
        )
    return sizes[axis_name]


class ShardingStrategy(abc.ABC):
    """Abstract base class for sharding strategies.

    Defines the interface that all sharding strategies must implement for consistent handling
    of different parallelism types. A strategy shards along one mesh axis, ``axis_name``, which
    is axis number ``mesh_axis`` of the meshes it is used with.

    Subclasses implement :meth:`get_partition_spec` (from dimension names) and
    :meth:`_shard_dims` (from a concrete shape); :meth:`resolve` passes that proposal through
    substrax's one resolver (divisibility, reasons) and :meth:`apply_sharding` places an array.
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

    def __eq__(self, other: object) -> bool:
        """Strategies are values: equal when of one type with equal settings."""
        if type(other) is not type(self):
            return NotImplemented
        return vars(self) == vars(other)

    def __hash__(self) -> int:
        return hash((type(self), self.axis_name, self.mesh_axis))

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

    def _shard_dims(
        self, shape: tuple[int, ...], name: str | None, size: int, layer: str | None = None
    ) -> ShardDims:
        """Dimensions of a parameter of ``shape`` that this strategy shards, or why none.

        ``size`` is the size of ``axis_name`` in the mesh; ``layer`` the kind of layer that
        holds the parameter, when known (see :meth:`resolve`).

        Returns:
          The dimension indices to shard over ``axis_name`` (empty when none), and a
          :class:`Reason` when none is sharded (None otherwise).
        """
        del shape, name, size, layer
        return (), None

    def _reason(self, kind: str, detail: str) -> Reason:
        return Reason(kind, None, None, (self.axis_name,), f"{type(self).__name__}: {detail}")

    def resolve(
        self, shape: Sequence[int], mesh: Any, *, name: str | None = None, layer: str | None = None
    ) -> Resolution:
        """The spec of a parameter of ``shape`` under this strategy on ``mesh``.

        The strategy proposes its axis for some dimensions; substrax's one resolver
        (:meth:`substrax.mesh.MeshRules.resolve` documents the policy) leaves out a proposal
        that does not divide its dimension, with an ``indivisible`` reason.

        Args:
          shape: The parameter's shape.
          mesh: The mesh (a ``Mesh`` or ``AbstractMesh``) that has ``axis_name``.
          name: The parameter's path, such as ``"layers/0/attn/out/kernel"``; strategies that
            tell layers apart by name use it.
          layer: The kind of layer that holds the parameter, when the caller knows it: a Flax
            module class name (``"Linear"``, ``"Embed"``, ``"Conv"``, ``"LayerNorm"``, ...),
            or ``"MultiHeadAttention.query"`` (``.key``, ``.value``, ``.out``) for the
            projections of an attention layer. Tensor parallelism uses it before shapes.

        Returns:
          A :class:`~substrax.mesh.Resolution`: the spec, and why any dimension the strategy
          would shard is replicated (or why it shards nothing).

        Raises:
          ValueError: If the mesh lacks ``axis_name`` or has it at another index than
            ``mesh_axis``.
        """
        size = self._check_mesh(mesh)
        shape = tuple(int(d) for d in shape)
        dims, reason = self._shard_dims(shape, name, size, layer)
        requested = [(self.axis_name,) if d in dims else () for d in range(len(shape))]
        return resolve_axes(requested, shape, mesh, reasons=(reason,) if reason else ())

    def _check_mesh(self, mesh: Any) -> int:
        size = axis_size(mesh, self.axis_name)
        names = tuple(axis_sizes(mesh))
        if names.index(self.axis_name) != self.mesh_axis:
            raise ValueError(
                f"{self!r} expects {self.axis_name!r} at mesh axis {self.mesh_axis}, but the mesh "
                f"has it at {names.index(self.axis_name)} (axes {names})."
            )
        return size

    def _place(self, array: jax.Array, mesh: Mesh, spec: PartitionSpec) -> jax.Array:
        import jax
        from jax.sharding import NamedSharding

        return jax.device_put(array, NamedSharding(mesh, spec))

    def _place_param(self, array: jax.Array, mesh: Mesh) -> jax.Array:
        """Places a parameter by :meth:`resolve`, warning where it replicates."""
        resolution = self.resolve(array.shape, mesh)
        for reason in resolution.of_kind("indivisible"):
            warnings.warn(f"{type(self).__name__}: {reason}.", ShardingWarning, stacklevel=3)
        return self._place(array, mesh, resolution.spec)
