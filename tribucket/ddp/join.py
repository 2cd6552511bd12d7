"""``Join`` support for the reducer: uneven inputs, as ``DDP.join()``.

A rank that ran out of inputs keeps issuing the collectives one iteration of the others
issues, contributing zeros (the reducer's ``shadow_iteration``); when every rank has joined,
the model of the last rank to join (ties: the highest rank) is broadcast, as DDP does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook

from .watchdog import CommGuard

__all__ = ["JoinFlags", "ReducerJoinHook", "refuse_join_with_experts"]


def refuse_join_with_experts(module) -> None:
    """Raise ``ValueError`` (before any collective) when ``module`` has expert-parallel
    parameters whose layers communicate, or that have replicas: ``Join`` cannot shadow those."""
    from .._tags import expert_group, expert_replica_group, is_expert_parallel

    experts = [(n, p) for n, p in module.named_parameters() if is_expert_parallel(p)]
    exchanging = [n for n, p in experts if dist.get_world_size(expert_group(p)) > 1]
    replicated = [n for n, p in experts if expert_replica_group(p) is not None]
    if not exchanging and not replicated:
        return
    why = (f"its MoE layers exchange tokens among the ranks of their expert-parallel group "
           f"(e.g. for {exchanging[0]!r}), so a rank out of inputs would still have to run "
           "them for the other ranks' tokens" if exchanging else
           f"expert replicas (e.g. {replicated[0]!r}) are averaged by reducers of their own, "
           "whose collectives a rank out of inputs would have to shadow too")
    raise ValueError(
        f"Join (uneven inputs) is not supported for a model with expert-parallel MoE layers: "
        f"{why}. Give every rank the same number of batches (e.g. a DistributedSampler with "
        "drop_last=True, or stop every rank at the shortest rank's count).")


class JoinFlags:
    """The small allreduces that coordinate ranks under ``Join``."""

    def __init__(self, process_group, device: torch.device, rank: int, guard: CommGuard):
        self.process_group, self.device, self.rank, self.guard = process_group, device, rank, guard
        #: Join(divide_by_initial_world_size=...): divide by the initial world size (True, as
        #: DDP) or by the ranks still training
        self.divide_by_initial_world_size = True

    def divisor(self, work, world_size: int, iteration: int, active: float | None = None) -> int:
        """What a pass divides by: the world size, or under
        ``Join(divide_by_initial_world_size=False)`` the ranks still training: the count the
        join notification allreduce ``work`` produced (torch runs it for the first joinable
        of a Join only), else ``active``, the sum of the forward's sync flags."""
        if self.divide_by_initial_world_size:
            return world_size
        if work is not None:
            self.guard.wait(work, "the Join notification", iteration)
            return max(1, int(work.result()[0].item()))
        return world_size if active is None else max(1, round(active))

    def allreduce(self, value: float, iteration: int, op=dist.ReduceOp.SUM) -> float:
        t = torch.tensor([value], device=self.device)
        work = dist.all_reduce(t, op=op, group=self.process_group, async_op=True)
        self.guard.wait(work, "a Join coordination allreduce", iteration)
        return t.item()

    def common_rank(self, candidate: bool, iteration: int) -> int:
        """The highest rank among the candidates (DDP's authoritative rank under Join)."""
        r = self.allreduce(float(self.rank if candidate else -1), iteration,
                           op=dist.ReduceOp.MAX)
        if r < 0:
            raise RuntimeError("Join: no rank is a candidate to hold the authoritative model")
        return int(r)


class ReducerJoinHook(JoinHook):
    """``Join`` support: shadow the iteration on joined ranks, sync the model at the end."""

    def __init__(self, reducer: Any, divide_by_initial_world_size: bool):
        self.reducer = reducer
        reducer._join_flags.divide_by_initial_world_size = bool(divide_by_initial_world_size)

    def main_hook(self) -> None:
        self.reducer._forward.shadow_iteration()

    def post_hook(self, is_last_joiner: bool) -> None:
        # as DDP: the model of the last rank to join (ties: the highest rank) wins
        r = self.reducer
        r._bw.forwards = 0  # joined ranks ran fewer steps: count steps afresh from here
        r._bw.opt_base = r._bw.opt_steps
        src = r._join_flags.common_rank(is_last_joiner, r._bw.passes)
        r._broadcast_states(src_rank=src, buffers=r.config.broadcast_buffers)
