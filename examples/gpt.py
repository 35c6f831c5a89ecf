"""A GPT-style decoder in plain Flax NNX with logical-axis annotations, its data, and layouts.

Shared by ``fsdp_training.py`` (the main job) and ``benchmarks/``. The model code knows only
logical names (``vocab``, ``embed``, ``heads``, ``kv``, ``mlp``, ``data``, ``seq``, ``expert``);
a layout (:class:`substrax.layout.Layout`) maps them to mesh axes. Attention is
:func:`substrax.spmd.attention`, so a context-parallel layout (``fsdp+cp``) splits the sequence;
``Config.moe_experts`` swaps each MLP for a :class:`substrax_flax.MixtureOfExperts`, which an
expert-parallel layout (``fsdp+ep``) shards.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import substrax_flax as sf
from substrax.spmd import attention, constrain, decode_attention


@dataclasses.dataclass(frozen=True)
class Config:
    """Model size. The defaults give the 5.2M-parameter decoder of the benchmark."""

    vocab: int = 4096
    d_model: int = 256
    heads: int = 8
    mlp: int = 1024
    layers: int = 4
    seq: int = 64
    #: Experts per mixture-of-experts MLP (0: dense MLPs), each token routed to two.
    moe_experts: int = 0
    #: Expert slots relative to an even load for one-hot dispatch (None: sorted dispatch,
    #: no capacity, no token dropped).
    capacity_factor: float | None = None
    #: Dropout rate after attention and after the MLP of each block (0: no dropout layers).
    dropout: float = 0.0
    #: Key/value heads (0: as many as ``heads``; fewer: grouped-query attention, as Llama 3).
    kv_heads: int = 0
    #: A SwiGLU MLP (``silu(x @ gate) * (x @ up) @ down``, as Llama's) instead of GELU's.
    gated: bool = False
    #: Attention in flash attention's blocks of this many tokens (no ``[seq, seq]`` score
    #: square kept for the backward pass; ``substrax.spmd.attention(block=...)``), or None
    #: for whole rows.
    attention_block: int | None = None

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    @property
    def kv(self) -> int:
        """Key/value heads."""
        return self.kv_heads or self.heads


#: Llama 3 8B's shapes (Meta's model card: 32 layers, width 4096, 32 query and 8 key/value
#: heads, SwiGLU of 14336, vocabulary 128256, untied head): 8,030,261,248 parameters.
LLAMA3_8B = Config(vocab=128256, d_model=4096, heads=32, kv_heads=8, mlp=14336, layers=32,
                   seq=8192, gated=True)  # fmt: skip
#: Mixtral 8x7B's shapes (Mistral's release: Llama-style blocks with 8 SwiGLU experts of
#: 14336, each token routed to two, vocabulary 32000): 46.7B parameters.
MIXTRAL_8X7B = Config(vocab=32000, d_model=4096, heads=32, kv_heads=8, mlp=14336, layers=32,
                      seq=4096, gated=True, moe_experts=8)  # fmt: skip


def llama3_8b() -> StackedGPT:
    """Llama 3 8B's shapes as a stacked decoder (for ``substrax_flax.compile``: abstract only)."""
    return StackedGPT(LLAMA3_8B, nnx.Rngs(0))


def mixtral_8x7b() -> StackedGPT:
    """Mixtral 8x7B's shapes as a stacked decoder of experts (abstract only, as above)."""
    return StackedGPT(MIXTRAL_8X7B, nnx.Rngs(0))


def _param(rngs, shape, names, init=None):
    init = init or nnx.initializers.lecun_normal()
    return nnx.Param(init(rngs.params(), shape), out_sharding=names)


def _rms_norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


#: Logical names of the queries, keys and values, and of each layer's key/value cache.
KV_NAMES = ("data", "seq", "heads", "kv")


