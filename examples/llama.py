"""A Llama-style decoder in Flax NNX that reads (and writes) Hugging Face Llama checkpoints.

RMSNorm, rotary positions (Hugging Face's ``rotate_half`` convention), grouped-query attention
and a SwiGLU MLP, with logical-axis annotations. :func:`key_map` maps a Hugging Face Llama
checkpoint's tensor names (``model.layers.{i}.self_attn.q_proj.weight``, ``[out, in]``
matrices) onto this model's variables (``layers/{i}/q``, ``[embed, heads, head_dim]``), so

    model = from_pretrained(directory, layout=Layout.named("fsdp", {"data": 8}))

reads a checkpoint directory (``config.json`` and safetensors files) straight into a
sharded model, and ``substrax_flax.save_weights(model, directory, key_map=key_map(config))``
writes one back. :func:`write_random_checkpoint` makes a small checkpoint in that format
with numpy, for tests and the example (nothing is downloaded).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import substrax_flax as sf
from substrax.spmd import attention, constrain, decode_attention, positions


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The fields of a Hugging Face ``LlamaConfig`` this model reads from ``config.json``."""

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 176
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_json(cls, path: str | pathlib.Path) -> LlamaConfig:
        """Reads ``config.json`` (a file, or the directory holding it); other keys are ignored.

        Raises:
          ValueError: If it is not a Llama config (its ``model_type``), naming what it is.
        """
        path = pathlib.Path(path)
        path = path / "config.json" if path.is_dir() else path
        raw = json.loads(path.read_text())
        if raw.get("model_type", "llama") != "llama":
            raise ValueError(f"{path} configures a {raw['model_type']!r} model, not 'llama'.")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names})

    def to_json(self) -> dict:
        """``config.json``'s contents, as Hugging Face writes them for these fields."""
        return {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                **dataclasses.asdict(self)}  # fmt: skip


def _param(rngs, shape, names, scale=0.02):
    return nnx.Param(nnx.initializers.normal(scale)(rngs.params(), shape), out_sharding=names)


def _rms_norm(x, scale, eps):
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * scale).astype(x.dtype)


def _rope(x, theta, start=0):
    """Rotary positions as Hugging Face's Llama applies them: halves rotated, not pairs.

    The tokens sit at positions ``start, start + 1, ...`` (``start`` > 0: decoding after the
    cached ones).
    """
    length, dim = x.shape[1], x.shape[-1]
    inv_freq = 1.0 / theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    angles = (positions(length) + start).astype(jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)[None, :, None, :]
    half = dim // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


#: The projections that get LoRA adapters (``lora_rank > 0``), as LoRA's paper adapts them.
LORA_TARGETS = ("q", "v")


