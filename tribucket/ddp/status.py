"""The end-of-backward status: one small allreduce (or a tail on the last bucket's) that
tells every rank which ranks missed gradients or misused the reducer and (when needed) the
global used map, so an error is raised on every rank instead of leaving one waiting in a
collective. (Whether a gradient is inf/NaN needs no agreement: every rank reads it from the
same reduced values, see ``tribucket/_epilogue.py``.)

Layout of the status vector:
``[problems per rank (world) | step mark per rank (world) | optimizer mark per rank (world)
| used map]``.
Each rank writes only its own slots, so the sum is exact even in a bf16 wire buffer (every
integer up to 256 is a bf16 value): the step mark is ``1 + forwards mod 255`` (the training
step), the optimizer mark ``1 + optimizer steps mod 255`` (see :meth:`Status.check_steps`),
both 0 for "not checked" (a Join shadow pass).
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from .watchdog import CommGuard

__all__ = ["Pending", "Status", "second_gradient_error", "static_graph_error"]


class Pending:
    """A pass's reduced status on its way to the host (``deferred_status``): a copy that the
    device writes when it gets there (pinned memory behind an event on a GPU), and what this
    rank knew of the pass to report it."""

    __slots__ = ("host", "event", "iteration", "missing", "errors")

    def __init__(self, host: torch.Tensor, event, iteration: int, missing: list[str],
                 errors: list[str]):
        self.host, self.event, self.iteration = host, event, iteration
        self.missing, self.errors = missing, errors


class Status:
    """Builds, sends and reads the status of one reducer (its inputs are passed in)."""

    def __init__(self, guard: CommGuard, rank: int, world_size: int, n_params: int,
                 device: torch.device, with_used_map: bool):
        self.guard, self.rank, self.world_size = guard, rank, world_size
        self.device = device
        # room for the used map (find_unused_parameters or static_graph): the length is
        # fixed, so the tail of the last bucket can hold it
        self.length = 3 * world_size + (n_params if with_used_map else 0)
        self.static_graph = False  # the advice of a missing gradient (set by Backward)

    @staticmethod
    def marks(p) -> tuple[int, int]:
        """What this rank writes in its step and optimizer slots for pass ``p``."""
        if p.shadow:
            return 0, 0
        return 1 + p.step % 255, 1 + p.opt_step % 255

    def tensor(self, problems: int, used: list | None, step_mark: int = 0,
               opt_mark: int = 0) -> torch.Tensor:
        """This rank's status; ``used`` (0/1 per parameter) or None when not needed."""
        ws = self.world_size
        # on a GPU, built in pinned memory: a copy from pageable memory would wait for the
        # device to finish the work queued before it (the backward)
        status = torch.zeros(3 * ws + (len(used) if used is not None else 0),
                             dtype=torch.float32, pin_memory=self.device.type == "cuda")
        status[self.rank] = problems
        status[ws + self.rank] = step_mark
        status[2 * ws + self.rank] = opt_mark
        if used is not None:
            status[3 * ws:] = torch.tensor(used, dtype=status.dtype)
        return status.to(self.device, non_blocking=True)

    def write_tail(self, buf: torch.Tensor, status: torch.Tensor) -> int:
        """Write ``status`` into the last ``length`` elements of ``buf``; return ``length``."""
        n = self.length
        tail = buf.narrow(0, buf.numel() - n, n)
        tail.zero_()
        tail[: status.numel()].copy_(status)
        return n

    def read_tail(self, buf: torch.Tensor) -> torch.Tensor:
        """The status in the tail of ``buf``, on ``buf``'s device (a view of it in fp32)."""
        n = self.length
        return buf.narrow(0, buf.numel() - n, n).float()

    def defer(self, status: torch.Tensor, iteration: int, missing: list[str],
              errors: list[str]) -> Pending:
        """Start copying the reduced ``status`` to the host without waiting for it (read it
        with :meth:`read`); ``missing`` and ``errors``: this rank's, for the report."""
        if status.device.type == "cuda":
            host = torch.empty(status.numel(), dtype=torch.float32, pin_memory=True)
            host.copy_(status.float(), non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:  # (the status may be a view of a bucket's buffer, which the next pass reuses)
            host, event = status.float().clone(), None
        return Pending(host, event, iteration, missing, errors)

    @staticmethod
    def read(pending: Pending) -> torch.Tensor:
        """The deferred status on the host, once the device has written it."""
        if pending.event is not None:
            pending.event.synchronize()
        return pending.host

    def launch(self, status: torch.Tensor, iteration: int):
        """Start the status allreduce (None with one rank)."""
        if self.world_size == 1:
            return None
        self.guard.fingerprint("status", iteration, 0, status.numel(), status.dtype)
        return dist.all_reduce(status, group=self.guard.group, async_op=True)

    def wait(self, work, iteration: int) -> None:
        if work is not None:
            self.guard.wait(work, "the end-of-backward status allreduce", iteration)

    def exchange(self, buckets: list, tail_buffer: torch.Tensor | None,
                 make_status: Callable[[], torch.Tensor], serialize: bool,
                 iteration: int) -> tuple[list, torch.Tensor, float]:
        """Wait for every bucket's result and agree on the status across ranks: returns the
        results, the reduced status (on the device: reading it on the host waits for the
        device) and the seconds spent waiting on the status.

        ``tail_buffer``: the last bucket's buffer when the status rode in its tail (read it
        back once the bucket is reduced); else the status is ``make_status()``, sent on its
        own, after the buckets when a hook's callbacks may still issue collectives
        (``serialize``)."""
        start = time.perf_counter()
        if tail_buffer is not None:
            results = [b.wait() for b in buckets]
            return results, self.read_tail(tail_buffer), time.perf_counter() - start
        status = make_status()
        work = None if serialize else self.launch(status, iteration)
        results = [b.wait() for b in buckets]
        if serialize:
            work = self.launch(status, iteration)
        start = time.perf_counter()
        self.wait(work, iteration)
        return results, status, time.perf_counter() - start

    def problems(self, status: torch.Tensor) -> list[float]:
        return status[: self.world_size].tolist()

    def used(self, status: torch.Tensor) -> list[bool]:
        return (status[3 * self.world_size:] > 0).tolist()

    def check_steps(self, status: torch.Tensor) -> None:
        """Raise on every rank if the ranks are not in the backward of the same training step.

        The step is the number of training-mode forwards with grad enabled this rank ran
        before the backward began: a rank that ran a forward without backward, or one more
        backward, pairs its collectives with another step of its peers."""
        ws = self.world_size
        marks = [int(m) for m in status[ws: 2 * ws].tolist()]
        opt_marks = [int(m) for m in status[2 * ws: 3 * ws].tolist()]
        if len({m for m in marks if m > 0}) <= 1:
            if len({m for m in opt_marks if m > 0}) <= 1:
                return
            seen = ", ".join(f"rank {r}: after optimizer step {m - 1}"
                             for r, m in enumerate(opt_marks) if m > 0)
            raise RuntimeError(
                f"tribucket (rank {self.rank}): the ranks are not in the backward of the same "
                f"training step ({seen}; counted modulo 255 since the reducer was attached or "
                "last found ranks out of step): a rank ran an extra forward and backward (or "
                "one fewer) without an optimizer step, or took an optimizer step its peers did "
                "not, so this backward would average two different steps. This backward's "
                "gradients were not averaged; the pass that rank ran extra was averaged with "
                "its peers' previous step. The ranks' training loops are now one iteration "
                "apart: end the job and resume from a checkpoint, and run the same forwards, "
                "backwards and optimizer steps on every rank (a forward and backward for "
                "inspection on one rank only: run it on a copy of the model).")
        seen = ", ".join(f"rank {r}: training forward {m - 1}" for r, m in enumerate(marks)
                         if m > 0)
        raise RuntimeError(
            f"tribucket (rank {self.rank}): the ranks are not in the backward of the same "
            f"training step ({seen}; counted modulo 255): a rank ran a forward without a "
            "backward, or one more backward than the others, so their gradients would mix "
            "two steps. This backward's gradients were not averaged. Run the same forwards "
            "(in training mode with grad enabled) and backwards on every rank; evaluate under "
            "torch.no_grad() or model.eval(). If a backward raised on one rank before it "
            "reached the model (an error in the loss's backward, out of memory), call "
            "reducer.backward_failed() on that rank where you catch the error, so every rank "
            "reports that step and the next one is in step. debug=True names the first "
            "collective that differs.")

    def raise_problems(self, missing_names: list[str], counts: list[float],
                       errors: list[str], frozen: list[str] = (),
                       replaced: list[str] = ()) -> None:
        """Raise the error every rank raises when some rank reported a problem (``frozen``:
        those of ``missing_names`` that no longer require grad; ``replaced``: those that
        changed dtype or device, or lost their gradient accumulator)."""
        ranks = [f"rank {r}: {int(c)}" for r, c in enumerate(counts) if c > 0]
        if errors:
            raise RuntimeError(f"tribucket (rank {self.rank}): {errors[0]}"
                               + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""))
        if not missing_names:
            raise RuntimeError(
                f"tribucket: another rank reported a problem in this backward pass "
                f"({', '.join(ranks)}); see its error. This rank's gradients were not averaged.")
        names = missing_names
        why = ""
        if frozen:
            why = (f" {len(frozen)} of them no longer require grad ({_listed(frozen, 10)}): the "
                   "reducer averages the parameters that required grad when it was built. "
                   + _reenter("freezing"))
        if replaced:
            why += " " + replaced_error(replaced, {}, lead=False)
        raise RuntimeError(
            "tribucket: some parameters received no gradient in this backward pass "
            f"({', '.join(ranks)} parameters missing). This rank ({self.rank}) got no gradient "
            f"for: {_listed(names, 20)}.{why} Every rank "
            "still completed its collectives, so none is left waiting. " + (
                "static_graph=True: these got a gradient in the first iteration and none now, "
                "so the graph changed, which static_graph does not allow; if the set of "
                "parameters used changes between iterations, pass find_unused_parameters=True "
                "instead of static_graph." if self.static_graph else
                "If parts of the model are legitimately unused, pass "
                "find_unused_parameters=True to fused_bucketing (or static_graph=True if the "
                "unused set never changes); otherwise make sure every parameter contributes to "
                "the loss."))


