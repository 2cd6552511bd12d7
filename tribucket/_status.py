"""The end-of-backward status: one small allreduce (or a tail on the last bucket's) that
tells every rank which ranks missed gradients or misused the reducer, whether any fp16
gradient overflowed, and (``find_unused_parameters``) the global used map, so an error is
raised on every rank instead of leaving one waiting in a collective."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ._pass import _Pass

__all__ = ["StatusSupport"]


class StatusSupport:
    """The status half of :class:`tribucket.Reducer` (it supplies the state used here)."""

    def _status_len(self) -> int:
        cfg = self.config
        used = cfg.find_unused_parameters or cfg.static_graph
        return self.world_size + 1 + (len(self._params) if used else 0)

    def _local_used(self, p: _Pass) -> list | None:
        """This rank's used map when the global one is needed this iteration, else None."""
        cfg = self.config
        if not (cfg.find_unused_parameters or (cfg.static_graph and self._static_used is None)):
            return None
        if p.shadow:
            return [0.0] * len(self._params)
        # locally used: the hook fired with a gradient (DDP's local_used_map)
        return [1.0 if (f > 0 and (self._shards is not None
                                               or self._params[i].grad is not None)) else 0.0
                for i, f in enumerate(p.fired)]

    def _exchange_status(self, p: _Pass, problems: int,
                         used: list | None) -> tuple[list, torch.Tensor, float]:
        """Wait for every bucket's result and agree on the status across ranks: returns the
        results, the reduced status and the seconds spent waiting on the status."""
        start = time.perf_counter()
        if self._piggyback:  # written into the last bucket when it was sent
            results = self._wait_buckets(p)
            return results, self._read_status(), time.perf_counter() - start
        status = self._status_tensor(problems, used)
        work = None if self._traits.serialize else self._launch_status(status)
        results = self._wait_buckets(p)
        if self._traits.serialize:  # hook callbacks may still be issuing collectives
            work = self._launch_status(status)
        start = time.perf_counter()
        if work is not None:
            self._guard.wait(work, "the end-of-backward status allreduce", self._passes)
        return results, status, time.perf_counter() - start

    def _write_status(self, p: _Pass, buf: torch.Tensor) -> int:
        """Write the status into the tail of the last bucket's buffer; return its length."""
        problems = 0 if p.shadow else (len(self._params) - sum(p.ready)) + len(p.errors)
        p.status_errors = len(p.errors)
        status = self._status_tensor(problems, self._local_used(p))
        n = self._status_len()
        tail = buf.narrow(0, buf.numel() - n, n)
        tail.zero_()
        tail[: status.numel()].copy_(status)
        return n

    def _read_status(self) -> torch.Tensor:
        mem = self._mem[-1]
        n = self._status_len()
        return mem.active.narrow(0, mem.active.numel() - n, n).float().cpu()

    def _status_tensor(self, problems: int, used: list | None) -> torch.Tensor:
        """``[problems per rank..., overflow flag, used map...]``: one allreduce tells all."""
        status = torch.zeros(self.world_size + 1 + (len(used) if used is not None else 0),
                             dtype=torch.float32)
        status[self.rank] = problems
        if self._traits.check_overflow:
            status[self.world_size] = float(self.found_inf.item())
        if used is not None:
            status[self.world_size + 1:] = torch.tensor(used, dtype=status.dtype)
        return status.to(self._device)

    def _launch_status(self, status: torch.Tensor):
        if self.world_size == 1:
            return None
        self._guard.fingerprint("status", self._passes, 0, status.numel(), status.dtype)
        return dist.all_reduce(status, group=self._guard.group, async_op=True)

    def _raise_missing(self, missing: list[int], counts: list[float], errors: list[str]) -> None:
        ranks = [f"rank {r}: {int(c)}" for r, c in enumerate(counts) if c > 0]
        if errors:
            raise RuntimeError(f"tribucket (rank {self.rank}): {errors[0]}"
                               + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""))
        if not missing:
            raise RuntimeError(
                f"tribucket: another rank reported a problem in this backward pass "
                f"({', '.join(ranks)}); see its error. This rank's gradients were not averaged.")
        names = [self._names[i] for i in missing]
        raise RuntimeError(
            "tribucket: some parameters received no gradient in this backward pass "
            f"({', '.join(ranks)} parameters missing). This rank ({self.rank}) got no gradient "
            f"for: {', '.join(names[:20])}{' ...' if len(names) > 20 else ''}. Every rank "
            "still completed its collectives, so none is left waiting. If parts of the model "
            "are legitimately unused, pass find_unused_parameters=True to fused_bucketing (or "
            "static_graph=True if the unused set never changes); otherwise make sure every "
            "parameter contributes to the loss.")
