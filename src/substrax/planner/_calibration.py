"""Published training runs the planner is calibrated against, and the fit of its efficiencies.

Each :class:`PublishedRun` is a configuration people trained and reported, with its source,
its layout, its batch and what it measured. :func:`ratios` estimates each with the planner,
fixed to the published layout, and :func:`fit` finds the :class:`Efficiency` that brings the
estimates closest to the measurements (``benchmarks/planner_published.py`` prints both).

Settings a source leaves open are chosen as its framework's defaults and said so per row:

- torchtitan's rows (``docs/performance.md`` and its async-TP benchmark) train with FSDP2's
  mixed precision (float32 parameters, bf16 compute: ``"mixed"``), AdamW, and the
  activation checkpointing named; the rows run without torch.compile (the 8B FSDP rows and
  405B) compute its loss, ``cross_entropy(pred.float(), labels)``, eagerly in float32
  (``loss="float32"``), the async-TP benchmark's (compiled) rows as one fused program;
- Megatron-LM's weak-scaling rows (its README: GPT models, vocabulary 131,072, sequence
  4,096, H100s, the distributed optimizer: ZeRO-1 over the replicas, micro-batches of one
  sequence, interleaved pipelines) keep bf16 parameters and gradients (``"bf16"``; their
  float32 master copy lives sharded in the distributed optimizer, as the moments do) and
  report model TFLOP/s per GPU; the step time is the model's
  FLOPs (Megatron's count: 6 per weight per token and the full attention square) over that
  rate. The README's table of their shapes is an image: each model's layers and width here
  are the standard GPT shapes (``ffn = 4 h``, untied head) that give its parameter count, as
  the 177B row's GPT-3 shape does exactly.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Sequence

from substrax.layout import Layout
from substrax.planner._architectures import TransformerConfig, architecture, transformer_leaves
from substrax.planner._efficiency import Efficiency
from substrax.planner._estimate import Candidate, Hardware, Workload, evaluate
from substrax.planner._hardware import HARDWARE
from substrax.planner._rank import plan

__all__ = ["PUBLISHED", "PublishedRun", "fit", "rank", "ratios", "summary"]

_TORCHTITAN = "torchtitan docs/performance.md (Llama 3, H100)"
_ASYNC_TP = "torchtitan async-TP benchmark, vanilla TP row"
_MEGATRON = "Megatron-LM README, weak scaling on H100"

#: What each framework's layouts are made of: torchtitan's FSDP2 (HSDP: replicas of FSDP
#: groups), tensor, pipeline and context parallelism; Megatron-LM's data parallelism with
#: its distributed optimizer (ZeRO), tensor, pipeline and context parallelism.
_TORCHTITAN_LAYOUTS = ("dp", "fsdp", "tp", "pp", "cp")
_MEGATRON_LAYOUTS = ("dp", "zero", "tp", "pp", "cp")


def _gpt(layers: int, width: int, heads: int) -> TransformerConfig:
    return TransformerConfig(
        layers=layers, d_model=width, heads=heads, kv_heads=heads, head_dim=width // heads,
        ffn=4 * width, vocab=131072, gated=False,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class PublishedRun:
    """One published training run.

    Attributes:
      name: A short label.
      source: Where it was published.
      config: The architecture.
      degrees: The layout's degrees (:meth:`substrax.layout.Layout.from_degrees`).
      batch: Sequences per step.
      seq: Tokens per sequence.
      remat: The activation checkpointing it ran (substrax's name for it).
      precision: Its precision, as :class:`~substrax.planner.Workload` names it.
      memory_gb: Device memory in GB (10^9 bytes).
      tokens_per_device_s: Its measured tokens per second per device, or
      model_tflops: its measured model TFLOP/s per device (Megatron's count).
      microbatches: Gradient-accumulation steps or pipeline microbatches (0: none).
      schedule: The pipeline's schedule.
      chunks: Its chunks of layers per stage.
      reserved_gib: Device memory the source reports in use, GiB, when it does.
      loss: How its loss holds the logits (:data:`~substrax.planner._estimate.LOSSES`).
      strategies: What its framework could have chosen (:data:`~substrax.planner.STRATEGIES`
        names): the candidates its published layout is ranked among.
    """

    name: str
    source: str
    config: TransformerConfig
    degrees: dict
    batch: int
    seq: int
    remat: str
    precision: str = "mixed"
    memory_gb: int = 80
    tokens_per_device_s: float = 0.0
    model_tflops: float = 0.0
    microbatches: int = 0
    schedule: str = "zb-h1"
    chunks: int = 1
    reserved_gib: float = 0.0
    strategies: tuple[str, ...] = ()
    loss: str = "fused"

    @property
    def layout(self) -> Layout:
        """The published layout."""
        return Layout.from_degrees(**self.degrees)

    @property
    def workload(self) -> Workload:
        """What one of its steps does.

        Tensor parallelism with sequence parallelism, as Megatron-LM and torchtitan run it.
        """
        return Workload(
            batch_tokens=self.batch * self.seq, seq=self.seq, precision=self.precision,
            optimizer="adamw", remat=self.remat, microbatches=self.microbatches,
            schedule=self.schedule, chunks=self.chunks, sequence_parallel=True, loss=self.loss,
        )  # fmt: skip

    def hardware(self, efficiency: Efficiency | None = None) -> Hardware:
        """The H100 profile with this run's memory (and ``efficiency`` when given)."""
        h100 = dataclasses.replace(HARDWARE["h100"], memory_bytes=self.memory_gb * 10**9)
        return h100 if efficiency is None else dataclasses.replace(h100, efficiency=efficiency)

    @property
    def step_s(self) -> float:
        """The measured seconds per step."""
        devices, tokens = self.layout.devices, self.batch * self.seq
        if self.tokens_per_device_s:
            return tokens / (self.tokens_per_device_s * devices)
        c = self.config
        weights = sum(math.prod(leaf.shape) for leaf in transformer_leaves(c))
        weights -= c.vocab * c.d_model + c.positions * c.d_model  # lookups are no products
        flops = tokens * (6 * weights + 12 * c.layers * c.d_model * self.seq)
        return flops / (self.model_tflops * 1e12 * devices)


PUBLISHED = (
    PublishedRun("Llama 3 8B, fsdp 8", _TORCHTITAN, architecture("llama3-8b"), {"fsdp": 8},
                 16, 8192, "selective", memory_gb=96, tokens_per_device_s=5762,
                 reserved_gib=82.4, strategies=_TORCHTITAN_LAYOUTS, loss="float32"),
    PublishedRun("Llama 3 8B, fsdp 128", _TORCHTITAN, architecture("llama3-8b"),
                 {"fsdp": 128}, 256, 8192, "selective", memory_gb=96,
                 tokens_per_device_s=5605, reserved_gib=67.0,
                 strategies=_TORCHTITAN_LAYOUTS, loss="float32"),
    PublishedRun("Llama 3 8B, fsdp 8 x tp 8", _ASYNC_TP, architecture("llama3-8b"),
                 {"fsdp": 8, "tp": 8}, 96, 8192, "selective", tokens_per_device_s=4378,
                 strategies=_TORCHTITAN_LAYOUTS),
    PublishedRun("Llama 3 70B, fsdp 32 x tp 8", _TORCHTITAN, architecture("llama3-70b"),
                 {"fsdp": 32, "tp": 8}, 512, 8192, "full", tokens_per_device_s=597.3,
                 strategies=_TORCHTITAN_LAYOUTS),
    PublishedRun("Llama 3 405B, fsdp 16 x tp 8", _TORCHTITAN, architecture("llama3-405b"),
                 {"fsdp": 16, "tp": 8}, 32, 8192, "full", tokens_per_device_s=109,
                 strategies=_TORCHTITAN_LAYOUTS, loss="float32"),
    PublishedRun("GPT 7.1B, tp 2 x dp 48", _MEGATRON, _gpt(30, 4096, 32),
                 {"tp": 2, "dp": 48, "zero": 1}, 192, 4096, "selective", "bf16",
                 model_tflops=465.9, microbatches=4, strategies=_MEGATRON_LAYOUTS),
    PublishedRun("GPT 70B, tp 8 x pp 2 x dp 48", _MEGATRON, _gpt(84, 8192, 64),
                 {"tp": 8, "pp": 2, "dp": 48, "zero": 1}, 384, 4096, "selective", "bf16",
                 model_tflops=419.7, microbatches=8, schedule="interleaved", chunks=2,
                 strategies=_MEGATRON_LAYOUTS),
    PublishedRun("GPT 177B, tp 8 x pp 6 x dp 48", _MEGATRON, _gpt(96, 12288, 96),
                 {"tp": 8, "pp": 6, "dp": 48, "zero": 1}, 1152, 4096, "selective", "bf16",
                 model_tflops=432.8, microbatches=24, schedule="interleaved", chunks=2,
                 strategies=_MEGATRON_LAYOUTS),
    PublishedRun("GPT 462B, tp 8 x pp 16 x dp 48", _MEGATRON, _gpt(112, 18432, 144),
                 {"tp": 8, "pp": 16, "dp": 48, "zero": 1}, 3072, 4096, "selective", "bf16",
                 model_tflops=459.9, microbatches=64, schedule="interleaved", chunks=7,
                 strategies=_MEGATRON_LAYOUTS),
)  # fmt: skip
"""The calibration set: the issue's published runs, with their sources."""


def estimate(run: PublishedRun, efficiency: Efficiency | None = None) -> Candidate:
    """The planner's estimate of ``run`` at its published layout."""
    config = run.config
    return evaluate(config, transformer_leaves(config), run.layout, run.workload,
                    run.hardware(efficiency))  # fmt: skip


def rank(run: PublishedRun, strategies: Sequence[str] | None = None) -> dict:
    """Where the planner ranks ``run``'s published layout among its own candidates.

    The planner searches the layouts of ``run``'s devices that ``strategies`` allow (default:
    its framework's, ``run.strategies``) with the run's model, batch, remat policy and
    pipeline schedule, and the microbatches searched: a count only divides the batch of the
    layout it was published for (Megatron's microbatches of one sequence are the most the
    search tries on a pipeline).

    Args:
      run: The published run.
      strategies: The strategies to search, or None for the run's framework's.

    Returns:
      ``{"rank", "candidates", "pick", "pick_over_published"}``: the published layout's
      1-based rank (0 when it is not among them), the candidate count, the planner's pick
      and the pick's estimated time over the published layout's.
    """
    workload = dataclasses.replace(run.workload, microbatches=None)
    result = plan(run.config, run.layout.devices, run.hardware(), workload,
                  strategies=strategies or run.strategies)  # fmt: skip
    labels = [c.layout.label for c in result.candidates]
    index = labels.index(run.layout.label) if run.layout.label in labels else None
    mine = estimate(run) if index is None else result.candidates[index]
    return {
        "rank": 0 if index is None else index + 1,
        "candidates": len(labels),
        "pick": result.best.layout.label,
        "pick_over_published": result.best.time_s / mine.time_s,
    }


def ratios(efficiency: Efficiency | None = None) -> list[float]:
    """Estimated over published step time, per run of :data:`PUBLISHED`."""
    return [estimate(run, efficiency).time_s / run.step_s for run in PUBLISHED]


def summary(values: list[float]) -> dict[str, float]:
    """``median``, ``worst`` (the ratio farthest from 1, either way) and ``spread``."""
    worst = max(values, key=lambda r: max(r, 1 / r))
    return {
        "median": statistics.median(values),
        "worst": worst,
        "spread": max(abs(r - 1) for r in values),
    }


def fit() -> Efficiency:
    """The :class:`Efficiency` that brings :data:`PUBLISHED`'s estimates closest to what ran.

    Three numbers are fitted: one share of peak for compute (matrix products and attention
    alike) and the exposed shares of tensor-parallel and pipeline traffic. The fit minimises
    the worst ``|log(estimate / published)|`` (every row counts, none is traded for the
    median), then the sum of their squares. Compute and the exposed parts are linear in
    ``1 / share`` and the exposures, so each run is estimated four times and a grid (shares
    0.300 to 0.600 by 0.005, exposures by 0.05) is searched on those parts.

    Returns:
      The fitted efficiency.
    """
    none = {"model": 0.0, "pipe": 0.0}
    parts = []
    for run in PUBLISHED:
        base = estimate(run, Efficiency(exposed=none)).time_s
        tp = estimate(run, Efficiency(exposed={**none, "model": 1.0})).time_s - base
        pp = estimate(run, Efficiency(exposed={**none, "pipe": 1.0})).time_s - base
        half = estimate(run, Efficiency(matmul=0.5, attention=0.5, exposed=none)).time_s
        compute = half - base  # (1 / 0.5 - 1) x the compute, its bubble included
        parts.append((base - compute, compute, tp, pp, run.step_s))
    best = None
    for milli in range(300, 601, 5):
        share = milli / 1000
        for model, pipe in itertools.product(range(21), range(21)):
            logs = [
                math.log((rest + compute / share + model / 20 * tp + pipe / 20 * pp) / published)
                for rest, compute, tp, pp, published in parts
            ]
            key = (round(max(map(abs, logs)), 4), sum(x * x for x in logs))
            if best is None or key < best[0]:
                best = (key, share, model / 20, pipe / 20)
    _, share, model, pipe = best
    return Efficiency(matmul=share, attention=share, exposed={"model": model, "pipe": pipe})
