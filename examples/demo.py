"""Builds meshes on 8 simulated devices and prints each strategy's partition specs for a model.

Run with ``make demo``.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)

from substrax.mesh import (  # noqa: E402
    DataParallelStrategy,
    DeviceMeshManager,
    FSDPStrategy,
    MultiDimensionalStrategy,
    ParallelismConfig,
    PipelineParallelStrategy,
    ShardingConfig,
    TensorParallelStrategy,
    fsdp_rules,
    partition_spec_for_names,
)

# A small transformer block: parameter path -> (shape, logical names).
MODEL = {
    "embed/embedding": ((4096, 256), ("vocab", "embed")),
    "attn/query/kernel": ((256, 8, 32), ("embed", "heads", "kv")),
    "attn/out/kernel": ((8, 32, 256), ("heads", "kv", "embed")),
    "mlp/up/kernel": ((256, 1024), ("embed", "mlp")),
    "mlp/up/bias": ((1024,), ("mlp",)),
    "mlp/down/kernel": ((1024, 256), ("mlp", "embed")),
    "norm/scale": ((256,), ("embed",)),
}


def main():
    mesh = DeviceMeshManager.create_device_mesh({"data": 2, "model": 4})
    print(f"mesh: {mesh}")
    print(f"info: {DeviceMeshManager.get_mesh_info(mesh)}\n")

    rules = fsdp_rules(data_axis="data", model_axis="model").extend(vocab="model", kv=None)
    print(f"rules (logical names): {rules.to_pairs()}")
    for path, (_, names) in MODEL.items():
        print(f"  {path:20s} {names!s:28s} -> {partition_spec_for_names(rules, *names)}")

    config = ShardingConfig(data_parallel_size=2, tensor_parallel_size=4, fsdp_enabled=True)
    parallelism = ParallelismConfig((2, 4), ("data", "model"), config)
    strategies = {
        "data parallel": DataParallelStrategy("data", 0),
        "fsdp": FSDPStrategy("model", 1, min_weight_size=256),
        "tensor parallel": TensorParallelStrategy("model", 1),
        "pipeline (4 stages)": PipelineParallelStrategy("model", 1, num_stages=4),
        "fsdp + tensor": MultiDimensionalStrategy(
            {
                "fsdp": FSDPStrategy("data", 0, min_weight_size=256),
                "tensor": TensorParallelStrategy("model", 1),
            },
            parallelism,
        ),
    }
    for label, strategy in strategies.items():
        print(f"\nstrategy: {label}")
        for path, (shape, _) in MODEL.items():
            resolution = strategy.resolve(shape, mesh, name=path)
            notes = "; ".join(map(str, resolution.reasons))
            print(
                f"  {path:20s} {shape!s:15s} -> {resolution.spec}{f'  ({notes})' if notes else ''}"
            )
    for count in (8, 64, 512, 4096):
        print(
            f"ShardingConfig.from_device_count({count}) = {ShardingConfig.from_device_count(count)}"
        )


if __name__ == "__main__":
    main()
