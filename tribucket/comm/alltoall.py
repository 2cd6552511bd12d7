"""Uneven all-to-all with autograd, the counts exchange in front of it, and error agreement.

All three are collectives on ``group`` (the default world when ``None``): every rank of the
group must call them in the same order. With one rank (or ``torch.distributed`` not
initialised) they are local no-ops, so single-process code runs unchanged.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

__all__ = ["all_to_all", "all_to_all_beside", "exchange_counts", "finish_exchange",
           "ranks_reporting", "group_rank_and_size", "set_failure_handler", "start_exchange"]

# id(group) -> (group, handler(group, error) -> the exception to raise instead, or None);
# the group is kept so that its id stays its own
_FAILURE_HANDLERS: dict[int, tuple] = {}


def set_failure_handler(group: dist.ProcessGroup | None,
                        handler: Callable[[object, BaseException], BaseException | None]) -> None:
    """Let ``handler`` explain a failed exchange on ``group`` (it returns the exception to
    raise instead, or None to keep the original): how an MoE layer names itself and its
    phase when an all-to-all of its backward fails, where no code of the layer runs."""
    _FAILURE_HANDLERS[id(group)] = (group, handler)


def group_rank_and_size(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """``(rank in group, group size)``; ``(0, 1)`` when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("a process group was given but torch.distributed is not initialised")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _exchange(x: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
              group: dist.ProcessGroup | None) -> torch.Tensor:
    out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
    try:
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=list(recv_splits),
                               input_split_sizes=list(send_splits), group=group)
    except Exception as error:
        _explain(group, error)
    return out


def _explain(group: dist.ProcessGroup | None, error: BaseException):
    """Re-raise ``error`` as the group's failure handler explains it (or as it is)."""
    entry = _FAILURE_HANDLERS.get(id(group))
    better = entry[1](group, error) if entry is not None else None
    if better is None:
        raise error
    raise better from error


def start_exchange(x: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
                   group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, object]:
    """:func:`all_to_all` without waiting (no autograd): ``(out, work)``; ``out`` holds the
    rows once :func:`finish_exchange` of ``work`` returns. Compute issued in between runs
    while the rows travel (gloo moves them on its own threads)."""
    out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
    try:
        work = dist.all_to_all_single(out, x.contiguous(), output_split_sizes=list(recv_splits),
                                      input_split_sizes=list(send_splits), group=group,
                                      async_op=True)
    except Exception as error:
        _explain(group, error)
    return out, work