class Block(nnx.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self, config: Config, rngs: nnx.Rngs):
        d, h, k, m = config.d_model, config.heads, config.head_dim, config.mlp
        self.attn_norm = nnx.Param(jnp.ones((d,)), out_sharding=("embed",))
        self.wq = _param(rngs, (d, h, k), ("embed", "heads", "kv"))
        self.wk = _param(rngs, (d, config.kv, k), ("embed", "heads", "kv"))
        self.wv = _param(rngs, (d, config.kv, k), ("embed", "heads", "kv"))
        self.wo = _param(rngs, (h, k, d), ("heads", "kv", "embed"))
        self.mlp_norm = nnx.Param(jnp.ones((d,)), out_sharding=("embed",))
        self.attention_block = config.attention_block
        if config.moe_experts:
            dispatch = "sorted" if config.capacity_factor is None else "one-hot"
            self.moe = sf.MixtureOfExperts(
                d, m, config.moe_experts, dispatch=dispatch,
                capacity_factor=config.capacity_factor, gated=config.gated,
                activation=jax.nn.silu if config.gated else jax.nn.gelu, rngs=rngs,
            )  # fmt: skip
        else:
            self.up = _param(rngs, (d, m), ("embed", "mlp"))
            if config.gated:
                self.gate = _param(rngs, (d, m), ("embed", "mlp"))
            self.down = _param(rngs, (m, d), ("mlp", "embed"))
        if config.dropout:
            self.attn_drop = nnx.Dropout(config.dropout, rngs=rngs)
            self.mlp_drop = nnx.Dropout(config.dropout, rngs=rngs)

    def _drop(self, name, x):
        return getattr(self, name)(x) if hasattr(self, name) else x

    def __call__(self, x, decode: bool = False):
        return self.decode(x) if decode else self.forward(x)[0]

    @sf.remat  # recomputed in the backward pass under make_train_step(remat=...)
    def forward(self, x):
        """The block's output and its load-balancing loss (0 for a dense MLP)."""
        return self._mlp(self._attention(x, cached=False))

    def decode(self, x):
        """The block's output for new tokens, their keys and values appended to the cache."""
        return self._mlp(self._attention(x, cached=True))[0]

    def init_cache(self, batch_size: int, max_length: int) -> None:
        """Key and value caches of ``max_length`` positions (``nnx.Cache``), and their index.

        They carry the activations' logical names, so a layout shards them as it shards the
        keys and values: rows over the batch axes, heads over the tensor axes.
        """
        shape = (batch_size, max_length, *self.wk.shape[1:])
        self.cached_key = nnx.Cache(jnp.zeros(shape, self.wk.dtype), out_sharding=KV_NAMES)
        self.cached_value = nnx.Cache(jnp.zeros(shape, self.wv.dtype), out_sharding=KV_NAMES)
        self.cache_index = nnx.Cache(jnp.zeros((), jnp.int32))

    def _attention(self, x, cached: bool):
        h = _rms_norm(x, self.attn_norm[...])
        q = constrain(jnp.einsum("bte,ehk->bthk", h, self.wq[...]), *KV_NAMES)
        k = constrain(jnp.einsum("bte,ehk->bthk", h, self.wk[...]), *KV_NAMES)
        v = constrain(jnp.einsum("bte,ehk->bthk", h, self.wv[...]), *KV_NAMES)
        if cached:
            attended = self._cached(q, k, v)
        else:
            attended = attention(q, k, v, causal=True, block=self.attention_block)
        out = self._drop("attn_drop", jnp.einsum("bthk,hke->bte", attended, self.wo[...]))
        return constrain(x + out, "data", "seq", "embed")

    def _cached(self, q, k, v):
        """Attention of new tokens over the cache, after appending their keys and values."""
        start = self.cache_index[...]
        for cache, new in ((self.cached_key, k), (self.cached_value, v)):
            cache[...] = jax.lax.dynamic_update_slice_in_dim(
                cache[...], new.astype(cache.dtype), start, axis=1
            )
        self.cache_index[...] = start + q.shape[1]
        return decode_attention(q, self.cached_key[...], self.cached_value[...], start)

    def _mlp(self, x):
        h = _rms_norm(x, self.mlp_norm[...])
        if hasattr(self, "moe"):
            out, stats = self.moe(h)
            return constrain(x + out, "data", "seq", "embed"), stats.aux_loss
        if hasattr(self, "gate"):
            h = jax.nn.silu(h @ self.gate[...]) * (h @ self.up[...])
        else:
            h = jax.nn.gelu(h @ self.up[...])
        h = constrain(h, "data", "seq", "mlp")
        out = self._drop("mlp_drop", h @ self.down[...])
        return constrain(x + out, "data", "seq", "embed"), jnp.zeros(())


