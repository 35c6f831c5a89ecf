"""Bad input to the adapter: clear errors that name the variable, or warnings when asked."""

import warnings

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax_test_models import Transformer
from jax.sharding import PartitionSpec as P

import substrax_flax as sf
from substrax import ShardingWarning
from substrax.mesh import DeviceMeshManager, MeshRules, fsdp_rules

RULES = fsdp_rules().extend(vocab="model", kv=None)


@pytest.fixture(scope="module")
def mesh():
    return DeviceMeshManager.create_device_mesh({"data": 2, "model": 4})


def _one(shape, names):
    class One(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(np.ones(shape, np.float32), out_sharding=names)

    return One


def test_a_long_annotation_is_an_error_and_a_short_one_is_padded(mesh):
    message = r"'w' of shape \(8, 4\): 3 logical names \('embed', 'mlp', 'kv'\)"
    with pytest.raises(ValueError, match=message):
        sf.plan_model(_one((8, 4), ("embed", "mlp", "kv")), mesh, RULES)
    row = sf.sharding_report(sf.plan_model(_one((8, 4), ("embed",)), mesh, RULES)).row("w")
    assert row.spec == P("model", None)
    assert [r.kind for r in row.reasons] == ["padded"]
    assert "padded with None, as Flax does" in str(row.reasons[0])


def test_unknown_logical_name_lists_the_known_ones(mesh):
    with pytest.raises(ValueError) as info:
        sf.plan_model(_one((8, 4), ("embed", "experts")), mesh, RULES)
    message = str(info.value)
    assert message.startswith("Variable 'w' of shape (8, 4): 'experts' (in ('embed', 'experts'))")
    # the rules' names, then the mesh's axes (an Explicit-style spec may name those)
    assert "logical name of the rules (['data', 'embed', 'mlp', 'heads', 'kv', 'vocab'])" in message
    assert "nor an axis of the mesh (('data', 'model'))" in message
    assert "rules=[('experts', None)]" in message and "rules.extend(experts=None)" in message
    assert "unknown_names='replicate'" in message


def test_unknown_logical_name_can_be_replicated_with_a_warning(mesh):
    with pytest.warns(ShardingWarning, match="'experts'"):
        plan = sf.plan_model(
            _one((8, 4), ("embed", "experts")), mesh, RULES, unknown_names="replicate"
        )
    row = sf.sharding_report(plan).row("w")
    assert row.spec == P("model", None)
    assert [(r.kind, r.dim, r.logical_name) for r in row.reasons] == [
        ("unknown_name", 1, "experts")
    ]


def test_rule_naming_a_missing_mesh_axis(mesh):
    with pytest.raises(ValueError, match=r"mesh axis 'tensor', which the mesh does not have"):
        sf.plan_model(_one((8, 4), ("embed", None)), mesh, MeshRules(embed="tensor"))


def test_repeated_logical_name_names_the_variable(mesh):
    with pytest.raises(
        ValueError, match=r"Variable 'w' .*: Logical axis name 'embed' appears more"
    ):
        sf.plan_model(_one((8, 8), ("embed", "embed")), mesh, RULES)


def test_indivisible_dimension_moves_its_axis_or_warns_where_it_cannot(mesh):
    row = sf.sharding_report(sf.plan_model(_one((6, 4), ("embed", None)), mesh, RULES)).row("w")
    assert row.spec == P(None, "model")  # 'model' moved to the dimension it divides
    assert [str(r) for r in row.reasons] == [
        "dim 0 (embed): 6 is not divisible by mesh axes ('model',); moved to dim 1 (4), now "
        "sharded model"
    ]
    with pytest.warns(ShardingWarning) as caught:
        plan = sf.plan_model(_one((6, 4), ("embed", None)), mesh, RULES, indivisible="replicate")
    variable, total = (str(w.message) for w in caught)  # the variable's, then the model's
    assert variable == (
        "Variable 'w' of shape (6, 4): dim 0 (embed): 6 is not divisible by mesh axes ('model',) "
        "of size 4; ('model',) left out. It is laid out as P(None, None)."
    )
    assert "4.00x" in total and "although dim 1 (4) divides them: indivisible='move'" in total
    assert sf.sharding_report(plan).row("w").spec == P(None, None)
    with pytest.warns(ShardingWarning) as caught:
        plan = sf.plan_model(_one((6, 3), ("embed", None)), mesh, RULES)  # nowhere to move
    variable, total = (str(w.message) for w in caught)
    assert variable.startswith("Variable 'w' of shape (6, 3): dim 0 (embed): 6 is not divisible")
    assert "no dimension divides their 4 devices (dim 0 (6) asked for them)" in total
    assert sf.sharding_report(plan).row("w").spec == P(None, None)


def test_indivisible_dimension_raises_when_strict(mesh):
    with pytest.raises(ValueError, match=r"dim 0 \(embed\): 6 is not divisible .* \(strict=True\)"):
        sf.plan_model(_one((6, 4), ("embed", None)), mesh, RULES, strict=True)


def test_tuple_rule_keeps_the_axes_that_divide(mesh):
    rules = MeshRules(embed=("data", "model"))
    with pytest.warns(ShardingWarning) as caught:
        plan = sf.plan_model(_one((6, 4), ("embed", None)), mesh, rules, indivisible="replicate")
    assert "dim 0 (embed): 6 is not divisible" in str(caught[0].message)
    assert sf.sharding_report(plan).row("w").spec == P("data", None)
    moved = sf.sharding_report(sf.plan_model(_one((6, 4), ("embed", None)), mesh, rules)).row("w")
    assert moved.spec == P("data", "model")


def test_a_factory_that_raises_propagates_its_own_exception(mesh):
    class Broken(Exception):
        pass

    def factory():
        raise Broken("the user's own error")

    with pytest.raises(Broken, match="the user's own error"):
        sf.create_sharded_model(factory, mesh, RULES)


def test_wrong_argument_types(mesh):
    with pytest.raises(TypeError, match="rules must be a MeshRules"):
        sf.plan_model(lambda: Transformer(nnx.Rngs(0)), mesh, "fsdp")
    with pytest.raises(TypeError, match="strategy must be a ShardingStrategy"):
        sf.plan_model(lambda: Transformer(nnx.Rngs(0)), mesh, RULES, strategy="fsdp")
    with pytest.raises(ValueError, match="unknown_names must be 'error' or 'replicate'"):
        sf.plan_model(lambda: Transformer(nnx.Rngs(0)), mesh, RULES, unknown_names="skip")
    with pytest.raises(TypeError, match=r"expects a ModelPlan, an nnx\.Module"):
        sf.sharding_report([1, 2])
    with pytest.raises(TypeError, match=r"shard_model expects an nnx\.Module"):
        sf.shard_model({"w": 1}, mesh, RULES)


def test_no_warning_when_everything_divides(mesh):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sf.plan_model(lambda: Transformer(nnx.Rngs(0)), mesh, RULES.extend(layers=None))


def test_logical_names_without_rules_are_not_replicated_quietly(mesh):
    with pytest.warns(ShardingWarning, match="rules=None means logical names are mesh axis names"):
        plan = sf.plan_model(_one((8, 4), ("embed", None)), mesh)
    assert sf.sharding_report(plan).row("w").spec == P(None, None)
    with pytest.raises(ValueError, match=r"rules=None .* \(strict=True\)"):
        sf.plan_model(_one((8, 4), ("embed", None)), mesh, strict=True)
    assert sf.sharding_report(sf.plan_model(_one((8, 4), ("model", None)), mesh)).row(
        "w"
    ).spec == P("model", None)  # a mesh axis name is honoured as given


class _Small(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 2, rngs=rngs)
        self.count = nnx.Param(np.ones((8,), np.int32))

    def __call__(self, x):
        return self.dense(x)


def _small(mesh, seed=0, with_count=False):
    def factory():
        model = _Small(nnx.Rngs(seed))
        if not with_count:
            del model.count
        return model

    model = sf.create_sharded_model(factory, mesh, MeshRules(data=("data", "model")))
    return model, sf.create_sharded_optimizer(model, optax.sgd(0.1))


def _mean_loss(model, batch):
    return jnp.mean(model(batch) ** 2)


X = np.ones((8, 4), np.float32)

STEP_CASES = {
    "aux asked, scalar given": (
        lambda m, o: sf.make_train_step(_mean_loss, has_aux=True)(m, o, X),
        TypeError,
        "has_aux=True, so loss_fn must return (loss, aux); it returned an array of shape ()",
    ),
    "aux given, not asked": (
        lambda m, o: sf.make_train_step(lambda m, b: (_mean_loss(m, b), {}))(m, o, X),
        TypeError,
        "loss_fn returned a tuple of 2; for (loss, aux) pass has_aux=True",
    ),
    "loss not a scalar": (
        lambda m, o: sf.make_train_step(lambda m, b: m(b))(m, o, X),
        TypeError,
        # found tracing the loss on the whole batch, before the step chooses its path
        "The loss must be a scalar; loss_fn returned an array of shape (8, 2) and dtype float32.",
    ),
    "loss a Python float": (
        lambda m, o: sf.make_train_step(lambda m, b: 0.5)(m, o, X),
        TypeError,
        "loss_fn returned a Python float (0.5): a constant, with no gradient. Return the loss "
        "as a jax scalar",
    ),
    "string batch": (
        lambda m, o: sf.make_train_step(_mean_loss)(m, o, "tokens"),
        TypeError,
        "The batch is a str ('tokens'), not an array",
    ),
    "list of rows": (
        lambda m, o: sf.make_train_step(_mean_loss)(m, o, [[1.0] * 4] * 8),
        TypeError,
        "Batch leaf [0][0] is a float (1.0), not an array",
    ),
    "leaves of different sizes": (
        lambda m, o: sf.make_train_step(lambda m, b: _mean_loss(m, b["x"]))(
            m, o, {"x": X, "y": np.ones(16, np.float32)}
        ),
        ValueError,
        "different leading sizes",
    ),
    "rows that do not split over the batch axes": (
        lambda m, o: sf.make_train_step(_mean_loss)(m, o, np.ones((12, 4), np.float32)),
        ValueError,
        # said before the region's shard_map names its own argument
        "The batch's 12 rows do not split evenly over the 8 devices of its batch axes "
        "('data', 'model'); pass a batch of a multiple of 8 rows.",
    ),
    "rows that do not split, with microbatches": (
        lambda m, o: sf.make_train_step(_mean_loss, microbatches=2)(
            m, o, np.ones((12, 4), np.float32)
        ),
        ValueError,
        "pass a batch of a multiple of 16 rows (microbatches=2 slices each device's rows).",
    ),
    "a device's rows that do not split into microbatches": (
        lambda m, o: sf.make_train_step(_mean_loss, microbatches=2)(m, o, X),
        ValueError,
        "microbatches=2 slices each device's rows, but the batch's 8 rows over 8 "
        "data-parallel replicas (('data', 'model')) give 1 per device",
    ),
    "no rows": (
        lambda m, o: sf.make_train_step(_mean_loss)(m, o, np.ones((0, 4), np.float32)),
        ValueError,
        "The batch has 0 rows",
    ),
}


@pytest.mark.parametrize("case", STEP_CASES)
def test_bad_step_input_raises_a_clear_error(mesh, case):
    call, exception, fragment = STEP_CASES[case]
    model, optimizer = _small(mesh)
    with pytest.raises(exception) as info:
        call(model, optimizer)
    assert fragment in str(info.value)


def test_a_state_donated_to_a_previous_step_is_named_with_the_fix(mesh):
    model, optimizer = _small(mesh)
    step = sf.make_train_step(_mean_loss)
    before = nnx.to_pure_dict(nnx.state(model))  # arrays taken out before the step...
    step(model, optimizer, X)  # ... which donates them
    state = nnx.state(model)
    nnx.replace_by_pure_dict(state, before)
    nnx.update(model, state)
    with pytest.raises(ValueError, match=r"The model's variable .* holds an array that a previous "
                       r"step donated \(jax deleted it\).* donate=False"):  # fmt: skip
        step(model, optimizer, X)


def test_an_optimizer_made_for_another_model_is_refused(mesh):
    model, _ = _small(mesh)
    _, other_optimizer = _small(mesh, seed=1)
    with pytest.raises(ValueError, match="an optimizer that create_sharded_optimizer made for"):
        sf.make_train_step(_mean_loss)(model, other_optimizer, X)


def test_an_integer_param_is_named(mesh):
    model, optimizer = _small(mesh, with_count=True)
    with pytest.raises(TypeError, match=r"not floating point: count \(int32\)"):
        sf.make_train_step(_mean_loss)(model, optimizer, X)


def test_bad_creation_input_raises_a_clear_error(mesh):
    with pytest.raises(TypeError, match=r"factory must return an nnx.Module, got dict"):
        sf.create_sharded_model(lambda: {"w": np.ones(3)}, mesh, RULES)
    with pytest.raises(TypeError, match=r"mesh must be a jax.sharding.Mesh, got dict"):
        sf.create_sharded_model(lambda: _Small(nnx.Rngs(0)), {"data": 8}, RULES)
    with pytest.raises(TypeError, match=r"loss_fn must be a function .* got NoneType None"):
        sf.make_train_step(None)
    model = sf.create_sharded_model(lambda: _Small(nnx.Rngs(0)), mesh, RULES)
    with pytest.raises(TypeError, match=r"tx must be an optax transformation such as optax"):
        sf.create_sharded_optimizer(model, "adam")


def test_a_built_model_passed_as_the_factory_says_what_to_pass(mesh):
    with nnx.use_eager_sharding(False):
        model = Transformer(nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"a built Transformer: pass lambda: Transformer\(...\)"):
        sf.create_sharded_model(model, mesh, layout="fsdp")


class _Dense(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.dense(x)


def test_a_loss_that_fails_is_told_how_the_step_calls_it(mesh):
    model = sf.create_sharded_model(lambda: _Dense(nnx.Rngs(0)), mesh, RULES)
    optimizer = sf.create_sharded_optimizer(model, optax.sgd(0.1))
    step = sf.make_train_step(lambda batch, model: model(batch).mean())  # arguments swapped
    with pytest.raises(Exception) as raised:
        step(model, optimizer, np.ones((8, 4), np.float32))
    assert any("calls loss_fn(model, batch), with model the _Dense and batch float32[8, 4]" in n
               for n in raised.value.__notes__)  # fmt: skip


def _loss_x_y(model, x, y):
    return ((model(x) - y) ** 2).mean()


def _pipeline_step(mesh, **changes):
    stages = dict(embed=_mean_loss, layer=_mean_loss, head=_mean_loss, stack="blocks")
    step = dict(mesh=mesh, microbatches=2)
    stages.update({k: v for k, v in changes.items() if k in stages})
    step.update({k: v for k, v in changes.items() if k not in stages})
    return sf.make_train_step(sf.Stages(**stages), **step)


# (call, exception, what the message says); each names the argument, what it got, what is valid
ENTRY_CASES = {
    "factory with arguments": (
        lambda mesh, model: sf.create_sharded_model(_Small, mesh, RULES),
        TypeError,
        "factory must be a function of no arguments that builds the model, but _Small(rngs) "
        "takes arguments: pass lambda: _Small(...) with them",
    ),
    "optimizer of a non-model": (
        lambda mesh, model: sf.create_sharded_optimizer({"w": 1}, optax.adam(1e-3)),
        TypeError,
        "create_sharded_optimizer expects an nnx.Module (create_sharded_model returns one), "
        "got dict.",
    ),
    "wrt not a filter": (  # Flax's own message for this is garbled (a bad format specifier)
        lambda mesh, model: sf.create_sharded_optimizer(model, optax.adam(1e-3), wrt=3),
        TypeError,
        "wrt must be an nnx filter: a Variable type (nnx.Param, nnx.LoRAParam, ...)",
    ),
    "wrt not a filter, step": (
        lambda mesh, model: sf.make_train_step(_mean_loss, wrt=3),
        TypeError,
        "wrt must be an nnx filter",
    ),
    "batch_axes not names": (
        lambda mesh, model: sf.make_train_step(_mean_loss, batch_axes=3),
        TypeError,
        "batch_axes must be a mesh axis name or a sequence of them, such as ('data',); got 3.",
    ),
    "an optax transformation as the optimizer": (
        lambda mesh, model: sf.make_train_step(_mean_loss)(model, optax.adam(1e-3), X),
        TypeError,
        "optimizer must be an nnx.Optimizer such as create_sharded_optimizer(model, "
        "optax.adamw(1e-3)) returns, got GradientTransformationExtraArgs.",
    ),
    "pipeline mesh as a dict": (
        lambda mesh, model: _pipeline_step({"pipe": 2}),
        TypeError,
        "mesh must be a jax.sharding.Mesh, got dict.",
    ),
    "pipeline stack not a name": (
        lambda mesh, model: _pipeline_step(mesh, stack=3),
        TypeError,
        "stack must name the model's attribute holding the layer stack",
    ),
    "pipeline layer not callable": (
        lambda mesh, model: _pipeline_step(mesh, layer="blocks"),
        TypeError,
        "layer must be a function, got str 'blocks'.",
    ),
    "a loss function of three arguments": (
        lambda mesh, model: sf.make_train_step(_loss_x_y),
        TypeError,
        "make_train_step calls loss_fn(model, batch) with the batch as one pytree; "
        "_loss_x_y(model, x, y) cannot be called so. Take the batch whole, e.g. lambda model, "
        "batch: _loss_x_y(model, batch['x'], batch['y']).",
    ),
    "an eval function of three arguments": (
        lambda mesh, model: sf.make_eval_step(_loss_x_y),
        TypeError,
        "make_eval_step calls fn(model, batch)",
    ),
    "a flat step's option with stages": (
        lambda mesh, model: _pipeline_step(mesh, data_parallel="xla"),
        TypeError,
        "make_train_step(Stages(...)) runs a pipeline; data_parallel are the flat step's "
        "options: leave them out.",
    ),
    "pipeline microbatches 0": (
        lambda mesh, model: _pipeline_step(mesh, microbatches=0),
        ValueError,
        "microbatches must be a positive integer, got 0.",
    ),
    "remat without a method": (
        lambda mesh, model: sf.remat("full"),
        TypeError,
        "remat decorates a block's method (@substrax_flax.remat above def __call__), got str",
    ),
    "checkpoint directory not a path": (
        lambda mesh, model: sf.Checkpointer(3),
        TypeError,
        "directory must be a path (a str or pathlib.Path) or a gs:// URL, got int 3.",
    ),
}


@pytest.mark.parametrize("case", ENTRY_CASES)
def test_bad_entry_point_arguments_name_the_argument_and_the_fix(mesh, case):
    call, exception, fragment = ENTRY_CASES[case]
    model, _ = _small(mesh)
    with pytest.raises(exception) as info:
        call(mesh, model)
    assert fragment in str(info.value)
