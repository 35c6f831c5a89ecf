"""A function evaluated twice, the second time reusing the first's scalars.

The non-finite guard computes the update once for its check and again in the branch that
commits it (:func:`~substrax_flax._jitted.guarded_update`): recomputing the elementwise work
is what keeps the updated state from being held beside the old one until the check is known.
But an update also computes scalars: ``optax.clip_by_global_norm``'s norm, a schedule's
learning rate, the step count. Computed again, the norm reads every gradient once more and,
on a sharded gradient, all-reduces once more (a second rendezvous of every device). Here the
update is traced once; its first evaluation records each value without dimensions, and the
second takes them from it instead of computing them: inside ``lax.cond`` they arrive as the
branch's operands, so the compiled program reduces once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.extend.core import Literal

from substrax_flax._jaxpr import bind, trace

__all__ = ["twice"]


def twice(fn: Callable[..., Any], *args: Any) -> tuple[Any, Callable[..., Any]]:
    """``fn(*args)``, and ``again`` that computes it once more sharing its scalars.

    ``again`` must be called with values equal to ``args`` (as a ``lax.cond`` branch gets its
    operands): each equation whose every output is a scalar takes them from the first
    evaluation, the rest is computed again. An equation with effects is always computed again.

    Args:
      fn: A function of pytrees, such as an optimizer's update.
      *args: Its arguments.

    Returns:
      ``(fn(*args), again)``, ``again(*args) == fn(*args)``.
    """
    closed, out_tree = trace(fn, *args)
    scalars: dict = {}
    first = _evaluate(closed, jax.tree.leaves(args), {}, record=scalars)

    def again(*args: Any) -> Any:
        return jax.tree.unflatten(out_tree, _evaluate(closed, jax.tree.leaves(args), scalars))

    return jax.tree.unflatten(out_tree, first), again


def _evaluate(closed, args: list, shared: dict, record: dict | None = None) -> list:
    """The jaxpr's outputs on ``args``; scalars from ``shared``, or recorded in ``record``."""
    jaxpr = closed.jaxpr
    env = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    for eqn in jaxpr.eqns:
        if eqn.outvars and all(v in shared for v in eqn.outvars):
            outs = [shared[v] for v in eqn.outvars]
        else:
            outs = bind(eqn, [read(v) for v in eqn.invars])
            if record is not None and _scalars(eqn):
                record.update(zip(eqn.outvars, outs, strict=True))
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def _scalars(eqn) -> bool:
    """Whether every output of ``eqn`` is a scalar and it has no effect."""
    return not eqn.effects and all(v.aval.shape == () for v in eqn.outvars)
