"""Per-layer gathers on a model written as published Flax NNX models are: a dataclass config
on the module, its own logical specs, dropout, blocks stacked by ``nnx.vmap`` and run by
``nnx.scan``, on a ``jax.make_mesh`` mesh (Explicit axes). The sharded step, gathering each
layer inside the scan, equals one device's ``nnx.jit`` step, dropout masks included. Each block's
bias, which no mesh axis splits, is summed over the accumulation slices beside the sharded
kernels (one barrier over the whole gradient tree made it vary over the batch axes and broke
the scan: ``_manual.reduced_in_the_loop``)."""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from flax_test_models import token_loss, train, unsharded

import substrax_flax as sf


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 64
    width: int = 32
    hidden: int = 64
    layers: int = 4
    rate: float = 0.2


class Block(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs):
        self.up = nnx.Linear(c.width, c.hidden, use_bias=False, rngs=rngs,
                             kernel_metadata={"out_sharding": ("embed", "mlp")})  # fmt: skip
        # a bias no mesh axis splits: its gradient is the same on every replica
        self.down = nnx.Linear(c.hidden, c.width, rngs=rngs,
                               kernel_metadata={"out_sharding": ("mlp", "embed")})  # fmt: skip
        self.drop = nnx.Dropout(c.rate, rngs=rngs)

    def __call__(self, x):
        return x + self.drop(self.down(jax.nn.gelu(self.up(x))))


class Scanned(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs):
        self.config = c
        self.embed = nnx.Embed(c.vocab, c.width, rngs=rngs,
                               embedding_metadata={"out_sharding": ("vocab", "embed")})  # fmt: skip

        @nnx.split_rngs(splits=c.layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make(rngs):
            return Block(c, rngs)

        self.blocks = make(rngs)

    def __call__(self, tokens):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x, block):
            return block(x)

        return run(self.embed(tokens), self.blocks) @ self.embed.embedding[...].T


BATCH = jax.random.randint(jax.random.key(1), (16, 9), 0, 64)


def _one_device(config):
    model = unsharded(lambda: Scanned(config, nnx.Rngs(0)))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    return train(model, optimizer, [BATCH] * 3, token_loss)


@pytest.fixture(scope="module")
def one_device():
    losses = _one_device(Config())
    assert abs(losses[-1] - _one_device(Config(rate=0.0))[-1]) > 1e-3  # dropout changes them
    return losses


@pytest.mark.parametrize("options", [{}, {"gather": "regather", "microbatches": 2}],
                         ids=["keep", "regather-accumulated"])  # fmt: skip
def test_a_published_style_stack_with_dropout_equals_one_device(one_device, options):
    mesh = jax.make_mesh((4, 2), ("data", "model"))  # Explicit axes, jax's default
    model = sf.create_sharded_model(lambda: Scanned(Config(), nnx.Rngs(0)), mesh,
                                    layout="fsdp+tp")  # fmt: skip
    optimizer = sf.create_sharded_optimizer(model, optax.adamw(1e-2))
    step = sf.make_train_step(token_loss, **options)
    losses = [float(step(model, optimizer, BATCH)["loss"]) for _ in range(3)]
    assert step.plan.path == "manual"
    np.testing.assert_allclose(losses, one_device, rtol=1e-5)
