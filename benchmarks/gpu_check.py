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
  time and the compiled program's FLOPs against the active dense compute.

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

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))

import gpt

import substrax_flax as sf
from substrax.mesh import DeviceMeshManager
from substrax.planner import HARDWARE, profile_of
from substrax.spmd import experts, native_grouped_matmul

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


def _flops(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost.get("flops", 0.0))


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
    flops, flax_flops = _flops(compiled), _flops(flax_compiled)
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
        "path": step.plan.path,
    }


def mixture(tokens, width, hidden, num_experts, top_k, steps) -> dict:
    """A dropless mixture's forward and backward in bf16, timed, with its compiled FLOPs."""
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (1, tokens, width), jnp.bfloat16)  # [batch, length, width]
    router = jax.random.normal(keys[1], (width, num_experts), jnp.bfloat16) * 0.02
    w_in = jax.random.normal(keys[2], (num_experts, width, hidden), jnp.bfloat16) * 0.02
    w_out = jax.random.normal(keys[3], (num_experts, hidden, width), jnp.bfloat16) * 0.02

    def loss(w_in, w_out, x):
        out, _ = experts(x, router, w_in, w_out, top_k=top_k, activation=jax.nn.silu)
        return jnp.mean(out.astype(jnp.float32) ** 2)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    compiled = grad.lower(w_in, w_out, x).compile()
    times = _time(lambda _: grad(w_in, w_out, x), [None], steps)
    active = 3 * 2 * 2 * tokens * top_k * width * hidden  # forward + two backward products
    text = compiled.as_text()
    return {
        "tokens": tokens,
        "experts": num_experts,
        "top_k": top_k,
        "step_s": statistics.median(times),
        "flops": _flops(compiled),
        "active_flops": active,
        "native_kernel": native_grouped_matmul(),
        "ragged_dot_in_program": "ragged" in text.lower(),
    }


def markdown(report: dict) -> str:
    d, m = report["decoder"], report["experts"]

    def pct(v):
        return "-" if v is None else f"{100 * v:.1f}%"

    return (
        f"# One {report['device']}: substrax's step beside plain Flax's\n\n"
        f"jax {report['jax']}, {report['date']}. Decoder: {d['params']:,} parameters, "
        f"{d['rows']} x {d['seq']} tokens, bf16 parameters and adamw.\n\n"
        "| step | median s | MFU |\n|---|---|---|\n"
        f"| substrax `make_train_step` ({d['path']}) | {d['substrax_step_s']:.4f} | "
        f"{pct(d['substrax_mfu'])} |\n"
        f"| plain Flax `nnx.jit` | {d['flax_step_s']:.4f} | {pct(d['flax_mfu'])} |\n\n"
        f"substrax / Flax step time: **{d['ratio']:.3f}**.\n\n"
        f"Dropless experts ({m['experts']} experts, top {m['top_k']}, {m['tokens']} tokens, "
        f"forward and backward): {m['step_s'] * 1e3:.2f} ms, {m['flops'] / 1e9:.1f} GFLOP "
        f"compiled for {m['active_flops'] / 1e9:.1f} GFLOP of active products "
        f"({m['flops'] / m['active_flops']:.2f}x); grouped kernel "
        f"{'ragged_dot' if m['ragged_dot_in_program'] else 'blocked loop'}.\n"
    )


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
        "decoder": decoder(CONFIG if full else TINY, args.rows, args.steps, peak),
        "experts": mixture(
            4096 if full else 64,
            1024 if full else 32,
            512 if full else 16,
            64 if full else 4,
            8 if full else 2,
            args.steps,
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
