"""Rearranging a file's tensor into a model's parameter, lazily, one slice at a time.

A pattern in einops' notation names each dimension's axes on both sides: ``"o i -> i o"``
transposes, ``"(h d) e -> e h d"`` splits a fused head dimension and moves it last. A pattern
is its own inverse with the sides swapped, which is how a model is written back. The lazy
arrays here (:class:`Lazy`) read the part of a file tensor that one slice of the result needs,
so loading a shard of a parameter reads about that shard's bytes.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence

import numpy as np

__all__ = ["Lazy", "Pattern", "Stack", "Take", "arrange", "lazy_arrange"]

Index = tuple[slice, ...]
_TOKEN = re.compile(r"\(|\)|[A-Za-z_][A-Za-z0-9_]*|\S")


def _groups(side: str, text: str) -> tuple[tuple[str, ...], ...]:
    groups, open_ = [], None
    for token in _TOKEN.findall(side):
        if token == "(":
            if open_ is not None:
                raise ValueError(f"Pattern {text!r}: groups do not nest.")
            open_ = []
        elif token == ")":
            if not open_:
                raise ValueError(f"Pattern {text!r}: an empty or unopened group.")
            groups.append(tuple(open_))
            open_ = None
        elif token.isidentifier():
            (groups if open_ is None else open_).append(token if open_ is not None else (token,))
        else:
            raise ValueError(f"Pattern {text!r}: {token!r} is not an axis name or parenthesis.")
    if open_ is not None:
        raise ValueError(f"Pattern {text!r}: a group is not closed.")
    return tuple(groups)


@dataclasses.dataclass(frozen=True)
class Pattern:
    """A parsed rearrangement: the file side's axes per dimension, and the model side's.

    Attributes:
      left: Axis names of each file dimension (a group of several is a fused dimension).
      right: Axis names of each model dimension.
      sizes: Sizes given for axes a shape alone cannot tell (``h`` in ``"(h d) e -> ..."``).
      text: The pattern as written.
    """

    left: tuple[tuple[str, ...], ...]
    right: tuple[tuple[str, ...], ...]
    sizes: tuple[tuple[str, int], ...]
    text: str

    @classmethod
    def parse(cls, text: str, sizes: Mapping[str, int] | None = None) -> Pattern:
        """Parses ``"left -> right"``.

        Raises:
          ValueError: If the sides name different axes, an axis twice, or a size for an axis
            the pattern lacks.
        """
        if not isinstance(text, str) or text.count("->") != 1:
            raise ValueError(
                f"A pattern is 'file axes -> model axes', such as 'o i -> i o'; got {text!r}."
            )
        left, right = (_groups(side, text) for side in text.split("->"))
        names = [a for g in left for a in g]
        if len(set(names)) != len(names) or sorted(names) != sorted(a for g in right for a in g):
            raise ValueError(
                f"Pattern {text!r}: each axis must appear once on each side; the file side has "
                f"{names}, the model side {[a for g in right for a in g]}."
            )
        sizes = dict(sizes or {})
        unknown = sorted(set(sizes) - set(names))
        if unknown:
            raise ValueError(f"Pattern {text!r} has no axis {unknown}; its axes: {names}.")
        return cls(left, right, tuple(sorted(sizes.items())), text)

    def inverse(self, shape: Sequence[int] | None = None) -> Pattern:
        """The pattern from the model's side back to the file's.

        Args:
          shape: The file side's shape, when known: every axis's size is then given.
        """
        left, right = self.text.split("->")
        sizes = self.sizes if shape is None else tuple(sorted(self.axis_sizes(shape).items()))
        return Pattern(self.right, self.left, sizes, f"{right.strip()} -> {left.strip()}")

    def axis_sizes(self, shape: Sequence[int]) -> dict[str, int]:
        """Every axis's size, from the file side's ``shape`` and the given sizes.

        Raises:
          ValueError: If the rank differs, or a fused dimension does not split as given.
        """
        if len(shape) != len(self.left):
            raise ValueError(
                f"Pattern {self.text!r} reads {len(self.left)} dimensions; the tensor has shape "
                f"{tuple(shape)}."
            )
        sizes, given = {}, dict(self.sizes)
        for dim, group in zip(shape, self.left, strict=True):
            open_ = [a for a in group if a not in given]
            known = math.prod(given[a] for a in group if a in given)
            if len(open_) > 1:
                raise ValueError(f"Pattern {self.text!r}: give the size of all but one of {open_}.")
            if dim % known or (not open_ and dim != known):
                raise ValueError(
                    f"Pattern {self.text!r}: dimension {dim} does not split into {group} with "
                    f"sizes {[given.get(a) for a in group]}."
                )
            sizes.update({a: given[a] for a in group if a in given})
            if open_:
                sizes[open_[0]] = dim // known
        return sizes

    def out_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The model side's shape for a file tensor of ``shape``."""
        sizes = self.axis_sizes(shape)
        return tuple(math.prod(sizes[a] for a in group) for group in self.right)


def arrange(array: np.ndarray, pattern: Pattern) -> np.ndarray:
    """``array`` (the left side) rearranged to the right side, whole."""
    sizes = pattern.axis_sizes(array.shape)
    axes = [a for g in pattern.left for a in g]
    split = array.reshape([sizes[a] for a in axes])
    moved = split.transpose([axes.index(a) for g in pattern.right for a in g])
    return moved.reshape(pattern.out_shape(array.shape))


