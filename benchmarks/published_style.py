"""A model written as published Flax NNX models are, trained by substrax's default step.

A frozen dataclass config, an ``nnx.List`` of blocks, ``nnx.MultiHeadAttention`` / ``Linear``
/ ``LayerNorm`` annotated with ``nnx.with_partitioning``, ``nnx.Dropout``, and a
``jax.make_mesh`` mesh (Explicit axes) with ``layout="fsdp"``. Prints the report, the step
plan's first decisions, three losses and the step's collective bytes per device (every loop
trip counted).

Run: ``python benchmarks/published_style.py``.
"""

import dataclasses

import jax

if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)

import numpy as np
import optax
from flax import nnx

import substrax_flax as sf
from substrax.hlo import traffic_by_kind


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 256
    dim: int = 64
    heads: int = 4
    layers: int = 3
    dropout: float = 0.1


class Block(nnx.Module):
    def __init__(self, cfg, rngs):
        self.cfg = cfg
        self.ln = nnx.LayerNorm(
            cfg.dim,
            scale_init=nnx.with_partitioning(nnx.initializers.ones, ("embed",)),
            bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("embed",)),
            rngs=rngs,
        )
        self.attn = nnx.MultiHeadAttention(
            cfg.heads,
            cfg.dim,
            decode=False,
            kernel_init=nnx.with_partitioning(
                nnx.initializers.lecun_normal(), ("embed", "heads", None)
            ),
            out_kernel_init=nnx.with_partitioning(
                nnx.initializers.lecun_normal(), ("heads", None, "embed")
            ),
            rngs=rngs,
        )
        self.up = nnx.Linear(
            cfg.dim,
            4 * cfg.dim,
            kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp")),
            rngs=rngs,
        )
        self.down = nnx.Linear(
            4 * cfg.dim,
            cfg.dim,
            kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("mlp", "embed")),
            rngs=rngs,
        )
        self.drop = nnx.Dropout(cfg.dropout, rngs=rngs)

    def __call__(self, x):
        x = x + self.drop(self.attn(self.ln(x)))
        return x + self.drop(self.down(jax.nn.gelu(self.up(x))))


class LM(nnx.Module):
    def __init__(self, cfg, rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(
            cfg.vocab,
            cfg.dim,
            embedding_init=nnx.with_partitioning(nnx.initializers.normal(0.02), ("vocab", "embed")),
            rngs=rngs,
        )
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.layers)])

    def __call__(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.embed.attend(x)


def loss_fn(model, batch):
    logits = model(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def main() -> None:
    mesh = jax.make_mesh((8,), ("data",))
    model = sf.create_sharded_model(
        lambda: LM(Config(), nnx.Rngs(0, dropout=1)), mesh, layout="fsdp"
    )
    print(sf.sharding_report(model))
    optimizer = sf.create_sharded_optimizer(model, optax.adamw(1e-3))
    step = sf.make_train_step(loss_fn)
    tokens = np.random.default_rng(0).integers(0, 256, (16, 33))
    for decision in step.plan_for(model, optimizer, tokens).decisions[:3]:
        print(decision)
    for i in range(3):
        metrics = step(model, optimizer, tokens)
        print(f"step {i + 1}: loss {float(metrics['loss']):.3f} ({metrics['path']} step)")
    text = step.lower(model, optimizer, tokens).compile().as_text()
    traffic = traffic_by_kind(text, 8, trips=True)
    print("bytes per device:", {kind: row["bytes"] for kind, row in traffic.items()})


if __name__ == "__main__":
    main()
