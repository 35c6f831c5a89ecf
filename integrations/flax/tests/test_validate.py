"""Planner estimates against XLA on compiled twins trained through substrax's train step."""

import pytest
from flax_test_models import tokens  # noqa: F401  (imports the conftest device setup first)

import substrax_flax as sf
from substrax.planner import Hardware, Layout, Workload, architecture, plan

LAYOUTS = [Layout(fsdp=512, tp=8), Layout(dp=64), Layout(dp=8, fsdp=64), Layout(dp=64, tp=8)]


@pytest.mark.parametrize("name", ["llama3-8b", "gpt2-small"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_state_is_exact_and_flops_are_close_on_twins(name, layout):
    result = sf.validate_candidate(architecture(name), layout)
    estimate, compiled = result["state_bytes"]
    assert estimate == compiled
    estimate, compiled = result["arguments_bytes"]
    assert estimate == compiled
    estimate, compiled = result["flops"]
    assert abs(compiled / estimate - 1) < 0.05  # measured 2.2% to 4.4% over the estimate
    estimate, compiled = result["peak_bytes"]
    assert abs(compiled / estimate - 1) < 0.25  # measured -3.5% to +7.5%


@pytest.mark.parametrize("layout", [Layout(dp=64), Layout(dp=8, fsdp=64)], ids=str)
def test_fsdp_and_data_parallel_traffic_match_the_hlo(layout):
    estimate, compiled = sf.validate_candidate(architecture("llama3-8b"), layout)["traffic_bytes"]
    assert abs(compiled / estimate - 1) < 0.01


def test_twins_keep_the_kinds_of_parallelism():
    assert sf.twin_layout(Layout(fsdp=512, tp=8), 8) == Layout(fsdp=4, tp=2)
    assert sf.twin_layout(Layout(dp=8, fsdp=64), 8) == Layout(dp=2, fsdp=4)
    with pytest.raises(ValueError, match="does not twin pipeline layouts"):
        sf.twin_layout(Layout(pp=4, fsdp=128), 8)


def test_plan_validate_uses_the_ranked_candidate():
    workload = Workload(batch_tokens=2**20, seq=4096, microbatches=8)
    hardware = Hardware(memory_bytes=80 * 10**9)
    result = plan("llama3-8b", 64, hardware, workload, strategies=("dp", "fsdp", "tp"))
    comparison = result.validate(0)
    assert comparison["state_bytes"][0] == comparison["state_bytes"][1]
