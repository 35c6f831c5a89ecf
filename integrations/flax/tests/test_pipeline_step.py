"""A Flax NNX model whose stacked layers run as a pipeline trains like the unpipelined model."""

import re

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from flax_test_models import (
    EMBED,
    Block,
    StackedTransformer,
    assert_laid_out_as,
    relative_error,
    rms_norm,
    token_loss,
    tokens,
)
from jax.sharding import PartitionSpec as P

import substrax_flax as sf
from substrax import ShardingWarning, spmd
from substrax.hlo import traffic_by_kind
from substrax.layout import Layout
from substrax.mesh import DeviceMeshManager, MeshRules

NAMES = dict(vocab=None, kv=None, mlp=None, heads=None, embed=None)


def embed(model, batch):
    return model.embed(batch[:, :-1]), batch[:, 1:]


def block(layer, x):
    return layer(x)


def head(model, y, targets):
    logits = rms_norm(y, model.norm[...]) @ model.head[...]
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def _factory(layers):
    return lambda: StackedTransformer(nnx.Rngs(0), layers=layers)


@pytest.fixture(scope="module")
def reference():
    mesh = DeviceMeshManager.create_device_mesh({"data": 8})
    rules = MeshRules(data="data").extend(layers=None, **NAMES)
    results = {}
    for layers in (4, 6, 8):
        model = sf.create_sharded_model(_factory(layers), mesh, rules)
        optimizer = sf.create_sharded_optimizer(model, optax.adamw(1e-2), mesh, rules)
        step = sf.make_train_step(token_loss, mesh, rules)
        losses = [float(step(model, optimizer, tokens(seed=i))["loss"]) for i in range(3)]
        results[layers] = losses, nnx.state(model)
    return results


@pytest.mark.parametrize(
    ("schedule", "repeats", "layers"),
    [("gpipe", 1, 4), ("1f1b", 1, 4), ("circular", 2, 8), ("interleaved", 2, 8), ("zb-h1", 1, 4)],
)
def test_pipelined_training_matches_and_keeps_shardings(reference, schedule, repeats, layers):
    mesh = DeviceMeshManager.create_device_mesh({"pipe": 4, "data": 2})
    rules = MeshRules(data="data").extend(layers="pipe", **NAMES)
    model = sf.create_sharded_model(_factory(layers), mesh, rules)
    optimizer = sf.create_sharded_optimizer(model, optax.adamw(1e-2), mesh, rules)
    assert model.blocks.wq[...].sharding.spec == P("pipe", None, None, None)
    planned = [a.sharding for a in jax.tree.leaves((nnx.state(model), nnx.state(optimizer)))]
    step = sf.make_train_step(
        sf.Stages(embed, block, head, stack="blocks", schedule=schedule, repeats=repeats),
        mesh,
        rules,
        microbatches=4,
    )
    losses = [float(step(model, optimizer, tokens(seed=i))["loss"]) for i in range(3)]
    ref_losses, ref_state = reference[layers]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert int(optimizer.step[...]) == 3
    assert_laid_out_as(jax.tree.leaves((nnx.state(model), nnx.state(optimizer))), planned)
    # As in test_train: gradients agree to ~1e-7; three adam steps through a scanned stack
    # amplify that to a few 1e-5 on some leaves, while the losses agree within 1e-5.
    leaves = zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(ref_state), strict=True)
    for got, want in leaves:
        assert relative_error(got, want) < 5e-5


def _padded(layers, mesh):
    """The 6-layer reference's stack in a stack of the pipeline's 8 slots (slot order)."""
    from substrax.mesh import PipelineParallelStrategy
    from substrax.pipeline import Pipeline

    pipe = Pipeline(block, head, mesh, PipelineParallelStrategy("pipe", 0, 4), num_microbatches=4)
    slots = pipe.num_slots(6)  # [2, 2, 1, 1] layers per stage: 4 x 2 slots, two masked
    return slots, pipe.unstack(pipe.stack(layers)[0], 6, keep_padding=True)


