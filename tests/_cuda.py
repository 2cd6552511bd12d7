"""What the GPU tests share: their marks, and running a script in a process of its own (one
NCCL process group per process) that writes ``OUT/result.json``."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent

#: ``pytestmark`` of a GPU test module: marked cuda (``make gpu-check`` selects it), skipped
#: without a device
MARKS = [pytest.mark.cuda,
         pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


def run_script(name: str, out: pathlib.Path, timeout: float = 300) -> dict:
    """Run ``tests/scripts/<name> OUT`` with the checkout importable; its ``result.json``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "scripts" / name), str(out)],
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "result.json").read_text())
