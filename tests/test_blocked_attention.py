"""Flash-style blocked attention on one device equals whole rows and holds no score square."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_context_attention import B, D, H, inputs

from substrax.hlo import dot_flops
from substrax.spmd import attention


def _loss(w, **options):
    return lambda q, k, v: jnp.sum(attention(q, k, v, **options) * w)


@pytest.mark.parametrize("causal", [True, False])
def test_values_and_gradients_equal_whole_rows(causal):
    q, k, v, w = inputs()
    blocked = jax.jit(lambda q, k, v: attention(q, k, v, causal=causal, block=8))
    whole = attention(q, k, v, causal=causal)
    np.testing.assert_allclose(blocked(q, k, v), whole, atol=2e-6, rtol=2e-5)
    got = jax.jit(jax.grad(_loss(w, causal=causal, block=8), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(_loss(w, causal=causal), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(g, r, atol=2e-5, rtol=2e-4)


def test_gradients_under_remat_equal_whole_rows():
    q, k, v, w = inputs()
    loss = jax.checkpoint(_loss(w, causal=True, block=16))
    got = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(_loss(w, causal=True), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(g, r, atol=2e-5, rtol=2e-4)


def _compiled(loss, length):
    q, k, v, w = inputs(length)
    grad = jax.jit(jax.grad(loss(w), argnums=(0, 1, 2)))
    return grad.lower(q, k, v).compile()


def test_the_backward_holds_one_block_square_and_skips_the_masked_blocks():
    """A causal step over 512 tokens in blocks of 64: whole rows hold [B, H, T, T] float32
    squares (2 MiB each); blocks hold [B, 64, H, 64] ones. Above the diagonal nothing runs:
    the products are the visible pairs' alone."""
    length, block = 512, 64
    whole = _compiled(lambda w: _loss(w, causal=True), length)
    blocked = _compiled(lambda w: _loss(w, causal=True, block=block), length)
    square = B * H * length * length * 4
    assert whole.memory_analysis().temp_size_in_bytes >= square
    assert blocked.memory_analysis().temp_size_in_bytes < square / 4
    blocks = length // block
    pairs = blocks * (blocks + 1) // 2  # 36 of 64: on and below the diagonal
    product = 2 * B * H * block * block * D
    # per pair: scores and values forward; scores again, their gradient, dq, dk, dv backward
    assert dot_flops(blocked.as_text()) == pairs * 7 * product


@pytest.mark.parametrize("block", [0, 5, 2.0, True])
def test_a_block_that_does_not_divide_the_length_is_refused(block):
    q, k, v, _ = inputs()
    with pytest.raises(
        ValueError, match=rf"divides the query and key lengths \(32, 32\), got {block!r}"
    ):
        attention(q, k, v, block=block)


def test_causal_blocks_need_one_length():
    q, k, v, _ = inputs()
    with pytest.raises(ValueError, match=r"one length, got \(32, 16\)"):
        attention(q, k[:, :16], v[:, :16], causal=True, block=8)