class LlamaBlock(nnx.Module):
    """Pre-norm grouped-query attention with rotary positions, then a SwiGLU MLP.

    With ``lora_rank > 0`` the :data:`LORA_TARGETS` projections get low-rank adapters
    (``nnx.LoRAParam``: ``<name>_lora_a`` ``[embed, rank]``, random, and ``<name>_lora_b``
    ``[rank, heads, head_dim]``, zero, so a fresh adapter changes nothing), scaled by
    ``lora_alpha / lora_rank``; train them alone with ``wrt=nnx.LoRAParam``.
    """

    def __init__(self, config: LlamaConfig, rngs: nnx.Rngs, lora_rank: int = 0,
                 lora_alpha: float = 16.0):  # fmt: skip
        d, f = config.hidden_size, config.intermediate_size
        h, kv, k = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.config, self.lora_scale = config, lora_alpha / max(lora_rank, 1)
        self.attn_norm = nnx.Param(jnp.ones((d,)), out_sharding=("embed",))
        self.q = _param(rngs, (d, h, k), ("embed", "heads", "kv"))
        self.k = _param(rngs, (d, kv, k), ("embed", "kv_heads", "kv"))
        self.v = _param(rngs, (d, kv, k), ("embed", "kv_heads", "kv"))
        self.o = _param(rngs, (h, k, d), ("heads", "kv", "embed"))
        self.mlp_norm = nnx.Param(jnp.ones((d,)), out_sharding=("embed",))
        self.gate = _param(rngs, (d, f), ("embed", "mlp"))
        self.up = _param(rngs, (d, f), ("embed", "mlp"))
        self.down = _param(rngs, (f, d), ("mlp", "embed"))
        for name in LORA_TARGETS if lora_rank else ():
            base = getattr(self, name)
            heads = base.get_metadata()["out_sharding"][1]
            a = nnx.initializers.normal(1.0 / lora_rank)(rngs.params(), (d, lora_rank))
            setattr(self, f"{name}_lora_a", nnx.LoRAParam(a, out_sharding=("embed", None)))
            b = jnp.zeros((lora_rank, *base.shape[1:]))
            setattr(self, f"{name}_lora_b", nnx.LoRAParam(b, out_sharding=(None, heads, "kv")))

    def _project(self, name, h):
        """``h`` through projection ``name``, plus its adapter's low-rank update if it has one."""
        out = jnp.einsum("bte,ehk->bthk", h, getattr(self, name)[...])
        if hasattr(self, f"{name}_lora_a"):
            low = h @ getattr(self, f"{name}_lora_a")[...]
            lora_b = getattr(self, f"{name}_lora_b")[...]
            out = out + self.lora_scale * jnp.einsum("btr,rhk->bthk", low, lora_b)
        return out

    def merge_lora(self) -> None:
        """Adds each adapter's update into its projection and zeroes the adapter (in place)."""
        for name in LORA_TARGETS:
            if hasattr(self, f"{name}_lora_a"):
                a, b = getattr(self, f"{name}_lora_a"), getattr(self, f"{name}_lora_b")
                base = getattr(self, name)
                update = self.lora_scale * jnp.einsum("er,rhk->ehk", a[...], b[...])
                base[...] = (base[...] + update).astype(base[...].dtype)
                b[...] = jnp.zeros_like(b[...])

    @sf.remat
    def __call__(self, x):
        q, k, v = self._qkv(x, 0)
        return self._mlp(x, attention(q, k, v, causal=True))

    def decode(self, x):
        """The block's output for new tokens, their keys and values appended to the cache."""
        start = self.cache_index[...]
        q, k, v = self._qkv(x, start)
        for cache, new in ((self.cached_key, k), (self.cached_value, v)):
            cache[...] = jax.lax.dynamic_update_slice_in_dim(
                cache[...], new.astype(cache.dtype), start, axis=1
            )
        self.cache_index[...] = start + x.shape[1]
        keys, values = self.cached_key[...], self.cached_value[...]
        return self._mlp(x, decode_attention(q, keys, values, start))

    def init_cache(self, batch_size: int, max_length: int) -> None:
        """Key and value caches (``nnx.Cache``, named as the keys and values are) and an index."""
        shape = (batch_size, max_length, *self.k.shape[1:])
        names = ("data", "seq", "kv_heads", "kv")
        self.cached_key = nnx.Cache(jnp.zeros(shape, self.k.dtype), out_sharding=names)
        self.cached_value = nnx.Cache(jnp.zeros(shape, self.v.dtype), out_sharding=names)
        self.cache_index = nnx.Cache(jnp.zeros((), jnp.int32))

    def _qkv(self, x, start):
        c = self.config
        h = _rms_norm(x, self.attn_norm[...], c.rms_norm_eps)
        q, k, v = (self._project(name, h) for name in ("q", "k", "v"))
        q = constrain(_rope(q, c.rope_theta, start), "data", "seq", "heads", "kv")
        k = constrain(_rope(k, c.rope_theta, start), "data", "seq", "kv_heads", "kv")
        return q, k, constrain(v, "data", "seq", "kv_heads", "kv")

    def _mlp(self, x, attended):
        c = self.config
        out = jnp.einsum("bthk,hke->bte", attended, self.o[...])
        x = constrain(x + out, "data", "seq", "embed")
        h = _rms_norm(x, self.mlp_norm[...], c.rms_norm_eps)
        gated = constrain(
            jax.nn.silu(h @ self.gate[...]) * (h @ self.up[...]), "data", "seq", "mlp"
        )
        return constrain(x + gated @ self.down[...], "data", "seq", "embed")


