"""Which microbatch a pipeline stage is computing, for ``layer_fn`` and ``loss_fn`` to read."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax

__all__ = ["computing", "microbatch_index"]

_INDEX: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar(
    "substrax_microbatch", default=None
)


def microbatch_index() -> jax.Array | None:
    """The index of the microbatch the calling ``layer_fn`` or ``loss_fn`` is computing.

    A :class:`~substrax.pipeline.Pipeline` calls its functions once per microbatch and
    stage while it traces the schedule; inside those calls this is the microbatch's index
    in the batch (a traced int32 scalar, the same in the forward pass and in a backward
    pass that recomputes it), so that random numbers can be drawn per microbatch:
    ``jax.random.fold_in(key, microbatch_index())``.

    Returns:
      The index, or None outside a pipeline's calls (``Pipeline.reference_loss``, shape
      checks).
    """
    return _INDEX.get()


@contextlib.contextmanager
def computing(index: jax.Array | None) -> Iterator[None]:
    """Makes :func:`microbatch_index` return ``index`` while the block traces."""
    token = _INDEX.set(index)
    try:
        yield
    finally:
        _INDEX.reset(token)