def test_a_padded_uneven_stack_is_sharded_over_the_stages_and_trains_like_its_layers(reference):
    mesh = DeviceMeshManager.create_device_mesh({"pipe": 4, "data": 2})
    rules = MeshRules(data="data").extend(layers="pipe", **NAMES)
    ref_losses, ref_state = reference[6]
    with nnx.use_eager_sharding(False):
        layers = nnx.state(_factory(6)().blocks)  # the reference's initial layers
    slots, stack = _padded(layers, mesh)
    assert slots == 8
    model = sf.create_sharded_model(_factory(slots), mesh, rules)
    nnx.update(model.blocks, jax.tree.map(lambda a, b: jax.device_put(a, b.sharding),
                                          stack, nnx.state(model.blocks)))  # fmt: skip
    optimizer = sf.create_sharded_optimizer(model, optax.adamw(1e-2), mesh, rules)
    assert model.blocks.wq[...].sharding.spec == P("pipe", None, None, None)
    step = sf.make_train_step(
        sf.Stages(embed, block, head, stack="blocks", num_layers=6), mesh, rules, microbatches=4
    )
    losses = [float(step(model, optimizer, tokens(seed=i))["loss"]) for i in range(3)]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    real = np.array([0, 1, 2, 3, 4, 6])  # stage 2's and 3's second slots are padding
    got = jax.tree.map(lambda a: np.asarray(a)[real], nnx.state(model.blocks))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(ref_state["blocks"]), strict=True):
        assert relative_error(g, w) < 5e-5


def test_an_uneven_stack_warns_and_a_wrong_layer_count_is_named():
    mesh = DeviceMeshManager.create_device_mesh({"pipe": 4, "data": 2})
    rules = MeshRules(data="data").extend(layers="pipe", **NAMES)
    with pytest.warns(ShardingWarning):
        model = sf.create_sharded_model(_factory(6), mesh, rules)  # 6 does not divide 4
    optimizer = sf.create_sharded_optimizer(model, optax.adamw(1e-2), mesh, rules)
    step = sf.make_train_step(
        sf.Stages(embed, block, head, stack="blocks"), mesh, rules, microbatches=4
    )
    with pytest.warns(ShardingWarning, match=r"step.num_slots\(6\) = 8 layers"):
        step(model, optimizer, tokens())
    step = sf.make_train_step(
        sf.Stages(embed, block, head, stack="blocks", num_layers=5), mesh, rules, microbatches=4
    )
    with pytest.raises(ValueError, match="num_layers=5: the stack stores 6 layers, but 5 layers "
                                         "take 8 padded slots"):  # fmt: skip
        step(model, optimizer, tokens())


def test_bad_configuration():
    mesh = DeviceMeshManager.create_device_mesh({"pipe": 4, "data": 2})
    with pytest.raises(ValueError, match="stage_axis 'stage' is not a mesh axis"):
        sf.make_train_step(
            sf.Stages(embed, block, head, stack="blocks", stage_axis="stage"), mesh, microbatches=4
        )
    rules = MeshRules(data="data").extend(layers="pipe", **NAMES)
    model = sf.create_sharded_model(_factory(4), mesh, rules)
    optimizer = sf.create_sharded_optimizer(model, optax.adamw(1e-2), mesh, rules)
    step = sf.make_train_step(
        sf.Stages(embed, block, head, stack="layers"), mesh, rules, microbatches=4
    )
    with pytest.raises(ValueError, match="no attribute 'layers' holding the layer stack"):
        step(model, optimizer, tokens())


def test_one_step_trains_two_models_each_with_its_own_pipeline(reference):
    mesh = DeviceMeshManager.create_device_mesh({"pipe": 4, "data": 2})
    rules = MeshRules(data="data").extend(layers="pipe", **NAMES)
    step = sf.make_train_step(
        sf.Stages(embed, block, head, stack="blocks"), mesh, rules, microbatches=4
    )
    runs = {}
    for layers in (4, 8):
        model = sf.create_sharded_model(_factory(layers), mesh, rules)
        runs[layers] = model, sf.create_sharded_optimizer(model, optax.adamw(1e-2))
    losses = {4: [], 8: []}
    for i in range(3):  # interleaved: building the second model's step must not touch the first's
        for layers, (model, optimizer) in runs.items():
            losses[layers].append(float(step(model, optimizer, tokens(seed=i))["loss"]))
    for layers in (4, 8):
        np.testing.assert_allclose(losses[layers], reference[layers][0], rtol=1e-5)


