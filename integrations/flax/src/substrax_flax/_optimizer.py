"""create_sharded_optimizer: an nnx.Optimizer whose optax state is created already sharded."""

from __future__ import annotations

import weakref
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import PartitionSpec

from substrax import warn_user
from substrax.layout import Layout
from substrax.mesh import Reason
from substrax_flax._plan import ModelPlan, model_plan, remember, shardings_of
from substrax_flax._probes import cheap_sharding_probes
from substrax_flax._resolve import Rules, Strategy, VariableSharding, make_row
from substrax_flax._state import (
    check_filter,
    constrain_state,
    is_abstract,
    shape_and_dtype,
    variables,
)

__all__ = ["create_sharded_optimizer", "optimizer_rows"]


def _mirrored_param(path: str, shape: tuple[int, ...], params: dict) -> VariableSharding | None:
    """The parameter whose path ends ``path`` and whose shape is ``shape``, if any."""
    parts = path.split("/")
    for start in range(len(parts)):
        row = params.get("/".join(parts[start:]))
        if row is not None and row.shape == shape:
            return row
    return None


def optimizer_rows(
    opt_state: Any,
    param_rows: tuple[VariableSharding, ...],
    mesh: Any,
    layout: Layout | None = None,
) -> tuple[VariableSharding, ...]:
    """Rows for an optimizer state: a leaf that mirrors a parameter takes its spec.

    A leaf mirrors a parameter when its path ends with the parameter's path and its shape is
    the parameter's (adam's ``mu`` / ``nu``, momentum traces, ...). Under a ZeRO layout it is
    also sharded over the replica axes (:meth:`~substrax.layout.Layout.optimizer_spec`); one
    that no dimension of divides keeps its parameter's spec, with a reason in its row and one
    ``ShardingWarning`` for all of them. Every other leaf (step counters, scalars, factored
    statistics) is replicated, and its row says so.

    Args:
      opt_state: The optimizer's ``nnx.State`` (abstract or live).
      param_rows: The rows of the parameters.
      mesh: The device mesh; None means one device (see :func:`plan_model`).
      layout: The model's layout, if it has one.

    Returns:
      One row per optimizer-state variable.
    """
    params = {row.path: row for row in param_rows}
    rows, whole = [], []
    for path, variable in variables(opt_state):
        param = _mirrored_param(path, shape_and_dtype(variable)[0], params)
        if param is not None:
            spec, why = param.spec, None
            if layout is not None and layout.zero:
                spec, why = layout.optimizer_spec(param.spec, param.shape)
            reasons = param.reasons
            if why is not None:
                reasons += (Reason("indivisible", None, None, layout.optimizer_axes, why),)
                whole.append(path)
            row = make_row(
                path,
                variable,
                spec,
                mesh,
                names=param.logical_names,
                rule=f"mirrors {param.path}"
                + (f", zero{layout.zero}" if spec != param.spec else ""),
                reasons=reasons,
            )
        else:
            shape = shape_and_dtype(variable)[0]
            why = Reason("by_design", None, None, (), "not parameter-shaped: replicated")
            row = make_row(
                path,
                variable,
                PartitionSpec(),
                mesh,
                names=None,
                rule="not parameter-shaped",
                reasons=(why,) if shape else (),
            )
        rows.append(row)
    if whole:
        warn_user(
            f"{len(whole)} optimizer state leaves are not sharded over the replica axes "
            f"{layout.optimizer_axes} of the zero{layout.zero} layout (no dimension divides), "
            f"the first {whole[0]!r}; see sharding_report(optimizer)."
        )
    return tuple(rows)


def create_sharded_optimizer(
    model: nnx.Module,
    tx: optax.GradientTransformation,
    mesh: jax.sharding.Mesh | None = None,
    rules: Rules = None,
    *,
    wrt: Any = nnx.Param,
    strategy: Strategy = None,
    plan: ModelPlan | None = None,
) -> nnx.Optimizer:
    """Creates an ``nnx.Optimizer`` for ``model`` with its optax state already sharded.

    The optax state is created inside ``jax.jit``: every leaf that mirrors a parameter (adam
    ``mu`` / ``nu``, momentum, ...) gets that parameter's planned sharding, and counters and
    other leaves are replicated. Flax's eager sharding is off while the state is created, so
    the ``optimizer_sharding`` metadata and flax issue 5112 (stacked layers) play no part.

    A model from :func:`create_sharded_model` (or :func:`shard_model`) remembers its plan, and
    the optimizer follows it: leave ``mesh``, ``rules`` and ``strategy`` out. They are for a
    model that substrax did not place.

    Args:
      model: The model, usually from :func:`create_sharded_model`.
      tx: The optax transformation, such as ``optax.adamw(1e-3)``.
      mesh: For a model substrax did not place: the device mesh (None: one device).
      rules: For a model substrax did not place: its rules (see :func:`plan_model`).
      wrt: The variables the optimizer updates, as for ``nnx.Optimizer``.
      strategy: For a model substrax did not place: its strategy.
      plan: The plan that laid ``model`` out (a copy of a placed model whose plan is gone,
        for one); instead of ``mesh``, ``rules`` and ``strategy``.

    Returns:
      The optimizer, its state sharded like the parameters it mirrors.

    Raises:
      TypeError: If ``tx`` is not an optax transformation (has no ``init`` and ``update``),
        or ``plan`` comes with ``mesh``, ``rules`` or ``strategy``.
      ValueError: As :func:`plan_model`, when ``mesh``, ``rules`` or ``strategy`` differ
        from the plan the model remembers, or the model is not laid out by ``plan``.
    """
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(
            f"tx must be an optax transformation such as optax.adamw(1e-3), got {tx!r} "
            f"({type(tx).__name__})."
        )
    graphdef, model_state = nnx.split(model)
    check_filter(wrt)
    what = "create_sharded_optimizer"
    if plan is None:
        plan = model_plan(model, mesh, rules, strategy, what=what)
    else:
        plan.adopt(model, what, mesh=mesh, rules=rules, strategy=strategy)
    mesh, param_rows = plan.mesh, plan.rows

    def make(state):
        with nnx.use_eager_sharding(False), cheap_sharding_probes():
            return nnx.Optimizer(nnx.merge(graphdef, state), tx, wrt=wrt)

    opt_graphdef, abstract_opt_state = nnx.split(nnx.eval_shape(make, model_state))
    rows = optimizer_rows(abstract_opt_state, param_rows, mesh, plan.layout)
    shardings = shardings_of(rows, abstract_opt_state, mesh)

    def init(state):
        opt_state = nnx.state(make(state))
        return constrain_state(opt_state, shardings)

    jitted = jax.jit(init, out_shardings=shardings)
    made = jax.eval_shape(jitted, model_state) if is_abstract(model_state) else jitted(model_state)
    optimizer = nnx.merge(opt_graphdef, made)
    remember(optimizer, rows)
    _OWNERS[optimizer] = weakref.ref(model)
    return optimizer


# The model each optimizer from create_sharded_optimizer was made for.
_OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_owner(optimizer: nnx.Optimizer, model: nnx.Module, what: str) -> None:
    """Raises if ``optimizer`` was created by substrax for another model than ``model``.

    Raises:
      ValueError: If it was (its state would silently train the wrong parameters).
    """
    owner = _OWNERS.get(optimizer)
    if owner is not None and owner() is not model:
        raise ValueError(
            f"{what} was given an optimizer that create_sharded_optimizer made for another "
            f"model ({type(owner()).__name__} at {id(owner()):#x}, not this "
            f"{type(model).__name__} at {id(model):#x}); pass the optimizer created from this "
            "model."
        )
