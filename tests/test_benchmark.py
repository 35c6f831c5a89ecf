"""The layouts benchmark runs at a tiny size and reports what it should."""

import os
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import layouts  # noqa: E402


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_benchmark_runs_at_a_tiny_size(tmp_path):
    report = layouts.main(
        ["--size", "tiny", "--steps", "1", "--layouts", "FSDP 8", "--output-dir", str(tmp_path)]
    )  # fmt: skip
    assert (tmp_path / "layouts.json").exists()
    assert "| FSDP 8 | substrax |" in (tmp_path / "layouts.md").read_text()
    fsdp = report["rows"][0]
    for name in ("substrax", "flax"):
        assert fsdp[name]["bytes_per_device"] > 0
        assert len(fsdp[name]["losses"]) == 2
    assert fsdp["max_loss_difference"] < 1e-4
    assert fsdp["substrax"]["full_size_init_buffers"] == []
    default = fsdp["substrax"]  # the manual data-parallel step: gather + reduce-scatter
    assert default["collectives"]["reduce-scatter"]["count"] > 0
    assert default["traffic_bytes"] <= 1.05 * fsdp["theory_traffic_bytes"]
    xla = fsdp["substrax xla"]  # XLA's partitioning all-reduces the gradients instead
    assert xla["traffic_bytes"] == pytest.approx(fsdp["theory_xla_traffic_bytes"], rel=0.05)
    assert fsdp["max_xla_loss_difference"] < 1e-4
    flag = 64  # bytes: the non-finite guard's all-reduced flag, which Flax's recipe lacks
    for row in report["rows"]:  # the default path (a named layout, nothing else) beats the recipe
        assert row["substrax"]["traffic_bytes"] <= row["flax"]["traffic_bytes"] + flag, row
        assert row["substrax"]["peak_bytes"] <= row["flax"]["peak_bytes"], row["layout"]


def test_theory_volumes():
    assert layouts.theory_bytes("dp", 800, {"data": 8}) == 2 * 800 * 7 / 8
    assert layouts.theory_bytes("fsdp", 800, {"data": 8}) == 3 * 800 * 7 / 8
    assert layouts.theory_bytes("fsdp", 800, {"data": 8}, manual=True) == 2 * 800 * 7 / 8
    hsdp = layouts.theory_bytes("hsdp", 800, {"data": 2, "model": 4})
    assert hsdp == 3 * 800 * 3 / 4 + 2 * 200 / 2
    assert layouts.theory_bytes("tp", 800, {"data": 2, "model": 4}) is None


def test_pipeline_benchmark_runs_at_a_tiny_size(tmp_path):
    import pipeline as pipeline_benchmark

    rows = pipeline_benchmark.main(
        [
            "--size",
            "tiny",
            "--steps",
            "1",
            "--factors",
            "1",
            "4",
            "--output-dir",
            str(tmp_path),
            "--plot",
            str(tmp_path / "pipeline.png"),
        ]
    )
    assert (tmp_path / "pipeline.md").exists() and (tmp_path / "pipeline.png").exists()
    assert len(rows) == 12
    for row in rows:
        if row["schedule"].startswith(("gpipe", "circular")):
            assert row["idle_measured"] == pytest.approx(row["idle_formula"])
        else:  # at or under the textbook, and nothing computed in an idle tick
            assert row["idle_measured"] <= row["idle_formula"] + 1e-9
            assert row["idle_flops_over_useful"] < 0.05
        if "remat" not in row["schedule"]:  # remat's recomputation is asked-for work
            assert row["flops_over_useful"] <= 1.05 / (1 - row["idle_measured"])
        assert row["reductions_in_loops"] == 0


def test_zoo_benchmark_runs_on_one_model(tmp_path):
    import zoo

    report = zoo.main(["--models", "tied", "--output-dir", str(tmp_path)])
    assert (tmp_path / "zoo.md").exists() and len(report["gallery"]) == 2
    for row in report["real"]:  # unannotated real-size shapes under the fsdp layout
        assert row["ratio_to_ideal"] <= row["target"] < row["reference_fsdp_ratio"]


