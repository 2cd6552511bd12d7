"""ShardedOptimizer's checks at construction and step: which optimizer classes can be
sharded, that every rank builds the same one, torch's param-group forms, and why a
GradScaler cannot drive it (``tribucket.zero``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

#: torch optimizers whose update is elementwise (each element's new value depends only on
#: its own value, gradient and state, and on scalar hyperparameters)
ELEMENTWISE_OPTIMIZERS = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
    torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adagrad, torch.optim.Adadelta,
    torch.optim.RMSprop, torch.optim.Rprop, torch.optim.ASGD,
)


def loss_scaling_refused(scaler: str) -> str:
    """Why a GradScaler cannot drive a ShardedOptimizer, and what to do instead."""
    return (f"{scaler} cannot drive a tribucket.ShardedOptimizer: its gradients live in the "
            "reducer's bucket shards, not in .grad, so the scaler has nothing to unscale or "
            "check for inf/NaN. Train with bf16 autocast (no loss scaling needed), or use "
            "fused_bucketing without shard_optimizer and a plain optimizer with this scaler")


def _refuse_loss_scaling(opt: "ShardedOptimizer") -> None:
    """torch.amp.GradScaler.step sets ``found_inf`` (and ``grad_scale``) on an optimizer with
    ``_step_supports_amp_scaling`` just before calling its ``step()``: refuse it there,
    before any parameter changes (every rank drives its scaler alike: every rank raises)."""
    if "found_inf" in opt.__dict__ or "grad_scale" in opt.__dict__:
        opt.__dict__.pop("found_inf", None)
        opt.__dict__.pop("grad_scale", None)
        raise TypeError(loss_scaling_refused("torch.amp.GradScaler"))


def _check_optimizer_class(cls: Any, assume_elementwise: bool) -> None:
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass (e.g. "
                        f"torch.optim.AdamW), got {cls!r}")
    if assume_elementwise or cls in ELEMENTWISE_OPTIMIZERS:
        return
    names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
    base = next((c for c in cls.__mro__ if c in ELEMENTWISE_OPTIMIZERS), None)
    if base is not None:
        raise ValueError(
            f"{cls.__name__} subclasses {base.__name__} but may not update elementwise as it "
            "does (a LAMB-style trust ratio, a per-parameter norm): ShardedOptimizer steps "
            "flat 1/world slices of the buckets, where such an update would be computed on "
            "slices instead of whole parameters. If its update of each element depends only "
            "on that element, its gradient and state, pass assume_elementwise=True.")
    raise ValueError(
        f"{cls.__name__} cannot be sharded: ShardedOptimizer steps flat 1/world slices of the "
        "buckets, so the update of each element must depend only on that element (its value, "
        "gradient and state) and on scalar hyperparameters. Optimizers with per-parameter "
        "matrix state or norms (Adafactor, Muon, LBFGS, LAMB-style trust ratios...) need whole "
        f"parameters. Sharded optimizers known to be elementwise: {names}. If yours is "
        "elementwise too, pass assume_elementwise=True.")


def _agree_across_ranks(reducer, cls: type, params: Any, assume_elementwise: bool,
                        overlap: bool, defaults: dict) -> None:
    """Every rank must build the same optimizer: each steps its own slice of the buckets,
    so a different class or hyperparameter on one rank would be applied to its slice alone,
    silently. One all-gather of a description of it, at construction."""
    groups = []
    if isinstance(params, list):
        groups = [sorted((k, repr(v)) for k, v in g.items() if k != "params")
                  for g in params if isinstance(g, dict)]
    mine = (f"{cls.__module__}.{cls.__qualname__}", assume_elementwise, bool(overlap),
            sorted((k, repr(v)) for k, v in defaults.items()), groups)
    every: list = [None] * reducer.world_size
    dist.all_gather_object(every, mine, group=reducer.process_group)
    fields = ("optimizer class", "assume_elementwise", "overlap_param_gather",
              "hyperparameters", "param group hyperparameters")
    for r, theirs in enumerate(every):
        for name, a, b in zip(fields, every[0], theirs):
            if a != b:
                raise RuntimeError(
                    f"ShardedOptimizer (rank {reducer.rank}): rank {r} builds it with "
                    f"{name} {b!r} but rank 0 with {a!r}; each rank steps its own slice of "
                    "the gradients, so every rank must build the same optimizer with the same "
                    "hyperparameters")
    return None


def _normalize_groups(params: Any) -> list[dict]:
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of parameters or of param-group dicts, "
                        "got a single tensor; wrap it in a list")
    items = list(params)
    if not items:
        raise ValueError("ShardedOptimizer got an empty parameter list")
    if all(isinstance(g, dict) for g in items):
        groups = []
        for k, g in enumerate(items):
            if "params" not in g:
                raise ValueError(f"param group {k} has no 'params' entry")
            ps = g["params"]
            ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
            groups.append(_named({**g, "params": ps}, k))
        return groups
    if any(isinstance(g, dict) for g in items):
        raise TypeError("params mixes parameters and param-group dicts; pass one kind")
    return [_named({"params": items}, 0)]


def _named(group: dict, k: int) -> dict:
    """torch's named form (``model.named_parameters()``): ``(name, parameter)`` pairs become
    ``params`` and ``param_names``."""
    ps = group["params"]
    named = [isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in ps]
    if not any(named):
        return group
    if not all(named):
        raise TypeError(f"param group {k} mixes named (name, parameter) pairs and bare "
                        "parameters; pass model.named_parameters() or model.parameters() "
                        "forms, not both")
    return {**group, "param_names": [n for n, _ in ps], "params": [p for _, p in ps]}
