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
    parallelism ``mlp``. Routing, dispatch (sorted and dropless by default) and the losses
    are :func:`substrax.spmd.experts`'.

    Shared experts (``shared_hidden``, DeepSeek-MoE and Qwen-MoE) are one gated MLP every
    token goes through, added to the routed output. A router bias (``bias_rate``,
    DeepSeek-V3's load balancing without an auxiliary loss) is a
    :class:`RouterBias` variable, not a parameter: each call in training moves it by
    ``bias_rate`` towards an even load (up for an expert with fewer choices than the mean,
    down for one with more), so a train step that updates the model's other variables
    (batch statistics) updates it too; :meth:`nnx.Module.eval` freezes it.

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
        routing: str = "softmax",
        normalize: bool = True,
        dispatch: str = "sorted",
        capacity_factor: float | None = None,
        activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu,
        gated: bool = False,
        shared_hidden: int | None = None,
        bias_rate: float | None = None,
        param_dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        """Creates the router and the experts' weights.

        Args:
          features: The width of the tokens.
          hidden: Each expert's hidden width.
          num_experts: The number of experts.
          top_k: Experts per token.
          routing: The router's scoring, one of :data:`substrax.spmd.ROUTINGS`.
          normalize: Renormalise the chosen experts' weights to sum to 1.
          dispatch: ``"sorted"`` (dropless) or ``"one-hot"`` (capacity slots).
          capacity_factor: ``"one-hot"`` only: slots per expert relative to an even load;
            None drops no token.
          activation: The experts' activation (``jax.nn.silu`` for Mixtral's experts).
          gated: Gated experts, ``activation(x @ w_gate) * (x @ w_in)`` (``w_gate`` named as
            ``w_in``).
          shared_hidden: The hidden width of the shared experts (a gated MLP with this
            activation, ``shared_in``, ``shared_gate`` ``("embed", "mlp")`` and
            ``shared_out`` ``("mlp", "embed")``), or None for none.
          bias_rate: The step of the router bias's update, or None for no bias.
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
        if bias_rate is not None and not bias_rate > 0:
            raise ValueError(f"bias_rate must be positive or None, got {bias_rate!r}.")
        self.top_k, self.capacity_factor, self.activation = top_k, capacity_factor, activation
        self.routing, self.normalize, self.dispatch = routing, normalize, dispatch
        self.bias_rate, self.deterministic = bias_rate, False
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
        if shared_hidden is not None:
            dense = nnx.initializers.lecun_normal()
            for name, shape, names in (
                ("shared_in", (features, shared_hidden), ("embed", "mlp")),
                ("shared_gate", (features, shared_hidden), ("embed", "mlp")),
                ("shared_out", (shared_hidden, features), ("mlp", "embed")),
            ):
                param = nnx.Param(dense(rngs.params(), shape, param_dtype), out_sharding=names)
                setattr(self, name, param)
        if bias_rate is not None:
            self.router_bias = RouterBias(jnp.zeros((num_experts,), jnp.float32))

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
        bias = self.router_bias[...] if hasattr(self, "router_bias") else None
        y, stats = experts(
            x, self.router[...], self.w_in[...], self.w_out[...], w_gate=gate, top_k=self.top_k,
            routing=self.routing, normalize=self.normalize, router_bias=bias,
            dispatch=self.dispatch, capacity_factor=self.capacity_factor,
            activation=self.activation,
        )  # fmt: skip
        if hasattr(self, "shared_in"):
            h = x @ self.shared_in[...].astype(x.dtype)
            h = self.activation(x @ self.shared_gate[...].astype(x.dtype)) * h
            y = y + h @ self.shared_out[...].astype(x.dtype)
        if bias is not None and not self.deterministic:
            even = jnp.mean(stats.counts)
            step = self.bias_rate * jnp.sign(even - stats.counts)
            self.router_bias[...] = bias + jax.lax.stop_gradient(step)
        return y, stats


class RouterBias(nnx.Variable):
    """A router's load-balancing bias: state the step carries, not a trained parameter."""
