"""Checkpointer: sharded Orbax checkpoints of a model and its optimizer, restorable anywhere.

Orbax is imported where a checkpoint is first opened, saved or read, not with substrax_flax:
it and tensorstore take 0.25 s of every process's start (half of what substrax_flax adds to
jax, flax and optax), which a process that never checkpoints need not pay.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import logging
import os
import sys
import traceback
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from substrax import warn_user
from substrax.distributed import progress
from substrax_flax._checkpoint_files import (
    CheckpointWarning,
    DirectoryLocked,
    check_writable,
    damage,
    lock,
    open_directory,
    remove_unfinished,
    set_aside,
    write_checksums,
)

__all__ = ["CheckpointWarning", "Checkpointer", "DirectoryLocked"]


class _DiskRefusals(logging.Filter):
    """Drops Orbax's logs of a save the disk refused: :meth:`Checkpointer.save` says it once.

    Orbax logs the same refusal from each of its background threads, with a traceback each
    (five for one full disk); the checkpointer raises one OSError naming the step and the
    newest complete one instead. Other errors pass.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (error is not None and _os_error(error) is not None)


_DISK_REFUSALS = _DiskRefusals()


def _orphaned_completion(unraisable: Any) -> bool:
    """Whether an unraisable error is a write finishing after its refused save closed its loop.

    When the disk refuses a save, Orbax closes the save's asyncio event loop while TensorStore
    still has writes in flight; each one that completes later calls the closed loop's
    ``call_soon_threadsafe`` from TensorStore's own thread, and Python prints the
    ``RuntimeError: Event loop is closed`` as unraisable (0 to 7 tracebacks for one save on
    a full 3 MB tmpfs, by timing). Only that error, raised there, counts.
    """
    error = getattr(unraisable, "exc_value", None)
    if not isinstance(error, RuntimeError) or str(error) != "Event loop is closed":
        return False
    names = [frame.name for frame in traceback.extract_tb(error.__traceback__)]
    return names[-2:] == ["call_soon_threadsafe", "_check_closed"]


def _drop_orphaned_completions() -> None:
    """Wraps ``sys.unraisablehook`` (once) to drop :func:`_orphaned_completion`'s errors.

    :meth:`Checkpointer.save` raises one OSError for the refused save; every other
    unraisable error goes to the hook that was there before.
    """
    previous = sys.unraisablehook
    if getattr(previous, "drops_orphaned_completions", False):
        return

    def hook(unraisable: Any) -> None:
        if not _orphaned_completion(unraisable):
            previous(unraisable)

    hook.drops_orphaned_completions = True
    sys.unraisablehook = hook


def _abstract(tree: Any) -> Any:
    """ShapeDtypeStructs with the shardings of a tree of live arrays (the restore target)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


def _is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def _storable(tree: Any) -> Any:
    """PRNG key arrays (dropout streams) as their raw key data, which Orbax can store."""
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def _keys_back(restored: Any, like: Any) -> Any:
    """Raw key data back into typed keys of ``like``'s implementation."""
    return jax.tree.map(
        lambda r, x: jax.random.wrap_key_data(r, impl=jax.random.key_impl(x)) if _is_key(x) else r,
        restored,
        like,
    )


def _flat(tree: Any) -> dict[str, Any]:
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {jax.tree_util.keystr(p, simple=True, separator="/"): x for p, x in leaves}


