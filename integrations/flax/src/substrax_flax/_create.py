"""Making plans and models: plan_model, create_sharded_model, shard_model, get_shardings."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from substrax_flax._plan import (
    LayoutLike,
    ModelPlan,
    code_is_typed,
    make_resolver,
    remember,
)
from substrax_flax._probes import cheap_sharding_probes
from substrax_flax._resolve import Indivisible, Rules, Strategy, UnknownNames

__all__ = ["create_sharded_model", "get_shardings", "plan_model", "shard_model"]


def plan_model(
    factory: Callable[[], nnx.Module],
    mesh: jax.sharding.Mesh | None = None,
    rules: Rules = None,
    *,
    layout: LayoutLike = None,
    strategy: Strategy = None,
    strict: bool = False,
    unknown_names: UnknownNames = "error",
    indivisible: Indivisible = "move",
) -> ModelPlan:
    """Plans the sharding of every variable of the model that ``factory`` builds.

    The model is built abstractly (``nnx.eval_shape``, no allocation). Each variable's logical
    axis names come from Flax's own metadata (``nnx.with_partitioning``; the ``out_sharding``,
    ``sharding_names`` and ``sharding`` keys are all read) and resolve through ``rules`` with
    substrax's one resolver (:meth:`substrax.mesh.MeshRules.resolve`): a mesh axis is used
    once per variable (first dimension wins), and a dimension keeps the longest prefix of its
    axes that divides it. Unannotated variables get their spec from ``strategy``, or are
    replicated. Flax's eager sharding is switched off while the factory runs, so the factory
    needs no mesh context and no ``nnx.logical_axis_rules``. A variable left (partly)
    replicated against its annotation gets one ``ShardingWarning``, pointing at your call.

    Args:
      factory: A function of no arguments that builds the model, such as
        ``lambda: Model(rngs=nnx.Rngs(0))``.
      mesh: The device mesh. None means the layout's mesh, or without a layout a single
        device: the model is created unsharded on the first device, so that an annotated
        model runs in a plain unit test (Flax alone refuses to create an annotated variable
        without a mesh context).
      rules: ``MeshRules``, Flax-style pairs ``[(logical, mesh_axes), ...]``, or None: the
        layout's parameter rules, or without a layout, logical names are mesh axis names.
      layout: A :class:`substrax.layout.Layout`, or a layout name (``"fsdp"``, ``"fsdp+tp"``,
        ... on ``mesh``). It gives the mesh (when ``mesh`` is None), the rules (when
        ``rules`` is None), the strategy for unannotated variables and the batch axes the
        train step uses.
      strategy: A ``ShardingStrategy`` or ``MultiDimensionalStrategy`` for unannotated
        variables; None means the layout's, or replicated.
      strict: Raise instead of warning when a dimension does not divide its mesh axes.
      unknown_names: ``"error"`` (default) raises on a logical name that ``rules`` does not
        know; ``"replicate"`` replicates that dimension with a ``ShardingWarning``.
      indivisible: What an annotated dimension does with the mesh axes it does not divide
        (128 experts on an FSDP axis of 256, a vocabulary of 1001 on 4 tensor devices):
        ``"move"`` (the default) puts them on the largest dimension they divide, preferring
        an unsharded one, and the report's ``moved`` reason says where; an axis moved off
        its dimension shards storage only, and the train step gathers it where the
        parameter is used, as it gathers FSDP axes. ``"replicate"`` keeps the array
        replicated over them, with a ``ShardingWarning``; ``strict`` raises either way.

    Returns:
      A :class:`ModelPlan`.

    Raises:
      ValueError: If an annotation's length differs from the variable's rank, a logical name
        is repeated in one annotation or unknown to the rules, a rule names a mesh axis that
        the mesh lacks, the layout's mesh differs from ``mesh``, or (``strict``) a dimension
        does not divide its mesh axes.
      TypeError: If ``rules``, ``layout`` or ``strategy`` has the wrong type.
    """
    resolver, layout = make_resolver(
        mesh, rules, strategy, layout, strict=strict, unknown_names=unknown_names,
        indivisible=indivisible,
    )  # fmt: skip
    graphdef, state, under_mesh = _abstract_split(factory, resolver.mesh)
    return ModelPlan(
        state, resolver, layout=layout, graphdef=graphdef, factory=factory, under_mesh=under_mesh
    )


def _mesh_context(mesh: Any) -> Any:
    """``jax.set_mesh(mesh)``, or for an ``AbstractMesh`` (a plan only) its abstract form."""
    if isinstance(mesh, jax.sharding.AbstractMesh):
        return jax.sharding.use_abstract_mesh(mesh)
    return jax.set_mesh(mesh)


def _abstract_split(factory: Callable[[], nnx.Module], mesh: Any) -> tuple[Any, Any, bool]:
    """``(graphdef, abstract state, whether the factory is created under the mesh context)``.

    The factory is traced under ``jax.set_mesh(mesh)``: model code in Flax's Explicit style
    builds its own ``PartitionSpec``s at creation (``out_sharding=P(...)`` in initializers,
    ``reshard``, ``with_sharding_constraint``), which jax allows only under a mesh context, and
    on Auto axes the context changes nothing else. It is later created under the context too,
    except on a mesh with Explicit axes where the traced state carries no spec in its types:
    created there without the context, jax still partitions its initializers instead of
    building each parameter whole (replicated, as the context would type it) first.
    """
    if isinstance(factory, nnx.Module):
        name = type(factory).__name__
        raise TypeError(
            f"factory must be a function that builds the model, got a built {name}: pass "
            f"lambda: {name}(...) so substrax creates it already sharded, or place this one "
            "with substrax_flax.shard_model(model, mesh, layout=...)."
        )
    if not callable(factory):
        raise TypeError(
            f"factory must be a function of no arguments that builds the model, such as "
            f"lambda: Model(rngs=nnx.Rngs(0)); got {type(factory).__name__} {factory!r:.80}."
        )
    try:  # a class's own signature: an nnx.Module's metaclass takes (*args, **kwargs)
        signature = inspect.signature(factory)
        if isinstance(factory, type):
            own = list(inspect.signature(factory.__init__).parameters.values())[1:]
            signature = inspect.Signature(own)
        signature.bind()
    except ValueError:  # no signature to read (a builtin): call it and see
        pass
    except TypeError:
        name = getattr(factory, "__name__", type(factory).__name__)
        wrap = f"lambda: {name}(...)" if isinstance(factory, type) else "a lambda that calls it"
        raise TypeError(
            f"factory must be a function of no arguments that builds the model, but "
            f"{name}{signature} takes arguments: pass {wrap} with them, such as "
            "lambda: Model(rngs=nnx.Rngs(0))."
        ) from None

    def split():
        model = factory()
        if not isinstance(model, nnx.Module):
            raise TypeError(
                f"factory must return an nnx.Module, got {type(model).__name__} {model!r:.80}."
            )
        return nnx.split(model)

    with nnx.use_eager_sharding(False), _mesh_context(mesh), cheap_sharding_probes():
        graphdef, state = jax.eval_shape(split)
    return graphdef, state, code_is_typed(state, mesh)


def create_sharded_model(
    factory: Callable[[], nnx.Module],
    mesh: jax.sharding.Mesh | None = None,
    rules: Rules = None,
    *,
    layout: LayoutLike = None,
    strategy: Strategy = None,
    strict: bool = False,
    unknown_names: UnknownNames = "error",
    indivisible: Indivisible = "move",
) -> nnx.Module:
    """Creates the model that ``factory`` builds, every variable already sharded.

    The same as ``plan_model(...).create()``: the model is created inside ``jax.jit`` with the
    planned output shardings, so no device ever holds a full parameter that the plan shards.
    Values equal those of ``factory()`` run unsharded with the same seeds. The model remembers
    its plan: :func:`create_sharded_optimizer`, :func:`make_train_step` and
    :func:`sharding_report` take it from there, with every option given here.

    On a mesh with Explicit axes the model is created the same way (the init uses
    ``jax.sharding.reshard`` there) and the model code needs no change to be *created*; to
    *run* it, every contraction over sharded dimensions must say how its output is sharded
    (``out_sharding=`` or ``jax.sharding.reshard``), as jax requires of Explicit meshes. Meshes
    from :class:`substrax.mesh.DeviceMeshManager` are Auto unless asked otherwise.

    Args:
      factory: A function of no arguments that builds the model.
      mesh: The device mesh (see :func:`plan_model`).
      rules: ``MeshRules``, Flax-style pairs, or None (see :func:`plan_model`).
      layout: A layout or layout name (see :func:`plan_model`).
      strategy: Spec for unannotated variables (see :func:`plan_model`).
      strict: Raise instead of warning when a dimension does not divide its mesh axes.
      unknown_names: ``"error"`` or ``"replicate"`` (see :func:`plan_model`).
      indivisible: ``"move"`` or ``"replicate"`` (see :func:`plan_model`).

    Returns:
      The sharded model.

    Raises:
      ValueError: As :func:`plan_model`.
      TypeError: As :func:`plan_model`.
    """
    plan = plan_model(
        factory, mesh, rules, layout=layout, strategy=strategy, strict=strict,
        unknown_names=unknown_names, indivisible=indivisible,
    )  # fmt: skip
    return plan.create()


def _state_of(model_or_state: Any) -> Any:
    if isinstance(model_or_state, nnx.Module):
        return nnx.state(model_or_state)
    if isinstance(model_or_state, nnx.State):
        return model_or_state
    raise TypeError(f"Expected an nnx.Module or nnx.State, got {type(model_or_state).__name__}.")


def get_shardings(
    model_or_state: Any,
    mesh: jax.sharding.Mesh | None = None,
    rules: Rules = None,
    *,
    layout: LayoutLike = None,
    strategy: Strategy = None,
    strict: bool = False,
    unknown_names: UnknownNames = "error",
    indivisible: Indivisible = "move",
) -> nnx.State:
    """The planned shardings of a model's variables, without moving any data.

    Args:
      model_or_state: A model (live or abstract) or its ``nnx.State``.
      mesh: The device mesh (see :func:`plan_model`).
      rules: ``MeshRules``, Flax-style pairs, or None (see :func:`plan_model`).
      layout: A layout or layout name (see :func:`plan_model`).
      strategy: Spec for unannotated variables (see :func:`plan_model`).
      strict: Raise instead of warning when a dimension does not divide its mesh axes.
      unknown_names: ``"error"`` or ``"replicate"`` (see :func:`plan_model`).
      indivisible: ``"move"`` or ``"replicate"`` (see :func:`plan_model`).

    Returns:
      An ``nnx.State`` matching ``nnx.state(model)`` whose variables hold ``NamedSharding``
      values.

    Raises:
      ValueError: As :func:`plan_model`.
      TypeError: If ``model_or_state`` is neither a module nor a state.
    """
    resolver, layout = make_resolver(
        mesh, rules, strategy, layout, strict=strict, unknown_names=unknown_names,
        indivisible=indivisible,
    )  # fmt: skip
    return ModelPlan(_state_of(model_or_state), resolver, layout=layout).shardings


def shard_model(
    model: nnx.Module,
    mesh: jax.sharding.Mesh | None = None,
    rules: Rules = None,
    *,
    layout: LayoutLike = None,
    strategy: Strategy = None,
    strict: bool = False,
    unknown_names: UnknownNames = "error",
    indivisible: Indivisible = "move",
) -> nnx.Module:
    """Moves a live model's variables to their planned shardings, in place.

    Prefer :func:`create_sharded_model` for new models: this one needs the model to fit where
    it is now. The model remembers its plan, as one from :func:`create_sharded_model` does.

    Args:
      model: A live model.
      mesh: The device mesh (see :func:`plan_model`).
      rules: ``MeshRules``, Flax-style pairs, or None (see :func:`plan_model`).
      layout: A layout or layout name (see :func:`plan_model`).
      strategy: Spec for unannotated variables (see :func:`plan_model`).
      strict: Raise instead of warning when a dimension does not divide its mesh axes.
      unknown_names: ``"error"`` or ``"replicate"`` (see :func:`plan_model`).
      indivisible: ``"move"`` or ``"replicate"`` (see :func:`plan_model`).

    Returns:
      ``model`` itself, its variables now sharded.

    Raises:
      ValueError: As :func:`plan_model`.
      TypeError: If ``model`` is not an ``nnx.Module``.
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"shard_model expects an nnx.Module, got {type(model).__name__}.")
    graphdef, state = nnx.split(model)
    resolver, layout = make_resolver(
        mesh, rules, strategy, layout, strict=strict, unknown_names=unknown_names,
        indivisible=indivisible,
    )  # fmt: skip
    plan = ModelPlan(state, resolver, layout=layout, graphdef=graphdef)
    nnx.update(model, jax.device_put(state, plan.shardings))
    remember(model, plan)
    return model
