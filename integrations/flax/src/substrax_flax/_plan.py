"""ModelPlan: a model's shardings worked out from its abstract state, and the jitted init."""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from substrax.distributed import agree
from substrax.layout import Layout
from substrax.mesh import MeshRules, as_axes, check_mesh, spec_entry
from substrax_flax._cache import equal
from substrax_flax._probes import cheap_sharding_probes
from substrax_flax._resolve import (
    Indivisible,
    Resolver,
    Rules,
    Strategy,
    UnknownNames,
    VariableSharding,
    as_rules,
    without_axes,
)
from substrax_flax._shortfall import TOLERANCE, warn_replicated, warn_shortfall
from substrax_flax._state import (
    constrain_state,
    is_variable,
    layer_kinds,
    map_variables,
    typed_spec,
    values_by_path,
    variables,
)

__all__ = [
    "ModelPlan",
    "as_layout",
    "make_resolver",
    "model_plan",
    "plan_of",
    "remember",
    "shardings_of",
]

# The plan that placed each live model or optimizer (and, for an optimizer, its rows).
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

LayoutLike = Layout | str | None

#: Numbers the models this process creates, in order: every process creates the same ones.
_PLANS_MADE = itertools.count(1)


def plan_of(obj: Any) -> Any:
    """The :class:`ModelPlan` (model) or rows (optimizer) recorded for an object, if any."""
    try:
        return _PLANS.get(obj)
    except TypeError:
        return None


def remember(obj: Any, plan: Any) -> None:
    """Records the plan of a model (or the rows of an optimizer) that substrax placed."""
    _PLANS[obj] = plan


def as_layout(layout: LayoutLike, mesh: Any) -> Layout | None:
    """A :class:`~substrax.layout.Layout` from a layout, a layout name (on ``mesh``) or None.

    Raises:
      ValueError: For a name without a mesh, or a layout whose mesh differs from ``mesh``.
      TypeError: For anything else.
    """
    if layout is None:
        return None
    if isinstance(layout, str):
        if mesh is None:
            raise ValueError(
                f"layout={layout!r} names a layout; it needs a mesh to be built on. Pass "
                "mesh=..., or a substrax.layout.Layout (which makes its own mesh)."
            )
        return Layout.named(layout, mesh)
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a Layout, a layout name or None, got {layout!r}.")
    if mesh is not None:
        layout.check_mesh(mesh)
    return layout


def make_resolver(
    mesh: Any,
    rules: Rules,
    strategy: Strategy,
    layout: LayoutLike,
    *,
    strict: bool = False,
    unknown_names: UnknownNames = "error",
    indivisible: Indivisible = "move",
) -> tuple[Resolver, Layout | None]:
    """The resolver of a plan: the layout's mesh, rules and strategy unless given explicitly."""
    if mesh is not None:
        check_mesh(mesh)
    layout = as_layout(layout, mesh)
    source = "the rules"
    if layout is not None:
        mesh = mesh if mesh is not None else layout.make_mesh()
        if rules is None:
            rules, source = layout.param_rules, f"layout {layout.name!r}'s rules"
        strategy = strategy if strategy is not None else layout.strategy()
    resolver = Resolver(
        mesh, rules, strategy, strict=strict, unknown_names=unknown_names,
        indivisible=indivisible, source=source,
    )  # fmt: skip
    return resolver, layout


