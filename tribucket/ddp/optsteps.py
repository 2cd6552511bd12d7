"""Optimizer steps counted per reducer: the second half of the step mark.

A rank that runs one extra forward and backward keeps its forward count equal to its peers'
(one forward per backward), so the forward count alone cannot tell its extra pass from their
next step. The optimizer steps taken since can: every rank steps after the same backward, so
at each synchronised backward every rank has taken the same number of steps of the
optimizers over the reducer's parameters (see ``status.Status.check_steps``).

Counted by one process-wide post-step hook of ``torch.optim`` (every torch optimizer calls it,
subclasses included); an optimizer is matched to the reducers whose parameters it holds once
per change of its parameter groups or of the set of live reducers, so a step costs a dict
lookup. :class:`tribucket.ShardedOptimizer` steps shards, not the parameters, and reports its
steps itself (:func:`stepped`).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["watch", "unwatch", "stepped", "live"]

_LIVE: "weakref.WeakSet[Any]" = weakref.WeakSet()  # Backward objects of attached reducers
_generation = 0  # bumped when _LIVE changes: the optimizers' matches are recomputed
_match: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()
_handle = None


def watch(bw: Any) -> None:
    """Count the optimizer steps over ``bw.params`` into ``bw.opt_steps`` from now on."""
    global _handle, _generation
    if _handle is None:
        _handle = register_optimizer_step_post_hook(_post_step)
    _LIVE.add(bw)
    _generation += 1


def unwatch(bw: Any) -> None:
    global _generation
    _LIVE.discard(bw)
    _generation += 1


def live() -> list:
    """The Backward objects of the reducers attached now."""
    return list(_LIVE)


def stepped(bw: Any) -> None:
    """One optimizer step over ``bw``'s parameters (for optimizers the hook cannot match)."""
    bw.opt_steps += 1


def _owners(opt: torch.optim.Optimizer) -> list:
    groups = opt.param_groups
    key = (_generation, len(groups), sum(len(g["params"]) for g in groups))
    hit = _match.get(opt)
    if hit is not None and hit[0] == key:
        return [bw for bw in (r() for r in hit[1]) if bw is not None]
    ids = {id(p) for g in groups for p in g["params"]}
    owners = [bw for bw in _LIVE if not ids.isdisjoint(bw.param_ids)]
    try:
        _match[opt] = (key, [weakref.ref(bw) for bw in owners])
    except TypeError:  # an optimizer that cannot be weakly referenced: match every step
        pass
    return owners


def _post_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if _LIVE and not getattr(opt, "steps_shards", False):  # (ShardedOptimizer: stepped)
        for bw in _owners(opt):
            if bw.shards is not None:
                raise RuntimeError(sharded_step_error(opt))
            bw.opt_steps += 1


def sharded_step_error(opt: torch.optim.Optimizer) -> str:
    """The misuse message when a torch optimizer steps parameters whose reducer shards."""
    name = type(opt).__name__
    return (f"tribucket: a {name} stepped parameters of a reducer built with "
            "shard_optimizer=True, whose averaged gradients are in its shards, not in .grad: "
            f"the step used none of them. Step them with tribucket.ShardedOptimizer(reducer, "
            f"torch.optim.{name}, ...), or enter without shard_optimizer=True")
