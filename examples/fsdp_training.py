"""Train a GPT-style decoder with FSDP (or another layout) across devices: substrax's main job.

With no accelerator it simulates 8 CPU devices and trains on a 2 x 4 ``data`` x ``model`` mesh.
It trains on text: eight of Shakespeare's plays as bytes (``examples/data/shakespeare.txt``,
public domain), the last 5% held out; ``--data`` reads your own ``.txt``, ``.jsonl``, ``.bin``
or ``.npy`` file through :mod:`substrax.data` (Grain), each process reading only its rows.

    python examples/fsdp_training.py --mesh data=2,model=4 --strategy fsdp --steps 150

Writes ``metrics.json`` (losses, mesh, strategy, throughput without the compile, memory) and
``metrics.jsonl`` (a line per step; a resumed run continues it) and ``loss.svg`` into
``--output-dir``, and with ``--tensorboard`` the same scalars for TensorBoard.
With ``--checkpoint-dir`` it saves sharded checkpoints (model, optimizer, step, data position);
``--resume`` continues from the latest one, under any ``--mesh`` / ``--strategy``. It runs
unchanged on several processes: ``python -m substrax.launch --num-processes 2
--devices-per-process 4 examples/fsdp_training.py``.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp

import substrax.distributed

if __name__ == "__main__":
    # 8 simulated CPU devices, or what `python -m substrax.launch` asks for in each process.
    substrax.distributed.initialize(cpu_devices=8)

import argparse
import dataclasses
import json
import math
import pathlib
import signal
import threading
import time

import numpy as np
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import gpt
import llama

import substrax_flax as sf
from substrax import data as sdata
from substrax.hlo import peak_bytes
from substrax.layout import LAYOUTS, Layout
from substrax.mesh import DeviceMeshManager
from substrax.pipeline import SCHEDULES
from substrax.planner import HARDWARE, profile_of
from substrax.spmd import PRECISIONS, REMAT

#: The default training text: eight plays, public domain (examples/data/README.md).
SHIPPED_TEXT = pathlib.Path(__file__).resolve().parent / "data" / "shakespeare.txt"
#: The prompt the run's closing sample continues, and the sampling temperature (greedy
#: decoding of a briefly trained model repeats its most likely word).
PROMPT, TEMPERATURE = "KING.\n", 0.8


class UsageError(Exception):
    """A bad command line: reported in one line, exit status 2."""


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=2,model=4"`` -> ``{"data": 2, "model": 4}``."""
    shape = {}
    for part in text.split(","):
        name, sep, size = part.partition("=")
        if not sep or not name.strip() or not size.strip().lstrip("-").isdigit():
            raise UsageError(f"--mesh {text!r}: expected name=size pairs such as data=2,model=4")
        shape[name.strip()] = int(size)
    return shape


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,  # --help shows every default
    )
    parser.add_argument("--mesh", default="data=2,model=4", help="axis sizes, e.g. data=2,model=4")
    parser.add_argument("--strategy", default="fsdp", help=f"one of {', '.join(LAYOUTS)}")
    parser.add_argument("--steps", type=int, default=150, help="total training steps")
    parser.add_argument("--batch-size", type=int, default=16, help="global batch (rows)")
    parser.add_argument("--seed", type=int, default=0, help="initialisation and data seed")
    parser.add_argument(
        "--data", type=pathlib.Path, default=SHIPPED_TEXT,
        help=f"training data: {', '.join(sdata.FORMATS)} (default: the shipped Shakespeare)",
    )  # fmt: skip
    parser.add_argument("--data-dtype", default="uint16",
                        help="the token ids' type in a .bin file")  # fmt: skip
    parser.add_argument(
        "--tokenizer", type=pathlib.Path, default=None,
        help="a Hugging Face tokenizer.json for .txt/.jsonl data (default: UTF-8 bytes)",
    )  # fmt: skip
    parser.add_argument(
        "--eval-data", type=pathlib.Path, default=None,
        help="held-out data (default: the last --eval-fraction of --data, never trained on)",
    )  # fmt: skip
    parser.add_argument("--eval-fraction", type=float, default=0.05,
                        help="the share of --data held out without --eval-data")  # fmt: skip
    parser.add_argument("--learning-rate", type=float, default=3e-3, help="adamw's peak rate")
    defaults = gpt.Config()
    parser.add_argument("--vocab", type=int, default=defaults.vocab, help="vocabulary size")
    parser.add_argument("--d-model", type=int, default=defaults.d_model, help="model width")
    parser.add_argument("--heads", type=int, default=defaults.heads, help="attention heads")
    parser.add_argument("--mlp", type=int, default=defaults.mlp, help="MLP hidden width")
    parser.add_argument("--layers", type=int, default=defaults.layers, help="decoder blocks")
    parser.add_argument("--seq", type=int, default=defaults.seq, help="tokens per row")
    parser.add_argument(
        "--dropout", type=float, default=defaults.dropout,
        help="dropout rate after attention and MLP (the masks are one device's on every layout)",
    )  # fmt: skip
    parser.add_argument(
        "--moe-experts", type=int, default=0,
        help="experts per mixture-of-experts MLP, 2 per token (0: dense MLPs); shard them with "
        "--strategy fsdp+ep --mesh data=2,expert=4",
    )  # fmt: skip
    parser.add_argument(
        "--capacity-factor", type=float, default=0.0,
        help="one-hot dispatch with this many expert slots relative to an even load; 0 (the "
        "default): sorted dispatch, no capacity, no token dropped",
    )  # fmt: skip
    parser.add_argument("--output-dir", type=pathlib.Path, default=None,
                        help="where metrics.json and metrics.jsonl are written (default: "
                        "runs/<strategy>-<mesh>, one directory per layout)")  # fmt: skip
    parser.add_argument("--quiet", action="store_true", help="no sharding report")
    parser.add_argument(
        "--tensorboard", action="store_true",
        help="also write each step's loss, step time and tokens/s for TensorBoard into "
        "<output-dir>/tensorboard (needs tensorboardX: pip install tensorboardX)",
    )  # fmt: skip
    parser.add_argument(
        "--peak-tflops", type=float, default=None,
        help="the device's peak TFLOP/s, for MFU (default: known for H100, H200 and TPU v5p; "
        "none on CPU)",
    )  # fmt: skip
    parser.add_argument("--stacked", action="store_true", help="layers stacked with nnx.vmap")
    parser.add_argument(
        "--microbatches", type=int, default=None,
        help="pp: pipeline microbatches (default 4); otherwise gradient accumulation (default 1)",
    )  # fmt: skip
    parser.add_argument(
        "--precision", default="f32", choices=PRECISIONS,
        help="mixed: float32 master weights, bfloat16 gathers, compute and reductions; "
        "bf16: parameters in bfloat16 too",
    )  # fmt: skip
    parser.add_argument(
        "--remat", default="none", choices=REMAT, help="recompute blocks in the backward pass"
    )
    parser.add_argument(
        "--attention-block", type=int, default=0,
        help="attention in flash attention's blocks of this many tokens, keeping no score "
        "square (0: whole rows)",
    )  # fmt: skip
    parser.add_argument(
        "--gather", default="keep", choices=("keep", "regather"),
        help="regather: gather FSDP parameters again in the backward pass (and per microbatch) "
        "instead of keeping them",
    )  # fmt: skip
    parser.add_argument(
        "--schedule", default="zb-h1", choices=SCHEDULES,
        help="pipeline schedule (the step plan shows its idle share and what it holds)",
    )  # fmt: skip
    parser.add_argument(
        "--repeats", type=int, default=1,
        help="chunks of layers per stage for the interleaved and circular schedules",
    )  # fmt: skip
    parser.add_argument(
        "--init-from", type=pathlib.Path, default=None,
        help="a Hugging Face Llama checkpoint directory (config.json + safetensors) to "
        "fine-tune instead of training the GPT decoder from scratch; python "
        "examples/llama.py DIR writes a small random one",
    )  # fmt: skip
    parser.add_argument(
        "--lora-rank", type=int, default=0,
        help="with --init-from: train rank-R LoRA adapters on the q and v projections only "
        "(0: train every parameter)",
    )  # fmt: skip
    parser.add_argument(
        "--export", type=pathlib.Path, default=None,
        help="with --init-from: write the trained model (adapters merged) here as a Hugging "
        "Face checkpoint",
    )  # fmt: skip
    parser.add_argument(
        "--eval-every", type=int, default=None,
        help="evaluate the held-out batches every N steps and at the last (0: never; "
        "default 50)",
    )  # fmt: skip
    parser.add_argument("--eval-batches", type=int, default=2,
                        help="held-out batches per evaluation")  # fmt: skip
    parser.add_argument(
        "--sample", type=int, default=48,
        help=f"at the end, continue the prompt {PROMPT!r} by this many tokens sampled at "
        f"temperature {TEMPERATURE} and print them (0: no sample)",
    )  # fmt: skip
    parser.add_argument("--checkpoint-dir", type=_directory_or_url, default=None,
                        help="save sharded checkpoints here, a path or a gs:// URL (none: no "
                        "checkpoints)")  # fmt: skip
    parser.add_argument("--save-every", type=int, default=50, help="steps between checkpoints")
    parser.add_argument("--keep", type=int, default=3, help="checkpoints to keep")
    parser.add_argument(
        "--synchronous-saves", action="store_true",
        help="wait for each checkpoint to be written (default: written in the background "
        "while training goes on)",
    )  # fmt: skip
    resume = parser.add_mutually_exclusive_group()
    resume.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    resume.add_argument(
        "--resume-if-present", action="store_true", help="--resume, or a fresh start if none"
    )
    return parser.parse_args(argv)


