"""The manual data-parallel step (the default where it keeps the numbers): gathers and
reduce-scatters by construction, losses as one device."""

import math
import warnings

import gpt
import jax
import jax.numpy as jnp
import jax_setup
import numpy as np
import optax
import pytest
from flax import nnx
from flax_test_models import unsharded

import substrax_flax as sf
from substrax import ShardingWarning
from substrax.hlo import traffic_by_kind
from substrax.layout import Layout
from substrax.mesh import DeviceMeshManager

CONFIG = gpt.Config(vocab=256, d_model=64, heads=4, mlp=256, layers=2, seq=16)
#: All-reduced bytes beyond the gradients: the loss and the non-finite guard's flags.
FLAGS = 512
BATCHES = [gpt.batch_at(i, 16, CONFIG.seq, 0) for i in range(3)]


def _factory():
    return gpt.GPT(CONFIG, nnx.Rngs(0))


def _split_bytes(model, batch_axes):
    """Bytes of the parameters stored sharded over a batch axis, and of the others."""
    sharded = replicated = 0
    for row in sf.sharding_report(model).rows:
        axes = {a for entry in row.spec if entry for a in np.atleast_1d(entry)}
        size = math.prod(row.shape) * 4
        if axes & set(batch_axes):
            sharded += size
        else:
            replicated += size
    return sharded, replicated


def _run(name, shape, data_parallel):
    mesh = DeviceMeshManager.create_device_mesh(shape)
    layout = Layout.named(name, mesh)
    model = sf.create_sharded_model(_factory, mesh, layout=layout)
    optimizer = sf.create_sharded_optimizer(model, gpt.optimizer(3e-3))
    step = sf.make_train_step(gpt.loss_fn, data_parallel=data_parallel)
    hlo = step.lower(model, optimizer, BATCHES[0]).compile().as_text()
    traffic = {k: v["bytes"] for k, v in traffic_by_kind(hlo, 8).items()}
    losses = [float(step(model, optimizer, b)["loss"]) for b in BATCHES]
    assert step.data_parallel_for(model, optimizer, BATCHES[0]) == (
        "xla" if data_parallel == "xla" else "manual"
    )
    return traffic, losses, _split_bytes(model, layout.batch_axes), layout


def _one_device_losses(factory, batches):
    """The losses of plain ``nnx.jit`` steps of the model on one device."""
    model = unsharded(factory)
    optimizer = nnx.Optimizer(model, gpt.optimizer(3e-3), wrt=nnx.Param)
    step = nnx.jit(lambda m, o, b: _update(m, o, b))
    return [float(step(model, optimizer, b)) for b in batches]


@pytest.fixture(scope="module")
def one_device():
    return _one_device_losses(_factory, BATCHES)


