"""What a checkpoint directory holds: checksums, damage, leftovers, writability, its lock.

A directory is a local (or mounted) path or a ``gs://`` URL, both as ``etils.epath.Path``,
the path type Orbax itself writes through. Each step records the size and checksum of its
files once Orbax has finished it, so damage is found from the files, before Orbax opens them
(Orbax's own failed reads leave noise from its reader threads): locally a CRC-32 of the bytes,
on object storage the CRC-32C the store keeps for each object (one listing, nothing
downloaded). Only process 0 reads and writes these files; the checkpointer tells the other
processes what it found.
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import shutil
import socket
import threading
import time
import uuid
import zlib

import jax
from etils import epath

from substrax import warn_user

__all__ = [
    "LOCK",
    "CheckpointWarning",
    "DirectoryLock",
    "DirectoryLocked",
    "ObjectLock",
    "check_writable",
    "damage",
    "is_remote",
    "lock",
    "open_directory",
    "remove_unfinished",
    "set_aside",
    "write_checksums",
]

#: URL schemes a checkpoint directory may have: Orbax 0.12.8 writes arrays (TensorStore) to
#: these and to local or mounted paths.
SCHEMES = ("gs://",)


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped, cast or is not finite: the run goes on, the user is told."""


def _store(path: epath.Path):
    """``(filesystem, key)`` of a URL, with every cached listing of that store dropped.

    fsspec keeps one filesystem per thread, each with its own listing cache, and Orbax lists
    steps from its own threads: after one thread deletes or renames, the others' caches are
    stale. The checkpointer reads the store, not a cache, so each use starts afresh.
    """
    import fsspec  # only object storage needs it

    fs, key = fsspec.core.url_to_fs(os.fspath(path))
    for instance in list(type(fs)._cache.values()):
        instance.invalidate_cache()
    return fs, key


def is_remote(directory: epath.Path | str) -> bool:
    """Whether ``directory`` is on object storage (a URL) rather than a local path."""
    return "://" in os.fspath(directory)


def open_directory(directory: str | os.PathLike) -> epath.Path:
    """``directory`` as the path the checkpointer writes: absolute, or a ``gs://`` URL.

    Raises:
      TypeError: If ``directory`` is not a path.
      ValueError: If it is a URL of a store Orbax cannot write (``s3://`` among them).
    """
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(
            f"directory must be a path (a str or pathlib.Path) or a gs:// URL, got "
            f"{type(directory).__name__} {directory!r:.80}."
        )
    text = os.fspath(directory)
    if not is_remote(text):
        return epath.Path(pathlib.Path(text).absolute())
    if not text.startswith(SCHEMES):
        raise ValueError(
            f"Checkpoint directory {text!r}: Orbax 0.12.8 writes arrays to {', '.join(SCHEMES)} "
            "and to local or mounted paths, not to this scheme. Use a gs:// bucket, or mount "
            "the bucket (for s3://, e.g. with mountpoint-s3 or s3fs-fuse) and pass the mount "
            "point."
        )
    return epath.Path(text.rstrip("/"))


#: The lock file of a checkpoint directory (held by its one writer, process 0 of a run).
LOCK = ".substrax-writer.lock"


class DirectoryLocked(RuntimeError):
    """Another run (or Checkpointer) writes to this checkpoint directory."""


def lock(directory: epath.Path, lease: float) -> DirectoryLock | ObjectLock:
    """The directory's writer lock: ``flock`` on a local path, a leased object on a bucket."""
    if is_remote(directory):
        return ObjectLock(directory, lease)
    return DirectoryLock(pathlib.Path(os.fspath(directory)))


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

    def check(self) -> None:
        """A ``flock`` cannot be taken away while held: nothing to check."""

    def __del__(self) -> None:
        self.release()


