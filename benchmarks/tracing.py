"""How long substrax takes to trace a model as it deepens, with and without jax's probe walk.

jax 0.10.2 walks the whole trace each time a tracer's missing ``.sharding`` is probed, and
Flax NNX probes it at every ``nnx.Rngs`` draw (``substrax_flax._probes``). For the example
decoder (``examples/gpt.py``, d_model 64, dropout 0.1, unstacked layers) at each depth this
times, once as substrax traces (the walk skipped) and once with jax's own probe: the planner's
abstract build (``model_leaves``), the plan (``plan_model``), the init lowered
(``compile_init``'s trace and lowering) and the train step lowered (its plan, trace and
lowering), and beside it Flax's own step for the same model and optimizer (``nnx.split`` of
both, ``nnx.value_and_grad`` and ``optimizer.update`` in a donated ``jax.jit``, under
``jax.set_mesh``), lowered with the walk as substrax's. The mesh has Auto axes, on which
Flax's step traces. Nothing is compiled; times are wall seconds on this machine.

Run: ``python benchmarks/tracing.py [--layers 8 32 64 126] [--output-dir DIR]``; writes
``tracing.json`` and ``tracing.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import sys
import time

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))

import gpt

import substrax_flax as sf
from substrax_flax import _probes
from substrax_flax.planner import model_leaves

PARTS = ("model_leaves", "plan", "init_lowered", "step_lowered", "flax_step_lowered")


@contextlib.contextmanager
def _walking(walk: bool):
    """With ``walk``, substrax's traces keep jax's own probe (the walk); else as shipped."""
    cheap = _probes._SLOW
    _probes._SLOW = None if walk else cheap
    try:
        yield
    finally:
        _probes._SLOW = cheap


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def flax_lowered(model: nnx.Module, optimizer: nnx.Optimizer, batch, mesh) -> jax.stages.Lowered:
    """Flax's functional train step for ``model`` and ``optimizer`` (abstract), lowered."""
    graphdef, state = nnx.split((model, optimizer))

    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(gpt.loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss, nnx.state((model, optimizer))

    with jax.set_mesh(mesh):
        return jax.jit(step, donate_argnums=0).lower(state, batch)


def measure(layers: int, walk: bool) -> dict[str, float]:
    """Seconds of each part for a decoder of ``layers`` unstacked layers."""
    config = gpt.Config(vocab=256, d_model=64, heads=4, mlp=128, layers=layers, seq=16,
                        dropout=0.1)  # fmt: skip

    def factory():
        return gpt.GPT(config, nnx.Rngs(0))

    mesh = jax.make_mesh((len(jax.devices()),), ("data",), axis_types=(AxisType.Auto,))
    batch = jax.ShapeDtypeStruct((2 * len(jax.devices()), config.seq + 1), np.int32)
    row = {}
    with _walking(walk):
        row["model_leaves"] = _timed(lambda: model_leaves(factory))
        plans = []
        row["plan"] = _timed(lambda: plans.append(sf.plan_model(factory, mesh, layout="fsdp")))
        (plan,) = plans
        row["init_lowered"] = _timed(plan._lower_init)
        model = plan.abstract_model()
        optimizer = sf.create_sharded_optimizer(model, gpt.optimizer())
        step = sf.make_train_step(gpt.loss_fn)
        row["step_lowered"] = _timed(lambda: step.lower(model, optimizer, batch))
        with _probes.cheap_sharding_probes():  # Flax's own step: the walk as substrax's
            row["flax_step_lowered"] = _timed(lambda: flax_lowered(model, optimizer, batch, mesh))
    return row


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 32, 64, 126])
    parser.add_argument("--output-dir", type=pathlib.Path, default=pathlib.Path("benchmarks"))
    args = parser.parse_args(argv)
    rows = []
    for layers in args.layers:
        for walk in (True, False):  # the walk first: the shipped path never runs cold
            rows.append({"layers": layers, "walk": walk, **measure(layers, walk)})
    lines = [
        "| layers | jax's probe walk | " + " | ".join(f"{p} s" for p in PARTS) + " |",
        "|---:|---|" + "---:|" * len(PARTS),
    ]
    for r in rows:
        times = " | ".join(f"{r[p]:.2f}" for p in PARTS)
        lines.append(f"| {r['layers']} | {'kept' if r['walk'] else 'skipped'} | {times} |")
    text = "\n".join(lines)
    print(text)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    result = {"jax": jax.__version__, "devices": len(jax.devices()), "rows": rows}
    (args.output_dir / "tracing.json").write_text(json.dumps(result, indent=2))
    (args.output_dir / "tracing.md").write_text(
        "# Tracing time against depth\n\n`python benchmarks/tracing.py --output-dir "
        f"benchmarks/results` (jax {jax.__version__}, {len(jax.devices())} simulated CPU "
        "devices; wall seconds, nothing compiled)\n\n" + text + "\n"
    )
    return result


if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)
    main()
