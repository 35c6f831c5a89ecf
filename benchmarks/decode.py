"""Generation with the KV cache against the whole window per token, at the model's layout.

On the example decoder over 8 simulated devices, for FSDP 8 and FSDP 4 x TP 2:
``generate(model, prompt, N)`` with the cache (the default for a model with ``init_cache``) and
with ``cache=False`` (each token a forward over the prompt and the tokens so far): seconds per
token after the first call (median of ``--repeats`` runs, compiles excluded), whether the two
give the same tokens, and the cache's bytes per device as planned (``make_decode_step``) and as
held.

Run: ``python benchmarks/decode.py [--size tiny] [--tokens 48] [--output-dir DIR]``; writes
``decode.json`` and ``decode.md``.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)

import argparse
import pathlib
import statistics
import time

import numpy as np
from flax import nnx
from layouts import SIZES, gpt, write_results  # layouts puts examples/ on the path

import substrax_flax as sf
from substrax.layout import Layout

CASES = {"FSDP 8": ("fsdp", {"data": 8}), "FSDP 4 x TP 2": ("fsdp+tp", {"data": 4, "model": 2})}
ROWS, PROMPT = 8, 6


def _seconds_per_token(model, prompt, tokens, repeats, cache) -> tuple[float, np.ndarray]:
    out = sf.generate(model, prompt, tokens, cache=cache)  # compiles
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sf.generate(model, prompt, tokens, cache=cache)
        times.append((time.perf_counter() - start) / tokens)
    return statistics.median(times), out


def row(config, label, tokens, repeats) -> dict:
    layout, mesh_shape = CASES[label]
    model = sf.create_sharded_model(lambda: gpt.GPT(config, nnx.Rngs(0)),
                                    layout=Layout.named(layout, mesh_shape))  # fmt: skip
    model.eval()
    prompt = gpt.batch_at(0, ROWS, PROMPT)[:, :PROMPT]
    cached, with_cache = _seconds_per_token(model, prompt, tokens, repeats, None)
    windowed, without = _seconds_per_token(model, prompt, tokens, repeats, False)
    step = sf.make_decode_step(model, ROWS, PROMPT + tokens)
    held = sum(
        leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(step.cache)
    )  # fmt: skip
    return {
        "layout": label,
        "cache_s_per_token": cached,
        "window_s_per_token": windowed,
        "speedup": windowed / cached,
        "same_tokens": bool((with_cache == without).all()),
        "cache_bytes_per_device": step.bytes_per_device,
        "cache_bytes_held": held,
        "cache_spec": str(next(r.spec for r in step.rows if r.path.endswith("cached_key"))),
    }


def markdown(report: dict) -> str:
    lines = [
        f"### Generation: {report['rows']} rows, a prompt of {report['prompt']} tokens, "
        f"{report['tokens']} new tokens (greedy)\n",
        "| layout | KV cache ms / token | whole window ms / token | speedup | same tokens | "
        "cache KiB / device, planned (held) | cache spec (keys) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["rows_measured"]:
        lines.append(
            f"| {r['layout']} | {r['cache_s_per_token'] * 1e3:.1f} | "
            f"{r['window_s_per_token'] * 1e3:.1f} | {r['speedup']:.2f}x | {r['same_tokens']} | "
            f"{r['cache_bytes_per_device'] / 1024:.1f} ({r['cache_bytes_held'] / 1024:.1f}) | "
            f"`{r['cache_spec']}` |"
        )
    lines.append(
        f"\nMeasured {report['date']}, {report['devices']} simulated CPU devices, jax "
        f"{report['jax']}; model {report['config']}; median of {report['repeats']} runs, "
        "compiles excluded."
    )
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output-dir", type=pathlib.Path, default=pathlib.Path("benchmarks"))
    args = parser.parse_args(argv)
    config = SIZES[args.size]
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "devices": jax.device_count(),
        "jax": jax.__version__,
        "config": str(config),
        "rows": ROWS,
        "prompt": PROMPT,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "rows_measured": [row(config, label, args.tokens, args.repeats) for label in CASES],
    }
    write_results(args.output_dir, "decode", report, markdown(report))
    return report


if __name__ == "__main__":
    main()
