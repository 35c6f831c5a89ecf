"""Estimates a sharded training step before anything is compiled: memory, traffic, time, warnings.

State bytes (parameters, gradients, optimizer) are exact: each leaf's spec comes from substrax's
one resolver (:meth:`substrax.mesh.MeshRules.resolve`) with the layout's parameter rules, as
the Flax adapter shards the same leaves. Activations,
gathered weights, unreduced gradients and logits use closed forms (Korthikanti et al. 2022 for
activations); traffic uses ring volumes per mesh axis, as :mod:`substrax.hlo` counts them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

from substrax.layout import Layout
from substrax.mesh._resolve import resolve_names, spec_entry
from substrax.mesh._strategies import PipelineParallelStrategy
from substrax.pipeline import SCHEDULES, Schedule
from substrax.planner._architectures import Leaf, TransformerConfig
from substrax.planner._efficiency import ROOFLINE, Efficiency
from substrax.spmd._blocks import auto_block, blocked_size
from substrax.spmd._remat import REMAT
from substrax.spmd._workarounds import region_obstacle

__all__ = [
    "Candidate",
    "Hardware",
    "LeafPlan",
    "Workload",
    "evaluate",
    "leaf_plans",
]

CHUNKED = ("interleaved", "circular")
"""The schedules that take more than one chunk of layers per stage."""

_OPTIMIZER_BYTES = {"adam": 8, "adamw": 8, "sgd": 0, "momentum": 4}
_UPDATE_FLOPS = {"adam": 12, "adamw": 14, "sgd": 2, "momentum": 4}
#: The default step's non-finite guard (``on_nonfinite="skip"``) computes the update once more
#: and checks the state it would write: measured, 2 x the update's FLOPs per parameter
#: (28 for adamw on the compiled twins, against "apply"), so 3 x in all.
_UPDATES_PER_STEP = 3
_ELEMENTWISE = 10  # FLOPs per element, forward and backward: softmax, norms, activations, loss
#: precision (a name of :data:`substrax.spmd.PRECISIONS`, as the step names it) -> (bytes of a
#: stored parameter or gradient, bytes of a gathered parameter, an activation or a gradient on
#: the wire).
PRECISION_BYTES = {"f32": (4, 4), "mixed": (4, 2), "bf16": (2, 2)}
#: The step's ``gather`` settings, the default first.
GATHER = ("keep", "regather")
#: How the loss holds the logits, the default first -> bytes per logit (one device's tokens
#: times its share of the vocabulary) live in the loss's backward pass; None: the compute
#: width. ``"fused"``: the logits once, in the compute width, as XLA compiles a JAX loss (it
#: fuses the upcast, the softmax and the cross-entropy into their consumers). ``"float32"``:
#: an eager framework's ``cross_entropy(logits.float(), labels)`` (torchtitan's loss without
#: torch.compile), whose backward holds the saved float32 log-probabilities, their gradient
#: and the logits' float32 gradient at once: 3 x 4 bytes.
LOSSES = {"fused": None, "float32": 12}


@dataclasses.dataclass(frozen=True)
class Workload:
    """What one training step does.

    Attributes:
      batch_tokens: Tokens per global batch (rounded to whole sequences).
      seq: Sequence length.
      precision: A name of :data:`substrax.spmd.PRECISIONS`, meaning what it means to
        ``make_train_step(precision=...)``: ``"f32"`` or ``"bf16"`` parameters, gradients
        and activations, or ``"mixed"``: float32 parameters, gradients and optimizer,
        bfloat16 gathers, activations and gradient reductions.
      optimizer: ``"adam"``/``"adamw"`` (two fp32 moments), ``"momentum"`` or ``"sgd"``.
      remat: ``"none"``, ``"selective"`` (attention recomputed) or ``"full"`` (layer input
        only); None lets :func:`~substrax.planner.plan` choose per layout.
      gather: As ``make_train_step(gather=...)``: FSDP parameters gathered where used and
        kept for the backward pass (``"keep"``, the step's default; with accumulation, kept
        for every slice) or gathered again there, and per slice (``"regather"``); None lets
        :func:`~substrax.planner.plan` choose per layout. A layer under remat gathers its
        parameters again when it is recomputed, either way.
      microbatches: Pipeline microbatches, or gradient-accumulation steps without a
        pipeline: each device holds one microbatch's activations at a time (0: the pipeline
        depth, or 1); None lets :func:`~substrax.planner.plan` choose per layout.
      schedule: The pipeline schedule, a name of :data:`substrax.pipeline.SCHEDULES`; its
        idle share and the activations it holds are read off its table, as the step runs it.
        The default is the pipelined training step's (``"zb-h1"``); None lets
        :func:`~substrax.planner.plan` choose per layout (with ``chunks``).
      chunks: Chunks of layers per stage for ``"interleaved"`` and ``"circular"`` (1
        otherwise); None lets :func:`~substrax.planner.plan` choose.
      sequence_parallel: Whether the ``h``-wide activations (the residual stream, the
        norms) are split over the tensor-parallel devices along the sequence, as Megatron-LM
        and torchtitan run tensor parallelism. substrax's layouts do not (their tensor axes
        shard ``heads``, ``kv_heads``, ``mlp`` and ``vocab``, not ``seq``): False, as they
        run.
      loss: How the loss holds the logits, a name of :data:`LOSSES`: ``"fused"`` (the
        default: a JAX loss, compiled by XLA) or ``"float32"`` (an eager framework's
        float32 cross-entropy, to estimate a PyTorch run: 12 bytes per logit).
    """

    batch_tokens: int
    seq: int
    precision: str = "bf16"
    optimizer: str = "adamw"
    remat: str | None = "selective"
    microbatches: int | None = 0
    gather: str | None = "keep"
    schedule: str | None = "zb-h1"
    chunks: int | None = 1
    sequence_parallel: bool = False
    loss: str = "fused"

    def __post_init__(self) -> None:
        if self.microbatches is not None and self.microbatches < 0:
            raise ValueError(f"microbatches must be >= 0, got {self.microbatches}.")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise ValueError(
                f"Unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}."
            )
        if self.chunks is not None and not (isinstance(self.chunks, int) and self.chunks >= 1):
            raise ValueError(f"chunks must be a positive integer, got {self.chunks!r}.")
        if self.chunks not in (None, 1) and self.schedule not in (None, *CHUNKED):
            raise ValueError(
                f"chunks={self.chunks} needs schedule 'interleaved' or 'circular', not "
                f"{self.schedule!r}."
            )
        if not (isinstance(self.seq, int) and self.seq >= 1):
            raise ValueError(f"seq must be a positive number of tokens, got {self.seq!r}.")
        if self.batch_tokens < self.seq:
            raise ValueError(
                f"batch_tokens ({self.batch_tokens}) must hold at least one sequence of seq "
                f"({self.seq}) tokens."
            )
        for value, options, what in ((self.precision, PRECISION_BYTES, "precision"),
                                     (self.optimizer, _OPTIMIZER_BYTES, "optimizer"),
                                     (self.remat or "none", REMAT, "remat"),
                                     (self.gather or "keep", GATHER, "gather"),
                                     (self.loss, LOSSES, "loss")):  # fmt: skip
            if value not in options:
                raise ValueError(f"Unknown {what} {value!r}; choose one of {', '.join(options)}.")

    @property
    def batch(self) -> int:
        """Sequences per global batch: ``batch_tokens / seq``, rounded to the nearest."""
        return max(1, round(self.batch_tokens / self.seq))


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One device's memory and speed.

    Attributes:
      memory_bytes: Memory per device.
      devices_per_host: Devices joined by fast links (tensor parallelism stays within them).
      flops: Peak FLOP/s per device (0: no time estimate).
      intra_host_bandwidth: Bytes/s per device within a host.
      inter_host_bandwidth: Bytes/s per device across hosts.
      blocked_experts: Whether experts' grouped products pad each expert's rows to whole
        blocks (substrax's kernel on XLA:CPU, :func:`substrax.spmd.group_rows`); GPUs and
        TPUs have a grouped kernel (``ragged_dot``) that does not.
      efficiency: The shares of the datasheet a step reaches (:class:`Efficiency`): the
        roofline by default; the named profiles (:data:`~substrax.planner.HARDWARE`) carry
        the calibrated ones.
      flash_attention: Whether attention runs as a flash kernel (cuDNN, splash): no score
        square is stored, and a causal mask skips half the products. True for the named GPU
        and TPU profiles; False (XLA's plain attention, as on XLA:CPU) by default.
      host_bandwidth: Bytes/s per device, each way, between the device and its host's memory
        (remat ``"offload"``'s transfers). 0: unknown; :func:`plan` then does not search
        ``"offload"``, and a workload that names it is estimated without the transfers'
        time (its candidate warns).
      host_memory_bytes: The host's memory per device, for remat ``"offload"``'s bytes: a
        candidate whose offloaded bytes exceed it does not fit. 0: unknown, not checked.
    """

    memory_bytes: int
    devices_per_host: int = 8
    flops: float = 0.0
    intra_host_bandwidth: float = 0.0
    inter_host_bandwidth: float = 0.0
    blocked_experts: bool = False
    efficiency: Efficiency = ROOFLINE
    flash_attention: bool = False
    host_bandwidth: float = 0.0
    host_memory_bytes: int = 0

    def __post_init__(self) -> None:
        if not self.memory_bytes > 0:
            raise ValueError(f"memory_bytes must be positive, got {self.memory_bytes!r}.")
        if not (isinstance(self.devices_per_host, int) and self.devices_per_host >= 1):
            raise ValueError(
                f"devices_per_host must be a positive integer, got {self.devices_per_host!r}."
            )
        for name in ("flops", "intra_host_bandwidth", "inter_host_bandwidth", "host_bandwidth",
                     "host_memory_bytes"):  # fmt: skip
            if getattr(self, name) < 0:
                raise ValueError(
                    f"{name} must not be negative (0: unknown), got {getattr(self, name)!r}."
                )


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """One parameter under a layout.

    Attributes:
      path: The parameter's path.
      names: Its logical names.
      spec: Mesh axes per dimension (empty tuple: replicated).
      params_per_device: Elements one device holds (a layer stack under a pipeline counts
        its padded slots, ``Pipeline.num_slots``).
      why: Why a dimension that a rule maps stays whole (not divisible, unknown name) or
        where its axes moved (the adapter's ``indivisible="move"``), if any.
      sharded_per_device: Elements per device of its optimizer state (and, for ZeRO-2, its
        gradient): ``params_per_device``, divided by the replicas under a ZeRO layout when a
        dimension divides (:meth:`~substrax.layout.Layout.optimizer_spec`).
    """

    path: str
    names: tuple[str | None, ...]
    spec: tuple[tuple[str, ...], ...]
    params_per_device: int
    why: str = ""
    sharded_per_device: int | None = None

    def __post_init__(self) -> None:
        if self.sharded_per_device is None:
            object.__setattr__(self, "sharded_per_device", self.params_per_device)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A layout's estimated step: memory per device, traffic, time, and what to watch.

    Attributes:
      layout: The layout.
      leaves: Per-parameter plan.
      params_per_device: Parameter elements per device (exact).
      bytes_per_device: ``params``, ``grads``, ``optimizer`` (exact), ``activations``,
        ``gathered``, ``unreduced``, ``logits`` (closed forms) and their sum ``peak``, what
        XLA allocates. The peak is the larger of two passes: a layer's backward (its buffers,
        in ``activations``, and the gathered layers) and the loss's (the embedding and head
        gathered, the logits as :attr:`Workload.loss` holds them); ``logits`` is what the
        loss's holds beyond the layer's, 0 where the layer's is the larger.
      traffic_bytes_per_step: Bytes each device moves per step, keyed ``"axis/kind"`` (such
        as ``"fsdp/all-gather"``); under remat ``"offload"`` also ``"host/offload"``, the
        copies to the host's memory and back, which are no collective.
      flops_per_device: FLOPs per device per step.
      time_s: Estimated step time: :attr:`time_breakdown`'s sum (0 without hardware speeds).
      bubble: Pipeline idle fraction (0 without a pipeline).
      headroom_bytes: Device memory left at the peak (negative when it does not fit).
      fits: Whether the peak fits the device memory.
      warnings: Indivisible dimensions, uneven stages, large replicated parameters.
      workload: The workload estimated, with the remat policy, microbatch count and schedule
        that :func:`~substrax.planner.plan` chose when it searched them.
      time_breakdown: ``time_s`` in parts, seconds: ``compute`` (matrix products and
        elementwise work), ``attention``, ``bubble`` (the pipeline's idle share of them),
        and ``exposed/<axis>`` per mesh axis kind whose collectives are on the critical path.
      hardware: The profile estimated against (its memory, speeds and kernels).
    """

    layout: Layout
    leaves: tuple[LeafPlan, ...]
    params_per_device: int
    bytes_per_device: dict[str, float]
    traffic_bytes_per_step: dict[str, float]
    flops_per_device: float
    time_s: float
    bubble: float
    headroom_bytes: float
    fits: bool
    warnings: tuple[str, ...]
    workload: Workload | None = None
    time_breakdown: dict[str, float] = dataclasses.field(default_factory=dict)
    hardware: Hardware | None = None

    def as_dict(self) -> dict:
        """A JSON-ready summary (without the per-leaf table).

        Returns:
          ``mesh``, ``strategy``, ``bytes_per_device``, ``params_per_device``,
          ``traffic_bytes_per_step``, ``flops_per_device``, ``time_s``, ``time_breakdown``,
          ``bubble``,
          ``headroom_bytes``, ``fits``, ``warnings``, ``remat``, ``microbatches``,
          ``schedule`` and ``chunks``.
        """
        return {
            "mesh": self.layout.shape,
            "strategy": self.layout.label,
            "remat": self.workload.remat if self.workload else None,
            "microbatches": self.workload.microbatches if self.workload else None,
            "schedule": self.workload.schedule if self.workload else None,
            "chunks": self.workload.chunks if self.workload else None,
            "bytes_per_device": self.bytes_per_device,
            "params_per_device": self.params_per_device,
            "traffic_bytes_per_step": self.traffic_bytes_per_step,
            "flops_per_device": self.flops_per_device,
            "time_s": self.time_s,
            "time_breakdown": self.time_breakdown,
            "bubble": self.bubble,
            "headroom_bytes": self.headroom_bytes,
            "fits": self.fits,
            "warnings": list(self.warnings),
        }


@functools.lru_cache(maxsize=1024)
def _stage_slots(layers: int, pp: int) -> int:
    """Slots of a layer stack padded for ``pp`` stages: ``pp x`` the busiest stage's layers.

    A stack sharded over the stage axis must divide it, so an uneven one is stored padded
    (``substrax.pipeline.Pipeline.num_slots`` with one repeat; the extra slots are masked).
    """
    return pp * max(PipelineParallelStrategy("pipe", 0, pp).assign_layers_to_stages(layers))


def _stored_shape(leaf: Leaf, layout: Layout) -> tuple[int, ...]:
    if layout.pp > 1 and leaf.names[:1] == ("layers",):
        return (_stage_slots(leaf.shape[0], layout.pp), *leaf.shape[1:])
    return leaf.shape


def _leaf_plan(leaf: Leaf, layout: Layout, rules: dict, strategy: Any, mesh: Any) -> LeafPlan:
    sizes = layout.shape
    shape = _stored_shape(leaf, layout)
    if strategy is not None and all(name is None for name in leaf.names):
        # unannotated: the layout's strategy, as the Flax adapter shards it
        resolution = strategy.resolve(shape, mesh, name=leaf.path, layer=leaf.layer)
    else:
        resolution = resolve_names(
            rules, leaf.names, shape, sizes, unknown_names="replicate", where=leaf.path
        ).move_left_out(shape, sizes)  # as the adapter stores it by default
    spec = resolution.axes  # one entry per dimension (the resolver's, with the shape given)
    count = math.prod(
        dim // math.prod(sizes[a] for a in axes) for dim, axes in zip(shape, spec, strict=True)
    )
    why = "; ".join(str(r) for r in resolution.of_kind("indivisible", "moved", "unknown_name"))
    sharded = count
    if layout.zero:
        _, whole = layout.optimizer_spec(tuple(spec_entry(axes) for axes in spec), shape)
        sharded = count if whole else count // layout.dp
    return LeafPlan(leaf.path, leaf.names, spec, count, why, sharded)


def _sums(config: TransformerConfig, leaves: tuple, layout: Layout, plans: tuple) -> tuple:
    """Per-layout element counts (see :attr:`Prepared.sums`)."""
    per_device = sum(p.params_per_device for p in plans)
    sharded = sum(p.sharded_per_device for p in plans)  # over the replicas under ZeRO
    dense = sum(p.params_per_device for p in plans if "expert" not in p.names)
    head, shared = _head(config, plans)
    layer_params = sum(
        math.prod(leaf.shape[1:]) / (layout.ep if "expert" in leaf.names else 1)
        for leaf in leaves
        if leaf.names[:1] == ("layers",)
    )
    outside = sum(_whole_over_fsdp(p, layout) for p in plans if p.names[:1] != ("layers",))
    return per_device, sharded, dense, head, shared, layer_params, outside


def _whole_over_fsdp(plan: LeafPlan, layout: Layout) -> float:
    """A parameter's elements per device once gathered over the FSDP axes its spec names."""
    sizes = dict(zip(layout.axis_names, layout.axis_sizes, strict=True))
    split = math.prod(sizes[a] for axes in plan.spec for a in axes if a in layout.fsdp_axes)
    return plan.params_per_device * split


def _activations(
    c: TransformerConfig,
    w: Workload,
    layout: Layout,
    act: int,
    schedule: Schedule | None,
    hw: Hardware | None = None,
) -> tuple[float, float]:
    """Activation bytes of one device's live microbatches, and of the layer in its backward.

    Each layer keeps :func:`_kept` ``s b h`` under its remat policy (in 2-byte units): the
    heads' and the MLP's parts divided over the tensor-parallel devices, the ``h``-wide
    residual stream whole on each unless ``w.sequence_parallel``; without a flash kernel,
    remat ``"none"`` also keeps the score square (``5 a s / h``, split by heads). The layer
    whose backward pass runs holds its gradients' buffers besides, about its own ``"none"``
    activations once more, under every policy (the others recompute them first). Under
    ``"offload"`` the device keeps what ``"full"`` keeps and :data:`OFFLOAD_IN_TRANSIT`
    layers' offloaded products in transit (:func:`_offloaded` counts the host's share).
    Context parallelism divides the sequence (ring attention holds one key/value block at a
    time, so the score term shrinks with the square). A mixture of experts replaces the
    MLP's part with its own (:func:`_expert_activations`).

    Returns:
      ``(kept, transient)``: what the layers keep for the backward pass (with offload's
      products in transit), and the buffers of the layer whose backward pass runs.
    """
    rows = w.batch / layout.batch_degree
    micro = w.microbatches or (layout.pp if layout.pp > 1 else 1)
    in_flight, waiting = _held(schedule)
    b, s, h, a, t = rows / micro, w.seq / layout.cp, c.d_model, c.heads, layout.tp
    flash = hw is not None and hw.flash_attention
    remat = w.remat or "none"
    square = 0 if flash or remat != "none" else 5 * a * s / (h * t)
    split = t if w.sequence_parallel else 1

    def per_token(policy: str) -> float:
        return _per_token(c, w, layout, act, hw, policy)

    layer, whole = per_token(remat) + square, per_token("none")
    # a deferred weight op keeps its layers' output cotangents as well (s b h each)
    per_layer_all = layer * s * b * h * in_flight + s * b * h / split * waiting
    kept = per_layer_all * math.ceil(c.layers / layout.pp)
    if remat == "offload":  # products of OFFLOAD_IN_TRANSIT layers on the way out or back
        kept += OFFLOAD_IN_TRANSIT * (per_token("selective") - layer) * s * b * h
    return kept * act / 2, whole * s * b * h * act / 2


#: Layers whose offloaded products remat ``"offload"`` holds on the device at its peak (on
#: their way to the host or back): XLA:TPU's Llama 3 8B step (fsdp 32, 4 microbatches of 8192
#: tokens, ``v5p-64``) allocated 10.96 GiB of HBM, 3.4 layers' worth beyond ``"full"``'s
#: 8.92 GiB; its host bytes equal :func:`_offloaded`'s exactly.
OFFLOAD_IN_TRANSIT = 3


def _per_token(c, w: Workload, layout: Layout, act: int, hw, policy: str) -> float:
    """A layer's bytes kept per token per ``h`` on one device (2-byte units) under ``policy``."""
    wide, heads, mlp = _kept(c, policy)
    t = layout.tp
    split = t if w.sequence_parallel else 1
    if c.experts and policy not in ("full", "offload"):  # the experts' part replaces the MLP's
        mlp = _expert_activations(c, w, layout, act, hw) * 2 / act / c.d_model * t
    return wide / split + heads / t + mlp / t


def _offload_warning(host: float, hw: Hardware) -> tuple[str, ...]:
    """A candidate's warning when its offloaded bytes' transfers cannot be timed."""
    if not host or hw.host_bandwidth or not hw.flops:
        return ()
    return (
        f"remat 'offload' keeps {host / 2**30:.2f} GiB per device in the host's memory; the "
        "link's bandwidth is unknown (Hardware.host_bandwidth=0, --host-bandwidth), so the "
        "transfers are not in the time.",
    )


def _offloaded(
    c: TransformerConfig, w: Workload, layout: Layout, act: int, schedule: Schedule | None,
    hw: Hardware | None = None,
) -> tuple[float, float]:  # fmt: skip
    """Remat ``"offload"``'s bytes per device: ``(held in the host's memory, copied per step)``.

    ``"selective"``'s saved products beyond what ``"full"`` keeps (the layer's input): held
    for each layer of each microbatch the schedule holds at once, and copied out after the
    forward pass and back for the backward pass for every microbatch (zeros for the other
    policies). On XLA:TPU a step of 8 layers (a 128-wide decoder at 512 tokens,
    ``v5p:2x2x2``) kept 33.5 MB on the host, where ``"selective"`` kept 36.9 MB more than
    ``"full"`` on the device; the device held 6.1 MB (1.3 layers' worth) more than under
    ``"full"``; see :data:`OFFLOAD_IN_TRANSIT`.
    """
    if (w.remat or "none") != "offload":
        return 0.0, 0.0
    rows = w.batch / layout.batch_degree
    micro = w.microbatches or (layout.pp if layout.pp > 1 else 1)
    in_flight, _ = _held(schedule)
    per_token = _per_token(c, w, layout, act, hw, "selective") - _per_token(
        c, w, layout, act, hw, "full"
    )
    tokens = rows / micro * w.seq / layout.cp
    microbatch = per_token * tokens * c.d_model * math.ceil(c.layers / layout.pp) * act / 2
    return microbatch * in_flight, 2 * microbatch * micro


def _kept(c: TransformerConfig, remat: str) -> tuple[float, float, float]:
    """A layer's bytes kept for the backward pass per token per ``h`` (2-byte activations).

    ``(h-wide, the heads', the MLP's)``, with flash-style attention (no score square), as
    XLA:TPU keeps them (measured on Llama 3 8B's and GPT-2's layers, libtpu 0.0.42.1; see
    docs/planning.md "At real size"):

    - ``"none"``: six ``h``-wide tensors (the residual stream and the norms' values), the
      queries and attention's output (``2 q`` each, ``q`` their width over ``h``), keys
      and values (``2 kv`` each), and six ``ffn``-wide ones in the MLP (its products and the
      activation's intermediates, which XLA keeps rather than recomputes, plain or gated):
      59 for a Llama 3 8B layer, 68 for GPT-2's (62 measured).
    - ``"selective"`` (products without batch dimensions saved): the layer's input and
      attention's output product, queries, keys and values, and the MLP's first products
      (one, or two gated): 21 for Llama 3 8B, 18 for GPT-2.
    - ``"full"``: the layer's input alone, 2.
    """
    q = c.heads * c.head_dim / c.d_model
    kv = c.kv_heads * c.head_dim / c.d_model
    f = c.ffn / c.d_model
    if remat in ("full", "offload"):  # offload moves selective's products to the host
        return 2.0, 0.0, 0.0
    if remat == "selective":
        return 4.0, 2 * q + 4 * kv, (4 if c.gated else 2) * f
    return 12.0, 4 * q + 4 * kv, 12 * f


def _expert_activations(
    c: TransformerConfig, w: Workload, layout: Layout, act: int, hw: Hardware | None
) -> float:
    """A mixture-of-experts MLP's bytes kept per token for the backward pass.

    The router's float32 logits and probabilities (``8 x experts``), each choice's weight,
    expert and places (``24`` per choice), the output's float32 sum (``4 h``), and per routed
    row, padding included, ``ffn``-wide rows: ``8`` gated (both inputs, the activation, their
    product and its gate-weighted copy, and the backward's gradients of them; one
    mixture-of-experts layer's step compiled on XLA:CPU keeps 7.9 per routed row, as a gated
    MLP keeps 8 per token), ``6`` plain. Over expert axes the exchange's buffers hold the
    worst case, every device's rows routed to this one: ``ep`` times those rows and three
    ``h``-wide ones (received, computed, sent back).
    """
    hidden = (8 if c.gated else 6) * c.ffn * act / layout.tp
    if layout.ep > 1:  # buffers for the worst case: every device's rows routed to this one
        row = layout.ep * (hidden + 3 * c.d_model * act)  # received, computed, sent back
    else:
        row = _padding(c, w, layout, hw) * hidden
    return 8 * c.experts + c.top_k * (24 + row) + 4 * c.d_model


def _padding(c: TransformerConfig, w: Workload, layout: Layout, hw: Hardware | None) -> float:
    """Rows the grouped product runs per routed row (1 without a blocked kernel).

    On a blocked kernel (``hw.blocked_experts``) each expert's rows are padded to whole
    blocks: a device's group of ``n`` rows runs the static bound ``n + experts x (block - 1)``
    rounded to blocks, or, over expert axes (a loop over the blocks in use), about half a
    block per local expert more.
    """
    if hw is None or not hw.blocked_experts:
        return 1.0
    groups = c.experts // layout.ep
    micro = max(w.microbatches or 1, 1)
    rows = w.batch * w.seq / (layout.batch_degree * layout.cp * micro) * c.top_k
    block = auto_block(int(rows), groups)
    if layout.ep > 1:
        return 1 + groups * block / (2 * rows)
    return blocked_size(rows, groups, block) / rows


def schedule_of(layout: Layout, w: Workload) -> Schedule | None:
    """The pipeline schedule ``w`` runs on ``layout``.

    Args:
      layout: The layout.
      w: The workload; a schedule it leaves open (None, outside :func:`plan`'s search) is
        the step's default, ``"zb-h1"``.

    Returns:
      The :class:`~substrax.pipeline.Schedule`, or None without a pipeline.

    Raises:
      ValueError: For a schedule the layout cannot run (see :class:`Workload`).
    """
    if layout.pp == 1:
        return None
    micro = w.microbatches or layout.pp
    return Schedule(w.schedule or "zb-h1", layout.pp, micro, w.chunks or 1)


def _held(schedule: Schedule | None) -> tuple[float, float]:
    """``(microbatches of activations held, of deferred weight ops' cotangents)`` per stage.

    GPipe and circular hold every microbatch (circular's rounds are chunks of a stage);
    the split schedules what their table holds at most, a chunk being ``1 / chunks`` stage.
    """
    if schedule is None:
        return 1.0, 0.0
    chunks = schedule.repeats
    if not schedule.split:
        return float(schedule.num_microbatches), 0.0
    return schedule.held() / chunks, schedule.waiting() / chunks


def leaf_plans(leaves: Sequence[Leaf], layout: Layout) -> tuple[LeafPlan, ...]:
    """Every parameter's plan under ``layout`` (cached: it does not depend on the workload)."""
    return _leaf_plans(tuple(leaves), layout)


@functools.lru_cache(maxsize=4096)
def _leaf_plans(leaves: tuple[Leaf, ...], layout: Layout) -> tuple[LeafPlan, ...]:
    rules = layout.param_rules.as_dict()
    unannotated = any(all(name is None for name in leaf.names) for leaf in leaves)
    strategy = layout.strategy() if unannotated else None
    mesh = None
    if strategy is not None:  # a model with unannotated leaves: its strategy's specs need jax
        from jax.sharding import AbstractMesh

        mesh = AbstractMesh(layout.axis_sizes, layout.axis_names)
    return tuple(_leaf_plan(leaf, layout, rules, strategy, mesh) for leaf in leaves)


def evaluate(
    config: TransformerConfig,
    leaves: Sequence[Leaf],
    layout: Layout,
    workload: Workload,
    hardware: Hardware,
) -> Candidate:
    """Estimates one layout's training step.

    Args:
      config: The architecture (for the closed forms).
      leaves: Its parameters with logical names.
      layout: The layout to evaluate.
      workload: Batch, sequence, precision, optimizer, remat.
      hardware: Device memory (and speeds, for a time estimate).

    Returns:
      The :class:`Candidate`.

    Raises:
      ValueError: If ``workload`` leaves ``remat`` or ``microbatches`` to be searched (that
        is :func:`~substrax.planner.plan`'s job), or its sequences do not split evenly over
        the layout's batch degree, or a replica's into its microbatches (jax shards a
        dimension only evenly).
    """
    if workload.remat is None or workload.microbatches is None:
        raise ValueError(
            "evaluate() needs a workload with remat and microbatches set; plan() searches them."
        )
    degree, micro = layout.batch_degree, max(workload.microbatches, 1)
    if workload.batch % (degree * micro):
        raise ValueError(
            f"The batch's {workload.batch} sequences do not split evenly over {layout.label}'s "
            f"batch degree {degree} and {micro} microbatch(es) per replica; use a multiple of "
            f"{degree * micro} sequences."
        )
    return evaluate_prepared(prepare(config, leaves, layout), workload, hardware)


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What :func:`evaluate` needs of a layout whatever the workload, computed once.

    Attributes:
      config: The architecture.
      leaves: Its parameters.
      layout: The layout.
      plans: Each parameter's plan.
      sums: ``(params per device, of which sharded over the replicas under ZeRO, not
        experts', the loss's own, those also looked up, elements of one stacked layer per
        expert shard, those outside the layer stack per device once gathered over FSDP)``.
      warnings: The layout's warnings.
      links: Hardware -> bandwidth per traffic axis, filled as :func:`_time` asks.
    """

    config: TransformerConfig
    leaves: tuple[Leaf, ...]
    layout: Layout
    plans: tuple[LeafPlan, ...]
    sums: tuple
    warnings: tuple[str, ...]
    links: dict = dataclasses.field(default_factory=dict, compare=False)


def prepare(config: TransformerConfig, leaves: Sequence[Leaf], layout: Layout) -> Prepared:
    """The workload-independent part of :func:`evaluate` for ``layout``.

    Args:
      config: The architecture.
      leaves: Its parameters.
      layout: The layout.

    Returns:
      The :class:`Prepared` values, for :func:`evaluate_prepared` with each workload.
    """
    leaves = tuple(leaves)
    plans = leaf_plans(leaves, layout)
    sums = _sums(config, leaves, layout, plans)
    return Prepared(config, leaves, layout, plans, sums, _warnings(config, plans, layout, sums[0]))


def _gathers(layout, workload: Workload) -> tuple[int, int, bool]:
    """How the default step moves FSDP parameters: ``(gathers, rounds, whole)``.

    ``gathers`` per round (1: the forward's kept for the backward pass; 2: gathered again
    there, under ``"regather"`` or for a layer under remat), ``rounds`` of gathers and
    reduce-scatters per step (one per accumulation slice under ``"regather"``), and whether
    the whole model is gathered once and kept for every slice (accumulation under
    ``"keep"``). A pipeline's stages gather their layers once (or twice) per step.
    """
    gather = workload.gather or "keep"
    slices = _slices(layout, workload)
    if layout.pp > 1:
        return (1 if gather == "keep" else 2), 1, False
    if gather == "keep" and slices > 1:
        return 1, 1, True
    if gather == "keep" and (workload.remat or "none") == "none":
        return 1, 1, False
    return 2, (slices if gather == "regather" else 1), False


def _slices(layout, workload: Workload) -> int:
    """Gradient-accumulation slices of a step (a pipeline's microbatches are not slices)."""
    return (workload.microbatches or 1) if layout.pp == 1 else 1


def _gathered(config, layout, workload, per_device, layer_shard, stored) -> tuple[float, float]:
    """Bytes of gathered parameters and of gradients not yet reduced, per device.

    Without FSDP, accumulation over microbatches holds the slice's gradient whole in the
    compute width, and the running sum whole too (before ZeRO-1's reduce-scatter or the
    data-parallel all-reduce); ZeRO-2 reduce-scatters each slice's gradient and sums shards
    (the ``grads`` term): Llama 3 8B on ZeRO-2 16 x TP 2, 8 slices, XLA:TPU: 53.5 GiB
    compiled, 53.9 estimated (60.2 compiled and 61.4 estimated while XLA:TPU moved the
    slices' reductions out of the loop and summed whole gradients, before the adapter's
    step kept them in it; docs/planning.md "At real size").
    """
    width = PRECISION_BYTES[workload.precision][1]
    if layout.fsdp == 1:
        sums = 1 if layout.zero == 2 else 2  # the slice's gradient, and a whole running sum
        return 0.0, (sums * per_device * width if _slices(layout, workload) > 1 else 0.0)
    gathers, _, whole = _gathers(layout, workload)
    if whole:  # every parameter gathered, and a whole gradient summed over the slices
        model = per_device * layout.fsdp
        return model * width, model * (stored + width)
    layer = layer_shard * layout.fsdp
    if gathers == 1 and layout.pp == 1:  # every layer's gathered parameters kept
        return layer * max(config.layers, 2), layer
    return 2 * layer, layer  # the layer in use and the next


def _vocabulary(layout: Layout, outside: float, width: int) -> float:
    """Bytes of the parameters outside the layer stack (embedding, head) that FSDP gathers.

    Each is gathered whole in the compute width for the lookup and the loss, and held in the
    loss's backward pass beside the logits (Llama 3 8B on FSDP 32, XLA:TPU: 1.96 GiB, the
    128256 x 4096 embedding and head), not in the layers' passes.
    """
    return outside * width if layout.fsdp > 1 else 0.0


def evaluate_prepared(pre: Prepared, workload: Workload, hardware: Hardware) -> Candidate:
    """:func:`evaluate` of a :func:`prepare`d layout (the search runs it per workload)."""
    config, leaves, layout, plans = pre.config, pre.leaves, pre.layout, pre.plans
    per_device, sharded, dense, head, shared, layer_params, outside = pre.sums
    stored, width = PRECISION_BYTES[workload.precision]
    rows = workload.batch / layout.batch_degree
    schedule = schedule_of(layout, workload)
    layer_shard = layer_params / (layout.tp * layout.fsdp) * width
    gathered, unreduced = _gathered(config, layout, workload, per_device, layer_shard, stored)
    kept, transient = _activations(config, workload, layout, width, schedule, hardware)
    per_slice = rows / max(workload.microbatches or 1, 1) * workload.seq / layout.cp  # tokens
    per_logit = LOSSES[workload.loss] or width
    loss = _vocabulary(layout, outside, width) + per_slice * config.vocab / layout.tp * per_logit
    memory = {
        "params": per_device * stored,
        "grads": (sharded if layout.zero == 2 else per_device) * stored,
        "optimizer": sharded * _OPTIMIZER_BYTES[workload.optimizer],
        "activations": kept + transient,
        "gathered": gathered,
        "unreduced": unreduced,
        # the peak is the larger of two passes: a layer's backward (its buffers, the gathered
        # layers) and the loss's (the embedding and head gathered, the logits)
        "logits": max(0.0, loss - transient - gathered),
    }
    memory["peak"] = sum(memory.values())
    host, copied = _offloaded(config, workload, layout, width, schedule, hardware)
    if host:  # in the host's memory, not the device's: not in the peak
        memory["host"] = host
    state = (per_device * width, dense * width, head * width, shared * width)
    traffic = _traffic(config, workload, layout, state, width, schedule)
    if copied:
        traffic["host/offload"] = copied
    tokens = workload.batch * workload.seq
    flops = _flops_per_token(config, leaves, workload.seq) * tokens
    attention = _attention_flops_per_token(config, workload.seq) * tokens
    if workload.remat == "full":  # the forward pass again: 8 of 6
        flops *= 8 / 6
        attention *= 8 / 6
    elif workload.remat in ("selective", "offload"):  # attention's forward again
        flops += attention / 3  # (scores, softmax, values)
        attention *= 4 / 3
    flops += _dispatch_flops(config, leaves, workload, layout, hardware) * tokens
    flops /= layout.devices
    attention /= layout.devices
    flops += per_device * _UPDATE_FLOPS[workload.optimizer] * _UPDATES_PER_STEP
    bubble = schedule.idle_fraction() if schedule is not None else 0.0
    breakdown = _time(flops, attention, traffic, bubble, pre, hardware)
    return Candidate(
        layout=layout,
        leaves=plans,
        params_per_device=per_device,
        bytes_per_device=memory,
        traffic_bytes_per_step=traffic,
        flops_per_device=flops,
        time_s=sum(breakdown.values()),
        bubble=bubble,
        headroom_bytes=hardware.memory_bytes - memory["peak"],
        fits=memory["peak"] <= hardware.memory_bytes
        and not (hardware.host_memory_bytes and host > hardware.host_memory_bytes),
        warnings=pre.warnings + _offload_warning(host, hardware),
        workload=workload,
        time_breakdown=breakdown,
        hardware=hardware,
    )


@functools.lru_cache(maxsize=256)
def _flops_per_token(c: TransformerConfig, leaves: tuple[Leaf, ...], seq: int) -> float:
    """Training FLOPs per token, forward and backward.

    Matmuls: 6 per weight (forward 2, backward 4), the output head included even when tied,
    lookups (embeddings) excluded; attention's score and value products, 12 x layers x heads x
    head_dim x seq. Elementwise work, ``_ELEMENTWISE`` per element: attention softmax (heads x
    seq per layer), two norms per layer and a final one, the MLP activation (twice when gated)
    and the cross-entropy over the vocabulary.
    """
    lookups = sum(
        math.prod(leaf.shape) for leaf in leaves if leaf.path in ("embedding", "positions")
    )
    active = c.top_k / c.experts if c.experts else 1.0  # each token meets top_k experts
    matmul = sum(
        math.prod(leaf.shape) * (active if "expert" in leaf.names else 1) for leaf in leaves
    )
    matmul -= lookups
    if c.tied:
        matmul += c.vocab * c.d_model
    attention = _attention_flops_per_token(c, seq)
    per_layer = c.heads * seq + 2 * c.d_model + c.ffn * (2 if c.gated else 1)
    elementwise = _ELEMENTWISE * (c.layers * per_layer + c.d_model + c.vocab)
    return 6 * matmul + attention + elementwise


def _dispatch_flops(
    c: TransformerConfig, leaves: tuple[Leaf, ...], w: Workload, layout: Layout, hw: Hardware
) -> float:
    """Mixture-of-experts FLOPs per token beyond :func:`_flops_per_token`'s active matmuls.

    Sorted dispatch multiplies ``tokens x top_k`` rows by their experts, padded on a blocked
    kernel (:func:`_padding`). Where the layer enters its own region (expert axes, or XLA's
    step over a split batch) its backward recomputes the forward: the router and experts
    again.
    """
    if not c.experts:
        return 0.0
    share = c.top_k / c.experts
    expert = sum(math.prod(leaf.shape) for leaf in leaves if "expert" in leaf.names)
    router = sum(math.prod(leaf.shape) for leaf in leaves if leaf.path.endswith("router"))
    factor = _padding(c, w, layout, hw)
    extra = 6 * expert * share * (factor - 1)
    region = layout.ep > 1 or (_xla_step(layout) and layout.batch_degree > 1)
    if region:
        extra += 2 * (expert * share * factor + router)
    return extra


def _head(c: TransformerConfig, plans: Sequence[LeafPlan]) -> tuple[float, float]:
    """Elements of this device's share of the loss's own parameters, and of those also looked up.

    The loss's parameters are everything outside the layer stack but the lookups
    (``embedding``, ``positions``), and the embedding too when the head is tied to it: under
    a pipeline the last stage's loss uses them, so their gradients are summed over the
    stages as well. A tied embedding's lookup gradient is reduced apart, over the replicas.
    """
    head = [
        p.params_per_device
        for p in plans
        if p.names[:1] != ("layers",) and p.path not in ("embedding", "positions")
    ]
    shared = [p.params_per_device for p in plans if c.tied and p.path == "embedding"]
    return sum(head) + sum(shared), sum(shared)


def _attention_flops_per_token(c: TransformerConfig, seq: int) -> float:
    """Attention's score and value products per token, forward and backward (12 x L H d s).

    The softmax's elementwise work (``heads x seq`` per layer) is counted with the rest.
    """
    return 12 * c.layers * c.heads * c.head_dim * seq


def _traffic(c, w, layout, state, width, schedule) -> dict[str, float]:
    """Ring volumes of one step, per device, keyed ``"axis/kind"``.

    ``state`` is ``(bytes of this device's parameters, of those that are not experts', of
    the loss's own, of those also looked up)`` in the wire width. Under a pipeline the loss's
    parameters are whole on every device and their gradients are all-reduced over every
    stage and replica at once (``pipe/all-reduce``, with the stack inputs' gradients summed
    over the stages); the stage boundary moves each microbatch's activations forward and its
    cotangents back on every tick of the schedule's table, idle ticks included.
    """
    state_bytes, dense_bytes, head_bytes, shared = state
    ep = layout.ep
    # dense parameters are sharded over the expert axes too, and gathered over them first
    # (by XLA): every other axis gathers and reduces them whole over the expert axes
    state_bytes += dense_bytes * (ep - 1)
    dense_bytes, head_bytes, shared = dense_bytes * ep, head_bytes * ep, shared * ep
    # under a pipeline the loss's own gradients are reduced with the stages' (below); a tied
    # embedding's lookup gradient stays with the rest
    own = head_bytes - shared if layout.pp > 1 else 0.0
    reduced, dense_bytes = state_bytes - own, dense_bytes - own
    rows = w.batch / layout.batch_degree
    tokens = rows * w.seq / layout.cp
    activation = tokens * c.d_model * width
    layers = math.ceil(c.layers / layout.pp)
    traffic = {}
    f = layout.fsdp * layout.cp  # parameters are sharded over the FSDP and context axes
    if f > 1:  # parameter all-gathers (one, or two when re-gathered), one reduce-scatter
        axes = "+".join(n for n, d in (("fsdp", layout.fsdp), ("context", layout.cp)) if d > 1)
        gathers, rounds, _ = _gathers(layout, w)
        traffic[f"{axes}/all-gather"] = rounds * gathers * state_bytes * f * (f - 1) / f
        if _xla_step(layout):  # XLA's partitioning all-reduces the gathered gradients
            traffic[f"{axes}/all-reduce"] = 2 * reduced * f * (f - 1) / f
        else:
            traffic[f"{axes}/reduce-scatter"] = rounds * reduced * f * (f - 1) / f
    if layout.dp > 1 and layout.zero:  # gradients reduce-scattered, new parameters gathered
        # ZeRO-2 reduce-scatters each accumulation slice's gradient, ZeRO-1 their sum
        scatters = _slices(layout, w) if layout.zero == 2 else 1
        traffic["data/reduce-scatter"] = scatters * reduced * (layout.dp - 1) / layout.dp
        traffic["data/all-gather"] = state_bytes * (layout.dp - 1) / layout.dp
    elif layout.dp > 1:  # gradient all-reduce of this device's shard
        traffic["data/all-reduce"] = 2 * reduced * (layout.dp - 1) / layout.dp
    if layout.cp > 1:  # the ring: forward, its recomputation, and a backward ring that
        # carries each block with its gradients (twice the bytes) and brings those home
        kv = tokens * c.kv_heads * c.head_dim * 2 * width / min(layout.tp, c.kv_heads)
        traffic["context/collective-permute"] = layers * (4 * (layout.cp - 1) + 1) * kv
    if ep > 1:  # dense parameters gathered, their gradients all-reduced (XLA's partitioning)
        traffic["expert/all-gather"] = dense_bytes * (ep - 1) / ep
        traffic["expert/all-reduce"] = 2 * dense_bytes * (ep - 1) / ep
    if ep > 1 and c.experts:  # dispatch and combine: forward, recomputed, backward
        # sorted dispatch: each routed row once there and once back, in rounds of 1/64 of
        # an even share per pair of devices (half a round's rounding on average)
        rows = ROUNDING * tokens * c.top_k * c.d_model * width
        traffic["expert/all-to-all"] = 6 * layers * rows * (ep - 1) / ep
    if layout.tp > 1:  # two activation all-reduces per layer forward, two backward
        traffic["model/all-reduce"] = 4 * layers * 2 * activation * (layout.tp - 1) / layout.tp
    if layout.pp > 1:
        micro, n = w.microbatches or layout.pp, layout.pp * layout.dp * layout.fsdp
        whole = head_bytes * layout.fsdp  # gathered before the head runs
        traffic["pipe/all-reduce"] = (
            2 * whole * (n - 1) / n + 2 * activation * (layout.pp - 1) / layout.pp
        )
        # two permutes a tick, idle ticks included: a split schedule's forward and backward,
        # GPipe's and circular's one in their forward loop and one in its transpose; each
        # device of a tensor-parallel group sends its 1/tp and gathers the rest over the model
        # axis where it is used (Pipeline._boundary), once per chunk and microbatch each way
        split = layout.tp if layout.tp > 1 and c.d_model % layout.tp == 0 else 1
        traffic["pipe/collective-permute"] = 2 * activation * schedule.num_ticks / micro / split
        if split > 1:
            traffic["model/all-gather"] = 2 * schedule.repeats * activation * (split - 1) / split
    return traffic


def _xla_step(layout: Layout) -> bool:
    """Whether substrax's train step runs ``layout`` with XLA's partitioning, not by hand.

    Read from the step's own list (:func:`substrax.spmd.region_obstacle`) for a region over
    the batch axes that leaves the tensor, context and expert axes to XLA.
    """
    sizes = {"model": layout.tp, "context": layout.cp, "expert": layout.ep}
    return region_obstacle(sizes, ()) is not None


#: Traffic on the critical path: a layer waits for its tensor-parallel reductions, its
#: experts' tokens and its stage's activations.
CRITICAL_AXES = ("model", "expert", "pipe")


def _time(flops, attention, traffic, bubble, pre: Prepared, hw: Hardware) -> dict[str, float]:
    """The step's seconds in parts (see :attr:`Candidate.time_breakdown`); empty without speeds.

    Compute runs at the hardware's calibrated shares of peak (:class:`Efficiency`): attention
    (``attention`` of ``flops``) counted causal, half its products, under a flash kernel.
    The pipeline's idle share stretches both. Tensor, expert and pipeline traffic is on the
    critical path (:data:`CRITICAL_AXES`), each by the share the efficiency exposes. The rest
    (FSDP and context gathers and reductions, data-parallel reductions, the ring) overlaps the
    other layers' compute, except one layer's share (the first gather, the last reduction)
    and whatever exceeds the compute.
    """
    if not hw.flops:
        return {}
    eff = hw.efficiency
    executed = attention / 2 if hw.flash_attention else attention
    parts = {
        "compute": (flops - attention) / (hw.flops * eff.matmul),
        "attention": executed / (hw.flops * eff.attention),
    }
    busy = parts["compute"] + parts["attention"]
    parts["bubble"] = busy * bubble / (1 - bubble)
    compute = busy + parts["bubble"]
    hidden = 0.0
    links = pre.links.setdefault(hw, {})  # this hardware's, looked up once per estimate
    for key, volume in traffic.items():
        axis = key.split("/")[0]
        if axis not in links:
            links[axis] = _bandwidth(axis, pre.layout, hw)
        bandwidth = links[axis]
        if not bandwidth:
            continue
        if axis in CRITICAL_AXES:
            seconds = volume / bandwidth * eff.exposed.get(axis, 1.0)
            parts[f"exposed/{axis}"] = parts.get(f"exposed/{axis}", 0.0) + seconds
        else:
            hidden += volume / bandwidth
    edge = hidden / math.ceil(pre.config.layers / pre.layout.pp)
    if hidden:
        parts["exposed/overlapped"] = edge + max(0.0, hidden - edge - compute)
    return parts


def _bandwidth(axis: str, layout: Layout, hw: Hardware) -> float:
    """Bytes/s of the links an axis's collectives run on: within a host or across hosts.

    ``"host"`` is the link to the host's memory (remat ``"offload"``).
    """
    if axis == "host":
        return hw.host_bandwidth
    degrees = {"fsdp": layout.fsdp, "context": layout.cp, "expert": layout.ep}
    parts = axis.split("+")
    fast = axis == "model" or (
        all(p in degrees for p in parts)
        and hw.devices_per_host % (layout.tp * math.prod(degrees[p] for p in parts)) == 0
    )
    return hw.intra_host_bandwidth if fast else hw.inter_host_bandwidth


def _warnings(c, plans, layout, per_device) -> tuple[str, ...]:
    found = [f"{p.path}: {p.why}" for p in plans if p.why]
    if layout.pp > 1 and c.layers % layout.pp:
        slots = _stage_slots(c.layers, layout.pp)
        found.append(
            f"{c.layers} layers do not divide {layout.pp} pipeline stages: stages get "
            f"{c.layers // layout.pp} or {c.layers // layout.pp + 1} layers, and the stack is "
            f"stored padded to {slots} slots ({slots - c.layers} masked; build it with "
            f"Pipeline.num_slots({c.layers}) layers and give the step num_layers={c.layers})"
        )
    if _xla_step(layout) and layout.fsdp > 1:
        found.append(
            "The layout uses two of tp, cp and ep, so the step runs XLA's partitioning, which "
            "all-reduces the FSDP gradients instead of reduce-scattering them."
        )
    whole = [p for p in plans if not any(p.spec)]
    replicated = sum(p.params_per_device for p in whole)
    if layout.devices > 1 and replicated > 0.05 * per_device:
        largest = sorted(whole, key=lambda p: -p.params_per_device)[:3]
        names = ", ".join(p.path for p in largest) + (", ..." if len(whole) > 3 else "")
        found.append(
            f"Parameters kept whole on every device ({names}) hold "
            f"{replicated / per_device:.0%} of each device's parameter bytes."
        )
    return tuple(found)


#: The rows sorted dispatch's exchange moves per row routed to another device: rounds of 1/64
#: of an even share per pair, half a round of rounding on average (a balanced router).
ROUNDING = 1 + 1 / 128
