"""Tags on parameters that the layers of tribucket agree on."""

from __future__ import annotations

import torch

#: set on parameters that are expert-parallel (each rank owns different values):
#: ``fused_bucketing`` neither verifies, broadcasts nor reduces them.
EXPERT_PARALLEL_ATTR = "_tribucket_expert_parallel"


def mark_expert_parallel(param: torch.Tensor) -> torch.Tensor:
    """Tag ``param`` as expert-parallel; the data-parallel reducer will leave it alone."""
    setattr(param, EXPERT_PARALLEL_ATTR, True)
    return param


def is_expert_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, EXPERT_PARALLEL_ATTR, False))
