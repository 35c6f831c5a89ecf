"""``substrax_flax.remat``: marks a model's blocks for the train step's remat policy.

``make_train_step(loss_fn, remat="full")`` recomputes, in the backward pass, every block whose
method carries :func:`remat`, one block at a time (``nnx.remat`` with the policy of
:func:`substrax.spmd.checkpoint_policy`). Outside a step, or with ``remat="none"``, a marked
method runs as it is, so the same model code serves both.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

from flax import nnx

from substrax.spmd import checkpoint_policy

__all__ = ["Marked", "remat", "use_remat"]


@dataclasses.dataclass
class Marked:
    """The remat setting of a step being traced, and how many marked blocks it met."""

    remat: str
    blocks: int = 0


_ACTIVE: contextvars.ContextVar[Marked | None] = contextvars.ContextVar(
    "substrax_remat", default=None
)


@contextlib.contextmanager
def use_remat(remat: str) -> Iterator[Marked]:
    """Makes ``remat`` the policy of marked blocks traced inside the context.

    Args:
      remat: One of :data:`substrax.spmd.REMAT`.

    Yields:
      A :class:`Marked` that counts the marked blocks traced.
    """
    checkpoint_policy(remat)  # raises for an unknown name
    marked = Marked(remat)
    token = _ACTIVE.set(marked)
    try:
        yield marked
    finally:
        _ACTIVE.reset(token)


def remat(method: Callable[..., Any]) -> Callable[..., Any]:
    """Decorates a block's method (usually ``__call__``) so the step can recompute it.

    Args:
      method: A method of an ``nnx.Module`` (a transformer block, a residual stage, ...).

    Returns:
      The method, run under ``nnx.remat`` with the active step's policy when that policy is
      not ``"none"``, and unchanged otherwise.

    Raises:
      TypeError: If ``method`` is not a function (``@remat`` is used without arguments).
    """
    if not callable(method):
        raise TypeError(
            f"remat decorates a block's method (@substrax_flax.remat above def __call__), got "
            f"{type(method).__name__} {method!r:.80}; the policy is make_train_step(remat=...)'s."
        )

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        marked = _ACTIVE.get()
        if marked is None or marked.remat == "none":
            return method(self, *args, **kwargs)
        marked.blocks += 1
        policy = checkpoint_policy(marked.remat)
        return nnx.remat(method, policy=policy)(self, *args, **kwargs)

    return wrapper
