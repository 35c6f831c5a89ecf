"""Experts composed: inside an ``nnx.scan`` stack and inside pipeline stages."""

import gpt
import jax
import numpy as np
import optax
import pytest
from flax import nnx

import substrax_flax as sf
from substrax import ShardingWarning
from substrax.layout import Layout

CONFIG = gpt.Config(vocab=64, d_model=32, heads=2, mlp=32, layers=4, seq=16, moe_experts=8)
BATCHES = [gpt.batch_at(i, 8, CONFIG.seq) % CONFIG.vocab for i in range(3)]


def _stacked():
    return gpt.StackedGPT(CONFIG, nnx.Rngs(0))


def task_loss(model, batch):  # what a pipeline's head computes: no load-balancing loss
    logits = model(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def _flat(layout, loss_fn, **step_args):
    model = sf.create_sharded_model(_stacked, layout=layout)
    optimizer = sf.create_sharded_optimizer(model, optax.sgd(0.5))
    step = sf.make_train_step(loss_fn, **step_args)
    metrics = [step(model, optimizer, batch) for batch in BATCHES]
    losses = [float(m["loss"]) for m in metrics]
    return losses, nnx.state(model, nnx.Param), step, model, optimizer


@pytest.fixture(scope="module")
def one_device():
    layout = Layout.named("dp", {"data": 1})
    return {name: _flat(layout, fn)[:2] for name, fn in (("aux", gpt.loss_fn),
                                                          ("task", task_loss))}  # fmt: skip


def test_experts_in_a_scan_stack_over_fsdp_ep_equal_one_device(one_device):
    """The stack's summed load-balancing loss included; XLA's step, named with its reason."""
    layout = Layout.named("fsdp+ep", {"data": 2, "expert": 4})
    with pytest.warns(ShardingWarning, match=r"stacked experts \(blocks/moe/w_in\)"):
        losses, params, step, model, optimizer = _flat(layout, gpt.loss_fn)
    want_losses, want_params = one_device["aux"]
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(want_params), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert model.blocks.moe.w_in[...].sharding.spec[:2] == (None, "expert")  # [layers, experts]
    plan = step.plan_for(model, optimizer, BATCHES[0])
    assert plan.path == "xla" and "stacked experts (blocks/moe/w_in)" in plan.reason


def test_experts_in_pp_x_fsdp_pipeline_stages_equal_the_flat_step(one_device):
    layout = Layout.from_degrees(pp=2, fsdp=4)
    mesh = layout.make_mesh()
    model = sf.create_sharded_model(_stacked, mesh, layout=layout)
    optimizer = sf.create_sharded_optimizer(model, optax.sgd(0.5))
    assert model.blocks.moe.w_in[...].sharding.spec[0] == "pipe"
    stages = sf.Stages(gpt.pipeline_embed, gpt.pipeline_block, gpt.pipeline_head, stack="blocks")
    step = sf.make_train_step(stages, mesh, microbatches=2)
    losses = [float(step(model, optimizer, batch)["loss"]) for batch in BATCHES]
    np.testing.assert_allclose(losses, one_device["task"][0], rtol=1e-5)
    want = one_device["task"][1]
    for got, ref in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(want),
                        strict=True):  # fmt: skip
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-6)
