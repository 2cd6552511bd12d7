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

import contextlib
import datetime
import itertools
import logging
import os
import re
import sys
import tempfile
import threading
from typing import Callable

import torch
import torch.distributed as dist

__all__ = ["CommGuard"]

logger = logging.getLogger("tribucket")

def _describe_progress(seen: int | None) -> str:
    if seen is None:
        return "never started a backward"
    if seen % 2:
        return f"last finished backward iteration {seen // 2}"
    return f"started backward iteration {seen // 2} but has not finished it"


# whole words only: "peer" is inside "TypeError", which user code raises
_BACKEND_WORDS = re.compile(r"\b(gloo|nccl|c10d|connection|timed out|timeout|pair closure|"
                            r"processgroup|process group|socket|peer)\b")


def _is_backend_error(e: BaseException) -> bool:
    """Whether ``e`` came from the communication library (a failed or timed out collective)
    rather than from user code run in a future's callback."""
    return _BACKEND_WORDS.search(str(e).lower()) is not None


def _first_line(e: BaseException) -> str:
    """The cause of a backend error, without gloo's generic advice or a C++ trace."""
    text = str(e).strip()
    if not text:
        return type(e).__name__
    first = text.splitlines()[0]
    cut = first.find(" This is typically caused by")
    return first[:cut] if cut > 0 else first


