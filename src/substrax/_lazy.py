"""Lazy re-exports for substrax's packages: a name's module is imported when it is first used.

A package lists its public names once, as explicit re-exports inside ``if TYPE_CHECKING:``
(what type checkers and the API reference read), and hands its own file to :func:`attach`,
which reads that block and imports each name's module on first access (PEP 562). So
``import substrax.planner`` does not import jax (about 1.2 s of CPU time) unless a name it
uses needs it: the planner's estimates are arithmetic.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable

__all__ = ["attach"]


def _re_exports(path: str) -> dict[str, tuple[str, str]]:
    """``{name: (module, its name there)}`` of the imports under ``if TYPE_CHECKING:``."""
    with open(path, encoding="utf-8") as file:
        tree = ast.parse(file.read(), path)
    found: dict[str, tuple[str, str]] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for line in node.body:
                if isinstance(line, ast.ImportFrom) and line.module is not None:
                    for alias in line.names:
                        found[alias.asname or alias.name] = (line.module, alias.name)
    return found


def attach(package: str, path: str) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of a package whose names load on first use.

    Args:
      package: The package's ``__name__``.
      path: Its ``__init__.py`` (``__file__``), whose ``if TYPE_CHECKING:`` block lists the
        re-exports as ``from module import name as name``.

    Returns:
      ``(__getattr__, __dir__)`` for the package's namespace.

    Raises:
      ValueError: If the block lists no name (the package would export nothing).
    """
    exports = _re_exports(path)
    if not exports:
        raise ValueError(f"{path} lists no re-exports under 'if TYPE_CHECKING:'.")

    def __getattr__(name: str) -> object:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, original = exports[name]
        value = getattr(importlib.import_module(module), original)
        setattr(importlib.import_module(package), name, value)  # later lookups skip this
        return value

    def __dir__() -> list[str]:
        return sorted(set(exports) | set(vars(importlib.import_module(package))))

    return __getattr__, __dir__
