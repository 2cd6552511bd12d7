"""``Join`` support for the reducer: uneven inputs, as ``DDP.join()``.

A rank that ran out of inputs keeps issuing the collectives one iteration of the others
issues, contributing zeros; when every rank has joined, the model of the last rank to join
(ties: the highest rank) is broadcast, as DDP does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook, Joinable

from ._pass import _BucketState, _Pass
from .comm import broadcast_coalesced

__all__ = ["JoinSupport"]


class JoinSupport(Joinable):
    """The ``Joinable`` half of :class:`tribucket.Reducer` (it supplies the state used here)."""

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """Shadow this reducer's collectives on ranks that ran out of inputs (``Join``).

        ``divide_by_initial_world_size`` (default ``True``, as DDP): divide gradients by the
        initial world size; ``False`` divides by the number of ranks still training.
        """
        if self.config.shard_optimizer:
            raise ValueError("Join (uneven inputs) is not supported with shard_optimizer=True: "
                             "a rank out of inputs would also have to shadow the sharded "
                             "optimizer's all-gathers; give every rank the same number of "
                             "batches (e.g. a DistributedSampler with drop_last=True)")
        return _ReducerJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self._device

    @property
    def join_process_group(self) -> Any:
        return self.process_group

    def _allreduce_flag(self, value: float, op=dist.ReduceOp.SUM) -> float:
        t = torch.tensor([value], device=self._device)
        work = dist.all_reduce(t, op=op, group=self.process_group, async_op=True)
        self._guard.wait(work, "a Join coordination allreduce", self._passes)
        return t.item()

    def _common_rank(self, candidate: bool) -> int:
        """The highest rank among the candidates (DDP's authoritative rank under Join)."""
        r = self._allreduce_flag(float(self.rank if candidate else -1), op=dist.ReduceOp.MAX)
        if r < 0:
            raise RuntimeError("Join: no rank is a candidate to hold the authoritative model")
        return int(r)

    def _shadow_iteration(self) -> None:
        """On a rank that ran out of inputs: issue the collectives one iteration of the
        others issues, contributing zeros (the reducer's ``JoinHook.main_hook``)."""
        if (self.config.broadcast_buffers and self._require_forward_param_sync
                and self._buffers and self.world_size > 1):
            src = self._common_rank(False)
            self._guard.fingerprint("buffers", self._passes, 0, len(self._buffers),
                                    None)
            broadcast_coalesced([b.detach() for _, b in self._buffers], src=src,
                                group=self._guard.group_arg())
        sync = self._allreduce_flag(0.0) != 0
        self._require_forward_param_sync = sync
        self._passes += 1
        if not sync:
            return
        if not self._allocated:
            self._allocate()
        p = _Pass(True, len(self._params), [len(b.indices) for b in self._layout.buckets])
        p.shadow = True
        for b, bucket in enumerate(self._layout.buckets):
            p.state[b] = _BucketState.LAUNCHED
            if bucket.sparse:
                param = self._bucket_params[b][0]
                self._launch_sparse(p, b, param)
                continue
            mem = self._mem[b]
            mem.active = buf = mem.active if mem.active is not None else mem._new_buffer()
            buf.zero_()
            self._send(p, b, buf, self._bucket_params[b], bucket)
        cfg = self.config
        used = self._local_used(p)
        # zeros plus the others' gradients: the results are discarded
        _, status, _ = self._exchange_status(p, 0, used)
        if used is not None and cfg.static_graph:
            self._static_used = (status[self.world_size + 1:] > 0).tolist()
        if cfg.static_graph and self._static_counts is None:
            self._static_counts = [1] * len(self._params)
        self.stats.iterations += 1
        if not self._rebuilt and not (cfg.find_unused_parameters and not cfg.static_graph) \
                and not (cfg.static_graph and self.stats.iterations < 2):
            self._rebuild(list(range(len(self._params))))


class _ReducerJoinHook(JoinHook):
    """``Join`` support: shadow the iteration on joined ranks, sync the model at the end."""

    def __init__(self, reducer: JoinSupport, divide_by_initial_world_size: bool):
        self.reducer = reducer
        reducer._divide_by_initial_world_size = bool(divide_by_initial_world_size)

    def main_hook(self) -> None:
        self.reducer._shadow_iteration()

    def post_hook(self, is_last_joiner: bool) -> None:
        # as DDP: the model of the last rank to join (ties: the highest rank) wins
        r = self.reducer
        src = r._common_rank(is_last_joiner)
        r._broadcast_states(src_rank=src, buffers=r.config.broadcast_buffers)
