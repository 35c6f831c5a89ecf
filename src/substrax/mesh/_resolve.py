"""The one resolver: logical names (or a strategy's proposal) to a PartitionSpec, with reasons.

Every part of substrax that turns names into specs comes here: :meth:`MeshRules.resolve`,
:func:`partition_spec_for_names`, the strategies, the Flax adapter, the planner and the
pipeline. The policy, in one place:

1. A logical name repeated within one array is an error; an unknown name is an error, or
   (``unknown_names="replicate"``) a replicated dimension with an ``unknown_name`` reason.
2. Dimensions are resolved in order. A mesh axis shards at most one dimension: an axis that an
   earlier dimension already holds is left out (``axis_used``; a tuple rule keeps its other
   axes), as Flax Linen's ``logical_to_mesh_axes`` does (first wins).
3. With a shape and a mesh, a dimension keeps the longest prefix of its remaining axes whose
   product divides it (``indivisible`` names the axes left out). An axis left out for
   divisibility stays free for later dimensions.
4. :func:`move_left_out` (the Flax adapter's default for annotated variables) then moves the
   axes still left out to the largest dimension they divide, preferring one no axis shards
   (``moved`` names where they went); with none, they stay ``indivisible``.

The resolver is arithmetic on axis names and imports no jax: a :class:`Resolution` keeps each
dimension's axes as a tuple and builds its ``PartitionSpec`` when asked (the planner resolves
thousands of leaves without ever importing jax).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from jax.sharding import PartitionSpec

__all__ = [
    "REASON_KINDS",
    "Reason",
    "Resolution",
    "UnknownNames",
    "as_axes",
    "axis_sizes",
    "move_left_out",
    "partition_spec",
    "resolve_axes",
    "resolve_names",
    "spec_entry",
]

UnknownNames = Literal["error", "replicate"]

#: Why a dimension is not sharded as asked. ``unknown_name``: the rules do not know the
#: logical name; ``unmapped``: its rule maps it to no mesh axis; ``axis_used``: an earlier
#: dimension holds the mesh axis; ``indivisible``: the dimension does not divide the axes;
#: ``below_threshold``: a strategy's size threshold; ``by_design``: the strategy never shards
#: such an array; ``no_annotation``: neither logical names nor a strategy; ``drifted``: a live
#: array's sharding differs from its plan; ``padded``: an annotation shorter than the array's
#: rank was padded with None (as Flax does); ``moved``: axes its dimension could not take went
#: to another dimension (:func:`move_left_out`), so the array is still sharded over them.
REASON_KINDS = (
    "unknown_name",
    "unmapped",
    "axis_used",
    "indivisible",
    "below_threshold",
    "by_design",
    "no_annotation",
    "drifted",
    "padded",
    "moved",
)


#: Logical names whose axes :func:`move_left_out` leaves in place wherever substrax moves axes
#: (the adapter's ``indivisible="move"`` and the planner): a stack's layer dimension is its
#: pipeline stage, and a pipeline pads an uneven stack instead.
STAY = ("layers",)


@dataclasses.dataclass(frozen=True)
class Reason:
    """Why one dimension (or a whole array) is not sharded as asked.

    Attributes:
      kind: One of :data:`REASON_KINDS`.
      dim: The dimension, or None when the reason is about the whole array.
      logical_name: The dimension's logical name, if it has one.
      axes: The mesh axes that were asked for but not applied.
      detail: The explanation in words.
    """

    kind: str
    dim: int | None
    logical_name: str | None
    axes: tuple[str, ...]
    detail: str

    def __post_init__(self) -> None:
        if self.kind not in REASON_KINDS:
            raise ValueError(f"Unknown reason kind {self.kind!r}; valid: {REASON_KINDS}.")

    def __str__(self) -> str:
        if self.dim is None:
            return self.detail
        name = f" ({self.logical_name})" if self.logical_name else ""
        return f"dim {self.dim}{name}: {self.detail}"


@dataclasses.dataclass(frozen=True)
class Resolution:
    """The spec of one array, and why any dimension is not sharded as asked.

    Attributes:
      axes: The mesh axes sharding each dimension (``()``: replicated), one tuple per dimension:
        :attr:`spec` as :func:`as_axes` reads it.
      reasons: One :class:`Reason` per dimension (or array) left replicated, or partly so.
      requested: The mesh axes asked for, per dimension, before any were left out.
    """

    axes: tuple[tuple[str, ...], ...]
    reasons: tuple[Reason, ...] = ()
    requested: tuple[tuple[str, ...], ...] = ()

    @property
    def spec(self) -> PartitionSpec:
        """The ``PartitionSpec``: one entry per dimension (:func:`spec_entry` of its axes)."""
        return partition_spec(*(spec_entry(axes) for axes in self.axes))

    def of_kind(self, *kinds: str) -> tuple[Reason, ...]:
        """The reasons of the given kinds.

        Args:
          *kinds: Kinds from :data:`REASON_KINDS`.

        Returns:
          The matching reasons, in dimension order.
        """
        return tuple(reason for reason in self.reasons if reason.kind in kinds)

    def move_left_out(
        self, shape: Sequence[int], mesh: Any, *, stay: Collection[str] = STAY
    ) -> Resolution:
        """This resolution with the axes left out for divisibility moved where they divide.

        See :func:`substrax.mesh._resolve.move_left_out` (the policy's fourth rule).

        Args:
          shape: The array's shape.
          mesh: A ``Mesh``, ``AbstractMesh`` or ``{axis: size}``.
          stay: Logical names whose axes never move (default :data:`STAY`).

        Returns:
          The new :class:`Resolution` (``moved`` reasons say where each axis went).
        """
        return move_left_out(self, shape, mesh, stay=stay)

    @property
    def moved_axes(self) -> tuple[str, ...]:
        """The mesh axes that :meth:`move_left_out` put on another dimension than asked."""
        return tuple(a for reason in self.of_kind("moved") for a in reason.axes)


def as_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axis names of one ``PartitionSpec`` entry or rule value, as a tuple.

    The one normaliser substrax uses wherever a spec entry, a rule's value or an argument such
    as ``batch_axes`` may be None, one axis name or a sequence of names.

    Args:
      entry: None, an axis name, or a sequence of axis names.

    Returns:
      ``()`` for None, ``(entry,)`` for a name, else ``tuple(entry)``.
    """
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def spec_entry(axes: Sequence[str]) -> Any:
    """The ``PartitionSpec`` entry for ``axes``, the inverse of :func:`as_axes`.

    Args:
      axes: Mesh axis names, in order.

    Returns:
      None for no axes, the name for one, else the tuple of names.
    """
    axes = tuple(axes)
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def partition_spec(*entries: Any) -> PartitionSpec:
    """``jax.sharding.PartitionSpec(*entries)``, importing jax only when a spec is built."""
    from jax.sharding import PartitionSpec

    return PartitionSpec(*entries)


def axis_sizes(mesh: Any) -> dict[str, int]:
    """``{axis_name: size}`` of a ``Mesh``, an ``AbstractMesh`` or a mapping."""
    shape = mesh if isinstance(mesh, Mapping) else dict(mesh.shape)
    return {name: int(size) for name, size in shape.items()}


def _divisible_prefix(size: int, axes: tuple[str, ...], sizes: Mapping[str, int]) -> int:
    """How many leading ``axes`` have a product that divides ``size``."""
    for end in range(len(axes), 0, -1):
        if size % math.prod(sizes[a] for a in axes[:end]) == 0:
            return end
    return 0


def resolve_axes(
    requested: Sequence[Sequence[str]],
    shape: Sequence[int] | None = None,
    mesh: Any = None,
    *,
    names: Sequence[str | None] | None = None,
    reasons: Sequence[Reason] = (),
) -> Resolution:
    """The spec of an array whose dimensions ask for ``requested`` mesh axes.

    Applies the policy of the module docstring: first wins, then (with ``shape`` and ``mesh``)
    the longest divisible prefix.

    Args:
      requested: Mesh axes asked for, one tuple per dimension (empty: replicated).
      shape: The array's shape; None skips the divisibility check.
      mesh: A ``Mesh``, ``AbstractMesh`` or ``{axis: size}``; needed with ``shape``.
      names: Logical names per dimension, for the reasons.
      reasons: Reasons found before (unknown names, a strategy's choices), kept first.

    Returns:
      The :class:`Resolution`.

    Raises:
      ValueError: If ``shape`` and ``requested`` differ in length, or an axis is not in
        ``mesh``.
    """
    requested = tuple(tuple(axes) for axes in requested)
    sizes = axis_sizes(mesh) if mesh is not None else None
    if shape is not None and len(shape) != len(requested):
        raise ValueError(f"{len(requested)} dimensions requested for shape {tuple(shape)}.")
    used: set[str] = set()
    entries, found = [], list(reasons)
    for dim, axes in enumerate(requested):
        name = names[dim] if names is not None else None
        free = tuple(a for a in axes if a not in used)
        if len(free) < len(axes):
            taken = tuple(a for a in axes if a in used)
            detail = f"mesh axes {taken} already shard an earlier dimension"
            found.append(Reason("axis_used", dim, name, taken, detail))
        kept = free
        if shape is not None and sizes is not None and free:
            _check_axes(free, sizes)
            kept = free[: _divisible_prefix(int(shape[dim]), free, sizes)]
            if len(kept) < len(free):
                product = math.prod(sizes[a] for a in free)
                found.append(Reason("indivisible", dim, name, free[len(kept):],
                                    f"{shape[dim]} is not divisible by mesh axes {free} of size "
                                    f"{product}; {free[len(kept):]} left out"))  # fmt: skip
        used.update(kept)
        entries.append(kept)
    return Resolution(tuple(entries), tuple(found), requested)


def move_left_out(
    resolution: Resolution, shape: Sequence[int], mesh: Any, *, stay: Collection[str] = STAY
) -> Resolution:
    """Moves the axes a dimension could not take to the largest dimension they divide.

    A weight annotated ``("expert", "embed", "mlp")`` with 128 experts on an FSDP axis of 256
    leaves the axis out of its first dimension; stored replicated over it, it would take 256x
    its share. Each ``indivisible`` reason's axes go instead to the largest dimension that
    they divide and that no axis shards (the first of equals), or failing that to the largest
    sharded dimension that they divide together with its axes (appended after them). The
    reason becomes ``moved`` and says where; with no such dimension it stays.

    Where the array is *used*, a caller that gathers over these axes (FSDP axes) loses
    nothing; tensor axes moved off their dimension shard storage only, and a step gathers
    them where the array is used (:attr:`Reason.axes` of the ``moved`` reasons).

    Args:
      resolution: A resolution of an array of ``shape``.
      shape: The array's shape.
      mesh: A ``Mesh``, ``AbstractMesh`` or ``{axis: size}``.
      stay: Logical names whose axes never move (default :data:`STAY`): a stack's
        ``"layers"`` dimension is its pipeline stage, which a pipeline pads instead.

    Returns:
      The resolution with its axes moved (itself when nothing was left out).
    """
    sizes = axis_sizes(mesh)
    entries = list(resolution.axes) + [()] * (len(shape) - len(resolution.axes))
    reasons = []
    for reason in resolution.reasons:
        movable = reason.kind == "indivisible" and reason.logical_name not in stay
        dim = _destination(reason, entries, shape, sizes) if movable else None
        if dim is None:
            reasons.append(reason)
            continue
        entries[dim] += reason.axes
        detail = (f"{shape[reason.dim]} is not divisible by mesh axes {reason.axes}; moved to "
                  f"dim {dim} ({shape[dim]}), now sharded {spec_entry(entries[dim])}")  # fmt: skip
        reasons.append(dataclasses.replace(reason, kind="moved", detail=detail))
    return dataclasses.replace(resolution, axes=tuple(entries), reasons=tuple(reasons))


def _destination(
    reason: Reason, entries: list[tuple[str, ...]], shape: Sequence[int], sizes: Mapping[str, int]
) -> int | None:
    """Where :func:`move_left_out` puts ``reason.axes``: a free dimension first, or None."""
    if any(a in e for e in entries for a in reason.axes):
        return None  # another dimension took an axis meanwhile
    size = math.prod(sizes[a] for a in reason.axes)

    def divides(dim: int) -> bool:
        return shape[dim] % (size * math.prod(sizes[a] for a in entries[dim])) == 0

    for free in (True, False):
        dims = [d for d in range(len(shape)) if (not entries[d]) == free and divides(d)]
        if dims:
            return max(dims, key=lambda d: (shape[d], -d))
    return None


def _check_axes(axes: tuple[str, ...], sizes: Mapping[str, int]) -> None:
    missing = [a for a in axes if a not in sizes]
    if missing:
        raise ValueError(
            f"Mesh axis {missing[0]!r} is not in the mesh; its axes are {tuple(sizes)}."
        )


def resolve_names(
    table: Mapping[str, Any],
    names: Sequence[str | None],
    shape: Sequence[int] | None = None,
    mesh: Any = None,
    *,
    unknown_names: UnknownNames = "error",
    where: str = "",
) -> Resolution:
    """The spec of an array whose dimensions have logical ``names``, through a rule table.

    An entry may also be a tuple of names (a ``PartitionSpec``-style entry): the dimension asks
    for the axes of each name, in order.

    Args:
      table: Logical name to mesh axes (``MeshRules.as_dict()``).
      names: One logical name (or None, or a tuple of names) per dimension.
      shape: The array's shape; None skips the rank and divisibility checks.
      mesh: A ``Mesh``, ``AbstractMesh`` or ``{axis: size}``; needed with ``shape``.
      unknown_names: ``"error"`` raises on a name ``table`` lacks; ``"replicate"`` leaves that
        dimension replicated with an ``unknown_name`` reason.
      where: What the array is, for error messages (such as ``"Variable 'w'"``).

    Returns:
      The :class:`Resolution`.

    Raises:
      ValueError: If a name is repeated, unknown (with ``unknown_names="error"``), or the
        names and shape differ in length.
      TypeError: If a name is not a string, None or a tuple of strings.
    """
    if unknown_names not in ("error", "replicate"):
        raise ValueError(f"unknown_names must be 'error' or 'replicate', got {unknown_names!r}.")
    names = tuple(names)
    prefix = f"{where}: " if where else ""
    for dim, entry in enumerate(names):
        parts = entry if isinstance(entry, tuple) else (entry,)
        if not all(part is None or isinstance(part, str) for part in parts):
            raise TypeError(
                f"{prefix}logical names must be strings or None (or tuples of strings), got "
                f"{entry!r} ({type(entry).__name__}) for dim {dim} of {names}."
            )
    if shape is not None and len(names) != len(shape):
        raise ValueError(
            f"{prefix}{len(names)} logical names {names} for shape {tuple(shape)} "
            f"({len(shape)} dimensions); give one name (or None) per dimension."
        )
    named = [n for entry in names for n in as_axes(entry)]
    repeated = sorted({n for n in named if named.count(n) > 1})
    if repeated:
        raise ValueError(
            f"{prefix}Logical axis name {repeated[0]!r} appears more than once in {names}; "
            "each dimension of an array needs its own name."
        )
    requested, reasons = [], []
    for dim, entry in enumerate(names):
        axes: tuple[str, ...] = ()
        for name in as_axes(entry):
            if name not in table:
                if unknown_names == "error":
                    raise ValueError(
                        f"{prefix}Unknown logical axis name {name!r}. Known names: "
                        f"{list(table)}. Add it with rules.extend({name}=<mesh axis or None>), "
                        f"or pass unknown_names='replicate' (dim {dim} of {names})."
                    )
                detail = f"logical name {name!r} is not in the rules (rules.extend({name}=...))"
                reasons.append(Reason("unknown_name", dim, name, (), detail))
            elif not as_axes(table[name]):
                detail = "its rule maps it to no mesh axis"
                reasons.append(Reason("unmapped", dim, name, (), detail))
            else:  # a tuple entry may name one mesh axis twice: keep it once
                axes += tuple(a for a in as_axes(table[name]) if a not in axes)
        requested.append(axes)
    labels = [None if e is None else "+".join(as_axes(e)) for e in names]
    return resolve_axes(requested, shape, mesh, names=labels, reasons=reasons)