def _listed(names: list[str], limit: int) -> str:
    return ", ".join(names[:limit]) + (" ..." if len(names) > limit else "")


def _reenter(change: str) -> str:
    """The fix for a requires_grad changed after the reducer was built."""
    return (f"After changing requires_grad ({change} layers, for example), leave "
            "fused_bucketing and enter it again (or build a new DistributedDataParallel): the "
            "new reducer averages the new set.")


class EntryTypes:
    """Each parameter's dtype and device on entering ``fused_bucketing``. ``param.data`` set
    to another (model.half(), .to(...)) makes torch drop its gradient accumulator, and the
    native hooks with it, and the buckets hold the old dtype. Checked at each training
    forward for ``sample``, one parameter of each dtype and device (in full on the error
    paths)."""

    def __init__(self, params: list[torch.Tensor], names: list[str]):
        self.params, self.names = params, names
        self.types = [(p.dtype, p.device) for p in params]
        first: dict = {}
        for i, t in enumerate(self.types):
            first.setdefault(t, i)
        self.sample = list(first.values())  # the first parameter of each dtype and device

    def changed(self, indices: Iterable[int] | None = None) -> list[int]:
        """The parameters (of ``indices``; all by default) whose dtype or device is not the
        one they had on entering."""
        params, types = self.params, self.types
        return [i for i in (range(len(params)) if indices is None else indices)
                if (params[i].dtype, params[i].device) != types[i]]

    def error(self, indices: list[int]) -> str:
        """The error of parameters ``indices``, whose dtype or device changed."""
        def told(dtype, device):
            return f"{str(dtype).removeprefix('torch.')} on {device}"
        changes: dict[str, list[str]] = {}
        for i in indices:
            q = self.params[i]
            changes.setdefault(f"{told(*self.types[i])} -> {told(q.dtype, q.device)}",
                               []).append(self.names[i])
        return replaced_error([self.names[i] for i in indices], changes)