def test_step_benchmark_runs_at_a_tiny_size(tmp_path):
    import step

    report = step.main(
        ["--size", "tiny", "--steps", "2", "--layouts", "FSDP 8", "--microbatches", "1", "4",
         "--flax-steps", "2", "--guard-steps", "2", "--output-dir", str(tmp_path)]
    )  # fmt: skip
    assert (tmp_path / "step.md").exists()
    guard = {row["layout"]: row for row in report["guard"]}
    assert list(guard) == ["FSDP 8", "FSDP 4 x DP 2"]
    for row in guard.values():  # the check computes the update once more: never fewer FLOPs
        assert row["skip"]["flops"] >= row["apply"]["flops"] > 0 and row["time_ratio"] > 0
    (row,) = report["precision"]
    assert row["traffic_ratio"] <= 0.55 and row["max_relative_loss_difference"] < 1e-2
    one, four = report["accumulation"]
    assert four["collectives"] == one["collectives"]  # reductions do not grow with K
    assert four["temp_bytes"] < one["temp_bytes"] and four["max_loss_difference"] < 1e-5
    against = {row["layout"]: row for row in report["against_flax"]["glibc"]}
    assert list(report["against_flax"]) == ["glibc"]  # --allocator's default
    assert list(against) == ["FSDP 4 x DP 2", "TP 4 x DP 2"]
    assert all(row["page_faults"] >= 0 and row["flax_page_faults"] >= 0 for row in against.values())
    assert "| TP 4 x DP 2 | glibc |" in (tmp_path / "step.md").read_text()
    hsdp = against["FSDP 4 x DP 2"]  # at the limit; times are measured, never asserted
    assert hsdp["traffic_bytes"] <= 1.05 * hsdp["limit_bytes"] < hsdp["flax_traffic_bytes"]
    assert all(row["max_loss_difference"] < 1e-5 for row in against.values())
    paths = {row["case"]: row for row in report["paths"]}
    for row in paths.values():  # dropout and jax.make_mesh meshes keep the manual step
        assert row["path"] == "manual" and row["traffic_bytes"] <= row["bound_bytes"], row
    for dropout in ("", "dropout 0.1, "):
        explicit = paths[f"{dropout}jax.make_mesh"]
        auto = paths[dropout[:-2] if dropout else "as benchmarked"]
        assert "Auto twin" in explicit["mesh"] and explicit["losses"] == auto["losses"]
    # one section measured again (here with no steps: nothing compiled), the others kept
    again = step.main(["--size", "tiny", "--sections", "flax", "--flax-steps", "0",
                       "--output-dir", str(tmp_path)])  # fmt: skip
    assert again["against_flax"] == {"glibc": []} and again["flax_steps"] == 0
    assert again["precision"] == report["precision"] and again["guard"] == report["guard"]


def test_tracing_benchmark_times_each_part_with_and_without_the_probe_walk(tmp_path):
    import tracing

    report = tracing.main(["--layers", "2", "--output-dir", str(tmp_path)])
    assert [(row["layers"], row["walk"]) for row in report["rows"]] == [(2, True), (2, False)]
    assert all(row[part] > 0 for row in report["rows"] for part in tracing.PARTS)
    assert "| 2 | skipped |" in (tmp_path / "tracing.md").read_text()


def test_decode_benchmark_runs_at_a_tiny_size(tmp_path):
    import decode

    report = decode.main(["--size", "tiny", "--tokens", "3", "--repeats", "1",
                          "--output-dir", str(tmp_path)])  # fmt: skip
    assert (tmp_path / "decode.md").exists()
    for row in report["rows_measured"]:  # both paths decode alike; the cache is as planned
        assert row["same_tokens"] and row["cache_bytes_held"] == row["cache_bytes_per_device"]
    assert report["rows_measured"][1]["cache_spec"] == "P('data', None, 'model', None)"


def test_experts_benchmark_runs_at_a_tiny_size(tmp_path):
    import experts as experts_benchmark

    report = experts_benchmark.main(
        ["--experts", "32", "--tokens", "256", "--sweep-only", "--output-dir", str(tmp_path)]
    )
    assert "| 32 |" in (tmp_path / "experts.md").read_text()
    for row in report["sweep"]:
        sorted_, one_hot = row["sorted"], row["one-hot"]
        assert sorted_["temp_bytes"] < one_hot["temp_bytes"]
        assert sorted_["flops"] < one_hot["flops"]
        assert sorted_["sent_bytes"] <= sorted_["bytes"] <= one_hot["bytes"]


