"""Resumable reducer state: what a run restored from a checkpoint needs to continue bit for
bit (the rebuilt layout, the iteration count, the comm hook's state), and the check, at the
first backward after entering or loading, that every rank holds the same.

The state is plain values (lists, ints, strings, bytes) with no tensor whose size depends
on the run, so ``torch.distributed.checkpoint`` can load it into a fresh reducer's
``state_dict()`` as well as ``torch.load`` can. The comm hook's state goes under
``hook_state`` when it is the same on every rank (tribucket's hooks) and under
``hook_state.rank<r>`` when it is the rank's own (torch's ``PowerSGDState``: error feedback
of the rank's gradients): a rank never loads another rank's.
"""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist

from ..layout import BucketLayout
from .hookcall import hook_name
from .model import verify_state_across_ranks

__all__ = ["state_dict", "read_state_dict", "agree_across_ranks", "with_expert_states",
           "expert_states", "own_entries"]

_STATE_VERSION = 2
_SHARED_KEY = "hook_state"
#: the expert reducers' states go under ``expert_reducers.rank<r>`` (a rank's own: its
#: experts, hence their names, differ from the other expert-parallel ranks')
_EXPERT_KEY = "expert_reducers"


def state_dict(names: list[str], layout: BucketLayout, progress: dict, hook: Any,
               hook_state: Any, rank: int, world_size: int) -> dict:
    """What a resumed run needs: the (rebuilt) layout, the progress counters, hook state.
    ``progress``: ``rebuilt``, ``iterations``, ``passes``, ``static_counts``, ``static_used``."""
    state = {
        "version": _STATE_VERSION,
        "world_size": world_size,
        "parameter_names": list(names),
        "layout": layout.to_tensor().tolist(),
        **progress,
        "hook": hook_name(hook),
    }
    saved = hook_state_dict(hook_state)
    if saved is not None:
        state[_hook_key(hook_state, rank)] = _to_bytes(
            {"rank": rank, "world_size": world_size, "state": saved})
    return state


def with_expert_states(state: dict, expert_reducers: list, rank: int) -> dict:
    """``state`` plus the expert reducers' states (``{"0": ..., "1": ...}`` in their order,
    one per replica group) under this rank's key; unchanged without expert reducers."""
    if expert_reducers:
        state[f"{_EXPERT_KEY}.rank{rank}"] = {str(i): r.state_dict()
                                              for i, r in enumerate(expert_reducers)}
    return state


def own_entries(state: dict, rank: int) -> dict:
    """The entries of ``state`` that are ``rank``'s own (its comm hook state, its expert
    reducers'): what a checkpoint written by one rank must gather from the others."""
    return {k: v for k, v in state.items() if k.endswith(f".rank{rank}")}


def check_is_reducer_state(state: Any) -> None:
    """Raise, naming the fix, unless ``state`` looks like a reducer's :func:`state_dict`."""
    if not isinstance(state, dict) or "parameter_names" not in state or "layout" not in state:
        what = (f"a dict with keys {sorted(map(str, state))[:4]}" if isinstance(state, dict)
                else type(state).__name__)
        raise TypeError(f"load_state_dict expects the dict of reducer.state_dict() (its buckets, "
                        f"counters and hook state), got {what}: the model's and the "
                        f"optimizer's states load through their own load_state_dict")


def expert_states(state: dict, count: int, rank: int) -> list[dict]:
    """The ``count`` expert reducer states of this rank in ``state``; raise, naming the fix,
    if it holds another number, another rank's or none."""
    mine = f"{_EXPERT_KEY}.rank{rank}"
    found = sorted(k for k in state if k.startswith(_EXPERT_KEY + ".rank"))
    if mine not in state:
        if not found and not count:
            return []
        if not found:
            raise ValueError(
                f"this reducer averages {count} set(s) of expert replicas (expert x data "
                "parallelism) but the saved reducer state holds no expert reducer state: it was "
                "saved from a model without expert replicas. Save reducer.state_dict() from "
                "the same model and groups, on every rank, and load each rank's own.")
        raise ValueError(
            f"the saved reducer state holds the expert reducers of {found[0][len(_EXPERT_KEY) + 1:]}, "
            f"not of rank {rank}" + (" (and this reducer has no expert replicas)" if not count
                                     else "") +
            ": each rank's experts are its own. Save reducer.state_dict() on every rank (a file "
            "per rank, or torch.distributed.checkpoint) and load each rank's own.")
    saved = state[mine]
    if len(saved) != count:
        raise ValueError(f"the saved reducer state holds {len(saved)} expert reducer state(s) "
                         f"for rank {rank}, this reducer has {count} (one per replica group): "
                         "resume with the same model, ep_size and groups")
    return [saved[str(i)] for i in range(count)]