@contextlib.contextmanager
def _quiet_store_errors():
    """Keep the C++ stack trace that a TCPStore prints on stderr when its host (rank 0) is
    gone out of the output: the reducer's own message says what happened. What else is
    printed meanwhile passes through."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no stderr to guard
        yield
        return
    global _capture
    if _capture is None:
        _capture = tempfile.TemporaryFile()  # one per process: a store call costs two dup2
    _capture.seek(0)
    _capture.truncate()
    os.dup2(_capture.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        if _capture.tell() or os.fstat(_capture.fileno()).st_size:
            _capture.seek(0)
            kept = [line for line in _capture.read().decode(errors="replace").splitlines(True)
                    if not _is_store_trace(line)]
            if kept:
                sys.stderr.write("".join(kept))


_capture = None  # the file that _quiet_store_errors points stderr at


def _is_store_trace(line: str) -> bool:
    return (line.startswith(("frame #", "Exception raised from", "<omitting python frames>"))
            or "TCPStore.cpp" in line or not line.strip())


_UNREACHABLE = " The rendezvous store is unreachable too: rank 0 (which hosts it) may be dead."

#: what debug fingerprints count (CommGuard.mark_call): each precedes one reducer collective
_COLLECTIVE = "the reducer's collective"

# Reducers are created in the same order on every rank, so this names them consistently.
_REDUCER_SEQ = itertools.count()

_KINDS = {"bucket": 1, "status": 2, "rebuild": 3, "buffers": 4, "join": 5, "autotune": 6}
_KIND_NAMES = {v: k for k, v in _KINDS.items()}
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
           torch.int32, torch.uint8, torch.bool, torch.int8, torch.int16, torch.complex64,
           torch.complex128]


def _dtype_code(dtype: torch.dtype | None) -> int:
    return _DTYPES.index(dtype) + 1 if dtype in _DTYPES else 0


def _dtype_name(code: int) -> str:
    return str(_DTYPES[code - 1]).replace("torch.", "") if 0 < code <= len(_DTYPES) else "-"


#: dedicated groups closed reducers gave back, per (ranks, backend, kind, timeout)
_FREE_GROUPS: dict[tuple, list] = {}


def _pool_key(process_group, kind: str, timeout) -> tuple:
    return (tuple(dist.get_process_group_ranks(process_group)),
            dist.get_backend(process_group), kind, timeout)


def _kinds(world_size: int, timeout, debug: bool) -> tuple:
    """The dedicated groups a reducer with these options uses."""
    if world_size == 1:
        return ()
    return (("reducer",) if timeout is not None or debug else ()) + \
        (("hooks",) if timeout is not None else ())


def free_groups(process_group, world_size: int, timeout, debug: bool) -> dict:
    """This rank's free dedicated groups for a reducer with these options: per purpose,
    their names (gathered with the reducer's first check: see :func:`groups_to_reuse`)."""
    names = dist.distributed_c10d._world.pg_names
    live = dist.distributed_c10d._world.pg_map  # (destroy_process_group() empties it)
    for free in _FREE_GROUPS.values():  # a destroyed group is not kept alive here
        free[:] = [g for g in free if g in live and g in names]
    return {kind: sorted(names[g] for g in _FREE_GROUPS.get(
                _pool_key(process_group, kind, timeout), []))
            for kind in _kinds(world_size, timeout, debug)}


def groups_to_reuse(every: list) -> dict:
    """From every rank's :func:`free_groups`: per purpose, the name of a free group every
    rank has (the same group: a group's name is the same on every rank), if any. A rank
    that dropped its group after a failure the others did not see makes them all create a
    new one."""
    reuse = {}
    for kind in (every[0] or {}):
        common = set.intersection(*(set((e or {}).get(kind, ())) for e in every))
        if common:
            reuse[kind] = min(common)
    return reuse


class CommGuard:
    """Where the reducer's collectives run, and what happens when one fails."""

    def __init__(self, process_group, rank: int, world_size: int, device: torch.device,
                 timeout: datetime.timedelta | None, debug: bool, reuse: dict | None = None):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.timeout, self.debug = timeout, debug
        self.seq = next(_REDUCER_SEQ)
        self.failed = False  # a collective of this reducer failed: the group is unusable
        self.step = 0  # the training step (forwards) the next collectives belong to
        self.group = process_group
        self._taken: list[tuple[tuple, object]] = []  # (pool key, group): given back at close
        self._reuse = reuse or {}  # purpose -> the name of the free group every rank has
        if world_size > 1 and (timeout is not None or debug):
            # debug fingerprints travel on their own group too, so they never interleave with
            # the collectives a comm hook launches from another thread on the user's group
            self.group = self._take_group(process_group, "reducer", timeout)
        self.dedicated = self.group is not process_group
        # global rank of each group rank: progress keys and reports use it, so that reducers
        # on different groups (expert replica groups) never share a key
        self._global = (dist.get_process_group_ranks(process_group) if world_size > 1
                        else [rank])
        # where torch's hooks given no group (state None, PowerSGDState(process_group=None))
        # send their collectives when timeout= is set: a group of its own, because their
        # callbacks may launch collectives from another thread (PowerSGD), which must not
        # interleave with the reducer's debug fingerprints
        self.hook_group = None
        if world_size > 1 and timeout is not None:
            self.hook_group = self._take_group(process_group, "hooks", timeout)
        self._store = None
        self._calls: dict[str, tuple[int, str]] = {}  # owner -> (calls entered, the last)
        if timeout is not None and world_size > 1:
            try:
                self._store = dist.distributed_c10d._get_default_store()
            except Exception:  # pragma: no cover - a group without a store
                self._store = None

    def _take_group(self, process_group, kind: str, timeout):
        """A dedicated group over ``process_group``'s ranks: the free one every rank has
        (``reuse``: agreed by name in the reducer's first gather), else a new one (a
        collective over those ranks)."""
        key = _pool_key(process_group, kind, timeout)
        free, name = _FREE_GROUPS.setdefault(key, []), self._reuse.get(kind)
        names = dist.distributed_c10d._world.pg_names
        group = next((g for g in free if names.get(g) == name), None) if name else None
        if group is not None:
            free.remove(group)
        else:
            kwargs = {"timeout": timeout} if timeout is not None else {}
            group = dist.new_group(dist.get_process_group_ranks(process_group),
                                   backend=dist.get_backend(process_group),
                                   use_local_synchronization=True, **kwargs)
        self._taken.append((key, group))
        return group

    def give_back(self) -> None:
        """At a clean close (nothing in flight, no collective failed): the dedicated groups go
        back to the pool for the next reducer, so a sweep of reducers in one process does not
        create two groups (their sockets and threads) per reducer."""
        taken, self._taken = self._taken, []
        if not self.failed:
            for key, group in taken:
                _FREE_GROUPS[key].append(group)

    def group_arg(self):
        return None if self.group is dist.group.WORLD else self.group

    # ----------------------------------------------------------------- progress and failure
    def _key(self, rank: int) -> str:
        return f"tribucket/{self.seq}/progress/{self._global[rank]}"

    def mark_progress(self, iteration: int, finished: bool = False) -> None:
        """Record in the rendezvous store that this rank started (``finished``: reached the
        end of) backward ``iteration``: ``2 * iteration + finished``, so progress compares
        as one number."""
        if self._store is None:
            return
        self._mine = 2 * iteration + int(finished)
        try:
            with _quiet_store_errors():
                self._store.set(self._key(self.rank), str(self._mine))
        except Exception:  # the store is gone (rank 0 died): diagnosis will say so
            pass

    def mark_call(self, name: str, owner: str = "ShardedOptimizer call") -> None:
        """Record in the rendezvous store that this rank entered its next call of ``owner``
        (numbered from 1; ``name``: which, as ``opt.step()``), so that a failure in one can
        name the ranks that never entered it (:meth:`who_missed_call`)."""
        if self._store is None:
            return
        n = self._calls.get(owner, (0, ""))[0] + 1
        self._calls[owner] = (n, name)
        try:
            with _quiet_store_errors():
                self._store.set(self._call_key(owner, self.rank), f"{n} {name}")
        except Exception:
            pass

    def _call_key(self, owner: str, rank: int) -> str:
        return f"tribucket/{self.seq}/call/{owner}/{self._global[rank]}"

    def who_missed_call(self, owner: str = "ShardedOptimizer call") -> str:
        """Which ranks have not entered this rank's last call of ``owner``
        (:meth:`mark_call`); "" without the store (no ``timeout=``) or such a call."""
        if self._store is None or owner not in self._calls:
            return ""
        mine, name = self._calls[owner]

        def entered(text: str | None) -> str:
            if text is None:
                return f"entered no {owner} yet"
            n, what = text.split(" ", 1)
            return f"last entered {owner} {n} ({what})"

        try:
            seen = self._peers(lambda r: self._call_key(owner, r))
        except Exception:
            return _UNREACHABLE
        behind = [f"rank {g} ({entered(text)})" for g, text in seen
                  if text is None or int(text.split(" ", 1)[0]) < mine]
        where = f" This rank entered {owner} {mine} ({name})"
        if behind:
            return (f"{where}; behind it: {', '.join(behind)}: it is late, stalled, crashed, "
                    "or left the training loop.")
        return f"{where}, and so did every rank: a rank failed inside it."

    def bounded(self, fn, what: str):
        """``fn()``: a collective of a call outside backward (one :meth:`mark_call` marked).
        A failure (the timeout passed, a peer died) raises naming ``what`` and the ranks that
        never entered the call; the group is dead then."""
        try:
            return fn()
        except Exception as e:
            self.failed = True
            who = (self.who_missed_call() or
                   " A peer did not join it: it died, or stalls before the same call "
                   "(opt.step(), opt.clip_grad_norm_(), opt.state_dict() and "
                   "tribucket.clip_grad_norm_() are called on every rank).")
            raise RuntimeError(
                f"tribucket (rank {self.rank}): {what} did not complete: {self.cause_of(e)}."
                f"{who} The process group cannot be used any more; end the job (torchrun "
                "restarts it) and resume from a checkpoint.") from e

    def report_own_failure(self, text: str) -> None:
        """Leave in the rendezvous store that this rank failed in its own code (``text``: the
        short cause), so the peers' reports name it instead of guessing."""
        if self._store is None:
            return
        try:
            with _quiet_store_errors():
                self._store.set(f"tribucket/{self.seq}/failed/{self._global[self.rank]}",
                                text[:300])
        except Exception:
            pass

    def _peers(self, key_of) -> list[tuple[int, str | None]]:
        """``(global rank, value)`` of every other rank's store key ``key_of(group rank)``
        (None: not set). Raises when the store is unreachable."""
        out = []
        with _quiet_store_errors():
            for r in range(self.world_size):
                if r != self.rank:
                    key = key_of(r)
                    out.append((self._global[r], self._store.get(key).decode(errors="replace")
                                if self._store.check([key]) else None))
        return out

    def _who_is_behind(self, iteration: int) -> str:
        if self._store is None:
            return (" Pass timeout=datetime.timedelta(...) to fused_bucketing to have it name "
                    "the missing rank and fail at that timeout.")
        mine = max(getattr(self, "_mine", 0), 2 * iteration)
        try:
            failed = [f"rank {g} ({text})" for g, text in self._peers(
                lambda r: f"tribucket/{self.seq}/failed/{self._global[r]}") if text is not None]
            if failed:
                return (f" The cause is on another rank, which reported an error of its "
                        f"own: {', '.join(failed)}.")
            progress = [(g, None if s is None else int(s)) for g, s in self._peers(self._key)]
        except Exception:
            return _UNREACHABLE
        behind = [f"rank {g} ({_describe_progress(seen)})" for g, seen in progress
                  if seen is None or seen < mine]
        if behind:
            return (f" This rank is in iteration {iteration}; behind it: "
                    f"{', '.join(behind)}: it is late (still starting up, a long "
                    "first batch or evaluation), stalled, crashed, or left the training "
                    "loop.")
        # past where this rank stands (a collective of this iteration's forward, say, while
        # the peer is in its backward): they did not pair this collective with this rank's
        ahead = [f"rank {g} ({_describe_progress(seen)})" for g, seen in progress
                 if seen is not None and seen > getattr(self, "_mine", 0)]
        if ahead:
            return (f" This rank is in iteration {iteration}; ahead of it: {', '.join(ahead)}, "
                    "past this collective: the ranks ran different collectives (a forward or "
                    "backward that raised on one rank and was run again, or a step one rank "
                    "skipped).")
        # in the same pass: debug fingerprints (one per collective) tell where
        return (self.who_missed_call(_COLLECTIVE) or
                " Every rank reached this point: a rank failed inside it.")

    def wait(self, work, what: str, iteration: int):
        """``work.wait()``, turning a failure (timeout, dead peer) into a clear error."""
        return self.call(work.wait, what, iteration)

    def call(self, fn, what: str, iteration: int):
        """``fn()`` (a blocking collective), turning a failure (timeout, dead peer) into the
        clear error of :meth:`wait`."""
        try:
            return fn()
        except Exception as e:
            self.failed = True
            raise self._failure(what, self.cause_of(e), iteration) from e

    def cause_of(self, e: BaseException) -> str:
        """A failed collective's cause in one line, naming the timeout when it passed."""
        cause = _first_line(e)
        if self.timeout is not None and ("timeout" in cause.lower()
                                         or "timed out" in cause.lower()):
            cause = f"timed out after {self.timeout} ({cause})"
        return cause

    def _failure(self, what: str, cause: str, iteration: int) -> RuntimeError:
        return RuntimeError(
            f"tribucket (rank {self.rank}): {what} did not complete: {cause}."
            f"{self._who_is_behind(iteration)} The process group cannot be used any more; "
            "end the job (torchrun restarts it) and resume from a checkpoint.")

    def wait_future(self, fut, what: str, iteration: int, own_code: Callable | None = None):
        """``fut.wait()`` bounded by the timeout (a Future has none of its own): a hook
        future that does not complete in time fails with the diagnosis of :meth:`wait`.
        ``own_code``: the future runs user code (a comm hook's callbacks), and this is the
        check of its value (returns what to give back); an error that is not the
        communication library's, or a value the check refuses, is reported as this rank's
        own, blaming no peer."""
        if self.timeout is not None and not fut.done():
            done = threading.Event()
            fut.add_done_callback(lambda _: done.set())
            if not done.wait(self.timeout.total_seconds()):
                self.failed = True
                raise self._failure(what, f"timed out after {self.timeout}", iteration)
        if own_code:
            try:
                value = fut.wait()
            except Exception as e:
                if not _is_backend_error(e):
                    raise self.own_failure(what, "raised", iteration, e) from e
                return self.wait(fut, what, iteration)
            try:
                return own_code(value)  # the hook's result, checked
            except RuntimeError as e:
                raise self.own_failure(what, "failed", iteration, e) from e
        return self.wait(fut, what, iteration)

    def own_failure(self, what: str, did: str, iteration: int,
                    e: BaseException) -> RuntimeError:
        """The error of user code (a comm hook) that failed on this rank, left in the store
        for the peers' reports too."""
        self.failed = True
        self.report_own_failure(f"{what} {did} in iteration {iteration}: {_first_line(e)}")
        return RuntimeError(
            f"tribucket (rank {self.rank}): {what} {did} on this rank in iteration "
            f"{iteration}: {_first_line(e)}. The error is in the hook's own code on this "
            "rank, not in a peer; the other ranks wait for this rank's end-of-backward "
            "status and fail (at timeout=, naming it). End the job, fix the hook, and "
            "resume from a checkpoint.")

    # ----------------------------------------------------------------- debug fingerprints
    def fingerprint(self, kind: str, iteration: int, bucket: int, numel: int,
                    dtype: torch.dtype | None) -> None:
        """All-gather what this rank is about to communicate; raise if the ranks differ."""
        if not self.debug or self.world_size == 1:
            return
        self.mark_call(f"{kind} {bucket} of iteration {iteration}", _COLLECTIVE)
        row = torch.tensor([_KINDS[kind], iteration, bucket, numel, _dtype_code(dtype),
                            self.step], dtype=torch.int64, device=self.device)
        rows = [torch.empty_like(row) for _ in range(self.world_size)]
        self.wait(dist.all_gather(rows, row, group=self.group, async_op=True),
                  f"debug fingerprint before {kind} {bucket}", iteration)
        table = [r.tolist() for r in rows]
        # the collective and the forward count (last), except on a rank that shadows the
        # others' collectives under Join (-1): it has no forwards of its own
        steps = {t[-1] for t in table if t[-1] >= 0}
        if all(t[:-1] == table[0][:-1] for t in table) and len(steps) <= 1:
            return

        def describe(t):
            after = "shadowing under Join" if t[5] < 0 else f"after training forward {t[5]}"
            return (f"{_KIND_NAMES.get(t[0], '?')} {t[2]} of iteration {t[1]} {after} "
                    f"({t[3]} elements of {_dtype_name(t[4])})")

        lines = "; ".join(f"rank {r}: {describe(t)}" for r, t in enumerate(table))
        self.failed = True  # their collectives no longer pair up: close() settles nothing
        raise RuntimeError(
            f"tribucket debug: the ranks diverged at {kind} {bucket} of iteration {iteration} "
            f"(the first collective that differs): {lines}. Their control "
            "flow differs (a rank ran a forward without backward or one more backward, ran "
            "one under no_sync, registered another hook or built another model), so their "
            "collectives no longer pair up.")