def test_a_pipeline_is_immutable():
    from substrax.mesh import PipelineParallelStrategy
    from substrax.pipeline import Pipeline

    mesh = DeviceMeshManager.create_device_mesh({"pipe": 4, "data": 2})
    pipe = Pipeline(block, head, mesh, PipelineParallelStrategy("pipe", 0, 4), num_microbatches=4)
    with pytest.raises(AttributeError, match="A Pipeline is immutable"):
        pipe.layer_fn = embed


def _constrained_block(layer, x):
    return spmd.constrain(layer(x), "data", None, "embed_tp")


def _constraints_on_model(step, model, optimizer, batch):
    """The sharding constraints of a stage's activation (2 rows x 8 tokens x 32) on 'model'."""
    text = step.lower(model, optimizer, batch).as_text()
    found = re.findall(r'sharding_constraint .*<@mesh, \[\{\}, \{\}, \{"model"\}\]> : '
                       r"tensor<2x8x32xf32>", text)  # fmt: skip
    return len(found)


def test_constrain_inside_a_stage_resolves_through_the_rules():
    mesh = DeviceMeshManager.create_device_mesh({"pipe": 2, "data": 2, "model": 2})
    rules = MeshRules(data="data").extend(layers="pipe", embed_tp="model", **NAMES)
    model = sf.create_sharded_model(_factory(4), mesh, rules)
    optimizer = sf.create_sharded_optimizer(model, optax.adamw(1e-2), mesh, rules)
    counts = {}
    for name, fn in (("constrained", _constrained_block), ("plain", block)):
        step = sf.make_train_step(
            sf.Stages(embed, fn, head, stack="blocks"), mesh, rules, microbatches=2
        )
        counts[name] = _constraints_on_model(step, model, optimizer, tokens())
    # the plain block's are the stage boundary's (each device sends its 1/tp of an
    # activation); the constrained block adds its own, forward (and its transpose)
    assert counts["plain"] >= 1 and counts["constrained"] >= counts["plain"] + 1


def test_a_pp_x_fsdp_layout_trains_from_create_sharded_model_like_the_flat_step(reference):
    layout = Layout.from_degrees(pp=2, fsdp=4)
    mesh = layout.make_mesh()
    model = sf.create_sharded_model(_factory(4), mesh, layout=layout)
    optimizer = sf.create_sharded_optimizer(model, optax.adamw(1e-2))
    assert model.blocks.wq[...].sharding.spec == P("pipe", "fsdp", None, None)
    # as the flat step: the model's plan brings the mesh and the layout
    step = sf.make_train_step(sf.Stages(embed, block, head, stack="blocks"), microbatches=2)
    with pytest.raises(ValueError, match=r"num_slots needs the stage count: make the step with"):
        step.num_slots(4)
    plan = step.plan_for(model, optimizer, tokens())
    assert "fsdp          'fsdp'" in str(plan) and plan.path == "pipeline"
    (wq,) = [p for p in plan.params if p.path == "blocks/wq"]
    assert wq.gradient == "reduce-scatter over ('fsdp',)"
    traffic = traffic_by_kind(step.lower(model, optimizer, tokens()).compile().as_text(), 8)
    assert traffic["reduce-scatter"]["count"] >= 1 and traffic["all-gather"]["count"] >= 1
    losses = [float(step(model, optimizer, tokens(seed=i))["loss"]) for i in range(3)]
    np.testing.assert_allclose(losses, reference[4][0], rtol=1e-5)


