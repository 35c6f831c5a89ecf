"""A catalogue of bad inputs: each raises the listed exception with a message that helps."""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

from substrax.mesh import (
    DataParallelStrategy,
    DeviceMeshManager,
    FSDPStrategy,
    MeshRules,
    MultiDimensionalStrategy,
    ParallelismConfig,
    PipelineParallelStrategy,
    ShardingConfig,
    TensorParallelStrategy,
    create_named_sharding,
    fsdp_rules,
    partition_spec_for_names,
)
from substrax.spmd import check_batch

create = DeviceMeshManager.create_device_mesh


def _mesh():
    return create({"data": 2, "model": 4})


SC = ShardingConfig(2, 4)

CASES = [
    (
        "device ids",
        lambda: create({"data": 8}, devices=list(range(8))),
        TypeError,
        "devices[0] is 0 (int), not a jax device",
    ),
    (
        "duplicate devices",
        lambda: create({"data": 8}, devices=[jax.devices()[0]] * 8),
        ValueError,
        "twice (at 0 and 1); each device may appear once",
    ),
    (
        "mesh as a dict",
        lambda: create_named_sharding({"data": 8}, "data"),
        TypeError,
        "mesh must be a jax.sharding.Mesh, got dict. Build one with",
    ),
    (
        "rule pair with an int name",
        lambda: MeshRules.from_pairs([(3, "model")]),
        ValueError,
        "logical name must be a non-empty string, got 3 in (3, 'model')",
    ),
    (
        "an int as a logical name",
        lambda: partition_spec_for_names(MeshRules(data="data"), 5),
        TypeError,
        "logical names must be strings or None (or tuples of strings), got 5 (int) for dim 0",
    ),
    (
        "config names fewer than sizes",
        lambda: ParallelismConfig((2, 4), ("data",), SC),
        ValueError,
        "mesh_shape (2, 4) has 2 axes but mesh_axis_names ('data',) names 1",
    ),
    (
        "config shape as a string",
        lambda: ParallelismConfig("24", ("data", "model"), SC),
        ValueError,
        "mesh_shape must be a tuple of axis sizes such as (2, 4), got str '24'",
    ),
    (
        "config shape None",
        lambda: ParallelismConfig(None, ("data",), SC),
        ValueError,
        "got NoneType None",
    ),
    (
        "multi config disagrees with the mesh",
        lambda: MultiDimensionalStrategy(
            {"dp": DataParallelStrategy("data", 0)},
            ParallelismConfig((2, 4), ("data", "model"), SC),
        ).resolve((8, 8), create({"data": 4, "model": 2})),
        ValueError,
        "The mesh {'data': 4, 'model': 2} is not the mesh of this strategy's config",
    ),
    ("batch is a string", lambda: check_batch("hello"), TypeError, "The batch is a str"),
    (
        "batch as rows",
        lambda: check_batch([[1.0, 2.0]] * 8),
        TypeError,
        "Batch leaf [0][0] is a float (1.0), not an array",
    ),
    (
        "batch leaves of different sizes",
        lambda: check_batch({"x": np.ones((8, 2)), "y": np.ones(16)}),
        ValueError,
        """different leading sizes {"['x']": 8, "['y']": 16}""",
    ),
    ("batch of 0 rows", lambda: check_batch(np.ones((0, 4))), ValueError, "0 rows"),
    ("product != devices", lambda: create({"data": 3}), ValueError, "needs 3 devices, but 8"),
    ("product > devices", lambda: create({"a": 4, "b": 4}), ValueError, "needs 16 devices"),
    ("zero size", lambda: create({"data": 0}), ValueError, "'data' has size 0"),
    ("negative size", lambda: create({"data": -2}), ValueError, "has size -2"),
    ("float size", lambda: create({"data": 8.0}), ValueError, "has size 8.0"),
    ("bool size", lambda: create({"data": True}), ValueError, "has size True"),
    ("duplicate names", lambda: create([("d", 2), ("d", 4)]), ValueError, "unique, got ['d']"),
    ("empty name", lambda: create({"": 8}), ValueError, "non-empty strings, got ''"),
    ("non-str name", lambda: create([(1, 8)]), ValueError, "non-empty strings, got 1"),
    ("two -1", lambda: create({"a": -1, "b": -1}), ValueError, "At most one mesh axis"),
    ("-1 indivisible", lambda: create({"a": -1, "b": 3}), ValueError, "multiply to 3"),
    ("empty shape", lambda: create({}), ValueError, "mesh_shape is empty"),
    ("bad entry", lambda: create([("data",)]), ValueError, "(name, size) pairs"),
    ("not a shape", lambda: create(8), ValueError, "dict {name: size}"),
    (
        "axis_types length",
        lambda: create({"a": 8}, axis_types=(AxisType.Auto, AxisType.Auto)),
        ValueError,
        "one type per axis: got 2",
    ),
    ("axis_types value", lambda: create({"a": 8}, axis_types=("auto",)), ValueError, "AxisType"),
    ("no devices", lambda: create({"a": 1}, devices=[]), ValueError, "devices is empty"),
    (
        "dp mesh too big",
        lambda: DeviceMeshManager.create_data_parallel_mesh(16),
        ValueError,
        "more devices than the 8 available",
    ),
    (
        "mp mesh too big",
        lambda: DeviceMeshManager.create_model_parallel_mesh(9),
        ValueError,
        "num_devices=9 asks for more devices",
    ),
    (
        "mp mesh zero",
        lambda: DeviceMeshManager.create_model_parallel_mesh(0),
        ValueError,
        "positive integer, got 0",
    ),
    (
        "hybrid too big",
        lambda: DeviceMeshManager.create_hybrid_mesh(4, 4),
        ValueError,
        "total devices=16 asks for more",
    ),
    ("hybrid -1", lambda: DeviceMeshManager.create_hybrid_mesh(-1, 4), ValueError, "explicit"),
    ("mesh info", lambda: DeviceMeshManager.get_mesh_info("mesh"), TypeError, "got str"),
    (
        "rule axis absent from mesh",
        lambda: MeshRules(embed="tensor").validate(_mesh()),
        ValueError,
        "names mesh axis 'tensor', which the mesh does not have. Mesh axes: ('data', 'model')",
    ),
    (
        "unknown logical name",
        lambda: partition_spec_for_names(fsdp_rules(), "vocab", "embed"),
        ValueError,
        "Unknown logical axis name 'vocab'. Known names: ['data', 'embed', 'mlp', 'heads']",
    ),
    (
        "repeated logical name",
        lambda: partition_spec_for_names(fsdp_rules(), "embed", "embed"),
        ValueError,
        "'embed' appears more than once",
    ),
    ("bad rule value", lambda: MeshRules(embed=3), ValueError, "'embed' must be a mesh axis name"),
    ("empty rule tuple", lambda: MeshRules(embed=()), ValueError, "got ()"),
    ("repeated rule axes", lambda: MeshRules(embed=("a", "a")), ValueError, "distinct"),
    ("extra shadows field", lambda: MeshRules(extra={"embed": "x"}), ValueError, "given twice"),
    (
        "repeated flax pair",
        lambda: MeshRules.from_pairs([("vocab", "model"), ("vocab", None)]),
        ValueError,
        "'vocab' appears twice in the rule pairs ('model' and None)",
    ),
    ("bad flax pair", lambda: MeshRules.from_pairs([("vocab",)]), ValueError, "(logical_name"),
    (
        "not rules",
        lambda: partition_spec_for_names({"embed": "model"}, "embed"),
        TypeError,
        "must be a MeshRules, got dict",
    ),
    (
        "named sharding unknown axis",
        lambda: create_named_sharding(_mesh(), "data", "tensor"),
        ValueError,
        "'tensor' is not in the mesh; its axes are ('data', 'model')",
    ),
    (
        "named sharding axis twice",
        lambda: create_named_sharding(_mesh(), "data", "data"),
        ValueError,
        "'data' is used twice",
    ),
    ("fsdp_rules axis", lambda: fsdp_rules(model_axis=""), ValueError, "model_axis must be"),
    (
        "batch does not divide data axis",
        lambda: DataParallelStrategy("data", 0).apply_sharding(np.ones((3, 2)), _mesh()),
        ValueError,
        "Batch dimension of size 3 (shape (3, 2)) does not divide mesh axis 'data' of size 2",
    ),
    (
        "strategy axis absent",
        lambda: FSDPStrategy("fsdp", 0).apply_sharding(np.ones((4, 4)), _mesh()),
        ValueError,
        "Mesh axis 'fsdp' is not in the mesh",
    ),
    (
        "strategy axis index mismatch",
        lambda: FSDPStrategy("model", 0).apply_sharding(np.ones((4, 4)), _mesh()),
        ValueError,
        "expects 'model' at mesh axis 0, but the mesh has it at 1",
    ),
    ("empty axis name", lambda: FSDPStrategy("", 0), ValueError, "non-empty mesh axis name"),
    ("negative mesh axis", lambda: FSDPStrategy("d", -1), ValueError, "got -1"),
    ("fsdp min size", lambda: FSDPStrategy("d", 0, -5), ValueError, "min_weight_size"),
    (
        "tp shard dimension",
        lambda: TensorParallelStrategy("model", 1, "rows"),
        ValueError,
        "shard_dimension must be one of ('in_features', 'out_features') or None, got 'rows'",
    ),
    ("pp stages", lambda: PipelineParallelStrategy("p", 0, 0), ValueError, "num_stages"),
    (
        "fewer layers than stages",
        lambda: PipelineParallelStrategy("p", 0, 4).assign_layers_to_stages(3),
        ValueError,
        "Cannot assign 3 layers to 4 pipeline stages",
    ),
    (
        "pipeline stages != mesh axis",
        lambda: PipelineParallelStrategy("model", 1, 2).apply_sharding(np.ones(2), _mesh()),
        ValueError,
        "has size 4, but the strategy has 2 stages",
    ),
    ("config zero size", lambda: ShardingConfig(data_parallel_size=0), ValueError, "got 0"),
    ("config float", lambda: ShardingConfig(tensor_parallel_size=2.5), ValueError, "got 2.5"),
    ("config fsdp flag", lambda: ShardingConfig(fsdp_enabled="yes"), ValueError, "bool"),
    (
        "from_device_count zero",
        lambda: ShardingConfig.from_device_count(0),
        ValueError,
        "device_count must be an integer >= 1, got 0",
    ),
    (
        "multi axis absent from config",
        lambda: MultiDimensionalStrategy(
            {"tp": TensorParallelStrategy("tensor", 1)},
            ParallelismConfig((2, 4), ("data", "model"), ShardingConfig(2, 4)),
        ),
        ValueError,
        "uses mesh axis 'tensor', which the config's mesh does not have",
    ),
    (
        "multi empty",
        lambda: MultiDimensionalStrategy({}, ParallelismConfig((8,), ("data",), ShardingConfig(8))),
        ValueError,
        "non-empty mapping",
    ),
    (
        "multi bad proposal",
        lambda: MultiDimensionalStrategy(
            {"dp": DataParallelStrategy("data", 0)},
            ParallelismConfig((8,), ("data",), ShardingConfig(8)),
        ).resolve_sharding_conflicts("w", {"dp": ("data",)}),
        ValueError,
        "must be a PartitionSpec",
    ),
]


@pytest.mark.parametrize(
    ("call", "exception", "fragment"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_bad_input_raises_a_clear_error(call, exception, fragment):
    with pytest.raises(exception) as info:
        call()
    assert fragment in str(info.value)


def test_catalogue_is_large():
    assert len(CASES) >= 25
    assert jax.device_count() == 8
