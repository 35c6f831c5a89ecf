"""Each step's batch of windows, in a seeded order, read per process; its saved position."""

from __future__ import annotations

import copy

import grain
import jax
import numpy as np

from substrax.data._windows import TokenWindows

_STATE_KEYS = ("fingerprint", "seq", "windows", "seed", "shuffle")


class Batches:
    """The global batch of each step as windows in a seeded order; each process reads its rows.

    The order is Grain's: ``grain.MapDataset.source(windows).shuffle(seed=seed)``, a random
    permutation of the windows drawn again for every pass (epoch) over them, so batch ``step``
    is a function of the seed and the step alone. Global batch ``step`` is the windows at
    positions ``offset + step * batch_size`` onward; a process reads only its contiguous share
    of them (process ``p`` of ``P`` the rows ``[p * b, (p + 1) * b)`` with
    ``b = batch_size / P``), which is the slice of the global batch that
    ``jax.make_array_from_process_local_data`` expects of it. The global batch is therefore the
    same on any number of processes and devices, and :meth:`state` and :meth:`resumed` carry
    the position across a resume, elastic or not.

    Args:
        windows: The rows to draw.
        batch_size: Rows per global batch.
        seed: The order's seed, in ``[0, 2**32)``.
        shuffle: False reads the windows in file order (evaluation).
        vocab_size: The model's vocabulary: a window holding an id at or above it is refused,
            naming the id. None checks nothing.
        process_index: This process (default ``jax.process_index()``).
        process_count: The processes sharing each batch (default ``jax.process_count()``).
        offset: Windows consumed before step 0 (set by :meth:`resumed`).

    Raises:
        ValueError: If ``batch_size`` is not positive or does not split over the processes, or
            the seed is out of range.
    """

    def __init__(
        self,
        windows: TokenWindows,
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        vocab_size: int | None = None,
        process_index: int | None = None,
        process_count: int | None = None,
        offset: int = 0,
    ):
        count = jax.process_count() if process_count is None else process_count
        index = jax.process_index() if process_index is None else process_index
        if batch_size < 1 or batch_size % count:
            raise ValueError(
                f"batch_size={batch_size} does not split over {count} process(es); use a "
                f"positive multiple of {count}"
            )
        if not 0 <= seed < 2**32:
            raise ValueError(f"seed={seed}: expected an integer in [0, 2**32)")
        if not 0 <= index < count:
            raise ValueError(f"process_index={index}: expected one of 0..{count - 1}")
        dataset = grain.MapDataset.source(windows)
        self.dataset = dataset.shuffle(seed=seed) if shuffle else dataset
        self.windows, self.batch_size, self.seed, self.shuffle = windows, batch_size, seed, shuffle
        self.vocab_size, self.offset = vocab_size, offset
        self.rows_per_process = batch_size // count
        self.first_row = index * self.rows_per_process

    def __call__(self, step: int) -> np.ndarray:
        """This process's rows of global batch ``step``: int32, ``(rows, seq + 1)``.

        Raises:
            ValueError: If a window holds an id outside the vocabulary.
        """
        first = self.position(step) + self.first_row
        rows = np.stack([self.dataset[i] for i in range(first, first + self.rows_per_process)])
        if self.vocab_size is not None and rows.size and int(rows.max()) >= self.vocab_size:
            raise ValueError(
                f"{self.windows.tokens.source!r} holds token id {int(rows.max())}, outside the "
                f"model's vocabulary of {self.vocab_size}: use a vocabulary of at least "
                f"{int(rows.max()) + 1} or the tokenizer that wrote the file"
            )
        return rows

    def position(self, step: int) -> int:
        """Windows consumed before global batch ``step`` (counting repeated passes)."""
        return self.offset + step * self.batch_size

    def state(self, step: int) -> dict:
        """What a checkpoint of ``step`` keeps to continue the order exactly (JSON-ready)."""
        return {
            "source": self.windows.tokens.source,
            "fingerprint": self.windows.tokens.fingerprint,
            "seq": self.windows.seq,
            "windows": len(self.windows),
            "seed": self.seed,
            "shuffle": self.shuffle,
            "position": self.position(step),
        }

    def resumed(self, state: dict, step: int) -> Batches:
        """These batches continued from a checkpoint's :meth:`state` at ``step``.

        Step ``step`` then reads the window the saved run would have read next, whatever the
        batch size or the number of processes now.

        Raises:
            ValueError: If the saved state is of other data, another ``seq``, another split
                or seed: it names each difference.
        """
        mine = self.state(step)
        differ = [
            f"{key} {state.get(key)!r} (now {mine[key]!r})"
            for key in _STATE_KEYS
            if state.get(key) != mine[key]
        ]
        if differ:
            raise ValueError(
                f"the checkpoint's data position is for other data: {', '.join(differ)}; "
                f"it read {state.get('source')!r}. Resume with the same data, seq, seed and "
                "held-out split, or start a new run"
            )
        resumed = copy.copy(self)
        resumed.offset = int(state["position"]) - step * self.batch_size
        return resumed