def test_remat_takes_the_names_the_flat_step_takes(reference):
    mesh = DeviceMeshManager.create_device_mesh({"pipe": 4, "data": 2})
    rules = MeshRules(data="data").extend(layers="pipe", **NAMES)
    with pytest.raises(
        ValueError, match=r"remat must be one of \('none', 'selective', 'offload', 'full'\)"
    ):
        sf.make_train_step(
            sf.Stages(embed, block, head, stack="blocks"), mesh, rules, microbatches=4, remat="some"
        )
    model = sf.create_sharded_model(_factory(4), mesh, rules)
    optimizer = sf.create_sharded_optimizer(model, optax.adamw(1e-2), mesh, rules)
    step = sf.make_train_step(
        sf.Stages(embed, block, head, stack="blocks"),
        mesh,
        rules,
        microbatches=4,
        remat="selective",
    )
    plan = step.plan_for(model, optimizer, tokens())
    assert plan.remat == "selective" and "remat         selective" in str(plan)
    losses = [float(step(model, optimizer, tokens(seed=i))["loss"]) for i in range(3)]
    np.testing.assert_allclose(losses, reference[4][0], rtol=1e-5)


def _head_with_aux(model, y, targets):
    logits = rms_norm(y, model.norm[...]) @ model.head[...]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    return loss, {"accuracy": (logits.argmax(-1) == targets).mean()}


def _loss_with_aux(model, batch):
    logits = model(batch[:, :-1])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
    return loss, {"accuracy": (logits.argmax(-1) == batch[:, 1:]).mean()}


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
def test_aux_outputs_are_the_flat_steps(schedule):
    flat_mesh = DeviceMeshManager.create_device_mesh({"data": 8})
    flat_rules = MeshRules(data="data").extend(layers=None, **NAMES)
    model = sf.create_sharded_model(_factory(4), flat_mesh, flat_rules)
    optimizer = sf.create_sharded_optimizer(model, optax.adamw(1e-2), flat_mesh, flat_rules)
    flat = sf.make_train_step(_loss_with_aux, flat_mesh, flat_rules, has_aux=True)
    want = [flat(model, optimizer, tokens(seed=i)) for i in range(2)]
    mesh = DeviceMeshManager.create_device_mesh({"pipe": 4, "data": 2})
    rules = MeshRules(data="data").extend(layers="pipe", **NAMES)
    model = sf.create_sharded_model(_factory(4), mesh, rules)
    optimizer = sf.create_sharded_optimizer(model, optax.adamw(1e-2), mesh, rules)
    step = sf.make_train_step(
        sf.Stages(embed, block, _head_with_aux, stack="blocks", schedule=schedule),
        mesh,
        rules,
        microbatches=4,
        has_aux=True,
    )
    got = [step(model, optimizer, tokens(seed=i)) for i in range(2)]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(float(g["loss"]), float(w["loss"]), rtol=1e-5)
        np.testing.assert_allclose(float(g["accuracy"]), float(w["accuracy"]), atol=1e-6)
    assert got[0]["path"] == "pipeline" and want[0]["path"] == "manual"
    step = sf.make_train_step(
        sf.Stages(embed, block, head, stack="blocks"), mesh, rules, microbatches=4, has_aux=True
    )
    with pytest.raises(TypeError, match="has_aux=True, so head_fn must return"):
        step(model, optimizer, tokens())


WRT = nnx.All(nnx.Param, nnx.Any(nnx.PathContains("up"), nnx.PathContains("head")))


