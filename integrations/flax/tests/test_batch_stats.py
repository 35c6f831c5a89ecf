"""Batch statistics on the manual data-parallel step: every ``nnx.BatchNorm`` reduces its
moments over the batch axes, so the step equals one device and moves what a model without
them moves (plus the statistics' all-reduces)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax_test_models import train, unsharded

import substrax_flax as sf
from substrax.hlo import traffic_by_kind
from substrax.layout import Layout

STEPS = 3


class NormedMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, norm: bool = True):
        self.up = nnx.Linear(16, 64, use_bias=not norm, rngs=rngs)
        self.norm = nnx.BatchNorm(64, rngs=rngs) if norm else None
        self.down = nnx.Linear(64, 4, rngs=rngs)

    def __call__(self, x):
        h = self.up(x)
        return self.down(jax_relu(self.norm(h) if self.norm is not None else h))


def jax_relu(x):
    return jnp.maximum(x, 0)


def _loss(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def _batch(seed, rows=16):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 16)).astype(np.float32)
    return {"x": x, "y": np.tanh(x[:, :4] * 2).astype(np.float32)}


def _tx():
    return optax.adamw(1e-2)


def _one_device(batches):
    model = unsharded(lambda: NormedMLP(nnx.Rngs(0)))
    optimizer = nnx.Optimizer(model, _tx(), wrt=nnx.Param)
    return train(model, optimizer, batches, _loss), model


@pytest.fixture(scope="module")
def trained():
    layout = dataclasses.replace(Layout.named("fsdp", {"data": 8}), fsdp_min_elements=8)
    model = sf.create_sharded_model(lambda: NormedMLP(nnx.Rngs(0)), layout=layout)
    optimizer = sf.create_sharded_optimizer(model, _tx())
    step = sf.make_train_step(_loss)
    batches = [_batch(i) for i in range(STEPS)]
    mode = step.data_parallel_for(model, optimizer, batches[0])
    hlo = {
        "manual": step.lower(model, optimizer, batches[0]).compile().as_text(),
        "xla": sf.make_train_step(_loss, data_parallel="xla")
        .lower(model, optimizer, batches[0])
        .compile()
        .as_text(),
    }
    losses = [float(step(model, optimizer, b)["loss"]) for b in batches]
    return mode, hlo, losses, model, batches


def test_batch_norm_stays_on_the_manual_step_and_equals_one_device(trained):
    mode, _, losses, model, batches = trained
    assert mode == "manual"
    reference, plain = _one_device(batches)
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    for name in ("mean", "var"):  # running statistics: the whole batch's
        got = getattr(model.norm, name)[...]
        np.testing.assert_allclose(got, getattr(plain.norm, name)[...], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(model.up.kernel[...], plain.up.kernel[...], rtol=1e-4, atol=1e-6)


def test_batch_norm_adds_only_its_statistics_to_the_traffic(trained):
    hlo = trained[1]
    manual, xla = (traffic_by_kind(hlo[mode], 8) for mode in ("manual", "xla"))
    assert manual["reduce-scatter"]["count"] >= 1  # gradients reduce-scattered
    # the moments (64 means and 64 mean squares, forward and transposed, each all-reduce
    # moving under twice its bytes) and the loss are all that is all-reduced; XLA's step
    # all-reduces every gradient
    assert manual["all-reduce"]["bytes"] <= 2 * (2 * 64 * 4) * 2 + 64
    assert xla["all-reduce"]["bytes"] > 2 * manual["all-reduce"]["bytes"]