def test_sorted_dispatch_costs_what_routing_selects_at_64_experts():
    """The documented figure: 64 experts, top 8, 4096 tokens, a step's temporaries and FLOPs
    within 1.2x the active dense compute's (one-hot dispatch: 85x and 35x)."""
    import experts as experts_benchmark

    sizes = experts_benchmark.DISPATCH
    active = experts_benchmark.dispatch_cost("active", 64, **sizes)
    got = experts_benchmark.dispatch_cost("sorted", 64, **sizes)
    assert got["temp_bytes"] <= 1.2 * active["temp_bytes"]
    assert got["flops"] <= 1.2 * active["flops"]


def test_tpu_benchmark_runs_at_a_tiny_size(tmp_path):
    import tpu

    report = tpu.main([
        "--size", "tiny", "--target", "v5p:2x2x2", "--layouts", "FSDP 32", "ZeRO-1 32",
        "--output-dir", str(tmp_path),
    ])  # fmt: skip
    assert "| FSDP 32 | substrax |" in (tmp_path / "tpu.md").read_text()
    fsdp, zero = report["rows"]
    assert fsdp["mesh"] == {"data": 8} and fsdp["path"] == "manual"
    for row in (fsdp, zero):
        assert row["substrax"]["data_bytes"] > 0 and row["substrax"]["other_bytes"] < 4096
    ours, theirs = fsdp["substrax"], fsdp["flax"]
    assert ours["data_bytes"] <= theirs["data_bytes"] and ours["peak_bytes"] <= theirs["peak_bytes"]
    assert "peak_bytes" in fsdp["flax donated"]  # the guide's step fits: donated too
    # ZeRO-1's reduce-scatter over all 8 chips would be compiled by XLA:TPU as a whole
    # all-reduce and a slice, then the update gathered: 1.5x the limit (DP's one all-reduce,
    # Flax's row). Staged, it stays two reduce-scatters, except at this size for gradients
    # whose last dimension splits below a 128-lane tile: 1.33x. docs/targets.md says why.
    assert zero["limit_bytes"] < zero["substrax"]["data_bytes"] < 1.4 * zero["limit_bytes"]
    assert zero["flax"]["data_bytes"] == pytest.approx(zero["limit_bytes"], rel=0.05)


def test_tpu_limit_counts_a_gather_a_scatter_and_a_replica_reduction():
    import tpu

    class Row:
        path, bytes_total = "w", 800

    class Param:
        path, stored, used = "w", ("fsdp",), (None,)

    class Plan:
        params, batch_axes = (Param,), ("data", "fsdp")

    # gathered over 4 FSDP chips (2 x 800 x 3/4) and its 200-byte shard over 2 replicas
    assert tpu.limit_bytes(Plan, [Row], {"data": 2, "fsdp": 4}) == 2 * 800 * 3 / 4 + 2 * 200 / 2


def test_gpu_check_runs_at_a_tiny_size(tmp_path):
    import gpu_check

    report = gpu_check.main(["--size", "tiny", "--steps", "1", "--output-dir", str(tmp_path)])
    assert report["decoder"]["substrax_step_s"] > 0 and report["decoder"]["flax_step_s"] > 0
    mixture = report["experts"]
    assert not mixture["native_kernel"]  # XLA:CPU's ragged_dot is dense: the blocked loop
    # the dense ragged_dot multiplies every row by every expert (4 here); the loop does not
    assert mixture["ragged_dot"]["flops"] > 3 * mixture["active_flops"]
    assert mixture["blocked"]["flops"] < 2 * mixture["active_flops"]
    assert report["kernels"]["matmul"]["tflops"] > 0
    assert report["kernels"]["attention_xla"]["forward_backward_tflops"] > 0
    assert "error" in report["kernels"]["attention_cudnn"]  # no cuDNN on the CPU
    assert "substrax / Flax step time" in (tmp_path / "gpu.md").read_text()


def test_gpu_check_reports_a_failed_phase_and_runs_the_others(tmp_path):
    import gpu_check

    def broken(*_):
        raise RuntimeError("no such kernel")

    assert "RuntimeError: no such kernel" in gpu_check._phase(broken)["error"]


