"""Shards of the gradient buckets: which slice of each bucket a rank owns (pure data).

A sharded optimizer (ZeRO-1/2) splits every bucket of the reducer's layout into ``world``
equal, contiguous slices; rank ``r`` owns ``[r * S, (r + 1) * S)`` of the bucket's flat
buffer, padded at the end so that ``world * S >= numel``. ``S`` is a multiple of
``SHARD_ALIGN`` elements so every shard starts on an aligned address. The reducer
reduce-scatters each bucket into these slices; the optimizer steps them; an all-gather of
the slices rebuilds the bucket.

Example: a bucket of two tensors of 3 and 70 elements (offsets 0 and 3, 73 elements) on two
ranks gets ``S = 64`` (73 / 2 rounded up to 64): rank 0 owns elements ``[0, 64)``, i.e.
tensor 0 whole and ``[0, 61)`` of tensor 1; rank 1 owns ``[64, 128)``: ``[61, 70)`` of
tensor 1 then 55 padding elements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .layout import BucketLayout

__all__ = ["SHARD_ALIGN", "Piece", "BucketShard", "shard_buckets"]

# torch 2.13 renamed reduce_scatter_tensor / all_gather_into_tensor (the old names warn)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or \
    dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

#: elements per shard are a multiple of this: 256 bytes of fp32, so a shard and each
#: rank's slice of the padded bucket start on an address any kernel can vectorise over
SHARD_ALIGN = 64


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that lies in a rank's shard of a bucket."""

    #: index of the parameter in the reducer's parameter list
    param: int
    #: first element of the parameter (flattened) in the shard
    param_start: int
    #: where that element sits in the shard
    shard_start: int
    #: elements
    length: int


@dataclass(frozen=True)
class BucketShard:
    """One rank's slice of one bucket."""

    #: bucket index in the layout
    index: int
    #: elements of the bucket (alignment padding between tensors included)
    numel: int
    #: elements of every rank's shard (``S``)
    shard_numel: int
    rank: int
    world: int
    dtype: torch.dtype
    #: the parameters overlapping this rank's slice, in bucket order
    pieces: tuple[Piece, ...]

    @property
    def lo(self) -> int:
        """First bucket element of this rank's shard."""
        return self.rank * self.shard_numel

    @property
    def padded_numel(self) -> int:
        """Elements of the bucket buffer padded to ``world`` equal shards."""
        return self.world * self.shard_numel


def shard_buckets(layout: BucketLayout, world: int, rank: int,
                  align: int = SHARD_ALIGN) -> list[BucketShard]:
    """Cut every bucket of ``layout`` into ``world`` equal slices; return ``rank``'s."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world} ranks")
    out = []
    for b, bucket in enumerate(layout.buckets):
        per_rank = -(-bucket.numel // world)
        s = max(align, -(-per_rank // align) * align)
        lo, hi = rank * s, (rank + 1) * s
        pieces = []
        for i, off, n in zip(bucket.indices, bucket.offsets, bucket.sizes):
            a, z = max(off, lo), min(off + n, hi)
            if a < z:
                pieces.append(Piece(i, a - off, a - lo, z - a))
        out.append(BucketShard(b, bucket.numel, s, rank, world, bucket.dtype, tuple(pieces)))
    return out


# gradient dtypes whose norm torch takes in float64
WIDE = (torch.float64, torch.complex128)


def norm_dtype(grads) -> torch.dtype:
    """The dtype a gradient norm is accumulated in: float64 if any gradient is float64
    (or complex128), as torch's ``clip_grad_norm_`` gives it, else float32."""
    return torch.float64 if any(g.dtype in WIDE for g in grads) else torch.float32


def slices_partial(grads: list[torch.Tensor], norm_type: float,
                   device: torch.device) -> torch.Tensor:
    """``sum |g|^p`` (``max |g|`` for ``p = inf``) over this rank's gradient slices, an fp32
    scalar (fp64 when a slice is, as torch's clip takes their norm); their padding is zero,
    so it adds nothing."""
    acc = norm_dtype(grads)
    local = torch.zeros((), dtype=acc, device=device)
    for g in grads:
        n = torch.linalg.vector_norm(g, norm_type, dtype=acc)
        local = torch.maximum(local, n) if math.isinf(norm_type) else local + n ** norm_type
    return local


def clip_slices_(grads: list[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
    """Scale the slices by torch's clip factor ``min(1, max_norm / (total + 1e-6))``."""
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