def _update(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(gpt.loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss


def test_fsdp_gradients_are_reduce_scattered_and_losses_match_one_device(one_device):
    traffic, losses, (sharded, replicated), _ = _run("fsdp", {"data": 8}, "auto")
    np.testing.assert_allclose(losses, one_device, rtol=2e-5)
    ring = 7 / 8
    assert traffic["reduce-scatter"] == pytest.approx(sharded * ring, rel=1e-3)
    assert traffic["all-gather"] == pytest.approx(sharded * ring, rel=1e-3)
    # left to all-reduce: replicated parameters (none here), the loss, and the non-finite
    # guard's flags for the gradients and the state the update would write (406 bytes here)
    assert traffic["all-reduce"] <= 2 * replicated * ring + FLAGS
    xla, xla_losses, _, _ = _run("fsdp", {"data": 8}, "xla")
    assert sum(traffic.values()) < 0.7 * sum(xla.values())  # XLA all-reduces instead
    np.testing.assert_allclose(losses, xla_losses, rtol=1e-5)


def test_fsdp_with_tensor_parallelism_keeps_the_tensor_axis_through_the_gather(one_device):
    traffic, losses, _, _ = _run("fsdp+tp", {"data": 2, "model": 4}, "manual")
    np.testing.assert_allclose(losses, one_device, rtol=2e-5)
    xla, _, _, _ = _run("fsdp+tp", {"data": 2, "model": 4}, "xla")
    assert traffic["reduce-scatter"] > 0 and xla["reduce-scatter"] == 0
    # gathers of the tensor-sharded blocks only (XLA would replicate over "model" first)
    assert traffic["all-gather"] == pytest.approx(xla["all-gather"], rel=1e-3)
    assert sum(traffic.values()) < sum(xla.values())


def test_hsdp_reduce_scatters_over_fsdp_and_all_reduces_the_shard(one_device):
    traffic, losses, (sharded, replicated), layout = _run("hsdp", {"data": 2, "fsdp": 4}, "manual")
    np.testing.assert_allclose(losses, one_device, rtol=2e-5)
    assert layout.batch_axes == ("data", "fsdp")
    assert traffic["reduce-scatter"] == pytest.approx(sharded * 3 / 4, rel=1e-3)
    shard_all_reduce = 2 * (sharded / 4) * 1 / 2
    assert traffic["all-reduce"] <= shard_all_reduce + 2 * replicated * 7 / 8 + FLAGS


class _Normed(nnx.Module):
    """Its own batch statistic, not an nnx.BatchNorm (whose moments the step would reduce)."""

    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 4, rngs=rngs)
        self.centre = nnx.BatchStat(jnp.zeros(4))

    def __call__(self, x):
        h = self.dense(x)
        self.centre[...] = 0.9 * self.centre[...] + 0.1 * h.mean(0)
        return h - self.centre[...]


class _Dropped(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 4, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.dropout(self.dense(x))


class _Noised(nnx.Module):
    """Noise from a key the module holds as a constant, not an nnx.Rngs stream."""

    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return self.dense(x) + jax.random.normal(jax.random.key(0), x.shape)


def test_dropout_from_an_rngs_stream_stays_on_the_manual_step():
    mesh = DeviceMeshManager.create_device_mesh({"data": 8})
    model = sf.create_sharded_model(lambda: _Dropped(nnx.Rngs(0)), mesh, layout="dp")
    optimizer = sf.create_sharded_optimizer(model, gpt.optimizer(1e-3))
    step = sf.make_train_step(lambda m, b: (m(b) ** 2).mean())
    assert step.data_parallel_for(model, optimizer, np.ones((8, 4), np.float32)) == "manual"


@pytest.mark.parametrize(
    ("module", "obstacle"),
    [(_Normed, r"batch statistics \(centre, an nnx.BatchStat\) outside an nnx.BatchNorm"),
     (_Noised, r"draws random numbers from a key that is not an nnx.Rngs stream \(random_bits")],
)  # fmt: skip
def test_rows_coupled_across_devices_keep_xla_partitioning(module, obstacle):
    mesh = DeviceMeshManager.create_device_mesh({"data": 8})
    model = sf.create_sharded_model(lambda: module(nnx.Rngs(0)), mesh, layout="dp")
    optimizer = sf.create_sharded_optimizer(model, gpt.optimizer(1e-3))
    batch = np.ones((8, 4), np.float32)
    step = sf.make_train_step(lambda m, b: (m(b) ** 2).mean(), data_parallel="manual")
    with pytest.raises(ValueError, match=obstacle + ".*Use data_parallel='xla'"):
        step(model, optimizer, batch)
    auto = sf.make_train_step(lambda m, b: (m(b) ** 2).mean())
    with warnings.catch_warnings():  # under dp both steps all-reduce: nothing lost, unsaid
        warnings.simplefilter("error", ShardingWarning)
        assert auto.data_parallel_for(model, optimizer, batch) == "xla"
    with pytest.raises(ValueError, match=r"must be one of \('auto', 'manual', 'xla'\), got 'hand'"):
        sf.make_train_step(gpt.loss_fn, data_parallel="hand")
    assert jax.device_count() == 8


def _accumulated(k, shape=None, layout="fsdp"):
    shape = shape or {"data": 8}
    mesh = DeviceMeshManager.create_device_mesh(shape, jax.devices()[: math.prod(shape.values())])
    model = sf.create_sharded_model(_factory, mesh, layout=Layout.named(layout, mesh))
    optimizer = sf.create_sharded_optimizer(model, gpt.optimizer(3e-3))
    step = sf.make_train_step(gpt.loss_fn, microbatches=k)
    batches = [gpt.batch_at(i, 64, CONFIG.seq, 0) for i in range(2)]
    compiled = step.lower(model, optimizer, batches[0]).compile()
    counts = {k: v["count"] for k, v in traffic_by_kind(compiled.as_text(), 8).items()}
    losses = [float(step(model, optimizer, b)["loss"]) for b in batches]
    return counts, compiled.memory_analysis().temp_size_in_bytes, losses


def test_accumulation_reduces_once_per_step_and_holds_one_slice():
    counts_1, temp_1, losses_1 = _accumulated(1)
    counts_4, temp_4, losses_4 = _accumulated(4)
    assert counts_4 == counts_1 and counts_1["reduce-scatter"] > 0  # not 4x the reductions
    np.testing.assert_allclose(losses_4, losses_1, rtol=1e-5)
    assert temp_4 < temp_1
    # one replica (a data axis of size 1): still slice by slice, without a manual region
    _, one_temp_1, one_losses_1 = _accumulated(1, {"data": 1, "model": 4}, "tp")
    _, one_temp_4, one_losses_4 = _accumulated(4, {"data": 1, "model": 4}, "tp")
    np.testing.assert_allclose(one_losses_4, one_losses_1, rtol=1e-5)
    assert one_temp_4 < one_temp_1
    with pytest.raises(ValueError, match="microbatches=2 runs in the manual data-parallel step"):
        sf.make_train_step(gpt.loss_fn, data_parallel="xla", microbatches=2)
    with pytest.raises(ValueError, match="microbatches must be a positive integer, got 0"):
        sf.make_train_step(gpt.loss_fn, data_parallel="manual", microbatches=0)


class _Seen(nnx.Variable):
    """A counter that is not a batch statistic: the loss adds the batch's sum to it."""


class _Counting(nnx.Module):
    def __init__(self, rngs):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", None))
        self.dense = nnx.Linear(8, 4, kernel_init=init, rngs=rngs)
        self.seen = _Seen(jnp.zeros(()))

    def __call__(self, x):
        self.seen[...] = self.seen[...] + x.sum()
        return self.dense(x)


def test_state_the_loss_computes_from_the_batch_takes_the_exact_path_with_its_reason():
    """Each device would count its own rows in the manual region (and shard_map would refuse
    the differing values); the step says so and runs XLA's partitioning, which counts all."""

    def loss(model, x):
        return (model(x) ** 2).mean()

    model = sf.create_sharded_model(lambda: _Counting(nnx.Rngs(0)),
                                    layout=Layout.named("fsdp", {"data": 8}))  # fmt: skip
    optimizer = sf.create_sharded_optimizer(model, optax.adam(1e-3))
    x = np.ones((16, 8), np.float32)
    with pytest.raises(ValueError, match=r"the loss updates model state from the batch \(seen "
                       r"\(_Seen\)\).*Use data_parallel='xla'"):  # fmt: skip
        sf.make_train_step(loss, data_parallel="manual")(model, optimizer, x)
    with pytest.warns(ShardingWarning, match=r"updates model state from the batch.*nnx.BatchStat"):
        metrics = sf.make_train_step(loss)(model, optimizer, x)
    assert metrics["path"] == "xla" and float(model.seen[...]) == x.sum()  # as one device


def test_the_plan_prints_repeated_layers_on_one_line_and_every_one_in_full():
    mesh = DeviceMeshManager.create_device_mesh({"data": 8})
    model = sf.create_sharded_model(_factory, mesh, layout="fsdp")
    optimizer = sf.create_sharded_optimizer(model, gpt.optimizer(3e-3))
    plan = sf.make_train_step(gpt.loss_fn).plan_for(model, optimizer, BATCHES[0])
    lines = str(plan).splitlines()
    up = [line for line in lines if line.strip().startswith("blocks/0-1/up:")]
    assert len(up) == 1 and "reduce-scatter over ('data',)" in up[0]
    assert not any(line.strip().startswith("blocks/1/") for line in lines)
    full = plan.text(full=True).splitlines()
    grouped = sum(" blocks/0-1/" in line for line in lines)  # 8 parameters per block
    assert grouped == 8 and len(full) == len(lines) + grouped  # 2 blocks: 16 lines, not 8
    assert any(line.strip().startswith("blocks/1/up:") for line in full)


STACK = gpt.Config(vocab=256, d_model=128, heads=4, mlp=512, layers=8, seq=8)
STACK_BATCHES = [gpt.batch_at(i, 16, STACK.seq, 0) for i in range(2)]


def _stacked():
    return gpt.StackedGPT(STACK, nnx.Rngs(0))


@pytest.fixture(scope="module")
def stacked_one_device():
    return _one_device_losses(_stacked, STACK_BATCHES)


@pytest.mark.parametrize(
    "gather, remat, k",
    [("keep", "none", 1), ("regather", "none", 1), ("keep", "full", 1), ("regather", "none", 2)],
)
def test_a_stack_is_gathered_layer_by_layer_inside_its_scan(stacked_one_device, gather, remat, k):
    """Each layer of an ``nnx.scan`` stack is gathered inside the loop and its gradient
    reduce-scattered there: the step never holds the whole gathered stack and its whole
    gradient (gathering every parameter before the forward pass held both: 2.6x the stack's
    bytes in temporaries at this size). Under ``"regather"`` no gathered layer is kept for the
    backward pass, which gathers each again; so does a layer under remat, which gathers its
    parameters inside its ``jax.checkpoint`` region. With ``k`` microbatches under
    ``"regather"`` each slice does so: ``k`` times the collectives, one layer's memory."""
    mesh = DeviceMeshManager.create_device_mesh({"data": 8})
    model = sf.create_sharded_model(_stacked, mesh, layout="fsdp")
    optimizer = sf.create_sharded_optimizer(model, gpt.optimizer(3e-3))
    step = sf.make_train_step(gpt.loss_fn, gather=gather, remat=remat, microbatches=k)
    with jax_setup.source_locations():
        lowered = step.lower(model, optimizer, STACK_BATCHES[0])
    compiled = lowered.compile()
    losses = [float(step(model, optimizer, b)["loss"]) for b in STACK_BATCHES]
    np.testing.assert_allclose(losses, stacked_one_device, rtol=2e-5)
    # run equation by equation, the program still names the model's own source lines
    assert 'examples/gpt.py":' in lowered.as_text(debug_info=True)
    sharded, _ = _split_bytes(model, ("data",))
    stack = sum(4 * math.prod(r.shape) for r in sf.sharding_report(model).rows
                if r.path.startswith("blocks"))  # fmt: skip
    ring, temps = 7 / 8, compiled.memory_analysis().temp_size_in_bytes
    traffic = {k: v["bytes"] for k, v in traffic_by_kind(compiled.as_text(), 8, trips=True).items()}
    assert traffic["reduce-scatter"] == pytest.approx(k * sharded * ring, rel=1e-3)
    if gather == "keep" and remat == "none":  # the forward's layers kept: one stack at most
        assert traffic["all-gather"] == pytest.approx(sharded * ring, rel=1e-3)
        assert temps < 1.75 * stack
    else:  # gathered again in the backward loop: nothing close to a whole stack held
        assert 1.9 * k * sharded * ring < traffic["all-gather"] <= 2 * k * sharded * ring
        assert temps < 0.75 * stack


def test_regather_on_xlas_step_says_it_is_not_done():
    """XLA's step keeps its gathered parameters whatever ``gather`` says (a policy refusing
    their name saves the unnamed layout they come from: the same temporaries under both
    settings); asking for ``"regather"`` there warns and the plan says so, rather than
    dropping the request silently."""
    mesh = DeviceMeshManager.create_device_mesh({"data": 8})
    model = sf.create_sharded_model(_stacked, mesh, layout="fsdp")
    optimizer = sf.create_sharded_optimizer(model, gpt.optimizer(3e-3))
    step = sf.make_train_step(gpt.loss_fn, gather="regather", data_parallel="xla")
    with pytest.warns(ShardingWarning, match="gather='regather'. is not done on XLA's step"):
        lowered = step.lower(model, optimizer, STACK_BATCHES[0])
    assert "gather        regather: not done: XLA's step keeps" in str(step.plan)
    kept = sf.make_train_step(gpt.loss_fn, data_parallel="xla").lower(
        model, optimizer, STACK_BATCHES[0]
    )  # the same program as under "keep": docs/step.md's figure
    temps = [x.compile().memory_analysis().temp_size_in_bytes for x in (lowered, kept)]
    assert temps[0] == temps[1]
    manual = sf.make_train_step(gpt.loss_fn, gather="regather")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShardingWarning)  # the manual step does it: no warning
        manual.lower(model, optimizer, STACK_BATCHES[0])