def test_step_profile_times_the_collectives_of_both_steps():
    import step_profile

    result = step_profile.main(["--size", "tiny", "--steps", "1", "--layout", "TP 4 x DP 2"])
    assert set(result) == {"substrax", "flax"}
    for row in result.values():
        assert row["collectives_ms"] > 0 and row["largest_collectives"]
        assert all(op.startswith("all-reduce") for op, _ in row["largest_collectives"])


def test_step_variants_time_each_default_against_flax():
    import step_variants

    report = step_variants.main(["--size", "tiny", "--steps", "1", "--layout", "TP 4 x DP 2"])
    ratios, kernels = report["ratios"], report["kernels"]
    assert list(ratios) == [*step_variants.VARIANTS, "flax, donated", "flax"]
    assert ratios["flax"] == 1.0
    assert all(ratio > 0 for ratio in ratios.values())  # times are measured, never asserted
    # the guard's check and its branch are kernels of their own; donation adds none
    assert kernels["default"] > kernels["no guard"] == kernels["no guard, undonated"] > 0
    assert set(report["page_faults"]) == set(ratios)
    # the manual region's weight gradients are dots XLA:CPU's YNNPACK fusions do not take
    dots = report["plain_dots"]
    assert dots["default"] == dots["no guard"] > dots["xla's step, no guard"] == dots["flax"]
    assert all(faults >= 0 for faults in report["page_faults"].values())
    # XLA:CPU gives a donated step more temporaries (its outputs are its inputs' buffers),
    # Flax's recipe as substrax's step: what glibc's defaults fault in again on every call
    temps = report["temp_bytes"]
    assert (
        temps["flax, donated"] > temps["flax"] and temps["no guard"] > temps["no guard, undonated"]
    )


KEPT_SCRIPT = """
import statistics, sys
sys.path.insert(0, sys.argv[1])
import jax
import jax.numpy as jnp
from allocator import keep_freed_memory, minor_faults
jax.config.update("jax_num_cpu_devices", 8)
mesh = jax.make_mesh((8,), ("d",))
x = jax.device_put(jnp.ones((8 * 1152, 4096)), jax.sharding.NamedSharding(mesh, jax.P("d")))
f = jax.jit(lambda x: (jnp.sin(x) * jnp.cos(x) + jnp.exp(x)).sum(1))  # 36 MiB of temp per device
def per_call():
    faults = []
    for _ in range(6):
        before = minor_faults()
        jax.block_until_ready(f(x))
        faults.append(minor_faults() - before)
    return statistics.median(faults[1:])
glibc = per_call()
keep_freed_memory()
print(glibc, per_call())
"""


def test_keeping_freed_memory_spares_xla_cpus_temporaries_their_page_faults():
    """What docs/benchmarks.md says of the allocator: with glibc's defaults each call faults its
    temporaries in again; kept, most of those faults go (a process of its own: it is for good).

    The temporaries exceed 32 MiB, the most glibc's adaptive mmap threshold reaches, so the
    defaults unmap them on every call whatever the process freed before. Smaller ones depend
    on that history: 8 MiB ones took 1 to 8,160 faults per call from run to run.
    """
    import resource
    import subprocess

    result = subprocess.run(
        [sys.executable, "-c", KEPT_SCRIPT, str(ROOT / "benchmarks")],
        capture_output=True, text=True, check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    glibc, kept = map(float, result.stdout.split())
    pages = 8 * (36 << 20) // resource.getpagesize()  # the 8 devices' temporaries
    assert glibc > 0.9 * pages, (glibc, pages)
    assert kept < glibc / 2, (glibc, kept)


def test_a_gradient_inside_a_region_leaves_its_weight_gradient_dots_plain():
    """docs/benchmarks.md's account of the manual region's dots, on a two-matmul model."""
    import region_dots

    result = region_dots.main(["--tokens", "8", "--d-model", "64", "--steps", "1"])
    assert list(result) == ["dp 2 x replicated", "dp 2 x tp 4"]
    for row in result.values():  # the two weight gradients; XLA's partitioned gradient, none
        assert row["region"]["plain_dots"] == 2 and row["xla"]["plain_dots"] == 0, row
        assert row["time_ratio"] > 0  # measured, never asserted
