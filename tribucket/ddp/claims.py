"""Which live reducer averages which parameter: one parameter, one reducer.

Two reducers over the same parameter (``Reducer(model)`` twice, or nested
``fused_bucketing``) would each divide its gradient by the world size: the result is the
average divided again, with no error. A reducer claims the parameters it averages when it
attaches and releases them when it closes, so the second attach fails at once, naming the
parameter. Reducers over disjoint parameters (the expert-parallel parameters of an MoE
model on their own group, the rest of the model on the data-parallel one) are fine.
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import torch

__all__ = ["claim", "release"]

# id(parameter) -> (weak reference to the parameter, weak reference to its reducer)
_OWNERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def _owner(param: torch.Tensor) -> Any:
    entry = _OWNERS.get(id(param))
    if entry is None:
        return None
    p, r = entry[0](), entry[1]()
    if p is not param or r is None or getattr(r, "_closed", False):
        del _OWNERS[id(param)]  # a dead parameter, a dead or closed reducer: no claim
        return None
    return r


def claim(reducer: Any, names: Sequence[str], params: Sequence[torch.Tensor]) -> None:
    """Record ``reducer`` as the owner of ``params``; raise if a live reducer owns one."""
    for name, p in zip(names, params):
        other = _owner(p)
        if other is not None and other is not reducer:
            raise ValueError(
                f"parameter {name!r} is already averaged by another reducer (attached to "
                f"{type(other.module).__name__}, not closed); a second one would average its "
                "gradient twice. Use one fused_bucketing per model, close the first reducer "
                "before attaching another, or pass the shared parameters in "
                "ignore_parameters= of one of them")
    ref = weakref.ref(reducer)
    for p in params:
        _OWNERS[id(p)] = (weakref.ref(p), ref)


def release(reducer: Any, params: Sequence[torch.Tensor]) -> None:
    """Drop ``reducer``'s claims on ``params``."""
    for p in params:
        entry = _OWNERS.get(id(p))
        if entry is not None and entry[1]() is reducer:
            del _OWNERS[id(p)]
