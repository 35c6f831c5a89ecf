"""The report as text: a table that fits a terminal, repeated layers grouped, each reason once."""

from __future__ import annotations

import dataclasses
import re
import textwrap
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

from substrax.mesh import Reason
from substrax_flax._resolve import VariableSharding

__all__ = [
    "WIDTH",
    "Group",
    "compact_table",
    "format_bytes",
    "group_by_layer",
    "group_rows",
    "wrap",
]

#: Columns of the default table (``ShardingReport.table()``).
WIDTH = 120

_COLUMNS = ("path", "n", "shape", "logical names", "spec", "per device", "notes")
_NUMBER = re.compile(r"^\d+$")
T = TypeVar("T")


def format_bytes(count: float) -> str:
    """``count`` bytes in B, KiB, MiB, GiB or TiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.2f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


@dataclasses.dataclass(frozen=True)
class Group:
    """Variables that differ only in a layer number: ``blocks/0-3/attn/kernel``.

    Attributes:
      path: The paths, the layer numbers written as ranges.
      rows: The variables, in report order.
    """

    path: str
    rows: tuple[VariableSharding, ...]


def _key(row: VariableSharding) -> tuple:
    reasons = tuple(_reason_text(r) for r in row.reasons)
    return row.shape, row.dtype, row.logical_names, tuple(row.spec), row.rule, reasons


def _ranges(numbers: Sequence[int]) -> str:
    """``0-3`` for 0, 1, 2, 3; ``0-1,4`` for 0, 1, 4."""
    spans: list[list[int]] = []
    for n in sorted(set(numbers)):
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)


def _group_path(paths: Sequence[str]) -> str:
    split = [path.split("/") for path in paths]
    if len(paths) == 1:
        return paths[0]
    parts = []
    for i, part in enumerate(split[0]):
        seen = {p[i] for p in split}
        parts.append(part if len(seen) == 1 else _ranges([int(p) for p in seen]))
    return "/".join(parts)


def group_by_layer(
    items: Sequence[T], path_of: Callable[[T], str], same: Callable[[T], Hashable]
) -> list[tuple[str, list[T]]]:
    """Items whose paths differ only in numeric parts (layer numbers) and agree in ``same``.

    Args:
      items: The items, in order.
      path_of: An item's ``/``-joined path.
      same: What the items of a group share besides their path's shape.

    Returns:
      ``(path with its layer numbers as ranges, members)`` in the order of each group's
      first item; an item unlike any other is a group of one.
    """
    groups: dict[tuple, list[T]] = {}
    for item in items:
        parts = tuple("#" if _NUMBER.match(p) else p for p in path_of(item).split("/"))
        groups.setdefault((parts, same(item)), []).append(item)
    return [(_group_path([path_of(m) for m in members]), members) for members in groups.values()]


def group_rows(rows: Sequence[VariableSharding]) -> list[Group]:
    """Rows that differ only in numeric path parts (layer numbers), grouped.

    Args:
      rows: The report's rows.

    Returns:
      The groups in the order of their first row; a variable unlike any other is a group
      of one.
    """
    return [
        Group(path, tuple(members))
        for path, members in group_by_layer(rows, lambda row: row.path, _key)
    ]


def _reason_text(reason: Reason) -> str:
    """A reason without its dimension number (the logical name says which)."""
    name = f"{reason.logical_name}: " if reason.logical_name else ""
    return f"{name}{reason.detail}"


def _names(names: tuple | None) -> str:
    if not names:
        return "-"
    return "(" + ", ".join("-" if n is None else str(n) for n in names) + ")"


def _spec(spec: Sequence) -> str:
    def entry(e):
        if e is None:
            return "-"
        return e if isinstance(e, str) else "+".join(e)

    return "(" + ", ".join(entry(e) for e in spec) + ")" if len(spec) else "()"


def _shorten(text: str, width: int) -> str:
    if len(text) <= width:
        return text
    keep = max(width - 3, 2)
    return text[: keep // 2] + "..." + text[len(text) - (keep - keep // 2) :]


def compact_table(rows: Sequence[VariableSharding], width: int = WIDTH) -> list[str]:
    """The rows as a table of at most ``width`` columns, then the notes it refers to.

    Args:
      rows: The report's rows.
      width: The widest line allowed.

    Returns:
      The lines: header, rule, one line per :func:`group_rows` group, and each distinct
      reason once as a numbered note.
    """
    notes: dict[str, int] = {}
    cells = []
    for group in group_rows(rows):
        row = group.rows[0]
        marks = []
        for reason in row.reasons:
            text = _reason_text(reason)
            marks.append(str(notes.setdefault(text, len(notes) + 1)))
        cells.append(
            [
                group.path,
                str(len(group.rows)),
                str(row.shape),
                _names(row.logical_names),
                _spec(row.spec),
                format_bytes(row.bytes_per_device),
                ",".join(dict.fromkeys(marks)),
            ]
        )
    table = [list(_COLUMNS), *cells]
    widths = [max(len(r[i]) for r in table) for i in range(len(_COLUMNS))]
    excess = sum(widths) + 2 * (len(widths) - 1) - width
    for column in (0, 3):  # the path, then the logical names, give up what is too wide
        if excess <= 0:
            break
        cut = min(excess, widths[column] - 12)
        if cut > 0:
            widths[column] -= cut
            excess -= cut
    lines = [
        "  ".join(_shorten(c, w).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in table
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for text, number in notes.items():
        lines.extend(wrap(f"{number}. {text}", width, indent=" " * (len(str(number)) + 2)))
    return lines


def wrap(text: str, width: int = WIDTH, indent: str = "  ") -> list[str]:
    """``text`` wrapped to ``width`` columns, continued lines indented."""
    return textwrap.wrap(text, width, subsequent_indent=indent, break_on_hyphens=False) or [""]
