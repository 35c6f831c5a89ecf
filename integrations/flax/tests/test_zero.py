"""ZeRO-1 and ZeRO-2: the optimizer state (and gradients) sharded over the replicas.

Against plain data parallelism on the benchmark decoder: the same losses, the same traffic
(a reduce-scatter and an all-gather instead of an all-reduce), an eighth of the optimizer state.
"""

import warnings

import gpt
import jax
import numpy as np
import optax
import pytest
from flax import nnx
from flax_test_models import StackedTransformer, tokens
from test_pipeline_step import block, embed, head

import substrax_flax as sf
from substrax import ShardingWarning
from substrax.hlo import collectives, traffic_by_kind, while_bodies
from substrax.layout import Layout
from substrax.mesh import DeviceMeshManager

CONFIG = gpt.Config(vocab=256, d_model=64, heads=4, mlp=256, layers=2, seq=16)
BATCHES = [gpt.batch_at(i, 16, CONFIG.seq, 0) for i in range(3)]
MESH = {"data": 8}


def _create(layout, mesh_shape=MESH):
    mesh = DeviceMeshManager.create_device_mesh(mesh_shape)
    model = sf.create_sharded_model(lambda: gpt.GPT(CONFIG, nnx.Rngs(0)), mesh, layout=layout)
    return model, sf.create_sharded_optimizer(model, gpt.optimizer(3e-3))


def _run(layout, mesh_shape=MESH):
    model, optimizer = _create(layout, mesh_shape)
    step = sf.make_train_step(gpt.loss_fn)
    hlo = step.lower(model, optimizer, BATCHES[0]).compile().as_text()
    losses = [float(step(model, optimizer, b)["loss"]) for b in BATCHES]
    return traffic_by_kind(hlo, 8), losses, model, optimizer


@pytest.fixture(scope="module")
def dp():
    return _run("dp")


@pytest.mark.parametrize("layout", ["zero1", "zero2"])
def test_zero_moves_what_dp_moves_and_holds_an_eighth_of_the_optimizer(dp, layout):
    traffic, losses, model, optimizer = _run(layout)
    np.testing.assert_allclose(losses, dp[1], rtol=1e-5)
    total = sum(kind["bytes"] for kind in traffic.values())
    assert total <= 1.05 * sum(kind["bytes"] for kind in dp[0].values())
    assert traffic["reduce-scatter"]["bytes"] > 0 and traffic["all-gather"]["bytes"] > 0
    assert traffic["all-reduce"]["bytes"] < 1024  # only the loss and the finite flag
    state = sf.sharding_report(optimizer).bytes_per_device
    scalars = 8  # adam's count and the optimizer's step
    assert state - scalars == (sf.sharding_report(dp[3]).bytes_per_device - scalars) / 8
    assert sf.sharding_report(model).bytes_per_device == sf.sharding_report(dp[2]).bytes_per_device
    rows = {row.path: row for row in sf.sharding_report(optimizer).rows}
    (up,) = [row for path, row in rows.items() if path.endswith("mu/blocks/0/up")]
    assert up.spec == jax.sharding.PartitionSpec(None, "data")  # (64, 256): the larger dim


def _reductions_in_loops(layout, k):
    model, optimizer = _create(layout)
    step = sf.make_train_step(gpt.loss_fn, microbatches=k)
    hlo = step.lower(model, optimizer, gpt.batch_at(0, 64, CONFIG.seq, 0)).compile().as_text()
    bodies = while_bodies(hlo)
    return sum(
        op.kind == "reduce-scatter" for op in collectives(hlo, 8) if op.computation in bodies
    )


def test_zero2_reduces_each_microbatch_and_zero1_once():
    assert _reductions_in_loops("zero1", 4) == 0
    assert _reductions_in_loops("zero2", 4) > 0


def test_zero_with_tensor_parallelism_trains_like_tp():
    _, tp_losses, _, tp_optimizer = _run("tp", {"data": 2, "model": 4})
    _, losses, _, optimizer = _run("zero1+tp", {"data": 2, "model": 4})
    np.testing.assert_allclose(losses, tp_losses, rtol=1e-5)
    report, tp_report = sf.sharding_report(optimizer), sf.sharding_report(tp_optimizer)
    assert report.bytes_per_device < 0.6 * tp_report.bytes_per_device


