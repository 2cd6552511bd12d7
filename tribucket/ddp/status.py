"""The end-of-backward status: one small allreduce (or a tail on the last bucket's) that
tells every rank which ranks missed gradients or misused the reducer, whether any fp16
gradient overflowed, and (when needed) the global used map, so an error is raised on every
rank instead of leaving one waiting in a collective.

Layout of the status vector: ``[problems per rank..., overflow flag, used map...]``.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

from .watchdog import CommGuard

__all__ = ["Status", "second_gradient_error", "static_graph_error"]


class Status:
    """Builds, sends and reads the status of one reducer (its inputs are passed in)."""

    def __init__(self, guard: CommGuard, rank: int, world_size: int, n_params: int,
                 device: torch.device, with_used_map: bool):
        self.guard, self.rank, self.world_size = guard, rank, world_size
        self.device = device
        # room for the used map (find_unused_parameters or static_graph): the length is
        # fixed, so the tail of the last bucket can hold it
        self.length = world_size + 1 + (n_params if with_used_map else 0)

    def tensor(self, problems: int, overflow: float, used: list | None) -> torch.Tensor:
        """This rank's status; ``used`` (0/1 per parameter) or None when not needed."""
        status = torch.zeros(self.world_size + 1 + (len(used) if used is not None else 0),
                             dtype=torch.float32)
        status[self.rank] = problems
        status[self.world_size] = overflow
        if used is not None:
            status[self.world_size + 1:] = torch.tensor(used, dtype=status.dtype)
        return status.to(self.device)

    def write_tail(self, buf: torch.Tensor, status: torch.Tensor) -> int:
        """Write ``status`` into the last ``length`` elements of ``buf``; return ``length``."""
        n = self.length
        tail = buf.narrow(0, buf.numel() - n, n)
        tail.zero_()
        tail[: status.numel()].copy_(status)
        return n

    def read_tail(self, buf: torch.Tensor) -> torch.Tensor:
        n = self.length
        return buf.narrow(0, buf.numel() - n, n).float().cpu()

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
        results, the reduced status and the seconds spent waiting on the status.

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

    def overflow(self, status: torch.Tensor) -> bool:
        return status[self.world_size].item() > 0

    def used(self, status: torch.Tensor) -> list[bool]:
        return (status[self.world_size + 1:] > 0).tolist()

    def raise_problems(self, missing_names: list[str], counts: list[float],
                       errors: list[str]) -> None:
        """Raise the error every rank raises when some rank reported a problem."""
        ranks = [f"rank {r}: {int(c)}" for r, c in enumerate(counts) if c > 0]
        if errors:
            raise RuntimeError(f"tribucket (rank {self.rank}): {errors[0]}"
                               + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""))
        if not missing_names:
            raise RuntimeError(
                f"tribucket: another rank reported a problem in this backward pass "
                f"({', '.join(ranks)}); see its error. This rank's gradients were not averaged.")
        names = missing_names
        raise RuntimeError(
            "tribucket: some parameters received no gradient in this backward pass "
            f"({', '.join(ranks)} parameters missing). This rank ({self.rank}) got no gradient "
            f"for: {', '.join(names[:20])}{' ...' if len(names) > 20 else ''}. Every rank "
            "still completed its collectives, so none is left waiting. If parts of the model "
            "are legitimately unused, pass find_unused_parameters=True to fused_bucketing (or "
            "static_graph=True if the unused set never changes); otherwise make sure every "
            "parameter contributes to the loss.")


def second_gradient_error(name: str, found_unused: bool) -> str:
    """The misuse message when parameter ``name`` gets a gradient twice in one pass."""
    if found_unused:
        return (f"parameter {name!r} was found unused after the forward (no path from the "
                "forward's outputs reaches it) but then received a gradient; compute the "
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
