"""Coalesced broadcast of many tensors of any dtype (model states on entering the reducer)."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from .. import kernels
from ..layout import compute_layout

__all__ = ["broadcast_coalesced", "BROADCAST_BUCKET_BYTES"]

#: bytes per coalesced broadcast: torch DDP's ``_DEFAULT_BROADCAST_BUCKET_SIZE`` (250 MiB)
BROADCAST_BUCKET_BYTES = 250 * 2**20
#: broadcasts in flight at once, as DDP's ``_broadcast_coalesced`` (bounds the extra memory)
_MAX_IN_FLIGHT = 2


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers a gap-free, non-overlapping block of memory in some dim order."""
    expected = 1
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _flat_memory(t: torch.Tensor) -> torch.Tensor | None:
    """A 1-D view of ``t``'s memory (channels_last and other dense layouts included); None
    when it has gaps or overlaps (a slice of a larger tensor)."""
    if t.is_contiguous():
        return t.view(-1)
    if not _dense(t):
        return None
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def broadcast_coalesced(tensors: Sequence[torch.Tensor], src: int = 0,
                        group: dist.ProcessGroup | None = None,
                        bucket_bytes: int = BROADCAST_BUCKET_BYTES) -> None:
    """Overwrite ``tensors`` on every rank with ``src``'s values, a few flat buffers at a time.

    Tensors are grouped by (dtype, device) into buffers of at most ``bucket_bytes`` (one
    tensor larger than that goes alone), packed with one kernel launch per buffer (bit-exact
    for any dtype: int64 counters, fp64, bool...), broadcast with at most two broadcasts in
    flight, and unpacked. A tensor whose memory has gaps (a slice of a larger one) travels
    as a dense copy, copied back at the end. ``src`` is a rank of ``group``.
    """
    if dist.get_world_size(group) == 1:
        return
    flat, gapped = [], []  # gapped: (tensor, the dense copy that travels for it)
    for t in tensors:
        if t.numel() == 0:
            continue
        view = _flat_memory(t)
        if view is None:
            view = t.detach().reshape(-1).clone()
            gapped.append((t, view))
        flat.append(view)
    tensors = flat
    if not tensors:
        return
    # every rank holds the same strides (the reducer verifies them), so broadcasting the
    # memory order moves every element to its place
    is_src = dist.get_rank(group) == src
    global_src = dist.get_global_rank(group, src) if group is not None else src
    layout = compute_layout(tensors, bucket_cap_bytes=bucket_bytes,
                            first_bucket_cap_bytes=bucket_bytes, align_bytes=1)
    in_flight: list[tuple] = []

    def finish(entry) -> None:
        work, buf, plan, members = entry
        work.wait()
        if not is_src:
            plan.unpack(buf, members)

    for bucket in layout.buckets:
        members = [tensors[i] for i in bucket.indices]
        plan = kernels.BucketPlan(bucket.sizes, bucket.offsets, bucket.numel, bucket.device)
        buf = torch.empty(bucket.numel, dtype=bucket.dtype, device=bucket.device)
        if is_src:
            plan.pack([t.detach() for t in members], buf)
        if len(in_flight) == _MAX_IN_FLIGHT:
            finish(in_flight.pop(0))
        work = dist.broadcast(buf, global_src, group=group, async_op=True)
        in_flight.append((work, buf, plan, [t.detach() for t in members]))
    for entry in in_flight:
        finish(entry)
    if not is_src:
        for t, copy in gapped:
            t.detach().copy_(copy.view(t.shape))
