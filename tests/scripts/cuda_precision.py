"""The epilogue and the entry checks on a CUDA device, one NCCL rank: ``clip_grad_norm_`` and
the GradScaler against torch's after DDP, and a parameter's dtype or device changed inside
``fused_bucketing``. Run by ``tests/test_cuda_precision.py`` in its own process (a NCCL
process group per process)::

    python tests/scripts/cuda_precision.py OUT_DIR [cpu]

``cpu`` runs the same on the CPU with gloo (to try the script on a machine without a GPU).
Writes ``OUT_DIR/result.json``, each case's result as the CPU tests' workers return it
(``tests/test_precision.py``, ``tests/test_failure_modes.py``), asserted by the same checks.
"""

from __future__ import annotations

import json
import pathlib
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from test_failure_modes import _retyped_after_entering  # noqa: E402
from test_precision import _clip_bits, _clip_vs_torch, _scaler_vs_torch  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CLIP = [("mlp", "fp32", None), ("transformer", "fp32", None), ("mlp", "fp16", None),
        ("mlp", "fp32", True)]
SCALER = [("float16", "unscale + clip"), ("float16", "unscale"),
          ("float16", "fused optimizer"), ("bfloat16", "unscale + clip")]
RETYPED = ["double", "half_float", "cpu", "layer_find_unused"]


def _case(fn, *args):
    """``{"ok": result}`` or ``{"error": message}``: one case's failure leaves the others."""
    try:
        return {"ok": fn(*args)}
    except Exception as e:  # noqa: BLE001 - reported to the test, which fails on it
        return {"error": f"{type(e).__name__}: {e}"}


def main(out_dir: str, device: str = "cuda") -> None:
    out = pathlib.Path(out_dir)
    kw = dict(device_id=torch.device("cuda", 0)) if device == "cuda" else {}
    dist.init_process_group("nccl" if device == "cuda" else "gloo",
                            init_method=f"file://{out / 'store'}", rank=0, world_size=1, **kw)
    if device == "cuda":
        torch.cuda.set_device(0)
    result = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
              "torch": torch.__version__}
    for name, dtype in DTYPES.items():
        result[f"clip bits {name}"] = _case(_clip_bits, dtype, device)
    for name, wire, eager in CLIP:
        result[f"clip {name} {wire} {eager}"] = _case(_clip_vs_torch, name, wire, eager, device)
    for dtype, mode in SCALER:
        result[f"scaler {dtype} {mode}"] = _case(_scaler_vs_torch, DTYPES[dtype], mode, device)
    for change in RETYPED:
        if change == "cpu" and device == "cpu":
            continue
        for native in (None, False):
            result[f"retyped {change} {native}"] = _case(_retyped_after_entering, change,
                                                         native, device)
    dist.destroy_process_group()
    (out / "result.json").write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main(*sys.argv[1:])
