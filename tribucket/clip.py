"""Gradient clipping by the global norm of a model whose parameters are partly expert-parallel.

``torch.nn.utils.clip_grad_norm_`` on one rank sees only that rank's experts, so ranks clip by
different factors and their dense replicas drift apart. Here each parameter's ``|g|^p`` is
counted exactly once across the world:

* a data-parallel (dense) parameter holds the same averaged gradient on every rank: it is
  counted locally, once;
* an expert-parallel parameter is one of the experts of its expert-parallel group: the
  local partial sum is summed over that group (one all-gather of a scalar per group; replica
  groups hold identical averaged gradients, so every expert-parallel group gives the same
  sum).

The total is ``(dense + sum over groups) ** (1/p)`` (``max`` for ``p = inf``), bit-identical
on every rank, and so is the clip factor.

The dense part is free when a reducer has just averaged those gradients: for ``p = 2``, whole
buckets, unchanged since backward, its epilogue already holds each bucket's norm
(``tribucket/_epilogue.py``), and the clip multiply runs on the flat buckets (skipped on the
CPU when the factor is 1). Otherwise the norms are computed here: by torch's own function
when no parameter is expert-parallel or sharded, so the norm (in the gradients' dtype) and
the clipped gradients are torch's to the bit.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn

from ._epilogue import cover
from ._shard import clip_slices_, norm_dtype, slices_partial
from ._tags import expert_group, is_expert_parallel
from .ddp import optsteps
from .ddp.watchdog import _first_line
from .trace.tracer import span_if_tracing

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(parameters: nn.Module | torch.Tensor | Iterable[torch.Tensor],
                    max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """Clip the gradients in place by their norm over the whole world; return that norm.

    Same signature and return value as ``torch.nn.utils.clip_grad_norm_`` (``parameters``
    may also be the model), for any mix of data-parallel and expert-parallel parameters
    (:class:`tribucket.moe.MoELayer`'s experts, with or without replicas), and for a model
    under ``fused_bucketing(..., shard_optimizer=True)``, whose averaged gradients live in
    the ShardedOptimizer's shards (all of its parameters must be given then). Call it on
    every rank, after backward (gradients averaged) and before ``optimizer.step()``: it
    issues one small collective per expert-parallel group and per sharding reducer. Without
    torch.distributed initialised it is torch's function.

    Example::

        loss.backward()
        tribucket.clip_grad_norm_(model, max_norm=1.0)
        opt.step()
    """
    if isinstance(parameters, nn.Module):
        parameters = parameters.parameters()
    elif isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = list(parameters)
    sharded = _sharded(parameters)
    params = [p for p in parameters if p.grad is not None]
    p_norm = float(norm_type)
    if math.isnan(p_norm):
        raise ValueError(f"norm_type={norm_type!r} must be a number or +-inf (2.0: the "
                         "Euclidean norm)")
    if p_norm <= 0 and (sharded or any(is_expert_parallel(q) or q.grad.is_sparse
                                       for q in params)):
        # torch's total of these orders is not a sum of per-rank parts
        raise ValueError(
            f"norm_type={norm_type!r}: with expert-parallel or sharded parameters, or sparse "
            "gradients, clip_grad_norm_ takes a positive order or inf (its total combines "
            "each rank's part); orders 0 and below work on data-parallel dense gradients")
    if not params and not sharded:
        return torch.tensor(0.0)
    with span_if_tracing("epilogue", args={"op": "clip_grad_norm_"}):
        return _clip(params, max_norm, p_norm, norm_type, error_if_nonfinite, foreach, sharded)


def _sharded(parameters: list[torch.Tensor]) -> list:
    """The attached ``shard_optimizer=True`` reducers (their Backward) whose parameters are
    among ``parameters``: their averaged gradients live in the ShardedOptimizer's shards,
    never in ``.grad``. All of a reducer's parameters, or none, must be given."""
    live = [bw for bw in optsteps.live() if bw.shards is not None]
    if not live:
        return []
    ids = set(map(id, parameters))
    owners = [bw for bw in live if not ids.isdisjoint(bw.param_ids)]
    if any(not bw.param_ids <= ids for bw in owners):
        raise ValueError(
            "clip_grad_norm_: some, not all, of the parameters given are averaged by "
            "fused_bucketing(..., shard_optimizer=True), whose gradients live in the "
            "ShardedOptimizer's shards, where they are mixed with the others'; clip the whole "
            "model (clip_grad_norm_(model, ...)) or use opt.clip_grad_norm_(max_norm)")
    return owners


def _clip(params: list[torch.Tensor], max_norm: float, p_norm: float, norm_type,
          error_if_nonfinite: bool, foreach, sharded: list = ()) -> torch.Tensor:
    """:func:`clip_grad_norm_` on ``params`` (those with a gradient) and the shards of the
    ``sharded`` reducers, ``p_norm`` checked."""
    dense, experts = [], []
    for q in params:
        (experts if is_expert_parallel(q) else dense).append(q)
    groups: dict[int, tuple] = {}  # id(EP group) -> (group, its parameters), in model order
    for q in experts:
        g = expert_group(q)
        groups.setdefault(id(g), (g, []))[1].append(q)
    device = params[0].grad.device if params else sharded[0].device
    # the reducers' buckets, when they hold exactly the dense gradients (whole buckets,
    # unchanged since backward, none named twice): the multiply runs on them, and their
    # epilogue's float32 figures are the norm of float32 gradients (no pass over them)
    fast = cover(dense) if p_norm == 2.0 and dense else None
    figures = fast is not None and fast.float32()
    total = None
    if not groups and not sharded:  # the total as torch forms it, to the bit
        total = fast.norm_of(dense) if figures else None
        if total is None and not any(q.grad.is_sparse for q in dense):
            total = torch.nn.utils.get_total_norm([q.grad for q in dense], p_norm,
                                                  foreach=foreach)
    if total is None:
        partials = [fast.norm().square() if figures
                    else _partial(dense, p_norm, foreach, device)]
        partials += [_group_partial(_partial(qs, p_norm, foreach, device), g)
                     for g, qs in groups.values()]
        # each rank's slices of a sharded reducer's buckets, gathered in rank order (on its
        # group: bounded by its timeout=, naming the rank that did not call)
        for bw in sharded:
            bw.guard.mark_call("tribucket.clip_grad_norm_()")
            local = slices_partial(_slices(bw), p_norm, device)
            partials.append(bw.guard.bounded(
                lambda: _group_partial(local, bw.guard.group),
                "tribucket.clip_grad_norm_'s all-gather of the gradient shards' norms"))
        total = _combine(partials, p_norm)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}) "
            "on every rank, so they cannot be clipped; pass error_if_nonfinite=False to skip "
            "this check")
    if fast is not None:
        fast.clip_with_norm_(max_norm, total)  # dense: one op per bucket
        if experts:
            torch.nn.utils.clip_grads_with_norm_(experts, max_norm, total, foreach=foreach)
    elif params:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=foreach)
    if sharded:
        clip_slices_([g for bw in sharded for g in _slices(bw)], max_norm, total)
    return total


