"""Training data from files: token ids or text, in windows, batched per process with Grain.

A run's data in three lines::

    tokens = substrax.data.load_tokens("corpus.txt")          # or .bin / .npy / .jsonl
    train, held = substrax.data.TokenWindows(tokens, seq=256).split(held_out=0.05)
    batches = substrax.data.Batches(train, batch_size=64, seed=0)
    rows = batches(step)                                      # this process's rows, (b, 257)

The order is deterministic in the seed and the step, each process reads only its rows, and
``batches.state(step)`` saved with a checkpoint continues the order exactly on resume
(``batches.resumed(state, step)``), on any number of processes. Needs ``grain``
(``pip install 'substrax[data]'``); a Hugging Face tokenizer needs ``tokenizers`` too.
"""

from substrax.data._batches import Batches as Batches
from substrax.data._tokens import DOCUMENT_SEPARATOR as DOCUMENT_SEPARATOR
from substrax.data._tokens import FORMATS as FORMATS
from substrax.data._tokens import Tokens as Tokens
from substrax.data._tokens import decode as decode
from substrax.data._tokens import encode as encode
from substrax.data._tokens import load_tokens as load_tokens
from substrax.data._windows import TokenWindows as TokenWindows

__all__ = [
    "DOCUMENT_SEPARATOR",
    "FORMATS",
    "Batches",
    "TokenWindows",
    "Tokens",
    "decode",
    "encode",
    "load_tokens",
]
