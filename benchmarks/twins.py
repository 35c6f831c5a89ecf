"""The planner's estimates against compiled twins of pipeline layouts.

For Llama-3 8B and GPT-2 small (tied head) under ``pp x dp``, ``pp x zero1 dp`` and
``pp x fsdp``, this builds each layout's twin (``pp 2`` and its data axes on 8 simulated
devices, 2 layers per stage, 4 microbatches), compiles one step of
``make_train_step(Stages(...))`` and puts XLA's figures next to the estimate
(``substrax_flax.planner``'s validation; collective bytes counted per loop trip).

Run: ``python benchmarks/twins.py [--output-dir DIR]``; writes ``twins.json`` and ``twins.md``.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)

import argparse
import json
import pathlib
import warnings

from substrax.layout import Layout
from substrax.planner import architecture
from substrax_flax.planner import _validate_layout

LAYOUTS = (
    Layout.from_degrees(pp=8, dp=8),
    Layout.from_degrees(pp=16, dp=128, zero=1),
    Layout.from_degrees(pp=4, fsdp=64),
)
MODELS = ("llama3-8b", "gpt2-small")


def measure(model: str, layout: Layout) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = _validate_layout(architecture(model), layout)
    row = {"model": model, "candidate": layout.label, "twin": result["twin"]["layout"]}
    for figure in ("state_bytes", "arguments_bytes", "traffic_bytes", "peak_bytes"):
        estimate, compiled = result[figure]
        row[figure] = {"estimate": estimate, "compiled": compiled, "ratio": compiled / estimate}
    return row


def markdown(rows: list[dict]) -> str:
    lines = [
        "| model | twin | state (compiled / estimate) | traffic | peak |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        ratios = [row[f]["ratio"] for f in ("state_bytes", "traffic_bytes", "peak_bytes")]
        lines.append(
            f"| {row['model']} | {row['twin']} | {ratios[0]:.4f} | {ratios[1] - 1:+.1%} "
            f"| {ratios[2]:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--output-dir", type=pathlib.Path, default=pathlib.Path("benchmarks/results")
    )
    args = parser.parse_args(argv)
    rows = []
    for model in MODELS:
        for layout in LAYOUTS:
            rows.append(measure(model, layout))
            print(markdown(rows).splitlines()[-1], flush=True)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "twins.json").write_text(json.dumps(rows, indent=2))
    (args.output_dir / "twins.md").write_text(markdown(rows))
    return rows


if __name__ == "__main__":
    main()