def _slices(bw) -> list[torch.Tensor]:
    """This rank's gradient slices of a sharded reducer's buckets."""
    return [g for g in bw.shard_grads.shards if g is not None]


def _partial(params: list[torch.Tensor], p_norm: float, foreach, device) -> torch.Tensor:
    """``sum |g|^p`` over ``params`` (``max |g|`` for inf), an fp32 scalar (fp64 when a
    gradient is)."""
    if not params:
        return torch.zeros((), dtype=torch.float32, device=device)
    grads = [q.grad for q in params]
    if foreach is not False and not any(g.is_sparse for g in grads):
        norms = torch._foreach_norm(grads, p_norm)
    else:
        norms = [torch.linalg.vector_norm(g.coalesce().values() if g.is_sparse else g, p_norm)
                 for g in grads]
    acc = norm_dtype(grads)
    norms_N = torch.stack([n.to(device=device, dtype=acc) for n in norms])
    return norms_N.max() if math.isinf(p_norm) else norms_N.pow(p_norm).sum()


def _group_partial(local: torch.Tensor, group) -> torch.Tensor:
    """Combine ``local`` over the expert-parallel ``group`` in group-rank order (so every
    rank, in every group whose members hold the same values, gets the same bits)."""
    if not (dist.is_available() and dist.is_initialized()):
        return local
    world = dist.get_world_size(group)
    if world == 1:
        return local
    every = [torch.empty_like(local) for _ in range(world)]
    try:
        dist.all_gather(every, local, group=group)
    except Exception as e:  # (an MoE layer's timeout= bounds it: its group is timed)
        raise RuntimeError(
            f"tribucket.clip_grad_norm_: the all-gather of the expert-parallel norms over "
            f"{world} ranks did not complete ({_first_line(e)}): "
            "a peer died, or did not call tribucket.clip_grad_norm_ (every rank of the "
            "group calls it, with the same parameters). The process group cannot be used "
            "any more; end the job and resume from a checkpoint.") from e
    return torch.stack(every)


def _combine(partials: list[torch.Tensor], p_norm: float) -> torch.Tensor:
    flat = torch.cat([t.reshape(-1) for t in partials])
    return flat.max() if math.isinf(p_norm) else flat.sum().pow(1.0 / p_norm)
