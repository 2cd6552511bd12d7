"""Tags on parameters that the layers of tribucket agree on, and the tensors a forward leaves
beside its output (an MoE layer's ``aux_loss``) for the reducer's unused-parameter search.

An expert-parallel parameter has different values on each rank of its expert-parallel (EP)
group: rank ``r`` of the group owns experts ``r*L .. r*L+L-1``. With expert x data
parallelism (a world larger than the EP group) the same expert also lives on one rank of
every other EP group; those ranks form the parameter's *replica group* (its
expert-data-parallel group), across which it is averaged like a dense parameter.

Readers of the tags (the data-parallel reducer, ``clip_grad_norm_``) use the functions
below, never the attribute names.
"""

from __future__ import annotations

import weakref

import torch

#: set on parameters that are expert-parallel (each rank owns different values):
#: ``fused_bucketing`` neither verifies, broadcasts nor reduces them over its group.
EXPERT_PARALLEL_ATTR = "_tribucket_expert_parallel"
#: the expert-parallel process group of a tagged parameter (None: the default group)
EXPERT_GROUP_ATTR = "_tribucket_expert_group"
#: the group of ranks that hold replicas of the same expert (None: no replicas)
EXPERT_REPLICA_GROUP_ATTR = "_tribucket_expert_replica_group"


def mark_expert_parallel(param: torch.Tensor, group=None, replica_group=None) -> torch.Tensor:
    """Tag ``param`` as expert-parallel over ``group`` (None: the default group), with
    replicas averaged over ``replica_group`` (None: the expert has no replicas)."""
    setattr(param, EXPERT_PARALLEL_ATTR, True)
    setattr(param, EXPERT_GROUP_ATTR, group)
    setattr(param, EXPERT_REPLICA_GROUP_ATTR, replica_group)
    return param


def is_expert_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, EXPERT_PARALLEL_ATTR, False))


def expert_group(param: torch.Tensor):
    """The expert-parallel group of a tagged parameter (None: the default group)."""
    return getattr(param, EXPERT_GROUP_ATTR, None)


def expert_replica_group(param: torch.Tensor):
    """The group across which a tagged parameter's replicas are averaged (None: none)."""
    return getattr(param, EXPERT_REPLICA_GROUP_ATTR, None)


# -- tensors a forward leaves beside its output --------------------------------------------
# (weak reference to the owner, tensors) of each reducer whose forward is running, the
# innermost last (weak: a reducer dropped without close() leaves no live entry behind)
_AUX_COLLECTORS: list[tuple[weakref.ref, list[torch.Tensor]]] = []


def note_aux_output(t: torch.Tensor) -> None:
    """A tensor a module's forward leaves beside its output for the user to add to the loss
    (an MoE layer's ``aux_loss``): every reducer whose forward is running counts it among
    that forward's outputs when it looks for unused parameters."""
    if _AUX_COLLECTORS and isinstance(t, torch.Tensor) and t.requires_grad:
        for owner, tensors in _AUX_COLLECTORS:
            if owner() is not None:
                tensors.append(t)


def collect_aux_outputs(owner: object) -> None:
    """Start collecting for ``owner``'s forward (a collection its last forward left behind,
    one that raised, is dropped, and so are those of owners that are gone)."""
    stop_aux_outputs(owner)
    _AUX_COLLECTORS[:] = [e for e in _AUX_COLLECTORS if e[0]() is not None]
    _AUX_COLLECTORS.append((weakref.ref(owner), []))


def stop_aux_outputs(owner: object) -> list[torch.Tensor]:
    """Stop collecting for ``owner``: the tensors noted since :func:`collect_aux_outputs`
    (called by its forward's end, and by its reducer's close after a forward that raised)."""
    for i, (o, tensors) in enumerate(_AUX_COLLECTORS):
        if o() is owner:
            del _AUX_COLLECTORS[i]
            return tensors
    return []
