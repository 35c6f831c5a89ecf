"""What a checkpoint directory holds on disk: checksums, damage, leftovers, writability.

Each step records the size and CRC-32 of its files once Orbax has finished it, so damage is
found by reading the files, before Orbax opens them (Orbax's own failed reads leave noise from
its reader threads). Only process 0 reads and writes these files; the checkpointer tells the
other processes what it found.
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import shutil
import socket
import time
import zlib

import jax

__all__ = [
    "LOCK",
    "DirectoryLock",
    "DirectoryLocked",
    "check_writable",
    "damage",
    "remove_unfinished",
    "write_checksums",
]

#: The lock file of a checkpoint directory (held by its one writer, process 0 of a run).
LOCK = ".substrax-writer.lock"


class DirectoryLocked(RuntimeError):
    """Another run (or Checkpointer) writes to this checkpoint directory."""


class DirectoryLock:
    """An exclusive ``flock`` on ``<directory>/.substrax-writer.lock``, held while open.

    The kernel releases it when the holder exits, however it exits (a ``kill -9`` too), so a
    crashed run never leaves a stale lock. The file records who holds it, for the message of
    the one refused.

    Args:
      directory: The checkpoint directory (it exists).

    Raises:
      DirectoryLocked: If another process, or another Checkpointer of this one, holds it.
    """

    def __init__(self, directory: pathlib.Path):
        path = directory / LOCK
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 4096, 0).decode(errors="replace").strip() or "unknown"
            os.close(self._fd)
            self._fd = None
            raise DirectoryLocked(
                f"Checkpoint directory {directory} is in use by another writer ({holder}). "
                "One run writes to a directory at a time: pass another --checkpoint-dir, wait "
                "for that run to end, or close() its Checkpointer."
            ) from None
        os.ftruncate(self._fd, 0)
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        os.pwrite(
            self._fd, f"pid {os.getpid()} on {socket.gethostname()} since {started}".encode(), 0
        )

    def release(self) -> None:
        """Releases the lock (idempotent)."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        self.release()


# Files every complete step holds (Orbax's layout for the items below).
REQUIRED = ("_CHECKPOINT_METADATA", "state/_METADATA", "state/manifest.ocdbt", "metadata/metadata")
# Size and CRC-32 of every file of a step, written once Orbax has finished the step.
CHECKSUMS = "substrax-checksums.json"


def _files(step_dir: pathlib.Path) -> dict[str, list[int]]:
    """``{relative path: [size, crc32]}`` of every file of a step but the checksum file."""
    sums = {}
    for path in sorted(step_dir.rglob("*")):
        if path.is_file() and path.name != CHECKSUMS:
            sums[path.relative_to(step_dir).as_posix()] = [path.stat().st_size, _crc32(path)]
    return sums


def _crc32(path: pathlib.Path, chunk: int = 1 << 24) -> int:
    crc = 0
    with path.open("rb") as file:
        while block := file.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def write_checksums(step_dir: pathlib.Path) -> None:
    """Records the size and CRC-32 of every file of a finished step (process 0 writes)."""
    if jax.process_index() == 0:
        (step_dir / CHECKSUMS).write_text(json.dumps(_files(step_dir)))


def damage(step_dir: pathlib.Path) -> str | None:
    """Why a step cannot be restored (missing files, sizes, checksums), or None.

    Only process 0 reads the files; the checkpointer tells the others. A step saved
    without checksums (by an older version) is checked for its required files only.
    """
    if jax.process_index() != 0:
        return None
    if not any(step_dir.iterdir()):
        return "its directory is empty"
    missing = [name for name in REQUIRED if not (step_dir / name).is_file()]
    if missing:
        return f"it lacks {', '.join(missing)}"
    try:
        recorded = json.loads((step_dir / CHECKSUMS).read_text())
    except (OSError, ValueError):
        return None
    found = _files(step_dir)
    for name, (size, crc) in recorded.items():
        if name not in found:
            return f"it lacks {name}"
        if found[name][0] != size:
            return f"{name} has {found[name][0]} of its {size} bytes (truncated)"
        if found[name][1] != crc:
            return f"{name} fails its CRC-32 check (corrupted)"
    return None


def remove_unfinished(directory: pathlib.Path) -> list[str]:
    """Removes the temporary directories of saves that never finished (killed runs).

    Returns:
      The names removed (process 0; the other processes remove nothing).
    """
    removed = []
    if jax.process_index() == 0:
        for path in sorted(directory.glob("*.orbax-checkpoint-tmp*")):
            shutil.rmtree(path)
            removed.append(path.name)
    return removed


def check_writable(directory: pathlib.Path) -> None:
    """Creates ``directory`` and writes a probe file in it, so a bad path fails before training.

    Raises:
      PermissionError: If it cannot be created or written.
    """
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".substrax-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise PermissionError(
            f"Checkpoint directory {directory} is not writable: {error.strerror or error}. "
            "Pass a directory this process can create and write."
        ) from error
