"""The step plan: every decision made before tracing, printed, and then what the step runs.

One case per reason the plan gives for its gradient path; each prints the plan before the
first call, then compiles the step and checks the program takes that path: the manual step
reduce-scatters the FSDP gradients, XLA's all-reduces them.
"""

import dataclasses
import gc
import warnings

import gpt
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import substrax_flax as sf
from substrax import ShardingWarning
from substrax.hlo import traffic_by_kind
from substrax.layout import LAYOUTS, Layout
from substrax.mesh import DeviceMeshManager, FSDPStrategy
from substrax.planner._estimate import _xla_step

KEY = jax.random.key(7)  # a key that is not an nnx.Rngs stream, closed over by a loss


class MLP(nnx.Module):
    """Plain nnx.Linear layers (no biases: ZeRO shards every state).

    Optionally a statistic of its own, or a bare batch-axis spec in its code.
    """

    def __init__(self, rngs: nnx.Rngs, *, stat: bool = False, names_batch: bool = False):
        self.up = nnx.Linear(16, 64, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(64, 16, use_bias=False, rngs=rngs)
        self.seen = nnx.BatchStat(jnp.zeros(())) if stat else None
        self.names_batch = names_batch

    def __call__(self, x):
        h = jax.nn.relu(self.up(x))
        if self.names_batch:
            h = jax.lax.with_sharding_constraint(h, P("data"))
        if self.seen is not None:
            self.seen[...] = h.mean()
        return self.down(h)


def _loss(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def _noisy_loss(model, batch):
    return _loss(model, batch) + 1e-3 * jax.random.normal(KEY, ()).astype(jnp.float32)


def _batch(rows=16, seq=None):
    rng = np.random.default_rng(0)
    shape = (rows, 16) if seq is None else (rows, seq, 16)
    x = rng.normal(size=shape).astype(np.float32)
    return {"x": x, "y": np.tanh(x).astype(np.float32)}


def _fsdp(mesh):
    return dataclasses.replace(Layout.named("fsdp", mesh), fsdp_min_elements=8)


def _case(mesh, layout, model=MLP, loss=_loss, batch=None, **options):
    mesh = DeviceMeshManager.create_device_mesh(mesh) if isinstance(mesh, dict) else mesh
    built = sf.create_sharded_model(lambda: model(nnx.Rngs(0)), mesh, layout=layout(mesh))
    optimizer = sf.create_sharded_optimizer(built, optax.adamw(1e-2))
    step = sf.make_train_step(loss, **options)
    return step, built, optimizer, batch or _batch()


REASONS = {
    "nothing in the way": (
        lambda: _case({"data": 8}, _fsdp), "manual", "each device computes its own rows"),
    "xla asked": (
        lambda: _case({"data": 8}, _fsdp, data_parallel="xla"), "xla", "'xla' was asked"),
    "a key that is not a stream": (
        lambda: _case({"data": 8}, _fsdp, loss=_noisy_loss), "xla", "not an nnx.Rngs stream"),
    "statistics of its own": (
        lambda: _case({"data": 8}, _fsdp, model=lambda r: MLP(r, stat=True)), "xla",
        "batch statistics (seen"),
    "code that names a batch axis": (
        lambda: _case({"data": 8}, _fsdp, model=lambda r: MLP(r, names_batch=True)), "xla",
        "names the batch axes ('data',)"),
    "two axes left to XLA": (
        lambda: _case({"fsdp": 2, "context": 2, "model": 2},
                      lambda m: Layout.from_degrees(fsdp=2, cp=2, tp=2), batch=_batch(seq=4)),
        "xla", "two mesh axes of size > 1 outside it, here ('context', 'model')"),
    "bf16 all-reduces over a tensor axis on CPU": (
        lambda: _case({"data": 4, "model": 2}, lambda m: Layout.named("fsdp+tp", m),
                      precision="mixed"), "xla", "aborts on bfloat16 all-reduces"),
    "one replica": (
        lambda: _case({"data": 1, "model": 8}, lambda m: Layout.named("tp", m)), "xla",
        "one replica"),
    "accumulation on one replica": (
        lambda: _case({"data": 1, "model": 8}, lambda m: Layout.named("tp", m),
                      microbatches=2), "manual", "gradient accumulation"),
}  # fmt: skip


def _planned(step, model, optimizer, batch):
    """The plan, and the warnings planning gave (each a ShardingWarning naming its cost)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = step.plan_for(model, optimizer, batch)
    for warning in caught:
        assert issubclass(warning.category, ShardingWarning), warning.message
        assert "MiB more per device per step" in str(warning.message)
    assert len(caught) == (1 if plan.path == "xla" and plan.extra_bytes else 0), str(plan)
    return plan


@pytest.mark.parametrize("reason", list(REASONS))
def test_the_printed_plan_names_the_path_the_compiled_step_takes(reason):
    make, path, why = REASONS[reason]
    step, model, optimizer, batch = make()
    plan = _planned(step, model, optimizer, batch)
    printed = str(plan)
    assert plan.path == path and why in plan.reason, printed
    assert f"path          {path}: " in printed and why in printed
    traffic = traffic_by_kind(step.lower(model, optimizer, batch).compile().as_text(), 8)
    if any(p.gradient.startswith("reduce-scatter") for p in plan.params):
        assert traffic["reduce-scatter"]["count"] >= 1, reason
    if path == "xla":  # XLA's step never reduce-scatters a gradient here, the manual one does
        assert traffic["reduce-scatter"]["count"] == 0, reason
        assert all(p.gradient.endswith("(XLA)") or p.gradient == "none" for p in plan.params)
    assert step.plan is plan  # the program the step would run (one compile: no call here)


def test_a_switch_that_costs_traffic_is_a_plan_line_and_a_warning():
    step, model, optimizer, batch = _case({"data": 8}, _fsdp, loss=_noisy_loss)
    with pytest.warns(ShardingWarning, match=r"not an nnx.Rngs stream.* MiB more per device"):
        plan = step.plan_for(model, optimizer, batch)
    assert plan.extra_bytes > 0 and "Draw from an nnx.Rngs stream" in plan.advice
    (cost,) = [d for d in plan.decisions if d.name == "cost"]
    assert cost.value == f"{plan.extra_bytes / 2**20:.1f} MiB"


def test_each_parameter_line_says_how_its_gradient_is_reduced_and_where_its_state_lives():
    mesh = {"data": 4, "model": 2}
    step, model, optimizer, batch = _case(mesh, lambda m: Layout.named("zero1+tp", m))
    plan = step.plan_for(model, optimizer, batch)
    rows = {p.path: p for p in plan.params}
    kernel = rows["up/kernel"]
    assert kernel.used == kernel.stored  # ZeRO-1 keeps parameters whole on the replicas
    # ... and reduce-scatters each gradient to its optimizer state's shard
    assert kernel.optimizer == P("data", "model") and kernel.stored == P(None, "model")
    assert kernel.gradient == "reduce-scatter over ('data',)"
    line = "up/kernel: P(None, 'model') -> P(None, 'model'); reduce-scatter over ('data',); "
    assert line + "P('data', 'model')" in str(plan)
    traffic = traffic_by_kind(step.lower(model, optimizer, batch).compile().as_text(), 8)
    assert traffic["reduce-scatter"]["count"] >= 1


def test_the_plan_is_there_after_a_call_and_says_what_is_missing_before():
    step, model, optimizer, batch = _case({"data": 8}, _fsdp)
    with pytest.raises(ValueError, match=r"no plan yet.*step.plan_for\(model, optimizer, batch\)"):
        step.plan  # noqa: B018
    assert step(model, optimizer, batch)["path"] == "manual"
    assert step.plan.path == "manual" and step.plan.batch_axes == ("data",)
    assert step.plan.mesh is model.up.kernel[...].sharding.mesh


FLAT_LAYOUTS = [name for name in LAYOUTS if name != "pp"]


@pytest.mark.parametrize(
    "layout",
    [Layout.named(name, {"data": 2, "model": 4}) for name in FLAT_LAYOUTS]
    + [Layout.from_degrees(fsdp=2, cp=2, tp=2), Layout.from_degrees(fsdp=2, ep=2, tp=2)],
    ids=[*FLAT_LAYOUTS, "fsdp+cp+tp", "fsdp+ep+tp"],
)
def test_the_planner_and_the_step_agree_on_the_path(layout):
    seq = 4 if layout.cp > 1 else None
    step, model, optimizer, batch = _case(layout.shape, lambda m: layout, batch=_batch(seq=seq))
    plan = _planned(step, model, optimizer, batch)
    assert (plan.path == "xla") == _xla_step(layout), str(plan)


# The benchmark decoder at a test's size, on the two meshes a user may bring.
CONFIG = gpt.Config(vocab=256, d_model=64, heads=4, mlp=128, layers=2, seq=16, dropout=0.1)


def _decoder_run(mesh):
    model = sf.create_sharded_model(lambda: gpt.GPT(CONFIG, nnx.Rngs(0)), mesh, layout="fsdp")
    optimizer = sf.create_sharded_optimizer(model, gpt.optimizer())
    step = sf.make_train_step(gpt.loss_fn)
    batches = [gpt.batch_at(i, 16, CONFIG.seq) for i in range(3)]
    plan = step.plan_for(model, optimizer, batches[0])
    traffic = traffic_by_kind(step.lower(model, optimizer, batches[0]).compile().as_text(), 8)
    losses = [float(step(model, optimizer, b)["loss"]) for b in batches]
    return plan, traffic, losses, model


def test_a_model_written_for_auto_axes_trains_on_a_jax_make_mesh_mesh_as_on_an_auto_one():
    auto = _decoder_run(DeviceMeshManager.create_device_mesh({"data": 8}))
    explicit = _decoder_run(jax.make_mesh((8,), ("data",)))
    assert jax.make_mesh((8,), ("data",)).axis_types == (AxisType.Explicit,)
    for plan, traffic, _, _ in (auto, explicit):
        assert plan.path == "manual" and traffic["reduce-scatter"]["count"] >= 1
    assert "Auto twin" in str(explicit[0]) and "Auto twin" not in str(auto[0])
    assert explicit[1] == auto[1]  # the same collectives, byte for byte
    np.testing.assert_allclose(explicit[2], auto[2], rtol=1e-6)
    # the model stays on the user's mesh, with its Explicit axes
    kernel = explicit[3].blocks[0].wq[...]
    assert kernel.sharding.mesh.axis_types == (AxisType.Explicit,)


def _placed():
    mesh = DeviceMeshManager.create_device_mesh({"data": 8})
    plan = sf.plan_model(lambda: MLP(nnx.Rngs(0)), mesh, layout=_fsdp(mesh))
    return plan, plan.create()


def test_a_copy_keeps_its_plan():
    plan, model = _placed()
    for copy in (nnx.clone(model), nnx.merge(*nnx.split(model))):
        optimizer = sf.create_sharded_optimizer(copy, optax.adamw(1e-2))
        mu = optimizer.opt_state[0].mu["up"]["kernel"][...]
        planned = plan.shardings["up"]["kernel"].get_value()
        assert mu.sharding == copy.up.kernel[...].sharding == planned
        assert sf.make_train_step(_loss).plan_for(copy, optimizer, _batch()).path == "manual"


def test_a_sharded_model_without_a_live_plan_is_not_replanned():
    plan, model = _placed()
    copy = nnx.clone(model)
    del plan, model  # the plan goes with the last model that remembers it
    gc.collect()
    sharded = nnx.clone(copy)
    del copy
    gc.collect()
    with pytest.raises(ValueError, match=r"sharded .* no substrax plan.*plan=plan"):
        sf.create_sharded_optimizer(sharded, optax.adamw(1e-2))


def test_a_plan_passed_to_the_optimizer_and_the_step_checks_the_model():
    plan, model = _placed()
    copy = nnx.clone(model)
    optimizer = sf.create_sharded_optimizer(copy, optax.adamw(1e-2), plan=plan)
    step = sf.make_train_step(_loss, plan=plan)
    assert step(copy, optimizer, _batch())["path"] == "manual"
    assert step.plan_for(copy, optimizer, _batch()).path == "manual"
    mesh = DeviceMeshManager.create_device_mesh({"data": 8})
    other = sf.create_sharded_model(lambda: MLP(nnx.Rngs(0)), mesh, layout="dp")
    with pytest.raises(ValueError, match="placed by another plan"):
        sf.create_sharded_optimizer(other, optax.adamw(1e-2), plan=plan)
    with pytest.raises(ValueError, match="placed by another plan"):
        step(other, sf.create_sharded_optimizer(other, optax.adamw(1e-2)), _batch())
    with pytest.raises(TypeError, match=r"plan= holds the layout; pass the plan or layout"):
        sf.make_train_step(_loss, plan=plan, layout="dp")
    with pytest.raises(TypeError, match=r"plan= holds the mesh; pass the plan or mesh"):
        sf.create_sharded_optimizer(model, optax.adamw(1e-2), mesh, plan=plan)


def test_the_plan_is_a_value_no_method_of_it_builds_a_step_an_optimizer_or_a_report():
    plan, _ = _placed()
    assert not any(hasattr(plan, name) for name in ("train_step", "optimizer", "report"))
    assert sf.sharding_report(plan).row(plan.rows[0].path).spec == plan.rows[0].spec


def test_a_strategy_that_differs_only_in_a_setting_is_not_the_models():
    mesh = DeviceMeshManager.create_device_mesh({"data": 8})
    model = sf.create_sharded_model(
        lambda: MLP(nnx.Rngs(0)), mesh, strategy=FSDPStrategy("data", 0, min_weight_size=8)
    )
    optimizer = sf.create_sharded_optimizer(model, optax.adamw(1e-2))
    same = FSDPStrategy("data", 0, min_weight_size=8)
    step = sf.make_train_step(_loss, strategy=same, batch_axes="data")
    assert step.plan_for(model, optimizer, _batch()).path == "manual"
    other = FSDPStrategy("data", 0)  # the same repr
    step = sf.make_train_step(_loss, strategy=other, batch_axes="data")
    with pytest.raises(ValueError, match="strategy FSDPStrategy"):
        step.plan_for(model, optimizer, _batch())


def test_moving_arrays_to_the_auto_twin_copies_nothing():
    from substrax_flax._jitted import rehome

    explicit = jax.make_mesh((8,), ("data",))
    twin = explicit.update(axis_types=(AxisType.Auto,))
    x = jax.device_put(np.ones((16, 4), np.float32),
                       jax.sharding.NamedSharding(explicit, P("data")))  # fmt: skip
    (y,) = rehome((x,), twin)
    assert y.sharding.mesh == twin and y.sharding.spec == P("data")
    for a, b in zip(x.addressable_shards, y.addressable_shards, strict=True):
        assert a.data.unsafe_buffer_pointer() == b.data.unsafe_buffer_pointer()
