"""Token sources: a token file, or text read through a tokenizer."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
from collections.abc import Sequence

import numpy as np

#: The suffixes :func:`load_tokens` reads, and what each holds.
FORMATS = {
    ".bin": "raw little-endian token ids (nanoGPT's format; pass dtype=)",
    ".npy": "a one-dimensional numpy array of token ids",
    ".txt": "text, tokenized",
    ".jsonl": "one JSON object per line with a 'text' field, tokenized",
}
_TOKEN_DTYPES = ("uint8", "uint16", "uint32", "int32")
_BYTES_VOCAB = 256
#: Documents of a ``.jsonl`` file are joined with this separator before tokenizing.
DOCUMENT_SEPARATOR = "\n\n"


@dataclasses.dataclass(frozen=True)
class Tokens:
    """A one-dimensional array of token ids and where it came from.

    Attributes:
        ids: The token ids, in file order: a memory map for ``.bin`` and ``.npy`` files, so a
            process reads only the windows it asks for.
        source: The path it was read from.
        vocab_size: The vocabulary the ids need: the tokenizer's size; for UTF-8 bytes the
            largest byte plus one (128 for ASCII text); None for a token file, whose ids are
            not all read up front (:class:`Batches` checks each window it reads against the
            model's vocabulary).
        tokenizer: The tokenizer's path, or ``"bytes"`` for UTF-8 bytes, or None for a token
            file.
    """

    ids: np.ndarray
    source: str
    vocab_size: int | None
    tokenizer: str | None

    @property
    def fingerprint(self) -> str:
        """A short hash of the ids' count, dtype and first and last MiB.

        A resumed run compares it with its checkpoint's, so that the saved data position is
        not applied to other data.
        """
        ids = self.ids
        edge = (1 << 20) // ids.dtype.itemsize
        digest = hashlib.sha256(f"{ids.size}:{ids.dtype}".encode())
        digest.update(np.ascontiguousarray(ids[:edge]).tobytes())
        digest.update(np.ascontiguousarray(ids[-edge:]).tobytes())
        return digest.hexdigest()[:16]


def load_tokens(
    path: str | os.PathLike, *, dtype: str = "uint16", tokenizer: str | os.PathLike | None = None
) -> Tokens:
    """Reads token ids from a token file or tokenizes a text file.

    Token files (``.bin``, ``.npy``) are memory-mapped, not read. Text (``.txt``, ``.jsonl``)
    is tokenized whole: as UTF-8 bytes (ids 0-255) by default, or with a Hugging Face
    ``tokenizer.json`` through the ``tokenizers`` package. Documents of a ``.jsonl`` file are
    joined with :data:`DOCUMENT_SEPARATOR`. For corpora larger than memory, write the ids once
    as a ``.bin`` file (``np.asarray(ids, np.uint16).tofile(path)``) and read that.

    Args:
        path: The file.
        dtype: The ids' type in a ``.bin`` file, one of ``uint8``, ``uint16``, ``uint32`` or
            ``int32`` (nanoGPT writes ``uint16``). Ignored for other formats.
        tokenizer: None for UTF-8 bytes, or the path of a Hugging Face ``tokenizer.json``.
            Text files only.

    Returns:
        The :class:`Tokens`.

    Raises:
        FileNotFoundError: If ``path`` or ``tokenizer`` does not exist.
        ValueError: If the suffix, the dtype or the array is not one of those listed, or a
            tokenizer is given for a token file, or the file holds no tokens.
    """
    path = pathlib.Path(path)
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        listed = ", ".join(f"{s} ({what})" for s, what in FORMATS.items())
        raise ValueError(f"{str(path)!r}: unknown data format {suffix!r}; expected one of {listed}")
    if not path.is_file():
        raise FileNotFoundError(f"data file {str(path)!r} does not exist")
    if suffix in (".bin", ".npy"):
        if tokenizer is not None:
            raise ValueError(
                f"{str(path)!r} already holds token ids; tokenizer={tokenizer!r} applies to "
                ".txt and .jsonl files only"
            )
        ids = _token_file(path, suffix, dtype)
        return Tokens(_nonempty(ids, path), str(path), None, None)
    text = _text(path, suffix)
    if tokenizer is None:
        ids = _nonempty(np.frombuffer(text.encode("utf-8"), np.uint8), path)
        return Tokens(ids, str(path), int(ids.max()) + 1, "bytes")
    encoder = _tokenizer(tokenizer)
    ids = np.asarray(encoder.encode(text).ids, np.uint32)
    return Tokens(_nonempty(ids, path), str(path), encoder.get_vocab_size(), str(tokenizer))


def _token_file(path: pathlib.Path, suffix: str, dtype: str) -> np.ndarray:
    if suffix == ".npy":
        ids = np.load(path, mmap_mode="r")
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise ValueError(
                f"{str(path)!r} holds a {ids.dtype} array of shape {ids.shape}; expected a "
                "one-dimensional array of integer token ids"
            )
        return ids
    if dtype not in _TOKEN_DTYPES:
        raise ValueError(f"dtype={dtype!r} for {str(path)!r}; expected one of {_TOKEN_DTYPES}")
    size = path.stat().st_size
    if size % np.dtype(dtype).itemsize:
        raise ValueError(
            f"{str(path)!r} has {size} bytes, not a whole number of {dtype} ids: is its dtype "
            f"another of {_TOKEN_DTYPES}?"
        )
    return np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)


def _text(path: pathlib.Path, suffix: str) -> str:
    text = path.read_text(encoding="utf-8")
    if suffix == ".txt":
        return text
    documents = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ValueError(
                f"{path!s}:{number}: expected an object with a 'text' string, got {line[:60]!r}"
            )
        documents.append(record["text"])
    return DOCUMENT_SEPARATOR.join(documents)


def _tokenizer(path):
    if not pathlib.Path(path).is_file():
        raise FileNotFoundError(f"tokenizer file {str(path)!r} does not exist")
    try:
        import tokenizers
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"tokenizer={str(path)!r} needs the 'tokenizers' package: pip install tokenizers"
        ) from None
    return tokenizers.Tokenizer.from_file(str(path))


def _nonempty(ids: np.ndarray, path: pathlib.Path) -> np.ndarray:
    if ids.size < 2:
        raise ValueError(f"{str(path)!r} holds {ids.size} token(s); a window needs at least 2")
    return ids


def encode(text: str, tokenizer: str | os.PathLike | None = None) -> np.ndarray:
    """``text`` as token ids (int32), as :func:`load_tokens` reads a text file.

    Args:
        text: The text, such as a prompt.
        tokenizer: None for UTF-8 bytes, or a ``tokenizer.json`` path (as
            :attr:`Tokens.tokenizer` names it; ``"bytes"`` means None).

    Returns:
        The ids.
    """
    if tokenizer in (None, "bytes"):
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
    return np.asarray(_tokenizer(tokenizer).encode(text).ids, np.int32)


def decode(ids: Sequence[int] | np.ndarray, tokenizer: str | os.PathLike | None = None) -> str:
    """Token ids as text: the inverse of :func:`encode`.

    Bytes that are not valid UTF-8, and ids above 255 under byte tokens, decode as U+FFFD.

    Args:
        ids: The ids, such as a generated continuation.
        tokenizer: As for :func:`encode`.

    Returns:
        The text.
    """
    ids = [int(i) for i in np.asarray(ids).reshape(-1)]
    if tokenizer in (None, "bytes"):
        return bytes(i if i < _BYTES_VOCAB else 0xFF for i in ids).decode("utf-8", "replace")
    return _tokenizer(tokenizer).decode(ids)
