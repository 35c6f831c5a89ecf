"""One GPU, one run: substrax's step beside plain Flax's at about 0.7B parameters, and the experts.

For a machine with one GPU (an H200 where one is lent; see ``docs/benchmarks.md``), run with
that machine's own jax and the repository on the path:

    PYTHONPATH=src:integrations/flax/src:examples python3 benchmarks/gpu_check.py \
        --output-dir "$OUT"

It measures, in bfloat16 (parameters, compute and adamw's update):

* the example decoder (stacked blocks, SwiGLU, grouped-query attention) at about 0.7B
  parameters: the median step time of ``substrax_flax.make_train_step`` and of a plain
  ``nnx.jit`` step on the same model and batch, their ratio, and each one's MFU (the compiled
  program's FLOPs over the time and the device's peak);
* a dropless mixture of experts (64 experts, top 8, 4096 tokens), forward and backward,
  whose grouped products run on ``jax.lax.ragged_dot`` there (the GPU's grouped kernel): its
  time and the compiled program's FLOPs against the active dense compute;
* the kernels the planner's efficiency model needs: a bf16 matrix product and causal
  attention (``jax.nn.dot_product_attention``, each implementation the device offers), forward
  and backward, as TFLOP/s and as a fraction of the device's peak. Causal attention is counted
  as half the score square, as flash kernels execute it.

Each phase runs on its own: one that fails records its error in the report (``error``) and
the others still run, so one call on a lent machine says everything it can.

It writes ``gpu.json`` and ``gpu.md`` into ``--output-dir`` and stays under 8 minutes (the
budget of a lent machine's run): each phase stops timing after ``--steps`` steps.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
import traceback
from unittest import mock

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))

import gpt

import substrax_flax as sf
from substrax.hlo import compiled_flops
from substrax.mesh import DeviceMeshManager
from substrax.planner import HARDWARE, profile_of
from substrax.spmd import _grouped, experts, native_grouped_matmul

CONFIG = gpt.Config(vocab=32000, d_model=1536, heads=12, kv_heads=4, mlp=6144, layers=16,
                    seq=2048, gated=True)  # fmt: skip
TINY = gpt.Config(vocab=256, d_model=64, heads=4, kv_heads=2, mlp=128, layers=2, seq=32,
                  gated=True)  # fmt: skip


def _bf16(model: nnx.Module) -> nnx.Module:
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))
    return model


def _time(step, batches, steps) -> list[float]:
    times = []
    for i in range(steps + 1):
        start = time.perf_counter()
        jax.block_until_ready(step(batches[i % len(batches)]))
        if i:  # the first call compiles
            times.append(time.perf_counter() - start)
    return times


def _median_s(fn, args, steps) -> float:
    return statistics.median(_time(lambda _: fn(*args), [None], steps))


def _temp_bytes(compiled) -> int | None:
    memory = compiled.memory_analysis()
    return None if memory is None else int(memory.temp_size_in_bytes)


def decoder(config, rows, steps, peak) -> dict:
    """substrax's default step and a plain nnx.jit step on the same bf16 model and batches."""
    batches = [gpt.batch_at(i, rows, config.seq) % config.vocab for i in range(4)]
    mesh = DeviceMeshManager.create_device_mesh({"data": 1}, jax.devices()[:1])
    model = _bf16(sf.create_sharded_model(lambda: gpt.StackedGPT(config, nnx.Rngs(0)), mesh,
                                          layout="dp"))  # fmt: skip
    optimizer = sf.create_sharded_optimizer(model, optax.adamw(1e-4))
    step = sf.make_train_step(gpt.loss_fn, precision="bf16")
    compiled = step.lower(model, optimizer, batches[0]).compile()
    ours = _time(lambda b: step(model, optimizer, b)["loss"], batches, steps)

    with nnx.use_eager_sharding(False):  # one device: the annotations name no mesh
        flax_model = _bf16(gpt.StackedGPT(config, nnx.Rngs(0)))
    flax_opt = nnx.Optimizer(flax_model, optax.adamw(1e-4), wrt=nnx.Param)

    @nnx.jit(donate_argnums=(0, 1))
    def flax_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(gpt.loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    flax_compiled = flax_step.lower(flax_model, flax_opt, jnp.asarray(batches[0])).compile()
    theirs = _time(lambda b: flax_step(flax_model, flax_opt, jnp.asarray(b)), batches, steps)
    ours_s, theirs_s = statistics.median(ours), statistics.median(theirs)
    flops, flax_flops = compiled_flops(compiled), compiled_flops(flax_compiled)
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return {
        "params": int(params),
        "rows": rows,
        "seq": config.seq,
        "substrax_step_s": ours_s,
        "flax_step_s": theirs_s,
        "ratio": ours_s / theirs_s,
        "substrax_flops": flops,
        "flax_flops": flax_flops,
        "substrax_mfu": flops / ours_s / peak if peak else None,
        "flax_mfu": flax_flops / theirs_s / peak if peak else None,
        "substrax_temp_bytes": _temp_bytes(compiled),
        "flax_temp_bytes": _temp_bytes(flax_compiled),
        "path": step.plan.path,
    }


def mixture(tokens, width, hidden, num_experts, top_k, steps) -> dict:
    """A dropless mixture's forward and backward in bf16 on both grouped kernels, timed.

    ``jax.lax.ragged_dot`` (what :func:`~substrax.spmd.native_grouped_matmul` chooses on this
    platform, or not) beside substrax's blocked loop, each with its compiled program's
    matrix-product FLOPs against the active products.
    """
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (1, tokens, width), jnp.bfloat16)  # [batch, length, width]
    router = jax.random.normal(keys[1], (width, num_experts), jnp.bfloat16) * 0.02
    w_in = jax.random.normal(keys[2], (num_experts, width, hidden), jnp.bfloat16) * 0.02
    w_out = jax.random.normal(keys[3], (num_experts, hidden, width), jnp.bfloat16) * 0.02

    def loss(w_in, w_out, x):
        out, _ = experts(x, router, w_in, w_out, top_k=top_k, activation=jax.nn.silu)
        return jnp.mean(out.astype(jnp.float32) ** 2)

    report = {
        "tokens": tokens,
        "experts": num_experts,
        "top_k": top_k,
        "active_flops": 3 * 2 * 2 * tokens * top_k * width * hidden,  # forward + 2 backward
        "native_kernel": native_grouped_matmul(),
    }
    for name, native in (("ragged_dot", True), ("blocked", False)):
        with mock.patch.object(_grouped, "native_grouped_matmul", return_value=native):
            compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(w_in, w_out, x).compile()
        report[name] = {
            "step_s": _median_s(compiled, (w_in, w_out, x), steps),
            "flops": compiled_flops(compiled),
            "temp_bytes": _temp_bytes(compiled),
        }
    return report


