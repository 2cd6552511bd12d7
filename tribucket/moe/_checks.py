"""Construction-time agreement of an MoE layer across ranks: rank 0's parameters broadcast,
and one all-gather each over the expert-parallel and the replica group that every rank built
the layer alike (names the field and the ranks otherwise, before any forward could hang)."""

from __future__ import annotations

import functools
import itertools
import zlib
from dataclasses import is_dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from ..comm import group_rank_and_size

if TYPE_CHECKING:
    from .layer import MoELayer

__all__ = ["broadcast_from_first_rank", "check_ranks_agree", "check_replica_group",
           "check_replicas_agree", "crc", "expert_signature"]


def broadcast_from_first_rank(module: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Overwrite ``module``'s parameters and buffers with the group's rank 0 values."""
    _, world = group_rank_and_size(group)
    if world == 1:
        return
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for t in itertools.chain(module.parameters(), module.buffers()):
            dist.broadcast(t.data, src=src, group=group)


def expert_signature(expert: nn.Module) -> tuple[tuple[str, tuple[int, ...], str], ...]:
    return tuple((n, tuple(q.shape), str(q.dtype)) for n, q in expert.named_parameters())


def crc(obj) -> int:
    return zlib.crc32(repr(obj).encode())


def check_ranks_agree(layer: MoELayer, signature, group: dist.ProcessGroup | None) -> None:
    """One all-gather: every rank built the layer alike (and, to shadow, with alike experts).

    A rank with another schedule, group size, shadow policy, top_k, capacity or d_model would
    issue different collectives in forward (or abort the router broadcast, which comes after
    this check) and hang the group; this catches it when the layer is built, naming the
    field and the ranks. Integer fields travel as themselves (every rank's value is named),
    the others as CRCs (each rank names its own value).
    """
    layer._agreed = True  # (from here a failure is every rank's: see named_on_every_rank)
    _, world = group_rank_and_size(group)
    if world == 1:
        return
    policy = layer.shadow_policy
    policy_key = repr(policy) if policy is None or is_dataclass(policy) else type(policy).__qualname__
    numeric = [("failed", 0), ("d_model", layer.d_model), ("num_experts", layer.num_experts),
               ("top_k", layer.top_k), ("group_size", layer.group_size),
               ("local experts", layer.num_local_experts),
               ("normalize_weights", int(layer.normalize_weights))]
    # the others travel as CRCs; each rank names its own value of those in `shown`
    shown = [("schedule", layer.schedule), ("shadow_policy", policy_key),
             ("capacity_factor", layer.dispatcher.capacity_factor), ("timeout", layer.timeout),
             ("score_func", layer.score_func), ("bias_update_rate", layer.bias_update_rate),
             ("num_expert_groups, num_limited_groups, route_scale",
              (layer.num_expert_groups, layer.num_limited_groups, layer.route_scale)),
             ("dedup", layer.dispatcher.dedup), ("experts kind", type(layer.experts).__name__)]
    signatures = [("shared experts (names, shapes, dtypes) and gate",
                   (expert_signature(layer.shared_experts) if layer.shared_experts is not None
                    else None, layer.shared_gate is not None)),
                  ("router parameters (names, shapes, dtypes)", expert_signature(layer.router)),
                  ("expert parameters (names, shapes, dtypes), needed to shadow",
                   signature if policy is not None else None)]
    fields = numeric + [(name, crc(value)) for name, value in shown + signatures]
    assert len(fields) == _AGREE_COLUMNS, len(fields)
    own = dict(shown)
    device = next(itertools.chain(layer.router.parameters(), layer.experts.parameters())).device
    mine = torch.tensor([v for _, v in fields], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    rows = [t.tolist() for t in every]
    failed = [r for r, row in enumerate(rows) if row[0]]
    if failed:
        raise ValueError(f"rank(s) {failed} of the expert-parallel group could not build their "
                         "MoELayer (each raised its own error, naming the argument): pass the "
                         "same, valid arguments on every rank")
    problems = []
    for column, (name, _) in enumerate(fields):
        values = [r[column] for r in rows]
        if len(set(values)) == 1:
            continue
        if column < len(numeric):
            problems.append(f"{name}: " + ", ".join(f"{v} on rank {r}" for r, v in enumerate(values)))
        else:
            here = f" (here: {own[name]!r})" if name in own else ""
            problems.append(f"{name} on rank(s) {[r for r, v in enumerate(values) if v != values[0]]}"
                            f" differ from rank 0's{here}")
    if problems:
        raise ValueError(f"the ranks of the expert-parallel group built MoELayer with different "
                         f"arguments ({'; '.join(problems)}); pass the same arguments on every "
                         "rank")


#: columns of check_ranks_agree's all-gather (a failed rank sends a row of its own)
_AGREE_COLUMNS = 19


def named_on_every_rank(init):
    """Decorate ``MoELayer.__init__``: an argument one rank refuses before the agreement
    across ranks (its peers wait in that all-gather) is reported to them in the same
    all-gather, so they raise naming the rank instead of waiting for the group's timeout."""
    @functools.wraps(init)
    def wrapper(self, experts, *args, **kwargs):
        try:
            init(self, experts, *args, **kwargs)
        except (ValueError, TypeError):
            if not self.__dict__.get("_agreed", False):
                _report_failed_build(kwargs.get("group"), experts)
            raise
    return wrapper


def _report_failed_build(group, experts) -> None:
    """This rank's row of check_ranks_agree's all-gather, saying it failed (best effort: a
    group that cannot gather has no peers waiting in it)."""
    try:
        _, world = group_rank_and_size(group)
        if world == 1:
            return
        mods = experts if isinstance(experts, (list, tuple, nn.ModuleList)) else [experts]
        p = next(itertools.chain.from_iterable(m.parameters() for m in mods), None)
        row = torch.zeros(_AGREE_COLUMNS, dtype=torch.int64,
                          device=p.device if p is not None else None)
        row[0] = 1
        dist.all_gather([torch.empty_like(row) for _ in range(world)], row, group=group)
    except Exception:  # noqa: BLE001 - the rank's own error is what it raises
        pass


def check_replica_group(group, replica_group, ep_world: int) -> None:
    """Local checks of ``replica_group`` against the EP group (no communication)."""
    if not (dist.is_available() and dist.is_initialized()):
        if replica_group is not None:
            raise RuntimeError("replica_group was given but torch.distributed is not initialised")
        return
    world = dist.get_world_size()
    if replica_group is None:
        if ep_world < world:
            raise ValueError(
                f"group has {ep_world} of the {world} ranks, so every expert has replicas on "
                f"other ranks that nothing would average: pass replica_group= too (both come "
                f"from tribucket.moe.expert_data_parallel_groups(ep_size={ep_world}))")
        return
    me = dist.get_rank()
    replicas = dist.get_process_group_ranks(replica_group)
    ep = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    if me not in replicas or set(replicas) & set(ep) != {me}:
        raise ValueError(
            f"replica_group {replicas} must hold this rank ({me}) and no other rank of its "
            f"expert-parallel group {ep}; build both with "
            "tribucket.moe.expert_data_parallel_groups(ep_size)")


def check_replicas_agree(layer: MoELayer, replica_group) -> None:
    """One all-gather over the replica group: its ranks hold the same global experts."""
    if replica_group is None or dist.get_world_size(replica_group) == 1:
        return
    device = next(itertools.chain(layer.router.parameters(), layer.experts.parameters())).device
    mine = torch.tensor([layer.expert_offset, layer.num_experts], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(replica_group))]
    dist.all_gather(every, mine, group=replica_group)
    rows = [tuple(t.tolist()) for t in every]
    if len(set(rows)) > 1:
        ranks = dist.get_process_group_ranks(replica_group)
        raise ValueError(
            "the ranks of replica_group do not hold the same experts: "
            + ", ".join(f"rank {g} has experts {o}..{o + layer.num_local_experts - 1} of {n}"
                        for g, (o, n) in zip(ranks, rows))
            + "; a rank's replica group must be the ranks at its position in the other "
            "expert-parallel groups (tribucket.moe.expert_data_parallel_groups)")
