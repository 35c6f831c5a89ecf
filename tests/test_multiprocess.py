"""Several processes on 127.0.0.1: the launcher, multi-host meshes, the example and checkpoints.

Every wait is bounded: the launcher's --timeout and subprocess timeouts.
"""

import json
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = str(ROOT / "examples" / "fsdp_training.py")
WORKER = str(ROOT / "tests" / "launch_worker.py")
TINY = ["--vocab", "128", "--d-model", "32", "--heads", "4", "--mlp", "64", "--layers", "1",
        "--seq", "16", "--batch-size", "8", "--quiet", "--eval-every", "0"]  # fmt: skip


def _launch(*args, processes=2, devices=4, timeout=240):
    command = [
        sys.executable, "-m", "substrax.launch", "--num-processes", str(processes),
        "--devices-per-process", str(devices), "--timeout", str(timeout - 30), *args,
    ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)


def _single(*args):
    command = [sys.executable, EXAMPLE, *TINY, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)


def _losses(directory):
    return json.loads((directory / "metrics.json").read_text())


def test_launcher_prefixes_output_and_passes_the_environment():
    result = _launch(WORKER, "hello", processes=3, devices=1, timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = sorted(result.stdout.splitlines())
    assert lines == [f"[{i}] hello from {i} of 3" for i in range(3)]


def test_launcher_stops_the_others_when_one_dies():
    start = time.monotonic()
    result = _launch(WORKER, "one-dies", processes=2, devices=1, timeout=90)
    assert result.returncode == 3
    assert time.monotonic() - start < 60


def test_multihost_mesh_puts_the_process_dimension_outermost():
    result = _launch(WORKER, "devices", processes=2, devices=4, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = sorted(line.split("] ", 1)[1] for line in result.stdout.splitlines() if "] " in line)
    assert lines == ["0 2 4 [{0}, {1}]", "1 2 4 [{0}, {1}]"]


def test_two_processes_each_read_their_half_of_a_checkpoint(tmp_path):
    """fsdp over both processes' 8 devices: each reads its own slices; the export is exact."""
    import safetensors.numpy

    sys.path.insert(0, str(ROOT / "examples"))
    import llama

    config = llama.LlamaConfig(hidden_size=128, intermediate_size=256)
    tensors = llama.write_random_checkpoint(tmp_path / "in", config)
    result = _launch(WORKER, "weights", str(tmp_path / "in"), str(tmp_path / "out"), timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    reads = [line.split("read ", 1)[1].split(" of ") for line in result.stdout.splitlines()
             if "] read " in line]  # fmt: skip
    assert len(reads) == 2
    for read, total in reads:
        assert int(read) <= 0.55 * int(total)  # measured 0.50 each
    back = safetensors.numpy.load_file(tmp_path / "out" / "model.safetensors")
    assert back.keys() == tensors.keys()
    for name, value in tensors.items():  # what the two processes loaded, gathered and written
        np.testing.assert_array_equal(back[name], value)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: 9 steps in one process."""
    directory = tmp_path_factory.mktemp("one")
    full = _single("--steps", "9", "--output-dir", str(directory))
    assert full.returncode == 0, full.stderr
    return _losses(directory)


def test_two_processes_train_like_one(tmp_path, one_process):
    multi = _launch(EXAMPLE, *TINY, "--steps", "8", "--output-dir", str(tmp_path / "two"))
    assert multi.returncode == 0, multi.stdout + multi.stderr
    two = _losses(tmp_path / "two")
    assert two["mesh"] == one_process["mesh"] == {"data": 2, "model": 4}
    np.testing.assert_allclose(two["losses"], one_process["losses"][:8], rtol=1e-5)


def test_checkpoints_move_between_process_counts_and_layouts(tmp_path, one_process):
    ckpt = str(tmp_path / "ckpt")
    # 2 processes, FSDP 2x4, save at step 3 ...
    first = _launch(EXAMPLE, *TINY, "--steps", "3", "--checkpoint-dir", ckpt,
                    "--output-dir", str(tmp_path / "a"))  # fmt: skip
    assert first.returncode == 0, first.stdout + first.stderr
    # ... 1 process, TP 1x8, resumes to step 6 and saves ...
    second = _single(
        "--steps", "6", "--checkpoint-dir", ckpt, "--resume", "--mesh", "data=1,model=8",
        "--strategy", "tp", "--output-dir", str(tmp_path / "b"),
    )  # fmt: skip
    assert second.returncode == 0, second.stderr
    # ... 2 processes, FSDP + TP, resume to step 9.
    third = _launch(EXAMPLE, *TINY, "--steps", "9", "--checkpoint-dir", ckpt, "--resume",
                    "--strategy", "fsdp+tp", "--output-dir", str(tmp_path / "c"))  # fmt: skip
    assert third.returncode == 0, third.stdout + third.stderr
    pieces = [_losses(tmp_path / name) for name in "abc"]
    assert [p["start_step"] for p in pieces] == [0, 3, 6]
    resumed = [loss for piece in pieces for loss in piece["losses"]]
    np.testing.assert_allclose(resumed, one_process["losses"], rtol=1e-5)


def test_processes_started_with_different_layouts_stop_at_once_naming_the_difference():
    """A typo on one host used to hang both processes in a collective; now both stop."""
    start = time.monotonic()
    result = _launch(WORKER, "layouts-differ", processes=2, devices=4, timeout=150)
    assert result.returncode != 0, result.stdout
    output = result.stdout + result.stderr
    assert "model plan 1 differs from process" in output, output[-3000:]
    assert "line 2: process 1 has 'layout dp 8', process 0 has 'layout fsdp 8'" in output or (
        "line 2: process 0 has 'layout fsdp 8', process 1 has 'layout dp 8'" in output
    )
    assert "created" not in result.stdout
    assert time.monotonic() - start < 90
