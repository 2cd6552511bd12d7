"""A pool of persistent gloo worker processes for distributed tests.

Spawning gloo processes costs seconds, so the suite keeps one pool per world size for the
whole session and runs each distributed test on it::

    def _check_allreduce():            # module level: the workers import it by name
        t = torch.ones(3) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        return t

    def test_allreduce(dist_run):
        results = dist_run(_check_allreduce, world_size=3)   # one result per rank
        assert all(torch.equal(r, torch.full((3,), 6.0)) for r in results)

Guarantees:

* every call has a timeout; past it the pool is killed and the test fails with each rank's
  Python stack (dumped by faulthandler) and log tail: a hang never blocks the suite;
* a rank that raises fails the test with that rank's traceback, and a rank that dies fails it
  at once with its exit code; in both cases the pool is torn down and the next test starts a
  fresh one, so no test inherits a half-finished collective;
* results travel with ``torch.save`` (tensors are copied, not shared).

Workers run with one intra-op thread each (this machine has 2 cores) and the environment
of the parent (``TRITON_INTERPRET`` included); they are forked from a fork server that has
imported torch (:func:`_context`).
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import importlib
import io
import multiprocessing as mp
import os
import queue
import signal
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch

DEFAULT_TIMEOUT = 120.0
_STARTUP_TIMEOUT = 120.0


class DistTestError(AssertionError):
    """A distributed test failed on some rank, timed out or lost a process."""


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _worker_main(rank: int, world_size: int, init_file: str, log_path: str, tasks, results,
                 environ: dict):
    # The parent's environment as it is now (a forked worker starts with the fork server's).
    os.environ.clear()
    os.environ.update(environ)
    # Everything this rank prints goes to its log; the parent shows the tail on failure.
    log = open(log_path, "a", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)
    # a crash (SIGSEGV, SIGABRT...) leaves every thread's Python stack in the log too
    faulthandler.enable(file=log, all_threads=True)
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=300))
    results.put(("ready", rank, True, b""))
    while True:
        task = tasks.get()
        if task is None:
            break
        call_id, module, name, args, kwargs = task
        print(f"--- call {call_id}: {module}.{name}", flush=True)
        _CALL.update(dir=os.path.dirname(init_file), id=call_id, rank=rank, world=world_size)
        try:
            fn = getattr(importlib.import_module(module), name)
            out = fn(*_loads(args), **_loads(kwargs))
            results.put((call_id, rank, True, _dumps(out)))
        except BaseException:  # noqa: BLE001 - report everything to the parent
            results.put((call_id, rank, False, traceback.format_exc().encode()))
        finally:
            open(_returned(call_id, rank), "w").close()
    try:
        dist.destroy_process_group()
    except Exception:
        pass


#: in a worker: the call it is running (pool directory, call id, rank, world size)
_CALL: dict = {}


def _returned(call_id: int, rank: int) -> str:
    return os.path.join(_CALL["dir"], f"returned.{call_id}.{rank}")


@contextlib.contextmanager
def tribucket_log(level: int | None = None):
    """The messages the ``tribucket`` logger emits inside the block (a list, filled as they
    come); ``level``: the logger's level inside the block."""
    import logging

    logged: list[str] = []
    log = logging.getLogger("tribucket")
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    before = log.level
    log.addHandler(handler)
    if level is not None:
        log.setLevel(level)
    try:
        yield logged
    finally:
        log.removeHandler(handler)
        log.setLevel(before)


def stall_until_the_others_return(max_s: float) -> float:
    """In a worker: sleep like a stalled rank until every other rank of this call has
    returned from it (they raised, as they should, or finished), or ``max_s`` passed;
    returns the time slept. A stalled rank's test then lasts as long as its peers take to
    give up, not a fixed sleep past their timeout: where the peers never give up (the
    feature broken), the stall lasts ``max_s`` as a plain sleep would."""
    start = time.monotonic()
    others = [r for r in range(_CALL["world"]) if r != _CALL["rank"]]
    while time.monotonic() - start < max_s:
        if all(os.path.exists(_returned(_CALL["id"], r)) for r in others):
            break
        time.sleep(0.02)
    return time.monotonic() - start


