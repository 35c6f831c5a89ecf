import math

import pytest

from substrax.mesh import DeviceMeshManager, ParallelismConfig, ShardingConfig


def test_defaults_and_total():
    config = ShardingConfig()
    assert (config.data_parallel_size, config.tensor_parallel_size) == (1, 1)
    assert config.pipeline_parallel_size == 1
    assert config.fsdp_enabled is False and config.fsdp_min_weight_size == 1024
    assert ShardingConfig(2, 4, 3).get_total_device_count() == 24


@pytest.mark.parametrize(
    ("count", "expected"),
    [
        (1, (1, 1)),
        (2, (2, 1)),
        (4, (2, 2)),
        (8, (4, 2)),
        (16, (4, 4)),
        (64, (8, 8)),
        (4096, (512, 8)),
        (7, (7, 1)),
        (12, (4, 3)),
    ],
)
def test_from_device_count_heuristic(count, expected):
    config = ShardingConfig.from_device_count(count)
    assert (config.data_parallel_size, config.tensor_parallel_size) == expected
    assert config.pipeline_parallel_size == 1
    assert config.fsdp_enabled == (expected[0] > 1)


def test_from_device_count_multiplies_back_for_every_count_up_to_4096():
    for count in range(1, 4097):
        assert ShardingConfig.from_device_count(count).get_total_device_count() == count


def test_parallelism_config_from_sharding_config_builds_a_mesh():
    config = ParallelismConfig.from_sharding_config(ShardingConfig(2, 2, 2, fsdp_enabled=True))
    assert config.mesh_axis_names == ("pipe", "data", "model")
    assert config.mesh_shape == (2, 2, 2)
    assert config.is_valid()
    mesh = DeviceMeshManager.create_device_mesh(config.axis_sizes)
    assert dict(mesh.shape) == {"pipe": 2, "data": 2, "model": 2}


@pytest.mark.parametrize(
    ("shape", "names"),
    [
        ((2, 2), ("data", "model")),
        ((4, 2), ("data", "model")),
        ((8, 1), ("data", "data")),
        ((0, 8), ("a", "b")),
        ((8,), ("",)),
    ],
)
def test_is_valid_rejects_mismatches(shape, names):
    assert not ParallelismConfig(shape, names, ShardingConfig(2, 4)).is_valid()


def test_a_config_that_cannot_describe_a_mesh_is_rejected_at_construction():
    # is_valid() judges whether a mesh realises the sharding config; these are not meshes.
    for shape, names in [((2, 4), ("data",)), ("24", ("a", "b")), (None, ("a",)), ((2.0,), ("a",))]:
        with pytest.raises(ValueError, match="mesh_shape"):
            ParallelismConfig(shape, names, ShardingConfig(2, 4))


def test_is_valid_accepts_other_axis_names_with_the_right_product():
    assert ParallelismConfig((8,), ("devices",), ShardingConfig(2, 4)).is_valid()
    assert math.prod(ParallelismConfig((2, 4), ("data", "model"), ShardingConfig(2, 4)).mesh_shape)


def test_a_planned_config_comes_from_the_planners_best_layout():
    from substrax.planner import Hardware, Workload, plan

    work = Workload(batch_tokens=2**20, seq=4096, microbatches=8)
    best = plan("llama3-8b", 64, Hardware(memory_bytes=80 * 10**9), work).best.layout
    config = best.sharding_config()
    assert config.get_total_device_count() == 64
    assert config.fsdp_enabled == (best.fsdp > 1) and config.tensor_parallel_size == best.tp
    assert config.data_parallel_size == best.dp * best.fsdp
    assert config.pipeline_parallel_size == best.pp


def test_the_mesh_layer_does_not_reach_up_to_the_planner():
    import inspect

    assert list(inspect.signature(ShardingConfig.from_device_count).parameters) == ["device_count"]
