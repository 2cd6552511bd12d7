"""The MoE layer on a GPU (one NCCL rank, in its own process): grouped and listed experts,
shared experts, sigmoid scores and the routing bias against the dense single-process
reference. Skipped without a CUDA device; ``make gpu-check`` runs it."""

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


def test_layer_matches_dense_reference_on_the_gpu(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "scripts" / "cuda_moe.py"),
                           str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert len(result["cases"]) == 3
    assert not result["failures"], "\n\n".join(result["failures"])
