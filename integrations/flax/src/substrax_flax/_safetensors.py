"""The safetensors format, read by slices through the ``safetensors`` package, and written.

A ``.safetensors`` file is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the raw bytes (row-major, little-endian). A
checkpoint is one file, a directory of them, or a directory with a
``model.safetensors.index.json`` (``weight_map``: tensor name -> file), as Hugging Face writes
sharded checkpoints. Reading goes through the official reader (``safe_open``), which checks
the header when the file is opened and reads only the slice asked for, so a process touches
only the bytes of the shards its devices hold; :attr:`bytes_read` counts them.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from collections.abc import Iterable, Iterator
from typing import Any

import ml_dtypes
import numpy as np
import safetensors.numpy
from safetensors import SafetensorError, safe_open

from substrax import warn_user

__all__ = [
    "INDEX",
    "Checkpoint",
    "NonFiniteWeightsWarning",
    "SafetensorsFile",
    "parse_size",
    "write_checkpoint",
]

#: The index file of a sharded checkpoint.
INDEX = "model.safetensors.index.json"

_DTYPES = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "I16": np.dtype(np.int16), "U16": np.dtype(np.uint16), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I32": np.dtype(np.int32),
    "U32": np.dtype(np.uint32), "F32": np.dtype(np.float32), "F64": np.dtype(np.float64),
    "I64": np.dtype(np.int64), "U64": np.dtype(np.uint64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}  # fmt: skip
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def _dtype_name(dtype: Any) -> str:
    dtype = np.dtype(dtype)
    if dtype not in _NAMES:
        raise ValueError(f"safetensors has no dtype for {dtype}; it has {', '.join(_DTYPES)}.")
    return _NAMES[dtype]


class SafetensorsFile:
    """One ``.safetensors`` file, opened with the ``safetensors`` package, its tensors not loaded.

    The official reader validates the header when the file is opened (a truncated or corrupt
    file is refused there, naming it) and reads a slice of a tensor without the rest
    (``safe_open(...).get_slice(name)[index]``).

    Args:
      path: The file.

    Raises:
      ValueError: If the ``safetensors`` reader refuses the file (its reason and the file are
        named), or a tensor has a dtype substrax does not read.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        with self._open() as file:
            self.metadata = file.metadata() or {}
            self.tensors = {}
            for name in file.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                piece = file.get_slice(name)
                if piece.get_dtype() not in _DTYPES:
                    raise ValueError(
                        f"{self.path}: tensor {name!r} has dtype {piece.get_dtype()!r}, which "
                        f"substrax cannot read; it reads {', '.join(_DTYPES)}."
                    )
                self.tensors[name] = (_DTYPES[piece.get_dtype()], tuple(piece.get_shape()))
        self.bytes_read = 0

    def _open(self) -> Any:
        """The file, opened with the official reader (which maps it and checks its header)."""
        try:
            return safe_open(str(self.path), framework="numpy")
        except (SafetensorError, OSError) as error:
            raise ValueError(
                f"{self.path} is not a readable safetensors file ({error}): the safetensors "
                "reader refuses it. Download or write it again."
            ) from None

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor ``name``."""
        return self.tensors[name][1]

    def dtype(self, name: str) -> np.dtype:
        """The dtype of tensor ``name``."""
        return self.tensors[name][0]

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """A copy of tensor ``name``, or of its slice ``index`` (one slice per dimension).

        Only the slice's bytes are read (and counted in :attr:`bytes_read`). The file is
        mapped for this read alone and unmapped after the copy, so the pages it touched leave
        this process (they stay in the page cache): host memory holds one slice at a time.
        """
        dtype, shape = self.tensors[name]
        if not math.prod(shape):  # an empty tensor: nothing to read (the reader refuses it)
            return np.zeros(shape, dtype)[index if index is not None else ()]
        with self._open() as file:
            if not shape:
                out = np.array(file.get_tensor(name), dtype)
            else:
                index = tuple(slice(0, n) for n in shape) if index is None else index
                out = np.array(file.get_slice(name)[index], dtype)
        self.bytes_read += out.nbytes
        return out


class NonFiniteWeightsWarning(RuntimeWarning):
    """A checkpoint tensor holds NaN or inf values (they are loaded as they are)."""


def _floating(array: np.ndarray) -> bool:
    """Whether the array holds floats: numpy's, or ml_dtypes' (bfloat16, float8_*)."""
    return array.dtype.kind == "f" or "float" in array.dtype.name


class Checkpoint:
    """A safetensors checkpoint: one file, a directory of files, or a sharded directory.

    Args:
      source: A ``.safetensors`` file, or a directory holding ``.safetensors`` files (with or
        without ``model.safetensors.index.json``).
      strict: Raise, rather than warn, when a tensor read holds NaN or inf.

    Raises:
      FileNotFoundError: If ``source`` does not exist or holds no ``.safetensors`` file.
      ValueError: If a tensor is in two files, or the index names a missing file or tensor.
    """

    def __init__(self, source: str | os.PathLike, *, strict: bool = False):
        self.strict = strict
        self.source = pathlib.Path(source)
        if not self.source.exists():
            raise FileNotFoundError(f"No safetensors checkpoint at {self.source}.")
        files = self._files()
        self.files = {path.name: SafetensorsFile(path) for path in files}
        self.where: dict[str, SafetensorsFile] = {}
        for file in self.files.values():
            for name in file.tensors:
                if name in self.where:
                    raise ValueError(
                        f"Tensor {name!r} is in both {self.where[name].path.name} and "
                        f"{file.path.name}."
                    )
                self.where[name] = file
        self.nonfinite: set[str] = set()  # tensors found to hold NaN or inf (warned once)
        index = self.source / INDEX if self.source.is_dir() else None
        if index is not None and index.exists():
            self._check_index(json.loads(index.read_text()).get("weight_map", {}))

    def _files(self) -> list[pathlib.Path]:
        if self.source.is_file():
            return [self.source]
        index = self.source / INDEX
        if index.exists():
            names = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
            missing = [n for n in names if not (self.source / n).exists()]
            if missing:
                raise ValueError(f"{index} names files that are not there: {missing}.")
            return [self.source / n for n in names]
        files = sorted(self.source.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{self.source} holds no .safetensors file.")
        return files

    def _check_index(self, weight_map: dict[str, str]) -> None:
        wrong = [name for name, file in weight_map.items()
                 if name not in self.where or self.where[name].path.name != file]  # fmt: skip
        if wrong:
            raise ValueError(
                f"{self.source / INDEX} places tensors where they are not: {wrong[:5]}"
                + (" ..." if len(wrong) > 5 else "")
            )

    @property
    def names(self) -> list[str]:
        """Every tensor's name."""
        return list(self.where)

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor ``name``."""
        return self.where[name].shape(name)

    def dtype(self, name: str) -> np.dtype:
        """The dtype of tensor ``name``."""
        return self.where[name].dtype(name)

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """Tensor ``name``, or its slice ``index`` (see :meth:`SafetensorsFile.read`).

        Warns:
          NonFiniteWeightsWarning: Once per tensor, when a slice read holds NaN or inf.

        Raises:
          ValueError: Instead of the warning, when ``strict``.
        """
        out = self.where[name].read(name, index)
        if name not in self.nonfinite and _floating(out) and not np.isfinite(out).all():
            self.nonfinite.add(name)
            found = (
                f"Tensor {name!r} in {self.where[name].path.name} holds non-finite values "
                f"({int(np.isnan(out).sum())} NaN, {int(np.isinf(out).sum())} inf in the "
                "slice read)"
            )
            if self.strict:
                raise ValueError(
                    f"{found}; strict=True refuses them. Fix the checkpoint, or load without "
                    "strict (a warning) and replace them after loading."
                )
            warn_user(
                f"{found}: they are loaded as they are. Check the checkpoint, or replace "
                "them after loading.",
                NonFiniteWeightsWarning,
            )
        return out

    @property
    def bytes_read(self) -> int:
        """Bytes copied out of the files so far."""
        return sum(file.bytes_read for file in self.files.values())

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor."""
        return sum(
            math.prod(shape) * dtype.itemsize
            for file in self.files.values()
            for dtype, shape in file.tensors.values()
        )


