"""``tribucket.clip_grad_norm_``: torch's ``clip_grad_norm_``, fast on the gradients a
reducer has just averaged.

When every parameter with a gradient belongs to a live reducer, whole buckets are given and
their gradients are unchanged since the reducer finished them, the 2-norm comes from the
reducer's per-bucket figures (no pass over the gradients beyond the reducer's epilogue) and
the multiply runs on the flat buckets. Otherwise (another ``norm_type``, other parameters,
gradients modified since) it is ``torch.nn.utils.clip_grad_norm_``.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from ._epilogue import reducer_clip_

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(parameters: nn.Module | torch.Tensor | Iterable[torch.Tensor],
                    max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """Clip the gradients' total norm to ``max_norm`` in place; return the norm before clipping.

    Same signature, result and return value as ``torch.nn.utils.clip_grad_norm_`` (to float32
    rounding of the norm); ``parameters`` may also be a module.

    Example::

        >>> with tribucket.fused_bucketing(model) as reducer:
        ...     loss_fn(model(x), y).backward()
        ...     tribucket.clip_grad_norm_(model, max_norm=1.0)   # norm from the reducer
        ...     opt.step()
    """
    if isinstance(parameters, nn.Module):
        params = list(parameters.parameters())
    elif isinstance(parameters, torch.Tensor):
        params = [parameters]
    else:
        params = list(parameters)
    with torch.no_grad():
        total = reducer_clip_(params, max_norm, norm_type, error_if_nonfinite)
    if total is not None:
        return total
    return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite,
                                          foreach)