def replaced_error(names: list[str], changes: dict[str, list[str]],
                   lead: bool = True) -> str:
    """The error of parameters ``names`` whose dtype or device changed after entering
    ``fused_bucketing`` (``changes``: ``{"was -> now": names}``, where known), or whose
    gradient accumulator torch replaced (``param.data`` set to another dtype or device and
    back)."""
    listed = ("; ".join(f"{change}: {_listed(ns, 10)}" for change, ns in changes.items())
              if changes else _listed(names, 10))
    what = (f"{len(names)} parameter(s) changed dtype or device after the reducer was built "
            f"(fused_bucketing entered, or DistributedDataParallel built), or were converted "
            f"and back ({listed})")
    return ((f"tribucket: {what}. " if lead else f"{what[0].upper()}{what[1:]}. ")
            + "Setting param.data to another dtype or device (model.half(), model.double(), "
            "model.to(...), also when converted back) makes torch drop each one's gradient "
            "accumulator, with the reducer's hooks, and its buckets hold the dtype and "
            "device of entering, so these gradients would not be averaged (torch DDP leaves "
            "them so, silently). Convert the model before entering; or leave fused_bucketing "
            "and enter it again (or build a new DistributedDataParallel): the new reducer "
            "averages the parameters as they are now.")


def unfrozen_error(names: list[str]) -> str:
    """The error of a training forward after parameters that were frozen on entering
    ``fused_bucketing`` were set to require grad."""
    return (f"tribucket: {len(names)} parameter(s) did not require grad when the reducer "
            "was built (fused_bucketing entered, or DistributedDataParallel built) and require "
            f"it now ({_listed(names, 10)}). The reducer averages the "
            "parameters that required grad when it was built, so these would train on each "
            "rank's own gradient and the ranks' models would drift apart (torch DDP lets them, "
            "silently). " + _reenter("unfreezing") + " A parameter meant to train on each rank "
            "alone belongs in ignore_parameters.")


