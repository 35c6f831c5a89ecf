"""How fast the planner is: Llama-3 sweeps, with the workload fixed and with remat, microbatches
and pipeline schedule searched, and the command line's CPU time for 405B on 4,096 devices in a
fresh process (the import included).

Run: ``python benchmarks/planner.py [--repeats N] [--output-dir DIR]``; writes ``planner.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import resource
import statistics
import subprocess
import sys
import time

from substrax.planner import Hardware, Workload, plan


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output-dir", type=pathlib.Path, default=pathlib.Path("benchmarks"))
    args = parser.parse_args(argv)
    hardware = Hardware(memory_bytes=80 * 10**9, flops=989e12, intra_host_bandwidth=450e9,
                        inter_host_bandwidth=50e9)  # fmt: skip
    fixed = Workload(batch_tokens=16 * 2**20, seq=8192, microbatches=16)
    searched = dataclasses.replace(fixed, remat=None, microbatches=None, schedule=None,
                                   chunks=None)  # fmt: skip
    rows = {}
    sweeps = [(m, d, w) for m, d in (("llama3-405b", 4096), ("llama3-70b", 512),
                                     ("llama3-8b", 64)) for w in (fixed, searched)]  # fmt: skip
    for model, devices, workload in sweeps:
        label = f"{model} on {devices}, {'searched' if workload is searched else 'fixed'}"
        times, count = [], 0
        for _ in range(args.repeats):
            start = time.perf_counter()
            count = len(plan(model, devices, hardware, workload).candidates)
            times.append(time.perf_counter() - start)
        sweep = statistics.median(times)
        rows[label] = {
            "candidates": count,
            "sweep_s": sweep,
            "per_candidate_ms": 1000 * sweep / count,
        }
        print(f"{label}: {count} candidates in {sweep * 1000:.1f} ms "
              f"({1000 * sweep / count:.3f} ms each)")  # fmt: skip
    rows["command line, llama3-405b on 4096"] = _command_line(args.repeats)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "planner.json").write_text(json.dumps(rows, indent=2))
    return rows


#: The command docs/planning.md shows, run in a fresh interpreter.
COMMAND = ["-m", "substrax.planner", "--model", "llama3-405b", "--devices", "4096", "--hardware",
           "h100", "--batch-tokens", "16Mi", "--seq", "8192", "--top", "8"]  # fmt: skip


def _command_line(repeats: int) -> dict:
    """The median CPU seconds (user + system) of ``COMMAND`` in a fresh process, and of the
    import alone."""

    def cpu(argv) -> float:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([sys.executable, *argv], check=True, stdout=subprocess.DEVNULL)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime

    whole = statistics.median(cpu(COMMAND) for _ in range(repeats))
    imported = statistics.median(cpu(["-c", "import substrax.planner"]) for _ in range(repeats))
    print(f"command line, llama3-405b on 4096: {whole:.2f} CPU-s, of which the import "
          f"{imported:.2f}")  # fmt: skip
    return {"cpu_s": whole, "import_cpu_s": imported}


if __name__ == "__main__":
    main()
