"""Futures for works that have none (or whose own future cannot be chained while in flight).

gloo's point-to-point works have no ``get_future()``, and a torchft work builds its callback
chain only in ``wait()``. One daemon thread waits on such works, in the order they were
handed over, and completes a plain torch Future for each batch: the caller never blocks.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

import torch

__all__ = ["completed_by_waiter"]

_queue: "queue.SimpleQueue | None" = None
_lock = threading.Lock()


def _waiter(q: "queue.SimpleQueue") -> None:
    while True:
        works, fut, then = q.get()
        try:
            for w in works:
                w.wait()
            fut.set_result(then())
        except Exception as e:  # noqa: BLE001 - delivered to whoever waits on the future
            fut.set_exception(e)
        del works, fut, then  # (hold no buffer until the next batch arrives)


def completed_by_waiter(works: list, then: Callable[[], Any]) -> torch.futures.Future:
    """A Future completed with ``then()`` once every work of ``works`` has finished (or with
    the first error one raises)."""
    global _queue
    with _lock:
        if _queue is None:
            _queue = queue.SimpleQueue()
            threading.Thread(target=_waiter, args=(_queue,), daemon=True,
                             name="tribucket-waiter").start()
    fut: torch.futures.Future = torch.futures.Future()
    _queue.put((works, fut, then))
    return fut
