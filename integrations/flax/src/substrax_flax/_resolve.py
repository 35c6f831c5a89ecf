"""Per-variable sharding decisions: logical names through rules, or a strategy, or replication."""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Iterable
from typing import Any, Literal

import jax
from jax.sharding import PartitionSpec

from substrax import ShardingWarning
from substrax.mesh import (
    DeviceMeshManager,
    MeshRules,
    MultiDimensionalStrategy,
    ShardingStrategy,
)
from substrax.mesh._strategy import INDIVISIBLE
from substrax_flax._state import logical_names, shape_and_dtype, variables

__all__ = ["Resolver", "VariableSharding", "as_rules", "make_row"]

Rules = MeshRules | Iterable[tuple[str, Any]] | None
Strategy = ShardingStrategy | MultiDimensionalStrategy | None
UnknownNames = Literal["error", "replicate"]


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
      reasons: Why dimensions were left replicated (no rule, mesh axis already used, not
        divisible, below a strategy's size threshold, ...).
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    logical_names: tuple[str | None, ...] | None
    rule: str
    spec: PartitionSpec
    bytes_total: int
    bytes_per_device: int
    reasons: tuple[str, ...] = ()


def make_row(
    path: str,
    variable: Any,
    spec: PartitionSpec,
    mesh: Any,
    *,
    names: tuple[str | None, ...] | None,
    rule: str,
    reasons: tuple[str, ...],
) -> VariableSharding:
    """A :class:`VariableSharding` for ``variable`` laid out by ``spec`` on ``mesh``."""
    shape, dtype = shape_and_dtype(variable)
    sizes = dict(mesh.shape)
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    shard_shape = [
        dim // math.prod(sizes[a] for a in _axes(entry))
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


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(axes: tuple[str, ...]) -> Any:
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


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
    """

    def __init__(
        self,
        mesh: Any,
        rules: Rules = None,
        strategy: Strategy = None,
        *,
        strict: bool = False,
        unknown_names: UnknownNames = "error",
    ):
        if unknown_names not in ("error", "replicate"):
            raise ValueError(
                f"unknown_names must be 'error' or 'replicate', got {unknown_names!r}."
            )
        if strategy is not None and not isinstance(
            strategy, (ShardingStrategy, MultiDimensionalStrategy)
        ):
            raise TypeError(
                "strategy must be a ShardingStrategy, a MultiDimensionalStrategy or None, "
                f"got {strategy!r}."
            )
        self.ignore_names = mesh is None and rules is None
        if mesh is None:
            mesh = single_device_mesh(None if rules is None else as_rules(rules, None))
        self.mesh = mesh
        self.rules = as_rules(rules, mesh)
        self.strategy = strategy
        self.strict = strict
        self.unknown_names = unknown_names
        self.sizes = {name: int(size) for name, size in dict(mesh.shape).items()}

    def plan(self, state: Any) -> tuple[VariableSharding, ...]:
        """One :class:`VariableSharding` per variable of ``state``, in tree order."""
        return tuple(self.variable(path, variable) for path, variable in variables(state))

    def variable(self, path: str, variable: Any) -> VariableSharding:
        """The sharding of one variable.

        Raises:
          ValueError: On an annotation of the wrong length, a repeated or unknown logical
            name, or (strict) a dimension that does not divide its mesh axes.
        """
        shape, _ = shape_and_dtype(variable)
        names = logical_names(variable, path)
        if self.ignore_names:
            spec, rule, reasons = PartitionSpec(*([None] * len(shape))), "no mesh", ()
        elif names is not None:
            spec, rule, reasons = self._from_names(path, shape, names)
        elif self.strategy is not None:
            spec, rule, reasons = self._from_strategy(path, shape)
        else:
            spec, rule = PartitionSpec(*([None] * len(shape))), "none"
            reasons = ("no annotation and no strategy: replicated",) if shape else ()
        return make_row(path, variable, spec, self.mesh, names=names, rule=rule, reasons=reasons)

    def _from_names(
        self, path: str, shape: tuple[int, ...], names: tuple[str | None, ...]
    ) -> tuple[PartitionSpec, str, tuple[str, ...]]:
        if len(names) != len(shape):
            raise ValueError(
                f"Variable {path!r} of shape {shape} is annotated with {names}: "
                f"{len(names)} logical names for {len(shape)} dimensions."
            )
        named = [n for n in names if n is not None]
        repeated = sorted({n for n in named if named.count(n) > 1})
        if repeated:
            raise ValueError(
                f"Variable {path!r} repeats logical name {repeated[0]!r} in its annotation "
                f"{names}; each dimension needs its own name."
            )
        names, reasons = self._drop_unknown(path, names)
        resolved = self.rules.resolve(*names)
        entries = []
        for dim, axis in enumerate(resolved):
            if axis.dropped:
                reasons.append(
                    f"dim {dim} ({axis.logical_name}): mesh axis {axis.dropped} already used "
                    "by an earlier dimension"
                )
            elif axis.logical_name is not None and not axis.requested:
                reasons.append(f"dim {dim} ({axis.logical_name}): rule maps it to no mesh axis")
            entries.append(_entry(self._divisible(path, shape, dim, axis.mesh_axes, reasons)))
        rule = ", ".join(
            f"{a.logical_name}->{_entry(a.requested)}" for a in resolved if a.logical_name
        )
        return PartitionSpec(*entries), rule or "none", tuple(reasons)

    def _drop_unknown(
        self, path: str, names: tuple[str | None, ...]
    ) -> tuple[tuple[str | None, ...], list[str]]:
        known = self.rules.logical_names
        reasons, kept = [], []
        for dim, name in enumerate(names):
            if name is None or name in known:
                kept.append(name)
                continue
            message = (
                f"Variable {path!r} has logical name {name!r} (dim {dim} of {names}), which the "
                f"rules do not know. Known names: {list(known)}. Add it with "
                f"rules.extend({name}=<mesh axis or None>)"
            )
            if self.unknown_names == "error":
                raise ValueError(f"{message}, or pass unknown_names='replicate'.")
            warnings.warn(f"{message}; replicated.", ShardingWarning, stacklevel=6)
            reasons.append(f"dim {dim} ({name}): unknown logical name")
            kept.append(None)
        return tuple(kept), reasons

    def _divisible(
        self, path: str, shape: tuple[int, ...], dim: int, axes: tuple[str, ...], reasons: list
    ) -> tuple[str, ...]:
        """The longest prefix of ``axes`` whose product divides ``shape[dim]``."""
        for end in range(len(axes), -1, -1):
            product = math.prod(self.sizes[a] for a in axes[:end])
            if shape[dim] % product == 0:
                break
        if end < len(axes):
            message = (
                f"Variable {path!r} of shape {shape}: dim {dim} ({shape[dim]}) {INDIVISIBLE} "
                f"mesh axes {axes} of size "
                f"{math.prod(self.sizes[a] for a in axes)}"
            )
            self._indivisible(message)
            reasons.append(f"dim {dim}: {shape[dim]} {INDIVISIBLE} {axes[end:]}, replicated")
        return axes[:end]

    def _indivisible(self, message: str) -> None:
        if self.strict:
            raise ValueError(f"{message} (strict=True).")
        warnings.warn(f"{message}: replicated.", ShardingWarning, stacklevel=7)

    def _from_strategy(
        self, path: str, shape: tuple[int, ...]
    ) -> tuple[PartitionSpec, str, tuple[str, ...]]:
        spec, notes = self.strategy.spec_for_shape(shape, self.mesh, name=path)
        for note in notes:
            if INDIVISIBLE in note:
                self._indivisible(f"Variable {path!r} of shape {shape}: {note}")
        return spec, type(self.strategy).__name__, tuple(notes)