def test_wrt_trains_a_subset_like_the_flat_step_and_leaves_the_rest():
    flat_mesh = DeviceMeshManager.create_device_mesh({"data": 8})
    flat_rules = MeshRules(data="data").extend(layers=None, **NAMES)
    model = sf.create_sharded_model(_factory(4), flat_mesh, flat_rules)
    optimizer = sf.create_sharded_optimizer(model, optax.adamw(1e-2), flat_mesh, flat_rules,
                                            wrt=WRT)  # fmt: skip
    flat = sf.make_train_step(token_loss, flat_mesh, flat_rules, wrt=WRT)
    want = [float(flat(model, optimizer, tokens(seed=i))["loss"]) for i in range(3)]
    mesh = DeviceMeshManager.create_device_mesh({"pipe": 4, "data": 2})
    rules = MeshRules(data="data").extend(layers="pipe", **NAMES)
    model = sf.create_sharded_model(_factory(4), mesh, rules)
    before = {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    optimizer = sf.create_sharded_optimizer(model, optax.adamw(1e-2), mesh, rules, wrt=WRT)
    step = sf.make_train_step(
        sf.Stages(embed, block, head, stack="blocks"), mesh, rules, microbatches=4, wrt=WRT
    )
    plan = step.plan_for(model, optimizer, tokens())
    (wq,) = [p for p in plan.params if p.path == "blocks/wq"]
    assert wq.gradient.startswith("none: not in wrt")
    got = [float(step(model, optimizer, tokens(seed=i))["loss"]) for i in range(3)]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    after = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    for path, value in before.items():
        trained = any(part in ("up", "head") for part in path)
        assert np.array_equal(value, np.asarray(after[path])) != trained, path


class _DropoutBlock(Block):
    """The test block with dropout on its output, as most published transformers have."""

    def __init__(self, rngs, rate):
        super().__init__(rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)

    def __call__(self, x):
        return self.drop(super().__call__(x))


class _DropoutStack(StackedTransformer):
    """StackedTransformer with dropout on each block's output (or another block kind)."""

    def __init__(self, rngs, layers=4, rate=0.5, kind=_DropoutBlock):
        super().__init__(rngs, layers=layers)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make(rngs):
            return kind(rngs, rate)

        self.blocks = make(rngs)


def _spread(model, y, targets):
    """The loss, and its square: the mean of squares exceeds the squared mean exactly when
    the microbatches' (and devices') losses differ."""
    loss = head(model, y, targets)
    return loss, {"square": loss**2}


def _dropout_run(layout, microbatches, rate=0.5, steps=2, batch=None, step=None):
    model = sf.create_sharded_model(lambda: _DropoutStack(nnx.Rngs(0), rate=rate), layout=layout)
    optimizer = sf.create_sharded_optimizer(model, optax.adamw(1e-2))
    step = step or sf.make_train_step(
        sf.Stages(embed, block, _spread, stack="blocks"),
        layout.make_mesh(),
        layout=layout,
        microbatches=microbatches,
        has_aux=True,
    )
    batches = [tokens(seed=i) if batch is None else batch for i in range(steps)]
    metrics = [{k: float(v) for k, v in step(model, optimizer, b).items() if k != "path"}
               for b in batches]  # fmt: skip
    return metrics, step


def _one_device_losses(rate, steps=3):
    """The flat step on one device: what every pipelined layout must equal, dropout included."""
    mesh = DeviceMeshManager.create_device_mesh({"data": 1}, devices=jax.devices()[:1])
    rules = MeshRules(data="data").extend(layers=None, **NAMES)
    model = sf.create_sharded_model(lambda: _DropoutStack(nnx.Rngs(0), rate=rate), mesh, rules)
    optimizer = sf.create_sharded_optimizer(model, optax.adamw(1e-2), mesh, rules)
    step = sf.make_train_step(token_loss, mesh, rules)
    return [float(step(model, optimizer, tokens(seed=i))["loss"]) for i in range(steps)]


def test_dropout_in_stages_draws_one_devices_masks_on_every_layout():
    want = _one_device_losses(0.5)
    assert abs(want[0] - _one_device_losses(0.0, steps=1)[0]) > 1e-2  # dropout is on
    for layout, micro in ((Layout.from_degrees(pp=2, dp=4), 2), (Layout.from_degrees(pp=2), 4)):
        runs, step = _dropout_run(layout, micro, steps=3)
        np.testing.assert_allclose([m["loss"] for m in runs], want, rtol=1e-5,
                                   err_msg=layout.label)  # fmt: skip
        line = next(d for d in step.plan.decisions if d.name == "random")
        assert line.value == "one device's draws"
        assert line.reason.startswith("draws of 1 shape(s) split with the rows (dimension 0)")


class _NoisyBlock(_DropoutBlock):
    """Adds noise of one more element than the rows: a draw that does not split with them."""

    def __call__(self, x):
        noise = jax.random.normal(self.drop.rngs(), (x.shape[0] + 1,))
        return super().__call__(x) + noise[: x.shape[0], None, None]


def _stack_step(kind):
    """A pp 2 x dp 4 model of ``kind`` blocks, its optimizer and a pipelined step."""
    layout = Layout.from_degrees(pp=2, dp=4)
    model = sf.create_sharded_model(lambda: _DropoutStack(nnx.Rngs(0), kind=kind), layout=layout)
    optimizer = sf.create_sharded_optimizer(model, optax.sgd(0.1))
    step = sf.make_train_step(
        sf.Stages(embed, block, head, stack="blocks"),
        layout.make_mesh(),
        layout=layout,
        microbatches=2,
    )
    return model, optimizer, step


def test_a_draw_that_does_not_split_with_the_rows_is_refused_naming_its_shapes():
    model, optimizer, step = _stack_step(_NoisyBlock)
    with pytest.raises(
        ValueError,
        match=r"one device's random numbers, but the loss draws .*"
        r"shape \(9,\) on the whole batch and \(2,\) on 1/8 of its rows",
    ):
        step(model, optimizer, tokens())


def test_dropout_rate_zero_equals_the_flat_step():
    mesh = DeviceMeshManager.create_device_mesh({"data": 8})
    rules = MeshRules(data="data").extend(layers=None, **NAMES)
    model = sf.create_sharded_model(lambda: _DropoutStack(nnx.Rngs(0), rate=0.0), mesh, rules)
    optimizer = sf.create_sharded_optimizer(model, optax.adamw(1e-2), mesh, rules)
    step = sf.make_train_step(token_loss, mesh, rules)
    want = [float(step(model, optimizer, tokens(seed=i))["loss"]) for i in range(3)]
    runs, _ = _dropout_run(Layout.from_degrees(pp=2, dp=4), 2, rate=0.0, steps=3)
    got = [m["loss"] for m in runs]
    np.testing.assert_allclose(got, want, rtol=1e-5)


class _NormedBlock(Block):
    def __init__(self, rngs, rate):
        super().__init__(rngs)
        self.bn = nnx.BatchNorm(EMBED, rngs=rngs)

    def __call__(self, x):
        return self.bn(super().__call__(x))


def test_batch_statistics_in_a_stage_are_refused_with_the_reason():
    model, optimizer, step = _stack_step(_NormedBlock)
    with pytest.raises(ValueError, match=r"found \['BatchStat'\].*batch statistics.*make_train_st"):
        step(model, optimizer, tokens())


SPLIT = (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))


