"""Shared experts of :class:`~tribucket.moe.MoELayer`: the modules every token passes through
(DeepSeek-V3, Qwen), summed and optionally gated; run by the layer beside its token exchanges.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def shared_list(shared) -> list[nn.Module]:
    """``shared_experts=`` as a list of modules (None: [])."""
    if shared is None:
        return []
    if isinstance(shared, nn.Module) and not isinstance(shared, (nn.ModuleList, nn.ModuleDict)):
        items = [shared]
    elif isinstance(shared, nn.ModuleDict):
        items = list(shared.values())
    else:
        items = list(shared) if isinstance(shared, Iterable) else []
    if not items or not all(isinstance(m, nn.Module) for m in items):
        raise TypeError(f"shared_experts must be a module or a non-empty list of modules (each "
                        f"[n, D] -> [n, D]), got {shared!r}")
    return items


def shared_forward(experts: nn.ModuleList, gate: nn.Module | None, x_TD: torch.Tensor,
                   rank: int) -> torch.Tensor:
    """The sum of the shared experts' outputs, times ``sigmoid(gate(x))`` when gated; an
    output of another shape raises, naming the expert and ``rank``."""
    out_TD = None
    for i, expert in enumerate(experts):
        y_TD = expert(x_TD)
        if not isinstance(y_TD, torch.Tensor) or y_TD.shape != x_TD.shape:
            got = tuple(y_TD.shape) if isinstance(y_TD, torch.Tensor) else type(y_TD).__name__
            raise ValueError(f"shared expert {i} on rank {rank} returned {got} for an input of "
                             f"shape {list(x_TD.shape)}; shared experts must map [n, D] -> [n, D]")
        out_TD = y_TD if out_TD is None else out_TD + y_TD
    if gate is not None:
        gate_T1 = torch.sigmoid(gate(x_TD.to(gate.weight.dtype)))
        out_TD = out_TD * gate_T1.to(out_TD.dtype)
    return out_TD


def shared_parameters(experts: nn.ModuleList, gate: nn.Module | None) -> list[torch.Tensor]:
    """The shared experts' and the gate's parameters (their gradients come back from the
    exchange they ran beside)."""
    mods = [experts] + ([gate] if gate is not None else [])
    return [p for m in mods for p in m.parameters()]
