"""ShardingReport: one row per variable, totals against the ideal, and warnings."""

from __future__ import annotations

import html
import math
from typing import Any

from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from substrax.mesh import Reason, as_axes
from substrax_flax._plan import ModelPlan, plan_of
from substrax_flax._report_table import WIDTH, compact_table, format_bytes, wrap
from substrax_flax._resolve import VariableSharding
from substrax_flax._shortfall import large_replicated, replicated
from substrax_flax._state import is_variable, logical_names, shape_and_dtype, variables

__all__ = ["ShardingReport", "sharding_report"]

#: A report warns when fully replicated variables hold more than this share of all bytes.
REPLICATED_SHARE = 0.05

_COLUMNS = ("path", "shape", "dtype", "logical names", "rule", "spec", "total", "per device", "why")


def _mesh_axes(spec: PartitionSpec) -> set[str]:
    return {axis for entry in spec for axis in as_axes(entry)}


class ShardingReport:
    """How every variable of a model (or optimizer) is laid out, with totals and warnings.

    ``str(report)`` is a plain-text table of at most 120 columns: variables that differ only
    in a layer number share a row (``blocks/0-3/wq``, with their count), and each reason is
    written once, as a numbered note. ``report.table(full=True)`` has every variable and
    column (dtype, rule, total bytes); in a notebook the report renders as an HTML table.
    ``report.summary()`` is one line to paste into an issue.

    Attributes:
      rows: One :class:`VariableSharding` per variable.
      mesh: The mesh the variables are laid out on (None if none is known).
      bytes_total: Bytes of all variables.
      bytes_per_device: Bytes one device holds.
      devices: Devices of the mesh.
      ideal_bytes_per_device: ``bytes_total / devices``: every byte stored once.
      ratio_to_ideal: ``bytes_per_device / ideal_bytes_per_device`` (1.0 is perfect; a model
        left entirely replicated on 8 devices reads 8.0).
      devices_sharded_over: Devices of the mesh axes that any variable is sharded over.
      ratio_over_used_axes: ``bytes_per_device`` over ``bytes_total / devices_sharded_over``:
        how well the axes that are used are used (1.0 for pure data parallelism).
      replicated_bytes: Bytes of the variables that are fully replicated.
      warnings: On a multi-device mesh, fully replicated variables over 1 MiB, and fully
        replicated variables together over 5% of all bytes.
    """

    def __init__(
        self, rows: tuple[VariableSharding, ...], mesh: Any = None, layout: str | None = None
    ):
        """Builds the report and its totals.

        Args:
          rows: One :class:`VariableSharding` per variable.
          mesh: The mesh, for the totals; None when unknown (everything on one device).
          layout: The layout's label (``"fsdp 8"``), for the summary; None when there is none.
        """
        self.rows = tuple(rows)
        self.mesh = mesh
        self.layout = layout
        sizes = dict(mesh.shape) if mesh is not None else {}
        used = set().union(*(_mesh_axes(row.spec) for row in self.rows)) if self.rows else set()
        self.bytes_total = sum(row.bytes_total for row in self.rows)
        self.bytes_per_device = sum(row.bytes_per_device for row in self.rows)
        self.devices = math.prod(sizes.values()) if sizes else 1
        self.devices_sharded_over = math.prod(sizes[axis] for axis in used)
        self.ideal_bytes_per_device = self.bytes_total / self.devices
        total = self.bytes_total or 1
        self.ratio_to_ideal = self.bytes_per_device / (total / self.devices)
        self.ratio_over_used_axes = self.bytes_per_device / (total / self.devices_sharded_over)
        whole = [row for row in self.rows if replicated(row)]
        self.replicated_bytes = sum(row.bytes_total for row in whole)
        self.warnings = self._warnings(whole) if self.devices > 1 else ()

    def _warnings(self, whole: list[VariableSharding]) -> tuple[str, ...]:
        found = [
            f"{row.path} ({format_bytes(row.bytes_total)}) is fully replicated"
            + (f": {'; '.join(map(str, row.reasons))}" if row.reasons else "")
            for row in large_replicated(whole)
        ]
        share = self.replicated_bytes / self.bytes_total if self.bytes_total else 0.0
        if share > REPLICATED_SHARE:
            largest = sorted(whole, key=lambda row: -row.bytes_total)[:3]
            found.append(
                f"fully replicated variables hold {share:.0%} of the bytes "
                f"({format_bytes(self.replicated_bytes)} on each of {self.devices} devices; "
                f"largest: {', '.join(row.path for row in largest)})"
            )
        return tuple(found)

    def row(self, path: str) -> VariableSharding:
        """The row of the variable at ``path``.

        Args:
          path: A variable path such as ``"blocks/mlp/up/kernel"``.

        Returns:
          Its :class:`VariableSharding`.

        Raises:
          KeyError: If no variable has that path; the message lists a few that do.
        """
        for row in self.rows:
            if row.path == path:
                return row
        raise KeyError(f"No variable at {path!r}. Paths: {[r.path for r in self.rows][:8]} ...")

    def _cells(self) -> list[tuple[str, ...]]:
        return [
            (
                row.path,
                str(row.shape),
                row.dtype,
                str(row.logical_names) if row.logical_names else "-",
                row.rule,
                str(tuple(row.spec)) if len(row.spec) else "()",
                format_bytes(row.bytes_total),
                format_bytes(row.bytes_per_device),
                "; ".join(map(str, row.reasons)),
            )
            for row in self.rows
        ]

    def summary(self) -> str:
        """The totals in one line.

        Returns:
          Total bytes, bytes per device, the ideal and their ratio.
        """
        where = f"{self.layout}, " if self.layout else ""
        mesh = f"mesh {dict(self.mesh.shape)}, " if self.mesh is not None else ""
        return (
            f"{where}{mesh}{len(self.rows)} variables: total {format_bytes(self.bytes_total)}, "
            "per device "
            f"{format_bytes(self.bytes_per_device)}, ideal "
            f"{format_bytes(self.ideal_bytes_per_device)} (over the mesh's {self.devices} "
            f"devices), ratio {self.ratio_to_ideal:.3f} ({self.ratio_over_used_axes:.3f} over the "
            f"{self.devices_sharded_over} devices of the axes used)"
        )

    def table(self, full: bool = False) -> str:
        """The report as text.

        Args:
          full: Every variable on its own line with every column (dtype, rule, total bytes,
            reasons in full), however wide; False: at most 120 columns, layers grouped and
            each reason once.

        Returns:
          The table, the summary line and the warnings.
        """
        if full:
            cells = [_COLUMNS, *self._cells()]
            widths = [max(len(row[i]) for row in cells) for i in range(len(_COLUMNS))]
            lines = [
                "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells
            ]
            lines.insert(1, "  ".join("-" * w for w in widths))
            lines.append(self.summary())
            lines.extend(f"warning: {w}" for w in self.warnings)
        else:
            lines = compact_table(self.rows, WIDTH)
            lines.extend(wrap(self.summary()))
            for warning in self.warnings:
                lines.extend(wrap(f"warning: {warning}"))
        return "\n".join(line.rstrip() for line in lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return f"ShardingReport({len(self.rows)} variables; {self.summary()})"

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in _COLUMNS)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>"
            for cells in self._cells()
        )
        notes = "".join(f"<li>{html.escape(w)}</li>" for w in self.warnings)
        return (
            f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
            f"<p>{html.escape(self.summary())}</p>" + (f"<ul>{notes}</ul>" if notes else "")
        )


