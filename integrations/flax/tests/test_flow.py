"""One plan flows: made once, with its options, taken by the optimizer, the step and the report."""

import inspect
import warnings

import numpy as np
import optax
import pytest
from flax import nnx
from flax_test_models import Transformer, token_loss, tokens, unsharded
from jax.sharding import PartitionSpec as P

import substrax_flax as sf
from substrax import ShardingWarning
from substrax.layout import Layout
from substrax.mesh import DeviceMeshManager, MeshRules, fsdp_rules

# 'vocab' is unknown to these rules; 'heads' (4) does not divide data x model (8).
RULES = fsdp_rules().extend(kv=None, layers=None, heads=("data", "model"))


def _line_of(marker):
    source, start = inspect.getsourcelines(test_warnings_appear_once_each_at_the_users_line)
    return start + next(i for i, line in enumerate(source) if marker in line)


def test_warnings_appear_once_each_at_the_users_line():
    mesh = DeviceMeshManager.create_device_mesh({"data": 2, "model": 4})
    factory = lambda: Transformer(nnx.Rngs(0))  # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = sf.create_sharded_model(factory, mesh, RULES, unknown_names="replicate")  # here
        optimizer = sf.create_sharded_optimizer(model, optax.adamw(1e-3))
        step = sf.make_train_step(token_loss)
        metrics = step(model, optimizer, tokens())
        sf.sharding_report(model)
    sharding = [w for w in caught if issubclass(w.category, ShardingWarning)]
    paths = [str(w.message).split("'")[1] for w in sharding]
    assert sorted(paths) == sorted(set(paths)), "a variable was warned about twice"
    assert {"embed/embedding", "head"} <= set(paths)  # unknown 'vocab'
    assert "blocks/0/wo" in paths  # heads (4) indivisible by data x model (8)
    assert {(w.filename, w.lineno) for w in sharding} == {(__file__, _line_of("# here"))}
    message = next(str(w.message) for w in sharding if "'head'" in str(w.message))
    assert "logical name 'vocab' is not in the rules" in message and "laid out as" in message
    assert np.isfinite(float(metrics["loss"]))


def test_options_given_at_creation_hold_for_the_optimizer_and_the_step():
    mesh = DeviceMeshManager.create_device_mesh({"data": 2, "model": 4})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardingWarning)
        model = sf.create_sharded_model(
            lambda: Transformer(nnx.Rngs(0)), mesh, RULES, unknown_names="replicate"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing re-resolved, nothing warned again
        optimizer = sf.create_sharded_optimizer(model, optax.adamw(1e-3))
        before = float(sf.make_train_step(token_loss)(model, optimizer, tokens())["loss"])
    assert optimizer.opt_state[0].mu["head"][...].sharding.spec == model.head[...].sharding.spec
    assert int(optimizer.step[...]) == 1 and np.isfinite(before)


def test_arguments_that_contradict_the_models_plan_are_refused():
    mesh = DeviceMeshManager.create_device_mesh({"data": 2, "model": 4})
    rules = fsdp_rules().extend(vocab="model", kv=None, layers=None)
    model = sf.create_sharded_model(lambda: Transformer(nnx.Rngs(0)), mesh, rules)
    other = MeshRules(data="data").extend(vocab=None, kv=None, layers=None)
    with pytest.raises(ValueError, match="the model was created by substrax with another plan"):
        sf.create_sharded_optimizer(model, optax.adamw(1e-3), mesh, other)
    assert sf.create_sharded_optimizer(model, optax.adamw(1e-3), mesh, rules) is not None


@pytest.mark.parametrize("name", ["hsdp"])  # fsdp and fsdp+tp: every gallery model, test_gallery
def test_a_named_layout_trains_like_one_device_with_nothing_else_given(name):
    layout = Layout.named(name, {"data": 2, "model": 4})
    factory = lambda: Transformer(nnx.Rngs(0))  # noqa: E731
    model = sf.create_sharded_model(factory, layout=layout)
    optimizer = sf.create_sharded_optimizer(model, optax.adamw(1e-2))
    step = sf.make_train_step(token_loss)
    reference = unsharded(factory)
    ref_opt = nnx.Optimizer(reference, optax.adamw(1e-2), wrt=nnx.Param)

    @nnx.jit
    def ref_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(token_loss)(model, batch)
        optimizer.update(model, grads)
        return loss

    for seed in range(3):
        loss = float(step(model, optimizer, tokens(seed=seed))["loss"])
        expected = float(ref_step(reference, ref_opt, tokens(seed=seed)))
        assert abs(loss - expected) <= 1e-5 * abs(expected)
    assert model.blocks[0].wq[...].sharding.spec[0] is not None  # embed stays sharded at rest


def test_the_default_step_gathers_each_fsdp_parameter_once():
    from substrax.hlo import collectives

    model = sf.create_sharded_model(lambda: Transformer(nnx.Rngs(0)), layout=Layout.named(
        "fsdp", {"data": 8}))  # fmt: skip
    optimizer = sf.create_sharded_optimizer(model, optax.adamw(1e-3))
    hlo = sf.make_train_step(token_loss).lower(model, optimizer, tokens()).compile().as_text()
    sharded = [row for row in sf.sharding_report(model).rows if any(row.spec)]
    gathers = [c for c in collectives(hlo) if c.kind == "all-gather"]
    assert len(gathers) == len(sharded)
    assert sf.sharding_report(model).row("head").spec == P("data", None)


def test_a_strategy_planned_model_is_gathered_once_too():
    """No annotations: the layout's strategy shards, and the default step still gathers once."""
    import dataclasses

    from flax_test_models import Plain, features, regression_loss

    from substrax.hlo import collectives

    layout = dataclasses.replace(Layout.named("fsdp", {"data": 8}), fsdp_min_elements=8)
    model = sf.create_sharded_model(lambda: Plain(nnx.Rngs(0)), layout=layout)
    optimizer = sf.create_sharded_optimizer(model, optax.adamw(1e-3))
    step = sf.make_train_step(regression_loss)
    hlo = step.lower(model, optimizer, features()).compile().as_text()
    sharded = [row for row in sf.sharding_report(model).rows if any(row.spec)]
    assert len(sharded) >= 4 and all(row.rule.startswith("fsdp over ") for row in sharded)
    gathers = [c for c in collectives(hlo) if c.kind == "all-gather"]
    assert len(gathers) == len(sharded)
