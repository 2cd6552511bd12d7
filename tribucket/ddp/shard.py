"""Buckets that are reduce-scattered (``shard_optimizer=True``): each rank keeps only its
slice of the averaged bucket, for :class:`tribucket.ShardedOptimizer`.

A :class:`ShardedBucket` is a :class:`~tribucket.ddp.bucket.DenseBucket` whose
communication is a reduce-scatter of the packed, pre-divided bucket (padded to ``world``
equal slices, see ``tribucket._shard``) and whose end is to hand this rank's slice to the
:class:`ShardGrads` the optimizer reads, instead of lending the buffer back as ``.grad``.

What is kept: the full bucket buffer lives from the bucket's first gradient until its
reduce-scatter has completed (waited for when the next bucket is launched, or at the end of
backward); each parameter's ``.grad`` is released once copied into the bucket; what stays is
this rank's averaged slice of every bucket.
"""

from __future__ import annotations

import time

import torch

from .._shard import BucketShard, reduce_scatter_single
from .bucket import BucketState, Comm, DenseBucket
from .state import Pass
from .watchdog import CommGuard

__all__ = ["ShardAccess", "ShardGrads", "ShardedBucket"]


class ShardGrads:
    """What a sharded backward leaves for the optimizer."""

    __slots__ = ("shards", "used", "n_params")

    def __init__(self, n_buckets: int, n_params: int):
        self.n_params = n_params
        #: per bucket: this rank's slice of the averaged gradients (the sum over the
        #: synchronised backward passes since clear()), or None
        self.shards: list[torch.Tensor | None] = [None] * n_buckets
        #: per parameter: whether any rank used it in the last synchronised backward
        #: (find_unused_parameters/static_graph), else None (all used)
        self.used: list[bool] | None = None

    def add(self, b: int, out: torch.Tensor) -> None:
        old = self.shards[b]
        if old is None:
            self.shards[b] = out
        else:
            old.add_(out)  # two synchronised backward passes without zero_grad: a sum

    def clear(self) -> None:
        self.shards = [None] * len(self.shards)


class _ReduceScatter:
    """A bucket's reduce-scatter in flight; waiting frees the bucket's full buffer."""

    __slots__ = ("work", "out", "mem", "guard", "what", "iteration", "done")

    def __init__(self, work, out: torch.Tensor, mem, guard: CommGuard, what: str,
                 iteration: int):
        self.work, self.out, self.mem = work, out, mem  # work None: a world of one
        self.guard, self.what, self.iteration = guard, what, iteration
        self.done = False

    def wait(self) -> torch.Tensor:
        if not self.done:
            if self.work is not None:
                self.guard.wait(self.work, f"the reduce-scatter of {self.what}", self.iteration)
            mem = self.mem
            if mem.active is not None:
                mem.plan.forget(mem.body(mem.active))
            mem.reset()  # the full buffer is free: only the slice stays
            self.done = True
        return self.out


class ShardedBucket(DenseBucket):
    """A dense bucket reduce-scattered into this rank's slice (``shard_optimizer=True``)."""

    __slots__ = ("shard", "sink")

    def __init__(self, index: int, spec, params: list, is_last: bool, mem, shard: BucketShard,
                 sink: ShardGrads, prev: "DenseBucket | None"):
        super().__init__(index, spec, params, is_last, mem, [(len(params), spec.numel)],
                         None, prev)
        self.shard = shard  # this rank's slice of the bucket
        self.sink = sink    # where the averaged slice goes

    def communicate(self, p: Pass, comm: Comm, buf: torch.Tensor) -> None:
        """Reduce-scatter the packed (pre-divided) bucket; free the previous bucket's."""
        self.state, self.t_launch = BucketState.LAUNCHED, time.perf_counter()
        for q in self.params:
            q.grad = None  # its value is in the bucket; the bucket is not lent back
        out = torch.empty(self.shard.shard_numel, dtype=buf.dtype, device=buf.device)
        p.bytes += buf.numel() * buf.element_size()
        comm.guard.fingerprint("bucket", p.iteration, self.index, buf.numel(), buf.dtype)
        work = None
        if comm.world_size == 1:
            out.copy_(buf)
        else:
            work = reduce_scatter_single(out, buf, group=comm.guard.group, async_op=True)
        self.handle = _ReduceScatter(work, out, self.mem, comm.guard, self.describe(),
                                     p.iteration)
        prev = self.prev
        if prev is not None and prev.handle is not None:
            prev.handle.wait()  # at most two full buffers alive: this one and the next

    def finish(self, result: torch.Tensor, targets: list, all_targets: bool = False,
               stats: torch.Tensor | None = None) -> bool:
        """This rank's slice of the averaged bucket goes to the optimizer's shard gradients
        (no ``.grad`` is lent). Returns False: no epilogue figures come from a sharded bucket
        (``ShardedOptimizer.clip_grad_norm_`` computes the norm of the shards)."""
        self.sink.add(self.index, result)
        sink = self.sink
        if all_targets:
            sink.used = None
            return False
        if sink.used is None:  # every bucket of the pass writes its parameters' flags
            sink.used = [True] * sink.n_params
        for i, t in zip(self.indices, targets):
            sink.used[i] = bool(t)
        return False


class ShardAccess:
    """The reducer's ``shard_optimizer=True`` API (for :class:`tribucket.ShardedOptimizer`):
    reads its :class:`~tribucket.ddp.backward.Backward` (``self._bw``) and nothing else."""

    @property
    def shards(self) -> list:
        """This rank's slice of every bucket (``shard_optimizer=True`` only)."""
        if self._bw.shards is None:
            raise RuntimeError("this reducer does not shard: pass shard_optimizer=True to "
                               "fused_bucketing (or Reducer)")
        return self._bw.shards

    @property
    def grad_shards(self) -> list[torch.Tensor | None]:
        """Per bucket: this rank's slice of the averaged gradients (the sum over the
        synchronised backward passes since :meth:`clear_grad_shards`), ``None`` if none."""
        return self._bw.shard_grads.shards

    @property
    def shard_used(self) -> list[bool] | None:
        """Per parameter: whether any rank used it in the last synchronised backward
        (``find_unused_parameters``/``static_graph``), else ``None`` (all used)."""
        return self._bw.shard_grads.used

    def clear_grad_shards(self) -> None:
        """Drop the gradient slices (``ShardedOptimizer.zero_grad``), and the finished
        reduce-scatters that produced them (each holds its slice until the next backward)."""
        self._bw.shard_grads.clear()
        for bucket in self._bw.buckets:
            if isinstance(bucket.handle, _ReduceScatter) and bucket.handle.done:
                bucket.handle = None
