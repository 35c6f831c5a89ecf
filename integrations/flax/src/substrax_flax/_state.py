"""Walking nnx.State trees: variable paths, logical names from Flax metadata, mapping leaves."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
from flax import nnx

from substrax.mesh import as_axes
from substrax.spmd import lay_out

__all__ = [
    "METADATA_KEYS",
    "check_filter",
    "constrain_state",
    "is_abstract",
    "is_variable",
    "layer_kinds",
    "logical_names",
    "map_variables",
    "shape_and_dtype",
    "typed_spec",
    "values_by_path",
    "variables",
    "write_back",
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


def is_array(node: Any) -> bool:
    """Whether ``node`` is an array leaf held outside a Variable (an ``nnx.data`` attribute)."""
    return not is_variable(node) and hasattr(node, "shape") and hasattr(node, "dtype")


def is_abstract(tree: Any) -> bool:
    """Whether ``tree`` (a state, a batch) holds ``jax.ShapeDtypeStruct``s: shapes, no data.

    An abstract model (:meth:`~substrax_flax.ModelPlan.abstract_model`) is compiled, never
    run: for a target whose devices this machine does not have (:func:`compile_for`).
    """
    leaves = jax.tree.leaves(tree)
    return bool(leaves) and any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves)


def variables(state: Any) -> Iterator[tuple[str, Any]]:
    """``(path, leaf)`` for every variable of a state, and every bare array, in tree order.

    Bare arrays are the values of ``nnx.data(...)`` attributes: they are part of the model's
    state (and of a checkpoint) without a Variable around them.
    """
    for path, leaf in jax.tree_util.tree_leaves_with_path(state, is_leaf=is_variable):
        if is_variable(leaf) or is_array(leaf):
            yield path_str(path), leaf


def map_variables(fn: Callable[[str, Any], Any], state: Any) -> Any:
    """A state of the same structure whose variables (and bare arrays) hold ``fn(path, leaf)``."""

    def visit(path, leaf):
        if is_variable(leaf):
            return leaf.replace(fn(path_str(path), leaf))
        return fn(path_str(path), leaf) if is_array(leaf) else leaf

    return jax.tree_util.tree_map_with_path(visit, state, is_leaf=is_variable)


def logical_names(variable: Any, path: str) -> tuple[Any, ...] | None:
    """The logical axis names of a variable from its metadata, or None when it has none.

    Accepts every metadata key Flax has used (see :data:`METADATA_KEYS`), as a tuple of names
    or a ``PartitionSpec`` (Explicit-style models name mesh axes there; an entry may be a
    tuple of names). An empty annotation (``()`` on a scalar) counts as none, as in Flax.

    Raises:
      ValueError: If an entry is neither a string, a tuple of strings, nor None.
    """
    if not is_variable(variable):
        return None
    metadata = variable.get_metadata()
    names = next((metadata[key] for key in METADATA_KEYS if metadata.get(key) is not None), None)
    if names is None or len(tuple(names)) == 0:
        return None
    names = tuple(names)
    names = tuple(tuple(n) if isinstance(n, list) else n for n in names)
    for name in names:
        parts = name if isinstance(name, tuple) else (name,)
        if name is not None and not all(isinstance(part, str) for part in parts):
            raise ValueError(
                f"Variable {path!r} has logical axis names {names}; each entry must be a "
                f"logical name (str), a tuple of names, or None, got {name!r}."
            )
    return names


def typed_spec(variable: Any) -> tuple[Any, ...] | None:
    """The mesh axes a variable's value carries in its type, or None.

    Explicit-style model code creates its arrays with the spec in the array's type
    (``init(key, shape, out_sharding=P(None, "model"))`` under ``jax.set_mesh`` with Explicit
    axes), without any metadata; the abstract value (``jax.eval_shape``) and the live array
    both carry it. Only axes that are Explicit count: an Auto axis is not part of a type, so
    an array that merely sits sharded on an Auto mesh says nothing about its plan.

    Returns:
      One entry (None, an axis name or a tuple of names) per dimension, or None when no
      dimension names an Explicit axis.
    """
    value = variable.get_value() if is_variable(variable) else variable
    sharding = getattr(value, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return None
    mesh = sharding.mesh
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    spec = tuple(sharding.spec) + (None,) * (len(getattr(value, "shape", ())) - len(sharding.spec))
    axes = [a for entry in spec for a in as_axes(entry)]
    explicit = jax.sharding.AxisType.Explicit
    if not axes or any(types.get(a) != explicit for a in axes):
        return None
    return spec


def shape_and_dtype(variable: nnx.Variable) -> tuple[tuple[int, ...], Any]:
    """Shape and dtype of a variable's value, or of a bare array (abstract or concrete)."""
    value = variable.get_value() if is_variable(variable) else variable
    return tuple(getattr(value, "shape", ())), getattr(value, "dtype", None)


