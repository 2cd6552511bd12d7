"""Building the buckets of a layout: each bucket's memory, chunk bounds and wire dtype.

Called by :meth:`tribucket.ddp.backward.Backward.allocate` at the first backward and after
every rebuild; every input is passed in, the result is the list of buckets and the
parameter -> (bucket, position) table the per-gradient hook reads.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..config import ReducerConfig
from ..layout import Bucket, BucketLayout
from .bucket import Comm, DenseBucket, SparseBucket
from .memory import BucketMemory
from .rebuild import DDP_ALIGN_BYTES
from .shard import ShardedBucket, ShardGrads

__all__ = ["align_bytes", "build_buckets", "wire_dtype"]

# Alignment of each gradient inside a bucket for tribucket's own paths on GPU (16 bytes lets
# the kernels use 128-bit accesses). Generic comm hooks, and the CPU, get DDP's unpadded
# buffers.
_ALIGN_BYTES = 16

#: CPU, ``pack_on_ready=None``: a bucket whose gradients average at least this many bytes
#: copies each gradient in as it becomes ready (it is still in cache, and the bucket is
#: packed when its last gradient lands); a bucket of smaller ones is packed in one call when
#: complete (per-gradient Python work costs more than the cache saves).
_EAGER_MIN_BYTES = 64 * 1024


def align_bytes(traits, device: torch.device) -> int:
    """Padding only helps the GPU kernels; generic hooks get DDP's unpadded buffers."""
    if traits.builtin and device.type == "cuda":
        return _ALIGN_BYTES
    return DDP_ALIGN_BYTES


def wire_dtype(traits, bucket_dtype: torch.dtype) -> torch.dtype:
    """The dtype a bucket travels in: the hook's compression dtype for floating buckets."""
    wire = traits.wire_dtype
    if wire is not None and bucket_dtype in (torch.float32, torch.float16, torch.bfloat16):
        return wire
    return bucket_dtype


def eager_pack(config: ReducerConfig, spec: Bucket, device: torch.device) -> bool:
    """Whether this bucket copies each gradient in as it becomes ready (see
    ``ReducerConfig.pack_on_ready``): on CPU, buckets of large gradients."""
    if config.pack_on_ready is not None:
        return config.pack_on_ready
    if device.type != "cpu":
        return False  # GPU: one fused pack launch per complete bucket
    return spec.payload_bytes >= _EAGER_MIN_BYTES * max(1, len(spec.indices))


def build_buckets(config: ReducerConfig, layout: BucketLayout, params: list[torch.Tensor],
                  names: list[str], comm: Comm, device: torch.device, status_len: int,
                  piggyback: bool, shards: list | None, shard_grads: ShardGrads | None,
                  write_status_tail) -> tuple[list, list]:
    """The buckets of ``layout`` and, per parameter, ``(its bucket, position in it)``.

    ``piggyback``: the last bucket's buffer has a tail of ``status_len`` elements that
    ``write_status_tail(pass, buffer)`` fills. ``shards``: ``shard_optimizer`` slices (each
    bucket padded to equal slices)."""
    buckets, slot, prev = [], [None] * len(params), None
    specs = layout.buckets
    for b, spec in enumerate(specs):
        bparams = [params[i] for i in spec.indices]
        last = b == len(specs) - 1
        if spec.sparse:
            bucket = SparseBucket(b, spec, bparams, last, names[spec.indices[0]])
        else:
            plan = kernels.BucketPlan(spec.sizes, spec.offsets, spec.numel, spec.device)
            tail = status_len if piggyback and last else 0
            if shards is not None:  # padding to equal slices
                tail = shards[b].padded_numel - spec.numel
            mem = BucketMemory(spec, bparams, wire_dtype(comm.traits, spec.dtype), plan,
                               always_view=config.gradient_as_bucket_view,
                               eager=eager_pack(config, spec, device), tail=tail,
                               # the sharded optimizer's flat parameters are in logical order
                               memory_order=shards is None)
            if config.gradient_as_bucket_view and any(q.grad is not None for q in bparams):
                # (rebuild) carry the accumulated gradients over and view the new bucket
                buf = mem.pack([q.grad for q in bparams], 1.0)
                mem.finish(buf, [q.grad is not None for q in bparams])
            if shards is not None:
                bucket = ShardedBucket(b, spec, bparams, last, mem, shards[b], shard_grads,
                                       prev)
            else:
                bucket = DenseBucket(b, spec, bparams, last, mem,
                                     mem.chunk_bounds(config.comm_chunk_mb,
                                                      comm.traits.chunkable),
                                     write_status_tail if tail else None, prev)
        for k, i in enumerate(spec.indices):
            slot[i] = (bucket, k)
        buckets.append(bucket)
        prev = bucket
    return buckets, slot
