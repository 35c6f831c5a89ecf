"""What the step reads off the loss's trace before it chooses its path: which random draws come
from keys that are not stream keys, and which shardings name the batch axes."""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from substrax.mesh import DeviceMeshManager
from substrax_flax._traced import is_key, trace

KEY = jax.random.key(0)
X = jnp.ones((4, 3))


def _foreign(fn, *args, streams):
    return trace(fn, *args, streams=streams).foreign_draws


def test_draws_from_a_stream_key_are_told_from_foreign_ones():
    def both(stream, batch_key, x):
        kept = jax.random.bernoulli(jax.random.fold_in(stream, 3), 0.5, x.shape)
        return x * kept + jax.random.normal(batch_key, x.shape)

    assert is_key(KEY) and not is_key(X)
    assert _foreign(both, KEY, KEY, X, streams=(True, False, False)) == ("random_bits",)
    assert _foreign(both, KEY, KEY, X, streams=(True, True, False)) == ()
    held = lambda stream, x: x + jax.random.normal(jax.random.key(7), x.shape)  # noqa: E731
    assert _foreign(held, KEY, X, streams=(True, False)) == ("random_bits",)  # a closed-over key


def test_stream_keys_are_followed_into_nested_jaxprs():
    @jax.checkpoint
    def remat(key, x):
        return x * jax.random.uniform(key, x.shape)

    def scanned(key, x):
        def body(carry, row):
            return carry, row * jax.random.uniform(jax.random.fold_in(carry, 1), row.shape)

        return jax.lax.scan(body, key, x)[1]

    def looped(key, x):
        def body(i, carry):
            key, x = carry
            return key, x + jax.random.normal(jax.random.fold_in(key, i), x.shape)

        return jax.lax.fori_loop(0, jnp.int32(x.shape[0]) + 0 * x[0, 0].astype(jnp.int32),
                                 body, (key, x))[1]  # fmt: skip

    def branched(key, x):
        return jax.lax.cond(x[0, 0] > 0, lambda: jax.random.normal(key, x.shape), lambda: x)

    for fn in (jax.jit(remat), scanned, looped, branched):
        assert trace(fn, KEY, X).random_draws == ("random_bits",), fn
        assert _foreign(fn, KEY, X, streams=(True, False)) == (), fn
        assert _foreign(fn, KEY, X, streams=(False, False)) == ("random_bits",), fn


def test_shardings_that_name_the_batch_axes_are_found():
    mesh = DeviceMeshManager.create_device_mesh({"data": 2, "model": 4})

    def constrained(x):
        return jax.lax.with_sharding_constraint(x * 2, P("data", None))

    with jax.set_mesh(mesh):
        traced = trace(constrained, jnp.ones((8, 4)))
    assert traced.naming(("data",)) == ("sharding_constraint",)
    assert traced.naming(("model",)) == ()
