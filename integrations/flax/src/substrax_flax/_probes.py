"""Tracing a model without jax's quadratic probe of a tracer's sharding.

In jax 0.10.2, reading ``.sharding`` on a tracer raises ``AttributeError`` (so that
``getattr(x, "sharding", None)`` works), but builds the message first, and the message names
the tracer's origin: ``Tracer._origin_msg`` walks every equation traced so far. Flax NNX
probes it on every ``variable[...] = value`` (``Variable.set_value``), which each
``nnx.Rngs`` draw performs to advance its count: building a model under a trace, or a
forward pass with dropout, then takes time quadratic in the number of draws: the example
decoder with 126 unstacked layers planned in 31.2 s and its train step lowered in 94.7 s,
2.2 s and 43.5 s without the walk (``benchmarks/tracing.py``). Upstream jax drops the origin from
this message (jax-ml/jax#40041).

:func:`cheap_sharding_probes` swaps the message for one without the origin while substrax
traces: on the model's factory, its optimizer and every step. Nothing else differs (the
same ``AttributeError``, which flax catches), and on a jax whose ``Tracer.sharding`` builds no
origin it does nothing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

try:
    from jax._src import core as _core
except ImportError:  # pragma: no cover - a jax without it: nothing to swap
    _core = None

__all__ = ["cheap_sharding_probes"]


def _slow_probe() -> property | None:
    """``Tracer.sharding`` where it walks the trace for its message, else None."""
    probe = getattr(_core, "Tracer", object).__dict__.get("sharding")
    fget = getattr(probe, "fget", None)
    names = getattr(getattr(fget, "__code__", None), "co_names", ())
    return probe if "_origin_msg" in names else None


def _sharding(tracer):
    raise AttributeError(f"The 'sharding' attribute is not available on {tracer._error_repr()}.")


_SLOW = _slow_probe()
_CHEAP = property(_sharding)
_LOCK = threading.Lock()
_depth = 0


@contextlib.contextmanager
def cheap_sharding_probes() -> Iterator[None]:
    """Within the block, a tracer's missing ``.sharding`` is reported without its origin.

    Re-entrant and shared between threads: the cheap probe stays until the last block ends.
    Usable as a decorator.
    """
    global _depth
    if _SLOW is None:
        yield
        return
    with _LOCK:
        _depth += 1
        if _depth == 1:
            _core.Tracer.sharding = _CHEAP
    try:
        yield
    finally:
        with _LOCK:
            _depth -= 1
            if _depth == 0:
                _core.Tracer.sharding = _SLOW
