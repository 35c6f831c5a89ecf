"""SPMD helpers for model code and steps: batches, constraints, and layers with own regions.

Batches on the mesh, logical-name constraints, and layers that enter their own ``shard_map``
region (ring attention over the context axes, mixture-of-experts dispatch over the expert axes).

Sharding inference is left to XLA on Auto meshes: a batch sharded over the data axes is all a
data-parallel step needs for XLA to insert the gradient all-reduce.
"""

from typing import TYPE_CHECKING

from substrax._lazy import attach

if TYPE_CHECKING:
    from substrax.spmd._attention import VARIANTS as VARIANTS
    from substrax.spmd._attention import attention as attention
    from substrax.spmd._attention import context_attention as context_attention
    from substrax.spmd._attention import context_axes as context_axes
    from substrax.spmd._attention import context_positions as context_positions
    from substrax.spmd._attention import decode_attention as decode_attention
    from substrax.spmd._attention import positions as positions
    from substrax.spmd._attention import unzigzag as unzigzag
    from substrax.spmd._attention import zigzag as zigzag
    from substrax.spmd._batch import batch_sharding as batch_sharding
    from substrax.spmd._batch import check_batch as check_batch
    from substrax.spmd._batch import check_rows as check_rows
    from substrax.spmd._batch import is_replicated_leaf as is_replicated_leaf
    from substrax.spmd._batch import replicate as replicate
    from substrax.spmd._batch import shard_batch as shard_batch
    from substrax.spmd._constrain import active_rules as active_rules
    from substrax.spmd._constrain import constrain as constrain
    from substrax.spmd._constrain import lay_out as lay_out
    from substrax.spmd._constrain import manual_batch_axes as manual_batch_axes
    from substrax.spmd._constrain import use_rules as use_rules
    from substrax.spmd._experts import DISPATCHES as DISPATCHES
    from substrax.spmd._experts import ExpertStats as ExpertStats
    from substrax.spmd._experts import expert_capacity as expert_capacity
    from substrax.spmd._experts import experts as experts
    from substrax.spmd._grouped import Groups as Groups
    from substrax.spmd._grouped import active_platform as active_platform
    from substrax.spmd._grouped import group_rows as group_rows
    from substrax.spmd._grouped import grouped_matmul as grouped_matmul
    from substrax.spmd._grouped import native_grouped_matmul as native_grouped_matmul
    from substrax.spmd._precision import PRECISIONS as PRECISIONS
    from substrax.spmd._precision import MixedPrecision as MixedPrecision
    from substrax.spmd._precision import as_precision as as_precision
    from substrax.spmd._remat import REMAT as REMAT
    from substrax.spmd._remat import checkpoint_policy as checkpoint_policy
    from substrax.spmd._routing import ROUTINGS as ROUTINGS
    from substrax.spmd._routing import Route as Route
    from substrax.spmd._routing import route as route
    from substrax.spmd._scatter import gather_shard as gather_shard
    from substrax.spmd._scatter import reduce_scatter as reduce_scatter
    from substrax.spmd._scatter import scatter_shard as scatter_shard
    from substrax.spmd._workarounds import OBSERVED_ON as OBSERVED_ON
    from substrax.spmd._workarounds import looped_region_obstacle as looped_region_obstacle
    from substrax.spmd._workarounds import region_obstacle as region_obstacle
    from substrax.spmd._workarounds import scatter_stages as scatter_stages

__getattr__, __dir__ = attach(__name__, __file__)

__all__ = [
    "DISPATCHES",
    "ExpertStats",
    "Groups",
    "ROUTINGS",
    "Route",
    "PRECISIONS",
    "REMAT",
    "VARIANTS",
    "MixedPrecision",
    "active_rules",
    "as_precision",
    "attention",
    "batch_sharding",
    "check_batch",
    "check_rows",
    "is_replicated_leaf",
    "checkpoint_policy",
    "constrain",
    "context_attention",
    "context_axes",
    "context_positions",
    "decode_attention",
    "expert_capacity",
    "experts",
    "group_rows",
    "grouped_matmul",
    "lay_out",
    "looped_region_obstacle",
    "OBSERVED_ON",
    "manual_batch_axes",
    "native_grouped_matmul",
    "active_platform",
    "positions",
    "gather_shard",
    "reduce_scatter",
    "region_obstacle",
    "route",
    "scatter_shard",
    "scatter_stages",
    "replicate",
    "shard_batch",
    "unzigzag",
    "use_rules",
    "zigzag",
]
