"""Per-variable sharding decisions: logical names through rules, or a strategy, or replication."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any, Literal

import jax
from jax.sharding import PartitionSpec

from substrax import warn_user
from substrax.mesh import (
    DeviceMeshManager,
    MeshRules,
    MultiDimensionalStrategy,
    Reason,
    Resolution,
    ShardingStrategy,
    as_axes,
    spec_entry,
)
from substrax_flax._state import logical_names, shape_and_dtype, typed_spec, variables

__all__ = [
    "Resolver",
    "VariableSharding",
    "as_rules",
    "make_row",
    "without_axes",
]

Rules = MeshRules | Iterable[tuple[str, Any]] | None
Strategy = ShardingStrategy | MultiDimensionalStrategy | None
UnknownNames = Literal["error", "replicate"]
Indivisible = Literal["move", "replicate"]
INDIVISIBLE = ("move", "replicate")


@dataclasses.dataclass(frozen=True)
class VariableSharding:
    """How one variable is laid out: one row of a :class:`ShardingReport`.

    Attributes:
      path: The variable's path in ``nnx.state(model)``, such as ``"blocks/mlp/up/kernel"``.
      shape: The global shape.
      dtype: The dtype's name.
      logical_names: The logical axis names from the Flax metadata (None when unannotated).
      rule: What decided the spec: the rules that matched (``"embed->model"``), the strategy,
        or ``"none"``.
      spec: The PartitionSpec.
      bytes_total: Bytes of the whole variable.
      bytes_per_device: Bytes of one device's shard.
      reasons: Why dimensions were left replicated, one :class:`~substrax.mesh.Reason` each
        (``kind`` says which: no rule, mesh axis already used, not divisible, below a
        strategy's size threshold, ...).
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    logical_names: tuple[str | None, ...] | None
    rule: str
    spec: PartitionSpec
    bytes_total: int
    bytes_per_device: int
    reasons: tuple[Reason, ...] = ()


def make_row(
    path: str,
    variable: Any,
    spec: PartitionSpec,
    mesh: Any,
    *,
    names: tuple[str | None, ...] | None,
    rule: str,
    reasons: tuple[Reason, ...],
) -> VariableSharding:
    """A :class:`VariableSharding` for ``variable`` laid out by ``spec`` on ``mesh``."""
    shape, dtype = shape_and_dtype(variable)
    sizes = dict(mesh.shape)
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    shard_shape = [
        dim // math.prod(sizes[a] for a in as_axes(entry))
        for dim, entry in zip(shape, entries, strict=True)
    ]
    itemsize = getattr(dtype, "itemsize", 0)
    return VariableSharding(
        path=path,
        shape=shape,
        dtype=str(dtype),
        logical_names=names,
        rule=rule,
        spec=spec,
        bytes_total=math.prod(shape) * itemsize,
        bytes_per_device=math.prod(shard_shape) * itemsize,
        reasons=reasons,
    )


def single_device_mesh(rules: MeshRules | None) -> Any:
    """A mesh over the first device with every axis ``rules`` names, each of size 1."""
    axes = sorted(rules.mesh_axes()) if rules is not None else []
    shape = {axis: 1 for axis in axes} or {"data": 1}
    return DeviceMeshManager.create_device_mesh(shape, jax.devices()[:1])


def as_rules(rules: Rules, mesh: Any) -> MeshRules:
    """Rules as a :class:`MeshRules`, validated against ``mesh`` unless it is None.

    None means "logical names are mesh axis names" (Flax's behaviour without rules).

    Raises:
      TypeError: If ``rules`` is neither a MeshRules, pairs, nor None.
      ValueError: If a rule names a mesh axis that ``mesh`` lacks.
    """
    if rules is None:
        rules = MeshRules.from_pairs((axis, axis) for axis in mesh.axis_names)
    elif not isinstance(rules, MeshRules):
        if isinstance(rules, (str, bytes)) or not isinstance(rules, Iterable):
            raise TypeError(
                "rules must be a MeshRules, Flax-style pairs [(logical, mesh_axis), ...] or "
                f"None, got {rules!r}."
            )
        rules = MeshRules.from_pairs(rules)
    return rules if mesh is None else rules.validate(mesh)


def without_axes(spec: PartitionSpec, drop: set[str]) -> PartitionSpec:
    """``spec`` with the mesh axes in ``drop`` removed from every entry."""
    return PartitionSpec(*(spec_entry(a for a in as_axes(e) if a not in drop) for e in spec))


class Resolver:
    """Decides the spec of each variable of a state on one mesh.

    Args:
      mesh: A ``Mesh`` or ``AbstractMesh``; None means one device (a mesh of size-1 axes, so
        that code written for a mesh runs in a plain unit test). With neither mesh nor rules,
        logical names are not resolved at all.
      rules: ``MeshRules``, Flax-style pairs, or None (logical names are mesh axis names).
      strategy: Gives unannotated variables a spec; None replicates them.
      strict: Raise instead of warning when a dimension does not divide its mesh axes.
      unknown_names: ``"error"`` raises on a logical name the rules do not know;
        ``"replicate"`` replicates that dimension with a warning.
      indivisible: What an annotated dimension does with mesh axes it does not divide:
        ``"move"`` (the default) puts them on the largest dimension they divide
        (:meth:`~substrax.mesh.Resolution.move_left_out`, a ``moved`` reason says where;
        the axes of a ``"layers"`` dimension stay);
        ``"replicate"`` leaves the array replicated over them, with a warning. ``strict``
        raises either way.
      source: Where the rules came from, for messages (``"layout 'fsdp'"``).
    """

    def __init__(
        self,
        mesh: Any,
        rules: Rules = None,
        strategy: Strategy = None,
        *,
        strict: bool = False,
        unknown_names: UnknownNames = "error",
        indivisible: Indivisible = "move",
        source: str = "the rules",
    ):
        if unknown_names not in ("error", "replicate"):
            raise ValueError(
                f"unknown_names must be 'error' or 'replicate', got {unknown_names!r}."
            )
        if indivisible not in INDIVISIBLE:
            raise ValueError(f"indivisible must be one of {INDIVISIBLE}, got {indivisible!r}.")
        if strategy is not None and not isinstance(
            strategy, (ShardingStrategy, MultiDimensionalStrategy)
        ):
            raise TypeError(
                "strategy must be a ShardingStrategy, a MultiDimensionalStrategy or None, "
                f"got {strategy!r}."
            )
        self.ignore_names = mesh is None and rules is None
        self.no_rules = rules is None
        if mesh is None:
            mesh = single_device_mesh(None if rules is None else as_rules(rules, None))
        self.mesh = mesh
        if rules is not None and not isinstance(rules, (MeshRules, str, bytes)):
            rules = list(rules) if isinstance(rules, Iterable) else rules
        self.rules = as_rules(rules, mesh)
        # Explicit-style models name mesh axes in their specs: a name the rules do not give
        # that is an axis of the mesh means that axis (the rules win where both exist).
        given = _given_names(rules, self.rules)
        self._table = self.rules.extend(
            **{axis: axis for axis in mesh.axis_names if axis not in given}
        )
        self.strategy = strategy
        self.strict = strict
        self.unknown_names = unknown_names
        self.indivisible = indivisible
        self.source = source

    def rows(
        self, state: Any, layers: dict[str, str] | None = None
    ) -> tuple[VariableSharding, ...]:
        """One :class:`VariableSharding` per variable of ``state``, in tree order.

        ``layers`` maps a variable's path to the kind of layer that holds it (see
        :func:`substrax_flax._state.layer_kinds`), for strategies that use it.
        """
        layers = layers or {}
        return tuple(
            self.variable(path, variable, layers.get(path)) for path, variable in variables(state)
        )

    def variable(self, path: str, variable: Any, layer: str | None = None) -> VariableSharding:
        """The sharding of one variable, warning (once) where it replicates what was asked.

        Raises:
          ValueError: On an annotation of the wrong length, a repeated or unknown logical
            name, or (strict) a dimension that does not divide its mesh axes.
        """
        shape, _ = shape_and_dtype(variable)
        names = logical_names(variable, path)
        if names is None:  # Explicit style: the spec lives in the array's type
            names = typed_spec(variable)
        replicated = ((),) * len(shape)
        if self.ignore_names:
            resolution, rule = Resolution(replicated), "no mesh"
        elif names is not None:
            resolution, rule = self._from_names(path, shape, names), _rule_text(names, self._table)
            if self.indivisible == "move" and not self.strict:  # strict raises on the original
                resolution = resolution.move_left_out(shape, self.mesh)
        elif self.strategy is not None:
            resolution = self.strategy.resolve(shape, self.mesh, name=path, layer=layer)
            resolution = dataclasses.replace(
                resolution, reasons=tuple(_in_words(r) for r in resolution.reasons)
            )
            rule = strategy_words(self.strategy)
        else:
            reasons = (Reason("no_annotation", None, None, (), "no annotation and no strategy: "
                              "replicated"),) if shape else ()  # fmt: skip
            resolution, rule = Resolution(replicated, reasons), "none"
        self._warn(path, shape, resolution)
        return make_row(path, variable, resolution.spec, self.mesh, names=names, rule=rule,
                        reasons=resolution.reasons)  # fmt: skip

    def _from_names(self, path: str, shape: tuple[int, ...], names: tuple[Any, ...]) -> Resolution:
        padded = ()
        if len(names) < len(shape):  # Flax pads a short annotation with None
            detail = (
                f"{len(names)} names {names} for {len(shape)} dimensions: padded with None, "
                "as Flax does"
            )
            padded = (Reason("padded", None, None, (), detail),)
            names = names + (None,) * (len(shape) - len(names))
        self._check_known(path, shape, names)
        try:
            resolution = self._table.resolve(
                *names, shape=shape, mesh=self.mesh, unknown_names=self.unknown_names
            )
        except ValueError as error:
            raise ValueError(f"Variable {path!r} of shape {shape}: {error}") from None
        return dataclasses.replace(resolution, reasons=padded + resolution.reasons)

    def _check_known(self, path: str, shape: tuple[int, ...], names: tuple[Any, ...]) -> None:
        """Raises on a name neither the rules nor the mesh know, saying which rule to add.

        Raises:
          ValueError: With ``unknown_names="error"``, naming the rules' source, the mesh's
            axes and the pairs that would map the name.
        """
        table = self._table.as_dict()
        unknown = [n for e in names for n in as_axes(e) if n is not None and n not in table]
        if not unknown or self.unknown_names != "error":
            return
        name, axes = unknown[0], tuple(self.mesh.axis_names)
        if self.source.startswith("layout"):  # the user never wrote these rules
            keep = f"rules=layout.param_rules.extend({name}=None) keeps the layout's names"
        else:
            keep = f"rules.extend({name}=None) adds it to yours"
        raise ValueError(
            f"Variable {path!r} of shape {shape}: {name!r} (in {names}) is neither a logical "
            f"name of {self.source} ({list(self.rules.logical_names)}) nor an axis of the "
            f"mesh ({axes}). A model that carries its own mesh-axis specs, written for a mesh "
            f"with the axis {name!r}, needs a rule for it: rules=[({name!r}, None)] replicates "
            f"that dimension, rules=[({name!r}, {axes[0]!r})] shards it over {axes[0]!r}, and "
            f"{keep}; or pass unknown_names='replicate' to replicate every unknown name."
        )

    def _warn(self, path: str, shape: tuple[int, ...], resolution: Resolution) -> None:
        """One warning per variable for what it asked and did not get (strict: an error)."""
        problems = resolution.of_kind("indivisible", "unknown_name")
        if self.no_rules and math.prod(dict(self.mesh.shape).values()) > 1:  # names, no rules
            hint = ": rules=None means logical names are mesh axis names; pass rules= or layout="
            unmapped = resolution.of_kind("unmapped")
            problems += tuple(dataclasses.replace(r, detail=r.detail + hint) for r in unmapped)
        if not problems:
            return
        message = (
            f"Variable {path!r} of shape {shape}: "
            + "; ".join(str(reason) for reason in problems)
            + f". It is laid out as {resolution.spec}."
        )
        if self.strict and any(r.kind != "unknown_name" for r in problems):
            raise ValueError(f"{message} (strict=True).")
        warn_user(message)


def _given_names(rules: Rules, resolved: MeshRules) -> set[str]:
    """The logical names the user gave a rule (a ``MeshRules`` field left at None is not).

    Pairs give their names; a ``MeshRules`` its extra names and the fields it maps to axes.
    """
    if isinstance(rules, MeshRules):
        return {name for name, axes in resolved.as_dict().items()
                if axes is not None or name in dict(resolved.extra)}  # fmt: skip
    return set(resolved.as_dict()) if rules is None else {pair[0] for pair in rules}


def _rule_text(names: tuple[Any, ...], rules: MeshRules) -> str:
    table = rules.as_dict()
    parts = [f"{name}->{table.get(name, '?')}" for entry in names for name in as_axes(entry)]
    return ", ".join(parts) or "none"


_WORDS = {
    "DataParallelStrategy": "dp",
    "FSDPStrategy": "fsdp",
    "TensorParallelStrategy": "tp",
    "PipelineParallelStrategy": "pp",
}


def _in_words(reason: Reason) -> Reason:
    """``reason`` with a strategy's class name (``"FSDPStrategy: ..."``) in the report's words.

    ``"FSDPStrategy: 63 elements are below min_elements 256"`` over ``data`` reads
    ``"fsdp over data: 63 elements are below min_elements 256"``, as the rule column says it.
    """
    kind, sep, detail = reason.detail.partition(": ")
    if not sep or kind not in _WORDS:
        return reason
    over = f" over {'+'.join(reason.axes)}" if reason.axes else ""
    return dataclasses.replace(reason, detail=f"{_WORDS[kind]}{over}: {detail}")


def strategy_words(strategy: Any) -> str:
    """A strategy as the report's rule column says it: ``"fsdp over data + tp over model"``."""
    parts = getattr(strategy, "strategies", None)
    if isinstance(parts, dict):
        return " + ".join(strategy_words(part) for part in parts.values())
    kind = _WORDS.get(type(strategy).__name__, type(strategy).__name__)
    axis = getattr(strategy, "axis_name", None)
    return f"{kind} over {axis}" if axis else kind
