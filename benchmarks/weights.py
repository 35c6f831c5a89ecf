"""Loading a safetensors checkpoint into a sharded model: substrax against the naive way.

The checkpoint is the example's Llama decoder in Hugging Face's format (``examples/llama.py``),
random float32 weights of about ``--gb`` GB. Each way runs in a fresh process on 8 simulated
CPU devices and loads it onto ``fsdp`` over the 8:

* **substrax**: ``llama.from_pretrained`` (:func:`substrax_flax.load_weights`): each array made
  from the memory-mapped slices its devices hold, one tensor at a time.
* **naive**: every file read with ``safetensors.numpy.load_file``, each tensor rearranged with
  numpy, then ``jax.device_put`` into its planned sharding.

Measured: the load's wall time, and its peak host memory: the growth of the process's peak
resident set during the load, less the bytes the model's arrays hold on the devices (on CPU
the devices' memory is the host's, so both ways hold the model once; what differs is what
they hold besides it).

Run: ``python benchmarks/weights.py [--gb 1.0] [--output-dir DIR]``; writes ``weights.json``
and ``weights.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))

MIB = 2**20
WAYS = ("substrax", "naive")


def config_of(gb: float):
    """A Llama config of about ``gb`` GB of float32 weights (width 1024, 32k vocabulary)."""
    import llama

    d, f, v, heads, kv = 1024, 2816, 32000, 16, 8
    layer = 2 * d * d + 2 * d * d * kv // heads + 3 * d * f + 2 * d
    layers = max(1, round((gb * 1e9 / 4 - 2 * v * d) / layer))
    return llama.LlamaConfig(
        vocab_size=v, hidden_size=d, intermediate_size=f, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv,
    )  # fmt: skip


def _status(field: str) -> int:
    """A memory figure of this process from ``/proc/self/status``, in bytes.

    ``VmRSS`` is the resident set now, ``VmHWM`` its peak. (``getrusage``'s ``ru_maxrss`` is
    no use here: Linux carries it over from the parent across fork and exec.)
    """
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise OSError(f"no {field} in /proc/self/status")


def _child(way: str, directory: str) -> dict:
    """Loads the checkpoint one way in this process; returns its time and memory."""
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import llama
    import numpy as np
    import safetensors.numpy
    from flax import nnx

    import substrax_flax as sf
    from substrax.layout import Layout
    from substrax_flax._rearrange import arrange

    layout = Layout.named("fsdp", {"data": 8})
    config = llama.LlamaConfig.from_json(directory)
    jax.devices()  # the backend's own memory, before the baseline
    baseline = _status("VmRSS")
    start = time.perf_counter()
    if way == "substrax":
        model = llama.from_pretrained(directory, layout=layout)
    else:
        plan = sf.plan_model(lambda: llama.Llama(config, nnx.Rngs(0)), layout=layout)
        shardings = {r.path: s for r, s in zip(plan.rows, jax.tree.leaves(plan.shardings),
                                               strict=True)}  # fmt: skip
        tensors = {}
        for file in sorted(pathlib.Path(directory).glob("*.safetensors")):
            tensors.update(safetensors.numpy.load_file(file))
        values = {}
        for name, target in llama.key_map(config).items():
            for i in range(config.num_hidden_layers) if "{i}" in name else [None]:
                key = name.format(i=i)
                if target is None or key not in tensors:
                    continue
                target = target if isinstance(target, sf.Target) else sf.Target(target)
                value = tensors[key]
                if target.pattern is not None:
                    value = np.ascontiguousarray(arrange(value, target.parsed))
                path = target.path.format(i=i)
                values[path] = jax.device_put(value, shardings[path])
        model = plan.create_with(values)
    jax.block_until_ready(nnx.state(model))
    seconds = time.perf_counter() - start
    peak = _status("VmHWM")
    arrays = jax.tree.leaves(nnx.state(model))
    device = sum(s.data.nbytes for a in arrays for s in a.addressable_shards)
    return {"way": way, "seconds": seconds, "peak_growth_bytes": peak - baseline,
            "device_bytes": device, "host_bytes": peak - baseline - device}  # fmt: skip


def measure(gb: float) -> dict:
    """Writes the checkpoint, then loads it each way in its own process."""
    import llama

    config = config_of(gb)
    with tempfile.TemporaryDirectory() as directory:
        llama.write_random_checkpoint(directory, config, shard_size="500MB")
        size = sum(p.stat().st_size for p in pathlib.Path(directory).glob("*.safetensors"))
        rows = []
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        env.pop("XLA_FLAGS", None)
        for way in WAYS:
            out = subprocess.run([sys.executable, __file__, "--child", way, directory],
                                 capture_output=True, text=True, env=env, check=True)  # fmt: skip
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {"checkpoint_bytes": size, "layers": config.num_hidden_layers, "rows": rows,
            "date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} CPU cores "
            f"({platform.machine()})"}  # fmt: skip


def markdown(report: dict) -> str:
    rows = {r["way"]: r for r in report["rows"]}
    naive = rows["naive"]
    lines = [
        f"# Loading a {report['checkpoint_bytes'] / 1e9:.2f} GB safetensors checkpoint onto fsdp 8",
        "",
        f"The example's Llama decoder ({report['layers']} layers, width 1024, 32k vocabulary, "
        f"float32) in Hugging Face's format, measured {report['date']} on {report['machine']}, 8 "
        "simulated CPU devices (`python benchmarks/weights.py`). Host memory: the peak resident "
        "set's growth during the load less the model's bytes on the devices.",
        "",
        "| way | load s | peak RSS growth MiB | of it on the devices MiB | host memory MiB | "
        "host memory vs naive |",
        "|---|---|---|---|---|---|",
    ]
    for way in WAYS:
        r = rows[way]
        lines.append(
            f"| {way} | {r['seconds']:.2f} | {r['peak_growth_bytes'] / MIB:.0f} | "
            f"{r['device_bytes'] / MIB:.0f} | {r['host_bytes'] / MIB:.0f} | "
            f"{r['host_bytes'] / naive['host_bytes']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0, help="checkpoint size, GB")
    parser.add_argument("--output-dir", type=pathlib.Path, default=None,
                        help="write weights.json and weights.md here")  # fmt: skip
    parser.add_argument("--child", nargs=2, metavar=("WAY", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(*args.child)))
        return {}
    report = measure(args.gb)
    table = markdown(report)
    if args.output_dir is not None:
        from layouts import write_results

        write_results(args.output_dir, "weights", report, table)
    else:
        print(table)
    return report


if __name__ == "__main__":
    main()