class GPT(nnx.Module):
    """Token embedding, ``layers`` blocks, a final norm and an untied output head."""

    def __init__(self, config: Config, rngs: nnx.Rngs):
        self.embedding = _param(
            rngs, (config.vocab, config.d_model), ("vocab", "embed"), nnx.initializers.normal(1.0)
        )
        self.blocks = nnx.List([Block(config, rngs) for _ in range(config.layers)])
        self.norm = nnx.Param(jnp.ones((config.d_model,)), out_sharding=("embed",))
        self.head = _param(rngs, (config.d_model, config.vocab), ("embed", "vocab"))

    def __call__(self, tokens, decode: bool = False):
        """The logits; with ``decode``, of new tokens after those in the cache (``init_cache``)."""
        if not decode:
            return self.forward(tokens)[0]
        x = constrain(jnp.take(self.embedding[...], tokens, axis=0), "data", "seq", "embed")
        for block in self.blocks:
            x = block.decode(x)
        return constrain(_rms_norm(x, self.norm[...]) @ self.head[...], "data", "seq", "vocab")

    def init_cache(self, batch_size: int, max_length: int) -> None:
        """Each block's key/value cache: ``batch_size`` rows of ``max_length`` positions."""
        for block in self.blocks:
            block.init_cache(batch_size, max_length)

    def forward(self, tokens):
        """The logits and the blocks' summed load-balancing loss (0 without experts)."""
        x = constrain(jnp.take(self.embedding[...], tokens, axis=0), "data", "seq", "embed")
        aux = jnp.zeros(())
        for block in self.blocks:
            x, block_aux = block.forward(x)
            aux = aux + block_aux
        logits = _rms_norm(x, self.norm[...]) @ self.head[...]
        return constrain(logits, "data", "seq", "vocab"), aux


class StackedGPT(nnx.Module):
    """The same decoder with its blocks stacked (``nnx.vmap``, logical axis ``layers``).

    Runs the stack with ``nnx.scan``, or as a pipeline through ``embed`` / ``block`` / ``head``
    (see ``pipeline_step``).
    """

    def __init__(self, config: Config, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=config.layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make(rngs):
            return Block(config, rngs)

        self.embedding = _param(
            rngs, (config.vocab, config.d_model), ("vocab", "embed"), nnx.initializers.normal(1.0)
        )
        self.blocks = make(rngs)
        self.norm = nnx.Param(jnp.ones((config.d_model,)), out_sharding=("embed",))
        self.head = _param(rngs, (config.d_model, config.vocab), ("embed", "vocab"))

    def __call__(self, tokens, decode: bool = False):
        """The logits; with ``decode``, of new tokens after those in the cache (``init_cache``)."""
        if not decode:
            return self.forward(tokens)[0]

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x, block):  # each layer reads and appends to its own slice of the cache
            return block.decode(x)

        x = constrain(self.embed(tokens), "data", "seq", "embed")
        return constrain(self.logits(run(x, self.blocks)), "data", "seq", "vocab")

    def init_cache(self, batch_size: int, max_length: int) -> None:
        """The stack's key/value cache, stacked like its layers (logical axis ``layers``).

        Each layer's slice is :meth:`Block.init_cache`'s; the leading ``layers`` dimension
        goes where the layout puts the stack's (over the stages under a pipeline).
        """
        blocks, layers = self.blocks, self.blocks.wk.shape[0]
        shape = (layers, batch_size, max_length, *blocks.wk.shape[2:])
        names = ("layers", *KV_NAMES)
        blocks.cached_key = nnx.Cache(jnp.zeros(shape, blocks.wk.dtype), out_sharding=names)
        blocks.cached_value = nnx.Cache(jnp.zeros(shape, blocks.wv.dtype), out_sharding=names)
        blocks.cache_index = nnx.Cache(jnp.zeros((layers,), jnp.int32), out_sharding=("layers",))

    def forward(self, tokens):
        """The logits and the blocks' summed load-balancing loss (0 without experts)."""

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(carry, block):
            x, aux = carry
            y, layer_aux = block.forward(x)
            return y, aux + layer_aux

        x, aux = run((self.embed(tokens), jnp.zeros(())), self.blocks)
        return self.logits(x), aux

    def embed(self, tokens):
        return jnp.take(self.embedding[...], tokens, axis=0)

    def logits(self, x):
        return _rms_norm(x, self.norm[...]) @ self.head[...]


