"""make_decode_step: prefill and one-token decode with a KV cache planned like the parameters.

A model that decodes with a cache follows Flax's own convention (``nnx.MultiHeadAttention``):
``model.init_cache(batch_size, max_length)`` creates its ``nnx.Cache`` variables, each with
logical names in its metadata (``out_sharding=("batch", "seq", "heads", "head_dim")``, in the
names the model's activations use), and ``model(tokens, decode=True)`` appends the keys and
values of ``tokens`` at the cache's index, attends over every cached position up to each
token's, and advances the index. The decode step creates that cache already sharded (inside
``jit``, each variable's names resolved through the layout's compute rules: the batch over the
batch axes, heads over the tensor axes), then runs the prefill (the prompt at once) and each
one-token step with the parameters in their planned shardings and the cache donated, so it is
updated in place. XLA partitions each step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from substrax.spmd import use_rules
from substrax_flax._jitted import rehome
from substrax_flax._plan import ModelPlan, model_plan, shardings_of
from substrax_flax._probes import cheap_sharding_probes
from substrax_flax._resolve import Resolver, VariableSharding
from substrax_flax._state import map_variables
from substrax_flax._step_plan import step_mesh

__all__ = ["DecodeStep", "make_decode_step"]


class DecodeStep:
    """A model's KV cache, laid out, and its prefill and one-token decode programs.

    Build it with :func:`make_decode_step`; :func:`~substrax_flax.generate` builds one for a
    model that has ``init_cache``.
    """

    def __init__(self, model: nnx.Module, batch_size: int, max_length: int, plan: ModelPlan,
                 logits_fn: Callable):  # fmt: skip
        """Plans and creates the cache; see :func:`make_decode_step`.

        Args:
          model: The model, laid out by ``plan``.
          batch_size: Rows decoded at once.
          max_length: Positions the cache holds.
          plan: The model's plan (its mesh, rules and parameter shardings).
          logits_fn: ``logits_fn(model, tokens) -> logits`` with the cache.
        """
        self.batch_size, self.max_length, self.logits_fn = batch_size, max_length, logits_fn
        # the train step's mesh: a model written for Auto axes on an Explicit mesh runs on its
        # Auto twin (mesh_decision says which, and why)
        self.mesh, self.mesh_decision = step_mesh(plan)
        self.rules = plan.compute_rules
        graphdef, state = nnx.split(model, nnx.Not(nnx.Cache))
        self._source = graphdef
        self._state_sh = shardings_of(plan.rows, state, self.mesh)
        make, self._graphdef = self._maker(graphdef, batch_size, max_length)
        abstract = jax.eval_shape(make, state)
        self.rows = _cache_rows(abstract, self.rules, self.mesh)
        by_path = {row.path: row for row in self.rows}
        self._cache_sh = map_variables(
            lambda path, _: NamedSharding(self.mesh, by_path[path].spec), abstract
        )
        # the token ids are a few bytes: replicated; the embedding's output is laid out by the
        # model's own constraint (its rows over the batch axes)
        self._tokens_sh = NamedSharding(self.mesh, PartitionSpec())
        self._make = jax.jit(make, in_shardings=(self._state_sh,), out_shardings=self._cache_sh)
        self.reset(model)
        self._run = jax.jit(self._step, in_shardings=(self._state_sh, self._cache_sh,
                                                      self._tokens_sh),
                            out_shardings=(None, self._cache_sh), donate_argnums=(1,))  # fmt: skip

    @property
    def bytes_per_device(self) -> int:
        """The cache's bytes on one device, as planned."""
        return sum(row.bytes_per_device for row in self.rows)

    def reset(self, model: nnx.Module) -> None:
        """Empties the cache for new prompts (the same compiled programs serve them).

        Args:
          model: The model the step was made for.
        """
        state = self._state_of(model)
        with jax.set_mesh(self.mesh):
            self.cache = self._make(state)

    def _state_of(self, model: nnx.Module) -> Any:
        graphdef, state = nnx.split(model, nnx.Not(nnx.Cache))
        if graphdef != self._source:
            raise ValueError(
                "The model's structure changed since its decode step was made (a mode switched, "
                "a variable added): make a new one with make_decode_step."
            )
        return rehome(state, self.mesh)

    def __call__(self, model: nnx.Module, tokens: Any) -> jax.Array:
        """Appends ``tokens`` to the cache and returns the logits after the last of them.

        The prefill passes the whole prompt at once; each later call passes one token per
        row.

        Args:
          model: The model the step was made for (its current parameters are used).
          tokens: ``int[batch_size, length]``.

        Returns:
          ``float32[batch_size, vocab]``: the logits at each row's last token.

        Raises:
          ValueError: If ``tokens`` has another batch size, or the cache has no room left.
        """
        tokens = np.asarray(tokens, np.int32)
        if tokens.ndim != 2 or tokens.shape[0] != self.batch_size:
            raise ValueError(
                f"tokens must be int[{self.batch_size}, length] (the cache's batch size), got "
                f"{list(tokens.shape)}."
            )
        state = self._state_of(model)
        with jax.set_mesh(self.mesh):
            logits, self.cache = self._run(state, self.cache, tokens)
        return logits

    def _maker(self, graphdef, batch_size: int, max_length: int):
        """``make(state) -> cache state`` and, once traced, the cached model's graph."""
        made = {}

        def make(state):
            with nnx.use_eager_sharding(False), cheap_sharding_probes():
                model = nnx.merge(graphdef, state)
                model.init_cache(batch_size, max_length)
                made["graphdef"], cache, _ = nnx.split(model, nnx.Cache, ...)
            return cache

        return make, made

    def _step(self, state, cache, tokens):
        with (
            use_rules(self.mesh, self.rules),
            nnx.use_eager_sharding(False),
            cheap_sharding_probes(),
        ):
            model = nnx.merge(self._graphdef["graphdef"], cache, state)
            logits = self.logits_fn(model, tokens)
            cache = nnx.state(model, nnx.Cache)
        return logits[:, -1].astype(jnp.float32), cache


