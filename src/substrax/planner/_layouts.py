"""The layouts a device count allows: every combination of the degrees the strategies permit."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from substrax.layout import Layout
from substrax.planner._architectures import TransformerConfig

__all__ = ["MIN_CONTEXT_TOKENS", "STRATEGIES", "layouts"]

#: What :func:`layouts` may combine: the degrees, and ZeRO over the replicas.
STRATEGIES = ("dp", "fsdp", "tp", "pp", "zero", "cp", "ep")

#: The fewest tokens of a sequence a context-parallel device holds in :func:`layouts`.
MIN_CONTEXT_TOKENS = 1024


def layouts(
    devices: int,
    config: TransformerConfig,
    *,
    devices_per_host: int = 8,
    strategies: Sequence[str] = STRATEGIES,
    seq: int | None = None,
) -> list[Layout]:
    """Every layout of ``devices`` that the strategies allow.

    Tensor parallelism stays within a host (its degree divides ``devices_per_host``: a group
    of 6 on hosts of 8 would span two hosts), pipelines have at most one stage per layer, and every
    size divides the device count. Expert parallelism divides a mixture of experts' experts;
    context parallelism needs ``seq`` and leaves each device at least
    :data:`MIN_CONTEXT_TOKENS` tokens in ``2 x cp`` whole chunks. Each is a
    :class:`substrax.layout.Layout` on axes ``pipe``, ``data``, ``fsdp``, ``expert``,
    ``context`` and ``model`` (:meth:`~substrax.layout.Layout.from_degrees`): the same object
    the Flax adapter applies.

    Args:
      devices: The device count.
      config: The architecture (its layer count bounds the pipeline, its experts ep).
      devices_per_host: Devices per host; tensor-parallel degrees divide it.
      strategies: Which of ``dp``, ``fsdp``, ``tp``, ``pp``, ``cp`` and ``ep`` may exceed
        1, and whether layouts with replicas (and no fsdp, cp or ep) also come as ``zero`` 1
        and 2 (optimizer state, and gradients, sharded over the replicas).
      seq: The sequence length (None: no context parallelism).

    Returns:
      The layouts.

    Raises:
      ValueError: If ``devices`` is not positive or a strategy is unknown.
    """
    if devices < 1:
        raise ValueError(f"devices must be positive, got {devices}.")
    unknown = set(strategies) - set(STRATEGIES)
    if unknown:
        raise ValueError(
            f"Unknown strategies {sorted(unknown)}; choose from {', '.join(STRATEGIES)}."
        )
    divisors = [d for d in range(1, devices + 1) if devices % d == 0]

    def allowed(strategy: str, degree: int) -> bool:
        return degree == 1 or strategy in strategies

    tps = [d for d in divisors if devices_per_host % d == 0 and allowed("tp", d)]
    pps = [d for d in divisors if d <= config.layers and allowed("pp", d)]
    eps = [d for d in divisors if allowed("ep", d) and (d == 1 or _divides(d, config.experts))]
    cps = [d for d in divisors if allowed("cp", d) and (d == 1 or _splits(seq, d))]
    found = []
    for tp, pp, ep, cp in itertools.product(tps, pps, eps, cps):
        if devices % (tp * pp * ep * cp):
            continue
        rest = devices // (tp * pp * ep * cp)
        for fsdp in (d for d in divisors if rest % d == 0):
            dp = rest // fsdp
            if allowed("fsdp", fsdp) and allowed("dp", dp):
                found.append(Layout.from_degrees(pp=pp, dp=dp, fsdp=fsdp, ep=ep, cp=cp, tp=tp))
                if "zero" in strategies and dp > 1 and fsdp == ep == cp == 1:
                    found += [Layout.from_degrees(pp=pp, dp=dp, tp=tp, zero=z) for z in (1, 2)]
    return found


def _divides(ep: int, experts: int) -> bool:
    return experts > 0 and experts % ep == 0


def _splits(seq: int | None, cp: int) -> bool:
    """Whether ``cp`` devices can split a sequence of ``seq`` in zigzag order, usefully."""
    return seq is not None and seq % (2 * cp) == 0 and seq // cp >= MIN_CONTEXT_TOKENS
