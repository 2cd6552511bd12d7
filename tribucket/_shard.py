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


class _ShardWork:
    """A bucket's reduce-scatter in flight, and the shard it writes."""

    __slots__ = ("work", "out", "collected")

    def __init__(self, work, out: torch.Tensor):
        self.work = work        # the async reduce-scatter (None: world of one)
        self.out = out          # this rank's shard of the averaged bucket
        self.collected = False  # waited for, and the full bucket buffer released

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()


class ShardSupport:
    """The reduce-scatter half of :class:`tribucket.Reducer` under ``shard_optimizer=True``
    (it supplies the state used here: layout, memory, guard, parameters).

    What is kept: the full bucket buffer exists only from the bucket's first gradient until
    its reduce-scatter has completed (waited for when the next bucket is launched, or at
    the end of backward); each parameter's ``.grad`` is released as soon as it is copied into the
    bucket; what stays is this rank's averaged shard of every bucket (``grad_shards``).
    """

    #: wait for (and free the full buffer of) bucket ``b - _RELEASE_LAG`` when bucket ``b``
    #: is launched: at most this many full buckets (plus the one being filled) are alive
    _RELEASE_LAG = 1

    def _init_shards(self) -> None:
        if not self.config.shard_optimizer:
            self._shards = None
            return
        sparse = [self._names[i] for i, s in enumerate(self._expect_sparse) if s]
        if sparse:
            raise ValueError(f"shard_optimizer=True does not support sparse gradients "
                             f"(parameters {sparse} come from Embedding(sparse=True)); use "
                             "dense embeddings or ignore_parameters for them")
        align = self._align_bytes()  # (GPU: 16 bytes) fixed now: the shards follow it
        if align != self._layout.align_bytes:
            encoded = self._layout.to_tensor().clone()
            encoded[2] = align
            self._layout = BucketLayout.from_tensor(encoded, self._params)
        self._shards = shard_buckets(self._layout, self.world_size, self.rank)
        self._grad_shards: list[torch.Tensor | None] = [None] * len(self._shards)
        self._shard_used: list[bool] | None = None

    # ------------------------------------------------------------------ for the optimizer
    @property
    def shards(self) -> list[BucketShard]:
        """This rank's slice of every bucket (``shard_optimizer=True`` only)."""
        if self._shards is None:
            raise RuntimeError("this reducer does not shard: pass shard_optimizer=True to "
                               "fused_bucketing (or Reducer)")
        return self._shards

    @property
    def averaged_parameters(self) -> list[torch.Tensor]:
        """The parameters this reducer averages; the layout's indices point into it."""
        return list(self._params)

    @property
    def device(self) -> torch.device:
        """The device of the averaged parameters."""
        return self._device

    @property
    def grad_shards(self) -> list[torch.Tensor | None]:
        """Per bucket: this rank's shard of the averaged gradients (the sum over the
        synchronised backward passes since :meth:`clear_grad_shards`), ``None`` if none."""
        return self._grad_shards

    @property
    def shard_used(self) -> list[bool] | None:
        """Per parameter: whether any rank used it in the last synchronised backward
        (``find_unused_parameters``/``static_graph``), else ``None`` (all used)."""
        return self._shard_used

    def clear_grad_shards(self) -> None:
        """Drop the gradient shards (``zero_grad``)."""
        self._grad_shards = [None] * len(self._shards)

    # ------------------------------------------------------------------ backward
    def _shard_pad(self, b: int) -> int:
        """Elements after bucket ``b`` that pad it to ``world`` equal shards."""
        if self._shards is None:
            return 0
        return self._shards[b].padded_numel - self._shards[b].numel

    def _send_shard(self, p, b: int, buf: torch.Tensor) -> None:
        """Reduce-scatter the packed (pre-divided) bucket ``b``; free bucket
        ``b - _RELEASE_LAG``'s buffer."""
        for q in self._bucket_params[b]:
            q.grad = None  # its value is in the bucket; the bucket is not lent back
        shard = self._shards[b]
        out = torch.empty(shard.shard_numel, dtype=buf.dtype, device=buf.device)
        p.bytes += buf.numel() * buf.element_size()
        self._guard.fingerprint("bucket", self._passes, b, buf.numel(), buf.dtype)
        if self.world_size == 1:
            out.copy_(buf)
            work = None
        else:
            work = reduce_scatter_single(out, buf, group=self._guard.group,
                                              async_op=True)
        p.handles[b] = _ShardWork(work, out)
        if b >= self._RELEASE_LAG:
            self._collect_shard(p, b - self._RELEASE_LAG)

    def _collect_shard(self, p, b: int) -> torch.Tensor:
        h = p.handles[b]
        if not h.collected:
            if h.work is not None:
                bucket = self._layout.buckets[b]
                self._guard.wait(h.work, f"the reduce-scatter of bucket {b} "
                                 f"({len(bucket.indices)} tensors, {bucket.numel} elements)",
                                 self._passes)
            mem = self._mem[b]
            if mem.active is not None:
                mem.plan.forget(mem.body(mem.active))
            mem.reset()  # the full buffer is free: only the shard stays
            h.collected = True
        return h.out

    def _finish_shards(self, results: list, global_used) -> None:
        """End of backward: keep (or add to) each bucket's shard of the average."""
        self._shard_used = None if global_used is None else list(global_used)
        for b, out in enumerate(results):
            old = self._grad_shards[b]
            if old is None:
                self._grad_shards[b] = out
            else:
                old.add_(out)  # two synchronised backward passes without zero_grad: a sum
