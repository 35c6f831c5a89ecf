"""The blocked layout's sizes: rows per block, and the rows once each group is padded to blocks.

Arithmetic shared by :func:`~substrax.spmd.group_rows` (which lays the rows out) and the
planner (which estimates the padding's cost); it imports no jax.
"""

from __future__ import annotations

__all__ = ["auto_block", "blocked_size"]


def auto_block(rows: int, groups: int) -> int:
    """The blocked kernel's default rows per block (see :func:`~substrax.spmd.group_rows`)."""
    block = 64
    while block > 8 and groups * (block - 1) > rows / 16:
        block //= 2
    return block


def blocked_size(rows: int, groups: int, block: int) -> int:
    """The blocked layout's rows: at most ``rows + groups x (block - 1)``, in whole blocks.

    Each of ``groups`` groups is padded to whole blocks; this is the static bound.
    """
    return block * ((rows + groups * (block - 1)) // block)
