"""The reducer's own collectives: a group with a timeout, failure diagnosis, fingerprints.

``Future.wait()`` has no timeout and ``destroy_process_group`` can block on a stalled peer,
so with ``fused_bucketing(..., timeout=...)`` the reducer runs its collectives on a dedicated
subgroup created with that timeout: gloo (and NCCL) fail its operations when it passes, and
the reducer turns the failure into a ``RuntimeError`` that says which bucket and, from
progress marks in the rendezvous store, which rank fell behind.

With ``debug=True`` (or ``TRIBUCKET_DEBUG=1``) every reducer collective is preceded by an
all-gather of a fingerprint (what, iteration, bucket, elements, dtype), as torch's
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` does for every collective: ranks whose control flow
diverged get an error naming the first differing bucket instead of a deadlock.
"""

from __future__ import annotations

import datetime
import itertools
import logging

import torch
import torch.distributed as dist

__all__ = ["CommGuard"]

logger = logging.getLogger("tribucket")

# Reducers are created in the same order on every rank, so this names them consistently.
_REDUCER_SEQ = itertools.count()

_KINDS = {"bucket": 1, "status": 2, "rebuild": 3, "buffers": 4, "join": 5}
_KIND_NAMES = {v: k for k, v in _KINDS.items()}
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
           torch.int32, torch.uint8, torch.bool, torch.int8, torch.int16, torch.complex64,
           torch.complex128]


def _dtype_code(dtype: torch.dtype | None) -> int:
    return _DTYPES.index(dtype) + 1 if dtype in _DTYPES else 0


def _dtype_name(code: int) -> str:
    return str(_DTYPES[code - 1]).replace("torch.", "") if 0 < code <= len(_DTYPES) else "-"


class CommGuard:
    """Where the reducer's collectives run, and what happens when one fails."""

    def __init__(self, process_group, rank: int, world_size: int, device: torch.device,
                 timeout: datetime.timedelta | None, debug: bool):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.timeout, self.debug = timeout, debug
        self.seq = next(_REDUCER_SEQ)
        self.failed = False  # a collective of this reducer failed: the group is unusable
        self.group = process_group
        if world_size > 1 and (timeout is not None or debug):
            # debug fingerprints travel on their own group too, so they never interleave with
            # the collectives a comm hook launches from another thread on the user's group
            kwargs = {"timeout": timeout} if timeout is not None else {}
            self.group = dist.new_group(dist.get_process_group_ranks(process_group),
                                        backend=dist.get_backend(process_group),
                                        use_local_synchronization=True, **kwargs)
        self.dedicated = self.group is not process_group
        self._store = None
        if timeout is not None and world_size > 1:
            try:
                self._store = dist.distributed_c10d._get_default_store()
            except Exception:  # pragma: no cover - a group without a store
                self._store = None

    def group_arg(self):
        return None if self.group is dist.group.WORLD else self.group

    # ----------------------------------------------------------------- progress and failure
    def _key(self, rank: int) -> str:
        return f"tribucket/{self.seq}/progress/{rank}"

    def mark_progress(self, iteration: int) -> None:
        """Record in the rendezvous store that this rank started backward ``iteration``."""
        if self._store is None:
            return
        try:
            self._store.set(self._key(self.rank), str(iteration))
        except Exception:  # the store is gone (rank 0 died): diagnosis will say so
            pass

    def _who_is_behind(self, iteration: int) -> str:
        if self._store is None:
            return (" Pass timeout=datetime.timedelta(...) to fused_bucketing to have it name "
                    "the missing rank and fail at that timeout.")
        try:
            behind = []
            for r in range(self.world_size):
                if r == self.rank:
                    continue
                key = self._key(r)
                seen = int(self._store.get(key)) if self._store.check([key]) else None
                if seen is None or seen < iteration:
                    behind.append(f"rank {r} (last started backward "
                                  f"{'never' if seen is None else f'iteration {seen}'})")
            if behind:
                return (f" This rank is in iteration {iteration}; behind it: "
                        f"{', '.join(behind)} - it crashed, stalled, or left the training loop.")
            return " Every rank reached this iteration: a rank failed inside it."
        except Exception:
            return " The rendezvous store is unreachable too: rank 0 (which hosts it) may be dead."

    def wait(self, work, what: str, iteration: int):
        """``work.wait()``, turning a failure (timeout, dead peer) into a clear error."""
        try:
            return work.wait()
        except Exception as e:
            self.failed = True
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RuntimeError(
                f"tribucket (rank {self.rank}): {what} did not complete: {first}."
                f"{self._who_is_behind(iteration)} The process group cannot be used any more; "
                "end the job (torchrun restarts it) and resume from a checkpoint.") from e

    # ----------------------------------------------------------------- debug fingerprints
    def fingerprint(self, kind: str, iteration: int, bucket: int, numel: int,
                    dtype: torch.dtype | None) -> None:
        """All-gather what this rank is about to communicate; raise if the ranks differ."""
        if not self.debug or self.world_size == 1:
            return
        row = torch.tensor([_KINDS[kind], iteration, bucket, numel, _dtype_code(dtype)],
                           dtype=torch.int64, device=self.device)
        rows = [torch.empty_like(row) for _ in range(self.world_size)]
        self.wait(dist.all_gather(rows, row, group=self.group, async_op=True),
                  f"debug fingerprint before {kind} {bucket}", iteration)
        table = [r.tolist() for r in rows]
        if all(t == table[0] for t in table):
            return

        def describe(t):
            return (f"{_KIND_NAMES.get(t[0], '?')} {t[2]} of iteration {t[1]} "
                    f"({t[3]} elements of {_dtype_name(t[4])})")

        lines = "; ".join(f"rank {r}: {describe(t)}" for r, t in enumerate(table))
        raise RuntimeError(
            f"tribucket debug: the ranks diverged at {kind} {bucket} of iteration {iteration} "
            f"(the first collective that differs): {lines}. Their control "
            "flow differs (a rank skipped a backward, ran one under no_sync, registered another "
            "hook or built another model), so their collectives no longer pair up.")