def default_output_dir(args) -> pathlib.Path:
    """``runs/<strategy>-<mesh>``: each layout's run in its own directory."""
    mesh = args.mesh.replace(",", "-").replace("=", "")
    return pathlib.Path("runs") / f"{args.strategy}-{mesh}"


def build(args):
    """Mesh, layout and config from the arguments, with one-line errors."""
    if args.d_model % args.heads:
        raise UsageError(f"--d-model {args.d_model} is not divisible by --heads {args.heads}")
    if args.microbatches is None:
        args.microbatches = 4 if args.strategy == "pp" else 1
    check_numbers(args)
    if (args.resume or args.resume_if_present) and args.checkpoint_dir is None:
        raise UsageError("--resume needs --checkpoint-dir")
    if args.output_dir is None:
        args.output_dir = default_output_dir(args)
    check_writable(args.output_dir, "--output-dir")
    if isinstance(args.checkpoint_dir, pathlib.Path):  # a URL is checked by the Checkpointer
        check_writable(args.checkpoint_dir, "--checkpoint-dir")
    if args.export is not None:
        check_writable(args.export, "--export")
    shape = parse_mesh(args.mesh)
    if args.moe_experts < 0 or args.capacity_factor < 0:
        raise UsageError("--moe-experts and --capacity-factor must not be negative")
    if args.attention_block < 0 or (args.attention_block and args.seq % args.attention_block):
        raise UsageError(
            f"--attention-block {args.attention_block} does not divide --seq {args.seq}; use a "
            "divisor of it, or 0 for whole rows"
        )
    if args.strategy == "pp" and "pipe" not in shape:
        raise UsageError(
            f"--strategy pp needs a pipe= axis in --mesh (got {args.mesh!r}), e.g. "
            "--mesh pipe=4,data=2"
        )
    try:
        mesh = DeviceMeshManager.create_device_mesh(shape)
        layout = Layout.named(args.strategy, mesh)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if not layout.batch_axes:
        raise UsageError(
            f"--strategy {args.strategy} on --mesh {args.mesh} uses every axis for its own role "
            "and leaves none to split the batch; add a data axis, e.g. --mesh data=2,model=4"
        )
    data_devices = math.prod(dict(mesh.shape)[a] for a in layout.batch_axes)
    if args.batch_size % data_devices:
        raise UsageError(
            f"--batch-size {args.batch_size} does not divide the {data_devices} devices of the "
            f"data axes {layout.batch_axes}; use a multiple of {data_devices}"
        )
    if args.eval_every is None:
        args.eval_every = 50
    if args.eval_every < 0 or args.eval_batches < 1:
        raise UsageError("--eval-every must not be negative and --eval-batches must be positive")
    if args.strategy == "pp":
        check_pipeline(args, layout.pp, data_devices)
    elif args.batch_size % (args.microbatches * data_devices):
        raise UsageError(
            f"--batch-size {args.batch_size} does not split into --microbatches "
            f"{args.microbatches} x {data_devices} data devices"
        )
    if layout.ep > 1 and args.moe_experts % layout.ep:
        raise UsageError(
            f"--moe-experts {args.moe_experts} does not divide over the {layout.ep} devices of "
            f"the expert axes {layout.expert_axes}"
        )
    if layout.cp > 1 and args.seq % (2 * layout.cp):
        raise UsageError(
            f"--seq {args.seq} does not split into 2 x {layout.cp} chunks over the context axes "
            f"{layout.context_axes} (zigzag order); use a multiple of {2 * layout.cp}"
        )
    if args.init_from is not None:
        return mesh, layout, pretrained_config(args)
    if args.lora_rank or args.export is not None:
        raise UsageError("--lora-rank and --export fine-tune a checkpoint: pass --init-from DIR")
    config = gpt.Config(
        vocab=args.vocab, d_model=args.d_model, heads=args.heads, mlp=args.mlp,
        layers=args.layers, seq=args.seq, moe_experts=args.moe_experts,
        capacity_factor=args.capacity_factor or None, dropout=args.dropout,
        attention_block=args.attention_block or None,
    )  # fmt: skip
    return mesh, layout, config