def _live_row(path: str, variable: Any, planned: VariableSharding | None) -> VariableSharding:
    value = variable.get_value() if is_variable(variable) else variable
    shape, dtype = shape_and_dtype(variable)
    sharding = getattr(value, "sharding", None)
    spec = sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()
    shard_shape = sharding.shard_shape(shape) if sharding is not None else shape
    itemsize = getattr(dtype, "itemsize", 0)
    rule, reasons = ("-", ())
    if planned is not None:
        rule, reasons = planned.rule, planned.reasons
        if tuple(planned.spec) != tuple(spec):
            detail = f"differs from the plan, which had {planned.spec}"
            drift = Reason("drifted", None, None, (), detail)
            reasons = (drift, *reasons)
    return VariableSharding(
        path=path,
        shape=shape,
        dtype=str(dtype),
        logical_names=logical_names(variable, path),
        rule=rule,
        spec=spec,
        bytes_total=math.prod(shape) * itemsize,
        bytes_per_device=math.prod(shard_shape) * itemsize,
        reasons=reasons,
    )


def sharding_report(model_or_state: Any) -> ShardingReport:
    """A report of how every variable is laid out.

    For a live model, optimizer or state the report shows the actual shardings of the arrays;
    for one that substrax created or sharded, the rule and reasons come from its plan, and a
    variable whose sharding drifted from the plan says so.

    Args:
      model_or_state: A :class:`ModelPlan`, an ``nnx.Module``, an ``nnx.Optimizer`` (any
        ``nnx.Pytree``) or an ``nnx.State``.

    Returns:
      A :class:`ShardingReport`.

    Raises:
      TypeError: For anything else.
    """
    if isinstance(model_or_state, ModelPlan):
        plan = model_or_state
        return ShardingReport(plan.rows, plan.mesh, plan.layout_label)
    if isinstance(model_or_state, nnx.Pytree):
        state = nnx.state(model_or_state)
    elif isinstance(model_or_state, nnx.State):
        state = model_or_state
    else:
        raise TypeError(
            "sharding_report expects a ModelPlan, an nnx.Module, an nnx.Optimizer or an nnx.State, "
            "got "
            f"{type(model_or_state).__name__}."
        )
    recorded = plan_of(model_or_state)
    layout = None
    if isinstance(recorded, ModelPlan):
        layout, recorded = recorded.layout_label, recorded.rows
    planned = {row.path: row for row in recorded or ()}
    rows, mesh = [], None
    for path, variable in variables(state):
        rows.append(_live_row(path, variable, planned.get(path)))
        value = variable.get_value() if is_variable(variable) else variable
        sharding = getattr(value, "sharding", None)
        if mesh is None and isinstance(sharding, NamedSharding):
            mesh = sharding.mesh
    return ShardingReport(tuple(rows), mesh, layout)
