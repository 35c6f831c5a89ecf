"""Logical-name sharding constraints for model code, resolved through the active rules."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
from jax.sharding import AxisType, Mesh, NamedSharding

from substrax.mesh import MeshRules, partition_spec_for_names

__all__ = ["active_rules", "constrain", "lay_out", "manual_batch_axes", "use_rules"]

# One stack of active (mesh, rules) entries per context: each thread and each asyncio task
# sees its own (a task starts from a copy of its creator's context).
_ACTIVE: contextvars.ContextVar[tuple] = contextvars.ContextVar("substrax_rules", default=())
# The active rules are part of jax's tracing and compilation cache key: a function jitted and
# traced under one set of rules is traced again under another, never reused.
_TRACE_KEY = jax.make_user_context(default_value=())


@contextlib.contextmanager
def use_rules(
    mesh: Mesh, rules: MeshRules, *, manual_batch_axes: tuple[str, ...] = ()
) -> Iterator[MeshRules]:
    """Makes ``rules`` on ``mesh`` the active rules for :func:`constrain` in this context.

    substrax's train steps activate their compute rules while tracing, so model code can call
    :func:`constrain` without knowing the layout. Contexts nest; the innermost wins. The state
    lives in a ``contextvars.ContextVar``: threads and asyncio tasks do not see each other's
    rules, and leaving contexts out of order removes exactly the entry that is left. The
    active rules are also part of jax's tracing cache key (``jax.make_user_context``): a
    jitted function that calls :func:`constrain` is traced again under other rules instead of
    reusing the layout of the first.

    Args:
      mesh: The device mesh.
      rules: The rules that resolve logical names.
      manual_batch_axes: Batch axes the caller has made manual around the model (each device
        holds its own rows there; the rules no longer name them). Layers whose statistics
        span the batch, such as :func:`~substrax.spmd.experts`' load balance, reduce over
        them.

    Yields:
      ``rules``, validated against ``mesh``.

    Raises:
      ValueError: If a rule names a mesh axis that ``mesh`` lacks.
    """
    rules.validate(mesh)
    entry = (mesh, rules, tuple(manual_batch_axes))
    _ACTIVE.set((*_ACTIVE.get(), entry))
    try:
        with _TRACE_KEY(_ACTIVE.get()):
            yield rules
    finally:
        stack = list(_ACTIVE.get())
        for i in range(len(stack) - 1, -1, -1):  # this entry, wherever it is now
            if stack[i] is entry:
                del stack[i]
                break
        _ACTIVE.set(tuple(stack))


def active_rules() -> tuple[Mesh, MeshRules] | None:
    """The innermost ``(mesh, rules)`` activated by :func:`use_rules`, or None.

    Returns:
      The active mesh and rules, or None outside any :func:`use_rules` context.
    """
    stack = _ACTIVE.get()
    return stack[-1][:2] if stack else None


def manual_batch_axes() -> tuple[str, ...]:
    """The batch axes the innermost :func:`use_rules` context declared manual, or ().

    Returns:
      The axes (inside substrax's manual data-parallel step: its region's batch axes).
    """
    stack = _ACTIVE.get()
    return stack[-1][2] if stack else ()


def constrain(x: jax.Array, *logical_names: str | None) -> jax.Array:
    """Constrains ``x`` to the layout its logical names resolve to under the active rules.

    Flax NNX has no logical-name constraint of its own; this is one. Inside a substrax train
    step (or any :func:`use_rules` context) it is ``jax.lax.with_sharding_constraint`` with
    the spec from :func:`substrax.mesh.partition_spec_for_names` (``jax.sharding.reshard`` on
    Explicit meshes). Outside any context it returns ``x`` unchanged, so the same model code
    runs unsharded in unit tests.

    Args:
      x: The array, usually an activation inside ``jit``.
      *logical_names: One logical name (or None) per dimension of ``x``.

    Returns:
      ``x``, constrained.

    Raises:
      ValueError: If the number of names differs from ``x.ndim``, or a name is unknown to the
        active rules or repeated.
    """
    if len(logical_names) != x.ndim:
        raise ValueError(
            f"constrain got {len(logical_names)} logical names {logical_names} for an array "
            f"of shape {x.shape} ({x.ndim} dimensions)."
        )
    active = active_rules()
    if active is None:
        return x
    mesh, rules = active
    return lay_out(x, NamedSharding(mesh, partition_spec_for_names(rules, *logical_names)))


def lay_out(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """Inside ``jit``: ``x`` laid out as ``sharding`` says, on Auto and Explicit axes alike.

    ``jax.lax.with_sharding_constraint`` on Auto axes, ``jax.sharding.reshard`` where the mesh
    has Explicit axes. Inside ``jax.shard_map`` over some of the mesh's axes the constraint is
    placed on the context's mesh, whose manual axes ``sharding``'s spec must not name.

    Args:
      x: The array.
      sharding: Its sharding on the whole mesh.

    Returns:
      ``x``, constrained.
    """
    context = jax.sharding.get_abstract_mesh()
    if context.manual_axes and set(context.axis_names) == set(sharding.mesh.axis_names):
        sharding = NamedSharding(context, sharding.spec)
    if AxisType.Explicit in tuple(sharding.mesh.axis_types):
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)
