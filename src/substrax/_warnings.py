"""The warning category substrax uses when it replicates what a user asked to shard."""

from __future__ import annotations

import sys
import warnings

__all__ = ["ShardingWarning", "warn_user"]


class ShardingWarning(UserWarning):
    """A dimension that was asked to be sharded is replicated (not divisible, unknown name, ...).

    Filter it like any warning, or turn it into an error with
    ``warnings.simplefilter("error", ShardingWarning)``; the Flax adapter's ``strict=True``
    raises instead of warning.
    """


def _is_library(module: str) -> bool:
    top = module.split(".")[0]
    return top == "substrax" or top.startswith("substrax_")


def warn_user(message: str, category: type[Warning] = ShardingWarning) -> None:
    """Warns, attributing the warning to the user's own call.

    The warning points at the first frame outside substrax and its adapters (packages named
    ``substrax`` or ``substrax_*``), however deep in the library it was raised, so a filter or
    a traceback names the user's line, not the library's.

    Args:
      message: The warning text: what was asked, and what was done.
      category: The warning class.
    """
    frame, level = sys._getframe(1), 2
    while frame is not None and _is_library(frame.f_globals.get("__name__", "")):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
