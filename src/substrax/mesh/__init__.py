"""Device meshes, mesh rules, partition-spec helpers and sharding strategies.

Three layers, from low to high:

* Meshes: :class:`DeviceMeshManager` (``jax.make_mesh`` over the visible devices, Auto axes).
* Rules: :class:`MeshRules` and helpers map logical axis names to mesh axes. Every name-to-spec
  decision in substrax goes through one resolver (:meth:`MeshRules.resolve` for names, each
  strategy's ``resolve`` for shapes), which returns a :class:`Resolution`: the spec and a
  :class:`Reason` for every dimension left out.
* Strategies: :class:`ShardingConfig`, :class:`ParallelismConfig` and the
  :class:`ShardingStrategy` implementations decide the partition spec of every parameter.
"""

from typing import TYPE_CHECKING

from substrax._lazy import attach

if TYPE_CHECKING:
    from substrax.mesh._config import ParallelismConfig as ParallelismConfig
    from substrax.mesh._config import ShardingConfig as ShardingConfig
    from substrax.mesh._devices import DeviceMeshManager as DeviceMeshManager
    from substrax.mesh._devices import check_mesh as check_mesh
    from substrax.mesh._multi import MultiDimensionalStrategy as MultiDimensionalStrategy
    from substrax.mesh._resolve import REASON_KINDS as REASON_KINDS
    from substrax.mesh._resolve import Reason as Reason
    from substrax.mesh._resolve import Resolution as Resolution
    from substrax.mesh._resolve import as_axes as as_axes
    from substrax.mesh._resolve import spec_entry as spec_entry
    from substrax.mesh._rules import MeshRules as MeshRules
    from substrax.mesh._rules import create_named_sharding as create_named_sharding
    from substrax.mesh._rules import data_parallel_rules as data_parallel_rules
    from substrax.mesh._rules import fsdp_rules as fsdp_rules
    from substrax.mesh._rules import partition_spec_for_names as partition_spec_for_names
    from substrax.mesh._strategies import DataParallelStrategy as DataParallelStrategy
    from substrax.mesh._strategies import FSDPStrategy as FSDPStrategy
    from substrax.mesh._strategies import PipelineParallelStrategy as PipelineParallelStrategy
    from substrax.mesh._strategies import TensorParallelStrategy as TensorParallelStrategy
    from substrax.mesh._strategy import ShardingStrategy as ShardingStrategy

__getattr__, __dir__ = attach(__name__, __file__)

__all__ = [
    "DataParallelStrategy",
    "DeviceMeshManager",
    "FSDPStrategy",
    "MeshRules",
    "MultiDimensionalStrategy",
    "ParallelismConfig",
    "PipelineParallelStrategy",
    "REASON_KINDS",
    "Reason",
    "Resolution",
    "ShardingConfig",
    "ShardingStrategy",
    "TensorParallelStrategy",
    "as_axes",
    "check_mesh",
    "create_named_sharding",
    "data_parallel_rules",
    "fsdp_rules",
    "partition_spec_for_names",
    "spec_entry",
]
