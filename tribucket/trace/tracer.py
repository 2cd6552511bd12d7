"""The recorder: :class:`Tracer`, and :func:`make_tracer` that decides whether there is one.

A record is a plain list ``[name, lane, t0, t1, args, step, range]`` (``t0``/``t1`` in
``perf_counter_ns``; ``t1`` is ``None`` while a span is open and ``_INSTANT`` for an
instant; ``range`` is the open ``torch.profiler`` range). Lists, not objects: a span costs
two clock reads, one list and one append, plus the profiler range (about 1 us with torch's
``_RecordFunctionFast``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["COMM", "COMPUTE", "DEVICE", "DEVICE_COMM", "DEVICE_ENV", "ENV", "MOE", "Tracer",
           "current", "make_tracer"]

#: the environment variable that turns tracing on: a directory the trace file is written to
ENV = "TRIBUCKET_TRACE"
#: ``TRIBUCKET_TRACE_DEVICE=1``: also record device spans (CUDA events) on GPUs
DEVICE_ENV = "TRIBUCKET_TRACE_DEVICE"

# lanes (one Chrome tid each, drawn in this order)
COMPUTE = "compute"   # backward, pack, wait, unpack, epilogue, optimizer
COMM = "comm"         # collectives in flight
MOE = "moe"           # the MoE layer's phases
DEVICE = "device"     # CUDA-event spans on the compute stream (device side)
DEVICE_COMM = "device comm"  # collectives in flight on the device (CUDA events)
LANES = (COMPUTE, COMM, MOE, DEVICE, DEVICE_COMM)

_now = time.perf_counter_ns
_INSTANT = -1  # t1 of an instant

# A torch.profiler range per span. torch's private _RecordFunctionFast costs ~1 us per
# range; the public ops pair (what record_function uses) costs 20-60 us on this machine, so
# it is only the fallback for a torch without the fast one.
try:
    _FastRange = torch._C._profiler._RecordFunctionFast
except AttributeError:  # pragma: no cover - older or newer torch
    _FastRange = None


class _OpsRange:
    __slots__ = ("name", "handle")

    def __init__(self, name: str):
        self.name, self.handle = name, None

    def __enter__(self):
        self.handle = torch.ops.profiler._record_function_enter_new(self.name, None)

    def __exit__(self, *exc):
        torch.ops.profiler._record_function_exit._RecordFunction(self.handle)


_Range = _FastRange if _FastRange is not None else _OpsRange

# a span recorded past max_events: written to, never kept
_DROPPED: list = [None, None, 0, None, None, 0, None]

_CURRENT: "Tracer | None" = None

# on_device()'s answer when spans are forced on for a tensor that has no CUDA stream (tests)
_NO_STREAM = False


def current() -> "Tracer | None":
    """The tracer of this process while one is open (the most recently created), else None.

    For code that has no reducer to ask (the MoE layer): ``tr = trace.current()`` once per
    forward, then ``if tr is not None: ...``."""
    return _CURRENT


def span_if_tracing(name: str, lane: str = COMPUTE, args: dict | None = None):
    """``with span_if_tracing("epilogue", args=...):`` a span of the open tracer, if any
    (:func:`current`); nothing when tracing is off."""
    tr = _CURRENT
    return tr.span(name, lane, args) if tr is not None else contextlib.nullcontext()


def _future_of(handle: Any):
    """A Work's future, or the handle itself (already a future)."""
    return handle.get_future() if hasattr(handle, "get_future") else handle


def _completed(rec: list, fut) -> None:
    """A collective's done-callback: runs on the backend's thread when it completes it."""
    if rec[3] is None:
        rec[3] = _now()


def _completed_part(rec: list, left: list, fut) -> None:
    left[0] -= 1
    if left[0] == 0 and rec[3] is None:
        rec[3] = _now()


