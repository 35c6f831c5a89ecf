"""What every test process sets before anything touches a JAX backend (imported by conftests).

Eight fake CPU devices, and a compilation cache private to this run, shared by its xdist workers
and the processes the tests start: tests that build the same program (the same model and layout
in another test, the example run again with other flags) load it instead of compiling it again.
The cache starts empty, so no result depends on an earlier run.

XLA:CPU's LLVM backend compiles at optimisation level 0: the tests' programs are small and compile
far longer than they run, so this cuts the suite's time by about a third. It changes only the
machine code LLVM emits, not the HLO passes, so collectives, buffer assignment and compiled memory
(which tests assert) are those of the default level. Benchmarks never import this module.
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if _FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()

import jax  # noqa: E402 (XLA_FLAGS first)

jax.config.update("jax_num_cpu_devices", 8)
# The first process of a run (pytest, or xdist's controller) makes the cache and removes it at
# exit; the workers, examples and launched processes it starts inherit it through the environment.
_CACHE = os.environ.get("SUBSTRAX_TEST_JAX_CACHE")
if _CACHE is None:
    _CACHE = tempfile.mkdtemp(prefix="substrax-test-jax-cache-")
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
    os.environ["SUBSTRAX_TEST_JAX_CACHE"] = _CACHE
os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
