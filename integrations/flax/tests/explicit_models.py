"""Models written for Explicit mesh axes, the way published NNX models write them.

* :class:`CachedDecoder`, in the style of the jax-ml/bonsai Qwen3: every kernel declares its
  spec with ``kernel_metadata={"out_sharding": P(...)}`` over the mesh axes ``fsdp`` and ``tp``,
  every projection says its output's spec (``out_sharding=``), the embedding lookup too, and
  attention writes its keys and values into a KV cache made with
  ``jnp.zeros(..., out_sharding=P("fsdp", None, "tp", None))``.
* :class:`SpecDecoder`, in the style of a Gemma port: parameters created with a spec in their
  type (``init(key, shape, out_sharding=P(...))``), activations resharded with
  ``jax.sharding.reshard`` at block boundaries, and a tied embedding used for the logits.

Both run as written on one device (a mesh of the same axis names, of size 1).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P
from jax.sharding import reshard


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 64
    width: int = 32
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    hidden: int = 64
    layers: int = 2
    seq: int = 8


WEIGHTS = {
    "embed": P("tp", "fsdp"),
    "q": P("fsdp", "tp", None),
    "kv": P("fsdp", "tp", None),
    "o": P("tp", None, "fsdp"),
    "up": P("fsdp", "tp"),
    "down": P("tp", "fsdp"),
    "head": P("fsdp", "tp"),
}
ACT = P("fsdp", None, None)
HEADS = P("fsdp", None, "tp", None)


class Attention(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs):
        def proj(heads, spec):
            return nnx.LinearGeneral(c.width, (heads, c.head_dim), use_bias=False, rngs=rngs,
                                     kernel_metadata={"out_sharding": spec})  # fmt: skip

        self.q = proj(c.heads, WEIGHTS["q"])
        self.k = proj(c.kv_heads, WEIGHTS["kv"])
        self.v = proj(c.kv_heads, WEIGHTS["kv"])
        self.o = nnx.LinearGeneral(
            (c.heads, c.head_dim), c.width, axis=(-2, -1), use_bias=False,
            kernel_metadata={"out_sharding": WEIGHTS["o"]}, rngs=rngs,
        )  # fmt: skip
        self.c = c

    def __call__(self, x):
        c = self.c
        b, t, _ = x.shape
        q = self.q(x, out_sharding=HEADS)
        k, v = self.k(x, out_sharding=HEADS), self.v(x, out_sharding=HEADS)
        # the KV cache, as a sampler would keep it: written at position 0
        shape = (b, t, c.kv_heads, c.head_dim)
        cache_k = jnp.zeros(shape, x.dtype, out_sharding=HEADS)
        cache_v = jnp.zeros(shape, x.dtype, out_sharding=HEADS)
        cache_k = jax.lax.dynamic_update_slice(cache_k, k, (0, 0, 0, 0))
        cache_v = jax.lax.dynamic_update_slice(cache_v, v, (0, 0, 0, 0))
        q = q.reshape(b, t, c.kv_heads, c.heads // c.kv_heads, c.head_dim)
        logits = jnp.einsum("btkgd,bskd->bkgts", q, cache_k) / np.sqrt(c.head_dim)
        mask = jnp.tril(jnp.ones((t, t), bool))
        weights = jax.nn.softmax(jnp.where(mask, logits, -1e9), axis=-1)
        out = jnp.einsum("bkgts,bskd->btkgd", weights, cache_v).reshape(b, t, c.heads, -1)
        return self.o(out, out_sharding=ACT)


class CachedBlock(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs):
        norm = {"out_sharding": P("tp")}
        self.norm1 = nnx.RMSNorm(c.width, scale_metadata=norm, rngs=rngs)
        self.attn = Attention(c, rngs)
        self.norm2 = nnx.RMSNorm(c.width, scale_metadata=norm, rngs=rngs)
        self.up = nnx.Linear(c.width, c.hidden, use_bias=False, rngs=rngs,
                             kernel_metadata={"out_sharding": WEIGHTS["up"]})  # fmt: skip
        self.down = nnx.Linear(c.hidden, c.width, use_bias=False, rngs=rngs,
                               kernel_metadata={"out_sharding": WEIGHTS["down"]})  # fmt: skip

    def __call__(self, x):
        x = x + self.attn(self.norm1(x))
        h = nnx.silu(self.up(self.norm2(x), out_sharding=P("fsdp", None, "tp")))
        return x + self.down(h, out_sharding=ACT)


class CachedDecoder(nnx.Module):
    """A Qwen3-style decoder (see the module docstring)."""

    def __init__(self, c: Config, rngs: nnx.Rngs):
        self.embed = nnx.Embed(c.vocab, c.width, rngs=rngs,
                               embedding_metadata={"out_sharding": WEIGHTS["embed"]})  # fmt: skip
        self.blocks = nnx.List([CachedBlock(c, rngs) for _ in range(c.layers)])
        self.norm = nnx.RMSNorm(c.width, scale_metadata={"out_sharding": P("tp")}, rngs=rngs)
        self.head = nnx.Linear(c.width, c.vocab, use_bias=False, rngs=rngs,
                               kernel_metadata={"out_sharding": WEIGHTS["head"]})  # fmt: skip

    def __call__(self, tokens):
        x = self.embed.embedding[...].at[tokens].get(out_sharding=ACT)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x), out_sharding=P("fsdp", None, "tp"))


class SpecBlock(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs):
        init = jax.nn.initializers.lecun_normal()

        def param(shape, spec):  # the spec in the array's type, as Gemma ports initialise
            return nnx.Param(init(rngs.params(), shape, out_sharding=spec))

        self.scale = nnx.Param(jnp.ones((c.width,)), out_sharding=P())
        self.wq = param((c.width, c.heads, c.head_dim), WEIGHTS["q"])
        self.wkv = param((2, c.width, c.heads, c.head_dim), P(None, "fsdp", "tp", None))
        self.wo = param((c.heads, c.head_dim, c.width), WEIGHTS["o"])
        self.w_gate = param((c.width, c.hidden), WEIGHTS["up"])
        self.w_up = param((c.width, c.hidden), WEIGHTS["up"])
        self.w_down = param((c.hidden, c.width), WEIGHTS["down"])
        self.c = c

    def __call__(self, x):
        c = self.c
        h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * self.scale[...]
        q = jnp.einsum("btd,dnh->btnh", h, self.wq[...], out_sharding=HEADS)
        k, v = jnp.einsum("btd,cdnh->cbtnh", h, self.wkv[...],
                          out_sharding=P(None, "fsdp", None, "tp", None))  # fmt: skip
        logits = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(c.head_dim)
        mask = jnp.tril(jnp.ones((x.shape[1],) * 2, bool))
        weights = jax.nn.softmax(jnp.where(mask, logits, -1e9), axis=-1)
        attn = jnp.einsum("bnts,bsnh->btnh", weights, v)
        x = x + jnp.einsum("btnh,nhd->btd", attn, self.wo[...], out_sharding=ACT)
        gate = jnp.einsum("btd,df->btf", x, self.w_gate[...], out_sharding=P("fsdp", None, "tp"))
        up = jnp.einsum("btd,df->btf", x, self.w_up[...], out_sharding=P("fsdp", None, "tp"))
        out = jnp.einsum("btf,fd->btd", jax.nn.gelu(gate) * up, self.w_down[...],
                         out_sharding=ACT)  # fmt: skip
        return reshard(x + out, ACT)


class SpecDecoder(nnx.Module):
    """A Gemma-style decoder (see the module docstring)."""

    def __init__(self, c: Config, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.embedding = nnx.Param(init(rngs.params(), (c.vocab, c.width)),
                                   out_sharding=WEIGHTS["embed"])  # fmt: skip
        self.blocks = nnx.List([SpecBlock(c, rngs) for _ in range(c.layers)])
        self.c = c

    def __call__(self, tokens):
        table = self.embedding[...]
        x = table.at[tokens].get(out_sharding=ACT) * np.sqrt(self.c.width)
        for block in self.blocks:
            x = block(x)
        return jnp.einsum("btd,vd->btv", x, table, out_sharding=P("fsdp", None, "tp"))


def loss_fn(model, tokens):
    logits = model(tokens[:, :-1]).astype(jnp.float32)
    targets = jax.nn.one_hot(tokens[:, 1:], logits.shape[-1])
    return -(jax.nn.log_softmax(logits) * targets).sum(-1).mean()


def tokens(seed: int, c: Config, rows: int = 8) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, c.vocab, (rows, c.seq + 1), dtype=np.int32)
