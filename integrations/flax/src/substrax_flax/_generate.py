"""generate: tokens sampled from a model at its layout, one at a time.

A model with a KV cache (``init_cache``, ``model(tokens, decode=True)``) decodes through
:func:`~substrax_flax.make_decode_step`: one prefill of the prompt, then one position per
token, its cache sharded as planned. A model without one runs its forward over the whole
window for each token (prompt and tokens so far, in a buffer of fixed length, so one program
serves every position) at the model's layout, as :func:`~substrax_flax.make_eval_step` runs
it, and samples from the logits at the last filled position; a causal model's logits there do
not see the buffer's unfilled tail. That costs ``new_tokens`` forwards of ``prompt +
new_tokens`` positions where the cache computes one position per token.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from substrax_flax._cache import equal
from substrax_flax._decode import make_decode_step
from substrax_flax._eval import make_eval_step

__all__ = ["generate", "sampler"]


def sampler(temperature: float = 0.0, top_k: int | None = None) -> Callable:
    """A jitted ``sample(logits [rows, vocab], key) -> tokens [rows]``.

    Args:
      temperature: 0 for greedy decoding (the largest logit); otherwise the logits are
        divided by it before sampling.
      top_k: Sample among the ``top_k`` largest logits only (None: all).

    Returns:
      The sampler. Its draws are the whole batch's: the same key gives the same tokens
      whatever the layout (jax's threefry draws are partitionable).

    Raises:
      ValueError: For a negative temperature or a ``top_k`` below 1.
    """
    if not temperature >= 0:
        raise ValueError(f"temperature must be 0 (greedy) or positive, got {temperature!r}.")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}.")

    @jax.jit
    def sample(logits, key):
        logits = logits.astype(jnp.float32)
        if temperature == 0:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        if top_k is not None:
            kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
            logits = jnp.where(logits < kth, -jnp.inf, logits)
        return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)

    return sample


def _next_logits(logits_fn: Callable) -> Callable:
    def fn(model, batch):
        logits = logits_fn(model, batch["tokens"])  # [rows, window, vocab]
        last = jax.lax.dynamic_index_in_dim(logits, batch["position"] - 1, axis=1, keepdims=False)
        return {"logits": last}

    return fn


def generate(
    model: nnx.Module,
    prompt: Any,
    new_tokens: int,
    *,
    logits_fn: Callable[[nnx.Module, jax.Array], jax.Array] | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int = 0,
    cache: bool | None = None,
) -> np.ndarray:
    """Appends ``new_tokens`` sampled tokens to each row of ``prompt``, at the model's layout.

    With a KV cache (the default for a model that has ``init_cache``), the prompt is prefilled
    at once and each token then computes one position (:func:`make_decode_step`: the cache is
    sharded as planned, rows over the batch axes, heads over the tensor axes). Without one,
    each token runs the eval step's forward over the whole window (rows split over the batch
    axes, each parameter gathered once per token). The sampling is the whole batch's, so the
    same seed gives one device's tokens on every layout. One process (the prompt is its rows).

    Args:
      model: A causal language model laid out by substrax (``model.eval()`` first: no
        dropout).
      prompt: ``int[rows, length]`` token rows; ``rows`` must divide over the batch axes.
      new_tokens: How many tokens to append.
      logits_fn: ``logits_fn(model, tokens [rows, length]) -> logits [rows, length, vocab]``
        (default: ``model(tokens, decode=True)`` with the cache, ``model(tokens)`` without).
      temperature: 0 (the default) for greedy decoding, else the sampling temperature.
      top_k: Sample among the ``top_k`` largest logits (None: all).
      seed: The sampling key's seed (token ``i`` draws with ``fold_in(key(seed), i)``).
      cache: Decode with the model's KV cache (None: when the model has ``init_cache`` and
        no ``logits_fn`` is given); False runs the whole window per token.

    Returns:
      ``int32[rows, length + new_tokens]``: the prompt and its continuation.

    Raises:
      ValueError: If ``prompt`` is not a 2-D integer array, ``new_tokens`` is not positive,
        the run has several processes, or as :func:`sampler`.
    """
    prompt = np.asarray(prompt)
    if prompt.ndim != 2 or not np.issubdtype(prompt.dtype, np.integer):
        raise ValueError(
            f"prompt must be int token rows [rows, length], got {prompt.dtype}{list(prompt.shape)}."
        )
    if not isinstance(new_tokens, int) or new_tokens < 1:
        raise ValueError(f"new_tokens must be a positive integer, got {new_tokens!r}.")
    if jax.process_count() > 1:
        raise ValueError(
            f"generate runs in one process (its prompt is every row); this run has "
            f"{jax.process_count()} processes. Generate from one process's model, or "
            "evaluate with make_eval_step, which takes each process's rows."
        )
    sample = sampler(temperature, top_k)
    rows, length = prompt.shape
    tokens = np.zeros((rows, length + new_tokens), np.int32)
    tokens[:, :length] = prompt
    key = jax.random.key(seed)
    if cache is None:
        cache = hasattr(model, "init_cache") and logits_fn is None
    if cache:
        step = _reused(model, ("decode", nnx.graphdef(model), rows, length + new_tokens,
                               logits_fn),
                       lambda: make_decode_step(model, rows, length + new_tokens,
                                                logits_fn=logits_fn))  # fmt: skip
        step.reset(model)
        logits = step(model, prompt)
        for i in range(new_tokens):
            tokens[:, length + i] = np.asarray(sample(logits, jax.random.fold_in(key, i)))
            if i + 1 < new_tokens:
                logits = step(model, tokens[:, length + i : length + i + 1])
        return tokens
    step = _reused(model, ("window", logits_fn), lambda: make_eval_step(
        _next_logits(logits_fn or (lambda model, tokens: model(tokens)))))  # fmt: skip
    for i in range(new_tokens):
        batch = {"tokens": tokens, "position": np.int32(length + i)}
        logits = step(model, batch)["logits"]
        tokens[:, length + i] = np.asarray(sample(logits, jax.random.fold_in(key, i)))
    return tokens


#: Each model's decode and eval steps, reused by later calls (their compiled programs too).
_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _reused(model: nnx.Module, key: tuple, make: Callable) -> Any:
    """The step ``make()`` built for ``model`` under ``key`` before, or a new one.

    Keys are compared by equality, never hashed, as the train step's programs are
    (:mod:`substrax_flax._cache`): the model's graph definition in them may hold a plain
    dataclass config, which cannot be hashed.
    """
    steps = _STEPS.setdefault(model, [])
    for stored, step in steps:
        if equal(stored, key):
            return step
    step = make()
    steps.append((key, step))
    return step
