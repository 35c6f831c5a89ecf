"""``shard_map`` regions that layers enter themselves, inside or outside a step's region.

Layers that need collectives of their own (ring attention, expert dispatch) find the mesh axes
of their logical names under the active rules (:func:`free_axes`) and enter a region over them
on the mesh in context (:func:`region_mesh`): the whole mesh, or the abstract mesh of the
enclosing step's manual region.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax

from substrax.mesh._resolve import as_axes
from substrax.spmd._constrain import active_rules

__all__ = ["axes_size", "free_axes", "recomputed_region", "reduce_as", "region_mesh", "vary_as"]


def free_axes(name: str) -> tuple[str, ...]:
    """The mesh axes logical ``name`` maps to under the active rules, if not yet manual.

    Axes of size 1 and axes an enclosing ``shard_map`` made manual are left out; outside any
    :func:`~substrax.spmd.use_rules` context there are none.

    Args:
      name: A logical name (``"seq"``, ``"batch"``, ``"expert"``).

    Returns:
      The axes, in the rule's order.
    """
    active = active_rules()
    if active is None:
        return ()
    mesh, rules = active
    axes = as_axes(rules.as_dict().get(name))
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    return tuple(a for a in axes if dict(mesh.shape)[a] > 1 and a not in manual)


def axes_size(axes: tuple[str, ...]) -> int:
    """The devices ``axes`` of the active mesh span (1 for none)."""
    return math.prod(dict(active_rules()[0].shape)[a] for a in axes) if axes else 1


def region_mesh(axes: tuple[str, ...]) -> Any:
    """The mesh a region over ``axes`` is entered on: the context's, else the active rules'."""
    context = jax.sharding.get_abstract_mesh()
    return context if set(axes) <= set(context.axis_names) else active_rules()[0]


def recomputed_region(
    fn: Callable, mesh: Any, in_specs: tuple, out_specs: Any, axis_names: set[str]
) -> Callable:
    """``jax.shard_map(fn, ...)`` whose backward pass recomputes ``fn`` in a region of its own.

    Only the inputs are kept for the backward pass (as flash attention does), and no residual
    crosses the region's boundary: inside a region over other axes (substrax's manual
    data-parallel step), a nested region's residuals would be laid out over the enclosing
    region's manual axes, which XLA rejects.

    Args:
      fn: The per-device function of positional arrays.
      mesh: The mesh (the context's abstract mesh inside another region).
      in_specs: One spec per input.
      out_specs: The outputs' specs (a pytree of specs, as ``shard_map`` takes).
      axis_names: The axes the region makes manual.

    Returns:
      The function on global arrays, differentiable.
    """

    def backward_of(*args):
        inputs, cotangents = args[: len(in_specs)], args[len(in_specs)]
        return jax.vjp(fn, *inputs)[1](cotangents)

    @jax.custom_vjp
    def run(*inputs):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             axis_names=axis_names)(*inputs)  # fmt: skip

    def forward(*inputs):
        return run(*inputs), inputs

    def backward(inputs, cotangents):
        region = jax.shard_map(backward_of, mesh=mesh, in_specs=(*in_specs, out_specs),
                               out_specs=in_specs, axis_names=axis_names)  # fmt: skip
        return region(*inputs, cotangents)

    run.defvjp(forward, backward)
    return run


def vary_as(x: jax.Array, *likes: jax.Array, axes: tuple[str, ...] = ()) -> jax.Array:
    """``x`` marked varying over the manual axes ``likes`` vary over, and over ``axes``.

    A loop's initial carry (zeros) must vary as its body's output does inside ``shard_map``.
    """
    names = set(axes).union(*(jax.typeof(like).manual_axis_type.varying for like in likes))
    missing = tuple(sorted(names - set(jax.typeof(x).manual_axis_type.varying)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def reduce_as(cotangent: jax.Array, primal: jax.Array) -> jax.Array:
    """A custom VJP's cotangent summed over the manual axes it varies over and ``primal`` not.

    JAX's own transposes do this (a ``pvary``'s transpose is a ``psum``); a custom backward
    rule must do it itself, so that a weight's gradient is summed over the devices that
    used it.
    """
    have = jax.typeof(primal).manual_axis_type.varying
    extra = tuple(sorted(set(jax.typeof(cotangent).manual_axis_type.varying) - set(have)))
    return jax.lax.psum(cotangent, extra) if extra else cotangent