def _context():
    """Workers are forked from a fork server that has imported torch once for the session,
    not spawned (each spawned worker imported torch itself: about 2 s of CPU per worker, and
    the suite starts a pool for each world size and again after every test that breaks
    one). The server also imports ``torch._dynamo``, which torch.optim imports at a
    process's first optimizer (another 2 s of CPU per worker). Workers share no state with
    the test process (the server is a process of its own that ran nothing but the imports),
    they get the test process's environment and sys.path, and import tribucket and the test
    modules themselves."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo"])
    return ctx


class WorkerPool:
    """``world_size`` gloo processes that run module-level functions on every rank."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._dir = tempfile.mkdtemp(prefix=f"tribucket-pool{world_size}-")
        ctx = _context()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._logs = [os.path.join(self._dir, f"rank{r}.log") for r in range(world_size)]
        init_file = os.path.join(self._dir, "rendezvous")
        self._procs = [
            ctx.Process(target=_worker_main, name=f"tribucket-rank{r}", daemon=True,
                        args=(r, world_size, init_file, self._logs[r], self._tasks[r],
                              self._results, dict(os.environ)))
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self._calls = 0
        self.alive = True
        self._collect("ready", _STARTUP_TIMEOUT, what="start-up")

    # ---------------------------------------------------------------------------------
    def run(self, fn: Callable, *args, timeout: float = DEFAULT_TIMEOUT,
            expect_dead: tuple = (), **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results.

        Ranks in ``expect_dead`` may die (their result is ``None``); the others must answer.
        """
        if not self.alive:
            raise DistTestError("this worker pool was torn down")
        module, name = fn.__module__, fn.__qualname__
        if "<locals>" in name or module == "__main__":
            raise ValueError(f"{name} must be a module-level function so workers can import it")
        self._calls += 1
        call_id = self._calls
        payload = (_dumps(args), _dumps(kwargs))
        for q in self._tasks:
            q.put((call_id, module, name, *payload))
        return self._collect(call_id, timeout, what=f"{module}.{name}", expect_dead=expect_dead)

    def _collect(self, call_id, timeout: float, what: str, expect_dead: tuple = ()) -> list:
        deadline = time.monotonic() + timeout
        got: dict[int, tuple[bool, bytes]] = {}
        while len(got) < self.world_size:
            try:
                cid, rank, ok, data = self._results.get(timeout=0.2)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(self._procs)
                        if r not in got and not p.is_alive()]
                for r, _ in [d for d in dead if d[0] in expect_dead]:
                    got[r] = (True, b"")  # died as the test intended
                dead = [d for d in dead if d[0] not in expect_dead]
                if dead:
                    self._fail(f"{what}: rank(s) {', '.join(f'{r} (exit code {c})' for r, c in dead)} "
                               "died", got)
                if time.monotonic() > deadline:
                    missing = [r for r in range(self.world_size) if r not in got]
                    self._fail(f"{what}: timed out after {timeout:.0f}s waiting for rank(s) "
                               f"{missing} (a hang: stacks below)", got, dump_stacks=True)
                continue
            if cid != call_id:
                continue  # a late answer to an earlier, already-failed call
            got[rank] = (ok, data)
        failed = {r: d.decode() for r, (ok, d) in got.items() if not ok}
        if failed:
            self._fail(f"{what}: raised on rank(s) {sorted(failed)}", got)
        return [_loads(got[r][1]) if got[r][1] else None for r in range(self.world_size)]

    def _fail(self, headline: str, got: dict, dump_stacks: bool = False) -> None:
        if dump_stacks:
            for p in self._procs:
                if p.is_alive():
                    try:
                        os.kill(p.pid, signal.SIGUSR1)
                    except OSError:
                        pass
            time.sleep(1.0)
        parts = [headline]
        for r in range(self.world_size):
            if r in got and not got[r][0]:
                parts.append(f"\n===== rank {r} traceback =====\n{got[r][1].decode()}")
        for r, path in enumerate(self._logs):
            try:
                with open(path, errors="replace") as f:
                    tail = f.readlines()[-60:]
            except OSError:
                tail = []
            if tail:
                parts.append(f"\n===== rank {r} log (last {len(tail)} lines) =====\n" + "".join(tail))
        self.close()
        raise DistTestError("\n".join(parts))

    def close(self) -> None:
        """Stop the workers (politely, then by force)."""
        if not self.alive:
            return
        self.alive = False
        for q in self._tasks:
            try:
                q.put(None)
            except Exception:
                pass
        deadline = time.monotonic() + 3.0
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


_POOLS: dict[int, WorkerPool] = {}


def get_pool(world_size: int) -> WorkerPool:
    """The session's pool for ``world_size`` ranks, started (or restarted) on demand."""
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive:
        pool = _POOLS[world_size] = WorkerPool(world_size)
    return pool


def run(fn: Callable, *args, world_size: int = 2, timeout: float = DEFAULT_TIMEOUT,
        teardown: bool = False, **kwargs) -> list:
    """Run ``fn`` on every rank of the shared ``world_size`` pool.

    ``teardown=True`` kills the pool afterwards (for tests that break the process group on
    purpose, e.g. by making a rank exit).
    """
    pool = get_pool(world_size)
    try:
        return pool.run(fn, *args, timeout=timeout, **kwargs)
    finally:
        if teardown:
            pool.close()


def close_all() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
