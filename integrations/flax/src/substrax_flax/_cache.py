"""The compiled steps of a step object, keyed on what determines their program.

A step is compiled once per program: the model's and optimizer's graph definitions (the
modules' structure and static attributes), the shapes, dtypes and shardings of their state,
and the batch's structure, shapes and dtypes. Graph definitions are compared by equality,
never hashed: published models keep plain (or ``slots=True``) dataclass configs, lists and
sets on their modules, which make ``hash(nnx.graphdef(model))`` raise while ``nnx.jit``
trains them. The array signature is compared first (the cheaper test).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

__all__ = ["ProgramKey", "StepCache", "equal"]


def _signature(tree: Any) -> tuple:
    """``(treedef, ((shape, dtype, sharding), ...))`` of a pytree of arrays."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple(
        (np.shape(x), _dtype(x), getattr(x, "sharding", None) if isinstance(x, jax.Array) else None)
        for x in leaves
    )


def _dtype(x: Any) -> Any:
    return x.dtype if hasattr(x, "dtype") else type(x)


def equal(a: Any, b: Any) -> bool:
    """``a == b`` as a bool; False where the comparison cannot say (arrays as attributes).

    A static attribute whose ``==`` is not a truth value (a numpy array) or raises cannot be
    proved equal, so the step is compiled again: never wrong, at worst one more compilation.
    """
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return False


@dataclasses.dataclass(frozen=True, eq=False)
class ProgramKey:
    """What a compiled step depends on.

    Attributes:
      graphdefs: The model's and the optimizer's ``nnx.GraphDef`` (compared by equality).
      arrays: The signature of their state and of the batch.
    """

    graphdefs: tuple[Any, Any]
    arrays: tuple

    @classmethod
    def of(cls, graphdefs: tuple[Any, Any], states: tuple[Any, Any], batch: Any) -> ProgramKey:
        """The key of a step's program for these arguments.

        Args:
          graphdefs: The model's and the optimizer's graph definitions (``nnx.split``).
          states: Their states, from the same split.
          batch: The batch as passed to the step (host or device arrays).

        Returns:
          The key.
        """
        arrays = (*(_signature(state) for state in states), _signature(batch))
        return cls(tuple(graphdefs), arrays)

    def matches(self, other: ProgramKey) -> bool:
        """Whether ``other`` names the same program."""
        return equal(self.arrays, other.arrays) and all(
            equal(a, b) for a, b in zip(self.graphdefs, other.graphdefs, strict=True)
        )


class StepCache:
    """Compiled steps by :class:`ProgramKey`, looked up by equality (a short list)."""

    def __init__(self) -> None:
        self._entries: list[tuple[ProgramKey, Any]] = []

    def get(self, key: ProgramKey) -> Any:
        """The entry stored for ``key``'s program, or None."""
        for stored, value in self._entries:
            if stored.matches(key):
                return value
        return None

    def put(self, key: ProgramKey, value: Any) -> None:
        """Stores ``value`` for ``key``'s program, replacing an entry for the same program."""
        self._entries = [(k, v) for k, v in self._entries if not k.matches(key)]
        self._entries.append((key, value))

    def values(self) -> list[Any]:
        """Every stored entry, oldest first."""
        return [value for _, value in self._entries]
