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

from typing import Any

import torch

from ._epilogue import cover
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

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor,
                        found_inf: torch.Tensor, allow_fp16: bool) -> dict:
        params = _grad_params(optimizer)
        figures = cover(params) if params is not None else None
        if figures is None:
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        with span_if_tracing("epilogue", args={"op": "unscale_"}):
            flag = figures.found_inf()
            device = params[0].grad.device
            with torch.no_grad():
                figures.scale_(inv_scale.to(device))
            return {device: flag.to(device=device, dtype=torch.float32).reshape(found_inf.shape)}

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        # step() without unscale_ for optimizers that unscale themselves (fused Adam...):
        # torch scans with a multiplier of 1; the reducer's flag makes that pass unneeded
        params = _grad_params(optimizer)
        figures = cover(params) if params is not None else None
        if figures is None:
            return super()._check_inf_per_device(optimizer)
        with span_if_tracing("epilogue", args={"op": "found_inf"}):
            flag = figures.found_inf()
        device = params[0].grad.device
        found = {device: flag.to(device=device, dtype=torch.float32).reshape(())}
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = found
        return found