@jax.jit
def _finite(leaves: list[jax.Array]) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def _all_finite(tree: Any) -> bool:
    """Whether every floating-point value in ``tree`` is finite (one reduction, any mesh)."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return bool(_finite(leaves)) if leaves else True


def _everywhere(problem: str | None) -> str | None:
    """The problem as every process sees it: one process failing to read fails them all."""
    if jax.process_count() == 1:
        return problem
    ok = multihost_utils.process_allgather(np.asarray(problem is None))
    return problem if problem is not None or bool(np.all(ok)) else "unreadable on another process"


class Checkpointer:
    """Saves and restores a model, its optimizer and run metadata with Orbax.

    Every process writes only its own shards; a restore reads each array straight into the
    sharding of the target model and optimizer, whatever mesh, layout or number of processes
    saved it.

    The directory is a local (or mounted) path or a ``gs://`` URL: Orbax writes both, and
    everything below holds on both.

    Nothing is lost or kept silently:

    - one writer per directory: process 0 holds an exclusive lock on it from here to
      :meth:`close` (or its exit, however it ends), and a second run or Checkpointer on the
      same directory is refused with :class:`DirectoryLocked`, naming the holder; every check
      of the steps there reads the disk. Locally the lock is an ``flock``, which the kernel
      releases when the holder dies; on object storage it is a leased object that the holder
      renews, taken over (with a warning) once not renewed for ``lease`` seconds;
    - saves are asynchronous by default: :meth:`save` returns once the state is copied to
      host memory, and the next save, any read of the steps, :meth:`wait`, :meth:`close` and
      the interpreter's exit wait for it to be written;
    - saves are atomic (Orbax writes a temporary directory and renames it when every process
      is done; on object storage it commits the step with a last ``commit_success.txt``), so
      a kill during a save, asynchronous or not, loses only that step; what killed saves
      left is removed when the directory is opened, and the directory is checked for
      writability then, before any training;
    - steps only move forward (:meth:`save` raises on a step that is not after the latest);
    - the last ``keep`` checkpoints are kept, and also the newest one whose values are all
      finite, so a run that diverged never rotates its last good state out;
    - each step records the size and CRC-32 of its files; :meth:`restore` without a step
      restores the newest intact checkpoint: a step whose files are missing, empty, truncated,
      corrupted or otherwise unreadable is skipped with one
      :class:`CheckpointWarning` naming it and why, and renamed ``<step>.corrupt`` so that the
      run can save that step again;
    - restoring values of another dtype is an error unless ``cast=True`` (then a warning).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        keep: int = 3,
        asynchronous: bool = True,
        lease: float = 30.0,
    ):
        """Opens (or creates) a checkpoint directory and checks that it is writable.

        Args:
          directory: Where checkpoints go, one subdirectory per step: a local or mounted path,
            or a ``gs://bucket/path`` URL (credentials as for any Google Cloud client).
          keep: How many of the latest checkpoints to keep (the newest finite one is kept
            besides).
          asynchronous: :meth:`save` returns once the state is copied to host memory and the
            arrays are written in the background while training goes on (one save in
            flight: the next save, any read of the steps, :meth:`wait`, :meth:`close` and
            the interpreter's exit wait for it). The copy holds one copy of this process's
            state in host memory until written. False: each save returns when written.
          lease: Object storage only: seconds after which a writer lock that its holder
            stopped renewing (a killed run) is taken over. Opening a directory whose writer
            was killed waits up to this long; a live holder renews every ``lease / 3``.

        Raises:
          TypeError: If ``directory`` is not a path.
          ValueError: If ``keep`` is not an integer of at least 1, ``lease`` is not positive,
            or ``directory`` is a URL of a store Orbax cannot write (``s3://``).
          PermissionError: If the directory cannot be created or written.
          DirectoryLocked: If another run or Checkpointer writes to the directory.
        """
        import orbax.checkpoint as ocp  # on first use (see the module docstring)

        self.directory = open_directory(directory)
        logging.getLogger("absl").addFilter(_DISK_REFUSALS)  # (once: the same filter object)
        _drop_orphaned_completions()
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ValueError(f"keep must be an integer of at least 1, got {keep!r}.")
        if not isinstance(lease, (int, float)) or isinstance(lease, bool) or not lease > 0:
            raise ValueError(f"lease must be a positive number of seconds, got {lease!r}.")
        self.keep = keep
        self._lock = None
        check_writable(self.directory)
        locked = None
        if jax.process_index() == 0:  # the run's one writer; its other processes follow it
            try:
                self._lock = lock(self.directory, lease)
            except DirectoryLocked as error:
                locked = error
        if _everywhere(None if locked is None else str(locked)) is not None:
            raise locked or DirectoryLocked(
                f"Checkpoint directory {self.directory} is in use by another writer (process 0 "
                "could not lock it)."
            )
        for name in remove_unfinished(self.directory):
            warn_user(
                f"Removed {name} in {self.directory}: a save that did not finish.",
                CheckpointWarning,
            )
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("substrax checkpoint directory cleaned")
        self.asynchronous = asynchronous
        self._pending: int | None = None  # the step of a save in flight
        atexit.register(_wait_at_exit, weakref.ref(self))
        options = ocp.CheckpointManagerOptions(enable_async_checkpointing=asynchronous, create=True)
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "metadata": ocp.JsonCheckpointHandler(),
                "status": ocp.JsonCheckpointHandler(),
            },
        )

    def latest_step(self) -> int | None:
        """The step of the newest checkpoint (see :meth:`restore` for which one it restores).

        Read from the disk, not remembered.

        Returns:
          The step, or None when the directory holds no checkpoint.
        """
        steps = self.all_steps()
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        """Steps of every checkpoint on disk, oldest first (after a save in flight is done).

        Returns:
          The steps.
        """
        self.wait()
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def wait(self) -> None:
        """Waits for a save in flight to be written, then records its checksums and rotates.

        Raises:
          OSError: If the disk refused it (as :meth:`save` says).
        """
        step, self._pending = self._pending, None
        if step is None:
            return
        with self._disk_errors(step):
            self._manager.wait_until_finished()
            write_checksums(self.directory / str(step))
        self._rotate()

    def metadata(self, step: int | None = None) -> dict:
        """The run metadata saved with a checkpoint, without reading its arrays.

        Without ``step`` it is the newest intact checkpoint's, as :meth:`restore` would
        restore: each newer step that is incomplete or unreadable (its metadata included) is
        skipped with a :class:`CheckpointWarning` and renamed ``<step>.corrupt``.

        Args:
          step: The step; the newest intact one when None.

        Returns:
          The metadata (a data position, settings), as given to :meth:`save`.

        Raises:
          FileNotFoundError: If there is no such checkpoint, or none is intact.
          ValueError: If the requested ``step`` is incomplete or unreadable.
        """
        if step is None:
            return self._newest(self._read_metadata)[1]
        if step not in self.all_steps():
            raise FileNotFoundError(
                f"No checkpoint for step {step} in {self.directory}; steps there: "
                f"{self.all_steps()}."
            )
        metadata, problem = self._read_metadata(step)
        if problem is not None:
            raise ValueError(f"Checkpoint step {step} in {self.directory} is unusable: {problem}.")
        return metadata

    def _read_metadata(self, step: int) -> tuple[dict | None, str | None]:
        """``(metadata, None)`` of an intact ``step``, or ``(None, why it is unusable)``."""
        import orbax.checkpoint as ocp  # on first use (see the module docstring)

        problem = _everywhere(damage(self.directory / str(step)))
        if problem is not None:
            return None, problem
        args = ocp.args.Composite(metadata=ocp.args.JsonRestore())
        read, problem = _guarded(lambda: dict(self._manager.restore(step, args=args).metadata))
        return read, _everywhere(problem)

    def is_finite(self, step: int) -> bool | None:
        """Whether every value saved at ``step`` was finite.

        Args:
          step: A saved step.

        Returns:
          True or False, or None for a checkpoint saved without this record.
        """
        import orbax.checkpoint as ocp  # on first use (see the module docstring)

        self.wait()
        try:
            restored = self._manager.restore(
                step, args=ocp.args.Composite(status=ocp.args.JsonRestore())
            )
        except Exception:  # an older or damaged checkpoint has no record
            return None
        return bool(restored.status["finite"])

    def save(
        self,
        model: nnx.Module,
        optimizer: nnx.Optimizer,
        step: int,
        metadata: dict | None = None,
        *,
        overwrite: bool = False,
    ) -> None:
        """Saves the model's and optimizer's state and ``metadata`` as checkpoint ``step``.

        Takes its arguments in :meth:`restore`'s order: model, optimizer, step. Steps only move
        forward: saving at a step that is not after the latest is an error, since it would
        either keep the old data under that step or leave newer steps that a resume would pick
        up instead. ``overwrite=True`` deletes every checkpoint at or after ``step`` first (a
        rolled-back run that trains again). Asynchronous (the default): returns once the state
        is copied to host memory; the step counts as saved once it is written (see
        :meth:`wait`). Whether every value is finite is recorded with the
        checkpoint; older checkpoints beyond ``keep`` are then deleted, except the newest
        finite one.

        Args:
          model: The model.
          optimizer: Its optimizer.
          step: The step number (the checkpoint's name).
          metadata: JSON-serialisable run information (data position, configuration, ...).
          overwrite: Delete checkpoints at or after ``step`` and save.

        Raises:
          ValueError: If ``step`` is not after the latest checkpoint and ``overwrite`` is False.
          TypeError: If ``metadata`` is not JSON-serialisable (before anything is written).
          RuntimeError: If Orbax declines to save.
          DirectoryLocked: If another writer took the directory's lock over (object storage,
            after this run failed to renew it for ``lease`` seconds).
          OSError: If the disk refuses the step (no space, no permission), naming the newest
            complete step.
        """
        import orbax.checkpoint as ocp  # on first use (see the module docstring)

        _check_arguments(model, optimizer, step, "save")
        _check_json(metadata)
        if self._lock is not None:
            self._lock.check()
        latest = self.latest_step()  # (waits for a save in flight first)
        if latest is not None and step <= latest:
            if not overwrite:
                raise ValueError(
                    f"Cannot save step {step} in {self.directory}: the latest checkpoint there is "
                    f"step {latest} (steps {self.all_steps()}). Save a later step, or pass "
                    f"overwrite=True to delete steps >= {step} first."
                )
            for old in self.all_steps():
                if old >= step:
                    self._manager.delete(old)
        state = _storable(
            {
                "model": nnx.to_pure_dict(nnx.state(model)),
                "optimizer": nnx.to_pure_dict(nnx.state(optimizer)),
            }
        )
        progress(f"checkpoint save of step {step}")
        with self._disk_errors(step):
            saved = self._manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
                    metadata=ocp.args.JsonSave(dict(metadata or {})),
                    status=ocp.args.JsonSave({"finite": _all_finite(state)}),
                ),
            )
            if not saved:
                raise RuntimeError(f"Orbax did not save step {step} in {self.directory}.")
        self._pending = step
        if not self.asynchronous:
            self.wait()

    @contextlib.contextmanager
    def _disk_errors(self, step: int):
        """Turns the disk's refusal, buried in Orbax's errors, into one clear OSError."""
        try:
            yield
        except Exception as error:
            cause = _os_error(error)
            if cause is None:
                raise
            self._pending = None
            complete = self._complete()
            if cause.errno == errno.ENOSPC:
                raise OSError(
                    errno.ENOSPC,
                    f"No space left on the device of {self.directory} while saving step {step}; "
                    "nothing was lost: the newest complete step is "
                    f"{complete[-1] if complete else 'none'} (steps {complete}). Free space, "
                    "then resume.",
                ) from None
            raise OSError(
                cause.errno,
                f"Saving step {step} in {self.directory} failed: {cause.strerror or cause} "
                f"({cause.filename or 'a file of the step'}). Nothing of step {step} was "
                f"committed; the complete steps there are {complete}. Fix the directory's "
                "permissions, then resume.",
            ) from None

    def _complete(self) -> list[int]:
        """The steps on disk whose files are whole (read again, after a failure)."""
        try:
            return [s for s in self.all_steps() if damage(self.directory / str(s)) is None]
        except OSError:
            return []

    def _rotate(self) -> None:
        """Deletes checkpoints beyond the last ``keep``, keeping the newest finite one."""
        steps = self.all_steps()
        old = steps[: -self.keep]
        if not old:
            return
        if not all(self.is_finite(step) is not False for step in steps[-self.keep :]):
            finite = [step for step in old if self.is_finite(step) is not False]
            old = [step for step in old if step != (finite[-1] if finite else None)]
        for step in old:
            self._manager.delete(step)

    def restore(
        self,
        model: nnx.Module,
        optimizer: nnx.Optimizer,
        step: int | None = None,
        *,
        cast: bool = False,
    ) -> dict:
        """Restores a checkpoint into ``model`` and ``optimizer``.

        Each array is read directly into the sharding that the array of ``model`` or
        ``optimizer`` has now, so a model created by substrax under another mesh or strategy
        is restored in its own layout. Without ``step``, the newest intact checkpoint is
        restored: each newer step that is incomplete or unreadable is skipped with a
        :class:`CheckpointWarning` and renamed ``<step>.corrupt``. Restoring a checkpoint
        whose values are not all finite warns and names the newest finite step.

        Args:
          model: The target model, created (sharded) as the run wants it.
          optimizer: Its optimizer.
          step: The checkpoint to restore; the newest intact one when None.
          cast: Allow values saved in another dtype, cast to the target's (with a warning).

        Returns:
          The metadata saved with the checkpoint.

        Raises:
          FileNotFoundError: If there is no checkpoint (or no such step, or no intact one).
          ValueError: If the checkpoint's shapes or paths differ from the targets' (every
            mismatched path is named), its dtypes differ and ``cast`` is False, or the
            requested ``step`` is incomplete or unreadable.
        """
        _check_arguments(model, optimizer, step, "restore")
        self.wait()
        progress(f"restoring a checkpoint from {self.directory}", busy=True)  # no known length
        target = {
            "model": nnx.to_pure_dict(nnx.state(model)),
            "optimizer": nnx.to_pure_dict(nnx.state(optimizer)),
        }
        stored = _storable(target)
        if step is None:
            step, restored = self._newest(lambda s: self._attempt(s, stored, cast))
        else:
            restored = self._restore_step(step, stored, cast)
        finite = self.is_finite(step)
        if finite is False:
            good = [s for s in self.all_steps() if s < step and self.is_finite(s) is not False]
            warn_user(
                f"Checkpoint step {step} in {self.directory} holds non-finite values (NaN or "
                f"inf); the newest finite one is "
                + (f"step {good[-1]}: restore(..., step={good[-1]})." if good else "none."),
                CheckpointWarning,
            )
        state = _keys_back(dict(restored.state), target)
        model_state, optimizer_state = nnx.state(model), nnx.state(optimizer)
        nnx.replace_by_pure_dict(model_state, state["model"])
        nnx.replace_by_pure_dict(optimizer_state, state["optimizer"])
        nnx.update(model, model_state)
        nnx.update(optimizer, optimizer_state)
        return dict(restored.metadata)

    def _restore_step(self, step: int, stored: dict, cast: bool) -> Any:
        if step not in self._manager.all_steps():
            raise FileNotFoundError(
                f"No checkpoint for step {step} in {self.directory}; steps there: "
                f"{self.all_steps()}."
            )
        restored, problem = self._attempt(step, stored, cast)
        if problem is not None:
            raise ValueError(f"Checkpoint step {step} in {self.directory} is unusable: {problem}.")
        return restored

    def _newest(self, read) -> tuple[int, Any]:
        """``(step, read(step))`` of the newest step ``read`` finds intact; sets others aside.

        ``read(step)`` returns ``(value, None)`` or ``(None, why the step is unusable)``.
        """
        skipped = []
        for step in reversed(self.all_steps()):
            value, problem = read(step)
            if problem is None:
                return step, value
            skipped.append(f"step {step}: {problem}")
            self._set_aside(step, problem)
        if not skipped:
            raise FileNotFoundError(f"No checkpoint in {self.directory}; steps there: [].")
        raise FileNotFoundError(
            f"No intact checkpoint in {self.directory} (skipped {'; '.join(skipped)})."
        )

    def _attempt(self, step: int, stored: dict, cast: bool) -> tuple[Any, str | None]:
        """Reads ``step``: ``(restored, None)``, or ``(None, why it is unusable)``.

        A target that does not fit the checkpoint (shapes, paths, dtypes) raises instead: that
        is the caller's mistake, not damage, and an older step would not fit either.
        """
        import orbax.checkpoint as ocp  # on first use (see the module docstring)

        problem = _everywhere(damage(self.directory / str(step)))
        if problem is not None:
            return None, problem
        saved, problem = _guarded(lambda: self._manager.item_metadata(step).state)
        if (problem := _everywhere(problem)) is not None:
            return None, problem
        self._check_target(step, saved, stored, cast)
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(_abstract(stored)), metadata=ocp.args.JsonRestore()
        )
        restored, problem = _guarded(lambda: self._manager.restore(step, args=args))
        return restored, _everywhere(problem)

    def _set_aside(self, step: int, problem: str) -> None:
        """Renames a skipped step to ``<step>.corrupt`` (kept for inspection, out of the way)."""
        warn_user(
            f"Skipped checkpoint step {step} in {self.directory}: {problem}; it is kept as "
            f"{step}.corrupt.",
            CheckpointWarning,
        )
        if jax.process_index() == 0:
            set_aside(self.directory / str(step))
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"substrax checkpoint set aside {step}")
        self._manager.reload()

    def _check_target(self, step: int, saved_tree: Any, target: dict, cast: bool) -> None:
        saved, wanted = _flat(saved_tree), _flat(target)

        def shape(tree, path):
            return tuple(tree[path].shape) if path in tree else "missing"

        problems = [
            f"{path}: checkpoint {shape(saved, path)}, target {shape(wanted, path)}"
            for path in sorted(set(saved) | set(wanted))
            if shape(saved, path) != shape(wanted, path)
        ]
        if problems:
            raise ValueError(
                f"Checkpoint step {step} in {self.directory} does not match the target model: "
                + "; ".join(problems)
            )
        casts = [
            f"{path}: checkpoint {np.dtype(saved[path].dtype)}, target {np.dtype(x.dtype)}"
            for path, x in sorted(wanted.items())
            if np.dtype(saved[path].dtype) != np.dtype(x.dtype)
        ]
        if casts and not cast:
            raise ValueError(
                f"Checkpoint step {step} in {self.directory} holds other dtypes than the target "
                f"model: {'; '.join(casts)}. Create the model in the saved dtypes, or pass "
                "cast=True to cast them."
            )
        if casts:
            warn_user(f"Casting checkpoint step {step}: {'; '.join(casts)}.", CheckpointWarning)

    def close(self) -> None:
        """Waits for a save in flight, releases the manager and the directory's lock."""
        self.wait()
        self._manager.close()
        if self._lock is not None:
            self._lock.release()

    def __del__(self) -> None:
        # a Checkpointer dropped with a save in flight writes it first (as at exit)
        if getattr(self, "_pending", None) is not None:
            self.wait()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def _wait_at_exit(ref: weakref.ref) -> None:
    """At exit: a save still in flight is written before the interpreter goes."""
    checkpointer = ref()
    if checkpointer is not None:
        checkpointer.wait()