class Llama(nnx.Module):
    """Token embedding, the blocks, a final norm and the output head (or the tied embedding)."""

    def __init__(self, config: LlamaConfig, rngs: nnx.Rngs, lora_rank: int = 0):
        self.config = config
        self.embed = _param(rngs, (config.vocab_size, config.hidden_size), ("vocab", "embed"))
        self.layers = nnx.List(
            [LlamaBlock(config, rngs, lora_rank) for _ in range(config.num_hidden_layers)]
        )
        self.norm = nnx.Param(jnp.ones((config.hidden_size,)), out_sharding=("embed",))
        if not config.tie_word_embeddings:
            self.head = _param(rngs, (config.hidden_size, config.vocab_size), ("embed", "vocab"))

    def __call__(self, tokens, decode: bool = False):
        """The logits; with ``decode``, of new tokens after those in the cache (``init_cache``)."""
        x = constrain(jnp.take(self.embed[...], tokens, axis=0), "data", "seq", "embed")
        for block in self.layers:
            x = block.decode(x) if decode else block(x)
        x = _rms_norm(x, self.norm[...], self.config.rms_norm_eps)
        head = self.embed[...].T if self.config.tie_word_embeddings else self.head[...]
        return constrain(x @ head, "data", "seq", "vocab")

    def init_cache(self, batch_size: int, max_length: int) -> None:
        """Each block's key/value cache: ``batch_size`` rows of ``max_length`` positions."""
        for block in self.layers:
            block.init_cache(batch_size, max_length)

    def merge_lora(self) -> None:
        """Folds every LoRA adapter into its projection (see :meth:`LlamaBlock.merge_lora`)."""
        for block in self.layers:
            block.merge_lora()

    def forward(self, tokens):
        """The logits and no auxiliary loss (as ``gpt.GPT.forward``, for the example's loss)."""
        return self(tokens), jnp.zeros(())


def key_map(config: LlamaConfig) -> dict:
    """Hugging Face Llama tensor names -> this model's variables, with the rearrangements.

    Hugging Face stores ``nn.Linear`` weights ``[out, in]`` with the heads fused into ``out``;
    this model keeps ``[in, heads, head_dim]`` (and ``[heads, head_dim, out]`` for the output
    projection), so the patterns transpose and split the heads. A tied model has no
    ``lm_head.weight``; an untied checkpoint's ``rotary_emb.inv_freq`` buffers (old
    checkpoints carry them) are ignored.
    """
    h, kv = config.num_attention_heads, config.num_key_value_heads
    layer = "model.layers.{i}"
    table = {
        "model.embed_tokens.weight": "embed",
        f"{layer}.input_layernorm.weight": "layers/{i}/attn_norm",
        f"{layer}.self_attn.q_proj.weight": sf.Target("layers/{i}/q", "(h d) e -> e h d", {"h": h}),
        f"{layer}.self_attn.k_proj.weight": sf.Target(
            "layers/{i}/k", "(h d) e -> e h d", {"h": kv}
        ),
        f"{layer}.self_attn.v_proj.weight": sf.Target(
            "layers/{i}/v", "(h d) e -> e h d", {"h": kv}
        ),
        f"{layer}.self_attn.o_proj.weight": sf.Target("layers/{i}/o", "e (h d) -> h d e", {"h": h}),
        f"{layer}.self_attn.rotary_emb.inv_freq": None,
        f"{layer}.post_attention_layernorm.weight": "layers/{i}/mlp_norm",
        f"{layer}.mlp.gate_proj.weight": sf.Target("layers/{i}/gate", "f e -> e f"),
        f"{layer}.mlp.up_proj.weight": sf.Target("layers/{i}/up", "f e -> e f"),
        f"{layer}.mlp.down_proj.weight": sf.Target("layers/{i}/down", "e f -> f e"),
        "model.norm.weight": "norm",
    }
    if not config.tie_word_embeddings:
        table["lm_head.weight"] = sf.Target("head", "v e -> e v")
    return table


