"""``bucket_cap_mb="auto"`` on a GPU (one NCCL rank, in its own process): the figures it
decides on hold the device's whole backward (a host that did not wait for the device would
see only its own launch time). Skipped without a CUDA device; ``make gpu-check`` runs it."""

from __future__ import annotations

import statistics

import pytest

from _cuda import MARKS, run_script

pytestmark = MARKS


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return run_script("cuda_autotune.py", tmp_path_factory.mktemp("cuda_autotune"))


def test_tuning_finishes_with_a_choice(result):
    assert result["done"] and result["choice"] in result["candidates"], result
    assert len(result["candidates"]) >= 2, result["candidates"]


def test_each_figure_is_the_devices_backward(result):
    # every backward holds a device-side wait of sleep_s that the host only enqueues: each
    # measured span must include it
    floor = 0.95 * result["sleep_s"]
    for candidate, samples in zip(result["candidates"], result["samples"]):
        assert samples and min(samples) >= floor, (
            f"candidate {candidate}: measured {samples} s, the device's backward takes at "
            f"least {result['sleep_s']:.4f} s (host figures: median "
            f"{statistics.median(result['host_s']):.4f} s)")
