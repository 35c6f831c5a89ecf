"""Mixture-of-experts internals: routers, the grouped product, dispatches, the exchange."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from substrax.hlo import collectives
from substrax.layout import Layout
from substrax.spmd import (
    ROUTINGS,
    experts,
    group_rows,
    grouped_matmul,
    route,
    use_rules,
)


def _weights(key, experts=8, features=16, hidden=24, scale=1.0):
    keys = jax.random.split(key, 4)
    return (
        scale * jax.random.normal(keys[0], (features, experts)),
        jax.random.normal(keys[1], (experts, features, hidden)) / features**0.5,
        jax.random.normal(keys[2], (experts, hidden, features)) / hidden**0.5,
        jax.random.normal(keys[3], (experts, features, hidden)) / features**0.5,
    )


def test_routers_choose_and_weigh_as_published():
    logits = jnp.array([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 0.5]])
    soft = route(logits, 2, "softmax")
    topk = route(logits, 2, "topk-softmax")
    np.testing.assert_array_equal(soft.index, [[0, 1], [1, 2]])
    np.testing.assert_allclose(soft.gates, topk.gates, rtol=1e-6)  # Mixtral == normalised
    np.testing.assert_allclose(soft.gates[0], jax.nn.softmax(jnp.array([2.0, 1.0])), rtol=1e-6)
    raw = route(logits, 2, "softmax", normalize=False)  # Qwen-MoE's norm_topk_prob=False
    np.testing.assert_allclose(raw.gates[0], jax.nn.softmax(logits[0])[:2], rtol=1e-6)
    sigmoid = route(logits, 2, "sigmoid", normalize=False)  # DeepSeek-V3's scores
    np.testing.assert_allclose(sigmoid.gates[1], jax.nn.sigmoid(jnp.array([3.0, 1.0])), rtol=1e-6)
    biased = route(logits, 2, "softmax", normalize=False, bias=jnp.array([0.0, 0.0, 0.0, 5.0]))
    np.testing.assert_array_equal(biased.index[:, 0], [3, 3])  # the bias moves the choice...
    np.testing.assert_allclose(biased.gates[0, 0], jax.nn.softmax(logits[0])[3], rtol=1e-6)
    np.testing.assert_allclose(soft.z, jax.nn.logsumexp(logits, -1), rtol=1e-6)  # ...not this
    with pytest.raises(ValueError, match=r"routing must be one of \('softmax'"):
        route(logits, 2, "softmax-topk")
    assert ROUTINGS == ("softmax", "topk-softmax", "sigmoid")


@pytest.mark.parametrize("native", [False, True])
def test_grouped_matmul_and_its_gradient_equal_a_gather_of_every_expert(native):
    """Blocked (XLA:CPU) and packed (``ragged_dot``) layouts; rows of group 5 are left out.

    The blocked loop over every block and over the blocks in use (``ragged``)."""
    keys = jax.random.split(jax.random.key(0), 3)
    x, w = jax.random.normal(keys[0], (40, 8)), jax.random.normal(keys[1], (5, 8, 6))
    group = jax.random.randint(keys[2], (40,), 0, 6)

    def grouped(x, w, ragged=False):  # read from x's rows, added into the result's rows
        groups = group_rows(group, 5, block=4, native=native, ragged=ragged)
        return grouped_matmul(x, w, groups, source=groups.slots, target=groups.slots, rows=40)

    def reference(x, w):
        product = jnp.einsum("nd,ndh->nh", x, w[jnp.minimum(group, 4)])
        return jnp.where((group < 5)[:, None], product, 0.0)

    for ragged in (False, True):
        np.testing.assert_allclose(grouped(x, w, ragged), reference(x, w), rtol=1e-5, atol=1e-5)
        got = jax.grad(lambda x, w, r=ragged: jnp.sin(grouped(x, w, r)).sum(), (0, 1))(x, w)
        want = jax.grad(lambda x, w: jnp.sin(reference(x, w)).sum(), (0, 1))(x, w)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tile", [4, 7, 64])
def test_the_tiled_weight_gradient_equals_ragged_dots(monkeypatch, tile):
    """XLA:TPU's grouped product: the weights' gradient tile by tile and group by group
    (groups that are empty, that share a tile, that span tiles, rows past the last group,
    a last tile cut short) equals ``ragged_dot``'s own transpose."""
    from substrax.spmd import _grouped

    monkeypatch.setattr(_grouped, "_TILE", tile)
    keys = jax.random.split(jax.random.key(1), 3)
    xs, w = jax.random.normal(keys[0], (30, 8)), jax.random.normal(keys[1], (5, 8, 6))
    sizes = jnp.array([3, 0, 11, 1, 9], jnp.int32)  # 24 of 30 rows; the rest belong to none
    cotangent = jax.random.normal(keys[2], (30, 6))

    def loss(f):
        return lambda xs, w: jnp.sum(f(xs, w, sizes) * cotangent)

    got = jax.grad(loss(_grouped._ragged), (0, 1))(xs, w)
    want = jax.grad(loss(jax.lax.ragged_dot), (0, 1))(xs, w)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_the_tiled_weight_gradient_inside_shard_map_sums_over_the_rows_devices():
    """As the step runs it: rows and group sizes varying over a manual axis, the weights
    not, so each device's weight gradient is summed over the axis."""
    from substrax.spmd import _grouped

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    keys = jax.random.split(jax.random.key(2), 3)
    xs, w = jax.random.normal(keys[0], (60, 8)), jax.random.normal(keys[1], (5, 8, 6))
    cotangent = jax.random.normal(keys[2], (60, 6))
    sizes = jnp.array([[3, 0, 11, 1, 9], [12, 6, 0, 7, 2]], jnp.int32)  # each device's

    def grads(f):
        def local(xs, w, sizes, cotangent):
            loss = lambda xs, w: jnp.sum(f(xs, w, sizes[0]) * cotangent)  # noqa: E731
            return jax.grad(loss, (0, 1))(xs, w)

        spec = P("data")
        return jax.shard_map(local, mesh=mesh, in_specs=(spec, P(), spec, spec),
                             out_specs=(spec, P()))(xs, w, sizes, cotangent)  # fmt: skip

    for a, b in zip(grads(_grouped._ragged), grads(jax.lax.ragged_dot), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("gated", [False, True])
def test_sorted_dispatch_equals_one_hot_without_dropping(routing, gated):
    """The same outputs, losses and gradients as one-hot dispatch with every slot kept."""
    router, w_in, w_out, w_gate = _weights(jax.random.key(1))
    x = jax.random.normal(jax.random.key(2), (2, 12, 16))
    gate = w_gate if gated else None

    def loss(dispatch, x, router, w_in, w_out, gate):
        y, stats = experts(x, router, w_in, w_out, w_gate=gate, top_k=3, routing=routing,
                           dispatch=dispatch, activation=jax.nn.silu)  # fmt: skip
        return jnp.sum(y**2) + stats.aux_loss + stats.z_loss, stats

    args = (x, router, w_in, w_out, gate)
    (got, got_stats), got_grads = jax.value_and_grad(loss, (1, 2, 3, 4), has_aux=True)(
        "sorted", *args
    )
    (want, want_stats), want_grads = jax.value_and_grad(loss, (1, 2, 3, 4), has_aux=True)(
        "one-hot", *args
    )
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_array_equal(got_stats.counts, want_stats.counts)
    assert float(got_stats.counts.sum()) == 2 * 12 * 3 and float(got_stats.dropped) == 0.0
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_bad_dispatch_input_is_named():
    router, w_in, w_out, _ = _weights(jax.random.key(0))
    x = jnp.ones((1, 4, 16))
    with pytest.raises(ValueError, match=r"capacity_factor=1\.25 applies to dispatch='one-hot'"):
        experts(x, router, w_in, w_out, capacity_factor=1.25)
    with pytest.raises(ValueError, match=r"dispatch must be one of \('sorted', 'one-hot'\)"):
        experts(x, router, w_in, w_out, dispatch="dense")
    with pytest.raises(ValueError, match=r"router_bias has shape \(4,\); it needs \(8,\)"):
        experts(x, router, w_in, w_out, router_bias=jnp.zeros(4))


def test_exchange_moves_the_rows_routed_within_5_percent():
    """fsdp+ep over 2 x 4: counts first, then the rows in rounds; what the compiled rounds
    carry (their all-to-all bytes x the rounds run) is the stats' ``moved``, within 5% of
    the rows routed to other devices (``sent``), 16384 choices per device."""
    layout = Layout.named("fsdp+ep", {"data": 2, "expert": 4})
    mesh = layout.make_mesh()
    router, w_in, w_out, _ = _weights(jax.random.key(3), 16, features=8, hidden=8, scale=0.1)
    x = jax.random.normal(jax.random.key(4), (8, 2048, 8))  # 2048 tokens x top 8 per device
    rows = NamedSharding(mesh, P(("data", "expert")))

    def forward(x, router, w_in, w_out):
        return experts(x, router, w_in, w_out, top_k=8)

    with use_rules(mesh, layout.compute_rules):
        forward = jax.jit(forward)
        args = (jax.device_put(x, rows), router, w_in, w_out)
        _, stats = forward(*args)
        hlo = forward.lower(*args).compile().as_text()
    ep, choices = 4, 2048 * 8
    chunk = math.ceil(choices / ep / 64)
    sent, moved = float(stats.sent), float(stats.moved)
    assert sent > 0.7 * 8 * choices  # three quarters of the choices leave their device
    assert sent <= moved <= 1.05 * sent
    rounds = moved / (8 * chunk * (ep - 1))
    assert rounds == int(rounds)
    # the rows' all-to-alls (there and back): [ep, chunk, features] float32 per round, of
    # which (ep - 1) / ep leave the device; the counts' is one int32 per expert
    moving = [op for op in collectives(hlo, 8) if op.kind == "all-to-all"]
    rounds_bytes = sorted(op.result_bytes for op in moving)
    assert rounds_bytes == [16 * 4, ep * chunk * 8 * 4, ep * chunk * 8 * 4]
    forward_bytes = rounds * max(op.traffic_bytes for op in moving) * 8  # all devices
    assert forward_bytes == moved * 8 * 4
