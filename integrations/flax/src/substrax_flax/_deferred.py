"""Parameters gathered where the loss uses them: a scanned stack one layer at a time.

In the manual region each parameter is stored as this device's shard. Gathering every one
before the forward pass would hold the whole model, and its whole gradient, on every device:
a stacked parameter (a layer axis scanned by ``nnx.scan`` or ``jax.lax.scan``) is used one
layer per iteration, but gathered up front it is whole for all of them. Here the loss is traced
once, on the gathered shapes, and then run equation by equation: a stored shard flows through
the program unevaluated until an equation uses it. A scan that takes it as a scanned operand
(``xs``) receives the shard itself, and the layer's slice is gathered inside the loop body;
any other use gathers it there. The gather's gradient is its reduce-scatter
(:meth:`~substrax_flax._manual.Mover.gather`), so the backward loop reduce-scatters each layer's
gradient as it is computed: no device holds more than a layer of gathered parameters and
gradients beyond what the backward pass keeps (see ``gather="regather"``, which keeps none).

A shard whose layer axis is itself split over the region's axes cannot be sliced before it is
gathered; it is gathered before the loop, as is a scan's carried or constant operand. Other
higher-order equations (custom derivatives, loops other than scans) are run whole, their
shard operands gathered first; a ``jit`` equation is run inline so that a stack scanned inside
it is still gathered layer by layer, and a ``checkpoint`` region (a layer under remat) gathers
its parameters inside, so that it gathers them again when it is recomputed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.extend.core import Literal, primitives
from jax.sharding import NamedSharding, PartitionSpec

from substrax_flax._jaxpr import bind as _bind
from substrax_flax._jaxpr import trace

__all__ = ["Stored", "gathered_shapes", "run_gathering"]


@dataclasses.dataclass(frozen=True, eq=False)
class Stored:
    """A parameter as stored: its shard and the mover that gathers it (not a pytree).

    Attributes:
      shard: This device's shard (inside a scan: the current layer's slice of it).
      mover: Its :class:`~substrax_flax._manual.Mover`, for ``shard``'s rank.
    """

    shard: jax.Array
    mover: Any

    def sliceable(self) -> bool:
        """Whether the leading (layer) axis is whole on this device and where used."""
        m = self.mover
        specs = [m.spec, m.stored_spec, m.grad_spec]
        specs += [m.compute.spec] if m.compute is not None else []
        return self.shard.ndim > 0 and all(len(s) == 0 or s[0] is None for s in specs)

    def sliced_mover(self) -> Any:
        """The mover of one layer's slice: every spec without its leading entry."""
        m = self.mover
        compute = m.compute
        if compute is not None:
            compute = NamedSharding(compute.mesh, PartitionSpec(*compute.spec[1:]))
        return dataclasses.replace(
            m, spec=_tail(m.spec), stored_spec=_tail(m.stored_spec),
            grad_spec=_tail(m.grad_spec), compute=compute,
        )  # fmt: skip


def _tail(spec: PartitionSpec) -> PartitionSpec:
    return PartitionSpec(*spec[1:])


Gather = Callable[[Stored], jax.Array]


def run_gathering(
    fn: Callable[[Any], Any],
    stored: Any,
    movers: Any,
    gather: Gather,
    gathered_shapes: Any,
    regather: bool = False,
) -> Any:
    """``fn(gathered)`` where each parameter is gathered at its use, a stack layer by layer.

    Args:
      fn: A function of the gathered parameters (a pytree like ``stored``).
      stored: The parameters' shards.
      movers: A :class:`~substrax_flax._manual.Mover` per leaf of ``stored``.
      gather: ``gather(Stored) -> array``: the parameter at its point of use (gathered, laid
        out, cast); its gradient must be the reduce-scatter of the gathered gradient.
      gathered_shapes: ``jax.ShapeDtypeStruct``s of the gathered parameters.
      regather: Keep no gathered value for the backward pass: each equation that uses a
        parameter runs under ``jax.checkpoint`` with the gather, saving nothing but its
        operands (the shard among them), so the backward pass gathers the parameter again.

    Returns:
      What ``fn`` returns.
    """
    closed, out_tree = trace(fn, gathered_shapes)
    leaves = [Stored(x, m) for x, m in
              zip(jax.tree.leaves(stored), jax.tree.leaves(movers), strict=True)]  # fmt: skip
    outs = _run(closed.jaxpr, closed.consts, leaves, _Gathers(gather, regather))
    return jax.tree.unflatten(out_tree, outs)


@dataclasses.dataclass(frozen=True)
class _Gathers:
    gather: Gather
    regather: bool

    def __call__(self, x: Stored) -> jax.Array:
        return self.gather(x)