class Tracer:
    """Records one run's spans and instants on this rank; :meth:`close` writes the file.

    Args:
        path: where rank 0 writes the trace: a ``.json`` file, or a directory (created if
            missing) in which a file named ``trace-<date>-<time>-<pid>.json`` is made.
            ``None``: nothing is written (the events stay in :attr:`events`).
        group: the process group whose ranks' events rank 0 gathers at :meth:`close`
            (``None``: the default group when one is initialised).
        record_function: also open a ``torch.profiler`` range per span (default True).
        max_events: events kept per rank; later ones are counted, not kept (a long run
            traced from the start stays bounded: ~0.3 KB per event).

    Every method is meant for the thread that runs the training loop (the autograd engine's
    thread on CPU); :meth:`collective`'s callback is the one thing that runs elsewhere.
    With a process group of more than one rank, :meth:`close` is a collective: every rank
    of ``group`` calls it.
    """

    def __init__(self, path: str | os.PathLike | None = None, *, group=None,
                 record_function: bool = True, max_events: int = 1_000_000):
        global _CURRENT
        if max_events < 1:
            raise ValueError(f"max_events={max_events}: pass a positive number of events")
        self.path = None if path is None else os.fspath(path)
        self.group = group
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.step = 0                     # the step events are recorded in (next_step)
        self.events: list[list] = []      # this rank's records (module docstring)
        self.device_events: list[list] = []  # CUDA-event spans, resolved at close
        self.record_function = record_function
        self.max_events = max_events
        self.dropped = 0                  # events past max_events
        self.closed = False
        self.written: str | None = None   # the file close() wrote (rank 0)
        self._event_factory = None        # CUDA events (tests inject a fake)
        #: device spans (CUDA events) for buckets on a GPU: off unless
        #: ``TRIBUCKET_TRACE_DEVICE=1``; measured on an H200 host, they add 7-8% to a
        #: one-GPU step where the host spans add 0-1% (docs/trace.md)
        self.device_spans: bool = os.environ.get(DEVICE_ENV, "") == "1"
        _CURRENT = self

    # ------------------------------------------------------------------ steps
    def next_step(self, step: int | None = None) -> None:
        """Events from now on belong to ``step`` (default: the current step + 1)."""
        self.step = self.step + 1 if step is None else step

    # ------------------------------------------------------------------ host spans
    def begin(self, name: str, lane: str = COMPUTE, args: dict | None = None) -> list:
        """Open a span now; returns its record, to pass to :meth:`end`."""
        ev = self.events
        if len(ev) >= self.max_events:
            self.dropped += 1
            return _DROPPED
        rng = None
        if self.record_function:
            rng = _Range(name)
            rng.__enter__()
        rec = [name, lane, 0, None, args, self.step, rng]
        ev.append(rec)
        rec[2] = _now()  # last: the bookkeeping above is outside the span
        return rec

    def end(self, rec: list, completes: list | None = None) -> int:
        """Close the span ``rec`` now; returns the time (``perf_counter_ns``).

        ``completes``: the record of a collective this span waited for. When the wait
        returned, the collective was complete, so its end is at most now; the backend's
        callback can run a few microseconds after the waiter wakes, and this keeps
        ``allreduce end <= wait end``."""
        t = _now()
        rec[3] = t
        rng = rec[6]
        if rng is not None:
            rec[6] = None
            rng.__exit__(None, None, None)
        if completes is not None:
            done = completes[3]
            if done is None or done > t:
                completes[3] = t
        return t

    def span(self, name: str, lane: str = COMPUTE, args: dict | None = None) -> "_Span":
        """``with tracer.span("epilogue"): ...``: :meth:`begin` / :meth:`end` as a block."""
        return _Span(self, name, lane, args)

    def instant(self, name: str, lane: str = COMPUTE, args: dict | None = None,
                t: int | None = None) -> None:
        """Record an instant, now or at ``t`` (``perf_counter_ns``)."""
        if len(self.events) >= self.max_events:
            self.dropped += 1
            return
        self.events.append([name, lane, _now() if t is None else t, _INSTANT, args,
                            self.step, None])

    def complete(self, name: str, t0: int, t1: int, lane: str = COMPUTE,
                 args: dict | None = None) -> None:
        """Record a span timed elsewhere (``perf_counter_ns`` values; for a
        ``time.perf_counter()`` float ``s``, pass ``int(s * 1e9)``: the same clock).
        No profiler range: it is over already."""
        if len(self.events) >= self.max_events:
            self.dropped += 1
            return
        self.events.append([name, lane, t0, t1, args, self.step, None])

    # ------------------------------------------------------------------ collectives
    def collective(self, name: str, handle: Any, args: dict | None = None,
                   lane: str = COMM) -> list:
        """A collective launched just now: its span starts now and ends when the backend
        completes it, timed by a done-callback on its future (on gloo it runs on gloo's
        thread as it completes the work; pass the record to :meth:`end` ``completes=`` of
        the wait that follows, which bounds it).

        ``handle``: a ``torch.distributed`` Work (``async_op=True``), a
        ``torch.futures.Future`` (a comm hook's), or a list of them (done when the last
        is). Call this right after the launch: a callback added to a future that is
        already complete runs at once, so a late call times the call, not the completion.

        Measured on gloo (CPU, 2 ranks): the callback runs on gloo's worker thread within
        0.1 ms of the end of gloo's own ``gloo:all_reduce`` profiler range; it needs the
        GIL, so while the training thread runs pure Python it waits for it (torch ops
        release the GIL); and it can run ~40 us after ``wait()`` has returned, hence
        ``end(..., completes=rec)``.
        """
        t = _now()
        if len(self.events) >= self.max_events:
            self.dropped += 1
            return _DROPPED
        rec = [name, lane, t, None, args, self.step, None]
        self.events.append(rec)
        handles = handle if isinstance(handle, (list, tuple)) else (handle,)
        futs = []
        for h in handles:
            try:
                futs.append(_future_of(h))
            except Exception:  # a backend without futures: the wait's end bounds it
                return rec
        if len(futs) == 1:
            futs[0].add_done_callback(functools.partial(_completed, rec))
        elif futs:
            left = [len(futs)]
            for f in futs:
                f.add_done_callback(functools.partial(_completed_part, rec, left))
        if self.record_function and futs and torch.autograd._profiler_enabled():
            # a profiler is recording: a range on this thread that ends with the future
            # (torch's own mechanism for async ranges; its ~30 us only while profiling)
            h = torch.ops.profiler._record_function_enter_new(name, None)
            torch.ops.profiler._call_end_callbacks_on_jit_fut._RecordFunction(h, futs[-1])
        return rec

    # ------------------------------------------------------------------ backward ranges
    def backward_range(self, name: str, begin_at: torch.Tensor, end_at: torch.Tensor,
                       lane: str = MOE, args: dict | None = None) -> None:
        """A span in the *backward* of a forward region ``end_at -> ... -> begin_at``:
        it begins when the gradient of ``begin_at`` (the region's output) arrives and ends
        when the gradient of ``end_at`` (its input) is computed. Call it in forward, after
        the region; a tensor that does not require grad leaves the span open (not written).
        """
        if not (begin_at.requires_grad and end_at.requires_grad):
            return
        box: list = []
        step = self.step

        def _begin(grad):
            if not box:
                rec = self.begin(name, lane, args)
                rec[5] = step
                box.append(rec)

        def _end(grad):
            if box and box[0][3] is None:
                self.end(box[0])

        begin_at.register_hook(_begin)
        end_at.register_hook(_end)

    # ------------------------------------------------------------------ device spans
    def device_begin(self, name: str, lane: str = DEVICE, args: dict | None = None,
                     stream=None) -> list:
        """Open a device-side span: a CUDA event recorded on ``stream`` (default: the
        current one). Resolved to host time at :meth:`close`, not before (no sync)."""
        ev = self._cuda_event()
        ev.record() if stream is None or stream is False else ev.record(stream)
        rec = [name, lane, ev, None, args, self.step, None]
        if len(self.device_events) + len(self.events) >= self.max_events:
            self.dropped += 1
            return _DROPPED
        self.device_events.append(rec)
        return rec

    def device_end(self, rec: list, stream=None) -> None:
        ev = self._cuda_event()
        ev.record() if stream is None or stream is False else ev.record(stream)
        rec[3] = ev

    def on_device(self, t: torch.Tensor):
        """The stream to record ``t``'s device spans on (its device's current stream), or
        ``None``: no device spans (:attr:`device_spans` off, or not a CUDA tensor).
        Looked up once per bucket and passed to each record: the lookup is most of a
        record's host cost (4 of 6 us on an H200 host)."""
        if not self.device_spans:
            return None
        if t.is_cuda:
            return torch.cuda.current_stream(t.device)
        return _NO_STREAM if self._event_factory is not None else None  # (stand-in events)

    def device_collective(self, name: str, handle: Any, args: dict | None = None,
                          lane: str = DEVICE_COMM, stream=None) -> list:
        """A collective's span on the device: from an event on the current stream at its
        launch (the backend's stream waits for it) to one recorded when it completes there.

        The end event is recorded in a ``then()`` callback of the collective's future (of
        the last one, for a list): torch runs such a callback with current streams that
        wait on the work's CUDA kernels, so the event completes when the collective does
        on the device, with no host sync. Call right after the launch."""
        rec = self.device_begin(name, lane, args, stream)
        if rec is _DROPPED:
            return rec
        rec[3] = None  # the end event comes from the callback
        handles = handle if isinstance(handle, (list, tuple)) else (handle,)
        if not handles:
            return rec  # nothing in flight: no device end
        try:
            fut = _future_of(handles[-1])
        except Exception:  # a backend without futures: no device end
            return rec

        def _done(f, rec=rec):
            ev = self._cuda_event()
            ev.record()
            rec[3] = ev

        fut.then(_done)
        return rec

    def _cuda_event(self):
        if self._event_factory is None:
            self._event_factory = functools.partial(torch.cuda.Event, enable_timing=True)
        return self._event_factory()

    def _resolve_device_events(self) -> list[list]:
        """Device spans as host-clock records: an anchor event recorded now, waited for, and
        each event's ``elapsed_time`` to it (ms, ~0.5 us resolution) subtracted from the
        host time at which the anchor completed."""
        pending = [r for r in self.device_events if r[3] is not None]
        if not pending:
            return []
        for r in pending:  # end events of collectives sit on other streams
            r[3].synchronize()
        anchor = self._cuda_event()
        anchor.record()
        anchor.synchronize()
        host = _now()
        out = []
        for name, lane, e0, e1, args, step, _ in pending:
            t0 = host - int(e0.elapsed_time(anchor) * 1e6)
            t1 = host - int(e1.elapsed_time(anchor) * 1e6)
            out.append([name, lane, t0, t1, args, step, None])
        return out

    # ------------------------------------------------------------------ close
    def export(self) -> dict:
        """This rank's events, finished ones only, as the plain data :mod:`.chrome` writes:
        ``{"rank", "offset_ns", "events": [(name, lane, t0, t1 or -1, args, step)], ...}``
        with ``offset_ns`` turning ``perf_counter_ns`` into ``time.time_ns``."""
        events = self.events + self._resolve_device_events()
        done, unfinished = [], 0
        for name, lane, t0, t1, args, step, _ in events:
            if t1 is None:
                unfinished += 1  # a span never ended (a collective that never completed)
                continue
            done.append((name, lane, t0, t1, args, step))
        return {"rank": self.rank, "offset_ns": _clock_offset(), "events": done,
                "unfinished": unfinished, "dropped": self.dropped, "pid": os.getpid()}

    def close(self, local: bool = False) -> str | None:
        """Gather every rank's events on rank 0 and write the file there (one per run);
        returns its path on rank 0 (``None`` elsewhere, or without ``path``). ``local``: no
        gather, this rank's events to a file of its own (its path returned on every rank).
        Idempotent."""
        global _CURRENT
        if self.closed:
            return self.written
        self.closed = True
        if _CURRENT is self:
            _CURRENT = None
        from .chrome import write_run

        self.written = write_run(self.export(), self.path, self.group, local)
        return self.written

    def __enter__(self) -> "Tracer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Span:
    __slots__ = ("tracer", "name", "lane", "args", "rec")

    def __init__(self, tracer: Tracer, name: str, lane: str, args: dict | None):
        self.tracer, self.name, self.lane, self.args = tracer, name, lane, args

    def __enter__(self) -> list:
        self.rec = self.tracer.begin(self.name, self.lane, self.args)
        return self.rec

    def __exit__(self, *exc) -> None:
        self.tracer.end(self.rec)


