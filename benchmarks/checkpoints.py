"""What checkpointing costs a training run: no saves, synchronous saves, asynchronous saves.

Runs the main example (``examples/fsdp_training.py``, its default decoder and ``fsdp`` layout on
8 simulated CPU devices) three times for the same steps: without ``--checkpoint-dir``, saving
every ``--save-every`` steps with ``--synchronous-saves``, and saving as often in the background
(the default). Reported per run: the median step time (the step call alone, from
``metrics.jsonl``), the mean wall time per step with every save included (the loop's time over
its steps, the compile left out) and both against the run without saves.

Run: ``python benchmarks/checkpoints.py [--steps 40] [--save-every 5] [--output-dir DIR]``;
writes ``checkpoints.json`` and ``checkpoints.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

RUNS = {
    "no saves": [],
    "synchronous saves": ["--synchronous-saves"],
    "asynchronous saves (default)": [],
}


def run(name: str, steps: int, save_every: int, directory: pathlib.Path) -> dict:
    """One run of the example; its step times and throughput."""
    out = directory / name.split()[0]
    command = [sys.executable, str(ROOT / "examples" / "fsdp_training.py"), "--quiet",
               "--steps", str(steps), "--output-dir", str(out), *RUNS[name]]  # fmt: skip
    if name != "no saves":
        command += ["--checkpoint-dir", str(out / "ckpt"), "--save-every", str(save_every)]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    subprocess.run(command, check=True, capture_output=True, text=True, env=env)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    seconds = [line["seconds"] for line in lines[1:]]  # the first call compiles
    metrics = json.loads((out / "metrics.json").read_text())
    tokens = metrics["batch_size"] * metrics["config"]["seq"]
    return {"run": name, "median_step_s": statistics.median(seconds),
            "wall_per_step_s": tokens / metrics["tokens_per_second"]}  # fmt: skip


def measure(steps: int, save_every: int) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        rows = [run(name, steps, save_every, pathlib.Path(directory)) for name in RUNS]
    return {"steps": steps, "save_every": save_every, "rows": rows,
            "date": time.strftime("%Y-%m-%d"),
            "machine": f"{os.cpu_count()} CPU cores ({platform.machine()})"}  # fmt: skip


def markdown(report: dict) -> str:
    base = report["rows"][0]
    lines = [
        f"# Checkpoints every {report['save_every']} steps: what they cost a run",
        "",
        f"The main example's default run ({report['steps']} steps, fsdp over 8 simulated CPU "
        f"devices), measured {report['date']} on {report['machine']} "
        "(`python benchmarks/checkpoints.py`).",
        "",
        "| run | median step s | x no saves | wall s per step, saves included | x no saves |",
        "|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        median, wall = row["median_step_s"], row["wall_per_step_s"]
        lines.append(
            f"| {row['run']} | {median:.3f} | {median / base['median_step_s']:.2f}x | "
            f"{wall:.3f} | {wall / base['wall_per_step_s']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="steps per run")
    parser.add_argument("--save-every", type=int, default=5, help="steps between saves")
    parser.add_argument("--output-dir", type=pathlib.Path, default=None,
                        help="write checkpoints.json and checkpoints.md here")  # fmt: skip
    args = parser.parse_args(argv)
    report = measure(args.steps, args.save_every)
    table = markdown(report)
    if args.output_dir is not None:
        from layouts import write_results

        write_results(args.output_dir, "checkpoints", report, table)
    else:
        print(table)
    return report


if __name__ == "__main__":
    main()
