"""Checkpointer: sharded Orbax checkpoints of a model and its optimizer, restorable anywhere."""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

__all__ = ["Checkpointer"]


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


def _flat_shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {jax.tree_util.keystr(p, simple=True, separator="/"): tuple(x.shape) for p, x in leaves}


class Checkpointer:
    """Saves and restores a model, its optimizer and run metadata with Orbax.

    Every process writes only its own shards; a restore reads each array straight into the
    sharding of the target model and optimizer, whatever mesh, layout or number of processes
    saved it. Saves are atomic (Orbax writes a temporary directory and renames it when every
    process is done), so a run killed mid-save leaves the previous checkpoint intact, and only
    the last ``keep`` checkpoints are kept.
    """

    def __init__(self, directory: str | pathlib.Path, *, keep: int = 3):
        """Opens (or creates) a checkpoint directory.

        Args:
          directory: Where checkpoints go, one subdirectory per step.
          keep: How many checkpoints to keep.

        Raises:
          ValueError: If ``keep`` is smaller than 1.
        """
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}.")
        self.directory = pathlib.Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=False, create=True
        )
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "metadata": ocp.JsonCheckpointHandler(),
            },
        )

    def latest_step(self) -> int | None:
        """The step of the newest complete checkpoint.

        Returns:
          The step, or None when the directory holds no complete checkpoint.
        """
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Steps of every complete checkpoint, oldest first.

        Returns:
          The steps.
        """
        return sorted(self._manager.all_steps())

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
        rolled-back run that trains again).

        Args:
          model: The model.
          optimizer: Its optimizer.
          step: The step number (the checkpoint's name).
          metadata: JSON-serialisable run information (data position, configuration, ...).
          overwrite: Delete checkpoints at or after ``step`` and save.

        Raises:
          ValueError: If ``step`` is not after the latest checkpoint and ``overwrite`` is False.
          RuntimeError: If Orbax declines to save.
        """
        latest = self.latest_step()
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
        saved = self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                metadata=ocp.args.JsonSave(dict(metadata or {})),
            ),
        )
        self._manager.wait_until_finished()
        if not saved:
            raise RuntimeError(f"Orbax did not save step {step} in {self.directory}.")

    def restore(self, model: nnx.Module, optimizer: nnx.Optimizer, step: int | None = None) -> dict:
        """Restores checkpoint ``step`` (the latest when None) into ``model`` and ``optimizer``.

        Each array is read directly into the sharding that the array of ``model`` or
        ``optimizer`` has now, so a model created by substrax under another mesh or strategy
        is restored in its own layout.

        Args:
          model: The target model, created (sharded) as the run wants it.
          optimizer: Its optimizer.
          step: The checkpoint to restore; the latest when None.

        Returns:
          The metadata saved with the checkpoint.

        Raises:
          FileNotFoundError: If there is no checkpoint (or no such step) in the directory.
          ValueError: If the checkpoint's shapes or paths differ from the targets'; the message
            names every mismatched path.
        """
        step = self.latest_step() if step is None else step
        if step is None or step not in self._manager.all_steps():
            raise FileNotFoundError(
                f"No checkpoint {'' if step is None else f'for step {step} '}in "
                f"{self.directory}; steps there: {self.all_steps()}."
            )
        target = {
            "model": nnx.to_pure_dict(nnx.state(model)),
            "optimizer": nnx.to_pure_dict(nnx.state(optimizer)),
        }
        stored = _storable(target)
        self._check_shapes(step, stored)
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(_abstract(stored)),
                metadata=ocp.args.JsonRestore(),
            ),
        )
        state = _keys_back(dict(restored.state), target)
        model_state, optimizer_state = nnx.state(model), nnx.state(optimizer)
        nnx.replace_by_pure_dict(model_state, state["model"])
        nnx.replace_by_pure_dict(optimizer_state, state["optimizer"])
        nnx.update(model, model_state)
        nnx.update(optimizer, optimizer_state)
        return dict(restored.metadata)

    def _check_shapes(self, step: int, target: dict) -> None:
        saved_tree = self._manager.item_metadata(step).state
        saved = {path: tuple(shape) for path, shape in _flat_shapes(saved_tree).items()}
        wanted = _flat_shapes(target)
        problems = [
            f"{path}: checkpoint {saved.get(path, 'missing')}, target {wanted.get(path, 'missing')}"
            for path in sorted(set(saved) | set(wanted))
            if saved.get(path) != wanted.get(path)
        ]
        if problems:
            raise ValueError(
                f"Checkpoint step {step} in {self.directory} does not match the target model: "
                + "; ".join(problems)
            )

    def close(self) -> None:
        """Waits for pending work and releases the manager."""
        self._manager.close()
