"""Rematerialisation policies by name, as the planner names them (:data:`REMAT`).

A policy says which activations of a recomputed block are kept for the backward pass:

- ``"none"``: no recomputation (the block is not checkpointed at all);
- ``"selective"``: keep the outputs of matrix products with the weights, recompute the rest:
  element-wise work, norms, and attention's scores and probabilities (batched products) --
  jax's ``dots_with_no_batch_dims_saveable``;
- ``"offload"``: ``"selective"``'s saved products, moved to the host's memory (pinned host)
  after the forward pass and brought back for the backward pass -- jax's
  ``offload_dot_with_no_batch_dims``. The device keeps what ``"full"`` keeps plus the
  transfers in flight, and recomputes what ``"selective"`` recomputes; the cost is the
  transfers (over PCIe on a GPU host, the host link on a TPU), which XLA overlaps with
  compute. XLA:TPU and XLA:GPU move them; XLA:CPU has no separate host memory and keeps them
  on the device, as ``"selective"`` does (same values and temporaries);
- ``"full"``: keep nothing inside the block: only its input is saved, and the whole block is
  recomputed in the backward pass.

A checkpoint saves memory only around a block of a model (a layer), so that the backward pass
recomputes one block at a time: a framework adapter applies the policy to the blocks that
model code marks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["REMAT", "checkpoint_policy"]

REMAT = ("none", "selective", "offload", "full")
"""Remat policies, from most device memory (and no recomputation) to least."""


def checkpoint_policy(remat: str, *, never_save: Sequence[str] = ()) -> Callable[..., Any] | None:
    """The ``jax.checkpoint`` policy of a named remat setting.

    Args:
      remat: One of :data:`REMAT`.
      never_save: Checkpoint names whose values are recomputed whatever the policy (such as
        gathered parameters, which a step may prefer to gather again).

    Returns:
      A policy for ``jax.checkpoint(f, policy=...)``, or None when nothing is to be
      recomputed (``"none"`` without ``never_save``).

    Raises:
      ValueError: If ``remat`` is not one of :data:`REMAT`.
    """
    if remat not in REMAT:
        raise ValueError(f"remat must be one of {REMAT}, got {remat!r}.")
    import jax  # here: the planner reads REMAT without importing jax

    policies = jax.checkpoint_policies
    if remat == "full":
        return policies.nothing_saveable
    if remat == "none":
        return policies.save_anything_except_these_names(*never_save) if never_save else None
    if remat == "offload":
        base = policies.offload_dot_with_no_batch_dims("device", "pinned_host")
    else:
        base = policies.dots_with_no_batch_dims_saveable
    if not never_save:
        return base
    excluded = set(never_save)

    def policy(prim, *args, **params):
        if params.get("name") in excluded:
            return False
        return base(prim, *args, **params)

    return policy
