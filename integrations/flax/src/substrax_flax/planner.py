"""Plan your own Flax NNX model, and check the planner's estimates against compiled twins.

    python -m substrax_flax.planner --factory my_model:make --devices 64 --memory 80GB \
        --batch-tokens 1M --seq 2048

takes every option of ``python -m substrax.planner`` (:func:`substrax.planner.main`) and adds
``--factory module:function``: the model is built abstractly (:func:`model_leaves`) and its
annotated parameters are planned. :func:`validate` compiles a scaled-down twin of a planned
candidate through the adapter's default path (:func:`substrax_flax.plan_model` with the
candidate's layout, :func:`substrax_flax.make_train_step` without compute rules) and puts
XLA's figures next to the estimate.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from substrax import ShardingWarning, warn_user
from substrax.hlo import compiled_flops, peak_bytes, traffic_by_kind
from substrax.layout import Layout
from substrax.planner import (
    ARCHITECTURES,
    Hardware,
    Leaf,
    Plan,
    TransformerConfig,
    Workload,
    architecture,
    evaluate,
    inferred_width,
)
from substrax.planner import main as planner_main
from substrax.planner import transformer_leaves as leaves_of
from substrax.spmd import attention, experts, native_grouped_matmul
from substrax.target import CompileTarget
from substrax_flax._compile import CompileRefused, compile_for
from substrax_flax._create import plan_model
from substrax_flax._optimizer import create_sharded_optimizer
from substrax_flax._pipeline_step import Stages
from substrax_flax._probes import cheap_sharding_probes
from substrax_flax._remat import remat
from substrax_flax._report import sharding_report
from substrax_flax._state import layer_kinds, logical_names, shape_and_dtype, variables
from substrax_flax._train import make_train_step

__all__ = ["main", "model_leaves", "validate"]


def model_leaves(factory: Callable[[], nnx.Module]) -> list[Leaf]:
    """The parameters of the model ``factory`` builds, as the planner's leaves.

    The model is built abstractly (``nnx.eval_shape``, eager sharding off), in time linear in
    its depth (:func:`~substrax_flax._probes.cheap_sharding_probes`: 2.8 s for 126 unstacked
    layers, where a plain ``nnx.eval_shape`` took 30.7 s; ``benchmarks/tracing.py``).

    Args:
      factory: A function of no arguments that builds the model.

    Returns:
      One :class:`substrax.planner.Leaf` per ``nnx.Param``, with the kind of layer that
      holds it; unannotated dimensions are None (the layout's strategy plans those, as the
      adapter shards them).
    """
    with nnx.use_eager_sharding(False), cheap_sharding_probes():
        model = nnx.eval_shape(factory)
        state, kinds = nnx.state(model, nnx.Param), layer_kinds(model)
    leaves = []
    for path, variable in variables(state):
        shape, _ = shape_and_dtype(variable)
        names = logical_names(variable, path) or (None,) * len(shape)
        leaves.append(Leaf(path, shape, tuple(names), kinds.get(path)))
    width = inferred_width(leaves)
    if not any("embed" in leaf.names for leaf in leaves) and width is not None:
        warn_user(
            "The model names no 'embed' dimension, so the planner takes its width to be "
            f"{width}, the commonest dimension of its matrices, for activations and FLOPs; "
            "its unannotated parameters are planned as the layout's strategy shards them."
        )
    return leaves


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``python -m substrax.planner``'s, plus ``--factory``.

    Args:
      argv: The arguments (``sys.argv[1:]`` when None).

    Returns:
      The exit status: 0, or 2 for bad input (one line on stderr).
    """
    return planner_main(argv, load_factory=model_leaves, prog="python -m substrax_flax.planner")


