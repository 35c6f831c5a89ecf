"""The main job, end to end at a tiny size, and its one-line errors."""

import functools
import json
import pathlib
import re
import shutil
import signal
import struct
import subprocess
import sys

import numpy as np
import pytest

import substrax_flax as sf

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = ["--vocab", "128", "--d-model", "32", "--heads", "4", "--mlp", "64", "--layers", "1",
        "--seq", "16", "--batch-size", "8", "--quiet", "--eval-every", "0",
        "--sample", "0"]  # fmt: skip


def _run(*args, tmp_path):
    output = [] if "--output-dir" in args else ["--output-dir", str(tmp_path)]
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / "fsdp_training.py"), *args, *output],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def _in_process(*args, directory) -> int:
    """``main(args)`` in this process (its 8 devices are the example's), writing into
    ``directory`` unless told otherwise: its exit status. A fresh process would start jax
    again (2.7 s). A refusal is an exit status of 2 and its line on stderr; a traceback fails
    the test as an error."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.syspath_prepend(str(ROOT / "examples"))
        import fsdp_training

        output = [] if "--output-dir" in args else ["--output-dir", str(directory)]
        try:
            return fsdp_training.main([*args, *output])
        except SystemExit as exit:  # argparse's own refusals
            return exit.code


def _main(*args, tmp_path, capsys) -> subprocess.CompletedProcess:
    """:func:`_in_process`, as :func:`_run`'s result (what it printed, from ``capsys``)."""
    status = _in_process(*args, directory=tmp_path)
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, status, captured.out, captured.err)


@pytest.fixture
def example(tmp_path, capsys):
    """Runs the example's ``main(args)`` in this process (:func:`_main`), writing into
    ``tmp_path`` unless told otherwise. For runs checked by their exit status, files and what
    the example prints; :func:`_run` keeps those that need a process of their own (signals,
    two runs at once) or read what Orbax logs to stderr."""
    return functools.partial(_main, tmp_path=tmp_path, capsys=capsys)