def _schedule_run(layout, schedule, repeats, factory, precision=None, remat="none", steps=2):
    """Losses, aux and parameters after ``steps`` sgd steps (a step's update is its gradient)."""
    model = sf.create_sharded_model(factory, layout=layout)
    optimizer = sf.create_sharded_optimizer(model, optax.sgd(0.5))
    step = sf.make_train_step(
        sf.Stages(embed, block, _spread, stack="blocks", schedule=schedule, repeats=repeats),
        layout.make_mesh(),
        layout=layout,
        microbatches=2,
        precision=precision,
        remat=remat,
        has_aux=True,
    )
    metrics = [step(model, optimizer, tokens(seed=i)) for i in range(steps)]
    losses = [(float(m["loss"]), float(m["square"])) for m in metrics]
    return losses, jax.tree.leaves(nnx.state(model, nnx.Param)), step


@pytest.mark.parametrize(
    ("degrees", "dropout", "precision", "remat", "schedules"),
    [
        ({"pp": 2, "fsdp": 4}, False, None, "none", SPLIT),
        ({"pp": 2, "dp": 4, "zero": 1}, True, None, "none", SPLIT),
        ({"pp": 2, "dp": 2, "tp": 2}, False, None, "selective", SPLIT[2:]),
    ],
    ids=["pp-x-fsdp", "pp-x-zero1-dropout", "pp-x-tp-selective"],
)
def test_every_schedule_trains_like_gpipe(degrees, dropout, precision, remat, schedules):
    """Losses, aux and the gradients (sgd's updates) of the split schedules equal GPipe's on
    pp x fsdp, on pp x zero1 with dropout, and on pp x tp with selective remat; each plan
    names its schedule's idle share. (bf16 compute: test_precision's pipeline test runs the
    default ZB-H1; pp x tp with bf16 aborts XLA:CPU's all-reduce promotion, GPipe too.)"""
    layout = Layout.from_degrees(**degrees)
    factory = (lambda: _DropoutStack(nnx.Rngs(0), rate=0.3)) if dropout else _factory(4)
    want, want_params, _ = _schedule_run(layout, "gpipe", 1, factory, precision, remat)
    # gradients to float tolerance (bf16 compute would round the weight gradients' products
    # in another fusion than GPipe's transpose: 3e-4 apart, measured on pp x zero1)
    tolerance = 5e-5 if precision is None else 1e-3
    for schedule, repeats in schedules:
        got, params, step = _schedule_run(layout, schedule, repeats, factory, precision, remat)
        np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=schedule)
        for a, b in zip(params, want_params, strict=True):
            assert relative_error(a, b) < tolerance, schedule
        plan = str(step.plan)  # the plan of the program that ran
        assert re.search(rf"schedule +{schedule}.* idle 0\.\d{{3}} of the stages' ticks", plan)


