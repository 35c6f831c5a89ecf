"""Windows of tokens: the rows a batch is made of."""

from __future__ import annotations

import numpy as np

from substrax.data._tokens import Tokens


class TokenWindows:
    """Windows of ``seq + 1`` consecutive token ids: one row of a batch each.

    Window ``i`` starts at id ``(start + i) * seq``, so consecutive windows share one id and
    every id is a target once per pass over the data. It is a Grain random-access source
    (``__len__`` and ``__getitem__``), read lazily: a memory-mapped file is touched only at
    the windows asked for.

    Args:
        tokens: The ids.
        seq: Tokens per row (each window holds ``seq + 1`` ids: inputs and shifted targets).
        start: The first window, counted from the start of the ids.
        stop: One past the last window (None: as many as the ids hold).

    Raises:
        ValueError: If ``seq`` is not positive or the ids hold no whole window in
            ``[start, stop)``.
    """

    def __init__(self, tokens: Tokens, seq: int, *, start: int = 0, stop: int | None = None):
        if seq < 1:
            raise ValueError(f"seq={seq}: expected a positive number of tokens per row")
        whole = (tokens.ids.size - 1) // seq
        stop = whole if stop is None else min(stop, whole)
        if not 0 <= start < stop:
            raise ValueError(
                f"{tokens.source!r}: {tokens.ids.size} ids hold {whole} window(s) of "
                f"{seq + 1} tokens; windows [{start}, {stop}) hold none. Use a shorter seq "
                "or more data"
            )
        self.tokens, self.seq, self.start, self.stop = tokens, seq, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} of {len(self)}")
        first = (self.start + index) * self.seq
        return np.asarray(self.tokens.ids[first : first + self.seq + 1], np.int32)

    def __repr__(self) -> str:
        return (
            f"TokenWindows({self.tokens.source!r}, seq={self.seq}, windows "
            f"[{self.start}, {self.stop}))"
        )

    def split(self, held_out: float) -> tuple[TokenWindows, TokenWindows]:
        """The windows to train on and the last ``held_out`` fraction of them, kept apart.

        Args:
            held_out: The fraction of windows held out, in ``(0, 1)``; at least one window.

        Returns:
            ``(train, held)``: disjoint windows, ``held`` at the end of the ids.

        Raises:
            ValueError: If ``held_out`` is outside ``(0, 1)`` or leaves no window to train on.
        """
        if not 0 < held_out < 1:
            raise ValueError(f"held_out={held_out}: expected a fraction between 0 and 1")
        held = max(1, round(len(self) * held_out))
        cut = self.stop - held
        if cut <= self.start:
            raise ValueError(
                f"held_out={held_out} of {len(self)} window(s) leaves none to train on"
            )
        return (
            TokenWindows(self.tokens, self.seq, start=self.start, stop=cut),
            TokenWindows(self.tokens, self.seq, start=cut, stop=self.stop),
        )
