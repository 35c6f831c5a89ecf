import jax
import numpy as np
import pytest
from jax.sharding import AxisType

from substrax.mesh import DeviceMeshManager


def test_dict_and_pairs_give_the_same_mesh():
    a = DeviceMeshManager.create_device_mesh({"data": 2, "model": 4})
    b = DeviceMeshManager.create_device_mesh([("data", 2), ("model", 4)])
    assert a.axis_names == b.axis_names == ("data", "model")
    assert dict(a.shape) == dict(b.shape) == {"data": 2, "model": 4}
    assert np.array_equal(
        np.vectorize(lambda d: d.id)(a.devices), np.vectorize(lambda d: d.id)(b.devices)
    )


def test_axes_are_auto_by_default_even_though_make_mesh_defaults_to_explicit():
    mesh = DeviceMeshManager.create_device_mesh({"data": 8})
    assert mesh.axis_types == (AxisType.Auto,)


def test_axis_types_are_honoured():
    types = (AxisType.Explicit, AxisType.Auto)
    mesh = DeviceMeshManager.create_device_mesh({"a": 2, "b": 4}, axis_types=types)
    assert mesh.axis_types == types


def test_minus_one_takes_the_remaining_devices():
    mesh = DeviceMeshManager.create_device_mesh({"data": -1, "model": 2})
    assert dict(mesh.shape) == {"data": 4, "model": 2}


def test_devices_argument_selects_a_subset():
    devices = jax.devices()[4:]
    mesh = DeviceMeshManager.create_device_mesh({"x": 2, "y": 2}, devices)
    assert {d.id for d in mesh.devices.flat} == {d.id for d in devices}


def test_data_model_and_hybrid_meshes():
    assert dict(DeviceMeshManager.create_data_parallel_mesh().shape) == {"data": 8}
    assert dict(DeviceMeshManager.create_data_parallel_mesh(4).shape) == {"data": 4}
    assert dict(DeviceMeshManager.create_model_parallel_mesh(2).shape) == {"model": 2}
    hybrid = DeviceMeshManager.create_hybrid_mesh(2, 2)
    assert dict(hybrid.shape) == {"data": 2, "model": 2}
    assert hybrid.axis_types == (AxisType.Auto, AxisType.Auto)
    assert hybrid.devices.size == 4


def test_get_mesh_info():
    mesh = DeviceMeshManager.create_device_mesh({"data": 2, "model": 4})
    info = DeviceMeshManager.get_mesh_info(mesh)
    assert info == {
        "num_devices": 8,
        "num_axes": 2,
        "axis_sizes": {"data": 2, "model": 4},
        "num_processes": 1,
        "process_index": 0,
        "num_local_devices": 8,
    }
    assert list(info["axis_sizes"]) == ["data", "model"]


def test_a_mesh_shards_an_array():
    mesh = DeviceMeshManager.create_device_mesh({"data": 2, "model": 4})
    x = jax.device_put(
        np.arange(32.0).reshape(4, 8),
        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", "model")),
    )
    assert x.addressable_shards[0].data.shape == (2, 2)


def test_multihost_mesh_in_one_process():
    mesh = DeviceMeshManager.create_multihost_mesh({"data": 1}, {"data": 2, "model": -1})
    assert dict(mesh.shape) == {"data": 2, "model": 4}
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    with pytest.raises(ValueError, match=r"intra_host \{'model': 4\} multiplies to 4, but there"):
        DeviceMeshManager.create_multihost_mesh({"data": 1}, {"model": 4})
    with pytest.raises(ValueError, match=r"inter_host \{'data': 2\} multiplies to 2"):
        DeviceMeshManager.create_multihost_mesh({"data": 2}, {"model": 8})


ONE_CPU = r"""
import jax
from substrax.layout import Layout
from substrax.mesh import DeviceMeshManager
for make in (lambda: DeviceMeshManager.create_device_mesh({"data": 8}),
             lambda: Layout.named("fsdp", {"data": 8}).make_mesh()):
    try:
        make()
    except ValueError as error:
        print(error)
"""


def test_too_few_cpu_devices_says_how_to_simulate_them():
    import os
    import subprocess
    import sys

    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    out = subprocess.run([sys.executable, "-c", ONE_CPU], capture_output=True, text=True,
                         env=env, timeout=120)  # fmt: skip
    lines = out.stdout.splitlines()
    assert len(lines) == 2, out.stderr[-2000:]
    assert all('jax.config.update("jax_num_cpu_devices", 8)' in line for line in lines), lines
    assert "devices=jax.devices()[:8]" not in lines[0]  # a slice of one device cannot help