def _twin_layout(layout: Layout, devices: int) -> Layout:
    """The layout scaled down to at most ``devices`` devices, keeping each kind of parallelism.

    tp, cp, ep, fsdp and dp become at most 2, 2, 2, 4 and 2 (while they fit), each above 1
    where the original's is; a ZeRO layout stays one.

    A pipeline layout becomes ``pp 2`` and its data axes (``dp``, ``fsdp``, ZeRO) on the
    other devices.

    Raises:
      ValueError: For a pipeline layout with tensor, context or expert parallelism.
    """
    if layout.pp > 1:
        if max(layout.tp, layout.cp, layout.ep) > 1:
            raise ValueError(
                f"validate twins pipeline layouts over dp, fsdp or ZeRO, not {layout.label}."
            )
        rest = devices // 2
        fsdp = min(layout.fsdp, rest)
        dp = min(layout.dp, max(rest // fsdp, 1))
        return Layout.from_degrees(pp=2, dp=dp, fsdp=fsdp, zero=layout.zero if dp > 1 else 0)
    tp, cp, ep = min(layout.tp, 2), min(layout.cp, 2), min(layout.ep, 2)
    inner = tp * cp * ep
    fsdp = min(layout.fsdp, max(devices // (inner * 2 if layout.dp > 1 else inner), 1), 4)
    dp = min(layout.dp, max(devices // (inner * fsdp), 1), 2)
    zero = layout.zero if dp > 1 else 0
    return Layout.from_degrees(dp=dp, fsdp=fsdp, ep=ep, cp=cp, tp=tp, zero=zero)


def _twin_config(config: TransformerConfig) -> TransformerConfig:
    grouped = config.kv_heads < config.heads
    return dataclasses.replace(
        config, layers=2, d_model=64, heads=4, kv_heads=2 if grouped else 4, head_dim=16,
        ffn=128, vocab=256, positions=16 if config.positions else 0,
        experts=4 if config.experts else 0,
    )  # fmt: skip


class _Twin(nnx.Module):
    """A decoder built from the planner's leaves, with their logical names as annotations."""

    def __init__(self, config: TransformerConfig, rngs: nnx.Rngs):
        self.config = config
        self.params = nnx.Dict({
            leaf.path.replace("/", "__"): _param(leaf, rngs) for leaf in leaves_of(config)
        })  # fmt: skip

    def _p(self, name: str) -> jax.Array:
        return self.params[name.replace("/", "__")][...]

    def __call__(self, tokens: jax.Array) -> jax.Array:
        c = self.config
        x = _embed(c, self._p, tokens)
        names = [n for n in self.params if n.startswith("layers__")]
        stacked = {n.removeprefix("layers__"): self.params[n][...] for n in names}
        for i in range(c.layers):  # unrolled: XLA's cost analysis counts a loop body once
            x = _layer_of(c, {k: v[i] for k, v in stacked.items()}, x)
        return _logits(c, self._p, x)


def _param(leaf: Leaf, rngs: nnx.Rngs, dtype: Any = jnp.float32) -> nnx.Param:
    """A twin's parameter: small random values, the leaf's logical names as annotation."""
    value = jax.random.normal(rngs.params(), leaf.shape, dtype) * 0.05
    return nnx.Param(value, out_sharding=leaf.names)


def _embed(c: TransformerConfig, p: Callable[[str], jax.Array], tokens: jax.Array) -> jax.Array:
    """The token embeddings (and learned positions) of ``tokens``; ``p(name)`` a parameter."""
    x = jnp.take(p("embedding"), tokens, axis=0)
    return x + p("positions")[: tokens.shape[1]] if c.positions else x


def _logits(c: TransformerConfig, p: Callable[[str], jax.Array], x: jax.Array) -> jax.Array:
    """The final norm and the output head (the embedding, transposed, when tied)."""
    return _norm(x, p("norm")) @ (p("embedding").T if c.tied else p("head"))


def _layer_of(c: TransformerConfig, p: dict, x: jax.Array, block: int | None = None) -> jax.Array:
    """One decoder layer of ``c`` with parameters ``p`` (one slice of the stack).

    ``block``: attention in flash attention's blocks of that size (no score square kept),
    as the planner assumes on hardware with a flash kernel; None for whole rows.
    """
    h = _norm(x, p["attn_norm"])
    q = jnp.einsum("bte,ehk->bthk", h, p["wq"])
    k = jnp.einsum("bte,ehk->bthk", h, p["wk"])
    v = jnp.einsum("bte,ehk->bthk", h, p["wv"])
    if c.biases:
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    out = attention(q, k, v, causal=True, block=block)  # a ring where the sequence is split
    x = x + jnp.einsum("bthk,hke->bte", out, p["wo"])
    if c.experts:
        out, _ = experts(
            _norm(x, p["mlp_norm"]), p["router"], p["w_in"], p["w_out"],
            w_gate=p.get("w_gate"), top_k=c.top_k, activation=jax.nn.silu,
        )  # fmt: skip
        return x + out
    h = _norm(x, p["mlp_norm"]) @ p["w_in"]
    h = jax.nn.silu(_norm(x, p["mlp_norm"]) @ p["w_gate"]) * h if c.gated else jax.nn.gelu(h)
    return x + h @ p["w_out"]


class _StackedTwin(nnx.Module):
    """The twin with its layers stacked under ``layers`` (attention in ``block``s, if given)."""

    def __init__(
        self,
        config: TransformerConfig,
        rngs: nnx.Rngs,
        dtype: Any = jnp.float32,
        block: int | None = None,
    ):
        leaves = leaves_of(config)
        self.config = config
        self.params = nnx.Dict({
            leaf.path: _param(leaf, rngs, dtype)
            for leaf in leaves
            if not leaf.path.startswith("layers/")
        })  # fmt: skip
        self.layers = nnx.Dict({
            leaf.path.removeprefix("layers/"): _param(leaf, rngs, dtype)
            for leaf in leaves
            if leaf.path.startswith("layers/")
        })  # fmt: skip
        self.scan = _Scan(config, block)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """The logits, the layers run by ``lax.scan`` (one compiled layer, as at real size)."""
        x = _embed(self.config, lambda n: self.params[n][...], tokens)
        stacked = {name: v[...] for name, v in self.layers.items()}
        x, _ = jax.lax.scan(lambda x, p: (self.scan.layer(p, x).astype(x.dtype), None), x, stacked)
        return _logits(self.config, lambda n: self.params[n][...], x)


class _Scan(nnx.Module):
    """One layer of the stacked twin, marked for the step's remat policy."""

    def __init__(self, config: TransformerConfig, block: int | None = None):
        self.config = config
        self.block = block

    @remat
    def layer(self, p: dict, x: jax.Array) -> jax.Array:
        return _layer_of(self.config, p, x, self.block)


def _pipeline_step(
    config: TransformerConfig, layout: Layout, microbatches: int, schedule: str,
    mesh: Any = None, block: int | None = None, **options: Any,
) -> Any:  # fmt: skip
    """The pipelined twin's step: embedding, one stacked layer, and the head's loss."""

    def embed(model: _StackedTwin, batch: dict) -> tuple[jax.Array, jax.Array]:
        return _embed(config, lambda n: model.params[n][...], batch["inputs"]), batch["targets"]

    def layer(one: nnx.Dict, x: jax.Array) -> jax.Array:
        return _layer_of(config, {name: v[...] for name, v in one.items()}, x, block)

    def head(model: _StackedTwin, y: jax.Array, targets: jax.Array) -> jax.Array:
        logits = _logits(config, lambda n: model.params[n][...], y)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    return make_train_step(
        Stages(embed, layer, head, stack="layers", schedule=schedule),
        mesh if mesh is not None else layout.make_mesh(), layout=layout,
        microbatches=microbatches, **options,
    )  # fmt: skip


def _norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def _loss(model: _Twin, batch: dict) -> jax.Array:
    logits = model(batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def validate(
    plan: Plan, rank: int = 0, *, devices: int | None = None, target: str | None = None
) -> dict[str, Any]:
    """Compiles one of ``plan``'s candidates and puts the compiler's figures beside the estimate.

    With ``target`` (a TPU slice, ``"v5p-64"``), the candidate itself is compiled for it by the
    real TPU compiler at the model's real size (:func:`~substrax_flax.compile_for`, no TPU
    needed): the architecture's parameters stacked over its layers (run by ``lax.scan``), in
    the workload's precision, with its remat policy, microbatches and schedule, trained with
    adamw through the default step; where the plan's hardware profile assumes a flash
    kernel, attention runs in flash attention's blocks of 512
    (:func:`substrax.spmd.attention` with ``block``), so no score square is kept, as the
    estimate counts it.

    Without, a scaled-down twin is compiled on the available devices: it keeps the
    architecture's kinds of layer (grouped-query attention, gating, tied head, biases) at a
    small size and the candidate layout's kinds of parallelism; it is planned with the twin
    layout and its training step (adamw in f32, :func:`~substrax_flax.make_train_step`'s
    default path: no compute rules, each parameter gathered once per step) is compiled for
    its abstract model (:meth:`~substrax_flax.ModelPlan.abstract_model`): nothing is
    initialised or run, as with ``target``.

    Args:
      plan: A plan of a built-in architecture (:func:`substrax.planner.plan`).
      rank: Which candidate (0: the best).
      devices: Devices for the twin; all available when None.
      target: A TPU slice of the plan's device count to compile the candidate for at real
        size (:meth:`substrax.target.CompileTarget.parse`), or None for the twin.

    Returns:
      ``{"candidate": ..., "twin": ..., "state_bytes": ..., "arguments_bytes": ...,
      "flops": ..., "traffic_bytes": ..., "peak_bytes": ...}``: the candidate's label, the
      twin's layout (with ``"data_parallel"``, the path its default step takes), and each
      figure an ``(estimate, compiled)`` pair per device; the compiled step is donated, as
      substrax runs it. For a target, ``"target"``, ``"layout"`` and ``"data_parallel"``
      replace ``"twin"``, with ``"compile_seconds"``, ``"host_bytes"`` (remat
      ``"offload"``'s share in the host's memory); the compiled peak is what XLA:TPU
      allocates, its heap peak (:class:`~substrax_flax.ProgramMemory`). Where the compiler
      refuses the candidate (it needs more memory than the chip has), it has ``"refused"``
      (the compiler's words) and the estimated peak beside None instead of the figures.

    Raises:
      ValueError: For a plan of a custom model, a rank out of range, a twin of a pipeline
        layout with tensor, context or expert parallelism, or a target of another size.
    """
    if plan.model not in ARCHITECTURES:
        raise ValueError(
            f"Only built-in architectures can be twinned, not {plan.model!r}; choose one of "
            f"{', '.join(ARCHITECTURES)}."
        )
    if not 0 <= rank < len(plan.candidates):
        raise ValueError(f"rank {rank} is out of range: the plan has {len(plan.candidates)}.")
    candidate = plan.candidates[rank]
    if target is not None:
        result = _validate_on_target(architecture(plan.model), candidate, target)
        return {"candidate": candidate.layout.label, **result}
    schedule = (candidate.workload.schedule if candidate.workload else None) or "zb-h1"
    result = _validate_layout(architecture(plan.model), candidate.layout, devices=devices,
                              schedule=schedule)  # fmt: skip
    return {"candidate": candidate.layout.label, **result}


def _validate_layout(
    config: TransformerConfig,
    layout: Layout,
    *,
    devices: int | None = None,
    precision: str = "f32",
    schedule: str = "zb-h1",
) -> dict[str, Any]:
    """The comparison of :func:`validate` for one layout of ``config``.

    With ``precision="mixed"`` the twin's step runs ``precision="mixed"``, and its traffic is
    read off the lowered program (XLA's CPU compiler widens bf16 collectives to f32). A
    pipelined twin runs ``schedule`` with one chunk per stage (its stages hold 2 layers).
    """
    devices = devices or jax.device_count()
    twin, small = _twin_layout(layout, devices), _twin_config(config)
    micro = 4 if twin.pp > 1 else 0  # a pipeline: 4 microbatches of 2 layers per stage
    small = dataclasses.replace(small, layers=2 * twin.pp) if twin.pp > 1 else small
    leaves = leaves_of(small)
    batch_rows = 2 * twin.batch_degree * max(micro // 2, 1)
    workload = Workload(batch_tokens=batch_rows * 16, seq=16, precision=precision,
                        optimizer="adamw", remat="none", microbatches=micro,
                        schedule=schedule)  # fmt: skip
    hardware = Hardware(memory_bytes=2**40, blocked_experts=not native_grouped_matmul())
    estimate = evaluate(small, leaves, twin, workload, hardware)
    kind = _StackedTwin if twin.pp > 1 else _Twin
    # abstract: only the step is compiled, so nothing is initialised or run
    model = plan_model(lambda: kind(small, nnx.Rngs(0)), layout=twin).abstract_model()
    optimizer = create_sharded_optimizer(model, optax.adamw(1e-3))
    if twin.pp > 1:
        step = _pipeline_step(small, twin, micro, workload.schedule)
    else:
        step = make_train_step(_loss, precision=precision)
    rows = np.zeros((batch_rows, 16), np.int32)  # shifted targets: the sequence may be split
    batch = {"inputs": rows, "targets": rows}
    with warnings.catch_warnings():  # the twin's path is returned below, not warned about
        warnings.simplefilter("ignore", ShardingWarning)
        path = step.plan_for(model, optimizer, batch).path
    lowered = step.lower(model, optimizer, batch)
    compiled = lowered.compile()
    memory = compiled.memory_analysis()
    state = sharding_report(model).bytes_per_device + sharding_report(optimizer).bytes_per_device
    planned = estimate.bytes_per_device
    scalars = 8  # adam's count and the optimizer's step: two 4-byte scalars
    compiled_text = compiled.as_text()
    text = lowered.as_text() if precision == "mixed" else compiled_text
    traffic = traffic_by_kind(text, devices, trips=True)  # a pipeline's ticks each count
    batch_per_device = 2 * rows.nbytes // (twin.batch_degree * twin.cp)
    return {
        "twin": {
            "layout": twin.label,
            "mesh": twin.shape,
            "params": sum(math.prod(leaf.shape) for leaf in leaves),
            "data_parallel": path,
        },
        "state_bytes": (planned["params"] + planned["optimizer"], state - scalars),
        "arguments_bytes": (
            planned["params"] + planned["optimizer"] + scalars + batch_per_device,
            memory.argument_size_in_bytes,
        ),
        "flops": (estimate.flops_per_device, compiled_flops(compiled, compiled_text)),
        "traffic_bytes": (
            _collective_bytes(estimate),
            sum(kind["bytes"] for kind in traffic.values()),
        ),
        "peak_bytes": (planned["peak"], peak_bytes(memory, jax.devices()[0].platform)),
    }


def _validate_on_target(config: TransformerConfig, candidate: Any, target: str) -> dict[str, Any]:
    """:func:`validate`'s comparison for a candidate compiled at real size for ``target``."""
    target = CompileTarget.parse(target)
    layout, workload = candidate.layout, candidate.workload
    if layout.devices != target.chips:
        raise ValueError(
            f"Candidate {layout.label} spans {layout.devices} devices; target {target.name} "
            f"has {target.chips} chips. Plan for {target.chips} devices, or name a slice of "
            f"{layout.devices}."
        )
    mesh = target.make_mesh(layout.shape)
    dtype = jnp.bfloat16 if workload.precision == "bf16" else jnp.float32
    precision = None if workload.precision == "f32" else workload.precision
    remat_name, micro = workload.remat or "none", workload.microbatches or 1
    rows = workload.batch_tokens // workload.seq
    flash = candidate.hardware is not None and candidate.hardware.flash_attention
    block = _flash_block(workload.seq) if flash else None
    tokens = jax.ShapeDtypeStruct((rows, workload.seq), jnp.int32)
    batch = {"inputs": tokens, "targets": tokens}
    if layout.pp > 1:
        step = _pipeline_step(config, layout, micro, workload.schedule or "zb-h1", mesh,
                              block=block, precision=precision, remat=remat_name)  # fmt: skip
        options = {}
    else:
        step = _loss
        options = {"precision": precision, "remat": remat_name, "microbatches": micro,
                   "gather": workload.gather or "keep"}  # fmt: skip
    planned = candidate.bytes_per_device
    with warnings.catch_warnings():  # the path is returned below, not warned about
        warnings.simplefilter("ignore", ShardingWarning)
        try:
            report = compile_for(lambda: _StackedTwin(config, nnx.Rngs(0), dtype, block),
                                 _float32_moments(optax.adamw(1e-3)), step, batch,
                                 target=target, layout=layout, mesh=mesh, **options)  # fmt: skip
        except CompileRefused as refused:  # the estimate fits where the compiler says not
            return {"target": target.name, "layout": layout.label, "refused": refused.compiler,
                    "peak_bytes": (planned["peak"], None)}  # fmt: skip
    scalars = 8  # adam's count and the optimizer's step
    batch_per_device = 2 * 4 * rows * workload.seq // (layout.batch_degree * layout.cp)
    return {
        "target": target.name,
        "layout": layout.label,
        "data_parallel": report.plan.path,
        "state_bytes": (planned["params"] + planned["optimizer"], report.state_bytes - scalars),
        "arguments_bytes": (
            planned["params"] + planned["optimizer"] + scalars + batch_per_device,
            report.step.argument_data,
        ),
        "flops": (candidate.flops_per_device, report.flops),
        "traffic_bytes": (_collective_bytes(candidate), report.traffic_bytes),
        "peak_bytes": (planned["peak"], report.step.peak),
        "host_bytes": (planned.get("host", 0.0), report.step.host_temporaries),
        "compile_seconds": report.compile_seconds,
    }


def _collective_bytes(candidate) -> float:
    """The candidate's collective bytes per step: its traffic but remat offload's host copies."""
    return sum(v for k, v in candidate.traffic_bytes_per_step.items() if not k.startswith("host/"))


def _flash_block(seq: int) -> int:
    """The twin's flash attention block: 512, or ``seq``'s largest divisor below it."""
    return max(d for d in range(1, min(seq, 512) + 1) if seq % d == 0)


def _float32_moments(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` keeping its state in float32 whatever the parameters' dtype, as the planner counts.

    optax's adam keeps its moments in the parameters' dtype (bf16 parameters: bf16 moments);
    mixed-precision recipes, and the planner's estimate, keep them in float32.
    """

    def wide(tree):
        return jax.tree.map(lambda x: x.astype(jnp.float32), tree)

    def init(params):
        return tx.init(wide(params))

    def update(updates, state, params=None):
        new, state = tx.update(wide(updates), state, None if params is None else wide(params))
        return jax.tree.map(lambda n, u: n.astype(u.dtype), new, updates), state

    return optax.GradientTransformation(init, update)


if __name__ == "__main__":
    sys.exit(main())
