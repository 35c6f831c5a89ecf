"""MeshRules: logical axis names mapped onto mesh axes, and the specs and shardings they give."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from substrax.mesh._resolve import Resolution, UnknownNames, as_axes, partition_spec, resolve_names

if TYPE_CHECKING:  # imported where a sharding is made: the planner reads rules without jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

MeshAxes = str | tuple[str, ...] | None

_FIELDS = ("data", "embed", "mlp", "heads")

__all__ = [
    "MeshAxes",
    "MeshRules",
    "create_named_sharding",
    "data_parallel_rules",
    "fsdp_rules",
    "partition_spec_for_names",
]


def _check_mesh_axes(logical: str, value: object) -> MeshAxes:
    """Validates one rule value: a mesh axis name, a tuple of names, or None."""
    if value is None or (isinstance(value, str) and value):
        return value
    if (
        isinstance(value, (tuple, list))
        and value
        and all(isinstance(v, str) and v for v in value)
        and len(set(value)) == len(value)
    ):
        return tuple(value)
    raise ValueError(
        f"Rule for logical axis {logical!r} must be a mesh axis name, a tuple of distinct mesh "
        f"axis names, or None; got {value!r}."
    )


@dataclasses.dataclass(frozen=True)
class MeshRules:
    """Logical-to-physical mesh axis mapping for SPMD sharding.

    Maps logical dimension names to physical mesh axis names, following the pattern from Flax
    NNX FSDP examples. Each value is a mesh axis name, a tuple of mesh axis names (the dimension
    is sharded over their product) or None (replicated). Names beyond the four fields (``vocab``,
    ``kv``, ``layers``, ``seq``, ``experts``, ...) go in ``extra``; :meth:`extend` and
    :meth:`from_pairs` are the convenient ways to set them. Instances are immutable and hashable.

    Attributes:
      data: Mesh axis for the batch/data dimension.
      embed: Mesh axis for embedding dimensions.
      mlp: Mesh axis for MLP hidden dimensions.
      heads: Mesh axis for attention head dimensions.
      extra: Further logical names and their mesh axes, as ``(name, axes)`` pairs (a dict is
        accepted and stored sorted by name).
    """

    data: MeshAxes = dataclasses.field(default=None, kw_only=True)
    embed: MeshAxes = dataclasses.field(default=None, kw_only=True)
    mlp: MeshAxes = dataclasses.field(default=None, kw_only=True)
    heads: MeshAxes = dataclasses.field(default=None, kw_only=True)
    extra: tuple[tuple[str, MeshAxes], ...] = dataclasses.field(default=(), kw_only=True)

    def __post_init__(self) -> None:
        for name in _FIELDS:
            object.__setattr__(self, name, _check_mesh_axes(name, getattr(self, name)))
        extra = self.extra.items() if isinstance(self.extra, Mapping) else self.extra
        pairs = {}
        for pair in extra:
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
                raise ValueError(
                    f"MeshRules.extra entries must be (name, axes) pairs, got {pair!r}."
                )
            name, axes = pair
            if not isinstance(name, str) or not name:
                raise ValueError(f"Logical axis names must be non-empty strings, got {name!r}.")
            if name in _FIELDS or name in pairs:
                raise ValueError(f"Logical axis {name!r} is given twice in MeshRules.")
            pairs[name] = _check_mesh_axes(name, axes)
        object.__setattr__(self, "extra", tuple(sorted(pairs.items())))

    @property
    def logical_names(self) -> tuple[str, ...]:
        """All logical names these rules know, the four fields first."""
        return _FIELDS + tuple(name for name, _ in self.extra)

    def as_dict(self) -> dict[str, MeshAxes]:
        """The rules as a dict from every known logical name to its mesh axes.

        Returns:
          A dict ``{logical_name: mesh_axes}``, the four fields first.
        """
        return {**{name: getattr(self, name) for name in _FIELDS}, **dict(self.extra)}

    def __call__(self, *keys: str | None) -> tuple[MeshAxes, ...]:
        """Look up mesh axes for the given logical dimension names.

        Args:
          *keys: Logical dimension names (must be attributes of MeshRules, or names in
            ``extra``). None stands for an unnamed, replicated dimension.

        Returns:
          Tuple of mesh axis names (or None for unmapped dimensions).

        Raises:
          ValueError: If a key is not a logical name these rules know.
        """
        table = self.as_dict()
        for key in keys:
            if key is not None and key not in table:
                raise ValueError(
                    f"Unknown logical axis name {key!r}. Known names: {list(table)}. Add it "
                    f"with rules.extend({key}=<mesh axis or None>)."
                )
        return tuple(None if key is None else table[key] for key in keys)

    def extend(self, **rules: MeshAxes) -> MeshRules:
        """Returns new rules with more (or changed) logical names.

        Args:
          **rules: Logical name to mesh axes, e.g. ``vocab="model"``, ``layers=None``.

        Returns:
          A new :class:`MeshRules`; these rules are unchanged.

        Raises:
          ValueError: If a value is not a mesh axis name, a tuple of names, or None.
        """
        fields = {name: rules.pop(name) for name in _FIELDS if name in rules}
        extra = {**dict(self.extra), **rules}
        return dataclasses.replace(self, **fields, extra=tuple(extra.items()))

    @classmethod
    def from_pairs(cls, pairs: Iterable[tuple[str, MeshAxes]]) -> MeshRules:
        """Build rules from Flax-style pairs ``[(logical_name, mesh_axes), ...]``.

        Unlike Flax, where a repeated logical name silently takes the last value, a repeated
        name is an error here.

        Args:
          pairs: ``(logical_name, mesh_axes)`` pairs, as given to ``nnx.logical_axis_rules``.

        Returns:
          The equivalent :class:`MeshRules`.

        Raises:
          ValueError: If a pair is malformed or a logical name is repeated.
        """
        table: dict[str, MeshAxes] = {}
        for pair in pairs:
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
                raise ValueError(f"Rule pairs must be (logical_name, mesh_axes), got {pair!r}.")
            name, axes = pair
            if not isinstance(name, str) or not name:
                raise ValueError(
                    f"A rule pair's logical name must be a non-empty string, got {name!r} in "
                    f"{tuple(pair)!r}; pairs are (logical_name, mesh_axes)."
                )
            if name in table:
                raise ValueError(
                    f"Logical axis {name!r} appears twice in the rule pairs "
                    f"({table[name]!r} and {axes!r}); give each name one rule."
                )
            table[name] = axes
        return cls().extend(**table)

    def to_pairs(self) -> tuple[tuple[str, MeshAxes], ...]:
        """The rules as Flax-style pairs, for ``nnx.logical_axis_rules``.

        Returns:
          ``((logical_name, mesh_axes), ...)`` for every known name.
        """
        return tuple(self.as_dict().items())

    def mesh_axes(self) -> frozenset[str]:
        """Every mesh axis name the rules map to.

        Returns:
          The set of mesh axis names used by any rule.
        """
        return frozenset(axis for axes in self.as_dict().values() for axis in as_axes(axes))

    def gathered_over(self, axes: Iterable[str]) -> MeshRules:
        """The rules where parameters are used: ``axes`` removed from every name but the batch's.

        A parameter stored sharded over an axis that also splits the batch (FSDP) is gathered
        before use; these are the rules of that gathered layout, for parameters at the point
        of use and for activations. ``data`` and ``batch`` keep every axis.

        Args:
          axes: The mesh axes to gather over (the FSDP axes).

        Returns:
          New rules; these are unchanged.
        """
        drop = set(axes)

        def gathered(name: str, value: MeshAxes) -> MeshAxes:
            if name in ("data", "batch") or not drop & set(as_axes(value)):
                return value
            return tuple(a for a in as_axes(value) if a not in drop) or None

        return MeshRules().extend(**{n: gathered(n, v) for n, v in self.as_dict().items()})

    def validate(self, mesh: Mesh) -> MeshRules:
        """Checks that every mesh axis the rules name exists in ``mesh``.

        Args:
          mesh: The mesh the rules will be used with (a ``Mesh`` or ``AbstractMesh``).

        Returns:
          These rules, so that the call can be chained.

        Raises:
          ValueError: If a rule names a mesh axis that ``mesh`` lacks.
        """
        for name, axes in self.as_dict().items():
            missing = [axis for axis in as_axes(axes) if axis not in mesh.axis_names]
            if missing:
                raise ValueError(
                    f"Rule {name!r} -> {axes!r} names mesh axis {missing[0]!r}, which the mesh "
                    f"does not have. Mesh axes: {tuple(mesh.axis_names)}."
                )
        return self

    def resolve(
        self,
        *logical_names: str | None,
        shape: tuple[int, ...] | None = None,
        mesh: Mesh | None = None,
        unknown_names: UnknownNames = "error",
    ) -> Resolution:
        """Resolves the logical names of one array's dimensions, explaining what is left out.

        This is substrax's one resolver (see :mod:`substrax.mesh`): a mesh axis shards at most
        one dimension, the first that asks for it (as Flax Linen's ``logical_to_mesh_axes``),
        a tuple rule loses only the axes already used, and with ``shape`` and ``mesh`` each
        dimension keeps the longest prefix of its axes whose product divides it.

        Args:
          *logical_names: One logical name (or None) per array dimension.
          shape: The array's shape, for the rank and divisibility checks.
          mesh: The mesh (``Mesh``, ``AbstractMesh`` or ``{axis: size}``), with ``shape``.
          unknown_names: ``"error"`` raises on a name these rules do not know;
            ``"replicate"`` replicates that dimension and says so in the reasons.

        Returns:
          A :class:`Resolution`: the spec, and a :class:`Reason` per dimension left out.

        Raises:
          ValueError: If a name is repeated or (``unknown_names="error"``) unknown, or the
            names do not match ``shape``'s rank.
        """
        return resolve_names(
            self.as_dict(), logical_names, shape, mesh, unknown_names=unknown_names
        )


def partition_spec_for_names(rules: MeshRules, *logical_names: str | None) -> PartitionSpec:
    """Apply MeshRules to create a PartitionSpec for a tensor.

    Maps logical dimension names through the rules to produce physical mesh axis assignments.
    None as a logical name means a replicated dimension. A mesh axis appears at most once: when
    two dimensions resolve to the same mesh axis, the first keeps it and the later ones are
    replicated (:meth:`MeshRules.resolve` says what was left out, and why).

    Args:
      rules: The MeshRules mapping to apply.
      *logical_names: Logical dimension names for each tensor axis.

    Returns:
      A PartitionSpec with physical mesh axis assignments.

    Raises:
      ValueError: If a logical name is repeated or unknown to ``rules``.
    """
    if not isinstance(rules, MeshRules):
        raise TypeError(f"rules must be a MeshRules, got {type(rules).__name__}.")
    return rules.resolve(*logical_names).spec


def create_named_sharding(mesh: Mesh, *axis_names: MeshAxes) -> NamedSharding:
    """Create a NamedSharding from a mesh and axis names.

    Args:
      mesh: The device mesh.
      *axis_names: Axis names for each dimension. Use None for replicated dimensions, and a
        tuple of names to shard one dimension over several mesh axes. If no axes are provided,
        creates a fully replicated sharding.

    Returns:
      A JAX NamedSharding object.

    Raises:
      ValueError: If a name is not an axis of ``mesh`` or a mesh axis is used twice.
      TypeError: If ``mesh`` is not a ``jax.sharding.Mesh``.
    """
    from jax.sharding import NamedSharding

    from substrax.mesh._devices import check_mesh

    check_mesh(mesh)
    used: list[str] = []
    for entry in axis_names:
        for axis in as_axes(_check_mesh_axes("dimension", entry)):
            if axis not in mesh.axis_names:
                raise ValueError(
                    f"Mesh axis {axis!r} is not in the mesh; its axes are {tuple(mesh.axis_names)}."
                )
            if axis in used:
                raise ValueError(
                    f"Mesh axis {axis!r} is used twice in {axis_names}; each mesh axis may shard "
                    "at most one dimension."
                )
            used.append(axis)
    return NamedSharding(mesh, partition_spec(*axis_names))


def data_parallel_rules(data_axis: str = "data") -> MeshRules:
    """Create MeshRules for pure data-parallel training.

    Shards only the batch dimension across devices; ``embed``, ``mlp`` and ``heads`` stay
    replicated.

    Args:
      data_axis: Name of the mesh axis for data parallelism.

    Returns:
      MeshRules with only the data axis mapped.

    Raises:
      ValueError: If ``data_axis`` is not a non-empty string.
    """
    return MeshRules(data=_axis_name(data_axis, "data_axis"))


def fsdp_rules(data_axis: str = "data", model_axis: str = "model") -> MeshRules:
    """Create MeshRules for Fully Sharded Data Parallel (FSDP) training.

    Shards the batch dimension across the data axis and model weight dimensions (``embed``,
    ``mlp`` and ``heads``) across the model axis. A weight annotated ``("embed", "mlp")`` is
    sharded on its first dimension only, since the first dimension keeps the shared axis.

    Args:
      data_axis: Name of the mesh axis for data parallelism.
      model_axis: Name of the mesh axis for model parallelism.

    Returns:
      MeshRules with data and model axes mapped.

    Raises:
      ValueError: If an axis name is not a non-empty string.
    """
    model_axis = _axis_name(model_axis, "model_axis")
    return MeshRules(
        data=_axis_name(data_axis, "data_axis"), embed=model_axis, mlp=model_axis, heads=model_axis
    )


def _axis_name(value: object, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty mesh axis name, got {value!r}.")
    return value
