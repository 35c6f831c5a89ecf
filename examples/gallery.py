"""Tiny Flax NNX models written the way people write them today: the gallery.

Written for substrax from common public patterns (no code copied): each model comes with a
factory, a loss and a batch maker. None of them knows about substrax.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

V, D, N, K, H, F, T = 32, 16, 4, 2, 8, 32, 8  # vocab, width, heads, kv heads, head dim, mlp, seq
LECUN = nnx.initializers.lecun_normal()


def _norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def token_loss(model, batch):
    logits = model(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def tokens(seed):
    return np.random.default_rng(seed).integers(0, V, (8, T + 1)).astype(np.int32)


# (a) Explicit style: heads-first einsum kernels (N, D, H), grouped-query attention, q/k norms,
# mesh-axis specs written into the variables.
class ExplicitDecoder(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        def param(shape, spec, init=LECUN):
            return nnx.Param(init(rngs.params(), shape), out_sharding=spec)

        self.embed = param((V, D), P("model", None), nnx.initializers.normal(1.0))
        self.wq = param((N, D, H), P("model", "data", None))
        self.wk = param((K, D, H), P(None, "data", None))
        self.wv = param((K, D, H), P(None, "data", None))
        self.wo = param((N, H, D), P("model", None, "data"))
        self.q_norm = nnx.Param(jnp.ones((H,)))
        self.k_norm = nnx.Param(jnp.ones((H,)))
        self.up = param((D, F), P("data", "model"))
        self.down = param((F, D), P("model", "data"))
        self.head = param((D, V), P("data", "model"))

    def __call__(self, ids):
        x = jnp.take(self.embed[...], ids, axis=0)
        q = _norm(jnp.einsum("btd,ndh->btnh", x, self.wq[...]), self.q_norm[...])
        k = _norm(jnp.einsum("btd,kdh->btkh", x, self.wk[...]), self.k_norm[...])
        v = jnp.einsum("btd,kdh->btkh", x, self.wv[...])
        k, v = (jnp.repeat(a, N // K, axis=2) for a in (k, v))
        scores = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H)
        mask = jnp.tril(jnp.ones((ids.shape[1], ids.shape[1]), bool))
        attended = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(jnp.where(mask, scores, -1e9)), v)
        x = x + jnp.einsum("btnh,nhd->btd", attended, self.wo[...])
        x = x + jax.nn.silu(x @ self.up[...]) @ self.down[...]
        return x @ self.head[...]


# (b) nnx.data array attributes and metadata-bearing Params.
class DataAttrDecoder(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.scale = nnx.data(jnp.asarray(np.sqrt(D), jnp.float32))
        self.positions = nnx.data(jnp.arange(T))
        embed_init = nnx.with_partitioning(nnx.initializers.normal(1.0), ("vocab", "embed"))
        self.embed = nnx.Embed(V, D, embedding_init=embed_init, rngs=rngs)
        self.pos = nnx.Param(jax.random.normal(rngs.params(), (T, D)) * 0.02, rngs=rngs)
        self.mlp = nnx.Linear(D, D, kernel_init=nnx.with_partitioning(LECUN, ("embed", "mlp")),
                              rngs=rngs)  # fmt: skip
        self.head = nnx.Linear(D, V, kernel_init=nnx.with_partitioning(LECUN, ("embed", "vocab")),
                               rngs=rngs)  # fmt: skip

    def __call__(self, ids):
        x = self.embed(ids) * self.scale + self.pos[...][self.positions[: ids.shape[1]]]
        return self.head(x + jax.nn.gelu(self.mlp(x)))


# (c) A vision transformer: patches, a (1, T, D) position embedding, a class token.
class ViT(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.patch = nnx.Linear(4 * 4 * 3, D, rngs=rngs)
        self.cls = nnx.Param(jnp.zeros((1, 1, D)))
        self.pos = nnx.Param(jax.random.normal(rngs.params(), (1, 17, D)) * 0.02)
        self.attn = nnx.MultiHeadAttention(N, D, decode=False, use_bias=False, rngs=rngs)
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.mlp = nnx.Linear(D, F, rngs=rngs)
        self.out = nnx.Linear(F, D, rngs=rngs)
        self.classify = nnx.Linear(D, 10, rngs=rngs)

    def __call__(self, images):
        b = images.shape[0]
        patches = images.reshape(b, 4, 4, 4, 4, 3).transpose(0, 1, 3, 2, 4, 5).reshape(b, 16, -1)
        x = jnp.concatenate([jnp.broadcast_to(self.cls[...], (b, 1, D)), self.patch(patches)], 1)
        x = x + self.pos[...]
        x = x + self.attn(self.norm(x))
        x = x + self.out(jax.nn.gelu(self.mlp(x)))
        return self.classify(x[:, 0])


# (d) A ResNet: conv kernels (kh, kw, in, out) and batch statistics. As in real ResNets, the
# convolutions before a BatchNorm have no bias (its gradient is zero: adam would make noise).
class ResNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.stem = nnx.Conv(3, 8, (3, 3), use_bias=False, rngs=rngs)
        self.bn1 = nnx.BatchNorm(8, rngs=rngs)
        self.conv = nnx.Conv(8, 8, (3, 3), use_bias=False, rngs=rngs)
        self.bn2 = nnx.BatchNorm(8, rngs=rngs)
        self.classify = nnx.Linear(8, 10, rngs=rngs)

    def __call__(self, images):
        x = jax.nn.relu(self.bn1(self.stem(images)))
        x = jax.nn.relu(x + self.bn2(self.conv(x)))
        return self.classify(x.mean(axis=(1, 2)))


def image_loss(model, batch):
    images, labels = batch
    return optax.softmax_cross_entropy_with_integer_labels(model(images), labels).mean()


def images(seed):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(8, 16, 16, 3)).astype(np.float32),
            rng.integers(0, 10, (8,)).astype(np.int32))  # fmt: skip


# (e) Dropout.
class DropoutMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, rate: float = 0.0):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.up = nnx.Linear(D, F, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)
        self.down = nnx.Linear(F, V, rngs=rngs)

    def __call__(self, ids):
        return self.down(self.drop(jax.nn.gelu(self.up(self.embed(ids)))))


# (f) 3-D kernels carrying two logical names (Flax's older examples), Flax rule pairs.
class ShortNames(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs, embedding_init=nnx.with_partitioning(
            nnx.initializers.normal(1.0), ("vocab", "embed")))  # fmt: skip
        self.qkv = nnx.Param(LECUN(rngs.params(), (D, 3 * N, H)), out_sharding=("embed", "heads"))
        self.out = nnx.Param(LECUN(rngs.params(), (N, H, D)), out_sharding=("heads",))
        self.head = nnx.Param(LECUN(rngs.params(), (D, V)), out_sharding=("embed", "vocab"))

    def __call__(self, ids):
        x = self.embed(ids)
        q, k, v = jnp.split(jnp.einsum("btd,dnh->btnh", x, self.qkv[...]), 3, axis=2)
        scores = jax.nn.softmax(jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H))
        x = x + jnp.einsum("bnts,bsnh,nhd->btd", scores, v, self.out[...])
        return x @ self.head[...]


FLAX_PAIRS = (("batch", "data"), ("embed", "model"), ("heads", None), ("vocab", None))


# (g) Flax guide style: a stacked scan of blocks, with_sharding_constraint in __call__.
class GuideBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(D, F, kernel_init=nnx.with_partitioning(LECUN, ("embed", "mlp")),
                             rngs=rngs)  # fmt: skip
        self.down = nnx.Linear(F, D, kernel_init=nnx.with_partitioning(LECUN, ("mlp", "embed")),
                               rngs=rngs)  # fmt: skip

    def __call__(self, x):
        h = jax.lax.with_sharding_constraint(jax.nn.relu(self.up(x)), P("data", None, None))
        return x + self.down(h)


class GuideStack(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=2)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make(rngs):
            return GuideBlock(rngs)

        self.embed = nnx.Embed(V, D, rngs=rngs, embedding_init=nnx.with_partitioning(
            nnx.initializers.normal(1.0), ("vocab", "embed")))  # fmt: skip
        self.blocks = make(rngs)
        self.head = nnx.Linear(D, V, kernel_init=nnx.with_partitioning(LECUN, ("embed", "vocab")),
                               rngs=rngs)  # fmt: skip

    def __call__(self, ids):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x, block):
            return block(x)

        return self.head(run(self.embed(ids), self.blocks))


# (h) Tied input and output embeddings.
class Tied(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs, embedding_init=nnx.with_partitioning(
            nnx.initializers.normal(1.0), ("vocab", "embed")))  # fmt: skip
        self.mlp = nnx.Linear(D, D, kernel_init=nnx.with_partitioning(LECUN, ("embed", "mlp")),
                              rngs=rngs)  # fmt: skip

    def __call__(self, ids):
        x = self.embed(ids)
        return self.embed.attend(x + jax.nn.gelu(self.mlp(x)))


@dataclasses.dataclass(frozen=True)
class Entry:
    """A gallery model: how to build it, its loss and its batches."""

    factory: Callable[[], nnx.Module]
    loss: Callable = token_loss
    batch: Callable = tokens
    needs_mesh: bool = False  # its __call__ uses bare PartitionSpecs


GALLERY = {
    "explicit-decoder": Entry(lambda: ExplicitDecoder(nnx.Rngs(0))),
    "data-attributes": Entry(lambda: DataAttrDecoder(nnx.Rngs(0))),
    "vit": Entry(lambda: ViT(nnx.Rngs(0)), image_loss, images),
    "resnet": Entry(lambda: ResNet(nnx.Rngs(0)), image_loss, images),
    "dropout": Entry(lambda: DropoutMLP(nnx.Rngs(0))),
    "short-names": Entry(lambda: ShortNames(nnx.Rngs(0))),
    "flax-guide": Entry(lambda: GuideStack(nnx.Rngs(0)), needs_mesh=True),
    "tied": Entry(lambda: Tied(nnx.Rngs(0))),
}


# Published models: what others' code keeps on its modules and passes to its loss. Each
# builds and trains under nnx.jit; none knows about substrax.
def _mlp_head(config, rngs):
    embed = nnx.Embed(config.vocab, config.width, rngs=rngs)
    return embed, nnx.Linear(config.width, config.vocab, rngs=rngs)


# (i) A plain (mutable, so unhashable) dataclass config kept on the module.
@dataclasses.dataclass
class MLPConfig:
    vocab: int = V
    width: int = D
    hidden: int = F
    activation: str = "gelu"


# (j) The same config with slots=True (no __dict__, no hash).
@dataclasses.dataclass(slots=True)
class SlotsConfig:
    vocab: int = V
    width: int = D
    hidden: int = F
    activation: str = "silu"


class ConfigMLP(nnx.Module):
    def __init__(self, config, rngs: nnx.Rngs):
        self.config = config
        self.embed, self.head = _mlp_head(config, rngs)
        self.up = nnx.Linear(config.width, config.hidden, rngs=rngs)
        self.down = nnx.Linear(config.hidden, config.width, rngs=rngs)

    def __call__(self, ids):
        x = self.embed(ids)
        act = getattr(jax.nn, self.config.activation)
        return self.head(x + self.down(act(self.up(x))))


# (k) A frozen config holding a list of block configs (a list inside: no hash).
@dataclasses.dataclass(frozen=True)
class BlockConfig:
    hidden: int
    residual: bool = True


@dataclasses.dataclass(frozen=True)
class StackConfig:
    blocks: list
    vocab: int = V
    width: int = D


class ConfigBlock(nnx.Module):
    def __init__(self, width, config: BlockConfig, rngs: nnx.Rngs):
        self.config = config
        self.up = nnx.Linear(width, config.hidden, rngs=rngs)
        self.down = nnx.Linear(config.hidden, width, rngs=rngs)

    def __call__(self, x):
        y = self.down(jax.nn.gelu(self.up(x)))
        return x + y if self.config.residual else y


class ConfigStack(nnx.Module):
    def __init__(self, config: StackConfig, rngs: nnx.Rngs):
        self.config = config
        self.embed, self.head = _mlp_head(config, rngs)
        self.blocks = nnx.List([ConfigBlock(config.width, c, rngs) for c in config.blocks])

    def __call__(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


# (l) List and set attributes: layer widths and the indices of residual blocks.
class Tagged(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.widths = [D, F, F, D]
        self.residual = {1}
        self.embed = nnx.Embed(V, D, rngs=rngs)
        pairs = zip(self.widths[:-1], self.widths[1:], strict=True)
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in pairs])
        self.head = nnx.Linear(D, V, rngs=rngs)

    def __call__(self, ids):
        x = self.embed(ids)
        h = x
        for i, layer in enumerate(self.layers):
            h = jax.nn.gelu(layer(h)) + (h if i in self.residual else 0)
        return self.head(x + h)


# (m, n) Stochastic depth (drop-path) with masks drawn from a plain jax key: passed in the
# batch, or held by the loss. One keep/drop decision per row.
class DropPath(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, rate: float = 0.25):
        self.rate = rate
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.up = nnx.Linear(D, F, rngs=rngs)
        self.down = nnx.Linear(F, D, rngs=rngs)
        self.head = nnx.Linear(D, V, rngs=rngs)

    def __call__(self, ids, key=None):
        x = self.embed(ids)
        h = self.down(jax.nn.gelu(self.up(x)))
        if key is not None:
            keep = jax.random.bernoulli(key, 1 - self.rate, (x.shape[0], 1, 1))
            h = jnp.where(keep, h / (1 - self.rate), 0.0)
        return self.head(x + h)


def keyed_loss(model, batch):
    ids = batch["tokens"]
    logits = model(ids[:, :-1], key=batch["key"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


def keyed_tokens(seed):
    """Tokens and a typed key (0-d: replicated to every device, not split into rows)."""
    return {"tokens": tokens(seed), "key": jax.random.key(seed)}


class HeldKeyLoss:
    """A loss that closes over its own key (made once, on first use)."""

    def __init__(self, seed: int):
        self.seed, self.key = seed, None

    def __call__(self, model, batch):
        if self.key is None:  # a concrete key, even when first called under a trace
            with jax.ensure_compile_time_eval():
                self.key = jax.random.key(self.seed)
        logits = model(batch[:, :-1], key=self.key)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


# (o) Mesh-axis specs of its own, written for a mesh with a "tp" axis: on a mesh without one,
# the user maps it with rules=[("tp", None)].
class OwnSpecs(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        def param(shape, spec, init=LECUN):
            return nnx.Param(init(rngs.params(), shape), out_sharding=spec)

        self.embed = param((V, D), P("tp", "data"), nnx.initializers.normal(1.0))
        self.up = param((D, F), P("data", "tp"))
        self.down = param((F, D), P("tp", "data"))
        self.head = param((D, V), P("data", "tp"))

    def __call__(self, ids):
        x = jnp.take(self.embed[...], ids, axis=0)
        x = x + jax.nn.gelu(x @ self.up[...]) @ self.down[...]
        return x @ self.head[...]


# (p) The Flax guide's Explicit style: the spec lives in the array's type (initializers
# called with out_sharding= under an Explicit mesh) and in einsum/dot outputs; no metadata.
class ExplicitGuide(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.embed = nnx.Param(
            nnx.initializers.normal(1.0)(rngs.params(), (V, D), out_sharding=P(None, "model"))
        )
        self.w1 = nnx.Param(init(rngs.params(), (D, F), out_sharding=P(None, "model")))
        self.w2 = nnx.Param(init(rngs.params(), (F, D), out_sharding=P("model", None)))
        self.head = nnx.Param(init(rngs.params(), (D, V), out_sharding=P(None, "model")))

    def __call__(self, ids):
        x = self.embed[...].at[ids].get(out_sharding=P("data", None, None))
        h = jax.nn.relu(
            jnp.einsum("btd,df->btf", x, self.w1[...], out_sharding=P("data", None, "model"))
        )
        x = x + jnp.einsum("btf,fd->btd", h, self.w2[...], out_sharding=P("data", None, None))
        return jnp.einsum("btd,dv->btv", x, self.head[...], out_sharding=P("data", None, None))


@dataclasses.dataclass(frozen=True)
class Published:
    """A published-style model: its factory, loss, batches, and what its user passes."""

    factory: Callable[[], nnx.Module]
    loss: Callable = token_loss
    batch: Callable = tokens
    rules: tuple | None = None  # the rules its user passes with the layout
    explicit: bool = False  # it runs on a mesh with Explicit axes only
    layout: str = "fsdp"  # the layout its mesh is meant for


PUBLISHED = {
    "dataclass-config": Published(lambda: ConfigMLP(MLPConfig(), nnx.Rngs(0))),
    "slots-config": Published(lambda: ConfigMLP(SlotsConfig(), nnx.Rngs(0))),
    "block-configs": Published(
        lambda: ConfigStack(
            StackConfig([BlockConfig(F), BlockConfig(2 * F, residual=False)]), nnx.Rngs(0)
        )
    ),
    "list-set-attributes": Published(lambda: Tagged(nnx.Rngs(0))),
    "drop-path-batch-key": Published(lambda: DropPath(nnx.Rngs(0)), keyed_loss, keyed_tokens),
    "drop-path-held-key": Published(lambda: DropPath(nnx.Rngs(0)), HeldKeyLoss(7)),
    "own-specs": Published(lambda: OwnSpecs(nnx.Rngs(0)), rules=(("tp", None),)),
    "explicit-guide": Published(
        lambda: ExplicitGuide(nnx.Rngs(0)), explicit=True, layout="fsdp+tp"
    ),
}
