"""Regression tests for the crashes users met on models written the way people write them."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

import substrax_flax as sf
from substrax.layout import Layout

LAYOUT = Layout.named("fsdp", {"data": 2, "model": 4})


class WithData(nnx.Module):
    """An embedding scale and position ids kept as nnx.data arrays (crashed ModelPlan)."""

    def __init__(self, rngs):
        self.scale = nnx.data(jnp.asarray(4.0))
        self.ids = nnx.data(jnp.arange(8))
        self.w = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (8, 16)))

    def __call__(self, x):
        return (x[:, self.ids] @ self.w[...]) * self.scale


class WithRngsMetadata(nnx.Module):
    """nnx.Param(x, rngs=rngs): metadata that differs per trace (crashed constrain_state)."""

    def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (8, 16)) * 0.1, rngs=rngs)

    def __call__(self, x):
        return x @ self.w[...]


class Stateful(nnx.Module):
    """Dropout, BatchNorm and a counter (the step raised flax's TraceContextError)."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(8, 16, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.calls = nnx.Variable(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        self.calls[...] += 1
        return self.bn(self.drop(self.lin(x)))


def _loss(model, x):
    return jnp.mean((model(x) - 1.0) ** 2)


def _x():
    return np.random.default_rng(0).normal(size=(8, 8)).astype(np.float32)


def _train(factory):
    model = sf.create_sharded_model(factory, layout=LAYOUT)
    optimizer = sf.create_sharded_optimizer(model, optax.sgd(0.1))
    step = sf.make_train_step(_loss)
    return model, [float(step(model, optimizer, _x())["loss"]) for _ in range(2)]


def test_nnx_data_arrays_are_created_sharded_and_moved():
    model, losses = _train(lambda: WithData(nnx.Rngs(0)))
    assert float(model.scale) == 4.0 and np.isfinite(losses).all()
    assert sf.sharding_report(model).row("ids").spec == P(None)
    with nnx.use_eager_sharding(False):
        live = WithData(nnx.Rngs(0))
    sf.shard_model(live, layout=LAYOUT)  # raised TypeError: unhashable type: ArrayImpl
    np.testing.assert_array_equal(live.ids, np.arange(8))


def test_params_with_rngs_in_their_metadata_train():
    _, losses = _train(lambda: WithRngsMetadata(nnx.Rngs(0)))
    assert losses[1] < losses[0]


def test_dropout_batch_statistics_and_counters_are_carried_through_the_step():
    model, losses = _train(lambda: Stateful(nnx.Rngs(0)))
    assert int(model.calls[...]) == 2 and np.isfinite(losses).all()
    assert int(model.drop.rngs.count[...]) == 2
    assert float(jnp.abs(model.bn.mean[...]).sum()) > 0  # batch statistics were updated


def test_a_model_with_nnx_data_arrays_loads_weights_with_a_dtype(tmp_path):
    """load_weights(dtype=...) read every leaf as a Variable (crashed on the nnx.data ones)."""
    import safetensors.numpy

    w = np.arange(128, dtype=np.float32).reshape(8, 16)
    safetensors.numpy.save_file({"w": w}, tmp_path / "model.safetensors")
    model = sf.load_weights(lambda: WithData(nnx.Rngs(0)), source=tmp_path, layout=LAYOUT,
                            dtype=jnp.bfloat16)  # fmt: skip
    assert model.w.dtype == jnp.bfloat16 and float(model.scale) == 4.0
    np.testing.assert_array_equal(np.asarray(model.w[...], np.float32), w)  # exact in bf16
    assert model.ids.dtype == jnp.int32  # nnx.data arrays keep their own dtype


def test_a_step_writes_into_the_models_own_variables_as_nnx_update_does():
    """The step writes its new state into the Variables ``nnx.split`` found (one pass, not
    ``nnx.update``'s walk of the graph): a Variable held from before holds the new value.
    A state with an ``nnx.data`` array goes through ``nnx.update``, with the same result."""
    for factory, counted in ((lambda: Stateful(nnx.Rngs(0)), True),
                             (lambda: WithData(nnx.Rngs(0)), False)):  # fmt: skip
        model = sf.create_sharded_model(factory, layout=LAYOUT)
        optimizer = sf.create_sharded_optimizer(model, optax.sgd(0.1))
        weight = model.lin.kernel if counted else model.w
        before, step = np.asarray(weight[...]), sf.make_train_step(_loss)
        for _ in range(2):
            step(model, optimizer, _x())
        assert (model.lin.kernel if counted else model.w) is weight
        assert not np.allclose(np.asarray(weight[...]), before)
        assert int(optimizer.step[...]) == 2
        if counted:
            assert int(model.calls[...]) == 2