def layer_kinds(model: Any) -> dict[str, str]:
    """The kind of layer that holds each variable of ``model`` (live or abstract), by path.

    The kind is the owning module's class name (``"Linear"``, ``"Conv"``, ``"Embed"``,
    ``"LayerNorm"``, ...); a projection of an ``nnx.MultiHeadAttention`` is
    ``"MultiHeadAttention.query"`` (``.key``, ``.value``, ``.out``).
    """
    modules = {
        tuple(path): node for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Module)
    }
    kinds = {}
    for path, node in nnx.iter_graph(model):
        if not is_variable(node) or tuple(path[:-1]) not in modules:
            continue
        owner, parent = modules[tuple(path[:-1])], modules.get(tuple(path[:-2]))
        kind = type(owner).__name__
        if isinstance(parent, nnx.MultiHeadAttention):
            kind = f"MultiHeadAttention.{path[-2]}"
        kinds["/".join(map(str, path))] = kind
    return kinds


def values_by_path(tree: Any) -> dict[str, Any]:
    """``{path: value}`` of every leaf of a state-like tree, Variables unwrapped."""
    leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_variable)
    return {path_str(p): leaf.get_value() if is_variable(leaf) else leaf for p, leaf in leaves}


def constrain_state(state: Any, shardings: Any) -> Any:
    """Inside ``jit``: every value of ``state`` laid out as in ``shardings``, matched by path.

    Uses ``with_sharding_constraint`` on Auto meshes and ``jax.sharding.reshard`` on meshes
    with Explicit axes (where a constraint may name only Auto axes). Leaves are matched by
    path, not by tree structure, so a Variable whose metadata differs between two traces
    (``nnx.Param(x, rngs=rngs)`` keeps the Rngs in its metadata) is still matched.
    """
    by_path = values_by_path(shardings)

    def place(path, leaf):
        return lay_out(leaf.get_value() if is_variable(leaf) else leaf, by_path[path])

    return map_variables(place, state)


def write_back(node: Any, before: Any, after: Any) -> None:
    """``nnx.update(node, after)``, where ``before`` is ``node``'s state from ``nnx.split``.

    ``before``'s Variables are ``node``'s own, so each takes its new value (and metadata) in
    place, in one pass over the leaves, as ``nnx.update`` would after walking the graph by
    path (a train step's per-call cost: 0.3 ms against 1.1 for a 5.2M decoder and its adamw
    state). A state with a bare array (an ``nnx.data`` attribute) goes through ``nnx.update``.
    """
    old = jax.tree.leaves(before, is_leaf=is_variable)
    new = jax.tree.leaves(after, is_leaf=is_variable)
    if len(old) != len(new) or not all(map(is_variable, old)) or not all(map(is_variable, new)):
        nnx.update(node, after)
        return
    for variable, value in zip(old, new, strict=True):
        variable.update_from_state(value)


def check_filter(wrt: Any, argument: str = "wrt") -> Any:
    """``wrt`` itself if it is an ``nnx`` filter; else a clear error.

    Args:
      wrt: The value passed as a filter.
      argument: The argument's name, for the message.

    Returns:
      ``wrt``.

    Raises:
      TypeError: If Flax cannot make a filter of it (its own error is garbled for some values).
    """
    try:
        nnx.filterlib.to_predicate(wrt)
    except (TypeError, ValueError):
        raise TypeError(
            f"{argument} must be an nnx filter: a Variable type (nnx.Param, nnx.LoRAParam, ...), "
            f"a tuple of filters, nnx.Not(...), nnx.All(...), or a path string; got {wrt!r}."
        ) from None
    return wrt
