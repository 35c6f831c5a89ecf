"""What a traced loss does, read from its jaxpr before the step chooses its path.

The step traces the loss once (nothing runs) and looks at its primitives:

* Random draws. The manual data-parallel step runs each device's rows on its own: a key passed
  in the batch or closed over by the loss would give every device the same numbers for
  different rows, where one device (and XLA's partitioning of the whole batch) draws one per
  row. Any primitive of :data:`RANDOM_PRIMITIVES` draws bits. Draws whose key derives from a
  model's ``nnx.Rngs`` stream are told apart (the *stream* keys, followed through the jaxpr):
  the manual step draws one device's numbers from those keys, each device computing its rows'
  share (:mod:`substrax_flax._streams`, which pairs the draws' shapes, :attr:`Traced.draw_shapes`).
* Shardings that name mesh axes. Inside the manual step the batch axes are manual, and a
  sharding in model code that names one (``with_sharding_constraint(x, P("data"))``) cannot
  be traced there; the step traces the loss with substrax's own rules already stripped of the
  batch axes, so any batch axis still named (:attr:`Traced.named_axes`) is the model's.
* State computed from the batch. The loss returns the model's other state (batch
  statistics, counters, sown intermediates); in the manual step each device computes it from
  its own rows, so a value that depends on the batch would differ between devices
  (:attr:`Traced.from_batch`, for each output, followed through the jaxpr from the batch).
* Expert dispatch. An expert-parallel layout shards expert weights over its expert axes; only
  code that sends the tokens to their experts (``all_to_all``, as
  :func:`substrax.spmd.experts` does) computes them there. Without it, XLA gathers the
  weights to compute.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
from jax.sharding import PartitionSpec

from substrax.mesh import as_axes

__all__ = ["RANDOM_PRIMITIVES", "Traced", "is_key", "trace"]

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


def _draw_shapes(jaxpr: Any) -> Iterator[tuple[int, ...]]:
    """The ``shape`` of every ``random_bits`` equation (one key's draw), in trace order."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "random_bits":
            yield tuple(eqn.params["shape"])
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                yield from _draw_shapes(sub)


def _sub_inputs(eqn: Any, sub: Any, index: int, marked: list[bool]) -> list[bool]:
    """Which of ``sub``'s inputs carry a stream key, from the equation's (``marked``).

    Where the correspondence is not known for sure, none does: a draw is then counted as
    foreign, which keeps the exact path (never the reverse).
    """
    n = len(sub.invars)
    if eqn.primitive.name == "while":
        cond, body = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
        inputs = marked[:cond] + marked[cond + body :] if index == 0 else marked[cond:]
    elif eqn.primitive.name == "cond":
        inputs = marked[1:]
    else:
        inputs = marked
    return inputs if len(inputs) == n else [False] * n


def _foreign(jaxpr: Any, marked: list[bool]) -> tuple[list[str], list[bool]]:
    """The random draws of ``jaxpr`` whose key is not a stream key, and its outputs' marks.

    Args:
      jaxpr: A jaxpr.
      marked: For each input, whether it carries a stream key.

    Returns:
      The foreign draws' primitive names, and for each output whether it carries one.
    """
    keyed = {v for v, m in zip(jaxpr.invars, marked, strict=True) if m}

    def carries(v: Any) -> bool:
        return not hasattr(v, "val") and v in keyed  # literals carry nothing

    found: list[str] = []
    for eqn in jaxpr.eqns:
        ins = [carries(v) for v in eqn.invars]
        subs = [sub for value in eqn.params.values() for sub in _sub_jaxprs(value)]
        if eqn.primitive.name in RANDOM_PRIMITIVES and not any(ins):
            found.append(eqn.primitive.name)
        outs = [any(ins)] * len(eqn.outvars) if not subs else [False] * len(eqn.outvars)
        for index, sub in enumerate(subs):
            draws, sub_outs = _foreign(sub, _sub_inputs(eqn, sub, index, ins))
            found += draws
            if len(sub_outs) == len(outs):
                outs = [a or b for a, b in zip(outs, sub_outs, strict=True)]
        keyed.update(v for v, m in zip(eqn.outvars, outs, strict=True) if m)
    return found, [carries(v) for v in jaxpr.outvars]


def _sequence_slices(jaxpr: Any, rows: list[bool]) -> list[str]:
    """Slices of a batch input along its second dimension (the sequence), as written.

    Only slices of the batch's own leaves are found (``batch["tokens"][:, 1:]``), which is how
    a loss shifts its targets.
    """
    batch = {v for v, m in zip(jaxpr.invars, rows, strict=True) if m}
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name != "slice" or eqn.invars[0] not in batch:
            continue
        shape = eqn.invars[0].aval.shape
        start, limit = eqn.params["start_indices"], eqn.params["limit_indices"]
        if len(shape) >= 2 and (start[1], limit[1]) != (0, shape[1]):
            found.append(f"[:, {start[1] or ''}:{'' if limit[1] == shape[1] else limit[1]}]")
    return found


def _spec_axes(value: Any) -> Iterator[str]:
    """The mesh axes a sharding-valued parameter names (a ``NamedSharding`` or a spec)."""
    if isinstance(value, (tuple, list)):
        for item in value:
            yield from _spec_axes(item)
        return
    spec = value if isinstance(value, PartitionSpec) else getattr(value, "spec", None)
    if isinstance(spec, PartitionSpec):
        for entry in spec:
            if entry is not PartitionSpec.UNCONSTRAINED:
                yield from as_axes(entry)


def _named_axes(jaxpr: Any) -> Iterator[tuple[str, str]]:
    """``(primitive, axis)`` for every mesh axis a sharding parameter names, nested included."""
    for eqn in jaxpr.eqns:
        for value in eqn.params.values():
            for axis in _spec_axes(value):
                yield eqn.primitive.name, axis
            for sub in _sub_jaxprs(value):
                yield from _named_axes(sub)


class Traced:
    """The primitives of one trace, nested jaxprs included.

    Args:
      primitives: Their names.
      foreign_draws: The random-drawing primitives whose key is not a stream key.
      named: ``(primitive, mesh axis)`` for each mesh axis a sharding in the trace names.
      from_batch: For each output leaf, whether its value depends on the batch (empty when
        the trace was not told which inputs are the batch).
      sequence_slices: The slices of batch leaves along their sequence (second) dimension,
        as written (``"[:, 1:]"``).
      draw_shapes: The shape of each key's ``random_bits`` draw, in trace order (what
        :func:`substrax_flax._streams.row_draws` pairs across two batch sizes).
    """

    def __init__(
        self,
        primitives: frozenset[str],
        foreign_draws: tuple[str, ...] = (),
        named: frozenset[tuple[str, str]] = frozenset(),
        from_batch: tuple[bool, ...] = (),
        sequence_slices: tuple[str, ...] = (),
        draw_shapes: tuple[tuple[int, ...], ...] = (),
    ):
        self.primitives = primitives
        self.foreign_draws = tuple(sorted(set(foreign_draws)))
        self.named = named
        self.from_batch = tuple(from_batch)
        self.sequence_slices = tuple(sequence_slices)
        self.draw_shapes = tuple(draw_shapes)

    def naming(self, axes: Iterable[str]) -> tuple[str, ...]:
        """The primitives whose shardings name any of ``axes``, sorted (none: ``()``)."""
        axes = set(axes)
        return tuple(sorted({primitive for primitive, axis in self.named if axis in axes}))

    @property
    def random_draws(self) -> tuple[str, ...]:
        """The random-drawing primitives found, sorted (none: ``()``)."""
        return tuple(sorted(self.primitives & RANDOM_PRIMITIVES))

    @property
    def dispatches_tokens(self) -> bool:
        """Whether the trace moves tokens between devices with ``all_to_all``."""
        return "all_to_all" in self.primitives


def is_key(leaf: Any) -> bool:
    """Whether ``leaf`` is a typed PRNG key array (what an ``nnx.Rngs`` stream holds)."""
    return jax.dtypes.issubdtype(getattr(leaf, "dtype", None), jax.dtypes.prng_key)


def trace(fn: Callable[..., Any], *args: Any, streams: Any = None, batch: Any = None) -> Traced:
    """Traces ``fn(*args)`` (nothing is computed) and collects its primitives.

    Args:
      fn: A function of arrays.
      *args: Its arguments: arrays or ``jax.ShapeDtypeStruct``s.
      streams: A pytree like ``args`` of bools: True marks a stream key, whose draws (and
        the draws of keys derived from it) are not foreign. None marks nothing.
      batch: A pytree like ``args`` of bools: True marks the batch, whose dependents
        :attr:`Traced.from_batch` follows to the outputs. None: not followed.

    Returns:
      A :class:`Traced` over its jaxpr (``scan``, ``cond``, ``remat``, ``shard_map`` and
      custom-derivative bodies included).
    """
    closed = jax.make_jaxpr(fn)(*args)
    marked = jax.tree.leaves(streams) if streams is not None else []
    if len(marked) != len(closed.jaxpr.invars):
        marked = [False] * len(closed.jaxpr.invars)
    draws, _ = _foreign(closed.jaxpr, [bool(m) for m in marked])
    named = frozenset(_named_axes(closed.jaxpr))
    from_batch: list[bool] = []
    slices: list[str] = []
    rows = [bool(m) for m in jax.tree.leaves(batch)] if batch is not None else []
    if len(rows) == len(closed.jaxpr.invars):  # the same forward marking, from the batch
        from_batch = _foreign(closed.jaxpr, rows)[1]
        slices = _sequence_slices(closed.jaxpr, rows)
    return Traced(frozenset(_primitives(closed.jaxpr)), tuple(draws), named, tuple(from_batch),
                  tuple(slices), tuple(_draw_shapes(closed.jaxpr)))  # fmt: skip
