"""Models as others publish them: axes that do not divide, specs in array types, own expert
code, own mesh-axis specs, keys and scalars in the batch, and configs the step cannot hash."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax_test_models import train, unsharded
from gallery import PUBLISHED, ExplicitGuide, MLPConfig, OwnSpecs
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

import substrax_flax as sf
from substrax import ShardingWarning
from substrax.layout import Layout
from substrax.mesh import DeviceMeshManager

LECUN = nnx.initializers.lecun_normal()
MESH = {"data": 2, "model": 4}


def _loss(model, batch):
    logits = model(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def _tokens(seed, vocab, rows=8):
    return np.random.default_rng(seed).integers(0, vocab, (rows, 9)).astype(np.int32)


def _one_device(factory, loss, batches):
    model = unsharded(factory)
    return train(model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param), batches, loss)


class Vocab(nnx.Module):
    """A decoder-ish MLP whose vocabulary (1001) divides no tensor degree."""

    def __init__(self, rngs, vocab=1001, width=64):
        def names(*n):
            return nnx.with_partitioning(LECUN, n)

        normal = nnx.with_partitioning(nnx.initializers.normal(1.0), ("vocab", "embed"))
        self.embed = nnx.Embed(vocab, width, embedding_init=normal, rngs=rngs)
        self.up = nnx.Linear(width, 128, kernel_init=names("embed", "mlp"), rngs=rngs)
        self.down = nnx.Linear(128, width, kernel_init=names("mlp", "embed"), rngs=rngs)
        self.head = nnx.Linear(width, vocab, kernel_init=names("embed", "vocab"), rngs=rngs)

    def __call__(self, ids):
        x = self.embed(ids)
        return self.head(x + self.down(jax.nn.gelu(self.up(x))))


@pytest.fixture(scope="module")
def vocab_plans():
    mesh = DeviceMeshManager.create_device_mesh(MESH)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardingWarning)
        return {
            how: sf.plan_model(lambda: Vocab(nnx.Rngs(0)), mesh, layout="fsdp+tp", indivisible=how)
            for how in ("move", "replicate")
        }


def test_an_axis_a_vocabulary_does_not_divide_moves_and_trains_like_one_device(vocab_plans):
    plan = vocab_plans["move"]
    assert sf.sharding_report(plan).ratio_to_ideal <= 1.10
    assert sf.sharding_report(vocab_plans["replicate"]).ratio_to_ideal > 3  # what moving saves
    row = sf.sharding_report(plan).row("embed/embedding")
    assert row.spec == P(None, ("data", "model"))
    (moved,) = row.reasons
    assert moved.kind == "moved" and moved.axes == ("model",) and "dim 1 (64)" in str(moved)
    # where it is used the moved tensor axis is gathered, like the FSDP axis
    compute = plan.compute_shardings(plan.abstract_state)
    assert compute["embed"]["embedding"].get_value().spec == P(None, None)
    model = plan.create()
    optimizer = sf.create_sharded_optimizer(model, optax.adamw(1e-2))
    step = sf.make_train_step(_loss)
    batches = [_tokens(i, 1001) for i in range(3)]
    losses = [float(step(model, optimizer, b)["loss"]) for b in batches]
    assert step.data_parallel_for(model, optimizer, batches[0]) == "manual"
    np.testing.assert_allclose(losses, _one_device(lambda: Vocab(nnx.Rngs(0)), _loss, batches),
                               rtol=1e-5)  # fmt: skip
    assert model.embed.embedding[...].sharding.spec == P(None, ("data", "model"))


def test_strict_still_raises_on_an_axis_it_would_move():
    with pytest.raises(ValueError, match=r"1001 is not divisible.*strict=True"):
        sf.plan_model(lambda: Vocab(nnx.Rngs(0)), layout=Layout.named("fsdp+tp", MESH),
                      strict=True)  # fmt: skip
    with pytest.raises(ValueError, match="indivisible must be one of"):
        sf.plan_model(lambda: Vocab(nnx.Rngs(0)), layout=Layout.named("fsdp", MESH),
                      indivisible="drop")  # fmt: skip


class PublishedMoE(nnx.Module):
    """A 30B mixture of experts at real size (128 experts of 768, d_model 2048, 48 stacked
    layers), its experts annotated on the FSDP axis as its authors wrote it."""

    L, D, H, KV, HD, E, FF, VOCAB = 48, 2048, 32, 4, 128, 128, 768, 151936

    def __init__(self, rngs):
        L, D, E, FF = self.L, self.D, self.E, self.FF

        def param(shape, spec):
            return nnx.Param(LECUN(rngs.params(), shape), out_sharding=spec)

        self.embed = param((self.VOCAB, D), P(None, "fsdp"))
        self.wq = param((L, D, self.H * self.HD), P(None, "fsdp", None))
        self.wkv = param((L, D, 2 * self.KV * self.HD), P(None, "fsdp", None))
        self.wo = param((L, self.H * self.HD, D), P(None, None, "fsdp"))
        self.router = param((L, D, E), P(None, "fsdp", None))
        self.w_in = param((L, E, D, 2 * FF), P(None, "fsdp", None, None))
        self.w_out = param((L, E, FF, D), P(None, "fsdp", None, None))
        self.head = param((D, self.VOCAB), P("fsdp", None))


def test_a_published_30b_moe_plans_near_the_ideal_on_256_devices():
    mesh = AbstractMesh((256,), ("fsdp",), axis_types=(AxisType.Auto,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardingWarning)
        kept = sf.plan_model(lambda: PublishedMoE(nnx.Rngs(0)), mesh, indivisible="replicate")
    moved = sf.plan_model(lambda: PublishedMoE(nnx.Rngs(0)), mesh)  # no warning: all placed
    assert sf.sharding_report(kept).ratio_to_ideal > 200  # 128 experts on 256 devices: replicated
    report = sf.sharding_report(moved)
    assert report.ratio_to_ideal <= 1.05
    assert report.bytes_total > 30e9 * 4  # the real size: 30.5B float32 parameters
    assert report.row("w_in").spec == P(None, None, "fsdp", None)  # d_model 2048 takes it
    assert report.row("w_out").spec == P(None, None, None, "fsdp")


def test_partial_replication_warns_once_naming_the_variable_and_the_fix():
    class Narrow(nnx.Module):  # 1001 x 30: no dimension divides 8 devices
        def __init__(self, rngs):
            self.table = nnx.Param(
                LECUN(rngs.params(), (1001, 30)), out_sharding=("vocab", "embed")
            )
            self.proj = nnx.Param(LECUN(rngs.params(), (32, 64)), out_sharding=("embed", "mlp"))

    with pytest.warns(ShardingWarning) as record:
        plan = sf.plan_model(lambda: Narrow(nnx.Rngs(0)), layout=Layout.named("fsdp", {"data": 8}))
    summary = [
        str(w.message) for w in record if "its annotations and strategy ask for" in str(w.message)
    ]
    assert len(summary) == 1
    assert "table (1001, 30)" in summary[0] and "Pad a dimension to a multiple of 8" in summary[0]
    assert "proj" not in summary[0]  # sharded as asked
    assert plan.shortfall.ratio > 1.10
    assert plan.shortfall.rows[0][0].path == "table"


class OwnExperts(nnx.Module):
    """Experts as their authors compute them: a dense einsum over every expert, no dispatch."""

    def __init__(self, rngs, vocab=64, width=32, hidden=64, experts=4):
        def param(shape, names):
            return nnx.Param(LECUN(rngs.params(), shape), out_sharding=names)

        self.embed = param((vocab, width), ("vocab", "embed"))
        self.router = param((width, experts), ("embed", None))
        self.w_in = param((experts, width, hidden), ("expert", "embed", "mlp"))
        self.w_out = param((experts, hidden, width), ("expert", "mlp", "embed"))
        self.head = param((width, vocab), ("embed", "vocab"))

    def __call__(self, ids):
        x = self.embed[...][ids]
        gates = jax.nn.softmax(x @ self.router[...], axis=-1)
        h = jax.nn.gelu(jnp.einsum("btd,edf->btef", x, self.w_in[...]))
        y = jnp.einsum("btef,efd,bte->btd", h, self.w_out[...], gates)
        return (x + y) @ self.head[...]


def test_experts_computed_gathered_warn_once_with_their_traffic():
    layout = Layout.from_degrees(fsdp=2, ep=4)
    model = sf.create_sharded_model(lambda: OwnExperts(nnx.Rngs(0)), layout=layout)
    optimizer = sf.create_sharded_optimizer(model, optax.adam(1e-2))
    step = sf.make_train_step(_loss)
    batches = [_tokens(i, 64) for i in range(2)]
    with pytest.warns(ShardingWarning, match="never sends tokens to their experts") as record:
        losses = [float(step(model, optimizer, b)["loss"]) for b in batches]
    (warning,) = [w for w in record if "experts" in str(w.message)]
    assert "w_in" in str(warning.message) and "w_out" in str(warning.message)
    assert "MiB per device per step" in str(warning.message)
    reference = _one_device(lambda: OwnExperts(nnx.Rngs(0)), _loss, batches)
    np.testing.assert_allclose(losses, reference, rtol=1e-5)  # gathered, but right


def test_specs_in_array_types_are_planned_as_plain_flax_places_them():
    mesh = DeviceMeshManager.create_device_mesh(MESH, axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        flax_model = ExplicitGuide(nnx.Rngs(0))  # plain Flax, eager
    plan = sf.plan_model(lambda: ExplicitGuide(nnx.Rngs(0)), mesh, layout="fsdp+tp")
    rows = {row.path: row for row in plan.rows}
    for path, variable in nnx.to_flat_state(nnx.state(flax_model)):
        name = "/".join(map(str, path))
        assert rows[name].spec == variable.get_value().sharding.spec, name
        assert rows[name].spec != P(None, None), name  # the test can fail: all are sharded


def test_own_mesh_axis_specs_on_a_mesh_without_the_axis_say_which_rule_to_add():
    mesh = DeviceMeshManager.create_device_mesh(MESH)
    with pytest.raises(ValueError) as error:
        sf.create_sharded_model(lambda: OwnSpecs(nnx.Rngs(0)), mesh, layout="fsdp")
    message = str(error.value)
    assert "'tp'" in message and "layout 'fsdp'" in message
    assert "rules=[('tp', None)]" in message and "('data', 'model')" in message
    model = sf.create_sharded_model(lambda: OwnSpecs(nnx.Rngs(0)), mesh, [("tp", None)],
                                    layout="fsdp")  # fmt: skip
    assert model.up[...].sharding.spec == P("data", None)


def test_a_step_compiles_once_for_a_model_whose_graph_cannot_be_hashed():
    def factory():
        from gallery import ConfigMLP

        return ConfigMLP(MLPConfig(), nnx.Rngs(0))

    model = sf.create_sharded_model(factory, layout=Layout.named("fsdp", MESH))
    with pytest.raises(TypeError, match="unhashable"):
        hash(nnx.graphdef(model))
    optimizer = sf.create_sharded_optimizer(model, optax.adam(1e-2))
    step = sf.make_train_step(_loss)
    for i in range(3):
        step(model, optimizer, _tokens(i, 32))
    (built,) = step._compiled.values()  # one program for three calls
    assert built.jitted._cache_size() == 1
    step(model, optimizer, _tokens(0, 32, rows=16))  # another batch shape: another program
    assert len(step._compiled.values()) == 2


class Scaled(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(32, 16, rngs=rngs)
        self.head = nnx.Linear(16, 32, rngs=rngs)

    def __call__(self, ids):
        return self.head(jax.nn.gelu(self.embed(ids)))


def _scaled_loss(model, batch):
    return batch["scale"] * _loss(model, batch["tokens"])


def _scaled(seed, rows=8):
    return {"tokens": _tokens(seed, 32, rows), "scale": np.float32(0.5 + seed)}


@pytest.mark.parametrize("microbatches", [1, 2])
def test_replicated_scalars_in_the_batch_reach_every_device_and_slice(microbatches):
    model = sf.create_sharded_model(lambda: Scaled(nnx.Rngs(0)), layout=Layout.named("fsdp", MESH))
    optimizer = sf.create_sharded_optimizer(model, optax.adamw(1e-2))
    step = sf.make_train_step(_scaled_loss, microbatches=microbatches)
    batches = [_scaled(i, rows=8 * microbatches) for i in range(3)]
    assert step.data_parallel_for(model, optimizer, batches[0]) == "manual"
    if microbatches > 1:  # one row per device does not split in two
        with pytest.raises(ValueError, match=r"microbatches=2 .* 8 rows over 8 .* 1 per device"):
            step(model, optimizer, _scaled(0))
    losses = [float(step(model, optimizer, b)["loss"]) for b in batches]
    reference = _one_device(lambda: Scaled(nnx.Rngs(0)), _scaled_loss, batches)
    np.testing.assert_allclose(losses, reference, rtol=1e-5)


def test_a_manual_step_refuses_a_loss_that_draws_from_a_shared_key():
    entry = PUBLISHED["drop-path-batch-key"]
    model = sf.create_sharded_model(entry.factory, layout=Layout.named("fsdp", MESH))
    optimizer = sf.create_sharded_optimizer(model, optax.adamw(1e-2))
    step = sf.make_train_step(entry.loss, data_parallel="manual")
    with pytest.raises(
        ValueError, match=r"draws random numbers from a key that is not an nnx.Rngs"
    ):
        step(model, optimizer, entry.batch(0))
    sf.make_train_step(entry.loss, data_parallel="xla")(model, optimizer, entry.batch(0))


def test_a_raw_key_in_the_batch_is_refused_with_the_typed_alternative():
    from substrax.spmd import check_batch

    assert check_batch({"x": np.zeros((4, 3)), "key": jax.random.key(0)}) == 4
    with pytest.raises(ValueError, match=r"jax.random.key\(seed\)"):
        check_batch({"x": np.zeros((4, 3)), "key": np.asarray(jax.random.PRNGKey(0))})
    with pytest.raises(ValueError, match="no rows"):
        check_batch({"scale": np.float32(1.0)})
