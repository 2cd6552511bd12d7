"""What the reducer needs to know about a model, and the check that every rank has the same."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._tags import expert_replica_group, is_expert_parallel

__all__ = ["ModelView", "expert_replica_sets", "inspect_model", "verify_across_ranks",
           "verify_state_across_ranks"]


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
    #: (name, parameter) of those in ``state_params`` that do not require grad (not averaged)
    frozen: list[tuple[str, torch.Tensor]]
    #: why this rank cannot go on (a parameter without data), refused on every rank at once
    problem: str | None = None
    #: names of the parameters and buffers ``ignore_parameters`` leaves out (compared
    #: across ranks as an option)
    ignored: list[str] = dataclasses.field(default_factory=list)


def module_buffers(module: nn.Module, ignore_names) -> list[tuple[str, torch.Tensor]]:
    """The module's buffers as they are now (a buffer reassigned, registered or set to None
    since entering included), less the ignored names."""
    return [(n, b) for n, b in module.named_buffers() if n not in ignore_names]


def inspect_model(module: nn.Module, ignore_parameters: tuple, only=None) -> ModelView:
    """Collect the parameters and buffers the reducer manages, validating ``ignore_parameters``.

    ``only`` (a collection of the model's parameters): manage just those, expert-parallel
    ones included, and no buffers (the expert replicas' reducer, on their replica group).
    """
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

    only_ids = None if only is None else {id(p) for p in only}

    def ignored(name: str, p: torch.Tensor) -> bool:
        if id(p) in ignore_ids or name in ignore_names:
            return True
        return is_expert_parallel(p) if only_ids is None else id(p) not in only_ids

    state_params = [(n, p) for n, p in named if not ignored(n, p)]
    buffers = [] if only is not None else module_buffers(module, ignore_names)
    left_out = sorted({n for n, p in named if id(p) in ignore_ids or n in ignore_names}
                      | {n for n, _ in module.named_buffers() if n in ignore_names})
    problem = _without_storage(state_params, buffers)
    if problem is not None:  # (shape and device unknown: refused in the entry check)
        return ModelView(state_params, buffers, [], [], {}, torch.device("cpu"), [], [],
                         problem, left_out)
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
                     # a bucket of its own: sparse gradients, and complex ones (all-reduced
                     # as torch.distributed does, viewed as real)
                     [id(p) in sparse_ids or p.is_complex() for p in params],
                     [(n, p) for n, p in state_params if not p.requires_grad],
                     ignored=left_out)


def _without_storage(params: list, buffers: list) -> str | None:
    """Why the model cannot be averaged, if a parameter or buffer the reducer would manage
    holds no data: a lazy module's (before its first forward) has no shape, and a
    meta-device model materialized later (``to_empty``) gets new parameter objects, which the
    reducer would never see."""
    for kind, named in (("parameter", params), ("buffer", buffers)):
        for n, t in named:
            if isinstance(t, nn.parameter.UninitializedTensorMixin):
                return (f"{kind} {n!r} is not initialized (a lazy module such as "
                        "nn.LazyLinear): run a forward on a sample batch first, so that its "
                        "shape is known, then enter fused_bucketing (as "
                        "DistributedDataParallel requires)")
            if t.is_meta:
                return (f"{kind} {n!r} is on the meta device (no data): materialize the model "
                        "first (model.to_empty(device=...) then initialize it, e.g. "
                        "reset_parameters()), then enter fused_bucketing; parameters created "
                        "after entering would not be averaged")
    return None


def expert_replica_sets(module: nn.Module, ignore_parameters: tuple) -> list[tuple]:
    """``[(replica_group, parameters)]``: the expert-parallel parameters that have replicas,
    grouped by replica group in model order (the same order on every rank)."""
    names = {n for n in ignore_parameters if isinstance(n, str)}
    ids = {id(t) for t in ignore_parameters if isinstance(t, torch.Tensor)}
    sets: dict[int, tuple] = {}
    for n, p in module.named_parameters():
        group = expert_replica_group(p) if is_expert_parallel(p) else None
        if group is None or not p.requires_grad or n in names or id(p) in ids:
            continue
        sets.setdefault(id(group), (group, []))[1].append(p)
    return list(sets.values())


def _options_of(config: Any) -> dict:
    """The options that change which collectives a reducer issues, in comparable form."""
    out = {}
    for f in dataclasses.fields(config):
        if f.name == "ignore_parameters":
            continue  # their effect (which parameters are averaged) is compared below
        value = getattr(config, f.name)
        if f.name == "trace":  # on or off (its close gathers to rank 0), not where it goes
            import os

            from ..trace import ENV
            value = bool(os.environ.get(ENV)) if value is None else value is not False
        out[f.name] = value.total_seconds() if hasattr(value, "total_seconds") else value
    return out


def _first_difference(ref: dict, other: dict) -> str | None:
    for key in ref:
        if ref[key] != other.get(key):
            return key
    return None


def _raise_if_differ(everyone: list, what: str, fix: str, show=repr) -> None:
    """Raise the same ``RuntimeError`` on every rank naming the first field of rank 0's dict
    that another rank has otherwise (``everyone``: the all-gathered dicts)."""
    for r in range(1, len(everyone)):
        key = _first_difference(everyone[0], everyone[r])
        if key is not None:
            raise RuntimeError(
                f"tribucket: {what} differ across ranks: {key}={show(everyone[0][key])} on "
                f"rank 0 but {show(everyone[r].get(key))} on rank {r}. {fix}")


def verify_state_across_ranks(summary: dict, group, world_size: int, fix: str,
                              guard: Any = None, iteration: int = 0) -> None:
    """All-gather ``summary`` (field -> comparable value) and raise on every rank if a rank's
    differs from rank 0's, naming the field. ``guard`` (a ``CommGuard``): a failed or timed
    out all-gather is reported as its other collectives are, naming the ranks behind."""
    if world_size == 1:
        return
    everyone: list = [None] * world_size
    if guard is None:
        dist.all_gather_object(everyone, summary, group=group)
    else:
        guard.call(lambda: dist.all_gather_object(everyone, summary, group=group),
                   "the first backward's check that every rank holds the same reducer state "
                   "(one all-gather)", iteration)
    _raise_if_differ(everyone, "the reducer's state and comm hook", fix,
                     show=lambda v: repr(v) if len(repr(v)) < 80 else f"{repr(v)[:60]}...")


def verify_across_ranks(view: ModelView, group, world_size: int, config: Any = None,
                        extra: dict | None = None, problem: str | None = None,
                        side: Any = None) -> list:
    """Raise the same ``RuntimeError`` on every rank if any rank's model or reducer options
    (and ``extra``: other facts every rank must share) differ from rank 0's (one
    ``all_gather_object``). ``problem``: this rank's reason not to go on (its own
    ``ValueError`` here, a ``RuntimeError`` naming it on the others), in the same gather.
    ``side``: anything else to gather, not compared; returns every rank's."""
    problem = "; ".join(filter(None, (view.problem, problem))) or None
    if world_size == 1:
        if problem is not None:
            raise ValueError(problem)
        return [side]
    if view.problem is not None:  # (no shapes to compare: the problem says why)
        view = dataclasses.replace(view, state_params=[], buffers=[])
    meta = [("parameter", n, tuple(p.shape), tuple(p.stride()), str(p.dtype), p.requires_grad,
             p.device.type) for n, p in view.state_params]
    meta += [("buffer", n, tuple(b.shape), tuple(b.stride()), str(b.dtype), False,
              b.device.type) for n, b in view.buffers]
    options = _options_of(config) if config is not None else {}
    if config is not None:  # (by name: the tensors given differ from rank to rank)
        options["ignore_parameters"] = view.ignored
    options.update(extra or {})
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, (options, meta, problem, side), group=group)
    if problem is not None:
        raise ValueError(problem)
    for r, (_, _, theirs, _) in enumerate(everyone):
        if theirs is not None:
            raise RuntimeError(f"tribucket: rank {r} cannot go on: {theirs}")
    _raise_if_differ([e[0] for e in everyone], "the reducer options",
                     "Pass the same options to fused_bucketing on every rank (they decide "
                     "which collectives each rank issues).")
    ref = everyone[0][1]
    for r in range(1, world_size):
        other = everyone[r][1]
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
            fields = ["kind", "name", "shape", "stride", "dtype", "requires_grad", "device"]
            diff = [f"{f}: {x!r} on rank 0 vs {y!r} on rank {r}"
                    for f, x, y in zip(fields, a, b) if x != y]
            raise RuntimeError(
                f"tribucket: the model differs across ranks at {a[0]} {a[1]!r} (shape "
                f"{list(a[2])} on rank 0, {list(b[2])} on rank {r}): {'; '.join(diff)}. Build "
                "the same model on every rank (on one kind of device) before entering "
                "fused_bucketing.")
    return [e[3] for e in everyone]
