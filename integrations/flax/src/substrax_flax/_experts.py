"""``substrax_flax.MixtureOfExperts``: an NNX mixture-of-experts feed-forward layer."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from substrax.spmd import ExpertStats, experts

__all__ = ["MixtureOfExperts"]


class MixtureOfExperts(nnx.Module):
    """A top-k routed mixture of feed-forward experts, expert parallel under an ``ep`` layout.

    Its parameters carry logical names: ``router`` ``("embed", None)``, ``w_in``
    ``("expert", "embed", "mlp")`` and ``w_out`` ``("expert", "mlp", "embed")``, so a layout
    with expert axes shards the experts over them, FSDP splits ``embed`` and tensor
    parallelism ``mlp``. Routing, capacity, the token-dropping policy and the load-balancing
    loss are :func:`substrax.spmd.experts`'.

    Example::

      moe = sf.MixtureOfExperts(256, 1024, num_experts=8, rngs=nnx.Rngs(0))
      y, stats = moe(x)                     # x: [batch, length, 256]
      loss = task_loss + 0.01 * stats.aux_loss
    """

    def __init__(
        self,
        features: int,
        hidden: int,
        num_experts: int,
        *,
        top_k: int = 2,
        capacity_factor: float | None = 1.25,
        activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu,
        gated: bool = False,
        param_dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        """Creates the router and the experts' weights.

        Args:
          features: The width of the tokens.
          hidden: Each expert's hidden width.
          num_experts: The number of experts.
          top_k: Experts per token.
          capacity_factor: Slots per expert relative to an even load; None drops no token
            (exact, ``num_experts`` x tokens slots: for tests and small models).
          activation: The experts' activation (``jax.nn.silu`` for Mixtral's experts).
          gated: Gated experts, ``activation(x @ w_gate) * (x @ w_in)`` (``w_gate`` named as
            ``w_in``).
          param_dtype: The parameters' dtype.
          rngs: The random streams (``params`` is used).

        Raises:
          ValueError: If a size is not positive or ``top_k`` exceeds ``num_experts``.
        """
        for name, value in (("features", features), ("hidden", hidden),
                            ("num_experts", num_experts)):  # fmt: skip
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k!r}.")
        self.top_k, self.capacity_factor, self.activation = top_k, capacity_factor, activation
        expert_init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        router_init = nnx.initializers.normal(features**-0.5)
        self.router = nnx.Param(
            router_init(rngs.params(), (features, num_experts), param_dtype),
            out_sharding=("embed", None),
        )
        self.w_in = nnx.Param(
            expert_init(rngs.params(), (num_experts, features, hidden), param_dtype),
            out_sharding=("expert", "embed", "mlp"),
        )
        self.w_out = nnx.Param(
            expert_init(rngs.params(), (num_experts, hidden, features), param_dtype),
            out_sharding=("expert", "mlp", "embed"),
        )
        if gated:
            self.w_gate = nnx.Param(
                expert_init(rngs.params(), (num_experts, features, hidden), param_dtype),
                out_sharding=("expert", "embed", "mlp"),
            )

    def __call__(self, x: jax.Array) -> tuple[jax.Array, ExpertStats]:
        """Routes ``x`` through its experts.

        Args:
          x: Tokens ``[batch, length, features]``.

        Returns:
          ``(y, stats)``: the output, shaped as ``x``, and the routing's
          :class:`~substrax.spmd.ExpertStats` (add ``stats.aux_loss`` to the loss).

        Raises:
          ValueError: If ``x`` is not ``[batch, length, features]`` or the experts do not
            divide over the layout's expert axes.
        """
        gate = self.w_gate[...] if hasattr(self, "w_gate") else None
        return experts(
            x, self.router[...], self.w_in[...], self.w_out[...], w_gate=gate, top_k=self.top_k,
            capacity_factor=self.capacity_factor, activation=self.activation,
        )  # fmt: skip
