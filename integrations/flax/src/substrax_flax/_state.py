"""Walking nnx.State trees: variable paths, logical names from Flax metadata, mapping leaves."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
from flax import nnx

__all__ = [
    "METADATA_KEYS",
    "constrain_state",
    "is_variable",
    "logical_names",
    "map_variables",
    "variables",
]

#: Where Flax keeps logical axis names, newest first: ``out_sharding`` (flax >= 0.12.4),
#: ``sharding_names`` (0.11.2 - 0.12.3), ``sharding`` (<= 0.11.0).
METADATA_KEYS = ("out_sharding", "sharding_names", "sharding")


def is_variable(node: Any) -> bool:
    """Whether ``node`` is an ``nnx.Variable`` (the leaves of an ``nnx.State`` walk)."""
    return isinstance(node, nnx.Variable)


def path_str(path: tuple[Any, ...]) -> str:
    """A key path as ``"layers/0/attn/kernel"``."""
    return jax.tree_util.keystr(path, simple=True, separator="/")


def variables(state: Any) -> Iterator[tuple[str, nnx.Variable]]:
    """``(path, variable)`` for every variable of a state, in tree order."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(state, is_leaf=is_variable):
        if is_variable(leaf):
            yield path_str(path), leaf


def map_variables(fn: Callable[[str, nnx.Variable], Any], state: Any) -> Any:
    """A state of the same structure whose variables hold ``fn(path, variable)`` as value."""

    def visit(path, leaf):
        return leaf.replace(fn(path_str(path), leaf)) if is_variable(leaf) else leaf

    return jax.tree_util.tree_map_with_path(visit, state, is_leaf=is_variable)


def logical_names(variable: nnx.Variable, path: str) -> tuple[str | None, ...] | None:
    """The logical axis names of a variable from its metadata, or None when it has none.

    Accepts every metadata key Flax has used (see :data:`METADATA_KEYS`). An empty annotation
    (``()`` on a scalar) counts as none, as in Flax.

    Raises:
      ValueError: If an entry is neither a string nor None.
    """
    metadata = variable.get_metadata()
    names = next((metadata[key] for key in METADATA_KEYS if metadata.get(key) is not None), None)
    if names is None or len(tuple(names)) == 0:
        return None
    names = tuple(names)
    for name in names:
        if name is not None and not isinstance(name, str):
            raise ValueError(
                f"Variable {path!r} has logical axis names {names}; each entry must be a "
                f"logical name (str) or None, got {name!r}."
            )
    return names


def shape_and_dtype(variable: nnx.Variable) -> tuple[tuple[int, ...], Any]:
    """Shape and dtype of a variable's value (abstract or concrete)."""
    value = variable.get_value()
    return tuple(getattr(value, "shape", ())), getattr(value, "dtype", None)


def _constrain(value: jax.Array, sharding: jax.sharding.NamedSharding) -> jax.Array:
    explicit = jax.sharding.AxisType.Explicit in tuple(sharding.mesh.axis_types)
    if explicit:
        return jax.sharding.reshard(value, sharding)
    return jax.lax.with_sharding_constraint(value, sharding)


def constrain_state(state: Any, shardings: Any) -> Any:
    """Inside ``jit``: every value of ``state`` laid out as in ``shardings``.

    Uses ``with_sharding_constraint`` on Auto meshes and ``jax.sharding.reshard`` on meshes
    with Explicit axes (where a constraint may name only Auto axes).
    """
    return jax.tree.map(_constrain, state, shardings)
