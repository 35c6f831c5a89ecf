"""Fakes 8 CPU devices before anything touches a JAX backend (see jax_setup.py)."""

import jax_setup  # noqa: F401
import pytest

from substrax.mesh import DeviceMeshManager


@pytest.fixture
def mesh_2x4():
    return DeviceMeshManager.create_device_mesh({"data": 2, "model": 4})