def pipeline_embed(model: StackedGPT, batch: jax.Array):
    """What enters the pipelined stack, and the next-token targets."""
    return model.embed(batch[:, :-1]), batch[:, 1:]


def pipeline_block(block: Block, x: jax.Array) -> jax.Array:
    """One layer of the stack."""
    return block(x)


def pipeline_head(model: StackedGPT, y: jax.Array, targets: jax.Array) -> jax.Array:
    """A microbatch's loss from the stack's output."""
    logits = model.logits(y)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


#: Weight of the experts' load-balancing loss (Switch Transformer's).
AUX_WEIGHT = 0.01


def loss_fn(model: GPT, batch: jax.Array | dict) -> jax.Array:
    """Next-token cross-entropy, plus the experts' load-balancing loss if the model has experts.

    Args:
      model: The model.
      batch: Token rows ``[batch, seq + 1]``, or ``{"inputs", "targets"}`` already shifted
        (:func:`next_tokens`): a sequence split over devices (context parallelism) must be
        shifted before it is split.
    """
    if not isinstance(batch, dict):
        batch = next_tokens(batch)
    logits, aux = model.forward(batch["inputs"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
    return loss + AUX_WEIGHT * aux


def next_tokens(rows: jax.Array | np.ndarray) -> dict:
    """``{"inputs": rows[:, :-1], "targets": rows[:, 1:]}``."""
    return {"inputs": rows[:, :-1], "targets": rows[:, 1:]}


def optimizer(learning_rate: float = 3e-3) -> optax.GradientTransformation:
    """adamw with gradient clipping."""
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(learning_rate, b2=0.98))


# --- data: sentences from a small grammar, as bytes --------------------------------------------

_SUBJECTS = ("the cat", "a dog", "the old man", "my sister", "a small bird", "the teacher")
_VERBS = ("sees", "likes", "follows", "draws", "hears", "finds")
_OBJECTS = ("the moon", "a red ball", "the river", "an apple", "the green door", "a song")
_ENDINGS = (" today", " again", " at night", "", " slowly", " in the park")


def _sentence(rng: np.random.Generator) -> str:
    parts = (_SUBJECTS, _VERBS, _OBJECTS, _ENDINGS)
    words = [part[rng.integers(len(part))] for part in parts]
    return f"{words[0]} {words[1]} {words[2]}{words[3]}. "


def batch_at(step: int, batch_size: int, seq: int, seed: int = 0) -> np.ndarray:
    """The batch of ``step``: ``batch_size`` rows of ``seq + 1`` byte tokens.

    Deterministic in ``(seed, step)``, so the data position of a run is its step number.
    """
    rng = np.random.default_rng([seed, step])
    rows = []
    for _ in range(batch_size):
        text = ""
        while len(text) < seq + 1 + 40:
            text += _sentence(rng)
        start = rng.integers(40)
        rows.append(np.frombuffer(text[start : start + seq + 1].encode(), np.uint8))
    return np.stack(rows).astype(np.int32)
