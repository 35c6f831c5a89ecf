"""The planner against published training runs: estimate, ratio, fit and rank per run.

For each run of ``substrax.planner._calibration.PUBLISHED`` (torchtitan's Llama 3 rows and
Megatron-LM's GPT weak-scaling rows, on H100s) it prints the published step time, the
planner's estimate at the published layout, their ratio, whether the estimate fits the
device, its memory against what the source reports (where it does), and the rank of the
published layout among the planner's own candidates for the same model, devices and batch
(``substrax.planner._calibration.rank``: layout and microbatches searched; remat and schedule
fixed to the published ones), with the planner's pick and how much faster it estimates it:
once among the layouts its framework offers, once among all of substrax's. It fits the
efficiencies again and checks them against the ones the planner ships.

Run: ``python benchmarks/planner_published.py [--output-dir DIR]``; writes
``planner_published.json`` and ``planner_published.md``.
"""

from __future__ import annotations

import argparse
import json
import pathlib

from substrax.planner._calibration import PUBLISHED, estimate, fit, rank, ratios, summary
from substrax.planner._efficiency import CALIBRATED, SPREAD
from substrax.planner._layouts import STRATEGIES


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=pathlib.Path, default=pathlib.Path("benchmarks"))
    args = parser.parse_args(argv)
    fitted = fit()
    rows = []
    for run, ratio in zip(PUBLISHED, ratios(), strict=True):
        candidate = estimate(run)
        rows.append({
            "run": run.name, "source": run.source, "published_s": run.step_s,
            "estimate_s": candidate.time_s, "ratio": ratio, "fits": candidate.fits,
            "peak_gib": candidate.bytes_per_device["peak"] / 2**30,
            "reported_gib": run.reserved_gib or None, "strategies": list(run.strategies),
            "framework": rank(run), "all": rank(run, STRATEGIES),
        })  # fmt: skip
    stats = summary([r["ratio"] for r in rows])
    result = {
        "shipped": {"matmul": CALIBRATED.matmul, "attention": CALIBRATED.attention,
                    "exposed": dict(CALIBRATED.exposed), "spread": SPREAD},
        "fitted": {"matmul": fitted.matmul, "attention": fitted.attention,
                   "exposed": dict(fitted.exposed)},
        "summary": stats,
        "rows": rows,
    }  # fmt: skip
    lines = [
        "| run | published s | estimate s | ratio | fits | peak GiB (reported) | rank among "
        "its framework's layouts: pick (its time / published layout's) | rank among all "
        "substrax layouts: pick |",
        "|---|---:|---:|---:|---|---:|---|---|",
    ]
    for r in rows:
        memory = f"{r['peak_gib']:.1f}" + (f" ({r['reported_gib']})" if r["reported_gib"] else "")
        ranks = [
            f"{k['rank']} of {k['candidates']}: {k['pick']} ({k['pick_over_published']:.3f})"
            for k in (r["framework"], r["all"])
        ]
        lines.append(
            f"| {r['run']} | {r['published_s']:.2f} | {r['estimate_s']:.2f} | {r['ratio']:.3f} "
            f"| {'yes' if r['fits'] else 'no'} | {memory} | {ranks[0]} | {ranks[1]} |"
        )
    lines.append("")
    lines.append(
        f"median ratio {stats['median']:.3f}, worst {stats['worst']:.3f}, spread "
        f"+-{stats['spread']:.1%}; fitted: matmul and attention {fitted.matmul:.3f} of peak, "
        f"exposed {dict(fitted.exposed)}; shipped: {CALIBRATED.matmul:.3f}, "
        f"{dict(CALIBRATED.exposed)}, spread +-{SPREAD:.0%}"
    )
    text = "\n".join(lines)
    print(text)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "planner_published.json").write_text(json.dumps(result, indent=2))
    (args.output_dir / "planner_published.md").write_text(
        "# The planner against published runs\n\n`python benchmarks/planner_published.py "
        "--output-dir benchmarks/results`\n\n" + text + "\n"
    )
    return result


if __name__ == "__main__":
    main()
