"""The loop of the split schedules (1F1B, interleaved, ZB-H1): one op per stage and tick.

Each tick, every stage looks up its op in the schedule's :class:`~substrax.pipeline._schedule.
Tables` and runs it in a ``lax.switch`` on its own index, so a stage computes only its op and an
idle stage computes nothing:

* forward: its chunk's layers on the microbatch, each layer through ``jax.vjp``; the
  pullbacks' residuals (less the layer's parameters, which stay where they are) go to a stash
  slot. The last virtual stage also takes the loss and its cotangent.
* backward: the layers' pullbacks in reverse for the input's gradient only (the parameters'
  products are dead code), sent to the stage before; each layer's output cotangent goes to a
  cotangent slot.
* weight: each layer's pullback on its stashed cotangent for the parameters' gradient only.

Values move between stages by one ``ppermute`` forward and one backward per tick, into ring
slots the tables assign, so memory follows what the schedule holds, not the microbatch count.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from substrax.pipeline._microbatch import computing
from substrax.pipeline._schedule import OPS
from substrax.spmd import checkpoint_policy

__all__ = ["run_split"]

_FIELDS = ("op", "microbatch", "chunk", "stash", "cotangent", "take", "loss_slot", "receive",
           "receive_grad")  # fmt: skip


class _Layer:
    """One layer as a forward that keeps its pullback's residuals, and its two backward halves.

    The pullback's leaves that are the layer's own parameters (or frozen parameters) are not
    stashed: the backward halves put the parameters back. Which leaves those are is read once,
    from an abstract trace, and checked on every trace.
    """

    def __init__(self, pipe, policy):
        self.pipe, self.policy = pipe, policy
        self.treedef, self.sources = None, None

    def apply(self, params, keep, x, frozen, index):
        args = params if frozen is None else (params, frozen)
        with computing(index):
            return jnp.where(keep, self.pipe.layer_fn(args, x), x)

    def forward(self, params, keep, x, frozen, index):
        """``(y, residuals)``: the layer's output and its pullback's stashed leaves."""
        apply = jax.checkpoint(self.apply, policy=self.policy) if self.policy else self.apply
        y, pullback = jax.vjp(lambda p, h: apply(p, keep, h, frozen, index), params, x)
        leaves, treedef = jax.tree.flatten(pullback)
        known = {id(leaf): ("params", i) for i, leaf in enumerate(jax.tree.leaves(params))}
        known.update({id(leaf): ("frozen", i) for i, leaf in enumerate(jax.tree.leaves(frozen))})
        sources = tuple(known.get(id(leaf), ("stash", None)) for leaf in leaves)
        if self.sources is None:
            self.treedef, self.sources = treedef, sources
        elif sources != self.sources or treedef.num_leaves != self.treedef.num_leaves:
            raise AssertionError("a layer's pullback changed structure between traces")
        return y, [leaf for leaf, (kind, _) in zip(leaves, sources, strict=True) if kind == "stash"]

    def pullback(self, params, frozen, residuals):
        """The layer's pullback, its parameters put back among the stashed residuals."""
        given = {"params": jax.tree.leaves(params), "frozen": jax.tree.leaves(frozen)}
        stashed = iter(residuals)
        leaves = [next(stashed) if kind == "stash" else given[kind][i]
                  for kind, i in self.sources]  # fmt: skip
        return jax.tree.unflatten(self.treedef, leaves)


def _add(grads: Any, chunk: jax.Array, dp: Any) -> Any:
    return jax.tree.map(lambda g, d: g.at[chunk].add(d), grads, dp)


def _chunk(tree: Any, chunk: jax.Array) -> Any:
    return jax.tree.map(lambda a: a[chunk], tree)


def _stage_forward(layer: _Layer, params, mask, x, frozen, index):
    """A chunk's layers in order: ``(y, residuals stacked over the layers)``."""

    def body(h, item):
        p, keep, fr = item
        return layer.forward(p, keep, h, fr, index)

    return jax.lax.scan(body, layer.pipe._varying(x), (params, mask, frozen))