def kernels(size, seq, steps, peak) -> dict:
    """A bf16 matrix product and causal attention, forward and backward, in TFLOP/s."""
    keys = jax.random.split(jax.random.key(1), 3)
    a = jax.random.normal(keys[0], (size, size), jnp.bfloat16)
    b = jax.random.normal(keys[1], (size, size), jnp.bfloat16)
    matmul_s = _median_s(jax.jit(jnp.matmul), (a, b), steps)
    rows = {"matmul": {"shape": [size, size, size], "tflops": 2 * size**3 / matmul_s / 1e12}}
    batch, heads, head_dim = 4, 16, 128
    q, k, v = (
        jax.random.normal(key, (batch, seq, heads, head_dim), jnp.bfloat16)
        for key in jax.random.split(keys[2], 3)
    )
    for implementation in ("cudnn", "xla"):
        rows[f"attention_{implementation}"] = _attention(implementation, (q, k, v), steps)
    for row in rows.values():
        for key in ("tflops", "forward_tflops", "forward_backward_tflops"):
            if key in row and peak:
                row[key.replace("tflops", "of_peak")] = row[key] * 1e12 / peak
    return rows


def _attention(implementation, qkv, steps) -> dict:
    """Causal attention's forward and forward+backward, counted as half the score square."""
    batch, seq, heads, head_dim = qkv[0].shape
    forward = 2 * 2 * batch * heads * seq * seq * head_dim / 2  # two products, half the square

    def attend(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)

    def loss(q, k, v):
        return attend(q, k, v).astype(jnp.float32).sum()

    try:
        forward_s = _median_s(jax.jit(attend), qkv, steps)
        both_s = _median_s(jax.jit(jax.grad(loss, (0, 1, 2))), qkv, steps)
    except Exception as error:  # an implementation this device lacks: recorded, not fatal
        return {"error": f"{type(error).__name__}: {error}"[:300]}
    return {
        "shape": [batch, seq, heads, head_dim],
        "forward_tflops": forward / forward_s / 1e12,
        "forward_backward_tflops": 3.5 * forward / both_s / 1e12,  # backward: 5 products
    }


