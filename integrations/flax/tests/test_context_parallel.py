"""Context parallelism: the sequence split over a ``context`` axis, attention as a ring."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import substrax_flax as sf
from substrax import ShardingWarning
from substrax.hlo import traffic_by_kind
from substrax.layout import Layout
from substrax.spmd import attention, constrain, positions, shard_batch, use_rules, zigzag

SEQ, VOCAB, D, HEADS = 32, 64, 32, 4


class Decoder(nnx.Module):
    """One causal attention block with learned positions (which zigzag order must follow)."""

    def __init__(self, rngs, variant="ring"):
        init = nnx.initializers.normal(0.1)
        self.variant = variant
        self.emb = nnx.Param(init(rngs.params(), (VOCAB, D)), out_sharding=("vocab", "embed"))
        self.pos = nnx.Param(init(rngs.params(), (SEQ, D)), out_sharding=(None, "embed"))
        self.wqkv = nnx.Param(
            init(rngs.params(), (3, D, HEADS, D // HEADS)),
            out_sharding=(None, "embed", "heads", "kv"),
        )
        self.wo = nnx.Param(
            init(rngs.params(), (HEADS, D // HEADS, D)), out_sharding=("heads", "kv", "embed")
        )
        self.head = nnx.Param(init(rngs.params(), (D, VOCAB)), out_sharding=("embed", "vocab"))

    def __call__(self, tokens):
        x = self.emb[...][tokens] + self.pos[...][positions(tokens.shape[1])]
        x = constrain(x, "batch", "seq", "embed")
        q, k, v = jnp.einsum("btd,cdhk->cbthk", x, self.wqkv[...])
        a = attention(q, k, v, causal=True, variant=self.variant)
        x = x + jnp.einsum("bthk,hkd->btd", a, self.wo[...])
        return x @ self.head[...]


def loss_fn(model, batch):
    logits = model(batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def _batches(steps=2, rows=8):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (steps, rows, SEQ + 1)).astype(np.int32)
    return [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in tokens]  # shifted before the split


def _train(layout, variant="ring", **step_args):
    model = sf.create_sharded_model(lambda: Decoder(nnx.Rngs(0), variant), layout=layout)
    optimizer = sf.create_sharded_optimizer(model, optax.adam(1e-2))
    step = sf.make_train_step(loss_fn, **step_args)
    losses = [float(step(model, optimizer, batch)["loss"]) for batch in _batches()]
    return (
        losses,
        nnx.state(model, nnx.Param),
        step.data_parallel_for(model, optimizer, _batches()[0]),
    )


@pytest.fixture(scope="module")
def one_device():
    return _train(Layout.named("dp", {"data": 1}))


CASES = [
    ("fsdp+cp", {"data": 2, "context": 4}, "ring", "auto"),
    ("fsdp+cp", {"data": 2, "context": 4}, "all_gather", "auto"),
]


@pytest.mark.parametrize("name,mesh,variant,data_parallel", CASES)
def test_losses_and_parameters_equal_one_device(one_device, name, mesh, variant, data_parallel):
    """Causal, load-balanced (zigzag) attention with positions: two adam steps as on one device.

    Tolerance: the online softmax sums blocks in another order than one block does, so the
    results differ by float32 rounding (rtol 1e-5 on the losses, 1e-4 on the parameters).
    """
    losses, params, mode = _train(Layout.named(name, mesh), variant, data_parallel=data_parallel)
    assert mode == ("manual" if data_parallel == "auto" else "xla")
    np.testing.assert_allclose(losses, one_device[0], rtol=1e-5)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(one_device[1]), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("name", "mesh"), [("cp", {"data": 1, "context": 8}),
                                           ("fsdp+cp", {"data": 2, "context": 4})])  # fmt: skip
def test_context_axes_shard_parameters_and_optimizer_state(one_device, name, mesh):
    """As torchtitan's FSDP spans its context axis: nothing is held whole on the context axes."""
    layout = Layout.named(name, mesh)
    model = sf.create_sharded_model(lambda: Decoder(nnx.Rngs(0)), layout=layout)
    optimizer = sf.create_sharded_optimizer(model, optax.adam(1e-2))
    assert model.wqkv[...].sharding.spec[1] == layout.param_rules.as_dict()["embed"]
    for report in (sf.sharding_report(model), sf.sharding_report(optimizer)):
        assert report.ratio_to_ideal <= 1.05
    if name == "cp":  # (fsdp+cp trains in the test above)
        losses, _, _ = _train(layout)
        np.testing.assert_allclose(losses, one_device[0], rtol=1e-5)


def test_context_composes_with_fsdp_and_tensor_parallelism(one_device):
    layout = Layout.from_degrees(fsdp=2, cp=2, tp=2)
    # two free axes in a manual region abort XLA: the step says so (once), not XLA
    with pytest.warns(ShardingWarning, match=r"fails a CHECK .* \('context', 'model'\)") as said:
        losses, _, mode = _train(layout)
    assert len(said) == 1 and "MiB more per device per step" in str(said[0].message)
    np.testing.assert_allclose(losses, one_device[0], rtol=1e-5)
    assert mode == "xla"


