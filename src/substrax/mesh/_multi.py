"""MultiDimensionalStrategy: several strategies, each on its own mesh axis, merged per dimension."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jax.sharding import PartitionSpec

from substrax.mesh._config import ParallelismConfig
from substrax.mesh._resolve import Resolution, as_axes, axis_sizes, resolve_axes, spec_entry
from substrax.mesh._strategy import ShardingStrategy

__all__ = ["MultiDimensionalStrategy"]


class MultiDimensionalStrategy:
    """Multi-dimensional parallelism strategy combining multiple approaches.

    Combines different sharding strategies (data, tensor, FSDP, pipeline) to achieve optimal
    performance for large-scale training. Each strategy proposes a spec on its own mesh axis;
    the proposals are merged by :meth:`resolve_sharding_conflicts`.
    """

    def __init__(self, strategies: Mapping[str, ShardingStrategy], config: ParallelismConfig):
        """Initialize multi-dimensional strategy.

        Args:
          strategies: Dictionary mapping strategy names to strategy instances. Its order is the
            priority order of the merge.
          config: Sharding configuration for the multi-dimensional strategy.

        Raises:
          ValueError: If ``strategies`` is empty, holds something that is not a
            ``ShardingStrategy``, or a strategy's axis is not where ``config`` puts it.
        """
        if not isinstance(config, ParallelismConfig):
            raise ValueError(f"config must be a ParallelismConfig, got {type(config).__name__}.")
        if not isinstance(strategies, Mapping) or not strategies:
            raise ValueError(
                "strategies must be a non-empty mapping of names to ShardingStrategy instances, "
                f"got {strategies!r}."
            )
        names = config.mesh_axis_names
        for key, strategy in strategies.items():
            if not isinstance(strategy, ShardingStrategy):
                raise ValueError(
                    f"strategies[{key!r}] must be a ShardingStrategy, got {strategy!r}."
                )
            if strategy.axis_name not in names:
                raise ValueError(
                    f"strategies[{key!r}] uses mesh axis {strategy.axis_name!r}, which the "
                    f"config's mesh does not have. Mesh axes: {names}."
                )
            if names.index(strategy.axis_name) != strategy.mesh_axis:
                raise ValueError(
                    f"strategies[{key!r}] expects {strategy.axis_name!r} at mesh axis "
                    f"{strategy.mesh_axis}, but the config has it at "
                    f"{names.index(strategy.axis_name)} (axes {names})."
                )
        self.strategies = dict(strategies)
        self.config = config

    def __repr__(self) -> str:
        return f"MultiDimensionalStrategy({self.strategies!r})"

    def __eq__(self, other: object) -> bool:
        """Equal when the strategies (in priority order) and the configs are."""
        if not isinstance(other, MultiDimensionalStrategy):
            return NotImplemented
        mine, theirs = list(self.strategies.items()), list(other.strategies.items())
        return mine == theirs and self.config == other.config

    def __hash__(self) -> int:
        return hash((tuple(self.strategies), self.config))

    def get_combined_partition_spec(
        self, tensor_name: str, tensor_shape: tuple[str, ...]
    ) -> PartitionSpec:
        """Get combined partition spec from all strategies.

        Args:
          tensor_name: Name/type of the tensor.
          tensor_shape: Shape dimension names of the tensor.

        Returns:
          Combined PartitionSpec
        """
        proposals = {
            key: strategy.get_partition_spec(tuple(tensor_shape))
            for key, strategy in self.strategies.items()
        }
        return self.resolve_sharding_conflicts(tensor_name, proposals)

    def resolve_sharding_conflicts(
        self, tensor_name: str, proposed_specs: dict[str, PartitionSpec]
    ) -> PartitionSpec:
        """Resolve conflicts between multiple proposed partition specs.

        The merge is deterministic: proposals are taken in the order of ``proposed_specs``
        (the priority order) and merged dimension by dimension. A dimension collects the mesh
        axes of every proposal for it, in that order, so FSDP on ``"data"`` and tensor
        parallelism on ``"model"`` of the same dimension give ``("data", "model")``. A mesh axis
        already used anywhere in the merged spec is skipped (first wins), so the result never
        names one mesh axis twice. A shorter spec is padded with None (replicated), as
        ``PartitionSpec`` itself reads it.

        Args:
          tensor_name: Name of the tensor (used in error messages).
          proposed_specs: Dictionary of strategy names to proposed specs.

        Returns:
          Resolved PartitionSpec

        Raises:
          ValueError: If a proposal is not a ``PartitionSpec``.
        """
        for key, spec in proposed_specs.items():
            if not isinstance(spec, PartitionSpec):
                raise ValueError(
                    f"Proposed spec {key!r} for {tensor_name!r} must be a PartitionSpec, "
                    f"got {spec!r}."
                )
        rank = max((len(spec) for spec in proposed_specs.values()), default=0)
        merged: list[list[str]] = [[] for _ in range(rank)]
        used: set[str] = set()
        for spec in proposed_specs.values():
            for dim, entry in enumerate(spec):
                for axis in as_axes(entry):
                    if axis not in used:
                        merged[dim].append(axis)
                        used.add(axis)
        return PartitionSpec(*(spec_entry(axes) for axes in merged))

    def _check_mesh(self, mesh: Any) -> None:
        have = axis_sizes(mesh)
        if have != self.config.axis_sizes:
            raise ValueError(
                f"The mesh {have} is not the mesh of this strategy's config "
                f"{self.config.axis_sizes}; build the mesh from the config "
                "(DeviceMeshManager.create_device_mesh(config.axis_sizes)) or fix the config."
            )

    def resolve(
        self, shape: Sequence[int], mesh: Any, *, name: str | None = None, layer: str | None = None
    ) -> Resolution:
        """The spec of a parameter of ``shape``: every strategy's proposal, merged.

        Each strategy's :meth:`ShardingStrategy.resolve` proposal is merged by
        :meth:`resolve_sharding_conflicts`, and the merged proposal goes through substrax's one
        resolver: where a dimension collects several axes whose product does not divide it,
        it keeps the longest prefix that does (an ``indivisible`` reason names the rest).

        Args:
          shape: The parameter's shape.
          mesh: The mesh (a ``Mesh`` or ``AbstractMesh``).
          name: The parameter's path, passed on to each strategy.
          layer: The kind of layer that holds it, passed on (see
            :meth:`ShardingStrategy.resolve`).

        Returns:
          A :class:`~substrax.mesh.Resolution`, with every strategy's reasons.

        Raises:
          ValueError: If ``mesh`` is not the mesh of the strategy's config (axis names and
            sizes).
        """
        self._check_mesh(mesh)
        shape = tuple(int(d) for d in shape)
        proposals, reasons = {}, []
        for key, strategy in self.strategies.items():
            resolution = strategy.resolve(shape, mesh, name=name, layer=layer)
            proposals[key] = resolution.spec
            reasons.extend(resolution.reasons)
        merged = tuple(self.resolve_sharding_conflicts(name or "<tensor>", proposals))
        merged += (None,) * (len(shape) - len(merged))
        return resolve_axes([as_axes(e) for e in merged], shape, mesh, reasons=reasons)
