"""Tracing a function of pytrees to a jaxpr and binding its equations one by one.

The step's evaluators (:mod:`~substrax_flax._deferred`, which gathers parameters where they
are used, and :mod:`~substrax_flax._recompute`, which evaluates an update twice sharing its
scalars) replay a traced program equation by equation; these are the pieces they share.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax

try:  # each equation keeps the user's source line and name stack in the program's metadata
    from jax._src import source_info_util as _source_info
except ImportError:  # pragma: no cover - a jax without it: the program is the same, unnamed
    _source_info = None

__all__ = ["bind", "trace"]


def trace(fn: Callable[..., Any], *args: Any) -> tuple[jax.extend.core.ClosedJaxpr, Any]:
    """``fn(*args)`` traced: its closed jaxpr on the flattened ``args``, and its output tree.

    Args:
      fn: A function of pytrees.
      *args: Its arguments: arrays, tracers or ``jax.ShapeDtypeStruct``s.

    Returns:
      ``(closed jaxpr, output treedef)``; the jaxpr's inputs are ``args``' leaves.
    """
    leaves, tree = jax.tree.flatten(args)
    out_tree = []

    def flat(*leaves):
        out_leaves, treedef = jax.tree.flatten(fn(*jax.tree.unflatten(tree, list(leaves))))
        out_tree.append(treedef)
        return out_leaves

    closed = jax.make_jaxpr(flat)(*leaves)
    return closed, out_tree[0]


def bind(eqn, inputs: list) -> list:
    """``eqn``'s primitive bound to ``inputs`` in its own context; its outputs as a list."""
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = params if isinstance(params, tuple) else ((), params)  # older jax: a pair
    with _source(eqn), eqn.ctx.manager:  # the equation's context (its mesh, its compute kind)
        out = eqn.primitive.bind(*subfuns, *inputs, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _source(eqn) -> contextlib.AbstractContextManager:
    """The equation's own source location and name stack, as ``jax.core.eval_jaxpr`` keeps."""
    if _source_info is None:
        return contextlib.nullcontext()
    stack = _source_info.current_name_stack() + eqn.source_info.name_stack
    return _source_info.user_context(eqn.source_info.traceback, name_stack=stack)