def test_the_ring_moves_one_kv_block_per_step_and_never_gathers_the_sequence():
    """Traffic per device = K/V bytes of the device's rows x (cp - 1) / cp (the theory)."""
    layout = Layout.named("fsdp+cp", {"data": 2, "context": 4})
    mesh = layout.make_mesh()
    b, t, h, d = 4, 64, 4, 16
    x = jax.ShapeDtypeStruct(
        (b, t, h, d), jnp.float32, sharding=NamedSharding(mesh, P("data", "context"))
    )
    kv_bytes = 2 * (b // 2) * t * h * d * 4  # keys and values of one device's rows
    for variant, kind in (("ring", "collective-permute"), ("all_gather", "all-gather")):
        with use_rules(mesh, layout.compute_rules):
            attend = jax.jit(
                lambda q, k, v, variant=variant: attention(q, k, v, causal=True, variant=variant)
            )
            hlo = attend.lower(x, x, x).compile().as_text()
        traffic = traffic_by_kind(hlo, 8)
        moved = {k: v["bytes"] for k, v in traffic.items() if v["count"]}
        assert moved == {kind: kv_bytes * 3 / 4}, (variant, moved)


def test_the_batch_is_split_over_the_sequence_in_zigzag_order():
    mesh = Layout.named("fsdp+cp", {"data": 2, "context": 4}).make_mesh()
    rows = np.arange(2 * 16).reshape(2, 16)
    batch = shard_batch({"x": rows, "label": np.arange(2)}, mesh, "data", seq_axes=("context",))
    assert batch["x"].sharding.spec == P("data", "context") and batch["label"].sharding.spec == P(
        "data"
    )
    np.testing.assert_array_equal(np.asarray(batch["x"]), np.asarray(zigzag(rows, 4)))
    # device (0, 1) holds chunk 1 and chunk 6 of row 0: an early and a late one
    shard = next(
        s for s in batch["x"].addressable_shards if s.index[1].start == 4 and s.index[0].start == 0
    )
    assert np.asarray(shard.data)[0].tolist() == [2, 3, 12, 13]
    with pytest.raises(ValueError, match="does not split into 2 x cp = 8 chunks"):
        shard_batch({"x": np.zeros((2, 12))}, mesh, "data", seq_axes=("context",))


def test_positions_follow_the_layout():
    assert positions(8).tolist() == list(range(8))  # no rules: natural order
    layout = Layout.named("cp", {"data": 2, "context": 4})
    with use_rules(layout.make_mesh(), layout.compute_rules):
        assert positions(8).tolist() == [0, 7, 1, 6, 2, 5, 3, 4]
        with pytest.raises(ValueError, match="multiple of 8"):
            attention(*(jnp.zeros((2, 12, 2, 4)),) * 3)


def test_attention_that_cannot_split_its_heads_says_so():
    layout = Layout.from_degrees(cp=2, tp=4)
    mesh = layout.make_mesh()
    q = jax.ShapeDtypeStruct((2, 16, 4, 8), jnp.float32)
    kv = jax.ShapeDtypeStruct((2, 16, 2, 8), jnp.float32)  # 2 key/value heads over 4 devices
    with use_rules(mesh, layout.compute_rules):
        attend = jax.jit(lambda q, k, v: attention(q, k, v, causal=True))
        with pytest.warns(ShardingWarning, match=r"2 key/value heads do not split .* \('model',\)"):
            attend.lower(q, kv, kv)
        attend.lower(q, q, q)  # 4 and 4 heads split: nothing to say


def test_a_loss_that_shifts_targets_after_the_sequence_is_split_is_refused():
    """Under context axes, ``batch[:, 1:]`` in the loss would shift each device's chunks."""

    def shifting_loss(model, tokens):  # the model sees whole rows; the targets are shifted
        logits = model(tokens)[:, :-1]
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    layout = Layout.named("fsdp+cp", {"data": 2, "context": 4})
    model = sf.create_sharded_model(lambda: Decoder(nnx.Rngs(0)), layout=layout)
    optimizer = sf.create_sharded_optimizer(model, optax.adam(1e-2))
    rows = np.zeros((8, SEQ), np.int32)
    with pytest.raises(ValueError, match=r"slices the batch along its sequence \(\[:, 1:\]\).*"
                       r"context axes \('context',\).*Shift before the step"):  # fmt: skip
        sf.make_train_step(shifting_loss)(model, optimizer, rows)
    # without context axes the same loss is right, and runs
    plain = sf.create_sharded_model(lambda: Decoder(nnx.Rngs(0)),
                                    layout=Layout.named("fsdp", {"data": 8}))  # fmt: skip
    plain_optimizer = sf.create_sharded_optimizer(plain, optax.adam(1e-2))
    sf.make_train_step(shifting_loss)(plain, plain_optimizer, rows)


def test_stacked_layers_with_ring_attention_take_xla_step_named_and_equal_one_device():
    """Ring attention inside an nnx.scan over stacked layers: Shardy rejects that nested
    region within the manual one (at lowering, on every platform), so the plan takes XLA's
    step before tracing, says why, and trains as one device does."""
    import gpt

    config = gpt.Config(vocab=VOCAB, d_model=D, heads=HEADS, mlp=64, layers=2, seq=SEQ)
    batches = [gpt.next_tokens(gpt.batch_at(i, 8, SEQ) % VOCAB) for i in range(2)]

    def train(layout):
        model = sf.create_sharded_model(lambda: gpt.StackedGPT(config, nnx.Rngs(0)),
                                        layout=layout)  # fmt: skip
        optimizer = sf.create_sharded_optimizer(model, optax.adam(1e-2))
        step = sf.make_train_step(gpt.loss_fn)
        losses = [float(step(model, optimizer, batch)["loss"]) for batch in batches]
        return losses, step.plan

    with pytest.warns(ShardingWarning, match="run ring attention, which would enter a region"):
        losses, plan = train(Layout.named("fsdp+cp", {"data": 2, "context": 4}))
    assert plan.path == "xla" and "Shardy" in plan.reason and "('context',)" in plan.reason
    np.testing.assert_allclose(losses, train(Layout.named("dp", {"data": 1}))[0], rtol=1e-5)
