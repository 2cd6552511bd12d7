"""The MoE layer on a GPU (one NCCL rank, in its own process): grouped and listed experts,
shared experts, sigmoid scores, the routing bias and group limits against the
dense single-process reference (the deduplicated dispatch needs two ranks: not on one GPU);
and the host stalls of a step. Skipped without a CUDA device; ``make gpu-check`` runs it."""

from __future__ import annotations

import pytest

from _cuda import MARKS, run_script

pytestmark = MARKS


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return run_script("cuda_moe.py", tmp_path_factory.mktemp("cuda_moe"))


def test_layer_matches_dense_reference_on_the_gpu(result):
    # every feature ran on the device: shared experts, the bias, group limits
    ran = {k for case in result["cases"] for k in case}
    assert {"shared", "bias", "groups"} <= ran, ran
    assert not result["failures"], "\n\n".join(result["failures"])


def test_a_step_stalls_the_host_once(result):
    # the counts, which size the exchanges, are read once per forward; the expert-id range
    # check rides on that read, and the grouped matmul's offsets go up through pinned memory
    # (before: 5 stalls per step, 3 of them pageable copies of the offsets)
    assert result["host_syncs"] == 1, result["host_syncs"]
