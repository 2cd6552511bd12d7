"""Where an MoE layer's collectives run, and how their failures read.

``MoELayer(..., timeout=...)`` runs the layer's collectives on a group created with that
timeout (one per expert-parallel group and timeout, shared by the layers that ask for the
same), so a stalled peer fails them instead of blocking for the process group's timeout
(30 minutes on gloo). A failure (timeout or dead peer) becomes a ``RuntimeError`` that names
the layer, the phase it was in (``counts``, ``dispatch``, ``combine``, ``backward``) and,
from progress marks each rank leaves in the rendezvous store (only with ``timeout``), the
ranks that fell behind.

Phases of one forward/backward, in order: ``counts`` (the counts all-to-all, the first
collective of a forward), ``dispatch`` (tokens to the experts), ``combine`` (the tokens
back, with each rank's expert-output check), ``backward`` (the reverse exchanges).
"""

from __future__ import annotations

import datetime
import itertools

import torch
import torch.distributed as dist

from ..comm import set_failure_handler
from ..trace import MOE
from ..trace import current as _trace_current

__all__ = ["MoEGuard", "PHASES"]

PHASES = ("counts", "dispatch", "combine", "backward", "gather")  # gather: gathered_experts

# layers are built in the same order on every rank, so this numbers them consistently
_LAYER_SEQ = itertools.count()
# (ranks, timeout) -> the timed group the layers with those share
_TIMED_GROUPS: dict[tuple, dist.ProcessGroup] = {}


def _is_comm_failure(error: BaseException) -> bool:
    text = str(error)
    return isinstance(error, dist.DistError) or any(
        s in text for s in ("gloo", "Connection closed", "Timed out", "NCCL", "timed out"))


