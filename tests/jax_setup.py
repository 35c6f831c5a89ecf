"""What every test process sets before anything touches a JAX backend (imported by conftests).

Eight fake CPU devices, and a compilation cache private to this run: tests that build the same
program (the same model and layout in another test) load it instead of compiling it again. The
cache starts empty, so no result depends on an earlier run.
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
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