SIZES = ("vocab", "d_model", "heads", "mlp", "layers", "moe_experts")


def pretrained_config(args) -> llama.LlamaConfig:
    """The checkpoint's config, after checking that the other flags agree with it."""
    defaults = parse_args([])
    changed = [f"--{name.replace('_', '-')}" for name in SIZES
               if getattr(args, name) != getattr(defaults, name)]  # fmt: skip
    if changed:
        raise UsageError(
            f"{', '.join(changed)}: the checkpoint's config.json sets the model's sizes with "
            "--init-from; drop them"
        )
    if args.strategy == "pp" or args.stacked:
        raise UsageError("--init-from loads the Llama decoder, whose blocks run in a loop: "
                         "drop --stacked and pp")  # fmt: skip
    if args.lora_rank < 0:
        raise UsageError(f"--lora-rank must not be negative, got {args.lora_rank}")
    try:
        config = llama.LlamaConfig.from_json(args.init_from)
    except (OSError, ValueError) as error:
        raise UsageError(f"--init-from {args.init_from}: {error}") from None
    return config


POSITIVE = ("steps", "batch_size", "save_every", "keep", "microbatches", "repeats", "vocab",
            "d_model", "heads", "mlp", "layers", "seq")  # fmt: skip


def check_numbers(args) -> None:
    """One-line errors for numeric flags out of range, before anything is built."""
    for name in POSITIVE:
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag} must be a positive integer, got {getattr(args, name)}")
    if not args.learning_rate > 0:
        raise UsageError(f"--learning-rate must be positive, got {args.learning_rate}")


def _directory_or_url(text: str) -> pathlib.Path | str:
    """A local path as a Path; a URL (``gs://...``) as given, since a Path folds its ``//``."""
    return text if "://" in text else pathlib.Path(text)


