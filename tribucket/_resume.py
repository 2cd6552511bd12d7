"""Resumable reducer state: what a run restored from a checkpoint needs to continue bit for
bit (the rebuilt layout, the iteration count, the comm hook's state)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ._hookcall import hook_name
from .layout import BucketLayout

__all__ = ["ResumeSupport"]

_STATE_VERSION = 1


class ResumeSupport:
    """``state_dict`` / ``load_state_dict`` of :class:`tribucket.Reducer` (it supplies the
    state used here)."""

    def state_dict(self) -> dict:
        """What a resumed run needs: the (rebuilt) layout, the iteration count, hook state."""
        return {
            "version": _STATE_VERSION,
            "parameter_names": list(self._names),
            "layout": self._layout.to_tensor(),
            "rebuilt": self._rebuilt,
            "iterations": self.stats.iterations,
            "passes": self._passes,
            "static_counts": self._static_counts,
            "static_used": self._static_used,
            "hook": hook_name(self._hook),
            "hook_state": hook_state_dict(self._hook_state),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` into a reducer over the same model (before training).

        Register the same comm hook (with a fresh state object) before loading, so its
        state — the gossip schedule, PowerSGD's error feedback and random state — is
        restored too.
        """
        if self._pass is not None:
            raise RuntimeError("load_state_dict cannot run during a backward pass")
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"reducer state version {state.get('version')!r} is not supported "
                             f"(expected {_STATE_VERSION})")
        if state["parameter_names"] != self._names:
            theirs, mine = state["parameter_names"], self._names
            diff = next((k for k in range(min(len(theirs), len(mine))) if theirs[k] != mine[k]),
                        min(len(theirs), len(mine)))
            raise ValueError(f"the saved reducer state is for other parameters: {len(theirs)} "
                             f"saved, {len(mine)} here, first difference at position {diff}")
        if state["hook"] != hook_name(self._hook):
            raise ValueError(f"the saved state was taken with comm hook {state['hook']}; "
                             f"register it (currently {hook_name(self._hook)}) before loading")
        self._layout = BucketLayout.from_tensor(state["layout"], self._params)
        self._rebuilt = bool(state["rebuilt"])
        self._static_counts = state["static_counts"]
        self._static_used = state["static_used"]
        self._ready_order = []
        self.stats.iterations = int(state["iterations"])
        self._passes = int(state.get("passes", state["iterations"]))
        self.stats.rebuilds = int(self._rebuilt)
        self.stats.buckets = len(self._layout.buckets)
        self._allocated = False  # buffers follow the restored layout at the next backward
        load_hook_state(self._hook_state, state.get("hook_state"))


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
