"""The planner against published runs: its calibrated times, and memory that fits what ran."""

import pytest

from substrax.planner import HARDWARE, main
from substrax.planner._calibration import PUBLISHED, estimate, fit, ratios, summary
from substrax.planner._efficiency import CALIBRATED, CALIBRATION_RUNS, SPREAD, Efficiency


@pytest.fixture(scope="module")
def estimates():
    return [estimate(run) for run in PUBLISHED]


def test_the_estimates_are_a_forecast_of_what_the_published_runs_measured():
    stats = summary(ratios())
    assert 0.9 <= stats["median"] <= 1.1
    assert all(0.75 <= r <= 1.33 for r in ratios()), ratios()
    assert stats["spread"] <= SPREAD < stats["spread"] + 0.01  # printed rounded up
    assert len(PUBLISHED) == CALIBRATION_RUNS


def test_a_roofline_is_what_the_calibration_corrects():
    """Uncalibrated, every run is estimated far too fast (the planner's old median, 0.5)."""
    roofline = ratios(Efficiency())
    assert max(roofline) < 0.75


def test_the_shipped_efficiencies_are_the_fit():
    assert fit() == CALIBRATED
    assert HARDWARE["h100"].efficiency == HARDWARE["tpu-v5p"].efficiency == CALIBRATED


def test_every_published_run_fits_and_reported_memory_is_within_10_percent(estimates):
    for run, candidate in zip(PUBLISHED, estimates, strict=True):
        assert candidate.fits, run.name
        if run.reserved_gib:
            peak = candidate.bytes_per_device["peak"] / 2**30
            assert peak == pytest.approx(run.reserved_gib, rel=0.10), run.name


def test_the_command_line_prints_the_spread_and_explains_the_time(capsys):
    assert main(["--model", "llama3-8b", "--devices", "8", "--hardware", "h100", "--memory",
                 "96GB", "--batch-tokens", "131072", "--seq", "8192", "--remat", "selective",
                 "--microbatches", "1", "--strategies", "fsdp", "--explain"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("estimate: "))
    assert line.endswith(f"s per step (+-{SPREAD:.0%}, calibrated on {len(PUBLISHED)} published "
                         "runs; docs/planning.md)")  # fmt: skip
    parts = next(x for x in out.splitlines() if x.startswith("time: "))
    assert parts.startswith("time: compute ") and " attention " in parts
