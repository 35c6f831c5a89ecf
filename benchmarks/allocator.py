"""How the host's allocator treats XLA:CPU's buffers, for the step benchmarks.

XLA:CPU allocates each call's temporary buffer with ``malloc`` and frees it when the call
ends. With glibc's default settings a buffer of a few tens of MB is handed back to the
system when freed, so the next call takes a page fault on each of its pages again: on 8
simulated devices that is tens of thousands of faults per step, more for a donated step,
whose temporary buffer cannot borrow the outputs' (docs/benchmarks.md). Accelerator runtimes
keep freed device memory in their own pools, so :func:`keep_freed_memory` tells glibc to keep
it too, and :func:`minor_faults` counts what a step pays.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

import jax

#: glibc's ``mallopt`` parameters (malloc.h).
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4

#: What :func:`keep_freed_memory` sets: no allocation served by its own mapping (those are
#: unmapped when freed, whatever their size; a threshold cannot exceed 32 MiB, and FSDP 4 x
#: DP 2's temporaries do), freed memory kept up to 1 GiB, and 64 MiB more taken per extension.
KEPT = {M_MMAP_MAX: 0, M_TRIM_THRESHOLD: 1 << 30, M_TOP_PAD: 64 << 20}


#: ``--allocator``'s choices: glibc's defaults, or freed memory kept (:func:`use`).
CHOICES = ("glibc", "kept")


def minor_faults() -> int:
    """This process's minor page faults so far (``getrusage``'s ``ru_minflt``)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float, int]:
    """``fn(*args)``, blocked on: its result, wall seconds and the minor page faults it took."""
    faults, start = minor_faults(), time.perf_counter()
    result = jax.block_until_ready(fn(*args))
    return result, time.perf_counter() - start, minor_faults() - faults


def use(choice: str) -> None:
    """Sets up ``--allocator``'s ``choice`` for this process: ``"kept"`` keeps freed memory.

    Raises:
      ValueError: If ``choice`` is not one of :data:`CHOICES`.
    """
    if choice not in CHOICES:
        raise ValueError(f"Unknown allocator {choice!r}; choose one of {', '.join(CHOICES)}")
    if choice == "kept":
        keep_freed_memory()


def _mallopt():
    name = ctypes.util.find_library("c")
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None) if name else None
    if not sys.platform.startswith("linux") or mallopt is None:
        raise RuntimeError(
            f"keep_freed_memory needs glibc's mallopt; this is {sys.platform!r} with C "
            f"library {name!r}. Run without it (the figures then include the page faults)."
        )
    return mallopt


def keep_freed_memory() -> None:
    """From now on, glibc keeps freed memory for the next allocation, as accelerator pools do.

    It is for a benchmark's own process and cannot be undone: setting any of these turns
    off glibc's mmap threshold that adapts to the sizes freed, so setting the documented
    defaults back would not restore how the process allocated before.

    Raises:
      RuntimeError: Where the C library is not glibc (no ``mallopt``), or it refuses a value.
    """
    mallopt = _mallopt()
    for param, value in KEPT.items():
        if mallopt(param, value) != 1:
            name = {M_TRIM_THRESHOLD: "M_TRIM_THRESHOLD", M_TOP_PAD: "M_TOP_PAD"}.get(
                param, "M_MMAP_MAX"
            )
            raise RuntimeError(f"glibc's mallopt refused {name} = {value}")
