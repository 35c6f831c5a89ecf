"""Fakes 8 CPU devices before anything touches a JAX backend."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402

from substrax.mesh import DeviceMeshManager  # noqa: E402


@pytest.fixture
def mesh_2x4():
    return DeviceMeshManager.create_device_mesh({"data": 2, "model": 4})