def parse_size(size: int | str) -> int:
    """Bytes from ``2GB``, ``500MB``, ``1GiB`` or an int.

    Raises:
      ValueError: For anything else, naming the forms it reads.
    """
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9,
             "B": 1}  # fmt: skip
    text = str(size).strip().upper()
    for unit, scale in units.items():
        number = text.removesuffix(unit).strip()
        if text.endswith(unit) and number.replace(".", "", 1).isdigit() and float(number) > 0:
            return int(float(number) * scale)
    raise ValueError(
        f"shard_size must be a positive byte count or a size such as '2GB', '500MB' or '1GiB', "
        f"got {size!r}."
    )


def _shards(entries, limit: int) -> list[list]:
    shards, size = [[]], 0
    for entry in entries:
        nbytes = math.prod(entry[2]) * entry[1].itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards


def write_checkpoint(
    directory: str | os.PathLike,
    entries: list[tuple[str, np.dtype, tuple[int, ...]]],
    tensors: Iterable[np.ndarray] | Iterator[np.ndarray],
    *,
    shard_size: int,
    metadata: dict[str, str] | None = None,
) -> list[pathlib.Path]:
    """Writes tensors as a safetensors checkpoint in ``directory``, with the safetensors package.

    One file ``model.safetensors`` when everything fits in ``shard_size``; otherwise
    ``model-0000k-of-0000n.safetensors`` files and ``model.safetensors.index.json``, as Hugging
    Face names them. ``tensors`` yields each array in ``entries``' order and each file is
    written once its tensors are made, so the host holds one file's tensors at a time (at
    most ``shard_size``, or one tensor larger than it), as Hugging Face's own writer does.

    Args:
      directory: Where to write (created if needed).
      entries: ``(name, dtype, shape)`` of each tensor, in order.
      tensors: The arrays, in the same order.
      shard_size: Bytes per file, at most (a larger tensor gets a file of its own).
      metadata: The header's ``__metadata__`` (string values), such as ``{"format": "pt"}``.

    Returns:
      The files written (the index last, when there is one).
    """
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt", **(metadata or {})}
    shards = _shards(entries, shard_size)
    count = len(shards)
    names = (
        ["model.safetensors"]
        if count == 1
        else [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]
    )
    tensors = iter(tensors)
    written = []
    for name, shard in zip(names, shards, strict=True):
        arrays = {}
        for key, dtype, shape in shard:
            _dtype_name(dtype)  # a dtype safetensors lacks is refused naming the ones it has
            array = np.array(next(tensors), dtype=dtype, order="C", copy=None)
            if array.shape != tuple(shape):
                raise ValueError(f"Tensor {key!r} has shape {array.shape}, not {shape}.")
            arrays[key] = array
        safetensors.numpy.save_file(arrays, directory / name, metadata=metadata)
        written.append(directory / name)
    if len(shards) > 1:
        total = sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in entries)
        weight_map = {key: name for name, shard in zip(names, shards, strict=True)
                      for key, _, _ in shard}  # fmt: skip
        index = directory / INDEX
        index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                    indent=2))  # fmt: skip
        written.append(index)
    return written
