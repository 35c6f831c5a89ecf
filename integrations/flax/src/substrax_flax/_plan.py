"""ModelPlan: a model's shardings worked out from its abstract state, and the jitted init."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding

from substrax_flax._resolve import Resolver, Rules, Strategy, UnknownNames, VariableSharding
from substrax_flax._state import constrain_state, map_variables

__all__ = [
    "ModelPlan",
    "create_sharded_model",
    "get_shardings",
    "plan_model",
    "plans_of",
    "shard_model",
    "shardings_of",
]

# Rows of the plan that placed each live model or optimizer, for sharding_report's reasons.
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def plans_of(obj: Any) -> tuple[VariableSharding, ...] | None:
    """The plan rows recorded for a model or optimizer that substrax placed, if any."""
    try:
        return _PLANS.get(obj)
    except TypeError:
        return None


def remember(obj: Any, rows: tuple[VariableSharding, ...]) -> None:
    """Records the plan rows of a model or optimizer that substrax placed."""
    _PLANS[obj] = rows


class ModelPlan:
    """The sharding of every variable of a model, decided before anything is allocated.

    Built by :func:`plan_model`. The model's state is never materialised here: its shapes come
    from ``nnx.eval_shape`` and its values are only created by :attr:`init`, inside
    ``jax.jit``, directly in the planned shardings.

    Attributes:
      mesh: The mesh.
      rules: The resolved ``MeshRules``.
      graphdef: The model's ``nnx.GraphDef``.
      specs: An ``nnx.State`` matching ``nnx.state(model)`` whose variables hold the
        ``PartitionSpec`` of each variable.
      shardings: The same with ``NamedSharding`` values.
      abstract_state: The same with ``jax.ShapeDtypeStruct`` values carrying their shardings
        (an Orbax restore target).
      rows: One :class:`VariableSharding` per variable, in state order.
      init: The jitted init: ``init()`` returns the model's state, created on device already
        sharded.
    """

    def __init__(self, factory: Callable[[], nnx.Module], resolver: Resolver):
        """Plans the model; use :func:`plan_model` rather than calling this directly.

        Args:
          factory: A function of no arguments that builds the model.
          resolver: Decides each variable's spec (mesh, rules, strategy, strictness).
        """
        self.mesh = resolver.mesh
        self.rules = resolver.rules
        self._factory = factory
        with nnx.use_eager_sharding(False):
            abstract_model = nnx.eval_shape(factory)
        self.graphdef, state = nnx.split(abstract_model)
        self.rows, self.shardings = _plan_state(state, resolver)
        self.specs = jax.tree.map(lambda sharding: sharding.spec, self.shardings)
        self.abstract_state = jax.tree.map(
            lambda value, sharding: jax.ShapeDtypeStruct(
                value.shape, value.dtype, sharding=sharding
            ),
            state,
            self.shardings,
        )
        self.init = jax.jit(self._create_state, out_shardings=self.shardings)

    def _create_state(self) -> nnx.State:
        with nnx.use_eager_sharding(False):
            model = self._factory()
        state = nnx.state(model)
        return constrain_state(state, self.shardings)

    def compile_init(self) -> jax.stages.Compiled:
        """Compiles the init without running it.

        Returns:
          The compiled executable: its ``memory_analysis()`` gives the init's per-device
          memory and ``as_text()`` its partitioned HLO, before anything is allocated.
        """
        return self.init.lower().compile()

    def create(self) -> nnx.Module:
        """Runs the init and assembles the model.

        Returns:
          The model, every variable in its planned sharding.
        """
        model = nnx.merge(self.graphdef, self.init())
        remember(model, self.rows)
        return model

    def report(self) -> Any:
        """The plan as a sharding report.

        Returns:
          A :class:`ShardingReport` with one row per variable.
        """
        from substrax_flax._report import ShardingReport

        return ShardingReport(self.rows, self.mesh)

    def __repr__(self) -> str:
        return f"ModelPlan(mesh={self.mesh}, variables={len(self.rows)})"


def plan_model(
    factory: Callable[[], nnx.Module],
    mesh: jax.sharding.Mesh | None,
    rules: Rules = None,
    *,
    strategy: Strategy = None,
    strict: bool = False,
    unknown_names: UnknownNames = "error",
) -> ModelPlan:
    """Plans the sharding of every variable of the model that ``factory`` builds.

    The model is built abstractly (``nnx.eval_shape``, no allocation). Each variable's logical
    axis names come from Flax's own metadata (``nnx.with_partitioning``; the ``out_sharding``,
    ``sharding_names`` and ``sharding`` keys are all read) and resolve through ``rules`` with
    :mod:`substrax.mesh`'s semantics: a mesh axis is used once per variable (first dimension
    wins). Unannotated variables get their spec from ``strategy``, or are replicated. Flax's
    eager sharding is switched off while the factory runs, so the factory needs no mesh context
    and no ``nnx.logical_axis_rules``.

    Args:
      factory: A function of no arguments that builds the model, such as
        ``lambda: Model(rngs=nnx.Rngs(0))``.
      mesh: The device mesh. None means a single device: the model is created unsharded on
        the first device, so that an annotated model runs in a plain unit test (Flax alone
        refuses to create an annotated variable without a mesh context).
      rules: ``MeshRules``, Flax-style pairs ``[(logical, mesh_axes), ...]``, or None, in which
        case logical names must be mesh axis names.
      strategy: A ``ShardingStrategy`` or ``MultiDimensionalStrategy`` for unannotated
        variables; None replicates them.
      strict: Raise instead of warning when a dimension does not divide its mesh axes.
      unknown_names: ``"error"`` (default) raises on a logical name that ``rules`` does not
        know; ``"replicate"`` replicates that dimension with a ``ShardingWarning``.

    Returns:
      A :class:`ModelPlan`.

    Raises:
      ValueError: If an annotation's length differs from the variable's rank, a logical name
        is repeated in one annotation or unknown to the rules, a rule names a mesh axis that
        the mesh lacks, or (``strict``) a dimension does not divide its mesh axes.
      TypeError: If ``rules`` or ``strategy`` has the wrong type.
    """
    resolver = Resolver(mesh, rules, strategy, strict=strict, unknown_names=unknown_names)
    return ModelPlan(factory, resolver)


def create_sharded_model(
    factory: Callable[[], nnx.Module],
    mesh: jax.sharding.Mesh | None,
    rules: Rules = None,
    *,
    strategy: Strategy = None,
    strict: bool = False,
    unknown_names: UnknownNames = "error",
) -> nnx.Module:
    """Creates the model that ``factory`` builds, every variable already sharded.

    The same as ``plan_model(...).create()``: the model is created inside ``jax.jit`` with the
    planned output shardings, so no device ever holds a full parameter that the plan shards.
    Values equal those of ``factory()`` run unsharded with the same seeds.

    On a mesh with Explicit axes the model is created the same way (the init uses
    ``jax.sharding.reshard`` there) and the model code needs no change to be *created*; to
    *run* it, every contraction over sharded dimensions must say how its output is sharded
    (``out_sharding=`` or ``jax.sharding.reshard``), as jax requires of Explicit meshes. Meshes
    from :class:`substrax.mesh.DeviceMeshManager` are Auto unless asked otherwise.

    Args:
      factory: A function of no arguments that builds the model.
      mesh: The device mesh; None means one device (see :func:`plan_model`).
      rules: ``MeshRules``, Flax-style pairs, or None (see :func:`plan_model`).
      strategy: Spec for unannotated variables (see :func:`plan_model`).
      strict: Raise instead of warning when a dimension does not divide its mesh axes.
      unknown_names: ``"error"`` or ``"replicate"`` (see :func:`plan_model`).

    Returns:
      The sharded model.

    Raises:
      ValueError: As :func:`plan_model`.
    """
    plan = plan_model(
        factory, mesh, rules, strategy=strategy, strict=strict, unknown_names=unknown_names
    )
    return plan.create()


def shardings_of(rows: tuple[VariableSharding, ...], state: Any, mesh: Any) -> Any:
    """A state like ``state`` holding each row's ``NamedSharding`` on ``mesh``, by path."""
    by_path = {row.path: row for row in rows}
    return map_variables(lambda path, _: NamedSharding(mesh, by_path[path].spec), state)


