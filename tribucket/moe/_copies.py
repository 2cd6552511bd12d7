"""The expert parameters' tags and gradient scale, kept on copies of an MoE layer, and the
loading of merged expert files.

An expert parameter carries what the rest of tribucket reads from it (expert-parallel, its
group and replica group: ``tribucket._tags``) and a hook scaling its gradient by
``expert_grad_scale``. Both live on the Parameter object, so a copy of the layer
(``copy.deepcopy(model)``: an EMA, a second run) or ``load_state_dict(..., assign=True)``,
which put new Parameters in place, would lose them: the reducer would then average other
ranks' experts together as if they were one dense parameter, and the gradients would be W
times too large. The layer puts them back on such parameters.
"""

from __future__ import annotations

import copy
from typing import Any

from .._tags import mark_expert_parallel

__all__ = ["tag_experts", "deepcopy_layer", "retag_after_load", "drop_other_ranks_experts"]

#: set on an expert parameter once its gradient-scale hook is registered
_SCALED = "_tribucket_expert_grad_scale"


def tag_experts(layer: Any, scale_only: bool = False) -> None:
    """Hook ``layer.expert_grad_scale`` on the expert parameters that lack it and (unless
    ``scale_only``, before the layer's group exists) tag them as expert-parallel over the
    layer's group and replica group."""
    s = layer.expert_grad_scale
    for p in layer.experts.parameters():
        if s != 1.0 and getattr(p, _SCALED, None) is None:
            p.register_hook(lambda g, s=s: g * s)
            setattr(p, _SCALED, s)
        if not scale_only:
            mark_expert_parallel(p, group=layer.dispatcher.group,
                                 replica_group=layer.replica_group)


def deepcopy_layer(layer: Any, memo: dict) -> Any:
    """``copy.deepcopy`` of an MoE layer: as nn.Module's, with the expert parameters tagged
    and hooked again, and without the last forward's ``aux_loss``/``stats`` (the loss holds
    a graph, which deepcopy refuses)."""
    new = type(layer).__new__(type(layer))
    memo[id(layer)] = new
    state = {k: (None if k in ("aux_loss", "stats") else v) for k, v in layer.__dict__.items()}
    new.__setstate__(copy.deepcopy(state, memo))
    tag_experts(new)
    return new


def retag_after_load(layer: Any, incompatible_keys: Any) -> None:
    """A load_state_dict post-hook: ``assign=True`` put new expert parameters in place."""
    tag_experts(layer)


def drop_other_ranks_experts(module: Any, state_dict, prefix, *_unused) -> None:
    """load_state_dict pre-hook: ignore experts this rank does not own (merged files)."""
    head = prefix + "experts."
    mine = {str(module.expert_offset + l) for l in range(module.num_local_experts)}
    for key in [k for k in state_dict if k.startswith(head)]:
        index = key[len(head):].split(".", 1)[0]
        if index.isdigit() and index not in mine and int(index) < module.num_experts:
            del state_dict[key]
