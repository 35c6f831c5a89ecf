"""make_eval_step: a forward function run at the training step's layout, without gradients.

An evaluation (a held-out loss, an accuracy, the logits) runs on the layout the model trains
on: the same decision between the manual region and XLA's partitioning, made before tracing
from the same evidence (:meth:`TrainStep._route`), parameters gathered once per call as the
training step gathers them, the batch split over the batch axes. Where the training step
reduce-scatters gradients, an evaluation moves nothing back: its traffic is the forward half
of a training step's. A plain ``nnx.jit`` forward of an FSDP model instead lets XLA gather
each parameter per use and reduce partial products.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from substrax.distributed import progress
from substrax.mesh import spec_entry
from substrax.spmd import MixedPrecision, check_batch, is_replicated_leaf, use_rules
from substrax_flax._cache import ProgramKey, StepCache
from substrax_flax._jitted import Built, JittedStep, mark_entry
from substrax_flax._manual import batch_specs, manual_movers, manual_rules, state_of
from substrax_flax._pipeline_step import Stages
from substrax_flax._plan import ModelPlan, model_plan, shardings_of
from substrax_flax._probes import cheap_sharding_probes
from substrax_flax._resolve import Rules, Strategy
from substrax_flax._state import check_filter
from substrax_flax._step_plan import Decision, StepPlan, param_steps, precision_name
from substrax_flax._train import (
    TrainStep,
    _batch_reason,
    _on,
    check_global_rows,
    check_takes_model_and_batch,
    make_train_step,
)

__all__ = ["EvalStep", "PipelineEvalStep", "make_eval_step"]


class EvalStep:
    """A jitted forward function at the model's layout: ``metrics = eval_step(model, batch)``.

    Build it with :func:`make_eval_step`. Like a :class:`TrainStep` it compiles once per
    program (model graph, shapes, shardings, batch), keeps every parameter in its planned
    sharding, and shows its decisions (:meth:`plan_for`); it changes nothing in the model.
    """

    def __init__(self, fn: Callable[..., Any], sums: tuple[str, ...], router: TrainStep):
        """Stores the configuration; see :func:`make_eval_step`.

        Args:
          fn: ``fn(model, batch) -> metrics``.
          sums: The metrics (top-level keys) summed over the batch, not averaged.
          router: A training step configured as the evaluation is: its routing (mesh,
            region, path) and loss wrapping serve the evaluation.
        """
        self.fn, self.sums, self._router = fn, sums, router
        self._compiled = StepCache()
        self._last: Built | None = None

    @cheap_sharding_probes()
    def __call__(self, model: nnx.Module, batch: Any) -> dict:
        """Evaluates ``fn`` on ``batch``.

        Args:
          model: The model (laid out by its plan; left unchanged).
          batch: Host arrays (sharded over the batch axes here) or ``jax.Array``s on the mesh.

        Returns:
          ``fn``'s metrics: each scalar the batch's mean (a name in ``sums``: its sum), each
          array with the batch's leading dimension the whole batch's rows.
        """
        built, state = self._built(model, batch)
        compiling = mark_entry(built, "eval step")  # for the launcher
        with jax.set_mesh(built.mesh):
            metrics = built.jitted(built.enter(state), JittedStep._batch(batch, built))
        if compiling:
            progress("eval step")
        return metrics

    def plan_for(self, model: nnx.Module, batch: Any) -> StepPlan:
        """The evaluation's decisions for these arguments (compiled if not yet).

        Args:
          model: The model.
          batch: A batch, as for a call.

        Returns:
          The :class:`StepPlan`: its path, mesh, region and each parameter's specs.
        """
        return self._built(model, batch)[0].plan

    @property
    def plan(self) -> StepPlan:
        """The plan of the program used last.

        Raises:
          RuntimeError: Before the first call.
        """
        if self._last is None:
            raise RuntimeError("The eval step has no plan yet: call it, or use plan_for(...).")
        return self._last.plan

    @cheap_sharding_probes()
    def lower(self, model: nnx.Module, batch: Any) -> jax.stages.Lowered:
        """The evaluation's program for these arguments, lowered (not run).

        Args:
          model: The model.
          batch: A batch, as for a call.

        Returns:
          The lowered program; ``.compile().as_text()`` shows its collectives.
        """
        built, state = self._built(model, batch)
        with jax.set_mesh(built.mesh):
            return built.jitted.lower(built.enter(state), JittedStep._batch(batch, built))

    @cheap_sharding_probes()
    def _built(self, model: nnx.Module, batch: Any) -> tuple[Built, Any]:
        if not isinstance(model, nnx.Module):
            raise TypeError(f"model must be an nnx.Module, got {type(model).__name__}.")
        check_batch(batch)
        model_def, state = nnx.split(model)
        key = ProgramKey.of((model_def, None), (state, ()), batch)
        built = self._compiled.get(key)
        if built is None:
            progress("eval step: planning and compiling a program", busy=True)
            built = self._build(model, batch)
            self._compiled.put(key, built)
        self._last = built
        return built, state

    def _build(self, model: nnx.Module, batch: Any) -> Built:
        router = self._router
        plan = router._given
        if plan is not None:
            plan.adopt(model, "make_eval_step(plan=...)")
        else:
            plan = model_plan(model, router.mesh, router.rules, router.strategy, router.layout,
                              what="make_eval_step")  # fmt: skip
        params = nnx.state(model, router.wrt)
        compute_sh, rules = router._compute(plan, params)
        route = router._route(model, batch, plan, compute_sh, rules, _draws_stay_with_xla)
        mesh, region = route.mesh, route.region
        used = _on(mesh, compute_sh)
        movers = None
        if route.path.name == "manual":
            check_global_rows(batch, mesh, region, 1)
            rows = {row.path: row for row in plan.rows}
            movers = manual_movers(params, rows, region, used, router.precision, plan.layout)
        step_plan = _eval_plan(route, plan, params, compute_sh, router)
        model_sh = _on(mesh, shardings_of(plan.rows, nnx.state(model), plan.mesh))
        active = manual_rules(rules, region) if region else rules
        model_def = nnx.graphdef(model)

        def evaluate(model_state, batch):
            with use_rules(mesh, active, manual_batch_axes=region), nnx.use_eager_sharding(False):
                merged = nnx.merge(model_def, model_state)
                _, params, rest = nnx.split(merged, router.wrt, ...)
                rest_leaves, rest_def = jax.tree.flatten(rest)
                forward = router._loss_fn(model_def, used, rest_def, region)
                if movers is None:  # XLA partitions the whole batch: its means are the batch's
                    return forward(params, rest_leaves, batch)[1][0]
                whole = router._loss_fn(model_def, used, rest_def)  # the shapes, on every row
                shapes = jax.eval_shape(lambda: whole(params, rest_leaves, batch)[1][0])
                return manual_forward(forward, params, rest_leaves, batch, mesh=mesh,
                                      batch_axes=region, movers=movers, sums=self.sums,
                                      shapes=shapes)  # fmt: skip

        jitted = jax.jit(evaluate, in_shardings=(model_sh, None))
        home = plan.mesh if mesh is not plan.mesh else None
        return Built(jitted, mesh, route.batch_axes, route.path.name, route.seq_axes, step_plan,
                     home)  # fmt: skip


def manual_forward(
    forward: Callable[..., Any],
    params: Any,
    rest_leaves: list,
    batch: Any,
    *,
    mesh: jax.sharding.Mesh,
    batch_axes: tuple[str, ...],
    movers: Any,
    sums: Sequence[str],
    shapes: Any,
) -> Any:
    """``forward``'s metrics with each device on its own rows, parameters gathered once.

    Args:
      forward: ``forward(params, rest_leaves, batch) -> (loss, (metrics, rest))``.
      params: The parameters, stored sharded.
      rest_leaves: The other state's leaves.
      batch: The batch, sharded over ``batch_axes``.
      mesh: The mesh.
      batch_axes: The axes of the region (the batch's, of size > 1).
      movers: Each parameter's :class:`~substrax_flax._manual.Mover`.
      sums: The top-level metrics summed over the devices; other scalars are averaged.
      shapes: The metrics' shapes on the whole batch (``jax.eval_shape``).

    Returns:
      The metrics: scalars reduced over the devices, arrays the whole batch's rows.
    """
    template = params

    def local(pure, rest_leaves, batch):
        gathered = jax.tree.map(lambda x, m: m.all_gather(x), pure, movers)
        metrics = forward(state_of(template, gathered), rest_leaves, batch)[1][0]
        return _reduced(metrics, batch_axes, sums)

    rows = PartitionSpec(spec_entry(batch_axes))
    out_specs = _out_specs(shapes, _rows(batch), rows)
    specs = jax.tree.map(lambda m: m.spec, movers)
    in_specs = (specs, PartitionSpec(), batch_specs(batch, batch_axes))
    mapped = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                           axis_names=set(batch_axes))  # fmt: skip
    return mapped(nnx.to_pure_dict(params), rest_leaves, batch)


def _rows(batch: Any) -> int | None:
    leaves = [x for x in jax.tree.leaves(batch) if not is_replicated_leaf(x)]
    return leaves[0].shape[0] if leaves else None


def _out_specs(shapes: Any, rows: int | None, spec: PartitionSpec) -> Any:
    """Each metric's spec out of the region: a scalar whole, a per-row array split by rows.

    Raises:
      ValueError: For a metric that is neither a scalar nor an array of the batch's rows.
    """

    def one(path, shape):
        if not shape.shape:
            return PartitionSpec()
        if shape.shape[0] == rows:
            return spec
        name = jax.tree_util.keystr(path) or "the metric"
        raise ValueError(
            f"make_eval_step: fn returned {name} of shape {shape.shape}, neither a scalar nor "
            f"an array of the batch's {rows} rows. Return scalars (averaged over the batch, or "
            "summed when named in sums=) and per-row arrays (the batch's rows, gathered)."
        )

    return jax.tree_util.tree_map_with_path(one, shapes)


def _reduced(metrics: Any, axes: tuple[str, ...], sums: Sequence[str]) -> Any:
    """Scalars averaged (or summed: ``sums``) over ``axes``; arrays left as each device's rows."""

    def one(path, x):
        if jnp.ndim(x):
            return x
        summed = bool(path) and _key(path[0]) in sums
        return jax.lax.psum(x, axes) if summed else jax.lax.pmean(x, axes)

    return jax.tree_util.tree_map_with_path(one, metrics)


def _key(entry: Any) -> Any:
    return getattr(entry, "key", getattr(entry, "name", getattr(entry, "idx", None)))


class PipelineEvalStep(EvalStep):
    """An evaluation of a pipelined model: its :class:`Stages` run forward only.

    Build it with :func:`make_eval_step` and :class:`Stages`. The embedding runs on the whole
    batch, the stack through the training schedule's forward pass
    (:meth:`PipelineTrainStep.forward_schedule`: GPipe's for one chunk per stage), each
    stage on its own layers and each microbatch's activations passed to the next stage, and
    the head's loss (and aux items) comes back as the mean over the microbatches. Nothing is
    differentiated, reduced back or changed in the model. It has no step plan (``plan_for``
    returns None).
    """

    def _build(self, model: nnx.Module, batch: Any) -> Built:
        return self._router._build(model, None, batch, forward=True)


def _draws_stay_with_xla(model, mesh, batch, split, traced) -> None:
    """Keeps an evaluation that draws random numbers on XLA's partitioning.

    XLA's partitioning draws as one device does (a model left in training mode: call
    ``model.eval()``).

    Raises:
      ValueError: Naming the draws, when ``fn`` draws from the model's streams.
    """
    del model, mesh, batch, split
    shapes = traced().draw_shapes
    if shapes:
        raise ValueError(
            f"the evaluation draws random numbers ({len(shapes)} draw(s), e.g. of shape "
            f"{shapes[0]}): a model in training mode? model.eval() turns dropout off"
        )


def _eval_plan(route, plan: ModelPlan, params: Any, compute_sh: Any, router: TrainStep) -> StepPlan:
    """The evaluation's decisions, as a :class:`StepPlan` prints them."""
    path, region = route.path, route.region
    steps = param_steps(plan, params, compute_sh, path.name, route.split)
    steps = tuple(dataclasses.replace(p, gradient="none (evaluation)") for p in steps)
    decisions = (
        Decision("path", path.name, path.reason),
        route.decision,
        Decision("batch axes", str(route.batch_axes), _batch_reason(router.batch_axes, plan)),
        Decision("region", str(region) if region else "none",
                 "manual over the batch axes of size > 1: each parameter gathered once"
                 if region else "XLA partitions the whole evaluation"),
        Decision("precision", precision_name(router.precision), "as asked"),
    )  # fmt: skip
    return StepPlan(path.name, path.reason, route.mesh, route.batch_axes, region,
                    route.seq_axes, router.precision, "none", 1, "keep", 0, steps, decisions,
                    path.advice)  # fmt: skip


def make_eval_step(
    fn: Callable[..., Any],
    mesh: jax.sharding.Mesh | None = None,
    rules: Rules = None,
    *,
    layout: Any = None,
    strategy: Strategy = None,
    sums: Sequence[str] = (),
    batch_axes: Sequence[str] | str | None = None,
    precision: MixedPrecision | str | None = None,
    data_parallel: str = "auto",
    wrt: Any = nnx.Param,
    plan: ModelPlan | None = None,
    microbatches: int | None = None,
) -> EvalStep:
    """Builds a jitted evaluation that runs ``fn`` at the training step's layout.

    ``fn(model, batch)`` returns its metrics (a dict, or any pytree): scalars such as a loss
    or an accuracy, and arrays with the batch's leading dimension such as logits. It runs
    without gradients where :func:`make_train_step` would run the loss: in the manual region
    over the batch axes (each device its own rows, each parameter gathered once per call: the
    forward half of a training step's traffic), or with XLA partitioning the whole batch
    where the training step would too (the plan says why). Nothing in the model changes.
    Put the model in evaluation mode first (``model.eval()``: no dropout); an evaluation that
    draws random numbers keeps XLA's partitioning, which draws as one device does.

    Args:
      fn: ``fn(model, batch) -> metrics``.
      mesh: For a model substrax did not place: the device mesh.
      rules: For a model substrax did not place: its rules.
      layout: For a model substrax did not place: its layout.
      strategy: For a model substrax did not place: its strategy.
      sums: Top-level metric names summed over the batch (a count of correct tokens);
        every other scalar is the batch's mean, each device's mean averaged (exact for means
        over rows, as the training step's loss is).
      batch_axes: The mesh axes of the batch's leading dimension (default: the plan's).
      precision: The mixed-precision policy, as for :func:`make_train_step`.
      data_parallel: ``"auto"``, ``"manual"`` or ``"xla"``, as for :func:`make_train_step`.
      wrt: The variables that are parameters (gathered as the training step gathers them).
      plan: The plan every model must be laid out by (instead of the one it remembers).
      microbatches: With :class:`Stages`: the microbatches the pipeline runs forward (the
        training step's count, or any that splits the batch).

    ``fn`` may be the pipelined model's :class:`Stages` instead (as given to
    :func:`make_train_step`): the evaluation then runs the stack forward through the
    pipeline (:class:`PipelineEvalStep`) and returns the head's loss and aux items, means
    over the microbatches.

    Returns:
      An :class:`EvalStep`: ``metrics = eval_step(model, batch)``.

    Raises:
      TypeError: If ``fn`` is not callable, ``sums`` is not a sequence of names, or ``plan``
        comes with ``mesh``, ``rules``, ``layout`` or ``strategy``.
      ValueError: As :func:`make_train_step` for the other arguments; on the first call,
        for a metric that is neither a scalar nor a per-row array, or batch rows that do
        not split evenly over the manual forward's batch axes.
    """
    if isinstance(fn, Stages):
        return _pipelined_eval(fn, mesh, rules, layout=layout, sums=sums, batch_axes=batch_axes,
                               precision=precision, wrt=wrt, microbatches=microbatches)  # fmt: skip
    if not callable(fn):
        raise TypeError(f"fn must be a function fn(model, batch) -> metrics, got {fn!r:.80}.")
    check_takes_model_and_batch(fn, "fn", "make_eval_step")
    if isinstance(sums, str) or not all(isinstance(name, str) for name in sums):
        raise TypeError(f"sums must be a sequence of metric names, got {sums!r}.")
    check_filter(wrt)

    def as_loss(model, batch):
        return jnp.zeros((), jnp.float32), fn(model, batch)

    router = make_train_step(
        as_loss, mesh, rules, layout=layout, strategy=strategy, has_aux=True, wrt=wrt,
        batch_axes=batch_axes, donate=False, on_nonfinite="apply", precision=precision,
        data_parallel=data_parallel, plan=plan,
    )  # fmt: skip
    router._entry = "make_eval_step"
    return EvalStep(fn, tuple(sums), router)


def _pipelined_eval(stages, mesh, rules, *, layout, sums, batch_axes, precision, wrt,
                    microbatches) -> PipelineEvalStep:  # fmt: skip
    """:func:`make_eval_step` for :class:`Stages`.

    Raises:
      TypeError: Without ``microbatches``, or with ``sums`` (the head's metrics are means).
    """
    if microbatches is None:
        raise TypeError(
            "make_eval_step(Stages(...)) needs microbatches=M: the microbatches the pipeline "
            "runs forward (the training step's count, say)."
        )
    if sums:
        raise TypeError(
            f"sums={tuple(sums)!r}: a pipelined evaluation returns the head's metrics as means "
            "over the microbatches; return a mean from the head instead."
        )
    router = make_train_step(
        stages, mesh, rules, layout=layout, microbatches=microbatches, batch_axes=batch_axes,
        donate=False, on_nonfinite="apply", precision=precision, wrt=wrt,
    )  # fmt: skip
    return PipelineEvalStep(stages.head, (), router)
