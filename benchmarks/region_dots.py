"""Why a gradient taken inside ``shard_map`` runs slower on XLA:CPU: its weight-gradient dots.

A two-matmul model (``tanh(x @ w1) @ w2``) on 8 simulated devices, its gradient taken two ways
over a batch split on ``data``: by XLA's partitioning of ``jax.grad`` (what Flax's recipe and
``data_parallel="xla"`` compile) and inside a ``shard_map`` region over ``data`` (the manual
step's way). XLA writes each weight gradient as a dot followed by a transpose (its dot
canonicalisation); inside the region no all-reduce stands between the two, so its algebraic
simplifier folds them into one dot whose left operand contracts its first dimension; XLA:CPU's
YNNPACK fusions do not take that dot, and it runs as a plain one. Prints each program's plain
dots and median time::

    .venv/bin/python benchmarks/region_dots.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from step_variants import plain_dots  # noqa: E402


def loss(params, x):
    w1, w2 = params
    hidden = jnp.tanh(jnp.einsum("btd,df->btf", x, w1))
    return jnp.mean(jnp.einsum("btf,fd->btd", hidden, w2) ** 2)


def gradients(mesh) -> dict:
    """``{"xla": fn, "region": fn}``: the two gradient programs of ``loss``."""

    def local(params, x):
        return jax.grad(lambda p: jax.lax.pmean(loss(p, x), "data"))(params)

    region = jax.shard_map(local, mesh=mesh, in_specs=((P(), P()), P("data")),
                           out_specs=(P(), P()), axis_names={"data"})  # fmt: skip
    return {"xla": jax.jit(jax.grad(loss)), "region": jax.jit(region)}


def _median_ms(fn, args, steps: int) -> float:
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64, help="sequences of 64 tokens")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    result = {}
    for label, tensor in (("dp 2 x replicated", False), ("dp 2 x tp 4", True)):
        specs = (P(None, "model"), P("model", None)) if tensor else (P(), P())
        d, f = args.d_model, 4 * args.d_model
        params = tuple(jax.device_put(jnp.full(shape, 0.01), NamedSharding(mesh, spec))
                       for shape, spec in zip(((d, f), (f, d)), specs, strict=True))  # fmt: skip
        x = jax.device_put(jnp.ones((args.tokens, 64, d)), NamedSharding(mesh, P("data")))
        row = {}
        for name, fn in gradients(mesh).items():
            text = fn.lower(params, x).compile().as_text()
            row[name] = {"plain_dots": plain_dots(text),
                         "median_ms": _median_ms(fn, (params, x), args.steps)}  # fmt: skip
        row["time_ratio"] = row["region"]["median_ms"] / row["xla"]["median_ms"]
        result[label] = row
        print(f"{label}: XLA's gradient {row['xla']['median_ms']:.1f} ms "
              f"({row['xla']['plain_dots']} plain dots), the region's "
              f"{row['region']['median_ms']:.1f} ms ({row['region']['plain_dots']} plain dots), "
              f"{row['time_ratio']:.2f}x")  # fmt: skip
    return result


if __name__ == "__main__":
    main()