def _clock_offset() -> int:
    """``time.time_ns() - time.perf_counter_ns()`` on this rank, from the closest of a few
    paired reads (on one host every rank's perf_counter is the same clock, and this
    mapping is exact to a microsecond; across hosts it is as good as their clock sync)."""
    best = None
    for _ in range(5):
        a = _now()
        w = time.time_ns()
        b = _now()
        if best is None or b - a < best[0]:
            best = (b - a, w - (a + b) // 2)
    return best[1]


def make_tracer(trace: Any = None, *, group=None) -> Tracer | None:
    """The tracer a component should use, or ``None`` (tracing off: record nothing).

    ``trace``: a :class:`Tracer` (used as it is); a path (``.json`` file or directory);
    ``True`` (the directory in ``TRIBUCKET_TRACE``, else the current directory); ``False``
    (off, whatever the environment says); ``None`` (the default: on if and only if
    ``TRIBUCKET_TRACE=DIR`` is set and non-empty).
    """
    if isinstance(trace, Tracer):
        return trace
    path = trace_path(trace)
    return Tracer(path, group=group) if path is not None else None


def trace_path(trace: Any) -> str | os.PathLike | None:
    """Where :func:`make_tracer` would write for ``trace`` (None: tracing off, or a
    :class:`Tracer` without a path)."""
    if isinstance(trace, Tracer):
        return trace.path
    if trace is False:
        return None
    env = os.environ.get(ENV, "")
    if trace is None:
        return env or None
    if trace is True:
        return env or os.getcwd()
    if isinstance(trace, (str, os.PathLike)):
        return trace
    raise TypeError(f"trace={trace!r}: pass a path (a .json file or a directory), True, "
                    f"False, None (then {ENV}=DIR decides) or a tribucket.trace.Tracer")