def second_gradient_error(name: str, found_unused: bool) -> str:
    """The misuse message when parameter ``name`` gets a gradient twice in one pass."""
    if found_unused:
        return (f"parameter {name!r} was found unused after the forward (no path from the "
                "forward's outputs reaches it) but then received a gradient. The usual cause "
                "is reentrant activation checkpointing (torch.utils.checkpoint with "
                "use_reentrant=True, or a Hugging Face model's "
                "gradient_checkpointing_enable() with use_reentrant=True), which hides the "
                "checkpointed layers from the forward's graph: pass use_reentrant=False, or "
                "static_graph=True when the same parameters are used every iteration. "
                "Otherwise the parameter is used outside the model's forward: compute the "
                "loss from the model's outputs")
    return (f"parameter {name!r} received a second gradient in the same backward pass. "
            "Causes: the parameter is used in several reentrant backward passes "
            "(torch.utils.checkpoint with use_reentrant=True: pass static_graph=True or "
            "use use_reentrant=False), or it is used outside the model's forward in "
            "another graph")


def static_graph_error(name: str, fired: int, expected: int) -> str:
    """The misuse message when a static graph's parameter gets more gradients than in the
    first iteration."""
    return (f"static_graph=True: parameter {name!r} received {fired} gradient(s) in this "
            f"backward but {expected} in the first iteration: the graph changed, which "
            "static_graph does not allow")