def check_writable(directory: pathlib.Path, flag: str) -> None:
    """Creates ``directory`` and writes a probe file there, so a bad path fails before training."""
    files = (p for p in (directory, *directory.parents) if p.exists() and not p.is_dir())
    taken = next(files, None)
    if taken is not None:
        raise UsageError(
            f"{flag} {directory}: {taken} is a file, not a directory; pass a directory path "
            "(it is created if missing)"
        )
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise UsageError(f"{flag} {directory} is not writable: {error.strerror or error}") from None


def check_pipeline(args, stages: int, data_devices: int) -> None:
    """One-line errors for a pipeline that cannot run."""
    chunks = stages * (args.repeats if args.schedule in ("circular", "interleaved") else 1)
    if args.layers < chunks:
        raise UsageError(f"--layers {args.layers} is fewer than the {chunks} pipeline chunks")
    if args.batch_size % (args.microbatches * data_devices):
        raise UsageError(
            f"--batch-size {args.batch_size} does not split into --microbatches "
            f"{args.microbatches} x {data_devices} data devices"
        )


class StepLog:
    """Each step's metrics as one JSON line; a resumed run continues the file.

    Lines of steps after the resumed checkpoint (a run killed between two saves) are dropped
    first, so the file holds every step of the run once.
    """

    def __init__(self, path: pathlib.Path, start_step: int):
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if start_step and path.exists():
            kept = [line for line in path.read_text().splitlines()
                    if line and json.loads(line)["step"] <= start_step]  # fmt: skip
        path.write_text("".join(f"{line}\n" for line in kept))
        self.path = path

    def write(self, record: dict) -> None:
        with self.path.open("a") as file:
            file.write(json.dumps(record) + "\n")


class Scalars:
    """Each step's loss, seconds and tokens/s as TensorBoard scalars (``--tensorboard``).

    A resumed run purges the steps after its checkpoint, as :class:`StepLog` drops them.
    """

    def __init__(self, directory: pathlib.Path, start_step: int):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise UsageError(
                "--tensorboard needs tensorboardX: pip install tensorboardX (make installs it)"
            ) from None
        self.writer = SummaryWriter(str(directory), purge_step=start_step + 1)

    def write(self, record: dict, tokens: int) -> None:
        step = record["step"]
        self.writer.add_scalar("loss", record["loss"], step)
        self.writer.add_scalar("step_seconds", record["seconds"], step)
        self.writer.add_scalar("tokens_per_second", tokens / record["seconds"], step)
        if "eval_loss" in record:
            self.writer.add_scalar("eval_loss", record["eval_loss"], step)

    def close(self) -> None:
        self.writer.close()


@dataclasses.dataclass
class RunData:
    """The run's training batches, its held-out batches and their tokenizer."""

    train: sdata.Batches
    held: sdata.Batches
    tokenizer: str | None


def open_data(args, vocab: int) -> RunData:
    """``--data`` (and ``--eval-data``) as batches of ``--seq + 1`` tokens, checked up front.

    Without ``--eval-data`` the last ``--eval-fraction`` of ``--data`` is held out, whether or
    not the run evaluates, so that turning evaluation on never changes what it trains on.
    """
    try:
        tokens = sdata.load_tokens(args.data, dtype=args.data_dtype, tokenizer=args.tokenizer)
        windows = sdata.TokenWindows(tokens, args.seq)
        if args.eval_data is None:
            train, held = windows.split(args.eval_fraction)
        else:
            held_tokens = sdata.load_tokens(
                args.eval_data, dtype=args.data_dtype, tokenizer=args.tokenizer
            )
            train, held = windows, sdata.TokenWindows(held_tokens, args.seq)
    except (OSError, ValueError, ImportError) as error:
        raise UsageError(f"--data: {error}") from None
    if tokens.vocab_size is not None and tokens.vocab_size > vocab:
        raise UsageError(
            f"--data {args.data} needs a vocabulary of {tokens.vocab_size} tokens (tokenizer: "
            f"{tokens.tokenizer}), more than the model's {vocab}: use --vocab {tokens.vocab_size}"
        )
    return RunData(
        sdata.Batches(train, args.batch_size, seed=args.seed, vocab_size=vocab),
        sdata.Batches(held, args.batch_size, shuffle=False, vocab_size=vocab),
        tokens.tokenizer,
    )


class StopAsked:
    """The first Ctrl-C asks the run to stop after the step in flight; a second stops it now.

    Single-process runs only: in a multi-process run every process must stop at the same
    step, and ``python -m substrax.launch`` stops them all.
    """

    def __init__(self):
        self.asked, self.previous = False, None

    def __enter__(self) -> StopAsked:
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self._ask)
        return self

    def _ask(self, signum, frame) -> None:
        self.asked = True
        signal.signal(signal.SIGINT, self.previous)  # a second Ctrl-C interrupts at once
        print("\nstopping after this step (Ctrl-C again to stop now) ...", file=sys.stderr,
              flush=True)  # fmt: skip

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


