import math

import jax
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding

from substrax.mesh import DeviceMeshManager, MeshRules, ShardingConfig, partition_spec_for_names

LOGICAL = ("data", "embed", "mlp", "heads", "vocab", "kv")


def _factorisations(n, max_axes=3):
    if max_axes == 1:
        return [(n,)]
    out = [(n,)]
    for d in range(2, n + 1):
        if n % d == 0:
            out += [(d, *rest) for rest in _factorisations(n // d, max_axes - 1)]
    return out


@st.composite
def mesh_rules_and_names(draw):
    num_devices = draw(st.sampled_from([1, 2, 4, 8]))
    sizes = draw(st.sampled_from(_factorisations(num_devices)))
    axis_names = tuple(f"ax{i}" for i in range(len(sizes)))
    choice = st.one_of(
        st.none(),
        st.sampled_from(axis_names),
        st.lists(st.sampled_from(axis_names), min_size=1, max_size=2, unique=True).map(tuple),
    )
    table = {name: draw(choice) for name in LOGICAL}
    rules = MeshRules.from_pairs(table.items())
    rank = draw(st.integers(0, 4))
    names = draw(
        st.lists(
            st.one_of(st.none(), st.sampled_from(LOGICAL)), min_size=rank, max_size=rank
        ).filter(lambda ns: len([n for n in ns if n]) == len({n for n in ns if n}))
    )
    return num_devices, dict(zip(axis_names, sizes, strict=True)), rules, names


@settings(max_examples=60, deadline=None)
@given(mesh_rules_and_names(), st.integers(1, 3))
def test_specs_always_build_a_sharding_and_place_an_array(case, multiple):
    num_devices, shape, rules, names = case
    mesh = DeviceMeshManager.create_device_mesh(shape, jax.devices()[:num_devices])
    spec = partition_spec_for_names(rules.validate(mesh), *names)
    used = [a for entry in spec if entry for a in ((entry,) if isinstance(entry, str) else entry)]
    assert len(used) == len(set(used))
    sharding = NamedSharding(mesh, spec)
    dims = []
    for entry in spec:
        axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
        dims.append(multiple * math.prod(shape[a] for a in axes))
    array = np.arange(math.prod(dims), dtype=np.float32).reshape(dims)
    placed = jax.device_put(array, sharding)
    np.testing.assert_array_equal(np.asarray(placed), array)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 1_000_000))
def test_from_device_count_multiplies_back(count):
    assert ShardingConfig.from_device_count(count).get_total_device_count() == count
