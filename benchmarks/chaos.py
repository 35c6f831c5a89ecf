"""A run killed at random points and resumed, alternating process counts, ends as if never killed.

The main example trains a small decoder, saving every ``--save-every`` steps (asynchronously)
into one checkpoint directory and one metrics file. Each attempt is started with
``--resume-if-present``, alternately as 2 processes x 4 devices (``python -m substrax.launch``)
and as 1 process x 8 devices, and is killed (SIGKILL, the launcher and its workers together):
every other kill at a random time after its first new save (a step, or the next asynchronous
save), the others at a random time from its start (start-up, a restore, the first steps). After
``--kills`` kills one attempt runs to the end. Then its per-step losses (``metrics.jsonl``
holds every step once) are compared with those of an uninterrupted run, which saves once.

Run: ``python benchmarks/chaos.py [--kills 10] [--seed 0] [--output-dir DIR]``; writes
``chaos.json`` and ``chaos.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = str(ROOT / "examples" / "fsdp_training.py")
SIZE = ["--vocab", "128", "--d-model", "64", "--heads", "4", "--mlp", "128", "--layers", "2",
        "--seq", "32", "--batch-size", "16", "--mesh", "data=2,model=4", "--quiet",
        "--eval-every", "0"]  # fmt: skip


def _command(processes: int, steps: int, save_every: int, ckpt: str, out: str) -> list[str]:
    run = [*SIZE, "--steps", str(steps), "--save-every", str(save_every), "--checkpoint-dir",
           ckpt, "--resume-if-present", "--output-dir", out]  # fmt: skip
    if processes == 1:
        return [sys.executable, EXAMPLE, *run]
    return [sys.executable, "-m", "substrax.launch", "--num-processes", "2",
            "--devices-per-process", "4", "--timeout", "300", EXAMPLE, *run]  # fmt: skip


def _env() -> dict:
    """The environment without a device-count flag: each launched process sets its own count."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    kept = " ".join(f for f in flags if not f.startswith("--xla_force_host_platform_device_count"))
    return {**os.environ, "XLA_FLAGS": kept}


def attempt(command: list[str], kill_after: float | None, ckpt: pathlib.Path | None = None) -> dict:
    """Runs ``command``, killing it (its whole process group) after ``kill_after`` s.

    With ``ckpt``, ``kill_after`` counts from the first new checkpoint step it saves, so
    the kill lands in a later step or save and the next attempt has something to resume.
    """
    start = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True, env=_env(), start_new_session=True)  # fmt: skip
    if kill_after is not None and ckpt is not None:
        before = max(_steps(ckpt), default=0)
        while process.poll() is None and max(_steps(ckpt), default=0) <= before:
            time.sleep(0.05)
    try:
        _, errors = process.communicate(timeout=kill_after)
        killed = False
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        _, errors = process.communicate()
        killed = True
    errors = errors[-2000:] if not killed else ""
    return {"killed": killed, "seconds": time.monotonic() - start,
            "status": process.returncode, "errors": errors}  # fmt: skip


def _steps(ckpt: pathlib.Path) -> list[int]:
    """The complete checkpoint steps in ``ckpt`` (none when it does not exist yet)."""
    return [int(p.name) for p in ckpt.iterdir() if p.name.isdigit()] if ckpt.exists() else []


def losses(out: pathlib.Path) -> dict[int, float]:
    """Step -> loss of every line of ``metrics.jsonl`` (each step must appear once)."""
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [line["step"] for line in lines]
    if len(steps) != len(set(steps)):
        raise AssertionError(f"metrics.jsonl repeats steps: {steps}")
    return {line["step"]: line["loss"] for line in lines}


def run(kills: int, seed: int, steps: int, save_every: int, directory: pathlib.Path) -> dict:
    rng = random.Random(seed)
    reference = directory / "reference"
    # the uninterrupted run saves once, at its end: its saves would not change its losses,
    # and every save of a run takes as long as several of these small steps
    done = attempt(_command(1, steps, steps, str(reference / "ckpt"), str(reference)), None)
    if done["status"] != 0:
        raise RuntimeError(f"the uninterrupted run failed: {done['errors']}")
    chaos, log = directory / "chaos", []
    while max(_steps(chaos / "ckpt"), default=0) < steps:  # until the last step is saved
        processes = 2 if len(log) % 2 == 0 else 1
        killed = sum(entry["killed"] for entry in log)
        command = _command(processes, steps, save_every, str(chaos / "ckpt"), str(chaos))
        start = max(_steps(chaos / "ckpt"), default=0)
        # every other kill comes at a random time after the attempt's first new save (a
        # step, or the next asynchronous save), the others at a random time from its start
        # (start-up, a restore, the first steps); a kill after the last save ends the run
        if killed >= kills:
            entry = attempt(command, None)
        elif killed % 2 == 0:
            entry = attempt(command, rng.uniform(0.0, 3.0), chaos / "ckpt")
        else:
            entry = attempt(command, rng.uniform(4.0, 10.0))
        log.append({"processes": processes, "from_step": start,
                    "saved_after": max(_steps(chaos / "ckpt"), default=0), **entry})  # fmt: skip
        if not entry["killed"]:
            if entry["status"] != 0:
                raise RuntimeError(f"attempt {len(log)} failed: {entry['errors']}")
            break
    want, got = losses(reference), losses(chaos)
    same = got.keys() == want.keys()
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in want) if same else None
    return {"kills": sum(e["killed"] for e in log), "attempts": log, "steps": steps,
            "same_steps": same, "max_relative_loss_difference": worst,
            "reference": str(reference), "chaos": str(chaos)}  # fmt: skip


def markdown(report: dict) -> str:
    rows = "\n".join(
        f"| {k + 1} | {a['processes']} | {a['from_step']} | {a['seconds']:.1f} | "
        f"{'killed' if a['killed'] else 'finished'} | {a['saved_after']} |"
        for k, a in enumerate(report["attempts"])
    )
    return (
        f"# {report['kills']} random kills, resumed alternately on 2 x 4 and 1 x 8 devices\n\n"
        f"`python benchmarks/chaos.py`, measured {time.strftime('%Y-%m-%d')}. Every step of "
        f"{report['steps']} logged once: {report['same_steps']}; largest relative loss "
        f"difference from the uninterrupted run: {report['max_relative_loss_difference']:.2e}.\n\n"
        "| attempt | processes | resumed from step | seconds | end | latest step after |\n"
        "|---|---|---|---|---|---|\n" + rows + "\n"
    )


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10, help="random kills before the last run")
    parser.add_argument("--seed", type=int, default=0, help="seeds the kill times")
    parser.add_argument("--steps", type=int, default=80, help="steps of the run")
    parser.add_argument("--save-every", type=int, default=4, help="steps between checkpoints")
    parser.add_argument("--output-dir", type=pathlib.Path, default=None,
                        help="write chaos.json and chaos.md here")  # fmt: skip
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as directory:
        report = run(args.kills, args.seed, args.steps, args.save_every, pathlib.Path(directory))
    table = markdown(report)
    if args.output_dir is not None:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from layouts import write_results

        write_results(args.output_dir, "chaos", report, table)
    else:
        print(table)
    return report


if __name__ == "__main__":
    main()