def read_state_dict(state: dict, names: list[str], params: list, hook: Any,
                    hook_state: Any, rank: int, world_size: int) -> tuple[BucketLayout, dict]:
    """Check ``state`` against this reducer's parameters, hook and rank; restore the hook's
    state; return the layout and the progress counters."""
    if state.get("version") not in (1, _STATE_VERSION):
        raise ValueError(f"reducer state version {state.get('version')!r} is not supported "
                         f"(expected {_STATE_VERSION})")
    if state["parameter_names"] != names:
        theirs, mine = state["parameter_names"], names
        diff = next((k for k in range(min(len(theirs), len(mine))) if theirs[k] != mine[k]),
                    min(len(theirs), len(mine)))
        raise ValueError(f"the saved reducer state is for other parameters: {len(theirs)} "
                         f"saved, {len(mine)} here, first difference at position {diff}")
    if state["hook"] != hook_name(hook):
        raise ValueError(f"the saved state was taken with comm hook {state['hook']}; "
                         f"register it (currently {hook_name(hook)}) before loading")
    hook_saved = _hook_state_to_load(state, hook, hook_state, rank, world_size)
    layout = BucketLayout.from_tensor(torch.as_tensor(state["layout"]), params)
    progress = dict(rebuilt=bool(state["rebuilt"]), iterations=int(state["iterations"]),
                    passes=int(state.get("passes", state["iterations"])),
                    static_counts=state["static_counts"], static_used=state["static_used"])
    load_hook_state(hook_state, hook_saved)
    return layout, progress


def _hook_state_to_load(state: dict, hook: Any, hook_state: Any, rank: int,
                        world_size: int) -> Any:
    """The hook state this rank must load; raise if the checkpoint holds another rank's or
    another world size's."""
    if state.get("version") == 1:
        return state.get("hook_state")
    mine = _hook_key(hook_state, rank)
    found = [k for k in state if k == _SHARED_KEY or k.startswith(_SHARED_KEY + ".rank")]
    if not found:
        return None
    if mine not in state:
        other = _from_bytes(state[found[0]])
        raise ValueError(
            f"the comm hook state in this checkpoint was saved by rank {other['rank']} of "
            f"{other['world_size']}; this is rank {rank}, and the state of {hook_name(hook)} "
            "is each rank's own (its error feedback is of that rank's gradients). Save "
            "reducer.state_dict() on every rank (a file per rank, or "
            "torch.distributed.checkpoint) and load each rank's own.")
    entry = _from_bytes(state[mine])
    if entry["world_size"] != world_size:
        raise ValueError(
            f"the comm hook state was saved with world size {entry['world_size']}; this run "
            f"has {world_size} ranks. Resume with the same world size, or register a fresh "
            "hook state without loading it.")
    return entry["state"]


def agree_across_ranks(hook: Any, hook_state: Any, traits: Any, layout: BucketLayout,
                       rebuilt: bool, iterations: int, static_record: tuple, guard) -> None:
    """Raise on every rank, naming the field, unless every rank has the same comm hook, wire
    dtype, layout, iteration count, static-graph record and hook schedule (one all-gather)."""
    summary = {
        "comm hook": hook_name(hook),
        "wire dtype": str(traits.wire_dtype),
        "rebuilt layout": rebuilt,
        "buckets": len(layout.buckets),
        "layout": layout.to_tensor().tolist(),
        "iterations": iterations,
        "static_graph record": static_record,
        "hook state iteration": getattr(hook_state, "iteration",
                                        getattr(hook_state, "iter", None)),
    }
    verify_state_across_ranks(
        summary, guard.group, guard.world_size,
        "Register the same comm hook on every rank, and call load_state_dict on every rank "
        "with the same checkpoint (or on none).", guard=guard, iteration=iterations + 1)


def _hook_key(state: Any, rank: int) -> str:
    """``hook_state`` for a state every rank shares, ``hook_state.rank<r>`` for a rank's own."""
    shared = type(state).__module__.startswith("tribucket.")
    return _SHARED_KEY if shared else f"{_SHARED_KEY}.rank{rank}"


def _to_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def hook_state_dict(state: Any) -> Any:
    if state is None or isinstance(state, dist.ProcessGroup) or isinstance(state, list):
        return None
    if hasattr(state, "state_dict"):
        return state.state_dict()
    if hasattr(state, "__getstate__") and hasattr(state, "process_group"):
        return state.__getstate__()  # torch's PowerSGDState (process group excluded)
    return None


def load_hook_state(state: Any, saved: Any) -> None:
    if saved is None or state is None:
        return
    if hasattr(state, "load_state_dict"):
        state.load_state_dict(saved)
    elif hasattr(state, "__setstate__") and hasattr(state, "process_group"):
        group = state.process_group
        state.__setstate__(saved)
        state.process_group = group  # keep the group the state was created with