def _stage_backward(layer: _Layer, params, frozen, residuals, dy):
    """The input's gradient through a chunk's layers, and each layer's output cotangent."""

    def body(cotangent, item):
        p, fr, res = item
        _, dx = layer.pullback(p, fr, res)(cotangent)
        return dx, cotangent

    return jax.lax.scan(body, layer.pipe._varying(dy), (params, frozen, residuals), reverse=True)


def _stage_weights(layer: _Layer, params, frozen, residuals, cotangents):
    """The parameters' gradient of a chunk's layers from their stashed output cotangents."""

    def body(_, item):
        p, fr, res, cotangent = item
        dp, _ = layer.pullback(p, fr, res)(cotangent)
        return None, dp

    return jax.lax.scan(body, None, (params, frozen, residuals, cotangents))[1]


def run_split(pipe, params, mask, xs, targets, head, frozen=None, *, dims, frozen_dims, scatter):
    """A split schedule's loss and gradients, inside the pipeline's ``shard_map``.

    Args:
      pipe: The :class:`~substrax.pipeline.Pipeline`.
      params: This stage's layers ``[1, R, Lc, ...]``, FSDP-sharded as stored.
      mask: Which of its slots are real layers.
      xs: The microbatches ``[M, rows, ...]``.
      targets: Their targets.
      head: The loss's parameters (or None).
      frozen: Layer parameters not differentiated (or None).
      dims: Each parameter's FSDP dimension (-1: none), to gather it once.
      frozen_dims: The same for ``frozen``.
      scatter: Each parameter's ``grad_dims`` entry (-1: all-reduce).

    Returns:
      ``((loss, aux), grads, head_grads, input_grads)``, each reduced once after the loop.
    """
    tables = pipe.timetable.tables()
    stages, micro, repeats = pipe.num_stages, pipe.num_microbatches, pipe.repeats
    last = stages * repeats - 1
    params = pipe._vary(jax.tree.map(lambda a: a[0], pipe._gather(params, dims)))
    frozen = jax.tree.map(lambda a: a[0], pipe._gather(frozen, frozen_dims))
    head, mask = pipe._varying(head), mask[0]
    stage = jax.lax.axis_index(pipe.stage_axis)
    layer = _Layer(pipe, checkpoint_policy(pipe.remat))
    forward_pattern = [(s, (s + 1) % stages) for s in range(stages)]
    backward_pattern = [(s, (s - 1) % stages) for s in range(stages)]
    if repeats == 1:
        forward_pattern = pipe.strategy.get_forward_communication_pattern()
        backward_pattern = pipe.strategy.get_backward_communication_pattern()

    sample = xs[0]
    probe = jax.eval_shape(
        lambda p, fr, h: _stage_forward(layer, p, mask[0], h, fr, jnp.int32(0)),
        _chunk(params, 0), _chunk(frozen, 0), sample,
    )  # fmt: skip
    depths = tables.depths

    def buffer(depth, like):
        return jnp.zeros((depth + 1, *like.shape), like.dtype)

    stash = [buffer(depths["stash"], r) for r in probe[1]]
    cot_like = jax.ShapeDtypeStruct((mask.shape[1], *sample.shape), sample.dtype)
    aux_zero = pipe._aux_zeros(sample, targets[0], head)

    def no_grads():
        return pipe._varying(jax.tree.map(lambda g: jnp.zeros(g.shape[1:], g.dtype), params))

    def outputs(y=None, residuals=None, loss=None, aux=None, dhead=None, dy=None, dx=None,
                cotangents=None):  # fmt: skip
        """A branch's results, zeros where the branch has none (every branch returns all)."""
        zero = jnp.zeros_like(sample)
        out = (
            zero if y is None else y,
            [jnp.zeros(r.shape, r.dtype) for r in probe[1]] if residuals is None else residuals,
            jnp.zeros((), jnp.float32) if loss is None else loss,
            aux_zero if aux is None else aux,
            jax.tree.map(jnp.zeros_like, head) if dhead is None else dhead,
            zero if dy is None else dy,
            zero if dx is None else dx,
            jnp.zeros(cot_like.shape, cot_like.dtype) if cotangents is None else cotangents,
        )
        return pipe._varying(out)

    def tick(carry, row):
        arrived, arrived_grad, acts, grad_in, stash, cots, grads, dhead, dxs, total, aux = carry
        op, m, c, slot, cot_slot, take, loss_slot, receive, receive_grad = (
            row[f][stage] for f in _FIELDS
        )
        k = c * stages + stage
        acts = acts.at[receive].set(arrived)
        grad_in = grad_in.at[receive_grad].set(arrived_grad)

        def idle():
            return outputs(), no_grads()

        def forward():
            x = jnp.where(k == 0, xs[m], acts[take])
            y, res = _stage_forward(layer, _chunk(params, c), mask[c], x, _chunk(frozen, c), m)

            def with_loss(y):
                grad_fn = jax.value_and_grad(pipe._loss, argnums=(0, 2), has_aux=True)
                (loss, extra), (dy, dh) = grad_fn(y, targets[m], head, m)
                dh = jax.tree.map(lambda d: d / micro, dh)
                return pipe._varying((loss, extra, dh, (dy / micro).astype(y.dtype)))

            def without(y):
                zero_head = jax.tree.map(jnp.zeros_like, head)
                return pipe._varying(
                    (jnp.zeros((), jnp.float32), aux_zero, zero_head, jnp.zeros_like(y))
                )

            loss, extra, dh, dy = jax.lax.cond(k == last, with_loss, without, y)
            return outputs(y=y, residuals=res, loss=loss, aux=extra, dhead=dh, dy=dy), no_grads()

        def backward():
            res = [r[slot] for r in stash]
            dx, cotangents = _stage_backward(
                layer, _chunk(params, c), _chunk(frozen, c), res, grad_in[take]
            )
            return outputs(dx=dx, cotangents=cotangents), no_grads()

        def weight():
            res = [r[slot] for r in stash]
            dp = _stage_weights(layer, _chunk(params, c), _chunk(frozen, c), res, cots[cot_slot])
            return outputs(), pipe._varying(dp)

        branches = {"idle": idle, "forward": forward, "backward": backward, "weight": weight}
        out, dp = jax.lax.switch(op, [branches[name] for name in OPS])
        # added only on a weight tick: the accumulator stays out of the switch, which would
        # copy it (a stage's parameters' bytes of temp memory)
        grads = jax.lax.cond(op == OPS.index("weight"), lambda g: _add(g, c, dp), lambda g: g,
                             grads)  # fmt: skip
        y, res, loss, extra, dh, dy, dx, cotangents = out
        is_forward, is_backward = op == OPS.index("forward"), op == OPS.index("backward")
        # writes with nothing to keep go to each buffer's spare slot (its last)
        stash_at = jnp.where(is_forward, slot, depths["stash"])
        stash = [r.at[stash_at].set(v) for r, v in zip(stash, res, strict=True)]
        grad_in = grad_in.at[jnp.where(is_forward, loss_slot, depths["gradient"])].set(dy)
        cots = cots.at[jnp.where(is_backward, cot_slot, depths["cotangent"])].set(cotangents)
        dxs = dxs.at[jnp.where(is_backward & (k == 0), m, micro)].set(dx)
        total, dhead = total + loss, jax.tree.map(jnp.add, dhead, dh)
        aux = jax.tree.map(jnp.add, aux, extra)
        sent = jax.lax.ppermute(pipe._boundary(y), pipe.stage_axis, forward_pattern)
        sent_back = jax.lax.ppermute(pipe._boundary(dx), pipe.stage_axis, backward_pattern)
        return (sent, sent_back, acts, grad_in, stash, cots, grads, dhead, dxs, total, aux), None

    zero = jnp.zeros_like(sample)
    carry = (
        zero, zero, buffer(depths["activation"], sample), buffer(depths["gradient"], sample),
        stash, buffer(depths["cotangent"], cot_like), jax.tree.map(jnp.zeros_like, params),
        jax.tree.map(jnp.zeros_like, head), buffer(micro, sample), jnp.zeros((), jnp.float32),
        aux_zero,
    )  # fmt: skip
    rows = {f: jnp.asarray(getattr(tables, f)) for f in _FIELDS}
    final, _ = jax.lax.scan(tick, pipe._varying(carry), rows)
    grads, dhead, dxs, total, aux = final[6:]
    used = pipe._read_by_loss(sample, targets[0], head)
    return pipe._split_results(grads, dhead, dxs[:micro], total, aux, scatter, lead=2, used=used)