class Stopped(Exception):
    """The run stopped at Ctrl-C, its logs written and its saves finished; says how to resume."""

    def __init__(self, step: int, checkpointer, args):
        latest = checkpointer.latest_step() if checkpointer else None
        if latest is None:
            how = "no checkpoint to resume from (--checkpoint-dir DIR saves them)"
        else:
            how = (f"the newest checkpoint is step {latest} in {args.checkpoint_dir}; run the "
                   "same command with --resume to continue from it")  # fmt: skip
        super().__init__(f"stopped at Ctrl-C after step {step}: {how}")


class HeldOut:
    """The held-out loss: ``--eval-batches`` batches no step trains on, through the eval step.

    The model is evaluated in evaluation mode (``model.eval()``: no dropout), then given its
    modes back exactly (not ``model.train()``, which would change its graph and compile the
    train step again).
    """

    MODES = ("deterministic", "use_running_average")

    def __init__(self, args, batches: sdata.Batches, step_fn, mesh):
        self.args, self.batches = args, batches
        if args.strategy == "pp":  # the stack forward through the pipeline, rows as they are
            self.step = sf.make_eval_step(step_fn.stages, mesh, layout=Layout.named("pp", mesh),
                                          microbatches=args.microbatches)  # fmt: skip
            self.rows = lambda rows: rows
        else:
            self.step = sf.make_eval_step(lambda model, batch: {"loss": gpt.loss_fn(model, batch)})
            self.rows = gpt.next_tokens

    def __call__(self, model) -> float:
        args = self.args
        modes = self.modes_of(model)
        model.eval()
        try:
            losses = [
                float(self.step(model, self.rows(self.batches(i)))["loss"])
                for i in range(args.eval_batches)
            ]  # fmt: skip
        finally:
            self.restore(modes)
        return sum(losses) / len(losses)

    @classmethod
    def modes_of(cls, model) -> list:
        """Each module's mode attributes, to give back after ``model.eval()``."""
        return [(module, name, getattr(module, name)) for _, module in nnx.iter_modules(model)
                for name in cls.MODES if hasattr(module, name)]  # fmt: skip

    @staticmethod
    def restore(modes) -> None:
        for module, name, value in modes:
            setattr(module, name, value)