def _cache_rows(abstract: Any, rules: Any, mesh: Any) -> tuple[VariableSharding, ...]:
    """Each cache variable planned as a parameter is: its names resolved by the core resolver.

    The names come from the variable's metadata (or, for an Explicit-style cache, its typed
    spec) and are resolved through the compute ``rules`` by the adapter's
    :class:`~substrax_flax._resolve.Resolver`, as parameters are: mesh-axis names mean those
    axes, an unknown name raises, and an axis a dimension does not divide moves to the
    largest dimension it divides (the row's ``moved`` reason says where) or, where none
    does, is left out with a :class:`~substrax.ShardingWarning`.

    Raises:
      ValueError: If ``init_cache`` created no ``nnx.Cache`` variable, or a name is unknown.
    """
    rows = Resolver(mesh, rules, source="the layout's compute rules").rows(abstract)
    if not rows:
        raise ValueError(
            "make_decode_step: init_cache created no nnx.Cache variable; the model must keep "
            "its keys and values in nnx.Cache variables (as nnx.MultiHeadAttention does)."
        )
    return rows


def make_decode_step(
    model: nnx.Module,
    batch_size: int,
    max_length: int,
    *,
    logits_fn: Callable[[nnx.Module, jax.Array], jax.Array] | None = None,
    mesh: jax.sharding.Mesh | None = None,
    rules: Any = None,
    layout: Any = None,
) -> DecodeStep:
    """Creates ``model``'s KV cache at its layout, and the step that decodes with it.

    ``model.init_cache(batch_size, max_length)`` must create ``nnx.Cache`` variables with
    logical names (``out_sharding=`` metadata) in the names the model's activations use, or
    mesh axes (an Explicit-style ``PartitionSpec``). They are planned as parameters are, by
    the same resolver, through the layout's compute rules: the batch over the batch axes,
    heads over the tensor axes, and an axis a dimension does not divide moved to the largest
    dimension it divides (the row's ``moved`` reason says where). The cache is created inside
    ``jit`` with those shardings (no device holds all of it), and kept in the step
    (:attr:`DecodeStep.cache`; :attr:`DecodeStep.rows` are report rows,
    :class:`~substrax_flax.VariableSharding`); the model is left unchanged. Each call
    appends tokens and returns the logits after the last. The step runs on the train step's
    mesh: a model written for Auto axes placed on a mesh with Explicit axes
    (``jax.make_mesh``) decodes on its Auto twin (``step.mesh_decision`` says so).

    Args:
      model: A causal language model laid out by substrax, with ``init_cache``.
      batch_size: Rows decoded at once; must divide over the batch axes.
      max_length: Positions the cache holds (prompt and new tokens).
      logits_fn: ``logits_fn(model, tokens) -> logits [rows, length, vocab]`` with the cache
        (default: ``model(tokens, decode=True)``).
      mesh: For a model substrax did not place: the device mesh.
      rules: For a model substrax did not place: its rules.
      layout: For a model substrax did not place: its layout.

    Returns:
      The :class:`DecodeStep`.

    Raises:
      TypeError: If the model has no ``init_cache``.
      ValueError: If ``batch_size`` or ``max_length`` is not positive, ``init_cache``
        creates no ``nnx.Cache`` variable, or a cache name is neither a logical name of the
        rules nor a mesh axis.

    Warns:
      ShardingWarning: For an axis no dimension of a cache variable divides (it is left out
        there), as for parameters.
    """
    if not callable(getattr(model, "init_cache", None)):
        raise TypeError(
            f"make_decode_step needs a model with init_cache(batch_size, max_length), as "
            f"nnx.MultiHeadAttention has; {type(model).__name__} has none. generate decodes "
            "such a model without a cache (a forward over the whole window per token)."
        )
    for name, value in (("batch_size", batch_size), ("max_length", max_length)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    plan = model_plan(model, mesh, rules, None, layout, what="make_decode_step")
    fn = logits_fn or (lambda model, tokens: model(tokens, decode=True))
    return DecodeStep(model, batch_size, max_length, plan, fn)
