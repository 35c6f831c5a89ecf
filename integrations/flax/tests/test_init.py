"""The sharded init: same values as unsharded, and no full-size buffer of a sharded parameter."""

import jax
import numpy as np
import pytest
from flax import nnx
from flax_test_models import StackedTransformer, Transformer, unsharded
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import substrax_flax as sf
from substrax.mesh import DeviceMeshManager, MeshRules

ALL = ("data", "model")
FSDP_ALL = MeshRules(data=ALL, embed=ALL).extend(vocab=None, kv=None, layers=None)
FSDP_TP = MeshRules(data="data", embed="data", mlp="model", heads="model").extend(
    vocab="model", kv=None, layers=None
)
AUTO, EXPLICIT = (AxisType.Auto,) * 2, (AxisType.Explicit,) * 2


def _full_shape_buffers(hlo, rows):
    """Sharded parameters whose global shape appears in the HLO text."""
    return [
        row.path
        for row in rows
        if any(entry is not None for entry in row.spec)
        and "[" + ",".join(map(str, row.shape)) + "]" in hlo
    ]


@pytest.mark.parametrize("axis_types", [AUTO, EXPLICIT], ids=["auto", "explicit"])
@pytest.mark.parametrize("rules", [FSDP_ALL, FSDP_TP], ids=["fsdp", "fsdp+tp"])
def test_values_equal_the_unsharded_factory(rules, axis_types):
    factory = lambda: Transformer(nnx.Rngs(0))  # noqa: E731
    mesh = DeviceMeshManager.create_device_mesh({"data": 2, "model": 4}, axis_types=axis_types)
    model = sf.create_sharded_model(factory, mesh, rules)
    reference = unsharded(factory)
    leaves = jax.tree_util.tree_leaves_with_path(nnx.state(reference))
    for (path, expected), actual in zip(leaves, jax.tree.leaves(nnx.state(model)), strict=True):
        np.testing.assert_array_equal(actual, expected, err_msg=jax.tree_util.keystr(path))


def test_stacked_values_equal_the_unsharded_factory():
    factory = lambda: StackedTransformer(nnx.Rngs(3))  # noqa: E731
    mesh = DeviceMeshManager.create_device_mesh({"data": 2, "model": 4})
    model = sf.create_sharded_model(factory, mesh, FSDP_TP.extend(layers="data"))
    assert model.blocks.wq[...].sharding.spec == P("data", None, "model", None)
    for expected, actual in zip(
        jax.tree.leaves(nnx.state(unsharded(factory))),
        jax.tree.leaves(nnx.state(model)),
        strict=True,
    ):
        np.testing.assert_array_equal(actual, expected)


@pytest.mark.parametrize("axis_types", [AUTO, EXPLICIT], ids=["auto", "explicit"])
def test_compiled_init_holds_no_full_sharded_parameter(axis_types):
    mesh = DeviceMeshManager.create_device_mesh({"data": 2, "model": 4}, axis_types=axis_types)
    plan = sf.plan_model(lambda: Transformer(nnx.Rngs(0)), mesh, FSDP_ALL)
    compiled = plan.compile_init()
    assert _full_shape_buffers(compiled.as_text(), plan.rows) == []
    # Output bytes per device: the shards, plus the 8-byte pointer table of the output tuple.
    output = compiled.memory_analysis().output_size_in_bytes
    assert output == sf.sharding_report(plan).bytes_per_device + 8 * len(plan.rows)


def test_the_full_buffer_detector_fires_on_a_naive_init():
    mesh = DeviceMeshManager.create_device_mesh({"data": 2, "model": 4})
    plan = sf.plan_model(lambda: Transformer(nnx.Rngs(0)), mesh, FSDP_ALL)

    def naive():
        return nnx.state(unsharded(lambda: Transformer(nnx.Rngs(0))))

    hlo = jax.jit(naive).lower().compile().as_text()
    assert "blocks/0/wq" in _full_shape_buffers(hlo, plan.rows)


def test_planning_and_compiling_the_init_allocate_nothing():
    mesh = DeviceMeshManager.create_device_mesh({"data": 2, "model": 4})
    live = jax.live_arrays()  # held, so no array made below can reuse one of their ids
    before = {id(a) for a in live}
    plan = sf.plan_model(lambda: Transformer(nnx.Rngs(0)), mesh, FSDP_TP)
    stats = plan.compile_init().memory_analysis()
    assert [a.shape for a in jax.live_arrays() if id(a) not in before] == []
    assert stats.output_size_in_bytes == sf.sharding_report(plan).bytes_per_device + 8 * len(
        plan.rows
    )
    model = plan.create()
    created = {id(a) for a in jax.live_arrays()} - before
    assert {id(a) for a in jax.tree.leaves(nnx.state(model))} <= created


def test_a_model_built_outside_substrax_gets_flax_s_error_and_the_documented_fixes_work():
    """Built before any substrax call, an annotated model meets Flax's eager-sharding check;
    docs/troubleshooting.md gives two fixes, and both give the planned shardings and values."""
    mesh = DeviceMeshManager.create_device_mesh({"data": 2, "model": 4})
    with pytest.raises(ValueError, match="An auto mesh context or metadata is required"):
        Transformer(nnx.Rngs(0))
    built = sf.create_sharded_model(lambda: Transformer(nnx.Rngs(0)), mesh, FSDP_TP)
    with nnx.use_eager_sharding(False):
        outside = Transformer(nnx.Rngs(0))
    sf.shard_model(outside, mesh, FSDP_TP)
    pairs = zip(jax.tree.leaves(nnx.state(built)), jax.tree.leaves(nnx.state(outside)), strict=True)
    for a, b in pairs:
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
        np.testing.assert_array_equal(a, b)
