"""Seconds a process spends blocked in torch.distributed calls (for the benchmarks).

``CommClock().install()`` wraps the collectives the MoE layer uses and
``dist.batch_isend_irecv``: a blocking call counts its whole duration, an asynchronous one
(``async_op=True``, point-to-point works) the time of the call plus the time spent in its
work's ``wait()``. Compute that runs while a work is in flight is not counted, so the figure
is the communication the step could not hide. ``barrier`` is left alone (the benchmarks use
it to line the ranks up between steps).
"""

from __future__ import annotations

import functools
import time

import torch.distributed as dist

_NAMES = ("all_to_all_single", "all_reduce", "all_gather", "broadcast", "reduce",
          "all_gather_into_tensor", "reduce_scatter_tensor", "batch_isend_irecv")


class _TimedWork:
    def __init__(self, work, clock: "CommClock"):
        self._work, self._clock = work, clock

    def wait(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._clock.seconds += time.perf_counter() - t0

    def __getattr__(self, name):
        return getattr(self._work, name)


class CommClock:
    """Accumulates blocked seconds in ``seconds``; ``reset()`` before each measured step."""

    def __init__(self):
        self.seconds = 0.0
        self._saved: dict[str, object] = {}

    def reset(self) -> None:
        self.seconds = 0.0

    def install(self) -> "CommClock":
        for name in _NAMES:
            fn = getattr(dist, name, None)
            if fn is None or name in self._saved:
                continue
            self._saved[name] = fn
            setattr(dist, name, self._wrap(fn))
        return self

    def uninstall(self) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved.clear()

    def _wrap(self, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
            if isinstance(out, list):  # batch_isend_irecv: one work per op
                return [_TimedWork(w, self) for w in out]
            if out is not None and hasattr(out, "wait"):
                return _TimedWork(out, self)
            return out

        return timed
