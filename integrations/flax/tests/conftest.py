"""Fakes 8 CPU devices before anything touches a JAX backend."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)
