"""substrax: shard JAX and Flax NNX models across many accelerators, simply and correctly.

Submodules:

* :mod:`substrax.mesh`: device meshes, logical-axis rules and sharding strategies.
* :mod:`substrax.spmd`: placing batches on a mesh and constraining activations.
"""

from substrax._warnings import ShardingWarning as ShardingWarning

__version__ = "0.1.0"

__all__ = ["ShardingWarning", "__version__"]
