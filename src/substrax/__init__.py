"""substrax: shard JAX and Flax NNX models across many accelerators, simply and correctly.

Submodules:

* :mod:`substrax.mesh`: device meshes, logical-axis rules and sharding strategies.
* :mod:`substrax.layout`: named layouts (dp, fsdp, hsdp, tp, fsdp+tp, pp): the role of each
  mesh axis, and the rules, batch axes and strategy that follow.
* :mod:`substrax.spmd`: placing batches on a mesh and constraining activations.
* :mod:`substrax.planner`: ranking layouts before anything is compiled.
* :mod:`substrax.pipeline`: running a layer stack as a pipeline.
* :mod:`substrax.data`: token files and text in windows, batched per process (Grain).
"""

from substrax._warnings import ShardingWarning as ShardingWarning
from substrax._warnings import warn_user as warn_user

__version__ = "0.1.0"

__all__ = ["ShardingWarning", "__version__", "warn_user"]
