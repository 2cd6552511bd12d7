"""The epilogue and the entry checks on a GPU (one NCCL rank, in its own process), with the
CPU tests' workers and assertions: ``tribucket.clip_grad_norm_`` equal to torch's clip after
DDP bit for bit in float32, bfloat16 and float16 (a NaN norm, a subset, a parameter named
twice), and against torch's on the fp16 wire and the transformer; the GradScaler's loss scales
and parameters as torch's, with no second inf scan; and a parameter's dtype or device
(``model.cpu()``) changed inside ``fused_bucketing`` named at the next forward. Skipped
without a CUDA device; ``make gpu-check`` runs it."""

from __future__ import annotations

import pytest
import torch

from _cuda import MARKS, run_script
from test_failure_modes import check_retyped
from test_precision import check_clip_vs_torch, check_scaler_vs_torch

pytestmark = MARKS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return run_script("cuda_precision.py", tmp_path_factory.mktemp("cuda_precision"))


def _ok(result, key):
    r = result[key]
    assert "error" not in r, f"{key}: {r.get('error')}"
    return r["ok"]


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_clip_is_torchs_to_the_bit_on_the_gpu(result, dtype):
    steps = _ok(result, f"clip bits {dtype}")
    assert len(steps) == 16 and [s for s in steps if not (s[1] and s[2])] == []


@pytest.mark.parametrize("name,wire,eager", [("mlp", "fp32", None), ("transformer", "fp32", None),
                                             ("mlp", "fp16", None), ("mlp", "fp32", True)])
def test_clip_grad_norm_equals_torch_on_the_gpu(result, name, wire, eager):
    check_clip_vs_torch(*_ok(result, f"clip {name} {wire} {eager}"))


@pytest.mark.parametrize("dtype,mode", [("float16", "unscale + clip"), ("float16", "unscale"),
                                        ("float16", "fused optimizer"),
                                        ("bfloat16", "unscale + clip")])
def test_grad_scaler_matches_torch_on_the_gpu(result, dtype, mode):
    check_scaler_vs_torch(DTYPES[dtype], *_ok(result, f"scaler {dtype} {mode}"))


@pytest.mark.parametrize("native", [None, False], ids=["default", "python_hooks"])
@pytest.mark.parametrize("change", ["double", "half_float", "cpu", "layer_find_unused"])
def test_dtype_or_device_changed_after_entering_is_named_on_the_gpu(result, change, native):
    check_retyped(change, *_ok(result, f"retyped {change} {native}"))