class ObjectLock:
    """A leased lock object ``<directory>/.substrax-writer.lock`` on object storage.

    Object stores have no ``flock``, and a process killed with ``kill -9`` cannot remove what
    it wrote, so the lock is a lease: the holder creates the object only if absent (a
    conditional write, ``ifGenerationMatch=0`` on GCS) and a thread renews it every third of
    ``lease`` seconds. A second writer watches an existing lock: renewed while it watches,
    the holder is alive and the writer is refused; not renewed for ``lease`` seconds, the
    holder is gone and the lock is taken over with a :class:`CheckpointWarning`. Opening a
    directory whose writer was killed therefore waits at most ``lease`` seconds. The
    holders' clocks must agree to well within ``lease`` (NTP does).

    Args:
      directory: The checkpoint directory (a ``gs://`` URL).
      lease: Seconds without renewal after which a holder counts as gone.

    Raises:
      DirectoryLocked: If a live writer holds it.
    """

    def __init__(self, directory: epath.Path, lease: float):
        self._directory = directory
        self._fs, self._key = _store(directory / LOCK)
        self._lease = float(lease)
        self._token = uuid.uuid4().hex
        self._who = f"pid {os.getpid()} on {socket.gethostname()}"
        self._stop = threading.Event()
        self.lost: str | None = None
        holder = self._wait_for_lapse()
        if holder is not None:
            warn_user(
                f"Took over the writer lock of {directory} from {holder['who']}: it was not "
                f"renewed for {time.time() - holder['renewed']:.0f} s (lease {holder['lease']:g} "
                "s), so that writer is gone.",
                CheckpointWarning,
            )
            self._fs.rm(self._key)
        try:
            self._fs.pipe_file(self._key, self._record(), mode="create")
        except FileExistsError:
            raise self._refusal(self._read() or {"who": "unknown"}) from None
        self._renewer = threading.Thread(target=self._renew, daemon=True, name="substrax-lock")
        self._renewer.start()

    def _record(self) -> bytes:
        return json.dumps(
            {"who": self._who, "token": self._token, "renewed": time.time(), "lease": self._lease}
        ).encode()

    def _read(self) -> dict | None:
        try:
            return json.loads(self._fs.cat_file(self._key))
        except FileNotFoundError:
            return None
        except ValueError:  # a torn or foreign file: treat as a holder that never renews
            return {"who": "unknown (unreadable lock)", "token": "", "renewed": 0.0, "lease": 0}

    def _wait_for_lapse(self) -> dict | None:
        """Watches a present lock until renewed (raise) or lapsed (return it); None if absent."""
        first = self._read()
        holder = first
        while holder is not None:
            if holder["renewed"] != first["renewed"] or holder["token"] != first["token"]:
                raise self._refusal(holder)
            if time.time() - holder["renewed"] >= max(holder["lease"], self._lease):
                return holder
            time.sleep(min(1.0, self._lease / 10))
            holder = self._read()  # (cat_file reads the store: no listing cache to drop)
        return None

    def _refusal(self, holder: dict) -> DirectoryLocked:
        return DirectoryLocked(
            f"Checkpoint directory {self._directory} is in use by another writer "
            f"({holder['who']}, renewing its lock). One run writes to a directory at a time: "
            "pass another --checkpoint-dir, wait for that run to end, or close() its "
            "Checkpointer."
        )

    def _renew(self) -> None:
        while not self._stop.wait(self._lease / 3):
            try:
                holder = self._read()
                if holder is None or holder["token"] != self._token:
                    self.lost = holder["who"] if holder else "nobody (the lock was deleted)"
                    return
                self._fs.pipe_file(self._key, self._record())
            except Exception:  # a failed renewal is retried; a lapse is seen by the next writer
                continue

    def check(self) -> None:
        """Raises :class:`DirectoryLocked` if the lock was taken over since it was acquired."""
        if self.lost is not None:
            raise DirectoryLocked(
                f"Lost the writer lock of {self._directory} to {self.lost}: this run could not "
                f"renew it within {self._lease:g} s. Nothing more is saved here; resume the "
                "run (it restores the newest complete step)."
            )

    def release(self) -> None:
        """Stops renewing and deletes the lock if it is still this holder's (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        holder = self._read()
        if holder is not None and holder["token"] == self._token:
            self._fs.rm(self._key)


# Files every complete step holds (Orbax's layout for the items below).
REQUIRED = ("_CHECKPOINT_METADATA", "state/_METADATA", "state/manifest.ocdbt", "metadata/metadata")
# Size and checksum of every file of a step, written once Orbax has finished the step.
CHECKSUMS = "substrax-checksums.json"
# The file Orbax writes last into a step on object storage (there is no rename to commit).
COMMITTED = "commit_success.txt"


def _files(step_dir: epath.Path, checksums: bool = True) -> dict[str, list]:
    """``{relative path: [size, checksum]}`` of every file of a step but the checksum file.

    Locally the checksum is the CRC-32 of the bytes (None without ``checksums``: no byte
    read); on object storage it is the CRC-32C the store records for each object, read from
    the one listing either way.
    """
    if is_remote(step_dir):
        fs, root = _store(step_dir)
        found = fs.find(root, detail=True)
        return {
            key[len(root) + 1 :]: [int(info["size"]), info.get("crc32c") or info.get("ETag")]
            for key, info in sorted(found.items())
            if info.get("type") != "directory" and not key.endswith("/" + CHECKSUMS)
        }
    local = pathlib.Path(os.fspath(step_dir))
    if not local.is_dir():
        return {}
    sums = {}
    for path in sorted(local.rglob("*")):
        if path.is_file() and path.name != CHECKSUMS:
            crc = _crc32(path) if checksums else None
            sums[path.relative_to(local).as_posix()] = [path.stat().st_size, crc]
    return sums


def _crc32(path: pathlib.Path, chunk: int = 1 << 24) -> int:
    crc = 0
    with path.open("rb") as file:
        while block := file.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def write_checksums(step_dir: epath.Path) -> None:
    """Records the size and checksum of every file of a finished step (process 0 writes)."""
    if jax.process_index() == 0:
        (step_dir / CHECKSUMS).write_text(json.dumps(_files(step_dir)))


def damage(step_dir: epath.Path) -> str | None:
    """Why a step cannot be restored (missing files, sizes, checksums), or None.

    Only process 0 reads the files; the checkpointer tells the others. A step saved
    without checksums (by an older version) is checked for its required files only.
    """
    if jax.process_index() != 0:
        return None
    found = _files(step_dir, checksums=False)  # names and sizes: no byte read yet
    if not found and not (step_dir / CHECKSUMS).exists():
        return "its directory is empty"
    missing = [name for name in REQUIRED if name not in found]
    if missing:
        return f"it lacks {', '.join(missing)}"
    try:
        recorded = json.loads((step_dir / CHECKSUMS).read_text())
    except (OSError, ValueError):
        return None
    if not is_remote(step_dir):  # a bucket's listing carried the checksums already
        found = _files(step_dir)
    for name, (size, crc) in recorded.items():
        if name not in found:
            return f"it lacks {name}"
        if found[name][0] != size:
            return f"{name} has {found[name][0]} of its {size} bytes (truncated)"
        if found[name][1] != crc:
            return f"{name} fails its CRC-32 check (corrupted)"
    return None


def remove_unfinished(directory: epath.Path) -> list[str]:
    """Removes what saves that never finished (killed runs) left behind.

    Locally those are Orbax's temporary directories; on object storage, where Orbax writes a
    step in place and commits it with a last ``commit_success.txt``, the step directories
    without it.

    Returns:
      The names removed (process 0; the other processes remove nothing).
    """
    if jax.process_index() != 0:
        return []
    if not is_remote(directory):
        unfinished = sorted(pathlib.Path(os.fspath(directory)).glob("*.orbax-checkpoint-tmp*"))
        for path in unfinished:
            shutil.rmtree(path)
        return [path.name for path in unfinished]
    _store(directory)
    unfinished = [
        path
        for path in sorted(directory.iterdir(), key=lambda p: p.name)
        if path.name.isdigit() and not (path / COMMITTED).exists()
    ]
    for path in unfinished:
        path.rmtree()
    _store(directory)
    return [path.name for path in unfinished]


def set_aside(step_dir: epath.Path) -> str:
    """Renames a damaged step to ``<step>.corrupt`` (``+`` appended while that name is taken).

    On object storage a rename is a server-side copy of each object, then a delete.

    Returns:
      The new name.
    """
    target = step_dir.with_name(f"{step_dir.name}.corrupt")
    while target.exists():
        target = target.with_name(target.name + "+")
    if is_remote(step_dir):
        fs, source = _store(step_dir)
        fs.copy(source, _store(target)[1], recursive=True)
        fs.rm(source, recursive=True)
        _store(step_dir)
    else:
        step_dir.rename(target)
    return target.name


def check_writable(directory: epath.Path) -> None:
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