def finish_exchange(work, group: dist.ProcessGroup | None = None) -> None:
    """Wait for a :func:`start_exchange` (a failure is explained as :func:`all_to_all`'s)."""
    try:
        work.wait()
    except Exception as error:
        _explain(group, error)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.splits = (tuple(send_splits), tuple(recv_splits))
        ctx.group = group
        return _exchange(x, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad_out):
        send_splits, recv_splits = ctx.splits
        # the reverse exchange: each row's gradient goes back to the rank the row came from
        return _exchange(grad_out, recv_splits, send_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
               group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Send ``x[rows of send_splits[r]]`` to rank ``r``; return the rows received, by source rank.

    ``x`` is split along dim 0 (``sum(send_splits) == x.shape[0]``); the result has
    ``sum(recv_splits)`` rows, rank 0's first. Differentiable: the backward is the reverse
    exchange. Zero-row splits (and ranks that send or receive nothing) are fine.

    Example (2 ranks)::

        rank 0: x = [a0, a1, a2], send_splits = [1, 2], recv_splits = [1, 1] -> [a0, b0]
        rank 1: x = [b0, b1],     send_splits = [1, 1], recv_splits = [2, 1] -> [a1, a2, b1]
    """
    if sum(send_splits) != x.shape[0]:
        raise ValueError(f"send_splits {list(send_splits)} add up to {sum(send_splits)}, "
                         f"but x has {x.shape[0]} rows")
    _, world = group_rank_and_size(group)
    if len(send_splits) != world or len(recv_splits) != world:
        raise ValueError(f"send_splits and recv_splits need one entry per rank ({world}), got "
                         f"{len(send_splits)} and {len(recv_splits)}")
    if world == 1:
        return x
    return _AllToAll.apply(x, send_splits, recv_splits, group)


def _kept(t: torch.Tensor) -> torch.Tensor:
    return t


def own_graph():
    """Saved-tensor hooks that keep what a graph built inside a forward (and differentiated
    by ``autograd.grad`` in its backward) saves as it is. Without them an enclosing
    activation checkpoint (``use_reentrant=False``) would drop those tensors and recompute
    its whole region once per such ``autograd.grad`` (each a graph task of its own), every
    collective of the region included; with them it recomputes once."""
    return torch.autograd.graph.saved_tensors_hooks(_kept, _kept)


def all_to_all_beside(x: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
                      beside, group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, object]:
    """:func:`all_to_all` of ``x`` and, when ``beside = (side, side_x, side_params)``,
    ``side(side_x)`` computed while the rows travel, in forward and in backward (an MoE
    layer's shared experts beside its token exchanges): ``(rows, side output or None)``.

    The side computation must not depend on the exchange; its gradients (to ``side_x`` and
    ``side_params``) reach autograd as ordinary gradients, computed while the reverse
    exchange carries the rows' gradients back. The same collectives as :func:`all_to_all`.
    """
    if beside is None:
        return all_to_all(x, send_splits, recv_splits, group), None
    side, side_x, side_params = beside
    if group_rank_and_size(group)[1] == 1:  # nothing travels
        return x, side(side_x)
    needs = torch.is_grad_enabled() and (
        x.requires_grad or side_x.requires_grad or any(p.requires_grad for p in side_params))
    if needs:
        return _ExchangeBeside.apply((tuple(send_splits), tuple(recv_splits), group),
                                     side, side_x, x, *side_params)
    out, work = start_exchange(x, send_splits, recv_splits, group)
    try:
        side_out = side(side_x)
    finally:
        finish_exchange(work, group)
    return out, side_out


class _ExchangeBeside(torch.autograd.Function):
    """The token all-to-all with an independent computation between its start and its wait,
    in forward and in backward (the shared experts, overlapped with the exchange).

    Forward: start the exchange of ``send_ND``; run ``side(side_x)`` with its own graph
    (``side_x`` detached: its gradient is returned from here); wait. Backward: start the
    reverse exchange of the rows' gradients; ``autograd.grad`` through the side graph; wait.
    """

    @staticmethod
    def forward(ctx, how, side, side_x, send_ND, *params):
        send_splits, recv_splits, group = how
        recv_RD, work = start_exchange(send_ND, send_splits, recv_splits, group)
        try:
            with torch.enable_grad(), own_graph():
                x_in = side_x.detach().requires_grad_(side_x.requires_grad)
                out = side(x_in)
        finally:  # the exchange completes on every rank, whatever the side computation did
            finish_exchange(work, group)
        ctx.how, ctx.x_in, ctx.out, ctx.params = how, x_in, out, params
        return recv_RD, out.detach()

    @staticmethod
    def backward(ctx, grad_recv_RD, grad_side):
        from ..kernels.moe import first_order_only, freed_graph_error  # (an MoE layer's
        first_order_only()  # shared experts beside its exchange: first order, freed once)
        if ctx.out is None:
            raise freed_graph_error()
        send_splits, recv_splits, group = ctx.how
        grad_send_ND, work = start_exchange(grad_recv_RD, recv_splits, send_splits, group)
        try:
            wanted = [t for t, need in zip((ctx.x_in,) + ctx.params,
                                           (ctx.needs_input_grad[2],) + ctx.needs_input_grad[4:])
                      if need]
            grads = iter(torch.autograd.grad(ctx.out, wanted, grad_side, allow_unused=True)
                         if wanted and ctx.out.requires_grad else [None] * len(wanted))
        finally:
            finish_exchange(work, group)
        out = [next(grads) if need else None
               for need in (ctx.needs_input_grad[2],) + ctx.needs_input_grad[4:]]
        ctx.x_in = ctx.out = None
        return (None, None, out[0], grad_send_ND if ctx.needs_input_grad[3] else None, *out[1:])


def exchange_counts(send_counts: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All-to-all of equal-sized count rows: ``send_counts[r]`` goes to rank ``r``.

    ``send_counts`` is ``[W, ...]`` (int64); the result has the same shape and row ``r`` holds
    what rank ``r`` sent to this rank. Not differentiable (counts are integers).
    """
    _, world = group_rank_and_size(group)
    if send_counts.shape[0] != world:
        raise ValueError(f"send_counts needs one row per rank ({world}), got {tuple(send_counts.shape)}")
    if world == 1:
        return send_counts.clone()
    out = torch.empty_like(send_counts)
    dist.all_to_all_single(out, send_counts.contiguous(), group=group)
    return out


def ranks_reporting(problem: bool, group: dist.ProcessGroup | None = None,
                    device: torch.device | str = "cpu") -> list[int]:
    """The ranks (in ``group``) for which ``problem`` is true; a collective (one all-reduce).

    Lets every rank learn that some rank found an error before a collective it would
    otherwise enter alone, so all ranks raise instead of some hanging.
    """
    rank, world = group_rank_and_size(group)
    if world == 1:
        return [0] if problem else []
    flags = torch.zeros(world, dtype=torch.int32, device=device)
    flags[rank] = int(problem)
    dist.all_reduce(flags, group=group)
    return [r for r, f in enumerate(flags.tolist()) if f]