def _phase(fn, *args) -> dict:
    start = time.perf_counter()
    try:
        result = fn(*args)
    except Exception as error:  # a lent machine's one call reports every phase it can
        result = {"error": "".join(traceback.format_exception(error))[-2000:]}
    print(f"{fn.__name__}: {time.perf_counter() - start:.1f} s", flush=True)
    return result


def markdown(report: dict) -> str:
    d, m, k = report["decoder"], report["experts"], report["kernels"]

    def pct(v):
        return "-" if v is None else f"{100 * v:.1f}%"

    def failed(name, phase):
        return f"{name} failed:\n\n```\n{phase['error']}\n```\n\n"

    head = f"# One {report['device']}: substrax's step beside plain Flax's\n\n"
    head += f"jax {report['jax']}, flax {report['flax']}, {report['date']}.\n\n"
    text = head if "error" not in d else head + failed("The decoder", d)
    if "error" not in d:
        text += _decoder_md(d, pct)
    text += failed("The experts", m) if "error" in m else _experts_md(m)
    text += failed("The kernels", k) if "error" in k else _kernels_md(k, pct)
    return text


def _kernels_md(k, pct) -> str:
    lines = ["| kernel | shape | TFLOP/s | of peak |", "|---|---|---|---|"]
    for name, row in k.items():
        if "error" in row:
            lines.append(f"| {name} | - | {row['error']} | - |")
        elif name == "matmul":
            lines.append(f"| {name} | {row['shape']} | {row['tflops']:.0f} | "
                         f"{pct(row.get('of_peak'))} |")  # fmt: skip
        else:
            for part in ("forward", "forward_backward"):
                lines.append(
                    f"| {name} {part.replace('_', '+')} (causal) | {row['shape']} | "
                    f"{row[part + '_tflops']:.0f} | {pct(row.get(part + '_of_peak'))} |"
                )
    return "\n" + "\n".join(lines) + "\n"


def _decoder_md(d, pct) -> str:
    return (
        f"Decoder: {d['params']:,} parameters, "
        f"{d['rows']} x {d['seq']} tokens, bf16 parameters and adamw.\n\n"
        "| step | median s | MFU | compiled temporaries |\n|---|---|---|---|\n"
        f"| substrax `make_train_step` ({d['path']}) | {d['substrax_step_s']:.4f} | "
        f"{pct(d['substrax_mfu'])} | {_gib(d['substrax_temp_bytes'])} |\n"
        f"| plain Flax `nnx.jit` | {d['flax_step_s']:.4f} | {pct(d['flax_mfu'])} | "
        f"{_gib(d['flax_temp_bytes'])} |\n\n"
        f"substrax / Flax step time: **{d['ratio']:.3f}**.\n\n"
    )


def _gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def _experts_md(m) -> str:
    lines = [
        f"Dropless experts ({m['experts']} experts, top {m['top_k']}, {m['tokens']} tokens, "
        f"forward and backward; {m['active_flops'] / 1e9:.1f} GFLOP of active products; "
        f"substrax's default here: {'ragged_dot' if m['native_kernel'] else 'blocked'}):\n",
        "| grouped kernel | ms | compiled GFLOP | x active | compiled temporaries |",
        "|---|---|---|---|---|",
    ]
    for name in ("ragged_dot", "blocked"):
        row = m[name]
        lines.append(
            f"| {name} | {row['step_s'] * 1e3:.2f} | {row['flops'] / 1e9:.1f} | "
            f"{row['flops'] / m['active_flops']:.2f} | {_gib(row['temp_bytes'])} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("full", "tiny"), default="full")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--output-dir", type=pathlib.Path, default=pathlib.Path("."))
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    profile = profile_of(device.device_kind)
    peak = HARDWARE[profile].flops if profile else 0.0
    full = args.size == "full"
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "device": device.device_kind,
        "platform": device.platform,
        "jax": jax.__version__,
        "flax": flax.__version__,
        "decoder": _phase(decoder, CONFIG if full else TINY, args.rows, args.steps, peak),
        "experts": _phase(
            mixture,
            4096 if full else 64,
            1024 if full else 32,
            512 if full else 16,
            64 if full else 4,
            8 if full else 2,
            args.steps,
        ),
        "kernels": _phase(
            kernels, 8192 if full else 256, 8192 if full else 128, 2 * args.steps, peak
        ),
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "gpu.json").write_text(json.dumps(report, indent=2, default=float))
    (args.output_dir / "gpu.md").write_text(markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
