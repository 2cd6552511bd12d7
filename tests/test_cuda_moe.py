"""The MoE layer on a GPU (one NCCL rank, in its own process): grouped and listed experts,
shared experts, sigmoid scores and the routing bias against the dense single-process
reference; and the host stalls of a step. Skipped without a CUDA device; ``make gpu-check``
runs it."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("cuda_moe")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "scripts" / "cuda_moe.py"),
                           str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((tmp_path / "result.json").read_text())


def test_layer_matches_dense_reference_on_the_gpu(result):
    assert len(result["cases"]) == 3
    assert not result["failures"], "\n\n".join(result["failures"])


def test_a_step_stalls_the_host_once(result):
    # the counts, which size the exchanges, are read once per forward; the expert-id range
    # check rides on that read, and the grouped matmul's offsets go up through pinned memory
    # (before: 5 stalls per step, 3 of them pageable copies of the offsets)
    assert result["host_syncs"] == 1, result["host_syncs"]