class Lazy:
    """An array that reads a slice of itself on demand (a file tensor, rearranged)."""

    shape: tuple[int, ...]
    dtype: np.dtype

    def read(self, index: Index) -> np.ndarray:
        """The slice ``index`` (one step-1 slice per dimension)."""
        raise NotImplementedError

    def whole(self) -> np.ndarray:
        """The whole array."""
        return self.read(tuple(slice(0, n) for n in self.shape))


def normalize(index: Sequence[slice], shape: Sequence[int]) -> Index:
    """``index`` with each slice's start and stop filled in (steps must be 1)."""
    out = []
    for part, n in zip(index, shape, strict=True):
        start, stop, step = part.indices(n)
        if step != 1:
            raise ValueError(f"Only contiguous slices are read, got {part}.")
        out.append(slice(start, stop))
    return tuple(out)


@dataclasses.dataclass
class Source(Lazy):
    """Tensor ``name`` of a checkpoint, read by ``read(name, index)``."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    reader: Callable[[str, Index], np.ndarray]

    def read(self, index: Index) -> np.ndarray:
        return self.reader(self.name, index)


@dataclasses.dataclass
class Take(Lazy):
    """``child[start:stop]`` along ``axis`` (one part of a fused tensor)."""

    child: Lazy
    axis: int
    start: int
    stop: int

    def __post_init__(self):
        shape = list(self.child.shape)
        if not 0 <= self.start < self.stop <= shape[self.axis]:
            raise ValueError(
                f"take=({self.axis}, {self.start}, {self.stop}) is outside dimension "
                f"{self.axis} of shape {tuple(shape)}."
            )
        shape[self.axis] = self.stop - self.start
        self.shape, self.dtype = tuple(shape), self.child.dtype

    def read(self, index: Index) -> np.ndarray:
        index = list(index)
        part = index[self.axis]
        index[self.axis] = slice(part.start + self.start, part.stop + self.start)
        return self.child.read(tuple(index))


@dataclasses.dataclass
class Stack(Lazy):
    """Children stacked along a new leading dimension (per-layer tensors into a scan's stack)."""

    children: list[Lazy]

    def __post_init__(self):
        first = self.children[0]
        self.shape, self.dtype = (len(self.children), *first.shape), first.dtype

    def read(self, index: Index) -> np.ndarray:
        rows = range(len(self.children))[index[0]]
        return np.stack([self.children[i].read(index[1:]) for i in rows])


@dataclasses.dataclass
class _Split(Lazy):
    """Each dimension of ``child`` split into the sizes of ``groups`` (row-major)."""

    child: Lazy
    groups: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        self.shape = tuple(n for g in self.groups for n in g)
        self.dtype = self.child.dtype

    def read(self, index: Index) -> np.ndarray:
        outer, after, at = [], [], 0
        for group in self.groups:
            first, rest = index[at], index[at + 1 : at + len(group)]
            inner = math.prod(group[1:])
            outer.append(slice(first.start * inner, first.stop * inner))
            after.append((first.stop - first.start, group[1:], rest))
            at += len(group)
        data = self.child.read(tuple(outer))
        data = data.reshape([n for rows, tail, _ in after for n in (rows, *tail)])
        return data[tuple(s for _, tail, rest in after for s in (slice(None), *rest))]


@dataclasses.dataclass
class _Transpose(Lazy):
    child: Lazy
    perm: tuple[int, ...]

    def __post_init__(self):
        self.shape = tuple(self.child.shape[p] for p in self.perm)
        self.dtype = self.child.dtype

    def read(self, index: Index) -> np.ndarray:
        source = [None] * len(self.perm)
        for k, p in enumerate(self.perm):
            source[p] = index[k]
        return self.child.read(tuple(source)).transpose(self.perm)


@dataclasses.dataclass
class _Merge(Lazy):
    """Consecutive dimensions of ``child`` merged, ``counts[k]`` of them into dimension k."""

    child: Lazy
    counts: tuple[int, ...]

    def __post_init__(self):
        shape, at = [], 0
        for count in self.counts:
            shape.append(math.prod(self.child.shape[at : at + count]))
            at += count
        self.shape, self.dtype = tuple(shape), self.child.dtype

    def read(self, index: Index) -> np.ndarray:
        source, cuts, at = [], [], 0
        for part, count in zip(index, self.counts, strict=True):
            dims = self.child.shape[at : at + count]
            inner = math.prod(dims[1:])
            first = slice(part.start // inner, -(-part.stop // inner))
            source += [first, *(slice(0, n) for n in dims[1:])]
            offset = first.start * inner
            cuts.append(slice(part.start - offset, part.stop - offset))
            at += count
        data = self.child.read(tuple(source))
        merged, at = [], 0
        for count in self.counts:
            merged.append(math.prod(data.shape[at : at + count]))
            at += count
        return data.reshape(merged)[tuple(cuts)]


def lazy_arrange(child: Lazy, pattern: Pattern) -> Lazy:
    """``child`` rearranged by ``pattern``, read lazily (see :func:`arrange`)."""
    sizes = pattern.axis_sizes(child.shape)
    axes = [a for g in pattern.left for a in g]
    order = [a for g in pattern.right for a in g]
    out = child
    if any(len(g) > 1 for g in pattern.left):
        out = _Split(out, tuple(tuple(sizes[a] for a in g) for g in pattern.left))
    perm = tuple(axes.index(a) for a in order)
    if perm != tuple(range(len(perm))):
        out = _Transpose(out, perm)
    if any(len(g) > 1 for g in pattern.right):
        out = _Merge(out, tuple(len(g) for g in pattern.right))
    return out