def _plan_state(state: Any, resolver: Resolver) -> tuple[tuple[VariableSharding, ...], Any]:
    """The rows of ``state`` and a state of their ``NamedSharding``s."""
    rows = resolver.plan(state)
    return rows, shardings_of(rows, state, resolver.mesh)


def _state_of(model_or_state: Any) -> Any:
    if isinstance(model_or_state, nnx.Module):
        return nnx.state(model_or_state)
    if isinstance(model_or_state, nnx.State):
        return model_or_state
    raise TypeError(f"Expected an nnx.Module or nnx.State, got {type(model_or_state).__name__}.")


def get_shardings(
    model_or_state: Any,
    mesh: jax.sharding.Mesh | None,
    rules: Rules = None,
    *,
    strategy: Strategy = None,
    strict: bool = False,
    unknown_names: UnknownNames = "error",
) -> nnx.State:
    """The planned shardings of a model's variables, without moving any data.

    Args:
      model_or_state: A model (live or abstract) or its ``nnx.State``.
      mesh: The device mesh; None means one device (see :func:`plan_model`).
      rules: ``MeshRules``, Flax-style pairs, or None (see :func:`plan_model`).
      strategy: Spec for unannotated variables (see :func:`plan_model`).
      strict: Raise instead of warning when a dimension does not divide its mesh axes.
      unknown_names: ``"error"`` or ``"replicate"`` (see :func:`plan_model`).

    Returns:
      An ``nnx.State`` matching ``nnx.state(model)`` whose variables hold ``NamedSharding``
      values.

    Raises:
      ValueError: As :func:`plan_model`.
      TypeError: If ``model_or_state`` is neither a module nor a state.
    """
    resolver = Resolver(mesh, rules, strategy, strict=strict, unknown_names=unknown_names)
    return _plan_state(_state_of(model_or_state), resolver)[1]


def shard_model(
    model: nnx.Module,
    mesh: jax.sharding.Mesh | None,
    rules: Rules = None,
    *,
    strategy: Strategy = None,
    strict: bool = False,
    unknown_names: UnknownNames = "error",
) -> nnx.Module:
    """Moves a live model's variables to their planned shardings, in place.

    Prefer :func:`create_sharded_model` for new models: this one needs the model to fit where
    it is now.

    Args:
      model: A live model.
      mesh: The device mesh; None means one device (see :func:`plan_model`).
      rules: ``MeshRules``, Flax-style pairs, or None (see :func:`plan_model`).
      strategy: Spec for unannotated variables (see :func:`plan_model`).
      strict: Raise instead of warning when a dimension does not divide its mesh axes.
      unknown_names: ``"error"`` or ``"replicate"`` (see :func:`plan_model`).

    Returns:
      ``model`` itself, its variables now sharded.

    Raises:
      ValueError: As :func:`plan_model`.
      TypeError: If ``model`` is not an ``nnx.Module``.
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"shard_model expects an nnx.Module, got {type(model).__name__}.")
    state = nnx.state(model)
    resolver = Resolver(mesh, rules, strategy, strict=strict, unknown_names=unknown_names)
    rows, shardings = _plan_state(state, resolver)
    nnx.update(model, jax.device_put(state, shardings))
    remember(model, rows)
    return model
