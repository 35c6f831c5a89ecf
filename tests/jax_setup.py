"""What every test process sets before anything touches a JAX backend (imported by conftests).

Eight fake CPU devices, and a compilation cache private to this run, shared with the processes
the tests start: tests that build the same program (the same model and layout in another test,
the example run again with other flags) load it instead of compiling it again. The cache starts
empty, so no result depends on an earlier run.
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)
_CACHE = tempfile.mkdtemp(prefix="substrax-test-jax-cache-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
# In the environment too, so the examples and workers the tests start share it.
os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
