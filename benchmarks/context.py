"""Context parallelism on the example decoder: activation memory and ring traffic.

For each sequence length and context-parallel degree cp (mesh ``data=1, context=cp``, layout
``cp``; cp = 1 is one device), this compiles the default train step of the example decoder on
one batch and reads XLA's memory analysis: the temp bytes per device are the activations (the
parameters are whole on every device, so they do not change with cp). Then, for the attention of
one layer alone, the traffic per device of the ring (``collective-permute``) and of the
all-gather variant against the theory, the key/value bytes of a device's rows x (cp - 1) / cp.
``--plot`` draws temp memory against sequence length, one line per cp.

Run: ``python benchmarks/context.py [--seqs 512,1024,2048] [--plot FILE] [--output-dir DIR]``;
writes ``context.json`` and ``context.md``.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)

import argparse
import dataclasses
import pathlib
import time

import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from layouts import MIB, compiled_stats, gpt, write_results  # puts examples/ on the path

import substrax_flax as sf
from substrax.hlo import traffic_by_kind
from substrax.layout import Layout
from substrax.spmd import attention, use_rules

DEGREES = (1, 2, 4, 8)
BATCH = 2


def _layout(cp: int) -> Layout:
    return Layout.named("cp", {"data": 1, "context": cp}) if cp > 1 else Layout.from_degrees()


def step_memory(config: gpt.Config, cp: int) -> dict:
    """The compiled step's temp and peak bytes per device, and its collectives."""
    layout = _layout(cp)
    model = sf.create_sharded_model(lambda: gpt.GPT(config, nnx.Rngs(0)), layout=layout)
    optimizer = sf.create_sharded_optimizer(model, gpt.optimizer())
    step = sf.make_train_step(gpt.loss_fn)
    batch = gpt.next_tokens(gpt.batch_at(0, BATCH, config.seq, 0))
    stats = compiled_stats(step.lower(model, optimizer, batch).compile(), layout.devices)
    return {"seq": config.seq, "cp": cp, "temp_bytes": stats["temp_bytes"],
            "peak_bytes": stats["peak_bytes"], "traffic_bytes": stats["traffic_bytes"]}  # fmt: skip


def ring_traffic(config: gpt.Config, cp: int, variant: str) -> dict:
    """One layer's attention forward: bytes moved per device, and the theory."""
    layout = _layout(cp)
    mesh = layout.make_mesh()
    shape = (BATCH, config.seq, config.heads, config.head_dim)
    spec = NamedSharding(mesh, P(None, "context"))
    x = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=spec)
    with use_rules(mesh, layout.compute_rules):
        attend = jax.jit(lambda q, k, v: attention(q, k, v, causal=True, variant=variant))
        traffic = traffic_by_kind(attend.lower(x, x, x).compile().as_text(), layout.devices)
    kv_bytes = 2 * BATCH * config.seq * config.heads * config.head_dim * 4
    return {
        "seq": config.seq, "cp": cp, "variant": variant,
        "bytes": sum(kind["bytes"] for kind in traffic.values()),
        "theory_bytes": kv_bytes * (cp - 1) / cp,
        "kinds": {name: kind for name, kind in traffic.items() if kind["count"]},
    }  # fmt: skip


def _table(memory: list[dict], traffic: list[dict]) -> str:
    lines = ["| seq | cp | step temp MiB / device | vs cp 1 | 1 / cp |", "|---|---|---|---|---|"]
    for row in memory:
        base = next(r for r in memory if r["seq"] == row["seq"] and r["cp"] == 1)
        lines.append(
            f"| {row['seq']} | {row['cp']} | {row['temp_bytes'] / MIB:.1f} | "
            f"{row['temp_bytes'] / base['temp_bytes']:.2f} | {1 / row['cp']:.2f} |"
        )
    lines += ["", "| seq | cp | variant | traffic MiB / device (one layer forward) | theory MiB |"
              " collectives |", "|---|---|---|---|---|---|"]  # fmt: skip
    for row in traffic:
        kinds = ", ".join(f"{k} x{v['count']}" for k, v in row["kinds"].items())
        lines.append(
            f"| {row['seq']} | {row['cp']} | {row['variant']} | {row['bytes'] / MIB:.3f} | "
            f"{row['theory_bytes'] / MIB:.3f} | {kinds} |"
        )
    return "\n".join(lines)


def plot(memory: list[dict], path: pathlib.Path) -> None:
    """Step temp memory per device against sequence length, one line per cp."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for cp in sorted({row["cp"] for row in memory}):
        rows = [row for row in memory if row["cp"] == cp]
        axes.plot([r["seq"] for r in rows], [r["temp_bytes"] / MIB for r in rows], "o-",
                  label=f"cp {cp}")  # fmt: skip
    axes.set(xlabel="sequence length (tokens)", ylabel="step activations (temp MiB / device)",
             xscale="log", yscale="log", title="Activations per device by cp degree")  # fmt: skip
    axes.set_xticks([r["seq"] for r in memory if r["cp"] == 1], minor=False)
    axes.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    axes.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="512,1024,2048", help="sequence lengths")
    parser.add_argument("--degrees", default=",".join(map(str, DEGREES)), help="cp degrees")
    parser.add_argument("--plot", type=pathlib.Path, default=None, help="write a PNG here")
    parser.add_argument("--output-dir", type=pathlib.Path, default=pathlib.Path("benchmarks"))
    args = parser.parse_args(argv)
    seqs = [int(s) for s in args.seqs.split(",")]
    degrees = [int(d) for d in args.degrees.split(",")]
    base = gpt.Config(vocab=256, d_model=128, heads=4, mlp=256, layers=2)
    configs = [dataclasses.replace(base, seq=seq) for seq in seqs]
    memory = [step_memory(config, cp) for config in configs for cp in degrees]
    traffic = [ring_traffic(configs[-1], cp, variant)
               for cp in degrees if cp > 1 for variant in ("ring", "all_gather")]  # fmt: skip
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "jax": jax.__version__,
        "config": dataclasses.asdict(base),
        "batch_size": BATCH,
        "memory": memory,
        "traffic": traffic,
    }
    text = (
        f"# Context parallelism: {jax.devices()[0].platform} devices\n\n"
        f"The example decoder ({base}, seq varied), batch {BATCH}, layout `cp` on "
        f"`data=1,context=cp`, measured {report['date']} with jax {jax.__version__} "
        "(`python benchmarks/context.py`).\n\n" + _table(memory, traffic) + "\n"
    )
    write_results(args.output_dir, "context", report, text)
    if args.plot is not None:
        plot(memory, args.plot)
    return report


if __name__ == "__main__":
    main()
