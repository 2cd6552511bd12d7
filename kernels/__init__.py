"""Triton kernels and their PyTorch references, imported as ``tribucket.kernels``.

Pack a bucket's tensors into one flat buffer (scale and cast fused in) and unpack it back::

    from tribucket import kernels

    plan = kernels.BucketPlan(sizes, offsets, numel, device)   # once per bucket layout
    plan.pack(grads, buffer, scale=1 / world, found_inf=flag)   # one launch on CUDA
    plan.unpack(buffer, grads)

``kernels.pack`` / ``kernels.unpack`` do the same without holding a plan (plans are cached
by layout). ``kernels.reference`` holds the plain-PyTorch specification of each contract.
The MoE kernels (``moe_*``, ``permute_tokens``, ``unpermute_tokens``) route tokens to
experts. Importing this package never needs triton.
"""

from . import reference
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
from .pack import BACKENDS, BLOCK, BucketPlan, pack, triton_available, unpack
from .reference import pack_reference, unpack_reference

__all__ = [
    "BACKENDS",
    "BLOCK",
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
    "pack_reference",
    "permute_tokens",
    "reference",
    "triton_available",
    "unpack",
    "unpack_reference",
    "unpermute_tokens",
]