class Progress:
    """A one-line progress bar on a terminal; a line every tenth of the run elsewhere."""

    def __init__(self, total: int, start: int):
        self.total, self.start = total, start
        self.tty = sys.stdout.isatty()
        self.began = time.perf_counter()
        self.flops = None  # (the step's FLOPs per device, the device's peak FLOP/s)

    def update(self, step: int, loss: float, seconds: float, tokens: int) -> None:
        """Shows the step's loss, time, tokens/s and MFU, the elapsed time and the ETA."""
        done = step - self.start
        width = 30
        filled = int(width * done / max(self.total - self.start, 1))
        elapsed = time.perf_counter() - self.began
        eta = seconds * (self.total - step)
        line = (
            f"[{'#' * filled}{'.' * (width - filled)}] step {step}/{self.total} "
            f"loss {loss:.3f} {seconds * 1000:.0f} ms {tokens / seconds:,.0f} tok/s "
            f"elapsed {elapsed:.0f} s eta {eta:.0f} s"
        )
        if self.flops is not None:
            line += f" mfu {mfu(*self.flops, seconds):.1%}"
        if self.tty:
            print("\r" + line, end="\n" if step == self.total else "", flush=True)
        elif done % max((self.total - self.start) // 10, 1) == 0 or step == self.total:
            print(line, flush=True)


def mfu(flops: float, peak: float, seconds: float) -> float:
    """Model FLOPs utilisation: the step's FLOPs per device over what the device could do."""
    return flops / seconds / peak


def peak_flops(args) -> tuple[float | None, str]:
    """The device's peak FLOP/s and where the figure comes from (None: unknown)."""
    if args.peak_tflops:
        return args.peak_tflops * 1e12, "--peak-tflops"
    kind = jax.devices()[0].device_kind
    profile = profile_of(kind)
    if profile is None:
        return None, f"no peak FLOP/s known for {kind!r}; pass --peak-tflops for MFU"
    return HARDWARE[profile].flops, f"the {profile} profile of substrax.planner"


def compiled_figures(step_fn, model, optimizer, batch) -> tuple[float, float, str]:
    """The step's peak bytes and FLOPs per device, and where the peak comes from.

    After the first call the step's program is cached, so lowering it again compiles
    nothing. On CPU the peak is XLA's compiled estimate (arguments + outputs - donated +
    temporaries); an accelerator reports its own peak.
    """
    compiled = step_fn.lower(model, optimizer, batch).compile()
    memory, cost = compiled.memory_analysis(), compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    flops = float((cost or {}).get("flops", 0.0))
    device = jax.local_devices()[0]
    stats = device.memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return float(stats["peak_bytes_in_use"]), flops, "the device's own peak"
    return float(peak_bytes(memory, device.platform)), flops, "XLA's compiled estimate"


def write_loss_plot(path: pathlib.Path, steps: list[int], losses: list[float]) -> None:
    """The loss against the step as an SVG line (no plotting library needed)."""
    width, height, pad = 640, 360, 48
    low, high = min(losses), max(losses)
    span, first, last = (high - low) or 1.0, steps[0], steps[-1]

    def xy(step, loss):
        x = pad + (width - 2 * pad) * (step - first) / max(last - first, 1)
        return x, height - pad - (height - 2 * pad) * (loss - low) / span

    points = " ".join(f"{x:.1f},{y:.1f}" for x, y in map(xy, steps, losses))
    path.write_text(
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">'
        f'<rect width="100%" height="100%" fill="white"/>'
        f'<polyline points="{points}" fill="none" stroke="#1f77b4" stroke-width="2"/>'
        f'<text x="{pad}" y="{pad - 16}" font-family="sans-serif" font-size="14">loss: '
        f"{losses[0]:.3f} at step {first} to {losses[-1]:.3f} at step {last}</text>"
        f'<text x="{pad}" y="{height - 16}" font-family="sans-serif" font-size="12">step</text>'
        "</svg>\n"
    )


def train(args) -> dict:
    accumulation_given = args.microbatches is not None
    mesh, layout, config = build(args)
    data = open_data(args, getattr(config, "vocab_size", getattr(config, "vocab", 0)))
    primary = jax.process_index() == 0
    checkpointer = open_checkpoints(args)
    if checkpointer is not None and not accumulation_given and args.strategy != "pp":
        keep_slices(args, checkpointer, layout.batch_degree, primary)
    step_fn = make_step(args, mesh)
    model_class = gpt.StackedGPT if args.stacked or args.strategy == "pp" else gpt.GPT
    stored = config  # a pipeline stores an uneven stack padded to its slots (masked)
    if args.strategy == "pp":
        stored = dataclasses.replace(config, layers=step_fn.num_slots(config.layers))

    def factory():
        model = model_class(stored, nnx.Rngs(args.seed))
        if args.precision == "bf16":  # parameters stored in bfloat16 (and adam's moments)
            params = nnx.state(model, nnx.Param)
            nnx.update(model, jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))
        return model

    if args.init_from is not None:
        model = load_pretrained(args, mesh, layout, config, primary)
    else:
        plan = sf.plan_model(factory, mesh, layout=layout)
        if primary and not args.quiet:
            print(f"mesh {dict(mesh.shape)}, strategy {args.strategy}")
            print(sf.sharding_report(plan))
        model = plan.create()
    optimizer = sf.create_sharded_optimizer(
        model, gpt.optimizer(args.learning_rate), wrt=trained(args)
    )
    saved = resume(args, checkpointer, model, optimizer, primary)
    start_step = int(optimizer.step[...])
    if saved.get("data") is not None:  # the same windows next, on any number of processes
        try:
            data.train = data.train.resumed(saved["data"], start_step)
        except ValueError as error:
            raise UsageError(f"--resume: {error}") from None
    losses, skipped, progress = [], [], Progress(args.steps, start_step)
    tokens = args.batch_size * args.seq
    log = StepLog(args.output_dir / "metrics.jsonl", start_step) if primary else None
    board = None
    if primary and args.tensorboard:
        board = Scalars(args.output_dir / "tensorboard", start_step)
    evaluations = []
    evaluate = HeldOut(args, data.held, step_fn, mesh) if args.eval_every else None
    started, compile_seconds = time.perf_counter(), 0.0
    with StopAsked() as stop:
        for step in range(start_step, args.steps):
            rows = data.train(step)  # this process's rows of the global batch
            if primary and step == start_step:
                print("compiling the train step ...", flush=True)
            tick = time.perf_counter()
            # next-token targets are shifted before the sequence is split
            metrics = step_fn(
                model, optimizer, rows if args.strategy == "pp" else gpt.next_tokens(rows)
            )
            loss = float(metrics["loss"])
            seconds = time.perf_counter() - tick
            losses.append(loss)
            if step == start_step:  # the first call compiles: kept out of the throughput
                compile_seconds = seconds
                used = rows if args.strategy == "pp" else gpt.next_tokens(rows)
                peak_bytes, flops, source = compiled_figures(step_fn, model, optimizer, used)
                peak, said = peak_flops(args)
                progress.flops = (flops, peak) if peak and flops else None
                if primary:
                    mib = peak_bytes / 2**20
                    print(f"compiled and ran the first step in {seconds:.1f} s ({metrics['path']} "
                          f"step); peak memory per device {mib:.1f} MiB ({source}); "
                          f"{flops / 1e9:.2f} GFLOP per device per step"
                          + (f"; MFU against {said}" if peak else f"; {said}"),
                          flush=True)  # fmt: skip
            if not bool(metrics["finite"]):  # the step skipped its update (and warned)
                skipped.append(step + 1)
            record = {"step": step + 1, "loss": loss, "seconds": seconds}
            if evaluate is not None and (
                (step + 1) % args.eval_every == 0 or step + 1 == args.steps
            ):
                record["eval_loss"] = evaluate(model)
                evaluations.append([step + 1, record["eval_loss"]])
            if primary:
                progress.update(step + 1, loss, seconds, tokens)
                if "eval_loss" in record:
                    held = record["eval_loss"]
                    print(f"step {step + 1}: held-out loss {held:.4f} "
                          f"({held / math.log(2):.3f} bits per byte)", flush=True)  # fmt: skip
                log.write(record)
                if board is not None:
                    board.write(record, tokens)
            if checkpointer and ((step + 1) % args.save_every == 0 or step + 1 == args.steps):
                save(checkpointer, model, optimizer, step + 1, args, layout.batch_degree,
                     data.train.state(step + 1))  # fmt: skip
                if primary:
                    how = "saved" if args.synchronous_saves else "saving (in the background)"
                    print(f"{how} a checkpoint of step {step + 1} in {args.checkpoint_dir}")
            if stop.asked:  # Ctrl-C: after the step in flight, its logs and its save
                break
    if checkpointer:
        wait_for(checkpointer)  # a save in flight is finished, not abandoned
        if primary and not args.synchronous_saves:
            print(f"checkpoints written; the latest is step {checkpointer.latest_step()}")
    elapsed = time.perf_counter() - started
    if board is not None:
        board.close()
    if args.export is not None:
        export(args, model, primary)
    if not losses:
        raise UsageError(f"nothing to do: the checkpoint is at step {start_step} >= --steps")
    state = sf.sharding_report(model).bytes_per_device
    state += sf.sharding_report(optimizer).bytes_per_device
    # a split sequence's model has no whole-sequence forward; generate runs in one process
    # (with the decoder's KV cache; a pipeline's stacked cache lies over the stages as its layers)
    sample = None
    whole = layout.cp == 1
    if args.sample and whole and jax.process_count() == 1:
        sample = sample_text(model, args.sample, layout.batch_degree, data.tokenizer, args.seed)
    metrics = {
        "start_step": start_step,
        "losses": losses,
        "mesh": dict(mesh.shape),
        "strategy": args.strategy,
        "config": dataclasses.asdict(config),
        "batch_size": args.batch_size,
        "seed": args.seed,
        "tokens_per_second": tokens
        * max(len(losses) - 1, 1)
        / max(elapsed - compile_seconds if len(losses) > 1 else elapsed, 1e-9),
        "compile_seconds": compile_seconds,
        "state_bytes_per_device": state,
        "peak_bytes_per_device": peak_bytes,
        "flops_per_device_per_step": flops,
        "skipped_steps": skipped,
        "eval_losses": evaluations,
        "sample": sample,
        "remat": args.remat,
        "gather": args.gather,
        "attention_block": args.attention_block,
        "precision": args.precision,
        "microbatches": args.microbatches,
        "moe_experts": args.moe_experts,
        "capacity_factor": args.capacity_factor,
    }
    if primary:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        (args.output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
        logged = [json.loads(line) for line in log.path.read_text().splitlines() if line]
        write_loss_plot(args.output_dir / "loss.svg", [r["step"] for r in logged],
                        [r["loss"] for r in logged])  # fmt: skip
        print(
            f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps; params + "
            f"optimizer state {state / 2**20:.2f} MiB per device; "
            f"{metrics['tokens_per_second']:,.0f} tok/s; wrote metrics.json, metrics.jsonl and "
            f"loss.svg in {args.output_dir}"
        )
    if sample is not None and primary:
        print(f"sample ({args.sample} tokens after {PROMPT!r} at temperature {TEMPERATURE}):\n"
              f"{sample}")  # fmt: skip
    if stop.asked:
        raise Stopped(start_step + len(losses), checkpointer, args)
    return metrics


def sample_text(model, new_tokens: int, rows: int, tokenizer, seed: int) -> str:
    """The model's continuation of :data:`PROMPT` (one row per batch device), as text.

    Sampled at :data:`TEMPERATURE` from ``seed``: the same text on every layout.
    """
    prompt = np.tile(sdata.encode(PROMPT, tokenizer), (rows, 1))
    modes = HeldOut.modes_of(model)
    model.eval()
    try:
        tokens = sf.generate(model, prompt, new_tokens, temperature=TEMPERATURE, seed=seed)[0]
    finally:
        HeldOut.restore(modes)
    return sdata.decode(tokens, tokenizer)


def trained(args):
    """The variables the optimizer and the step train: the adapters alone under LoRA."""
    return nnx.LoRAParam if args.lora_rank else nnx.Param


def load_pretrained(args, mesh, layout, config, primary):
    """The Llama decoder with the checkpoint's weights (float32, or bfloat16 with bf16)."""
    dtype = jnp.bfloat16 if args.precision == "bf16" else jnp.float32  # converted, and said

    def factory():
        return llama.Llama(config, nnx.Rngs(args.seed), args.lora_rank)

    try:
        plan = sf.plan_weights(factory, mesh, args.init_from, layout=layout,
                               key_map=llama.key_map(config), dtype=dtype)  # fmt: skip
    except (OSError, ValueError) as error:
        raise UsageError(f"--init-from {args.init_from}: {error}") from None
    if primary and not args.quiet:
        print(f"mesh {dict(mesh.shape)}, strategy {args.strategy}")
        print(sf.sharding_report(plan.model))
    if primary:
        print(plan)
    try:
        return plan.load()
    except sf.WeightsMismatch as error:
        raise UsageError(f"--init-from {args.init_from}: {error}") from None


def export(args, model, primary) -> None:
    """Writes the trained model to ``--export`` in Hugging Face's format, adapters merged."""
    if args.lora_rank:
        model.merge_lora()
    llama.save_pretrained(model, args.export, leave_out=[".*_lora_.*"])
    if primary:
        print(f"exported the model (LoRA adapters merged) to {args.export}")


def make_step(args, mesh):
    """The train step: pipelined for ``--strategy pp``, the plain one otherwise.

    Both take the layout from the model's plan (each parameter gathered where used).
    """
    if args.strategy != "pp":
        return sf.make_train_step(
            gpt.loss_fn, remat=args.remat, microbatches=args.microbatches,
            precision=args.precision, wrt=trained(args), gather=args.gather,
        )  # fmt: skip
    try:
        stages = sf.Stages(gpt.pipeline_embed, gpt.pipeline_block, gpt.pipeline_head,
                           stack="blocks", schedule=args.schedule, repeats=args.repeats,
                           num_layers=args.layers)  # fmt: skip
        return sf.make_train_step(
            stages, mesh, layout=Layout.named("pp", mesh), microbatches=args.microbatches,
            remat=args.remat, precision=args.precision,
        )  # fmt: skip
    except ValueError as error:
        raise UsageError(str(error)) from None


class SaveFailed(Exception):
    """A checkpoint could not be written (disk full, permissions): the run stops, saying so."""


def save(checkpointer, model, optimizer, step, args, data_devices, position) -> None:
    """Saves checkpoint ``step`` with the data position and the batch's slicing.

    ``position`` is the training batches' :meth:`~substrax.data.Batches.state`: the data, its
    order's seed and the windows consumed, so a resume reads the next window; the rows per
    device per accumulation slice let a resume on another number of data devices keep them
    (:func:`keep_slices`). A disk that refuses the save stops the run with its message.
    """
    rows = args.batch_size // (data_devices * args.microbatches)
    metadata = {"step": step, "seed": args.seed, "batch_size": args.batch_size,
                "rows_per_slice": rows, "data": position}  # fmt: skip
    try:
        checkpointer.save(model, optimizer, step, metadata)
    except OSError as error:
        raise SaveFailed(str(error)) from None


def keep_slices(args, checkpointer, data_devices, primary) -> None:
    """On resume, sets --microbatches so each device's slices keep the checkpoint's rows.

    A run resumed on fewer (more) data devices than it saved on raises (lowers) gradient
    accumulation, so the global batch and the rows a device computes at once stay as they
    were, and the examples of each step are the same; it says so.
    """
    if not (args.resume or args.resume_if_present) or checkpointer.latest_step() is None:
        return
    saved = checkpointer.metadata()
    if "batch_size" in saved and saved["batch_size"] != args.batch_size:
        raise UsageError(
            f"--batch-size {args.batch_size} differs from the checkpoint's run "
            f"({saved['batch_size']}): pass --batch-size {saved['batch_size']} to continue it"
        )
    rows = saved.get("rows_per_slice")
    if not rows or args.batch_size % (data_devices * rows):
        return
    slices = args.batch_size // (data_devices * rows)
    if slices != args.microbatches:
        args.microbatches = slices
        if primary:
            print(f"resuming on {data_devices} data devices: --microbatches {slices} keeps the "
                  f"checkpoint's {rows} rows per device per slice and its global batch of "
                  f"{args.batch_size} rows")  # fmt: skip


def wait_for(checkpointer) -> None:
    """Waits for the save in flight (asynchronous saves), with the same message on failure."""
    try:
        checkpointer.wait()
    except OSError as error:
        raise SaveFailed(str(error)) from None


def open_checkpoints(args):
    """The run's Checkpointer (None without --checkpoint-dir); it holds the directory."""
    if args.checkpoint_dir is None:
        return None
    try:
        return sf.Checkpointer(
            args.checkpoint_dir, keep=args.keep, asynchronous=not args.synchronous_saves
        )
    except sf.DirectoryLocked as error:
        raise UsageError(f"--checkpoint-dir: {error}") from None


def resume(args, checkpointer, model, optimizer, primary) -> dict:
    """Restores the latest checkpoint into the model and optimizer if asked (and checks).

    Returns:
        The checkpoint's metadata (its data position under ``"data"``), or ``{}`` when the run
        starts fresh.
    """
    if checkpointer is None:
        return {}
    if not (args.resume or args.resume_if_present):
        if checkpointer.latest_step() is not None:
            raise UsageError(
                f"--checkpoint-dir {args.checkpoint_dir} already holds checkpoints (steps "
                f"{checkpointer.all_steps()}): pass --resume to continue that run, or use another "
                "directory"
            )
        return {}
    if checkpointer.latest_step() is None:
        if args.resume:
            raise UsageError(
                f"--resume: no checkpoint in {args.checkpoint_dir} (use --resume-if-present to "
                "start fresh)"
            )
        return {}
    metadata = checkpointer.restore(model, optimizer)
    if metadata.get("seed", args.seed) != args.seed:
        raise UsageError(f"--seed {args.seed} differs from the checkpoint's {metadata['seed']}")
    if primary:
        print(f"resumed from step {metadata['step']} in {args.checkpoint_dir}")
    return metadata


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        train(args)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except SaveFailed as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except Stopped as stopped:
        print(stopped, file=sys.stderr)
        return 130  # as a shell reports a run stopped by SIGINT
    return 0


if __name__ == "__main__":
    sys.exit(main())
