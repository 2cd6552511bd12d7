"""Triton kernels and their PyTorch references, imported as ``tribucket.kernels``."""

from .moe import (
    moe_counts,
    moe_permute,
    moe_unpermute,
    moe_unpermute_backward,
    permute_tokens,
    unpermute_tokens,
)
from .moe_reference import (
    moe_counts_reference,
    moe_permute_reference,
    moe_unpermute_backward_reference,
    moe_unpermute_reference,
)
from .pack import BucketPlan, pack, unpack

__all__: list[str] = [
    "BucketPlan",
    "moe_counts",
    "moe_counts_reference",
    "moe_permute",
    "moe_permute_reference",
    "moe_unpermute",
    "moe_unpermute_backward",
    "moe_unpermute_backward_reference",
    "moe_unpermute_reference",
    "pack",
    "permute_tokens",
    "unpack",
    "unpermute_tokens",
]