def _check_json(metadata: Any) -> None:
    """Raises, before anything is written, unless ``metadata`` is a JSON-serialisable dict.

    Raises:
      TypeError: Naming the key whose value JSON cannot hold.
    """
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise TypeError(f"metadata must be a dict, got {type(metadata).__name__}.")
    for key, value in metadata.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError) as error:
            raise TypeError(
                f"metadata[{key!r}] is not JSON-serialisable ({error}); nothing was saved. "
                "Store numbers, strings, lists and dicts (a path as str(path), an array as "
                ".tolist())."
            ) from None


def _check_arguments(model: Any, optimizer: Any, step: Any, method: str) -> None:
    """Raises unless ``(model, optimizer, step)`` are an nnx Module, Optimizer and int (or None).

    Raises:
      TypeError: Naming the argument, what it got and the order.
    """
    optional = " or None" if method == "restore" else ""
    for name, value, ok in (
        ("model", model, isinstance(model, nnx.Module)),
        ("optimizer", optimizer, isinstance(optimizer, nnx.Optimizer)),
        ("step", step, (isinstance(step, (int, np.integer)) and not isinstance(step, bool))
         or (step is None and method == "restore")),
    ):  # fmt: skip
        if not ok:
            kind = {"model": "an nnx.Module", "optimizer": "an nnx.Optimizer"}.get(
                name, f"an int{optional}"
            )
            raise TypeError(
                f"Checkpointer.{method}(model, optimizer, step, ...): {name} must be {kind}, got "
                f"{type(value).__name__}."
            )


def _os_error(error: BaseException) -> OSError | None:
    """The disk's error (no space, no permission, read-only) behind ``error``, if any.

    TensorStore reports a full disk as ``ValueError: RESOURCE_EXHAUSTED ... No space left on
    device [os_error_code='28']``, not as an OSError: that is read as ENOSPC too. A bare
    ``RESOURCE_EXHAUSTED`` is not: XLA names a device out of memory so.
    """
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EACCES,
                                                          errno.EROFS, errno.EDQUOT):  # fmt: skip
            return error
        if "No space left on device" in str(error):
            return OSError(errno.ENOSPC, "No space left on device")
        error = error.__cause__ or error.__context__
    return None


def _guarded(read) -> tuple[Any, str | None]:
    """``(read(), None)``, or ``(None, "unreadable (...)")`` with the error's first line."""
    try:
        return read(), None
    except Exception as error:  # any read failure makes the step unusable
        lines = str(error).strip().splitlines()
        return None, f"unreadable ({type(error).__name__}: {lines[0][:300] if lines else ''})"
