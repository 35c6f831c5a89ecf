"""A reduce-scatter in two stages equals one, and the stages are chosen where XLA:TPU needs them."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from substrax.spmd import reduce_scatter, scatter_stages


def _scattered(mesh, axes, dimension, stages):
    x = jax.random.normal(jax.random.key(0), (8, 16, 24))  # one addend per device

    def body(block):
        return reduce_scatter(block[0], axes, dimension=dimension, stages=stages)

    out = P(*(None,) * dimension, axes)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=out))(x)


@pytest.mark.parametrize("dimension", [0, 1])
@pytest.mark.parametrize("stages", [(4, 2), (2, 4)])
def test_two_stages_equal_one_reduce_scatter_over_a_tuple_of_axes(mesh_2x4, dimension, stages):
    axes = ("data", "model")
    once = _scattered(mesh_2x4, axes, dimension, None)
    staged = _scattered(mesh_2x4, axes, dimension, stages)
    assert staged.shape == once.shape
    # the same sums, added in another order
    assert jnp.allclose(staged, once, atol=1e-5)
    total = jax.random.normal(jax.random.key(0), (8, 16, 24)).sum(0)
    assert jnp.allclose(once, total, atol=1e-5)


def test_stages_that_do_not_cover_the_group_are_refused(mesh_2x4):
    with pytest.raises(ValueError, match=r"stages \(2, 2\) must multiply to the 8 devices"):
        _scattered(mesh_2x4, ("data", "model"), 0, (2, 2))


@pytest.mark.parametrize(
    ("sizes", "axes", "platform", "expected"),
    [
        ({"data": 8}, ("data",), "tpu", (4, 2)),
        ({"data": 32}, ("data",), "tpu", (8, 4)),  # v5p:2x4x4: both stages at the limit
        ({"data": 64}, ("data",), "tpu", (8, 8)),
        ({"data": 4, "fsdp": 8}, ("data", "fsdp"), "tpu", (8, 4)),
        ({"data": 8, "model": 4}, ("data",), "tpu", None),  # a sub-group stays one
        ({"data": 7}, ("data",), "tpu", None),  # nothing to stage
        ({"data": 32}, ("data",), "cpu", None),
        ({"data": 32}, ("data",), "gpu", None),
    ],
)
def test_stages_only_where_xla_tpu_reduces_over_every_device(sizes, axes, platform, expected):
    assert scatter_stages(sizes, axes, platform) == expected