def test_checkpoints_move_between_zero_and_other_layouts(tmp_path, dp):
    model, optimizer = _create("zero2")
    step = sf.make_train_step(gpt.loss_fn)
    step(model, optimizer, BATCHES[0])
    saved = [np.asarray(x) for x in jax.tree.leaves((nnx.state(model), nnx.state(optimizer)))]
    checkpointer = sf.Checkpointer(tmp_path)
    checkpointer.save(model, optimizer, 1)
    for layout in ("fsdp", "zero1"):  # onto another layout, and back onto ZeRO
        other, other_optimizer = _create(layout)
        planned = [x.sharding for x in jax.tree.leaves(nnx.state(other_optimizer))]
        checkpointer.restore(other, other_optimizer)
        leaves = jax.tree.leaves((nnx.state(other), nnx.state(other_optimizer)))
        for got, want in zip(leaves, saved, strict=True):
            np.testing.assert_array_equal(np.asarray(got), want)
        assert [x.sharding for x in jax.tree.leaves(nnx.state(other_optimizer))] == planned
    checkpointer.close()


class _Odd(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (3, 5)))

    def __call__(self, x):
        return x @ self.w[...]


def test_a_state_no_dimension_of_divides_is_reported():
    mesh = DeviceMeshManager.create_device_mesh(MESH)
    model = sf.create_sharded_model(lambda: _Odd(nnx.Rngs(0)), mesh, layout="zero1")
    with pytest.warns(ShardingWarning, match=r"2 optimizer state leaves are not sharded .*'data'"):
        optimizer = sf.create_sharded_optimizer(model, optax.adam(1e-3))
    row = sf.sharding_report(optimizer).rows[1]
    assert "no unsharded dimension of (3, 5) (spec P(None, None)) divides by the 8 replicas" in (
        str(row.reasons[-1])
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step = sf.make_train_step(lambda m, b: (m(b) ** 2).mean())
        step(model, optimizer, np.ones((8, 3), np.float32))
    (row,) = step.plan.params  # the step plan says why this gradient is all-reduced
    assert row.gradient.startswith("all-reduce over ('data',) (no unsharded dimension of (3, 5)")


def test_a_pipeline_with_zero_shards_the_optimizer_and_trains_alike():
    runs = {}
    for zero in (0, 1):  # 3 layers on 2 stages: stored padded to 4 slots
        layout = Layout.from_degrees(pp=2, dp=4, zero=zero)
        stages = sf.Stages(embed, block, head, stack="blocks", num_layers=3)
        step = sf.make_train_step(stages, layout.make_mesh(), layout=layout, microbatches=2)
        slots = step.num_slots(3)
        assert slots == 4
        model = sf.create_sharded_model(
            lambda slots=slots: StackedTransformer(nnx.Rngs(0), layers=slots), layout=layout
        )
        assert model.blocks.wq[...].sharding.spec[0] == "pipe"
        optimizer = sf.create_sharded_optimizer(model, optax.adamw(1e-2))
        text = step.lower(model, optimizer, tokens(seed=0)).compile().as_text()
        bodies = while_bodies(text)
        after = [op for op in collectives(text, 8) if op.computation not in bodies]
        losses = [float(step(model, optimizer, tokens(seed=i))["loss"]) for i in range(2)]
        runs[zero] = losses, sf.sharding_report(optimizer).bytes_per_device, after
    np.testing.assert_allclose(runs[1][0], runs[0][0], rtol=1e-5)
    assert runs[1][1] < 0.3 * runs[0][1]  # adam's moments over the 4 replicas
    # the loop reduce-scatters the layers' gradients to the optimizer's slices, and the new
    # slices are gathered: the volume of data parallelism's all-reduce. ZeRO adds at most the
    # gather of the updated shards of the parameters outside the stack (1.05x here)
    traffic = [sum(op.traffic_bytes for op in runs[z][2]) for z in (0, 1)]
    outside = sum(v.nbytes for k, v in nnx.to_flat_state(nnx.state(model)) if k[0] != "blocks")
    assert traffic[0] < traffic[1] <= traffic[0] + outside * 3 / 4
    assert sum(op.kind == "reduce-scatter" and op.group_size == 4 for op in runs[1][2]) >= 6
