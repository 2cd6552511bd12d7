"""Settle tribucket's collectives before interpreter shutdown.

A gloo process group destroyed during interpreter shutdown can abort the process: its worker
threads drop the works of finished collectives, a work holds Python objects (a future's
tensors, a callback), and a thread that needs the GIL while the interpreter is finalising is
terminated ("terminate called without an active exception", SIGABRT). torch DDP scripts hit
it when the model (whose reducer holds the group) is still alive at exit; the usual advice is
a ``gc.collect()`` before ``destroy_process_group()``.

tribucket removes the need: every object that can hold a process group, a work or a future
(reducers, MoE layers, sharded optimizers) registers here, and an exit handler, run while
the interpreter is still whole, (1) detaches reducers still attached, (2) waits for and drops
every work and future they hold, (3) drops their references to process groups, and (4)
collects cycles. A group the user destroyed (``destroy_process_group()``) is then freed here,
while the GIL can still be taken; objects used after the handler ran raise a clear error.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import time
import weakref
from typing import Any

import torch

__all__ = ["register", "settle"]

_OWNERS: "weakref.WeakSet[Any]" = weakref.WeakSet()
_registered = False
_settled = False


def register(owner: Any) -> None:
    """Settle ``owner`` at exit (its ``_settle_at_exit()`` if it has one, then a scrub)."""
    global _registered
    _OWNERS.add(owner)
    if not _registered:
        atexit.register(settle)
        _registered = True


def _kinds() -> tuple:
    import torch.distributed as dist
    kinds = [torch.futures.Future, torch._C.Future]
    if dist.is_available():
        kinds += [dist.ProcessGroup, dist.Work]
    return tuple(kinds)


def _scrub(obj: Any, kinds: tuple, seen: set, depth: int = 0) -> None:
    """Drop references to process groups, works and futures held by ``obj`` and by the
    tribucket objects it holds (attributes, lists and dicts of them)."""
    if id(obj) in seen or depth > 8:
        return
    seen.add(id(obj))
    if isinstance(obj, list):
        for i, v in enumerate(obj):
            if isinstance(v, kinds):
                obj[i] = None
            else:
                _scrub(v, kinds, seen, depth + 1)
        return
    if isinstance(obj, dict):
        for k, v in list(obj.items()):
            if isinstance(v, kinds):
                obj[k] = None
            else:
                _scrub(v, kinds, seen, depth + 1)
        return
    if isinstance(obj, tuple):
        for v in obj:
            _scrub(v, kinds, seen, depth + 1)
        return
    mod = type(obj).__module__ or ""
    if not mod.startswith("tribucket") or isinstance(obj, torch.nn.Module) and depth > 0:
        return  # (modules: the owners registered themselves; children are not ours)
    names = list(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        names += [s for s in getattr(cls, "__slots__", ()) if isinstance(s, str)]
    for name in names:
        try:
            v = getattr(obj, name)
        except AttributeError:
            continue
        if isinstance(v, kinds):
            try:
                if isinstance(obj, torch.nn.Module):
                    object.__setattr__(obj, name, None)
                else:
                    setattr(obj, name, None)
            except (AttributeError, TypeError):
                pass
        else:
            _scrub(v, kinds, seen, depth + 1)


def settle() -> None:
    """Detach, drain and drop what tribucket holds of torch.distributed (the exit handler;
    safe to call more than once)."""
    global _settled
    if _settled:
        return
    _settled = True
    owners = list(_OWNERS)
    for owner in owners:
        fn = getattr(owner, "_settle_at_exit", None)
        if fn is not None:
            try:
                fn()
            except Exception:  # exit: never mask the script's own outcome
                pass
    kinds = _kinds()
    seen: set = set()
    for owner in owners:
        try:
            _scrub(owner, kinds, seen)
        except Exception:
            pass
    del owners
    watchdog = sys.modules.get("tribucket.ddp.watchdog")
    if watchdog is not None:  # the free dedicated groups, while the GIL can be taken
        watchdog._FREE_GROUPS.clear()
    gc.collect()
    _let_gloo_workers_finish()


#: gloo's worker threads (``ProcessGroupGloo::runLoop``), as Linux names them
_GLOO_WORKER = "pt_gloo_runloop"


def _busy_threads(name: str, proc: str = "/proc/self/task") -> list[int]:
    """Thread ids of this process named ``name`` that are running or runnable (state R in
    ``/proc/self/task/<tid>/stat``); [] where /proc is not there."""
    busy = []
    try:
        tids = os.listdir(proc)
    except OSError:
        return busy
    for tid in tids:
        try:
            with open(f"{proc}/{tid}/comm") as f:
                if f.read().strip() != name:
                    continue
            with open(f"{proc}/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]  # (comm may hold spaces)
        except (OSError, IndexError):
            continue
        if state == "R":
            busy.append(int(tid))
    return busy


def _let_gloo_workers_finish(timeout_s: float = 0.5, proc: str = "/proc/self/task") -> bool:
    """Wait (GIL released) until no gloo worker thread is running, at most ``timeout_s``.

    A gloo worker completes a collective, which wakes the caller, and only then, at the end
    of its loop iteration, drops its reference to the work. Descheduled there (a loaded
    machine), it can be the last owner of the work's tensors when the interpreter is
    already finalising: freeing a tensor whose Python object torch kept alive needs the GIL,
    which a thread cannot take then, so it exits inside a C++ destructor and the process
    aborts ("terminate called without an active exception", seen in a core dump: frames
    ``~AsyncAllgatherWork`` <- ``ProcessGroupGloo::runLoop`` <- ``decref_pyobject`` <-
    ``PyThread_exit_thread``). The group itself outlives ``destroy_process_group()`` in any
    script that built an optimizer (torch keeps a reference), so its workers are still
    there at exit. Returns True when they all went idle."""
    deadline = time.monotonic() + timeout_s
    idle_polls = 0
    while time.monotonic() < deadline:
        if _busy_threads(_GLOO_WORKER, proc):
            idle_polls = 0
        else:
            idle_polls += 1
            if idle_polls >= 2:  # idle twice, a millisecond apart
                return True
        time.sleep(0.001)
    return False
