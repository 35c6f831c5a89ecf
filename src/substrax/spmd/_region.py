"""``shard_map`` regions that layers enter themselves, inside or outside a step's region."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

__all__ = ["recomputed_region"]


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
