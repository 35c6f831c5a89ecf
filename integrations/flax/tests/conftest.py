"""Fakes 8 CPU devices before anything touches a JAX backend (see tests/jax_setup.py)."""

import jax_setup  # noqa: F401
