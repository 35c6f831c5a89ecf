"""make_train_step: matches one device, keeps shardings, realises FSDP's gather pattern."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from flax_test_models import (
    Transformer,
    assert_laid_out_as,
    relative_error,
    token_loss,
    tokens,
    train,
    unsharded,
)

import substrax_flax as sf
from substrax.hlo import traffic_by_kind
from substrax.mesh import DeviceMeshManager, MeshRules

ALL = ("data", "model")
DEFAULTS = dict(vocab=None, kv=None, layers=None)
FSDP = MeshRules(data=ALL, embed=ALL).extend(**DEFAULTS)
FSDP_COMPUTE = MeshRules(data=ALL).extend(**DEFAULTS)
FACTORY = lambda: Transformer(nnx.Rngs(0))  # noqa: E731
BATCHES = [tokens(seed=i) for i in range(3)]


@pytest.fixture(scope="module")
def mesh():
    return DeviceMeshManager.create_device_mesh({"data": 2, "model": 4})


@pytest.fixture(scope="module")
def reference():
    model = unsharded(FACTORY)
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    return train(model, optimizer, BATCHES, token_loss), nnx.state(model, nnx.Param)


def _run(mesh, rules, **kwargs):
    model = sf.create_sharded_model(FACTORY, mesh, rules)
    optimizer = sf.create_sharded_optimizer(model, optax.adamw(1e-2), mesh, rules)
    planned = (
        sf.get_shardings(model, mesh, rules),
        [a.sharding for a in jax.tree.leaves(nnx.state(optimizer))],
    )
    step = sf.make_train_step(token_loss, mesh, rules, **kwargs)
    losses = [float(step(model, optimizer, batch)["loss"]) for batch in BATCHES]
    assert_laid_out_as(nnx.state(model), planned[0])
    assert_laid_out_as(nnx.state(optimizer), planned[1])
    assert int(optimizer.step[...]) == len(BATCHES)  # the update was not dropped
    return losses, model, optimizer, step


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"compute_rules": FSDP_COMPUTE}, {"compute_rules": FSDP_COMPUTE, "gather": "regather"}],
    ids=["plain", "gather", "regather"],
)
def test_step_matches_one_device_and_keeps_shardings(mesh, reference, kwargs):
    (ref_losses, ref_params) = reference
    losses, model, _, _ = _run(mesh, FSDP, **kwargs)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for expected, actual in zip(
        jax.tree.leaves(ref_params), jax.tree.leaves(nnx.state(model, nnx.Param)), strict=True
    ):
        assert relative_error(actual, expected) < 1e-5


def test_gathering_parameters_gives_one_gather_and_one_reduce_scatter(mesh):
    _, model, optimizer, step = _run(mesh, FSDP, compute_rules=FSDP_COMPUTE)
    hlo = step.lower(model, optimizer, BATCHES[0]).compile().as_text()
    traffic = traffic_by_kind(hlo)
    rows = sf.sharding_report(model).rows
    param_bytes = sum(row.bytes_total for row in rows)
    sharded_bytes = sum(row.bytes_total for row in rows if row.bytes_per_device < row.bytes_total)
    assert 0 < sharded_bytes < param_bytes  # the mlp biases stay replicated under these rules
    # Every sharded parameter gathered once (ring volume 7/8 of the full bytes) ...
    assert traffic["all-gather"]["bytes"] == pytest.approx(sharded_bytes * 7 / 8)
    # ... and each of their gradients reduce-scattered once, straight into its shard; the
    # replicated biases' gradients and a few scalars (loss, finite flag) are all-reduced.
    assert traffic["reduce-scatter"]["bytes"] == pytest.approx(sharded_bytes * 7 / 8)
    assert traffic["all-reduce"]["bytes"] <= 2 * 7 / 8 * (param_bytes - sharded_bytes) + 256
    assert traffic["all-to-all"]["count"] == 0


def test_aux_metrics_and_lowering(mesh):
    def loss_with_aux(model, batch):
        loss = token_loss(model, batch)
        return loss, {"double": 2 * loss}

    model = sf.create_sharded_model(FACTORY, mesh, FSDP)
    optimizer = sf.create_sharded_optimizer(model, optax.sgd(0.1), mesh, FSDP)
    step = sf.make_train_step(loss_with_aux, mesh, FSDP, has_aux=True, donate=False)
    metrics = step(model, optimizer, BATCHES[0])
    assert float(metrics["double"]) == pytest.approx(2 * float(metrics["loss"]))
    assert step.lower(model, optimizer, BATCHES[0]).compile().memory_analysis() is not None


def test_bad_arguments(mesh):
    with pytest.raises(ValueError, match="gather must be 'keep' or 'regather', got 'lazy'"):
        sf.make_train_step(token_loss, mesh, FSDP, gather="lazy")
    with pytest.raises(ValueError, match="needs the batch's mesh axes"):
        sf.make_train_step(token_loss, mesh, MeshRules(embed="model"))