@pytest.mark.parametrize(("strategy", "precision", "microbatches"), [("fsdp", "mixed", 2)])
def test_example_trains_and_writes_metrics(tmp_path, strategy, precision, microbatches):
    result = _run(*TINY, "--steps", "12", "--strategy", strategy, "--precision", precision,
                  "--microbatches", str(microbatches), "--batch-size", "16",
                  "--peak-tflops", "0.5", "--eval-every", "6", "--sample", "48", "--tensorboard",
                  tmp_path=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    # once the step is compiled: its peak memory and FLOPs; then MFU on every progress line
    peak = re.search(r"peak memory per device ([\d.]+) MiB \(XLA's compiled estimate\)",
                     result.stdout)  # fmt: skip
    assert peak and float(peak.group(1)) == round(metrics["peak_bytes_per_device"] / 2**20, 1)
    assert metrics["peak_bytes_per_device"] > metrics["state_bytes_per_device"]
    assert metrics["flops_per_device_per_step"] > 0 and "MFU against --peak-tflops" in result.stdout
    assert re.search(r"step 12/12 .* mfu \d+\.\d%", result.stdout)
    svg = (tmp_path / "loss.svg").read_text()
    assert svg.startswith("<svg") and svg.count(",") >= 12  # a point per step
    assert metrics["start_step"] == 0 and len(metrics["losses"]) == 12
    assert metrics["mesh"] == {"data": 2, "model": 4} and metrics["strategy"] == strategy
    assert (metrics["precision"], metrics["microbatches"]) == (precision, microbatches)
    assert metrics["losses"][-1] < metrics["losses"][0]
    assert "loss" in result.stdout and "MiB per device" in result.stdout
    # the held-out loss every 6 steps: printed, in metrics.json, on its step's line, in
    # TensorBoard; it falls as training goes on
    (first, at_6), (last, at_12) = metrics["eval_losses"]
    assert (first, last) == (6, 12) and at_12 < at_6
    assert f"step 12: held-out loss {at_12:.4f}" in result.stdout
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval_loss" in r] == [6, 12]
    assert records[11]["eval_loss"] == at_12
    # and a sampled continuation of the prompt, generated at the layout by the eval step
    assert metrics["sample"].startswith("KING.\n") and len(metrics["sample"].encode()) >= 6 + 48
    said = f"sample (48 tokens after 'KING.\\n' at temperature 0.8):\n{metrics['sample']}"
    assert said in result.stdout
    scalars = [(step, value) for tag, step, value in _tensorboard_scalars(tmp_path / "tensorboard")
               if tag == "eval_loss"]  # fmt: skip
    assert [step for step, _ in scalars] == [6, 12]
    assert [value for _, value in scalars] == pytest.approx([at_6, at_12], rel=1e-6)


def test_context_and_expert_runs_train(tmp_path, example):
    """The issue's two commands at a tiny size (their losses equal the runs without the new
    axis: test_context_parallel.py and test_experts.py compare the layouts themselves)."""
    runs = {
        "cp": ["--strategy", "fsdp+cp", "--mesh", "data=2,context=4"],
        "ep": ["--moe-experts", "4", "--strategy", "fsdp+ep", "--mesh", "data=2,expert=4"],
    }
    for name, args in runs.items():
        out = tmp_path / name
        result = example(*TINY, "--steps", "6", *args, "--output-dir", str(out))
        assert result.returncode == 0, result.stderr
        metrics = json.loads((out / "metrics.json").read_text())
        assert metrics["strategy"] == args[args.index("--strategy") + 1]
        assert metrics["moe_experts"] == (4 if name == "ep" else 0)
        assert metrics["losses"][-1] < metrics["losses"][0]


def test_blocked_attention_trains_as_whole_rows(tmp_path, example):
    """--attention-block 4 over 16 tokens (the causal half of 16 block pairs) gives the
    losses of whole rows: the online softmax differs by rounding only."""
    runs = {}
    for block in ("0", "4"):
        out = tmp_path / block
        result = example(*TINY, "--steps", "4", "--attention-block", block, "--output-dir",
                         str(out))  # fmt: skip
        assert result.returncode == 0, result.stderr
        runs[block] = json.loads((out / "metrics.json").read_text())
    assert runs["4"]["attention_block"] == 4
    assert runs["4"]["losses"] == pytest.approx(runs["0"]["losses"], rel=1e-5)
    # the blocks above the diagonal are not run
    assert runs["4"]["flops_per_device_per_step"] < runs["0"]["flops_per_device_per_step"]


def test_fine_tuning_a_llama_checkpoint_with_lora_and_exporting_it(tmp_path, example):
    import safetensors.numpy

    source, exported = tmp_path / "llama", tmp_path / "tuned"
    subprocess.run([sys.executable, str(ROOT / "examples" / "llama.py"), str(source)],
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    result = example("--init-from", str(source), "--lora-rank", "2", "--steps", "3", "--mesh",
                     "data=8", "--seq", "16", "--batch-size", "8", "--quiet", "--export",
                     str(exported))  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "21 variables from" in result.stdout and "8 keep their initialisers" in result.stdout
    losses = json.loads((tmp_path / "metrics.json").read_text())["losses"]
    assert losses[-1] < losses[0]
    before = safetensors.numpy.load_file(source / "model.safetensors")
    after = safetensors.numpy.load_file(exported / "model.safetensors")
    assert before.keys() == after.keys() and (exported / "config.json").exists()
    name = "model.layers.0.self_attn.{}_proj.weight"
    assert np.array_equal(after[name.format("k")], before[name.format("k")])  # frozen, no adapter
    assert not np.array_equal(after[name.format("q")], before[name.format("q")])  # merged in
    assert np.array_equal(after["lm_head.weight"], before["lm_head.weight"])
    # model sizes come from the checkpoint: a size flag is refused in one line
    refused = example("--init-from", str(source), "--d-model", "32")
    assert refused.returncode == 2 and "drop them" in refused.stderr


PIPELINE_SIZE = [*TINY, "--layers", "4", "--steps", "4", "--sample", "6"]


@pytest.fixture(scope="module")
def unpipelined(tmp_path_factory):
    directory = tmp_path_factory.mktemp("dp")
    status = _in_process(*PIPELINE_SIZE, "--strategy", "dp", "--stacked", "--mesh", "data=8",
                         directory=directory)  # fmt: skip
    assert status == 0
    return json.loads((directory / "metrics.json").read_text())


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
def test_pipeline_mode_matches_the_unpipelined_run(tmp_path, schedule, unpipelined, example):
    """The losses, and the closing sample: decoded with the stack's cache over the stages."""
    pipelined = example(*PIPELINE_SIZE, "--strategy", "pp", "--mesh", "pipe=4,data=2",
                        "--schedule", schedule, "--microbatches", "2")  # fmt: skip
    assert pipelined.returncode == 0, pipelined.stderr
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["losses"] == pytest.approx(unpipelined["losses"], rel=1e-5)
    assert metrics["sample"] == unpipelined["sample"] and len(metrics["sample"].encode()) >= 6 + 6


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mesh", "data=3,model=4"], "needs 12 devices, but 8 were given"),
        (["--strategy", "zero3"], "Unknown layout 'zero3'; choose one of dp, fsdp"),
        (["--batch-size", "7"], "--batch-size 7 does not divide the 2 devices"),
        (["--mesh", "data"], "expected name=size pairs"),
        (["--strategy", "pp", "--mesh", "data=8"], "--strategy pp needs a pipe= axis in --mesh"),
        (["--microbatches", "0"], "--microbatches must be a positive integer, got 0"),
        (["--strategy", "tp", "--mesh", "data=8"], "leaves none to split the batch; add a data"),
        (
            ["--strategy", "fsdp+cp", "--mesh", "data=2,context=4", "--seq", "12"],
            "--seq 12 does not split into 2 x 4 chunks",
        ),
        (
            ["--moe-experts", "6", "--strategy", "fsdp+ep", "--mesh", "data=2,expert=4"],
            "--moe-experts 6 does not divide over the 4 devices",
        ),
        (["--microbatches", "3"], "does not split into --microbatches 3 x 2 data devices"),
        (["--output-dir", "/dev/null/out"], "--output-dir /dev/null/out: /dev/null is a file, not"),
        (["--checkpoint-dir", "/dev/null/ckpt"], "/dev/null/ckpt: /dev/null is a file, not a dir"),
        (
            ["--strategy", "pp", "--mesh", "pipe=4,data=2", "--microbatches", "3", "--layers", "4"],
            "does not split into --microbatches 3 x 2 data devices",
        ),
        (
            ["--strategy", "pp", "--mesh", "pipe=4,data=2", "--layers", "3"],
            "--layers 3 is fewer than the 4 pipeline chunks",
        ),
        (["--data", "/nonexistent/corpus.txt"], "'/nonexistent/corpus.txt' does not exist"),
        (["--data", "setup.cfg"], "unknown data format '.cfg'; expected one of .bin"),
        (["--vocab", "100"], "needs a vocabulary of 126 tokens (tokenizer: bytes), more than"),
        (["--eval-fraction", "1.5"], "held_out=1.5: expected a fraction between 0 and 1"),
        (["--attention-block", "5"], "--attention-block 5 does not divide --seq 16; use a"),
    ],
)
def test_example_rejects_bad_input_in_one_line(args, message, example):
    """Exit status 2 and one line; a traceback would fail the test."""
    strategy = [] if "--strategy" in args else ["--strategy", "tp"]
    refused = example(*TINY, *strategy, *args)
    assert refused.returncode == 2, refused.stderr
    assert message in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1


