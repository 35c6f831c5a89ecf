"""What a traced loss does, read from its jaxpr before the step chooses its path.

The step traces the loss once (nothing runs) and looks at its primitives:

* Random draws. The manual data-parallel step runs each device's rows with the same key: a key
  in an ``nnx.Rngs`` stream, passed in the batch or closed over by the loss would give every
  device the same numbers for different rows, where one device (and XLA's partitioning of the
  whole batch) draws one per row. Any primitive of :data:`RANDOM_PRIMITIVES` draws bits.
* Expert dispatch. An expert-parallel layout shards expert weights over its expert axes; only
  code that sends the tokens to their experts (``all_to_all``, as
  :func:`substrax.spmd.experts` does) computes them there. Without it, XLA gathers the
  weights to compute.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax

__all__ = ["RANDOM_PRIMITIVES", "Traced", "trace"]

#: Primitives that draw random bits: typed-key draws (``random_bits``, what every
#: ``jax.random`` sampler lowers to), the raw threefry hash, and XLA's generators.
RANDOM_PRIMITIVES = frozenset({"random_bits", "threefry2x32", "rng_bit_generator", "rng_uniform"})


def _sub_jaxprs(value: Any) -> Iterator[Any]:
    """The jaxprs inside an equation's parameter (scan bodies, cond branches, calls)."""
    if isinstance(value, (tuple, list)):
        for item in value:
            yield from _sub_jaxprs(item)
    elif hasattr(value, "eqns"):
        yield value
    elif hasattr(getattr(value, "jaxpr", None), "eqns"):
        yield value.jaxpr


def _primitives(jaxpr: Any) -> Iterator[str]:
    for eqn in jaxpr.eqns:
        yield eqn.primitive.name
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                yield from _primitives(sub)


class Traced:
    """The primitives of one trace, nested jaxprs included.

    Args:
      primitives: Their names.
    """

    def __init__(self, primitives: frozenset[str]):
        self.primitives = primitives

    @property
    def random_draws(self) -> tuple[str, ...]:
        """The random-drawing primitives found, sorted (none: ``()``)."""
        return tuple(sorted(self.primitives & RANDOM_PRIMITIVES))

    @property
    def dispatches_tokens(self) -> bool:
        """Whether the trace moves tokens between devices with ``all_to_all``."""
        return "all_to_all" in self.primitives


def trace(fn: Callable[..., Any], *args: Any) -> Traced:
    """Traces ``fn(*args)`` (nothing is computed) and collects its primitives.

    Args:
      fn: A function of arrays.
      *args: Its arguments: arrays or ``jax.ShapeDtypeStruct``s.

    Returns:
      A :class:`Traced` over its jaxpr (``scan``, ``cond``, ``remat``, ``shard_map`` and
      custom-derivative bodies included).
    """
    closed = jax.make_jaxpr(fn)(*args)
    return Traced(frozenset(_primitives(closed.jaxpr)))