class MoEGuard:
    """The collectives' group of one MoE layer, its progress marks and its failure reports."""

    def __init__(self, group, rank: int, world: int, timeout: datetime.timedelta | None,
                 name: str | None):
        self.seq = next(_LAYER_SEQ)
        self.name = name if name is not None else f"#{self.seq}"
        self.rank, self.world = rank, world
        self.group = group
        self.forwards = 0       # forwards begun by this layer (the same count on every rank)
        self.phase = None       # the phase of the last mark
        self._trace = self._trace_rec = None  # the open span of the phase (tracing on)
        self._store = None
        self._ranks = list(range(world))
        if world > 1 and dist.is_initialized():
            self._ranks = dist.get_process_group_ranks(group if group is not None
                                                       else dist.group.WORLD)
        if timeout is not None and world > 1:
            key = (tuple(self._ranks), timeout)
            known = dist.distributed_c10d._world.pg_map  # (destroy_process_group empties it)
            if key not in _TIMED_GROUPS or _TIMED_GROUPS[key] not in known:
                _TIMED_GROUPS[key] = dist.new_group(self._ranks, timeout=timeout,
                                                    use_local_synchronization=True)
            self.group = _TIMED_GROUPS[key]
            try:
                self._store = dist.distributed_c10d._get_default_store()
            except Exception:  # pragma: no cover - a group without a store
                self._store = None
        if world > 1:
            set_failure_handler(self.group, _current_failure)

    # ----------------------------------------------------------------- marks
    def _key(self, global_rank: int) -> str:
        return f"tribucket/moe/{self.seq}/{global_rank}"

    def mark(self, phase: str) -> None:
        """This rank enters ``phase`` (of forward ``self.forwards``); with a tracer open
        (``tribucket.trace``), the previous phase's span ends and ``moe.<phase>`` begins."""
        self.phase = phase
        self.trace_phase(phase)
        _CURRENT[id(self.group)] = self
        if self._store is not None:
            try:
                self._store.set(self._key(self._ranks[self.rank]),
                                f"{self.forwards}:{PHASES.index(phase)}")
            except Exception:  # the store is gone (rank 0 died): the diagnosis says so
                pass

    def trace_phase(self, phase: str) -> None:
        """With a tracer open: end the current phase's span and begin ``moe.<phase>``
        ("backward": an instant, its end is not marked). Called alone, a traced sub-phase
        (the experts' compute) that the failure diagnosis does not track."""
        tr = _trace_current()
        if tr is None and self._trace_rec is None:
            return
        self.end_phase()
        if tr is not None and phase == "backward":
            tr.instant("moe.backward", MOE, {"layer": self.name})
        elif tr is not None:
            self._trace = tr
            self._trace_rec = tr.begin(f"moe.{phase}", MOE, {"layer": self.name})

    def end_phase(self) -> None:
        """End the traced span of the current phase (the end of forward, or the next)."""
        rec, self._trace_rec = self._trace_rec, None
        if rec is not None:
            self._trace.end(rec)

    def backward_mark(self, grad):
        """Tensor hook on the layer's output: its backward (the reverse exchanges) begins."""
        self.mark("backward")

    def failure_of(self, error: BaseException) -> BaseException | None:
        """The diagnosed error for a failed collective of this layer (None: not one)."""
        if not _is_comm_failure(error) or isinstance(error, _LayerFailure):
            return None
        return self.failure(error)

    # ----------------------------------------------------------------- diagnosis
    def _behind(self) -> str:
        if self._store is None:
            return (" Pass MoELayer(..., timeout=datetime.timedelta(...)) to have it name the "
                    "missing rank and fail at that timeout.")
        me = (self.forwards, PHASES.index(self.phase))
        try:
            behind = []
            for r, g in enumerate(self._ranks):
                if r == self.rank:
                    continue
                key = self._key(g)
                seen = self._store.get(key).decode() if self._store.check([key]) else None
                where = tuple(map(int, seen.split(":"))) if seen else None
                if self.phase == "gather":  # a peer not in the gather is the one missing
                    if where is None or PHASES[where[1]] != "gather":
                        last = ("never entered this layer" if where is None else
                                f"in forward {where[0]}, {PHASES[where[1]]} phase")
                        behind.append(f"rank {r} (global rank {g}; not in gathered_experts: "
                                      f"{last})")
                elif where is not None and PHASES[where[1]] == "gather":
                    behind.append(f"rank {r} (global rank {g}; inside "
                                  "tribucket.moe.gathered_experts, which every rank of the "
                                  "group must enter together)")
                elif where is None or where < me:
                    last = ("never entered this layer" if where is None else
                            f"last in forward {where[0]}, {PHASES[where[1]]} phase")
                    behind.append(f"rank {r} (global rank {g}; {last})")
        except Exception:
            return " The rendezvous store is unreachable too: rank 0 (which hosts it) may be dead."
        if not behind:
            return " Every rank reached this phase: a rank failed inside it."
        hint = ""
        if self.phase == "gather":
            hint = (" Entering tribucket.moe.gathered_experts is a collective (an all-gather of "
                    "the experts): enter it on every rank of the group, then evaluate on the "
                    "ranks you want inside it.")
        elif self.phase == "counts":
            hint = (" If those ranks skipped this forward on purpose (evaluating on some ranks "
                    "only), evaluate inside `with tribucket.moe.gathered_experts(model):`, "
                    "entered on every rank.")
        return f" Behind this rank: {', '.join(behind)}.{hint}"

    def failure(self, error: BaseException) -> "_LayerFailure":
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return _LayerFailure(
            f"tribucket MoE layer {self.name!r} (rank {self.rank} of its expert-parallel group) "
            f"failed in its {self.phase} phase of forward {self.forwards}: {first}."
            f"{self._behind()} The process group cannot be used any more; end the job "
            "(torchrun restarts it) and resume from a checkpoint.")


class _LayerFailure(RuntimeError):
    """A communication failure inside an MoE layer, diagnosed."""


# id(group) -> the guard that marked a phase on it last (the layer whose collectives run)
_CURRENT: dict[int, MoEGuard] = {}


def _current_failure(group, error: BaseException) -> BaseException | None:
    """The comm layer's failure handler: the diagnosis of the layer running on ``group``."""
    guard = _CURRENT.get(id(group))
    return None if guard is None else guard.failure_of(error)


def trace_backward(tr, name: str, y_TD: torch.Tensor, outputs, inputs,
                   x_TD: torch.Tensor) -> None:
    """``moe.combine.bwd``, ``moe.experts.bwd`` and ``moe.dispatch.bwd`` on tracer ``tr``:
    from the gradient of each region's output to that of its input. Of per-expert (or
    per-source) lists, the first tensor: autograd reaches it last, its gradient closes the
    experts' backward."""
    def one(ts):
        if isinstance(ts, torch.Tensor):
            return ts
        return next((t for t in ts if t.requires_grad), None)

    out, inp = one(outputs), one(inputs)
    if out is None or inp is None:
        return
    args = {"layer": name}
    tr.backward_range("moe.combine.bwd", y_TD, out, args=args)
    tr.backward_range("moe.experts.bwd", out, inp, args=args)
    tr.backward_range("moe.dispatch.bwd", inp, x_TD, args=args)