class ModelPlan:
    """The sharding of every variable of a model, decided once, before anything is allocated.

    Built by :func:`plan_model` (or by :func:`create_sharded_model`, which remembers it on the
    model it returns). Everything after creation takes this plan from the model: the
    optimizer, the train steps, the report; none of them re-resolves the model's names, so the
    plan's options (``strict``, ``unknown_names``, the layout) hold throughout, and each
    warning is emitted once, when the plan is made.

    Attributes:
      mesh: The mesh.
      rules: The resolved ``MeshRules``.
      strategy: The strategy for unannotated variables, or None.
      layout: The :class:`~substrax.layout.Layout` the plan realises, or None.
      graphdef: The model's ``nnx.GraphDef``.
      specs: An ``nnx.State`` matching ``nnx.state(model)`` whose variables hold the
        ``PartitionSpec`` of each variable.
      shardings: The same with ``NamedSharding`` values.
      abstract_state: The same with ``jax.ShapeDtypeStruct`` values carrying their shardings
        (an Orbax restore target).
      rows: One :class:`VariableSharding` per variable, in state order.
      shortfall: Bytes per device against what the variables asked for (a
        ``ShardingWarning`` at planning when over 1.10x, naming the variables and fixes).
      init: The init (plans made from a factory, else None): ``init()`` returns the model's
        state, created on device already sharded by one jitted computation.
    """

    def __init__(
        self,
        state: nnx.State,
        resolver: Resolver,
        *,
        layout: Layout | None = None,
        graphdef: Any = None,
        factory: Callable[[], nnx.Module] | None = None,
        under_mesh: bool | None = None,
    ):
        """Plans ``state``; use :func:`plan_model` rather than calling this directly.

        Args:
          state: The model's state (abstract or live).
          resolver: Decides each variable's spec (mesh, rules, strategy, strictness).
          layout: The layout the resolver was built from, if any.
          graphdef: The model's graph definition.
          factory: A function of no arguments that builds the model (for :attr:`init`).
          under_mesh: Whether the factory must run under ``jax.set_mesh`` (Explicit style;
            None: read off ``state``, see :func:`code_is_typed`).
        """
        self.mesh, self.rules, self.strategy = resolver.mesh, resolver.rules, resolver.strategy
        self.layout, self.graphdef, self._factory = layout, graphdef, factory
        self.strict, self.unknown_names = resolver.strict, resolver.unknown_names
        self.rows = resolver.rows(state, _layers(graphdef, state))
        _check_stages(self.rows, layout, self.mesh)
        self.shortfall = warn_shortfall(self.rows, self.mesh, "The model")
        if self.shortfall.ratio <= TOLERANCE:  # one warning: the shortfall names its own
            warn_replicated(self.rows, self.mesh, "The model")
        self.shardings = shardings_of(self.rows, state, self.mesh)
        self.specs = jax.tree.map(lambda sharding: sharding.spec, self.shardings)
        self.abstract_state = jax.tree.map(
            lambda value, sharding: jax.ShapeDtypeStruct(
                value.shape, value.dtype, sharding=sharding
            ),
            state,
            self.shardings,
        )
        if under_mesh is None:
            under_mesh = code_is_typed(state, self.mesh)
        self._template, self.init, self._under_mesh = state, None, under_mesh
        if factory is not None:
            # The jitted init returns its values by path: a Variable's metadata may differ
            # between traces (``nnx.Param(x, rngs=rngs)``), so no tree structure is shared.
            paths = [path for path, _ in variables(state)]
            by_path = values_by_path(self.shardings)
            out = [by_path[path] for path in paths]
            self._values = jax.jit(self._create_values, out_shardings=out)
            self.init = self._init

    @property
    def explicit_code(self) -> bool:
        """Whether the model's code is written for Explicit mesh axes.

        True on a mesh with Explicit axes when the model's variables carry their specs in
        their types (Flax's Explicit style: ``out_sharding=P(...)`` at creation); a model
        written for Auto axes (plain ``nnx.Embed``, ``nnx.Linear``) placed on such a mesh
        (``jax.make_mesh`` makes one) is False, and its step runs on the mesh's Auto twin.
        """
        explicit = jax.sharding.AxisType.Explicit in tuple(self.mesh.axis_types)
        return explicit and self._under_mesh

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes of the batch: the layout's, or those the rules give ``batch``/``data``."""
        if self.layout is not None:
            return self.layout.batch_axes
        table = self.rules.as_dict()
        axes = table.get("batch") or table.get("data")
        return as_axes(axes)

    @property
    def gather_axes(self) -> tuple[str, ...]:
        """The batch axes parameters are whole on where they are used.

        The layout's :attr:`~substrax.layout.Layout.gather_axes` (expert axes keep their
        experts), else the batch axes.
        """
        return self.layout.gather_axes if self.layout is not None else self.batch_axes

    @property
    def compute_rules(self) -> MeshRules:
        """Rules where parameters are used: the parameter rules gathered over the gather axes.

        A layout's :attr:`~substrax.layout.Layout.compute_rules` (its sequence stays split
        over the context axes).
        """
        if self.layout is not None:
            return self.layout.compute_rules
        return self.rules.gathered_over(self.gather_axes)

    def optimizer_spec(self, row: VariableSharding) -> PartitionSpec:
        """The spec of ``row``'s optimizer state: its own, or under ZeRO sharded further.

        Args:
          row: One of :attr:`rows`.

        Returns:
          :meth:`substrax.layout.Layout.optimizer_spec`'s spec, or the row's without a layout.
        """
        return self.optimizer_spec_and_reason(row)[0]

    def optimizer_spec_and_reason(self, row: VariableSharding) -> tuple[PartitionSpec, str | None]:
        """:meth:`optimizer_spec`, and why it is the parameter's own where ZeRO asked more.

        Args:
          row: One of :attr:`rows`.

        Returns:
          ``(spec, why)``, as :meth:`substrax.layout.Layout.optimizer_spec` returns them
          (``why`` None without a layout).
        """
        if self.layout is None:
            return row.spec, None
        return self.layout.optimizer_spec(row.spec, row.shape)

    def compute_spec(self, row: VariableSharding) -> PartitionSpec:
        """``row``'s spec where the parameter is used.

        A parameter stored sharded over an axis that also splits the batch (FSDP, context) is
        gathered there once per step, and so is one stored sharded over an expert axis on any
        dimension but its ``expert`` one (an expert is computed where it is stored, the rest
        of the model whole); every other axis (tensor, stage) is kept, except an axis that
        was moved off the dimension that asked for it (a ``moved`` reason): it shards the
        stored array only, and is gathered too.

        Args:
          row: One of :attr:`rows`.

        Returns:
          The spec, of the row's rank.
        """
        moved = {a for reason in row.reasons if reason.kind == "moved" for a in reason.axes}
        spec = without_axes(row.spec, set(self.gather_axes) | moved)
        experts = set(self.layout.expert_axes if self.layout is not None else ())
        if not experts & {a for e in spec for a in as_axes(e)}:
            return spec
        names = row.logical_names or (None,) * len(spec)
        return PartitionSpec(*(
            e if name == "expert" else spec_entry(a for a in as_axes(e) if a not in experts)
            for e, name in zip(spec, names, strict=False)  # a spec may be short
        ))  # fmt: skip

    def compute_shardings(self, state: Any) -> Any:
        """Each parameter of ``state`` where it is used (:meth:`compute_spec`).

        Args:
          state: The differentiated part of the model's state (by default its ``nnx.Param``s).

        Returns:
          A state of ``NamedSharding``s.
        """
        by_path = {row.path: row for row in self.rows}

        def gathered(path, _):
            return NamedSharding(self.mesh, self.compute_spec(by_path[path]))

        return map_variables(gathered, state)

    def check_arguments(self, mesh: Any, rules: Rules, strategy: Strategy, what: str) -> None:
        """Checks that arguments passed again agree with the plan (None always agrees).

        Args:
          mesh: A mesh given to a later call, or None.
          rules: Rules given to a later call, or None.
          strategy: A strategy given to a later call, or None.
          what: The call, for the message.

        Raises:
          ValueError: If ``mesh``, ``rules`` or ``strategy`` differ from the plan's.
        """
        differs = []
        if mesh is not None and mesh != self.mesh:
            differs.append(f"mesh {dict(mesh.shape)} (the model's: {dict(self.mesh.shape)})")
        if rules is not None and as_rules(rules, None) != self.rules:
            differs.append(f"rules {as_rules(rules, None)} (the model's: {self.rules})")
        if strategy is not None and strategy != self.strategy:
            differs.append(f"strategy {strategy!r} (the model's: {self.strategy!r})")
        if differs:
            raise ValueError(
                f"{what} was given {'; '.join(differs)}, but the model was created by substrax "
                "with another plan. Leave these arguments out: the model's plan is used."
            )

    def _create_values(self) -> list[jax.Array]:
        with nnx.use_eager_sharding(False), cheap_sharding_probes():
            model = self._factory()
        state = constrain_state(nnx.state(model), self.shardings)
        return [_value(leaf) for _, leaf in variables(state)]

    def _mesh_context(self) -> Any:
        return jax.set_mesh(self.mesh) if self._under_mesh else contextlib.nullcontext()

    def _init(self) -> nnx.State:
        with self._mesh_context():
            created = self._values()
        values = dict(zip((p for p, _ in variables(self._template)), created, strict=True))
        return map_variables(lambda path, _: values[path], self._template)

    def _need_factory(self) -> None:
        if self.init is None:
            raise ValueError("This plan was made from a live model, not a factory: it has no init.")

    def compile_init(self) -> jax.stages.Compiled:
        """Compiles the init without running it.

        Returns:
          The compiled executable: its ``memory_analysis()`` gives the init's per-device
          memory and ``as_text()`` its partitioned HLO, before anything is allocated.

        Raises:
          ValueError: For a plan made from a live model.
        """
        return self._lower_init().compile()

    def _lower_init(self) -> jax.stages.Lowered:
        """The init lowered for this plan's mesh (:meth:`compile_init` compiles it)."""
        self._need_factory()
        with self._mesh_context():
            return self._values.lower()

    def create(self) -> nnx.Module:
        """Runs the init and assembles the model, which remembers this plan.

        Returns:
          The model, every variable in its planned sharding.

        Raises:
          ValueError: For a plan made from a live model.
        """
        self._need_factory()
        self._agree()
        model = nnx.merge(self.graphdef, self.init())
        remember(model, self)
        return model

    def abstract_model(self) -> nnx.Module:
        """The model as shapes: each variable a ``jax.ShapeDtypeStruct`` in its planned sharding.

        Nothing is created or allocated; the model remembers this plan, so
        :func:`create_sharded_optimizer` gives it an abstract optimizer, and a step's
        ``lower(model, optimizer, batch)`` compiles for the plan's mesh, even a mesh of devices
        this machine does not have (:func:`compile_for`).

        Returns:
          The abstract model.
        """
        model = nnx.merge(self.graphdef, self.abstract_state)
        remember(model, self)
        return model

    def _agree(self) -> None:
        """In a multi-process run, checks that every process planned the same model first.

        Processes that disagree (a typo in one host's arguments) would compile different
        inits and steps and wait in each other's collectives forever; this stops them with
        the first line that differs (:func:`substrax.distributed.agree`).
        """
        if jax.process_count() > 1:
            lines = [
                f"mesh {dict(self.mesh.shape)}",
                f"layout {self.layout.label if self.layout is not None else None}",
            ]
            lines += [f"{r.path} {r.shape} {r.dtype} {r.spec}" for r in self.rows]  # fmt: skip
            agree(f"model plan {next(_PLANS_MADE)}", "\n".join(lines))

    def create_with(self, values: dict[str, jax.Array]) -> nnx.Module:
        """Assembles the model from ``values`` (by path), initialising only the rest.

        The variables ``values`` lacks are created by a jitted init that returns only them
        (XLA drops the rest of the factory's work, its random numbers included); with
        nothing lacking, no init runs at all.

        Args:
          values: Arrays in this plan's shardings, keyed by variable path.

        Returns:
          The model, which remembers this plan.

        Raises:
          ValueError: For a plan made from a live model.
        """
        self._need_factory()
        self._agree()
        paths = [path for path, _ in variables(self._template)]
        rest = [path for path in paths if path not in values]
        made = {}
        if rest:
            wanted = set(rest)
            by_path = values_by_path(self.shardings)

            def init():
                made = zip(paths, self._create_values(), strict=True)
                return [value for path, value in made if path in wanted]

            with self._mesh_context():
                created = jax.jit(init, out_shardings=[by_path[p] for p in rest])()
            made = dict(zip(rest, created, strict=True))
        state = map_variables(lambda path, _: values.get(path, made.get(path)), self._template)
        model = nnx.merge(self.graphdef, state)
        remember(model, self)
        return model

    def adopt(self, model: nnx.Module, what: str, **arguments: Any) -> None:
        """Makes ``model`` remember this plan, checking that it is laid out by it.

        Args:
          model: A model this plan created, or a copy of one (``nnx.clone``, ``nnx.merge``).
          what: The call, for the message.
          **arguments: The call's own ``mesh``, ``rules``, ``layout`` or ``strategy``, which
            a plan replaces: each must be None.

        Raises:
          TypeError: If an argument in ``arguments`` is given: the plan holds it.
          ValueError: If ``model`` remembers another plan, or its graph or an array's
            sharding is not this plan's.
        """
        given = sorted(name for name, value in arguments.items() if value is not None)
        if given:
            raise TypeError(
                f"{what}: plan= holds the {', '.join(given)}; pass the plan or "
                f"{', '.join(given)}, not both."
            )
        own = plan_of(model)
        if own is self:
            return
        if isinstance(own, ModelPlan):
            raise ValueError(
                f"{what}: the model was placed by another plan ({own!r}, not {self!r})."
            )
        graphdef, state = nnx.split(model)
        wrong = _misplaced(self, state)
        if self.graphdef is not None and not equal(self.graphdef, graphdef):
            wrong = ["its graph (modules and attributes) is not the plan's", *wrong]
        if wrong:
            raise ValueError(
                f"{what}: the model is not laid out by this plan: {'; '.join(wrong[:3])}. "
                "Create it with plan.create() (or create_sharded_model)."
            )
        remember(model, self)

    @property
    def layout_label(self) -> str | None:
        """The layout's label (``"fsdp 2 x tp 4"``), or None for a plan without a layout."""
        return self.layout.label if self.layout is not None else None

    def __repr__(self) -> str:
        layout = f", layout={self.layout.name}" if self.layout is not None else ""
        return f"ModelPlan(mesh={dict(self.mesh.shape)}{layout}, variables={len(self.rows)})"


