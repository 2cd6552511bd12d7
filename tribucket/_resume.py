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

from ._hookcall import hook_name
from ._model import verify_state_across_ranks
from .layout import BucketLayout

__all__ = ["ResumeSupport"]

_STATE_VERSION = 2
_SHARED_KEY = "hook_state"


class ResumeSupport:
    """``state_dict`` / ``load_state_dict`` of :class:`tribucket.Reducer` (it supplies the
    state used here)."""

    def state_dict(self) -> dict:
        """What a resumed run needs: the (rebuilt) layout, the iteration count, hook state."""
        state = {
            "version": _STATE_VERSION,
            "world_size": self.world_size,
            "parameter_names": list(self._names),
            "layout": self._layout.to_tensor().tolist(),
            "rebuilt": self._rebuilt,
            "iterations": self.stats.iterations,
            "passes": self._passes,
            "static_counts": self._static_counts,
            "static_used": self._static_used,
            "hook": hook_name(self._hook),
        }
        saved = hook_state_dict(self._hook_state)
        if saved is not None:
            key = _hook_key(self._hook_state, self.rank)
            state[key] = _to_bytes({"rank": self.rank, "world_size": self.world_size,
                                    "state": saved})
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` into a reducer over the same model, on every rank,
        before the first backward.

        Register the same comm hook (with a fresh state object) before loading, so its
        state — the gossip schedule, PowerSGD's error feedback and random state — is
        restored too. The first backward checks that every rank loaded the same state.
        """
        if self._pass is not None or self._passes > 0:
            raise RuntimeError("load_state_dict must be called before the first backward pass "
                               "(on every rank), right after entering fused_bucketing and "
                               "registering the comm hook")
        if state.get("version") not in (1, _STATE_VERSION):
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
        hook_saved = self._hook_state_to_load(state)
        self._layout = BucketLayout.from_tensor(torch.as_tensor(state["layout"]), self._params)
        self._rebuilt = bool(state["rebuilt"])
        self._static_counts = state["static_counts"]
        self._static_used = state["static_used"]
        self._ready_order = []
        self.stats.iterations = int(state["iterations"])
        self._passes = int(state.get("passes", state["iterations"]))
        self.stats.rebuilds = int(self._rebuilt)
        self.stats.buckets = len(self._layout.buckets)
        self._allocated = False  # buffers follow the restored layout at the next backward
        load_hook_state(self._hook_state, hook_saved)
        self._agree_pending = True

    def _hook_state_to_load(self, state: dict) -> Any:
        """The hook state this rank must load; raise if the checkpoint holds another rank's
        or another world size's."""
        if state.get("version") == 1:
            return state.get("hook_state")
        mine = _hook_key(self._hook_state, self.rank)
        found = [k for k in state if k == _SHARED_KEY or k.startswith(_SHARED_KEY + ".rank")]
        if not found:
            return None
        if mine not in state:
            other = _from_bytes(state[found[0]])
            raise ValueError(
                f"the comm hook state in this checkpoint was saved by rank {other['rank']} of "
                f"{other['world_size']}; this is rank {self.rank}, and the state of "
                f"{hook_name(self._hook)} is each rank's own (its error feedback is of that "
                "rank's gradients). Save reducer.state_dict() on every rank (a file per rank, "
                "or torch.distributed.checkpoint) and load each rank's own.")
        entry = _from_bytes(state[mine])
        if entry["world_size"] != self.world_size:
            raise ValueError(
                f"the comm hook state was saved with world size {entry['world_size']}; this "
                f"run has {self.world_size} ranks. Resume with the same world size, or "
                "register a fresh hook state without loading it.")
        return entry["state"]

    def _agree_on_state(self) -> None:
        """At the first synchronised backward after entering or loading: every rank must hold
        the same layout, iteration count, comm hook and hook schedule (one all-gather)."""
        self._agree_pending = False
        state = self._hook_state
        summary = {
            "comm hook": hook_name(self._hook),
            "wire dtype": str(self._traits.wire_dtype),
            "rebuilt layout": self._rebuilt,
            "buckets": len(self._layout.buckets),
            "layout": self._layout.to_tensor().tolist(),
            "iterations": self.stats.iterations,
            "static_graph record": (self._static_counts, self._static_used),
            "hook state iteration": getattr(state, "iteration", getattr(state, "iter", None)),
        }
        verify_state_across_ranks(
            summary, self._guard.group, self.world_size,
            "Register the same comm hook on every rank, and call load_state_dict on every "
            "rank with the same checkpoint (or on none).")


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
