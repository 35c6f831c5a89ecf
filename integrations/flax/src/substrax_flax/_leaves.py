"""planner_leaves: a Flax NNX model's parameters, as the planner's leaves, without allocation."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable

from flax import nnx

from substrax import ShardingWarning
from substrax.planner import Leaf
from substrax_flax._state import logical_names, shape_and_dtype, variables

__all__ = ["planner_leaves"]

#: An unstacked model whose abstract build takes longer than this gets a warning.
SLOW_EVAL_SHAPE_SECONDS = 1.0


def planner_leaves(factory: Callable[[], nnx.Module]) -> list[Leaf]:
    """The parameters of the model ``factory`` builds, with their logical names.

    The model is built abstractly (``nnx.eval_shape``, eager sharding off). In flax 0.12.8 that
    grows quadratically with the depth of an unstacked model (about 28 s for 126 layers); when
    it is slow and no dimension is named ``layers``, a ``ShardingWarning`` recommends stacking
    the layers with ``nnx.vmap``.

    Args:
      factory: A function of no arguments that builds the model.

    Returns:
      One :class:`substrax.planner.Leaf` per ``nnx.Param``; unannotated dimensions are None.
    """
    start = time.perf_counter()
    with nnx.use_eager_sharding(False):
        state = nnx.state(nnx.eval_shape(factory), nnx.Param)
    elapsed = time.perf_counter() - start
    leaves = []
    for path, variable in variables(state):
        shape, _ = shape_and_dtype(variable)
        names = logical_names(variable, path) or (None,) * len(shape)
        leaves.append(Leaf(path, shape, tuple(names)))
    stacked = any("layers" in leaf.names for leaf in leaves)
    if elapsed > SLOW_EVAL_SHAPE_SECONDS and not stacked:
        warnings.warn(
            f"nnx.eval_shape took {elapsed:.1f} s for this unstacked model; it grows "
            "quadratically with depth in flax 0.12.8. Stack the layers with nnx.vmap (a "
            "'layers' axis), or plan a named architecture.",
            ShardingWarning,
            stacklevel=2,
        )
    return leaves