def _tensorboard_scalars(directory: pathlib.Path) -> list[tuple[str, int, float]]:
    """``(tag, step, value)`` of every scalar in the TensorBoard event files under ``directory``."""
    from tensorboardX.proto import event_pb2

    scalars = []
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):  # TFRecords: length, its CRC, the event, its CRC
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
            scalars += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
            at += 16 + length
    return scalars


@pytest.fixture(scope="module")
def two_saves(tmp_path_factory):
    """A run that saved steps 1 and 2, and its losses."""
    directory = tmp_path_factory.mktemp("two_saves")
    status = _in_process(*TINY, "--steps", "3", "--save-every", "1", "--keep", "3",
                         "--checkpoint-dir", str(directory / "ckpt"), "--synchronous-saves",
                         directory=directory)  # fmt: skip
    assert status == 0
    shutil.rmtree(directory / "ckpt" / "3")  # as if killed before its third save
    return directory, json.loads((directory / "metrics.json").read_text())["losses"]


def _empty_directory(step):
    shutil.rmtree(step)
    step.mkdir()


def _truncated_data(step):
    for path in (step / "state" / "d").iterdir():
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {
    "empty step directory": (_empty_directory, "its directory is empty"),
    "metadata deleted": (lambda step: (step / "metadata" / "metadata").unlink(), "lacks metadata"),
    "metadata empty": (lambda step: (step / "metadata" / "metadata").write_text(""), "0 of its"),
    "data truncated": (_truncated_data, "(truncated)"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_latest_step_is_skipped_and_the_run_resumes_from_the_one_before(
    tmp_path, two_saves, damage, example
):
    """Resumed in this process, as the saves were: the skip is the checkpoint's warning,
    which a run in a terminal prints to stderr."""
    directory, losses = two_saves
    shutil.copytree(directory / "ckpt", tmp_path / "ckpt")
    harm, reason = DAMAGE[damage]
    harm(tmp_path / "ckpt" / "2")
    with pytest.warns(sf.CheckpointWarning, match="Skipped checkpoint step 2") as warned:
        resumed = example(*TINY, "--steps", "3", "--checkpoint-dir", str(tmp_path / "ckpt"),
                          "--resume")  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert any(reason in str(w.message) for w in warned), [str(w.message) for w in warned]
    assert "resumed from step 1" in resumed.stdout
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["start_step"] == 1
    np.testing.assert_allclose(metrics["losses"], losses[1:], rtol=1e-5)  # the same data next


def test_a_fresh_run_refuses_a_directory_with_another_runs_checkpoints(tmp_path, example):
    ckpt = str(tmp_path / "ckpt")
    first = example(*TINY, "--steps", "1", "--checkpoint-dir", ckpt, "--tensorboard")
    assert first.returncode == 0, first.stderr[-2000:]
    refused = example(*TINY, "--steps", "2", "--checkpoint-dir", ckpt)
    assert refused.returncode == 2
    assert "already holds checkpoints (steps [1]): pass --resume" in refused.stderr
    # a run killed after logging step 2 but before saving it: the resumed run logs each step once
    log = tmp_path / "metrics.jsonl"
    log.write_text(log.read_text() + json.dumps({"step": 2, "loss": 0.0, "seconds": 0.0}) + "\n")
    resumed = example(*TINY, "--steps", "3", "--checkpoint-dir", ckpt, "--resume",
                      "--tensorboard")  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    # TensorBoard's scalars: each step once (the resumed run starts its own file at step 2)
    losses = [(step, value) for tag, step, value in _tensorboard_scalars(tmp_path / "tensorboard")
              if tag == "loss"]  # fmt: skip
    assert [step for step, _ in losses] == [1, 2, 3]
    np.testing.assert_allclose([v for _, v in losses], [r["loss"] for r in records], rtol=1e-6)
    assert "compiling the train step ..." in resumed.stdout
    assert "saving (in the background) a checkpoint of step 3" in resumed.stdout
    assert "checkpoints written; the latest is step 3" in resumed.stdout and "eta" in resumed.stdout


def test_a_second_run_into_a_directory_in_use_is_refused(tmp_path):
    """Two runs started together into one checkpoint directory: the second stops, in one line."""
    ckpt = str(tmp_path / "ckpt")
    command = [sys.executable, str(ROOT / "examples" / "fsdp_training.py"), *TINY, "--steps",
               "6", "--save-every", "2", "--checkpoint-dir", ckpt, "--output-dir",
               str(tmp_path / "a")]  # fmt: skip
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in first.stdout:  # the first holds the directory once it compiles
            if "compiling the train step" in line:
                break
        first.send_signal(signal.SIGSTOP)  # paused, holding it, while the second starts
        second = _run(*TINY, "--steps", "6", "--checkpoint-dir", ckpt, "--output-dir",
                      str(tmp_path / "b"), tmp_path=tmp_path)  # fmt: skip
        first.send_signal(signal.SIGCONT)
        rest, errors = first.communicate(timeout=300)
    finally:
        first.kill()
    assert second.returncode == 2, second.stderr[-2000:]
    assert f"--checkpoint-dir: Checkpoint directory {ckpt} is in use by another writer (pid" in (
        second.stderr
    )
    assert first.returncode == 0, errors[-2000:]
    assert "checkpoints written; the latest is step 6" in rest
    assert sorted(int(p.name) for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit()) == [
        2,
        4,
        6,
    ]


def test_a_resume_on_fewer_data_devices_keeps_the_batch_and_the_losses(tmp_path, example):
    """Saved on 8 data devices, resumed on 4: accumulation doubles (announced), so each step
    sees the same rows, and the next 5 losses are the uninterrupted run's, dropout included
    (its masks are one device's on every layout and accumulation)."""
    size = [*TINY, "--batch-size", "16", "--dropout", "0.2"]
    full = example(*size, "--steps", "7", "--mesh", "data=8", "--output-dir",
                   str(tmp_path / "full"))  # fmt: skip
    assert full.returncode == 0, full.stderr[-2000:]
    ckpt = str(tmp_path / "ckpt")
    first = example(*size, "--steps", "2", "--mesh", "data=8", "--checkpoint-dir", ckpt,
                    "--output-dir", str(tmp_path / "a"))  # fmt: skip
    assert first.returncode == 0, first.stderr[-2000:]
    second = example(*size, "--steps", "7", "--mesh", "data=4,model=2", "--strategy",
                     "fsdp+tp", "--checkpoint-dir", ckpt, "--resume", "--output-dir",
                     str(tmp_path / "b"))  # fmt: skip
    assert second.returncode == 0, second.stderr[-2000:]
    assert ("resuming on 4 data devices: --microbatches 2 keeps the checkpoint's 2 rows per "
            "device per slice and its global batch of 16 rows") in second.stdout  # fmt: skip
    want = json.loads((tmp_path / "full" / "metrics.json").read_text())["losses"]
    resumed = json.loads((tmp_path / "b" / "metrics.json").read_text())
    assert resumed["microbatches"] == 2 and resumed["start_step"] == 2
    np.testing.assert_allclose(resumed["losses"], want[2:], rtol=1e-5)
    refused = example(*TINY, "--batch-size", "32", "--steps", "8", "--mesh", "data=8",
                      "--checkpoint-dir", ckpt, "--resume")  # fmt: skip
    assert refused.returncode == 2 and "pass --batch-size 16 to continue it" in refused.stderr


def test_runs_of_different_layouts_write_different_directories(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    import fsdp_training

    dirs = {
        fsdp_training.default_output_dir(fsdp_training.parse_args(args))
        for args in (["--strategy", "fsdp"], ["--strategy", "fsdp+tp"],
                     ["--strategy", "fsdp", "--mesh", "data=8"])
    }  # fmt: skip
    assert len(dirs) == 3 and pathlib.Path("runs/fsdp-data2-model4") in dirs


def test_every_flag_has_help_and_help_shows_the_defaults(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    import fsdp_training

    with pytest.raises(SystemExit):
        fsdp_training.parse_args(["--help"])
    text = capsys.readouterr().out
    flags = re.findall(r"^  (--[a-z-]+)", text, re.M)
    assert len(flags) >= 25, flags
    for block in re.split(r"\n(?=  --)", text.split("options:", 1)[1])[1:]:
        assert len(block.split()) > 2, f"{block.split()[0]} has no help text"
    flat = " ".join(text.split())  # help lines wrap at the terminal's width
    assert "(default: fsdp)" in flat and "(default: 150)" in flat


def test_the_readme_names_every_flag():
    text = (ROOT / "README.md").read_text()
    listed = set(re.findall(r"--[a-z-]+", text.split("Its flags:", 1)[1].split("## ", 1)[0]))
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "fsdp_training.py"), "--help"],
                         capture_output=True, text=True, timeout=120).stdout  # fmt: skip
    flags = set(re.findall(r"^  (--[a-z-]+)", out, re.M)) - {"--help"}
    assert flags and flags <= listed, sorted(flags - listed)


def test_the_default_report_of_the_example_decoder_fits_a_terminal(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    import gpt
    from flax import nnx

    import substrax_flax as sf
    from substrax.layout import Layout
    from substrax.mesh import DeviceMeshManager

    mesh = DeviceMeshManager.create_device_mesh({"data": 2, "model": 4})
    layout = Layout.named("fsdp+tp", mesh)
    report = sf.sharding_report(
        sf.plan_model(lambda: gpt.GPT(gpt.Config(), nnx.Rngs(0)), mesh, layout=layout)
    )
    text = str(report)
    assert max(map(len, text.splitlines())) <= 120
    full = report.table(full=True)
    assert max(map(len, full.splitlines())) > 120 and len(full.splitlines()) > len(
        text.splitlines()
    )
    # the four blocks share rows, and each reason is written once, as a numbered note
    assert re.search(r"^blocks/0-3/wq\s+4\s", text, re.M) and "blocks/1/" not in text
    notes = re.findall(r"^\d+\. (.*)$", text, re.M)
    assert notes and len(notes) == len(set(notes))
    assert "MultiDimensionalStrategy" not in text
    assert report.summary().startswith("fsdp 2 x tp 4, mesh {'data': 2, 'model': 4}, 35 variables")


def test_ctrl_c_stops_after_the_step_in_flight_and_says_how_to_resume(tmp_path, example):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    command = [sys.executable, str(ROOT / "examples" / "fsdp_training.py"), *TINY, "--steps",
               "400", "--save-every", "3", "--checkpoint-dir", ckpt,
               "--output-dir", out]  # fmt: skip
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in run.stdout:  # interrupted while a background save may be in flight
            if "a checkpoint of step 3" in line:
                break
        run.send_signal(signal.SIGINT)
        _, errors = run.communicate(timeout=300)
    finally:
        run.kill()
    assert run.returncode == 130, errors[-2000:]
    assert "Traceback" not in errors and "Exception" not in errors
    stopped = re.search(r"stopped at Ctrl-C after step (\d+): the newest checkpoint is step "
                        r"(\d+) in .*ckpt; run the same command with --resume", errors)  # fmt: skip
    assert stopped, errors[-2000:]
    step, saved = int(stopped.group(1)), int(stopped.group(2))
    assert 3 <= saved <= step < 400 and saved % 3 == 0
    logged = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert len(logged["losses"]) == step  # the steps it ran, written as at a normal end
    again = example(*TINY, "--steps", str(saved + 2), "--checkpoint-dir", ckpt, "--resume",
                    "--output-dir", out)  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads((tmp_path / "out" / "metrics.json").read_text())["start_step"] == saved