@pytest.mark.parametrize(
    ("schedule", "repeats", "layers"), [("zb-h1", 1, 4), ("circular", 2, 8), ("interleaved", 2, 8)]
)
def test_a_pipelined_evaluation_is_the_steps_loss_with_the_forward_traffic_only(
    schedule, repeats, layers
):
    """make_eval_step(Stages(...)): the stack forward through the pipeline, nothing back."""
    mesh = DeviceMeshManager.create_device_mesh({"pipe": 4, "data": 2})
    rules = MeshRules(data="data").extend(layers="pipe", **NAMES)
    model = sf.create_sharded_model(_factory(layers), mesh, rules)
    optimizer = sf.create_sharded_optimizer(model, optax.adamw(1e-2), mesh, rules)
    stages = sf.Stages(embed, block, head, stack="blocks", schedule=schedule, repeats=repeats)
    step = sf.make_train_step(stages, mesh, rules, microbatches=4, donate=False)
    evaluate = sf.make_eval_step(stages, mesh, rules, microbatches=4)
    batch = tokens(seed=3)
    before = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model))]
    metrics = evaluate(model, batch)
    for got, want in zip(jax.tree.leaves(nnx.state(model)), before, strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)  # nothing in the model changed
    # the training step's loss on the same batch is computed before its update
    trained = float(step(model, optimizer, batch)["loss"])
    assert relative_error(float(metrics["loss"]), trained) < 1e-5
    # the forward half of the step's traffic: stage sends forward, no gradient reduction
    model = sf.create_sharded_model(_factory(layers), mesh, rules)
    optimizer = sf.create_sharded_optimizer(model, optax.adamw(1e-2), mesh, rules)
    moved = _moved(evaluate.lower(model, batch))
    trains = _moved(step.lower(model, optimizer, batch))
    assert 0 < moved <= trains / 2, (moved, trains)


def _moved(lowered) -> float:
    """Bytes a compiled program's collectives move per device (each loop trip counted)."""
    kinds = traffic_by_kind(lowered.compile().as_text(), 8, trips=True)
    return sum(kind["bytes"] for kind in kinds.values())


def test_a_pipelined_evaluation_says_what_it_needs():
    mesh = DeviceMeshManager.create_device_mesh({"pipe": 4, "data": 2})
    rules = MeshRules(data="data").extend(layers="pipe", **NAMES)
    stages = sf.Stages(embed, block, head, stack="blocks")
    with pytest.raises(TypeError, match=r"make_eval_step\(Stages\(...\)\) needs microbatches=M"):
        sf.make_eval_step(stages, mesh, rules)
    with pytest.raises(TypeError, match=r"sums=\('n',\): a pipelined evaluation returns"):
        sf.make_eval_step(stages, mesh, rules, microbatches=4, sums=("n",))
    # an interleaved stack evaluates through circular's forward, which needs a microbatch
    # per stage at least
    interleaved = sf.Stages(embed, block, head, stack="blocks", schedule="interleaved", repeats=2)
    evaluate = sf.make_eval_step(interleaved, mesh, rules, microbatches=2)
    model = sf.create_sharded_model(_factory(8), mesh, rules)
    with pytest.raises(ValueError, match="microbatches"):
        evaluate(model, tokens(seed=0))
