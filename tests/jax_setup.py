"""What every test process sets before anything touches a JAX backend (imported by conftests).

Eight fake CPU devices, and a compilation cache private to this run, shared by its xdist workers
and the processes the tests start: tests that build the same program (the same model and layout
in another test, the example run again with other flags) load it instead of compiling it again.
The cache starts empty, so no result depends on an earlier run.

XLA:CPU compiles fast: its LLVM backend at optimisation level 0, its fusions through the
legacy elemental emitter rather than the MLIR fusion emitters, and each program's code generated
as one LLVM module rather than split into parts for parallel threads (two workers already keep
both cores busy). The tests' programs are small and compile far longer than they run: level 0
cut the suite's time by about a third, the emitter another 27% (17:18 to 12:32 on 2 cores), one
module about 9% of six step-heavy test files' CPU time (190-212 user-s against 211-225, four
runs each). None changes the collectives or their bytes. The
emitter moves a few fusion boundaries: on the benchmark decoder's steps (FSDP 8, TP 4 x DP 2,
FSDP 4 x DP 2, tiny size) temp bytes differ by at most 0.03% and FLOPs by 0.05% from the default
compiler's, and float rounding differs (test_train's stacked adam test says where it shows).
Benchmarks never import this module: their figures are the default compiler's.

The cache's entries are written atomically (:func:`_atomic_put`): jax writes an entry in place,
so the other worker, compiling the same program at the same moment, could read it half written
(both collect the test modules at once, and a module that draws a batch at import compiles the
same program in both: a fresh-clone run failed so, "Error reading persistent compilation cache
entry for 'jit__randint': ZstdError").

Each operation's location in the lowered program names no Python call stack
(``jax_traceback_in_locations_limit`` 0; jax keeps up to 100 frames by default). The frames
are metadata that XLA carries through every pass: without them test_eval.py's backend
compiles took 8-13% less time (31.7-34.6 s against 36.3-37.5, 203 compiles, two runs each,
alternating), test_pipeline_step.py's 10% less (62.1 s against 68.9) and the files 4-9% less
wall time. Op names (the named scopes tests look for) stay; a test that reads source lines
lowers under :func:`source_locations`.

Python's cyclic garbage collector runs less often (:data:`GC_THRESHOLD`): tracing and lowering
allocate millions of short-lived containers, and at the default thresholds a test process
spent about 7% of its CPU time in collections (3.9 s of 52 s over test_streams.py and
test_flow.py, timed with ``gc.callbacks``), 1.5 s at these thresholds, for 22% more resident
memory (1.04 GB against 0.85).
"""

import atexit
import contextlib
import gc
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_FAST_COMPILE = (
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
    "--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
)
if _FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()
# no Python call stack in each op's location (jax keeps JAX_TRACEBACK_LIMIT frames): see above
os.environ["JAX_TRACEBACK_IN_LOCATIONS_LIMIT"] = "0"

import jax  # noqa: E402 (XLA_FLAGS first)
from jax._src import lru_cache  # noqa: E402

#: ``gc.set_threshold``'s: a young collection every 20,000 net allocations (Python's default 700).
GC_THRESHOLD = (20_000, 20, 100)
gc.set_threshold(*GC_THRESHOLD)

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_traceback_in_locations_limit", 0)  # also where jax was imported first
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

_in_place_put = lru_cache.LRUCache.put


def _atomic_put(self, key: str, value: bytes) -> None:
    """``LRUCache.put``, writing the entry to a file of its own and renaming it into place."""
    if self.eviction_enabled or not key:  # jax's own, locked path (and its error)
        return _in_place_put(self, key, value)
    final = self.path / f"{key}{lru_cache._CACHE_SUFFIX}"
    if final.exists():
        return None
    partial = self.path / f".{key}.{os.getpid()}.partial"
    partial.write_bytes(value)
    os.replace(partial, final)  # a reader sees no entry or the whole of it
    return None


lru_cache.LRUCache.put = _atomic_put

#: jax 0.10.2's default ``jax_traceback_in_locations_limit``: the frames each op's location keeps.
JAX_TRACEBACK_LIMIT = 100


@contextlib.contextmanager
def source_locations():
    """Lowers with jax's default source locations, for a test that reads them."""
    previous = jax.config.jax_traceback_in_locations_limit
    jax.config.update("jax_traceback_in_locations_limit", JAX_TRACEBACK_LIMIT)
    try:
        yield
    finally:
        jax.config.update("jax_traceback_in_locations_limit", previous)
