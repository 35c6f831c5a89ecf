"""Routers: which ``top_k`` experts each token goes to, and with what weights.

Three scorings cover the mixtures people publish:

* ``"softmax"``: a softmax over every expert, the ``top_k`` largest chosen, their weights
  renormalised to sum to 1 when ``normalize`` (Switch Transformer, Qwen-MoE's
  ``norm_topk_prob``). Normalised, it equals ``"topk-softmax"``.
* ``"topk-softmax"``: the ``top_k`` largest logits, a softmax over them (Mixtral, gpt-oss).
* ``"sigmoid"``: a sigmoid per expert, the ``top_k`` largest chosen, renormalised when
  ``normalize`` (DeepSeek-V3).

A router ``bias`` ``[experts]`` moves the choice only, never the weights (DeepSeek-V3's
load balancing without an auxiliary loss: raise the bias of an expert that gets too few
tokens, lower it for one that gets too many).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["ROUTINGS", "Route", "route"]

#: The router scorings :func:`route` takes.
ROUTINGS = ("softmax", "topk-softmax", "sigmoid")


class Route(NamedTuple):
    """One group's routing.

    Attributes:
      gates: Each choice's weight ``[tokens, top_k]`` (float32).
      index: Each choice's expert ``[tokens, top_k]``, best first.
      probs: The router's probabilities ``[tokens, experts]`` for the load-balancing loss
        (the softmax; for ``"sigmoid"``, the scores normalised per token).
      z: Each token's ``logsumexp`` of the logits ``[tokens]`` (for the z-loss).
    """

    gates: jax.Array
    index: jax.Array
    probs: jax.Array
    z: jax.Array


def route(
    logits: jax.Array,
    top_k: int,
    routing: str = "softmax",
    *,
    normalize: bool = True,
    bias: jax.Array | None = None,
) -> Route:
    """Routes each token to its ``top_k`` experts.

    Args:
      logits: The router's logits ``[tokens, experts]`` (float32).
      top_k: Experts per token.
      routing: One of :data:`ROUTINGS`.
      normalize: Renormalise the chosen weights to sum to 1 (``"softmax"`` and
        ``"sigmoid"``; ``"topk-softmax"`` always sums to 1).
      bias: A bias ``[experts]`` added to the scores for the choice only, or None.

    Returns:
      The :class:`Route`.

    Raises:
      ValueError: If ``routing`` is not one of :data:`ROUTINGS`.
    """
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}.")
    probs = jax.nn.softmax(logits, axis=-1)
    if routing == "sigmoid":
        scores = jax.nn.sigmoid(logits)
        probs = scores / scores.sum(-1, keepdims=True)
    else:
        scores = logits if routing == "topk-softmax" else probs
    choice = scores if bias is None else scores + jax.lax.stop_gradient(bias).astype(scores.dtype)
    _, index = jax.lax.top_k(choice, top_k)
    gates = jnp.take_along_axis(scores, index, axis=-1)
    if routing == "topk-softmax":
        gates = jax.nn.softmax(gates, axis=-1)
    elif normalize:
        gates = gates / gates.sum(-1, keepdims=True)
    return Route(gates, index, probs, jax.nn.logsumexp(logits, axis=-1))
