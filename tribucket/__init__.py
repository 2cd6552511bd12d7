"""tribucket: gradient bucketing and communication runtime for PyTorch.

Triton kernels do the memory work (``tribucket.kernels``), ``torch.distributed`` does the
communication, and a Python reducer (``fused_bucketing``) and an MoE dispatcher
(``tribucket.moe``) orchestrate them. See the README and docs/ for the user guide.
"""

from __future__ import annotations

from . import amp, hooks
from ._env import nccl_version
from .clip import clip_grad_norm_
from .config import ReducerConfig
from .grad_bucket import GradBucket
from .layout import NO_CAP, Bucket, BucketLayout, TensorSpec, compute_layout
from .ddp import Reducer, ReducerStats, fused_bucketing
from .parallel import DistributedDataParallel
from .zero import ShardedOptimizer

__version__ = "0.1.0"

__all__ = [
    "Bucket",
    "BucketLayout",
    "DistributedDataParallel",
    "GradBucket",
    "NO_CAP",
    "Reducer",
    "ReducerConfig",
    "ReducerStats",
    "ShardedOptimizer",
    "TensorSpec",
    "amp",
    "clip_grad_norm_",
    "compute_layout",
    "fused_bucketing",
    "hooks",
    "nccl_version",
]
