"""The main job, end to end at a tiny size, and its one-line errors."""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = ["--vocab", "128", "--d-model", "32", "--heads", "4", "--mlp", "64", "--layers", "1",
        "--seq", "16", "--batch-size", "8", "--quiet"]  # fmt: skip


def _run(*args, tmp_path):
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / "fsdp_training.py"), *args,
         "--output-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp+tp"])
def test_example_trains_and_writes_metrics(tmp_path, strategy):
    result = _run(*TINY, "--steps", "12", "--strategy", strategy, tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["start_step"] == 0 and len(metrics["losses"]) == 12
    assert metrics["mesh"] == {"data": 2, "model": 4} and metrics["strategy"] == strategy
    assert metrics["losses"][-1] < metrics["losses"][0]
    assert "loss" in result.stdout and "MiB per device" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mesh", "data=3,model=4"], "needs 12 devices, but 8 were given"),
        (["--strategy", "zero3"], "Unknown strategy 'zero3'; choose one of dp, fsdp"),
        (["--batch-size", "7"], "--batch-size 7 does not divide the 2 devices"),
        (["--mesh", "data"], "expected name=size pairs"),
    ],
)
def test_example_rejects_bad_input_in_one_line(tmp_path, args, message):
    result = _run(*TINY, "--strategy", "tp", *args, tmp_path=tmp_path)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