def _layers(graphdef: Any, state: Any) -> dict[str, str]:
    """Which kind of layer holds each variable (for strategies), when the graph is known."""
    if graphdef is None:
        return {}
    with nnx.use_eager_sharding(False):
        return layer_kinds(nnx.merge(graphdef, state))


def _value(leaf: Any) -> Any:
    return leaf.get_value() if is_variable(leaf) else leaf


def code_is_typed(state: Any, mesh: Any) -> bool:
    """Whether a model's code is created under the mesh context.

    On Auto axes always; on Explicit axes when its variables carry their specs in their types
    (Explicit style).
    """
    if jax.sharding.AxisType.Explicit not in tuple(mesh.axis_types):
        return True
    return any(typed_spec(variable) is not None for _, variable in variables(state))


def shardings_of(rows: tuple[VariableSharding, ...], state: Any, mesh: Any) -> Any:
    """A state like ``state`` holding each row's ``NamedSharding`` on ``mesh``, by path."""
    by_path = {row.path: row for row in rows}
    return map_variables(lambda path, _: NamedSharding(mesh, by_path[path].spec), state)


def model_plan(
    model: nnx.Module,
    mesh: Any = None,
    rules: Rules = None,
    strategy: Strategy = None,
    layout: LayoutLike = None,
    *,
    what: str,
) -> ModelPlan:
    """The plan a model remembers, or (for a model substrax did not place) one made now.

    Raises:
      TypeError: If ``model`` is not an ``nnx.Module``.
      ValueError: If the model remembers a plan and the arguments disagree with it.
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(
            f"{what} expects an nnx.Module (create_sharded_model returns one), got "
            f"{type(model).__name__}."
        )
    plan = plan_of(model)
    if plan is None and all(x is None for x in (mesh, rules, strategy, layout)):
        plan = _plan_of_copy(model, what)
    if isinstance(plan, ModelPlan):
        if mesh is not None:  # without a plan, make_resolver checks it
            check_mesh(mesh)
        plan.check_arguments(mesh, rules, strategy, what)
        if layout is not None and as_layout(layout, plan.mesh) != plan.layout:
            raise ValueError(
                f"{what} was given layout {layout!r}, but the model was created with "
                f"{plan.layout}. Leave it out: the model's plan is used."
            )
        return plan
    resolver, layout = make_resolver(mesh, rules, strategy, layout)
    return ModelPlan(nnx.state(model), resolver, layout=layout, graphdef=nnx.graphdef(model))


def _plan_of_copy(model: nnx.Module, what: str) -> ModelPlan | None:
    """The plan of the model ``model`` is a copy of (``nnx.clone``, ``nnx.merge``), or None.

    A copy has its original's graph and every array in its original's planned sharding; it
    takes that plan (and remembers it). A model whose arrays are sharded but match no live
    plan is never re-planned with default options.

    Raises:
      ValueError: If ``model``'s arrays are sharded over several devices but no live plan
        matches them.
    """
    graphdef, state = nnx.split(model)
    for plan in {id(p): p for p in _PLANS.values() if isinstance(p, ModelPlan)}.values():
        if plan.graphdef is None or not equal(plan.graphdef, graphdef):
            continue
        if not _misplaced(plan, state):
            remember(model, plan)
            return plan
    shardings = [getattr(v, "sharding", None) for v in jax.tree.leaves(state)]
    meshes = {s.mesh.shape_tuple for s in shardings if isinstance(s, NamedSharding)}
    if any(s is not None and len(s.device_set) > 1 for s in shardings):
        raise ValueError(
            f"{what} was given a model whose arrays are sharded (over the mesh "
            f"{', '.join(str(dict(m)) for m in meshes) or 'of its arrays'}) but that has no "
            "substrax plan: it is a copy (nnx.clone, nnx.merge) of a model whose plan is gone, "
            "or was placed by hand. Pass its plan's mesh and layout (or rules), or the plan "
            "itself: make_train_step(loss_fn, plan=plan)."
        )
    return None


def _check_stages(rows: tuple[VariableSharding, ...], layout: Layout | None, mesh: Any) -> None:
    """Raises when a layout splits pipeline stages but the model has no stacked layers.

    Raises:
      ValueError: If ``layout`` has stage axes of size > 1 and no variable has a ``layers``
        dimension (or a spec on those axes): every device would hold the whole model.
    """
    sizes = dict(mesh.shape)
    stages = tuple(a for a in (layout.pipe_axes if layout is not None else ()) if sizes[a] > 1)
    if not stages:
        return
    for row in rows:
        if "layers" in (row.logical_names or ()) or any(
            a in stages for entry in row.spec for a in as_axes(entry)
        ):
            return
    raise ValueError(
        f"Layout {layout.name!r} splits the model's stacked layers (the 'layers' dimension) "
        f"over the stage axes {stages}, but no variable of the model has a 'layers' "
        "dimension: every device would hold the whole model. Stack the blocks with "
        "nnx.vmap(..., transform_metadata={nnx.PARTITION_NAME: 'layers'}) and train with "
        "make_train_step(Stages(...)) (see docs/pipeline.md), or use a layout without pipeline "
        "stages ('fsdp', 'fsdp+tp')."
    )


def _misplaced(plan: ModelPlan, state: Any) -> list[str]:
    """Where ``state``'s arrays are not in ``plan``'s shardings (path and both shardings)."""
    planned = values_by_path(plan.shardings)
    wrong = []
    for path, value in values_by_path(state).items():
        sharding = getattr(value, "sharding", None)
        if path not in planned:
            wrong.append(f"{path} is not in the plan")
        elif sharding != planned[path]:
            wrong.append(f"{path} is laid out as {sharding}, the plan has {planned[path]}")
    return wrong
