import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from substrax import ShardingWarning
from substrax.layout import Layout
from substrax.mesh import (
    DataParallelStrategy,
    DeviceMeshManager,
    FSDPStrategy,
    MultiDimensionalStrategy,
    ParallelismConfig,
    PipelineParallelStrategy,
    ShardingConfig,
    ShardingStrategy,
    TensorParallelStrategy,
)


def _spec_of(array):
    return array.sharding.spec


def test_sharding_strategy_is_abstract():
    with pytest.raises(TypeError):
        ShardingStrategy("data", 0)


def test_data_parallel_specs_and_batch_placement(mesh_2x4):
    dp = DataParallelStrategy("data", 0)
    assert dp.get_partition_spec(("batch", "seq", "embed")) == P("data", None, None)
    assert dp.get_partition_spec(("embed", "mlp")) == P(None, None)
    batch = np.arange(48.0).reshape(6, 8)
    placed = dp.apply_sharding(batch, mesh_2x4)
    assert _spec_of(placed) == P("data")
    np.testing.assert_array_equal(placed, batch)
    resolution = dp.resolve((1024, 1024), mesh_2x4)
    assert resolution.spec == P(None, None)
    assert [(r.kind, str(r)) for r in resolution.reasons] == [
        ("by_design", "DataParallelStrategy: data parallelism replicates parameters")
    ]


def test_fsdp_shards_large_first_dimensions_only(mesh_2x4):
    fsdp = FSDPStrategy("model", 1, min_weight_size=16)
    assert fsdp.should_shard_weight(np.zeros((16, 3)))
    assert not fsdp.should_shard_weight(np.zeros((15, 300)))
    assert not fsdp.should_shard_weight(np.zeros(()))
    assert fsdp.get_partition_spec(("embed", "mlp")) == P("model", None)
    assert fsdp.get_partition_spec(("batch", "embed")) == P("model", None)
    assert fsdp.get_partition_spec(("seq", "batch")) == P(None, "model")
    assert fsdp.get_gradient_partition_spec(("embed", "mlp")) == P("model", None)
    w = np.arange(32 * 3.0).reshape(32, 3)
    placed = fsdp.apply_sharding(w, mesh_2x4)
    assert _spec_of(placed) == P("model", None)
    assert placed.addressable_shards[0].data.shape == (8, 3)
    np.testing.assert_array_equal(placed, w)
    small = fsdp.apply_sharding(np.ones((8, 3)), mesh_2x4)
    assert _spec_of(small) == P(None, None)


def test_fsdp_replicates_an_indivisible_weight_with_a_warning(mesh_2x4):
    fsdp = FSDPStrategy("model", 1, min_weight_size=4)
    with pytest.warns(
        ShardingWarning, match=r"18 is not divisible by mesh axes \('model',\) of size 4"
    ):
        placed = fsdp.apply_sharding(np.ones((18, 2)), mesh_2x4)
    assert _spec_of(placed) == P(None, None)
    resolution = fsdp.resolve((2, 2), mesh_2x4)
    assert resolution.spec == P(None, None)
    assert resolution.of_kind("below_threshold")[0].detail.endswith("below min_weight_size 4")


@pytest.mark.parametrize(
    ("shard_dimension", "linear", "bias"),
    [
        (None, P(None, "model"), P("model")),
        ("out_features", P(None, "model"), P("model")),
        ("in_features", P("model", None), P(None)),
    ],
)
def test_tensor_parallel_linear_layouts(mesh_2x4, shard_dimension, linear, bias):
    tp = TensorParallelStrategy("model", 1, shard_dimension)
    assert tp.get_linear_weight_spec() == linear
    assert tp.resolve((8, 16), mesh_2x4).spec == linear
    assert tp.resolve((16,), mesh_2x4).spec == bias
    placed = tp.apply_sharding(np.arange(128.0).reshape(8, 16), mesh_2x4)
    assert _spec_of(placed) == linear
    np.testing.assert_array_equal(placed, np.arange(128.0).reshape(8, 16))


def test_tensor_parallel_attention_layouts(mesh_2x4):
    tp = TensorParallelStrategy("model", 1)
    assert tp.get_attention_qkv_spec() == P(None, "model", None)
    assert tp.get_attention_output_spec() == P("model", None, None)
    assert tp.get_partition_spec(("in_features", "heads", "head_dim")) == P(None, "model", None)
    assert tp.resolve((32, 4, 8), mesh_2x4, name="attn/query/kernel").spec == P(None, "model", None)
    assert tp.resolve((4, 8, 32), mesh_2x4, name="attn/out/kernel").spec == P("model", None, None)
    assert tp.resolve((4, 8), mesh_2x4, name="attn/key/bias").spec == P("model", None)


def test_pipeline_stage_assignment_and_patterns(mesh_2x4):
    pp = PipelineParallelStrategy("model", 1, num_stages=4)
    assert pp.assign_layers_to_stages(10) == [3, 3, 2, 2]
    assert pp.assign_layers_to_stages(4) == [1, 1, 1, 1]
    assert pp.get_forward_communication_pattern() == [(0, 1), (1, 2), (2, 3)]
    assert pp.get_backward_communication_pattern() == [(3, 2), (2, 1), (1, 0)]
    assert pp.get_partition_spec(("embed", "mlp")) == P(None, None)
    assert _spec_of(pp.apply_sharding(np.ones((4, 4)), mesh_2x4)) == P()
    assert PipelineParallelStrategy("p", 0, 1).get_forward_communication_pattern() == []