def from_pretrained(directory: str | pathlib.Path, mesh=None, *, lora_rank: int = 0,
                    seed: int = 0, **kwargs) -> Llama:  # fmt: skip
    """The model of a Hugging Face Llama checkpoint directory, loaded sharded.

    Args:
      directory: Holds ``config.json`` and the safetensors file(s).
      mesh: The mesh (or pass ``layout=``).
      lora_rank: Add LoRA adapters of this rank (0: none); they keep their initialisers.
      seed: Seeds the adapters' initialisers.
      **kwargs: More :func:`substrax_flax.load_weights` arguments (``layout``, ``dtype``, ...).
    """
    config = LlamaConfig.from_json(directory)
    return sf.load_weights(lambda: Llama(config, nnx.Rngs(seed), lora_rank), mesh, directory,
                           key_map=key_map(config), **kwargs)  # fmt: skip


def save_pretrained(model: Llama, directory: str | pathlib.Path, **kwargs) -> list[pathlib.Path]:
    """Writes ``config.json`` and the weights in Hugging Face's names and layouts.

    Args:
      model: The model (with LoRA adapters: call ``model.merge_lora()`` first and pass
        ``leave_out=[".*_lora_.*"]``).
      directory: Where to write.
      **kwargs: More :func:`substrax_flax.save_weights` arguments (``shard_size``, ...).
    """
    written = sf.save_weights(model, directory, key_map=key_map(model.config), **kwargs)
    if jax.process_index() == 0:
        path = pathlib.Path(directory) / "config.json"
        path.write_text(json.dumps(model.config.to_json(), indent=2))
    return written


def hf_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Hugging Face Llama checkpoint of ``config``, and its shape."""
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = (
        config.num_attention_heads * config.head_dim,
        config.num_key_value_heads * config.head_dim,
    )
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}"
        shapes.update({
            f"{layer}.input_layernorm.weight": (d,),
            f"{layer}.self_attn.q_proj.weight": (q, d),
            f"{layer}.self_attn.k_proj.weight": (kv, d),
            f"{layer}.self_attn.v_proj.weight": (kv, d),
            f"{layer}.self_attn.o_proj.weight": (d, q),
            f"{layer}.post_attention_layernorm.weight": (d,),
            f"{layer}.mlp.gate_proj.weight": (f, d),
            f"{layer}.mlp.up_proj.weight": (f, d),
            f"{layer}.mlp.down_proj.weight": (d, f),
        })  # fmt: skip
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, d)
    return shapes


def write_random_checkpoint(directory, config: LlamaConfig, *, seed=0, dtype=np.float32,
                            shard_size="2GB") -> dict[str, np.ndarray]:  # fmt: skip
    """Writes a Hugging Face-format Llama checkpoint of random weights, with numpy.

    Returns:
      The tensors written, by name (for a reference forward pass).
    """
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in hf_shapes(config).items():
        norm = name.endswith("layernorm.weight") or name == "model.norm.weight"
        value = (
            1.0 + 0.1 * rng.standard_normal(shape) if norm else 0.05 * rng.standard_normal(shape)
        )
        tensors[name] = value.astype(dtype)
    directory = pathlib.Path(directory)
    sf.save_tensors(directory, tensors, shard_size=shard_size)
    (directory / "config.json").write_text(json.dumps(config.to_json(), indent=2))
    return tensors


def main(argv=None) -> int:
    """``python examples/llama.py DIR``: writes a small random Llama checkpoint to fine-tune."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__.split(": ", 1)[1])
    parser.add_argument("directory", type=pathlib.Path, help="where to write it")
    parser.add_argument("--layers", type=int, default=LlamaConfig.num_hidden_layers,
                        help="decoder blocks")  # fmt: skip
    parser.add_argument("--hidden-size", type=int, default=LlamaConfig.hidden_size,
                        help="model width")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="weights' seed")
    args = parser.parse_args(argv)
    config = LlamaConfig(num_hidden_layers=args.layers, hidden_size=args.hidden_size)
    write_random_checkpoint(args.directory, config, seed=args.seed)
    print(f"wrote a random Llama checkpoint ({config}) to {args.directory}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
