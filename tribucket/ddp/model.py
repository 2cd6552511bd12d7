"""What the reducer needs to know about a model, and the check that every rank has the same."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .._tags import is_expert_parallel

__all__ = ["ModelView", "inspect_model", "verify_across_ranks"]


@dataclass
class ModelView:
    #: parameters verified and broadcast on entering (frozen ones too, as DDP)
    state_params: list[tuple[str, torch.Tensor]]
    #: buffers verified and broadcast
    buffers: list[tuple[str, torch.Tensor]]
    #: names of the averaged parameters, in model order (DDP's order)
    names: list[str]
    #: the averaged parameters (require grad, not ignored, not expert-parallel)
    params: list[torch.Tensor]
    #: id(param) -> position in ``params``
    index_of: dict[int, int]
    #: the device every averaged parameter lives on
    device: torch.device
    #: per parameter: its module produces sparse gradients (Embedding(sparse=True))
    expect_sparse: list[bool]


def inspect_model(module: nn.Module, ignore_parameters: tuple) -> ModelView:
    """Collect the parameters and buffers the reducer manages, validating ``ignore_parameters``."""
    ignore_ids, ignore_names = set(), set()
    for k, item in enumerate(ignore_parameters):
        if isinstance(item, str):
            ignore_names.add(item)
        elif isinstance(item, torch.Tensor):
            ignore_ids.add(id(item))
        else:
            raise TypeError(f"ignore_parameters[{k}] must be a parameter or its name, got "
                            f"{type(item).__name__}")
    named = list(module.named_parameters())  # tied parameters appear once
    known = {n for n, _ in named} | {n for n, _ in module.named_buffers()}
    unknown = sorted(ignore_names - known)
    if unknown:
        raise ValueError(f"ignore_parameters names {unknown} are not parameters or buffers of "
                         f"the model; known names look like {sorted(known)[:5]}")
    strangers = ignore_ids - {id(p) for _, p in named}
    if strangers:
        raise ValueError(f"{len(strangers)} tensor(s) in ignore_parameters are not parameters "
                         "of the model (pass the model's own parameter objects or names)")

    def ignored(name: str, p: torch.Tensor) -> bool:
        return id(p) in ignore_ids or name in ignore_names or is_expert_parallel(p)

    state_params = [(n, p) for n, p in named if not ignored(n, p)]
    buffers = [(n, b) for n, b in module.named_buffers() if n not in ignore_names]
    grad_params = [(n, p) for n, p in state_params if p.requires_grad]
    names = [n for n, _ in grad_params]
    params = [p for _, p in grad_params]
    devices = {p.device for p in params}
    if len(devices) > 1:
        first = params[0].device
        other = next(i for i, p in enumerate(params) if p.device != first)
        raise ValueError(f"fused_bucketing expects the parameters on one device: {names[0]!r} is "
                         f"on {first} but {names[other]!r} is on {params[other].device}; move "
                         "the model with model.to(device)")
    sparse_ids = {id(m.weight) for m in module.modules()
                  if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse}
    return ModelView(state_params, buffers, names, params,
                     {id(p): i for i, p in enumerate(params)},
                     params[0].device if params else torch.device("cpu"),
                     [id(p) in sparse_ids for p in params])


def verify_across_ranks(view: ModelView, group, world_size: int) -> None:
    """Raise the same ``RuntimeError`` on every rank if any rank's model differs from rank 0's."""
    if world_size == 1:
        return
    meta = [("parameter", n, tuple(p.shape), tuple(p.stride()), str(p.dtype), p.requires_grad)
            for n, p in view.state_params]
    meta += [("buffer", n, tuple(b.shape), tuple(b.stride()), str(b.dtype), False)
             for n, b in view.buffers]
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, meta, group=group)
    ref = everyone[0]
    for r in range(1, world_size):
        other = everyone[r]
        for k in range(max(len(ref), len(other))):
            a = ref[k] if k < len(ref) else None
            b = other[k] if k < len(other) else None
            if a == b:
                continue
            if a is None or b is None:
                have = a if b is None else b
                raise RuntimeError(
                    f"tribucket: the model differs across ranks: rank 0 has {len(ref)} "
                    f"parameters/buffers, rank {r} has {len(other)}; the first extra one is "
                    f"{have[0]} {have[1]!r} with shape {list(have[2])}. Build the same model "
                    "on every rank before entering fused_bucketing.")
            fields = ["kind", "name", "shape", "stride", "dtype", "requires_grad"]
            diff = [f"{f}: {x!r} on rank 0 vs {y!r} on rank {r}"
                    for f, x, y in zip(fields, a, b) if x != y]
            raise RuntimeError(
                f"tribucket: the model differs across ranks at {a[0]} {a[1]!r} (shape "
                f"{list(a[2])} on rank 0, {list(b[2])} on rank {r}): {'; '.join(diff)}. Build "
                "the same model on every rank before entering fused_bucketing.")