@pytest.mark.parametrize("stages", [1, 2, 3, 5, 8])
def test_pipeline_assignment_is_balanced(stages):
    pp = PipelineParallelStrategy("pipe", 0, stages)
    for layers in range(stages, 40):
        counts = pp.assign_layers_to_stages(layers)
        assert sum(counts) == layers and max(counts) - min(counts) <= 1


def _fsdp_tp(min_weight_size=4):
    config = ParallelismConfig((2, 4), ("data", "model"), ShardingConfig(2, 4, fsdp_enabled=True))
    strategies = {
        "fsdp": FSDPStrategy("data", 0, min_weight_size),
        "tensor": TensorParallelStrategy("model", 1),
        "data": DataParallelStrategy("data", 0),
    }
    return MultiDimensionalStrategy(strategies, config)


def test_multi_dimensional_combines_axes():
    multi = _fsdp_tp()
    assert multi.get_combined_partition_spec("w", ("in_features", "out_features")) == P(
        "data", "model"
    )
    assert multi.get_combined_partition_spec("x", ("batch", "out_features")) == P("data", "model")


def test_resolve_sharding_conflicts_is_first_wins_and_never_repeats_an_axis():
    multi = _fsdp_tp()
    merged = multi.resolve_sharding_conflicts(
        "w", {"a": P("data", None), "b": P("model", "data"), "c": P(None, None, "model")}
    )
    assert merged == P(("data", "model"), None, None)
    assert multi.resolve_sharding_conflicts("w", {}) == P()
    reordered = multi.resolve_sharding_conflicts("w", {"b": P("model", "data"), "a": P("data")})
    assert reordered == P("model", "data")


def test_multi_dimensional_spec_for_shape_checks_the_combined_product(mesh_2x4):
    multi = MultiDimensionalStrategy(
        {
            "fsdp": FSDPStrategy("data", 0, 1),
            "tp": TensorParallelStrategy("model", 1, "in_features"),
        },
        ParallelismConfig((2, 4), ("data", "model"), ShardingConfig(2, 4)),
    )
    assert multi.resolve((16, 3), mesh_2x4).spec == P(("data", "model"), None)
    resolution = multi.resolve((4, 3), mesh_2x4)
    assert resolution.spec == P("data", None)
    assert [(r.kind, r.dim, r.axes) for r in resolution.reasons] == [("indivisible", 0, ("model",))]


def test_multi_dimensional_places_arrays_that_match_the_originals(mesh_2x4):
    multi = _fsdp_tp()
    w = np.arange(64.0).reshape(8, 8)
    spec = multi.resolve(w.shape, mesh_2x4).spec
    placed = jax.device_put(w, jax.sharding.NamedSharding(mesh_2x4, spec))
    assert placed.addressable_shards[0].data.shape == (4, 2)
    np.testing.assert_array_equal(placed, w)


def test_strategy_on_a_three_axis_config_mesh():
    config = ParallelismConfig.from_sharding_config(ShardingConfig(2, 2, 2))
    mesh = DeviceMeshManager.create_device_mesh(config.axis_sizes)
    multi = MultiDimensionalStrategy(
        {"tp": TensorParallelStrategy("model", 2), "pp": PipelineParallelStrategy("pipe", 0, 2)},
        config,
    )
    assert multi.resolve((4, 4), mesh).spec == P(None, "model")


def test_strategies_compare_by_value():
    assert FSDPStrategy("data", 0) == FSDPStrategy("data", 0)
    assert len({FSDPStrategy("data", 0), FSDPStrategy("data", 0)}) == 1
    # a setting the repr does not show still makes them differ
    narrow = FSDPStrategy("data", 0, min_weight_size=8)
    assert repr(narrow) == repr(FSDPStrategy("data", 0)) and narrow != FSDPStrategy("data", 0)
    assert TensorParallelStrategy("model", 1) != FSDPStrategy("model", 1)
    assert TensorParallelStrategy("model", 1, "in_features") != TensorParallelStrategy("model", 1)


def test_min_weight_size_means_the_first_dimension_everywhere():
    """One meaning: ShardingConfig, FSDPStrategy (either mode) and Layout count the first
    dimension as min_weight_size, and elements only as min_elements."""
    wide = jax.ShapeDtypeStruct((4, 4096), np.float32)  # small first dimension, many elements
    for shard in ("first", "largest"):
        strategy = FSDPStrategy("data", 0, 8, shard=shard)
        assert not strategy.should_shard_weight(wide), shard
        assert (
            FSDPStrategy("data", 0, 0, shard=shard, min_elements=16385).should_shard_weight(wide)
            is False
        )
        assert FSDPStrategy("data", 0, 0, shard=shard, min_elements=16384).should_shard_weight(wide)
    layout = Layout.from_config(
        ParallelismConfig((8,), ("data",), ShardingConfig(8, fsdp_enabled=True,
                                                          fsdp_min_weight_size=8))
    )  # fmt: skip
    assert layout.fsdp_min_weight_size == 8 and layout.sharding_config().fsdp_min_weight_size == 8
    mesh = layout.make_mesh()
    assert layout.strategy().resolve(wide.shape, mesh).spec == P(None, None)  # first dim 4 < 8
    layout = Layout.named("fsdp", {"data": 8})  # a named layout counts elements only
    assert (layout.fsdp_min_weight_size, layout.fsdp_min_elements) == (0, 256)
    assert layout.strategy().resolve(wide.shape, mesh).spec == P(None, "data")
    with pytest.raises(ValueError, match="min_elements must be a non-negative integer, got -1"):
        FSDPStrategy("data", 0, min_elements=-1)
