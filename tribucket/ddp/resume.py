"""Resumable reducer state: what a run restored from a checkpoint needs to continue bit for
bit (the rebuilt layout, the iteration count, the comm hook's state)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ..layout import BucketLayout
from .hookcall import hook_name

__all__ = ["state_dict", "read_state_dict"]

_STATE_VERSION = 1


def state_dict(names: list[str], layout: BucketLayout, progress: dict, hook: Any,
               hook_state: Any) -> dict:
    """What a resumed run needs: the (rebuilt) layout, the progress counters, hook state.
    ``progress``: ``rebuilt``, ``iterations``, ``passes``, ``static_counts``, ``static_used``."""
    return {
        "version": _STATE_VERSION,
        "parameter_names": list(names),
        "layout": layout.to_tensor(),
        **progress,
        "hook": hook_name(hook),
        "hook_state": hook_state_dict(hook_state),
    }


def read_state_dict(state: dict, names: list[str], params: list, hook: Any,
                    hook_state: Any) -> tuple[BucketLayout, dict]:
    """Check ``state`` against this reducer's parameters and hook; restore the hook's state;
    return the layout and the progress counters."""
    if state.get("version") != _STATE_VERSION:
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
    layout = BucketLayout.from_tensor(state["layout"], params)
    progress = dict(rebuilt=bool(state["rebuilt"]), iterations=int(state["iterations"]),
                    passes=int(state.get("passes", state["iterations"])),
                    static_counts=state["static_counts"], static_used=state["static_used"])
    load_hook_state(hook_state, state.get("hook_state"))
    return layout, progress


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
