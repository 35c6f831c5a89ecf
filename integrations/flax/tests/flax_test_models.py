"""Small Flax NNX models for the adapter's tests, and a reference train step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

VOCAB, EMBED, HEADS, KV, MLP = 64, 32, 4, 8, 64
LECUN = nnx.initializers.lecun_normal()


def _param(rngs, shape, names, init=LECUN):
    return nnx.Param(init(rngs.params(), shape), out_sharding=names)


def rms_norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


class Block(nnx.Module):
    """A pre-norm transformer block annotated with embed, heads, kv and mlp."""

    def __init__(self, rngs):
        self.norm1 = nnx.Param(jnp.ones((EMBED,)), out_sharding=("embed",))
        self.wq = _param(rngs, (EMBED, HEADS, KV), ("embed", "heads", "kv"))
        self.wk = _param(rngs, (EMBED, HEADS, KV), ("embed", "heads", "kv"))
        self.wv = _param(rngs, (EMBED, HEADS, KV), ("embed", "heads", "kv"))
        self.wo = _param(rngs, (HEADS, KV, EMBED), ("heads", "kv", "embed"))
        self.norm2 = nnx.Param(jnp.ones((EMBED,)), out_sharding=("embed",))
        zeros = nnx.initializers.zeros_init()
        self.up = nnx.Linear(
            EMBED,
            MLP,
            kernel_init=nnx.with_partitioning(LECUN, ("embed", "mlp")),
            bias_init=nnx.with_partitioning(zeros, ("mlp",)),
            rngs=rngs,
        )
        self.down = nnx.Linear(
            MLP,
            EMBED,
            kernel_init=nnx.with_partitioning(LECUN, ("mlp", "embed")),
            bias_init=nnx.with_partitioning(zeros, ("embed",)),
            rngs=rngs,
        )

    def __call__(self, x):
        h = rms_norm(x, self.norm1[...])
        q = jnp.einsum("bte,ehk->bthk", h, self.wq[...])
        k = jnp.einsum("bte,ehk->bthk", h, self.wk[...])
        v = jnp.einsum("bte,ehk->bthk", h, self.wv[...])
        logits = jnp.einsum("bthk,bshk->bhts", q, k) / np.sqrt(KV)
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        weights = jax.nn.softmax(jnp.where(causal, logits, -1e9), axis=-1)
        o = jnp.einsum("bhts,bshk->bthk", weights, v)
        x = x + jnp.einsum("bthk,hke->bte", o, self.wo[...])
        return x + self.down(jax.nn.gelu(self.up(rms_norm(x, self.norm2[...]))))


class Transformer(nnx.Module):
    """A decoder annotated with vocab, embed, heads, kv and mlp."""

    def __init__(self, rngs, layers=2):
        self.embed = nnx.Embed(
            VOCAB,
            EMBED,
            embedding_init=nnx.with_partitioning(nnx.initializers.normal(0.5), ("vocab", "embed")),
            rngs=rngs,
        )
        self.blocks = nnx.List([Block(rngs) for _ in range(layers)])
        self.norm = nnx.Param(jnp.ones((EMBED,)), out_sharding=("embed",))
        self.head = _param(rngs, (EMBED, VOCAB), ("embed", "vocab"))

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return rms_norm(x, self.norm[...]) @ self.head[...]


class StackedTransformer(nnx.Module):
    """The same decoder with its blocks stacked by nnx.vmap and run by nnx.scan."""

    def __init__(self, rngs, layers=4):
        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make(rngs):
            return Block(rngs)

        self.embed = nnx.Embed(
            VOCAB,
            EMBED,
            embedding_init=nnx.with_partitioning(nnx.initializers.normal(0.5), ("vocab", "embed")),
            rngs=rngs,
        )
        self.blocks = make(rngs)
        self.norm = nnx.Param(jnp.ones((EMBED,)), out_sharding=("embed",))
        self.head = _param(rngs, (EMBED, VOCAB), ("embed", "vocab"))

    def __call__(self, tokens):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x, block):
            return block(x)

        x = run(self.embed(tokens), self.blocks)
        return rms_norm(x, self.norm[...]) @ self.head[...]


class Plain(nnx.Module):
    """No annotations at all: nnx.Linear and nnx.MultiHeadAttention."""

    def __init__(self, rngs):
        # No attention biases: the key bias gets a mathematically zero gradient, so adam turns
        # rounding noise into full-size steps and the comparison with one device is ill-posed.
        self.attn = nnx.MultiHeadAttention(
            num_heads=4,
            in_features=EMBED,
            qkv_features=EMBED,
            decode=False,
            use_bias=False,
            rngs=rngs,
        )
        self.up = nnx.Linear(EMBED, MLP, rngs=rngs)
        self.down = nnx.Linear(MLP, EMBED, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(x)
        return x + self.down(jax.nn.gelu(self.up(x)))


def token_loss(model, batch):
    logits = model(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def regression_loss(model, batch):
    return jnp.mean((model(batch) - jnp.roll(batch, 1, axis=-1)) ** 2)


def tokens(batch=8, length=9, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, length)).astype(np.int32)


def features(batch=8, length=6, seed=0):
    return np.random.default_rng(seed).normal(size=(batch, length, EMBED)).astype(np.float32)


def unsharded(factory):
    """The model as ``factory`` builds it on one device, without any mesh."""
    with nnx.use_eager_sharding(False):
        return factory()


def make_step(loss_fn):
    @nnx.jit
    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    return step


def train(model, optimizer, batches, loss_fn):
    step = make_step(loss_fn)
    return [float(step(model, optimizer, batch)) for batch in batches]


def relative_error(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def assert_laid_out_as(arrays, shardings):
    """Every array's sharding is equivalent to its planned one (P() == P(None, None))."""
    arrays, shardings = jax.tree.leaves(arrays), jax.tree.leaves(shardings)
    assert len(arrays) == len(shardings)
    for array, sharding in zip(arrays, shardings, strict=True):
        assert array.sharding.is_equivalent_to(sharding, array.ndim), (array.sharding, sharding)
