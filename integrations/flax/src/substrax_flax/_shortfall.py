"""Bytes a plan stores beyond what its annotations and strategy asked for, and one warning.

A variable *asks* for the mesh axes its logical names (or the strategy) give it. Where a
dimension cannot take them and no other dimension can either (see
:meth:`substrax.mesh.Resolution.move_left_out`), the variable is stored replicated over them:
its ``indivisible`` reasons name those axes. The plan's *asked* bytes per device are what every
variable would hold sharded as asked; a plan that holds more than :data:`TOLERANCE` times that
warns once, at creation, naming the variables that cause it and what would fix each.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from substrax import ShardingWarning, warn_user
from substrax.mesh import as_axes
from substrax_flax._resolve import VariableSharding

__all__ = [
    "LARGE_REPLICATED_BYTES",
    "TOLERANCE",
    "Shortfall",
    "large_replicated",
    "replicated",
    "shortfall",
    "warn_replicated",
    "warn_shortfall",
]

#: A plan whose bytes per device exceed this multiple of the asked bytes warns.
TOLERANCE = 1.10

#: Variables named in the warning, largest excess first.
_NAMED = 5

#: A fully replicated variable larger than this is named: in the report's warnings, and once
#: at creation when the plan shards other variables.
LARGE_REPLICATED_BYTES = 1 << 20


def replicated(row: VariableSharding) -> bool:
    """Whether ``row`` is a variable (not a scalar) whole on every device."""
    return bool(row.shape) and not any(as_axes(entry) for entry in row.spec)


def large_replicated(rows: Sequence[VariableSharding]) -> list[VariableSharding]:
    """The fully replicated ``rows`` over :data:`LARGE_REPLICATED_BYTES`, as given."""
    return [row for row in rows if replicated(row) and row.bytes_total > LARGE_REPLICATED_BYTES]


@dataclasses.dataclass(frozen=True)
class Shortfall:
    """How far a plan's bytes per device are from the bytes its variables asked for.

    Attributes:
      bytes_per_device: Bytes one device holds.
      asked_bytes_per_device: Bytes one device would hold with every variable sharded over
        every mesh axis it asked for.
      rows: The variables stored replicated over axes they asked for, largest excess first,
        as ``(row, excess bytes per device, lost axes)``.
    """

    bytes_per_device: int
    asked_bytes_per_device: float
    rows: tuple[tuple[VariableSharding, float, tuple[str, ...]], ...]

    @property
    def ratio(self) -> float:
        """``bytes_per_device / asked_bytes_per_device`` (1.0 when nothing is lost)."""
        return self.bytes_per_device / self.asked_bytes_per_device if self.bytes_per_device else 1


def shortfall(rows: tuple[VariableSharding, ...], mesh: Any) -> Shortfall:
    """The :class:`Shortfall` of a plan's rows on ``mesh``.

    Args:
      rows: The plan's rows.
      mesh: Its mesh.

    Returns:
      The shortfall.
    """
    sizes = dict(mesh.shape)
    total, asked, lost_rows = 0, 0.0, []
    for row in rows:
        lost = tuple(a for r in row.reasons if r.kind == "indivisible" for a in r.axes)
        ideal = row.bytes_per_device / math.prod(sizes[a] for a in lost)
        total, asked = total + row.bytes_per_device, asked + ideal
        if lost:
            lost_rows.append((row, row.bytes_per_device - ideal, lost))
    lost_rows.sort(key=lambda item: -item[1])
    return Shortfall(total, asked, tuple(lost_rows))


def _fix(row: VariableSharding, lost: tuple[str, ...], sizes: dict[str, int]) -> str:
    degree = math.prod(sizes[a] for a in lost)
    dims = [r for r in row.reasons if r.kind == "indivisible"]
    where = ", ".join(f"dim {r.dim} ({row.shape[r.dim]})" for r in dims if r.dim is not None)
    head = f"{row.path} {row.shape} holds {_mib(row.bytes_per_device)} per device, replicated "
    free = [d for d, n in enumerate(row.shape) if row.spec[d] is None and n % degree == 0]
    if free:  # planned with indivisible="replicate"
        d = max(free, key=lambda d: row.shape[d])
        return (
            f"{head}over {lost} ({where} asked for them), although dim {d} ({row.shape[d]}) "
            "divides them: indivisible='move' (the default) shards it there"
        )
    return (
        f"{head}over {lost}: no dimension divides their {degree} devices ({where} asked for "
        f"them). Pad a dimension to a multiple of {degree}, map its name to fewer axes in the "
        "rules, or use a layout whose degrees divide it"
    )


def _mib(count: float) -> str:
    return f"{count / 2**20:.2f} MiB"


def warn_shortfall(rows: tuple[VariableSharding, ...], mesh: Any, what: str) -> Shortfall:
    """Warns once when the plan holds more than :data:`TOLERANCE` x its asked bytes.

    Args:
      rows: The plan's rows.
      mesh: Its mesh.
      what: What was planned, for the message (``"The model"``).

    Returns:
      The shortfall.
    """
    found = shortfall(rows, mesh)
    if found.ratio <= TOLERANCE:
        return found
    sizes = dict(mesh.shape)
    named = "; ".join(_fix(row, lost, sizes) for row, _, lost in found.rows[:_NAMED])
    more = len(found.rows) - _NAMED
    warn_user(
        f"{what} holds {_mib(found.bytes_per_device)} per device, {found.ratio:.2f}x the "
        f"{_mib(found.asked_bytes_per_device)} its annotations and strategy ask for, because "
        f"some variables are replicated over axes they asked for. {named}"
        + (f"; and {more} more (see the report's 'why' column)." if more > 0 else "."),
        ShardingWarning,
    )
    return found


def warn_replicated(rows: tuple[VariableSharding, ...], mesh: Any, what: str) -> None:
    """Warns once when a plan that shards some variables leaves a large one whole.

    A layout that replicates every parameter by design (``dp``, ZeRO, pipeline stages aside)
    says nothing; one that shards parameters and leaves a variable over
    :data:`LARGE_REPLICATED_BYTES` whole everywhere (its names map to no mesh axis, or no rule
    matched) says which, once, at creation, with the reasons the report gives.

    Args:
      rows: The plan's rows.
      mesh: Its mesh.
      what: What was planned, for the message.
    """
    sizes = dict(mesh.shape)
    if math.prod(sizes.values()) < 2:
        return
    whole = sorted(large_replicated(rows), key=lambda row: -row.bytes_total)
    if not whole or all(replicated(row) for row in rows if row.shape):
        return
    named = "; ".join(
        f"{row.path} {row.shape} ({_mib(row.bytes_total)}"
        + (f": {', '.join(map(str, row.reasons))})" if row.reasons else ", no rule shards it)")
        for row in whole[:_NAMED]
    )
    more = len(whole) - _NAMED
    warn_user(
        f"{what} shards some variables but keeps {len(whole)} large one(s) whole on every "
        f"device: {named}" + (f"; and {more} more" if more > 0 else "") + ". Map their "
        "logical names to mesh axes in the rules (or name them as the layout does: embed, "
        "mlp, heads, vocab, ...); sharding_report(model) shows every row.",
        ShardingWarning,
    )
