"""Whole rows against flash attention's blocks: a causal attention step's temporaries on XLA:TPU.

Compiles (deviceless, ``libtpu``; see ``substrax.target``) the gradient of a causal
``substrax.spmd.attention`` for a ``v5p:2x2x1`` slice, one sequence per chip, over whole rows
and in blocks (``block=...``), and prints per chip the temporaries, one float32 score
square's bytes, and the matrix-product FLOPs. docs/context.md quotes its default run.

Run: ``python benchmarks/attention_blocks.py [--seq 2048] [--heads 8] [--block 256]``.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compiled for the slice, run nowhere

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from substrax.hlo import compiled_flops
from substrax.spmd import attention
from substrax.target import CompileTarget

MIB = 2**20


def compile_step(target: CompileTarget, seq: int, heads: int, head_dim: int, block: int | None):
    """The compiled gradient of ``sum(attention(q, k, v) * w)``, one sequence per chip."""
    mesh = target.make_mesh({"data": target.chips})
    shape = jax.ShapeDtypeStruct((target.chips, seq, heads, head_dim), jnp.bfloat16,
                                 sharding=NamedSharding(mesh, P("data")))  # fmt: skip

    def loss(q, k, v, w):
        return jnp.sum(attention(q, k, v, causal=True, block=block) * w)

    with target.compiling():
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*(shape,) * 4).compile()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="v5p:2x2x1")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block", type=int, default=256)
    args = parser.parse_args(argv)
    target = CompileTarget.parse(args.target)
    square = args.heads * args.seq * args.seq * 4 / MIB
    print(f"{target.name}, {args.seq} tokens, {args.heads} heads of {args.head_dim}, one "
          f"sequence per chip; a float32 score square: {square:.1f} MiB")  # fmt: skip
    for block in (None, args.block):
        compiled = compile_step(target, args.seq, args.heads, args.head_dim, block)
        temps = compiled.memory_analysis().temp_size_in_bytes / MIB
        name = "whole rows" if block is None else f"blocks of {block}"
        print(f"{name:>14}: temporaries {temps:.1f} MiB, "
              f"{compiled_flops(compiled) / 1e9:.2f} GFLOP")  # fmt: skip


if __name__ == "__main__":
    main()
