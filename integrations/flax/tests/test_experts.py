"""Mixtures of experts: sorted and one-hot dispatch, routers, experts over an ``expert`` axis."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import substrax_flax as sf
from substrax.hlo import traffic_by_kind
from substrax.layout import Layout
from substrax.spmd import constrain, expert_capacity, experts, use_rules

VOCAB, D, HIDDEN, EXPERTS = 64, 32, 64, 8


class Model(nnx.Module):
    """Embedding, one gated mixture of experts whose router favours expert 0, a head."""

    def __init__(self, rngs, capacity_factor=None, **moe):
        init = nnx.initializers.normal(0.5)
        self.emb = nnx.Param(init(rngs.params(), (VOCAB, D)), out_sharding=("vocab", "embed"))
        dispatch = "sorted" if capacity_factor is None else "one-hot"
        self.moe = sf.MixtureOfExperts(
            D, HIDDEN, EXPERTS, top_k=2, dispatch=dispatch, capacity_factor=capacity_factor,
            gated=True, rngs=rngs, **moe,
        )  # fmt: skip
        mean = self.emb[...].mean(0)  # uneven loads: expert 0 gets 3 to 8x the least's
        self.moe.router[...] = self.moe.router[...].at[:, 0].add(mean / jnp.sum(mean**2))
        self.head = nnx.Param(init(rngs.params(), (D, VOCAB)), out_sharding=("embed", "vocab"))

    def __call__(self, tokens):
        x = constrain(self.emb[...][tokens], "batch", None, "embed")
        y, stats = self.moe(x)
        return (x + y) @ self.head[...], stats


def loss_fn(model, batch):
    logits, stats = model(batch[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
    return ce + 0.01 * stats.aux_loss + 1e-3 * stats.z_loss, {
        "aux": stats.aux_loss,
        "z": stats.z_loss,
        "dropped": stats.dropped,
        "load": stats.load,
        "tokens_per_expert": stats.counts,
    }


BATCHES = np.random.default_rng(0).integers(0, VOCAB, (3, 16, 17)).astype(np.int32)


def _train(layout, capacity_factor=None, moe=None, **step_args):
    factory = lambda: Model(nnx.Rngs(0), capacity_factor, **(moe or {}))  # noqa: E731
    model = sf.create_sharded_model(factory, layout=layout)
    # SGD: a parameter's change is its gradient's; adam would blow a rounding difference in
    # a near-zero gradient up to a full step (m / sqrt(v) is +-1 whatever the gradient's size)
    optimizer = sf.create_sharded_optimizer(model, optax.sgd(0.5))
    step = sf.make_train_step(loss_fn, has_aux=True, **step_args)
    metrics = [step(model, optimizer, batch) for batch in BATCHES]
    model.plan = step.plan_for(model, optimizer, BATCHES[0])
    return metrics, nnx.state(model, nnx.Param), model


@pytest.fixture(scope="module")
def one_device():
    return _train(Layout.named("dp", {"data": 1}))


@pytest.mark.parametrize("data_parallel", ["auto", "xla"])
def test_sorted_experts_over_fsdp_ep_equal_one_device(one_device, data_parallel):
    """Dropless over 2 x 4 devices, uneven loads: three steps as on one device, to 1e-5.

    Every choice is counted: the step's metrics carry the tokens per expert, ``tokens x
    top_k`` in all, the same on both layouts.
    """
    layout = Layout.named("fsdp+ep", {"data": 2, "expert": 4})
    metrics, params, _ = _train(layout, data_parallel=data_parallel)
    reference, reference_params, _ = one_device
    for got, want in zip(metrics, reference, strict=True):
        counts = np.asarray(want["tokens_per_expert"])
        assert counts.max() > 4 * counts.min() > 0  # the busiest expert > 4 x the least
        assert counts.sum() == 16 * 16 * 2 and float(got["dropped"]) == 0.0
        np.testing.assert_array_equal(got["tokens_per_expert"], counts)
        np.testing.assert_allclose(
            [got["loss"], got["aux"], got["z"]], [want["loss"], want["aux"], want["z"]],
            rtol=1e-5,
        )  # fmt: skip
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(reference_params), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_dropping_groups_tokens_by_device_whatever_the_expert_axis():
    """With a capacity, each device's rows are a group: fsdp 8 and fsdp 2 x ep 4 agree."""
    fsdp, _, _ = _train(Layout.named("fsdp", {"data": 8}), capacity_factor=1.0)
    ep, _, model = _train(Layout.named("fsdp+ep", {"data": 2, "expert": 4}), capacity_factor=1.0)
    assert ep[0]["tokens_per_expert"].sum() == 16 * 16 * 2  # counted before dropping
    assert float(ep[0]["dropped"]) > 0.05
    for got, want in zip(ep, fsdp, strict=True):
        np.testing.assert_allclose(
            [got["loss"], got["dropped"]], [want["loss"], want["dropped"]], rtol=1e-5
        )
    # each device holds 1/ep of the experts (and 1/2 of their embed dimension)
    w_in = model.moe.w_in[...]
    assert w_in.addressable_shards[0].data.shape == (EXPERTS // 4, D // 2, HIDDEN)


@pytest.mark.parametrize("name", ["ep", "fsdp+ep"])
def test_expert_axes_shard_the_dense_parameters_and_optimizer_state(name):
    """Nothing is held whole on the expert axes: dense weights are sharded on ``embed``."""
    layout = Layout.named(name, {"data": 2, "expert": 4})
    model = sf.create_sharded_model(lambda: Model(nnx.Rngs(0)), layout=layout)
    optimizer = sf.create_sharded_optimizer(model, optax.adam(1e-2))
    embed = ("data", "expert") if name == "fsdp+ep" else "expert"
    assert model.emb[...].sharding.spec == P(None, embed)
    assert model.moe.w_in[...].sharding.spec[:2] == (
        "expert",
        "data" if name == "fsdp+ep" else None,
    )
    over = 1 if name == "fsdp+ep" else 2  # ep keeps every parameter whole on its 2 replicas
    for report in (sf.sharding_report(model), sf.sharding_report(optimizer)):
        assert report.ratio_to_ideal <= 1.05 * over


def test_two_all_to_alls_per_layer_forward_of_the_theoretical_size():
    """Dispatch and combine: each [experts, capacity, features] of one device, (ep-1)/ep sent."""
    layout = Layout.named("ep", {"data": 2, "expert": 4})
    model = sf.create_sharded_model(lambda: Model(nnx.Rngs(0), 1.0), layout=layout)
    mesh = layout.make_mesh()
    rows = NamedSharding(mesh, P(("data", "expert")))
    params = nnx.state(model, nnx.Param)
    used = sf.plan_model(lambda: Model(nnx.Rngs(0), 1.0), layout=layout).compute_shardings(params)

    def forward(model, tokens):  # the dense parameters gathered first, as the train step does
        nnx.update(model, jax.lax.with_sharding_constraint(nnx.state(model, nnx.Param), used))
        return model(tokens)[0]

    with use_rules(mesh, layout.compute_rules):
        forward = jax.jit(forward)
        hlo = forward.lower(model, jax.device_put(BATCHES[0, :, :-1], rows)).compile().as_text()
    moved = traffic_by_kind(hlo, 8)["all-to-all"]
    local_tokens = 16 * 16 // 8
    capacity = expert_capacity(local_tokens, EXPERTS, 2, 1.0)
    assert moved["count"] == 2
    assert moved["bytes"] == 2 * EXPERTS * capacity * D * 4 * 3 / 4


def test_routing_keeps_first_choices_first_and_bad_input_is_named():
    x = jnp.ones((1, 4, 2))
    router = jnp.array([[1.0, 0.5, 0.0], [1.0, 0.5, 0.0]])  # every token: expert 0, then 1
    w_in, w_out = jnp.ones((3, 2, 2)), jnp.ones((3, 2, 2))
    _, stats = experts(x, router, w_in, w_out, top_k=2, dispatch="one-hot", capacity_factor=0.75)
    # capacity = ceil(0.75 * 4 * 2 / 3) = 2 per expert: 2 first choices and 2 second kept
    assert expert_capacity(4, 3, 2, 0.75) == 2
    assert float(stats.dropped) == 0.5 and np.asarray(stats.load).tolist() == [0.5, 0.5, 0.0]
    _, stats = experts(x, router, w_in, w_out, top_k=2, dispatch="one-hot", capacity_factor=None)
    assert float(stats.dropped) == 0.0
    with pytest.raises(ValueError, match=r"top_k must be an integer in \[1, 3\]"):
        experts(x, router, w_in, w_out, top_k=4)
    with pytest.raises(ValueError, match=r"w_out has shape \(3, 2, 2\).* needs \(3, 5, 2\)"):
        experts(x, router, jnp.ones((3, 2, 5)), w_out)
    with pytest.raises(ValueError, match="num_experts"):
        sf.MixtureOfExperts(4, 4, 2, top_k=3, rngs=nnx.Rngs(0))


def test_shared_experts_and_a_router_bias_train_as_on_one_device():
    """DeepSeek-V3's router: sigmoid scores, a bias that balances without a loss, a shared
    expert. The bias moves from whole-batch counts, so the manual step keeps it, and it
    freezes in eval mode."""
    moe = {"routing": "sigmoid", "shared_hidden": 16, "bias_rate": 0.01}
    reference, _, one = _train(Layout.named("dp", {"data": 1}), moe=moe)
    metrics, _, model = _train(Layout.named("fsdp+ep", {"data": 2, "expert": 4}), moe=moe)
    assert model.plan.path == "manual"
    for got, want in zip(metrics, reference, strict=True):
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    bias = np.asarray(model.moe.router_bias[...])
    np.testing.assert_allclose(bias, np.asarray(one.moe.router_bias[...]), atol=1e-7)
    counts = np.asarray(reference[-1]["tokens_per_expert"])
    assert np.abs(bias).max() == pytest.approx(0.03)  # 3 steps of 0.01
    assert bias[np.argmax(counts)] < 0 < bias[np.argmin(counts)]  # towards even loads
    model.eval()
    model(BATCHES[0][:, :-1])
    np.testing.assert_array_equal(np.asarray(model.moe.router_bias[...]), bias)
