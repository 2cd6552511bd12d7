"""tribucket: gradient bucketing and communication runtime for PyTorch.

Triton kernels do the memory work (``tribucket.kernels``), ``torch.distributed`` does the
communication, and a Python reducer (``fused_bucketing``) and an MoE dispatcher
(``tribucket.moe``) orchestrate them. See the README for the user guide.
"""

from __future__ import annotations

from ._env import nccl_version
from .layout import NO_CAP, Bucket, BucketLayout, TensorSpec, compute_layout

__version__ = "0.1.0"

__all__ = [
    "Bucket",
    "BucketLayout",
    "NO_CAP",
    "TensorSpec",
    "compute_layout",
    "nccl_version",
]
