"""Context-parallel attention equals one device's attention, values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from substrax.hlo import collectives
from substrax.mesh import DeviceMeshManager
from substrax.spmd import context_attention, context_positions, unzigzag, zigzag

B, T, H, HKV, D = 2, 32, 4, 2, 8


def inputs(length=T, seed=0):
    """Queries, grouped keys and values, and an output weight, ``length`` tokens long."""
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (B, length, H, D))
    k = jax.random.normal(keys[1], (B, length, HKV, D))
    v = jax.random.normal(keys[2], (B, length, HKV, D))
    w = jax.random.normal(keys[3], (B, length, H, D))
    return q, k, v, w


def _dense(q, k, v, causal):
    groups = H // HKV
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
    if causal:
        scores = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def _context(mesh, causal, balanced, variant):
    cp = mesh.shape["context"]
    spec = P(None, "context")

    def local(q, k, v):
        return context_attention(q, k, v, axis_name="context", causal=causal, balanced=balanced,
                                 variant=variant)  # fmt: skip

    mapped = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)

    def attention(q, k, v):
        if balanced:
            q, k, v = (zigzag(x, cp) for x in (q, k, v))
        out = mapped(q, k, v)
        return unzigzag(out, cp) if balanced else out

    return jax.jit(attention)


@pytest.fixture(scope="module")
def mesh():
    return DeviceMeshManager.create_device_mesh({"context": 4}, jax.devices()[:4])


@pytest.mark.parametrize(
    ("variant", "causal", "balanced"),
    [("ring", True, True)],
)  # fmt: skip
def test_values_and_gradients_equal_one_device(mesh, variant, causal, balanced):
    """Grouped-query heads, values and gradients (the all-gather variant, and the ring on a
    whole train step, are compared with one device in test_context_parallel.py)."""
    q, k, v, w = inputs()
    attention = _context(mesh, causal, balanced, variant)
    np.testing.assert_allclose(attention(q, k, v), _dense(q, k, v, causal), atol=2e-6, rtol=2e-5)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * w)

    got = jax.grad(loss(attention), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss(lambda q, k, v: _dense(q, k, v, causal)), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(g, r, atol=2e-5, rtol=2e-4)


def test_the_ring_passes_key_value_blocks_and_never_gathers(mesh):
    q, k, v, _ = inputs()
    text = _context(mesh, True, True, "ring").lower(q, k, v).as_text()
    ops = collectives(text, 4)
    assert {op.kind for op in ops} == {"collective-permute"}
    block = B * (T // 4) * HKV * D * 4  # one device's keys (or values), f32
    assert sum(op.traffic_bytes for op in ops) == 2 * 3 * block  # K and V, cp - 1 times


def test_zigzag_gives_each_device_an_early_and_a_late_chunk():
    x = jnp.arange(16)[None]
    order = zigzag(x, 4)
    assert order[0].tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    assert unzigzag(order, 4)[0].tolist() == list(range(16))
    mesh = DeviceMeshManager.create_device_mesh({"context": 4}, jax.devices()[:4])
    positions = jax.shard_map(
        lambda: context_positions(4, "context", balanced=True)[None], mesh=mesh, in_specs=(),
        out_specs=P("context"),
    )()  # fmt: skip
    assert positions.reshape(-1).tolist() == order[0].tolist()
    with pytest.raises(ValueError, match="does not split into 2 x cp = 8 chunks"):
        zigzag(jnp.arange(12)[None], 4)
    with pytest.raises(ValueError, match=r"variant must be one of \('ring', 'all_gather'\)"):
        context_attention(x, x, x, axis_name="context", variant="tree")
