"""``tribucket.amp.GradScaler``: torch's ``GradScaler`` that takes the reducer's inf/NaN flag
instead of scanning every gradient again.

``torch.amp.GradScaler.unscale_`` (and ``step`` without it) runs
``torch._amp_foreach_non_finite_check_and_unscale_`` over every gradient of the optimizer:
a pass that multiplies by ``1/scale`` and checks each value. When a tribucket reducer has
just averaged those gradients, its epilogue already knows whether one is inf/NaN
(``reducer.found_inf``: computed from the *reduced* values, equal on every rank); this
subclass takes that flag and only multiplies, one op per bucket lent to ``.grad``. Where the
flag does not cover the optimizer's gradients exactly (parameters the reducer does not own,
sparse or fp16 gradients, gradients modified since the backward), it does what torch does.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import _refresh_per_optimizer_state

from ._epilogue import cover
from ._tags import expert_group, is_expert_parallel
from .trace.tracer import span_if_tracing

__all__ = ["GradScaler"]


def _grad_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor] | None:
    """The optimizer's parameters with a gradient, or None when torch's path must run
    (sparse or float16 gradients, several devices)."""
    params = [p for group in optimizer.param_groups for p in group["params"]
              if p.grad is not None]
    if not params:
        return None
    first = params[0].grad.device
    for p in params:
        g = p.grad
        if g.is_sparse or g.dtype == torch.float16 or g.device != first:
            return None
    return params


def _expert_groups(optimizer: torch.optim.Optimizer) -> list:
    """The expert-parallel groups (of more than one rank) of the optimizer's parameters, in
    order: an expert's gradient is computed on its owner alone, so an overflow there must be
    shared with the group's other ranks. Decided from the parameters, not their gradients,
    so every rank of a group takes part alike; cached on the optimizer while its parameter
    count stays."""
    count = sum(len(g["params"]) for g in optimizer.param_groups)
    cached = _EXPERT_GROUPS.get(optimizer)
    if cached is not None and cached[0] == count:
        return cached[1]
    groups: dict[int, Any] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if is_expert_parallel(p):
                g = expert_group(p)
                if id(g) not in groups and dist.get_world_size(g) > 1:
                    groups[id(g)] = g
    _EXPERT_GROUPS[optimizer] = (count, list(groups.values()))
    return _EXPERT_GROUPS[optimizer][1]


#: optimizer -> (its parameter count, its expert-parallel groups), as long as it lives
_EXPERT_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _agree(optimizer: torch.optim.Optimizer, found: dict) -> dict:
    """``found`` (device -> inf flag) with each flag the max over the optimizer's expert-
    parallel groups: every rank skips the step when one rank's experts overflowed."""
    groups = _expert_groups(optimizer)
    if not groups:
        return found
    # (no gradient here, no token reached this rank's experts: it still takes part)
    device = (next(iter(found.values())).device if found else
              next(p.device for g in optimizer.param_groups for p in g["params"]))
    flag = torch.zeros((), device=device)
    for f in found.values():
        flag = torch.maximum(flag, f.reshape(()).float().to(device))
    for g in groups:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=g)
    for f in found.values():
        f.copy_(flag.to(f.device).reshape(f.shape))
    return found


def _dropping_step() -> bool:
    from .ft import dropping_step  # (torchft itself is imported by managed reducers only)

    return dropping_step()


def _refuse_sharded(optimizer: Any) -> None:
    from .zero import ShardedOptimizer, loss_scaling_refused

    if isinstance(optimizer, ShardedOptimizer):
        raise TypeError(loss_scaling_refused("GradScaler"))


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose inf/NaN check is the reducer's ``found_inf``.

    A drop-in replacement: same arguments, same state dict, same skipped steps and scale
    updates as torch's scaler on DDP. Use it exactly as torch's::

        scaler = tribucket.amp.GradScaler("cuda")        # or "cpu"
        with tribucket.fused_bucketing(model) as reducer:
            for x, y in loader:
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = loss_fn(model(x), y)
                scaler.scale(loss).backward()
                scaler.unscale_(opt)                       # no inf scan: the reducer's flag
                tribucket.clip_grad_norm_(model, 1.0)      # no norm pass: the reducer's norm
                scaler.step(opt)                           # skipped when found_inf
                scaler.update()
                opt.zero_grad()
    """

    def unscale_(self, optimizer) -> None:
        _refuse_sharded(optimizer)
        return super().unscale_(optimizer)

    def step(self, optimizer, *args: Any, **kwargs: Any):
        _refuse_sharded(optimizer)
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """torch's ``update()``; in a step a torchft manager drops (``fused_bucketing(...,
        manager=...)``), the scale and growth count stay as they are: a replica group that
        gave the step up (a caught failure) calls no ``update()``, and every group's loss
        must stay scaled alike."""
        if new_scale is None and self._enabled and _dropping_step():
            self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
            return
        super().update(new_scale)

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor,
                        found_inf: torch.Tensor, allow_fp16: bool) -> dict:
        params = _grad_params(optimizer)
        figures = cover(params) if params is not None else None
        if figures is None:
            return _agree(optimizer, super()._unscale_grads_(optimizer, inv_scale, found_inf,
                                                             allow_fp16))
        with span_if_tracing("epilogue", args={"op": "unscale_"}):
            flag = figures.found_inf()
            device = params[0].grad.device
            with torch.no_grad():
                figures.scale_(inv_scale.to(device))
            return _agree(optimizer, {device: flag.to(device=device, dtype=torch.float32)
                                      .reshape(found_inf.shape)})

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        # step() without unscale_ for optimizers that unscale themselves (fused Adam...):
        # torch scans with a multiplier of 1; the reducer's flag makes that pass unneeded
        params = _grad_params(optimizer)
        figures = cover(params) if params is not None else None
        if figures is None:
            return _agree(optimizer, super()._check_inf_per_device(optimizer))
        with span_if_tracing("epilogue", args={"op": "found_inf"}):
            flag = figures.found_inf()
        device = params[0].grad.device
        found = _agree(optimizer, {device: flag.to(device=device, dtype=torch.float32)
                                   .reshape(())})
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = found
        return found