def gathered_shapes(gather_all: Callable[[Any], Any], stored: Any) -> Any:
    """The types of ``gather_all(stored)``, to trace the loss on, without gathering anything.

    Inside a manual region ``jax.eval_shape`` gives each its varying axes but no sharding, and
    tracing needs both: the context's mesh is added.
    """
    mesh = jax.sharding.get_abstract_mesh()

    def typed(s):
        manual = getattr(s, "manual_axis_type", None)
        if s.sharding is not None or manual is None or mesh.empty:
            return s
        sharding = NamedSharding(mesh, PartitionSpec())
        return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding,
                                    weak_type=s.weak_type, manual_axis_type=manual)  # fmt: skip

    return jax.tree.map(typed, jax.eval_shape(gather_all, stored))


def _run(jaxpr, consts, args, gather: _Gathers) -> list:
    """``jaxpr`` evaluated with :class:`Stored` values gathered where they are used."""
    env: dict = {}

    def raw(v):
        return v.val if isinstance(v, Literal) else env[v]

    def value(v):
        x = raw(v)
        if isinstance(x, Stored):
            x = gather(x)
            env[v] = x  # one gather per use site's scope, shared by later uses
        return x

    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        inputs = [raw(v) for v in eqn.invars]
        if not any(isinstance(x, Stored) for x in inputs):
            outs = _bind(eqn, inputs)
        elif eqn.primitive is primitives.scan_p:
            outs = _scan(eqn, inputs, gather)
        elif eqn.primitive is primitives.jit_p:
            inner = eqn.params["jaxpr"]
            outs = _run(inner.jaxpr, inner.consts, inputs, gather)
        elif eqn.primitive is primitives.remat_p:
            outs = _remat(eqn, inputs, gather)
        elif gather.regather:
            outs = _bind_regathered(eqn, inputs, gather)
        else:
            outs = _bind(eqn, [value(v) for v in eqn.invars])
        env.update(zip(eqn.outvars, outs, strict=True))
    return [value(v) for v in jaxpr.outvars]


def _bind_regathered(eqn, inputs: list, gather: _Gathers) -> list:
    """``eqn`` on its stored operands gathered, as one rematerialised step (see ``regather``)."""
    stored = [(i, x) for i, x in enumerate(inputs) if isinstance(x, Stored)]

    def use(shards):
        args = list(inputs)
        for (i, x), shard in zip(stored, shards, strict=True):
            args[i] = gather(Stored(shard, x.mover))
        return _bind(eqn, args)

    policy = jax.checkpoint_policies.nothing_saveable
    return jax.checkpoint(use, policy=policy)([x.shard for _, x in stored])


def _remat(eqn, inputs: list, gather: _Gathers) -> list:
    """A ``jax.checkpoint`` region (a remat'd layer) whose stored operands are gathered inside.

    Its policy then decides about the gathered values as about any other: a rematerialised
    layer gathers its parameters again in the backward pass, with its other recomputation.
    """
    p = eqn.params
    stored = [(i, x) for i, x in enumerate(inputs) if isinstance(x, Stored)]

    def region(shards):
        args = list(inputs)
        for (i, x), shard in zip(stored, shards, strict=True):
            args[i] = Stored(shard, x.mover)
        return _run(p["jaxpr"], [], args, gather)

    remat = jax.checkpoint(region, policy=p["policy"], prevent_cse=p["prevent_cse"])
    return remat([x.shard for _, x in stored])


def _scan(eqn, inputs: list, gather: _Gathers) -> list:
    """A scan whose scanned operands may be stored shards: each layer gathered in the body."""
    p = eqn.params
    n_consts, n_carry = p["num_consts"], p["num_carry"]

    def whole(x):
        return gather(x) if isinstance(x, Stored) else x

    consts = [whole(x) for x in inputs[:n_consts]]
    carry = [whole(x) for x in inputs[n_consts : n_consts + n_carry]]
    xs, movers = [], []
    for x in inputs[n_consts + n_carry :]:
        if isinstance(x, Stored) and x.sliceable():
            xs.append(x.shard)
            movers.append(x.sliced_mover())
        else:
            xs.append(whole(x))
            movers.append(None)
    body = p["jaxpr"]

    def step(carry, layer):
        layer = [x if m is None else Stored(x, m) for x, m in zip(layer, movers, strict=True)]
        outs = _run(body.jaxpr, body.consts, [*consts, *carry, *layer], gather)
        return outs[:n_carry], outs[n_carry:]

    carry, ys = jax.lax.scan(
        step, carry, xs, length=p["length"], reverse=p["reverse"], unroll=p["unroll"]
    )
    return [*carry, *ys]
