"""The reducer's per-iteration bookkeeping: bucket states, one backward pass, its figures."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ReducerStats"]


class _BucketState(enum.IntEnum):
    PENDING = 0   # waiting for gradients
    READY = 1     # every gradient is in; waits for earlier buckets to be launched
    LAUNCHED = 2  # packed and handed to the hook / allreduce; result in flight
    DONE = 3      # result arrived


@dataclass
class ReducerStats:
    """Figures of the reducer. ``*_s`` fields describe the last synchronised backward."""

    #: backward passes that averaged gradients
    iterations: int = 0
    #: seconds from the start of backward to the autograd engine finishing it
    backward_compute_s: float = 0.0
    #: seconds from the end of backward computation until every .grad held the average:
    #: the communication that did not overlap with computation
    comm_exposed_s: float = 0.0
    #: of which: the end-of-backward status check (missing gradients, overflow flag)
    status_check_s: float = 0.0
    #: bytes of gradient buffers handed to collectives in the last backward (one rank)
    bytes_communicated: int = 0
    #: buckets in the current layout
    buckets: int = 0
    #: times the buckets were rebuilt in gradient-ready order (at most once)
    rebuilds: int = 0
    #: bytes of the bucket buffers one iteration uses
    bucket_bytes_allocated: int = 0
    #: per-bucket seconds from launch to the end of backward, last backward (``debug`` only)
    bucket_comm_s: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class _Pass:
    """One backward pass of the model, from its first gradient to the engine callback."""

    __slots__ = ("sync", "ready", "fired", "pending", "state", "next_bucket", "handles",
                 "t_start", "callback_queued", "any_ready", "t_launch", "bytes", "errors",
                 "scale", "prefix", "chunk_next", "shadow", "status_errors", "step")

    def __init__(self, sync: bool, n_params: int, pending: list[int]):
        self.sync = sync                       # False: no_sync, gradients stay local
        self.ready = bytearray(n_params)       # parameter i's gradient is in its bucket slot
        self.fired = [0] * n_params            # gradient hooks seen per parameter
        self.pending = list(pending)           # per bucket: parameters not yet ready
        self.state = [_BucketState.PENDING] * len(pending)  # per bucket state (module doc)
        self.next_bucket = 0                   # every bucket before this one is launched
        self.handles: list[Any] = [None] * len(pending)  # per bucket: Work or Future
        self.t_start = time.perf_counter()     # backward start (output grad_fn or first hook)
        self.callback_queued = False           # the end-of-backward callback is queued
        self.any_ready = False                 # some parameter hook fired in this pass
        self.t_launch = [0.0] * len(pending)   # per bucket launch time (debug stats)
        self.bytes = 0                         # bytes handed to collectives
        self.errors: list[str] = []            # misuse found during backward, raised at the end
        self.scale = 1.0                       # pre-division fused into the pack (1/world)
        self.prefix = [0] * len(pending)       # per bucket: leading parameters all ready
        self.chunk_next = [0] * len(pending)   # per bucket: next chunk to send (chunked)
        self.shadow = False                    # a Join shadow pass: zeros, no problems
        self.status_errors = 0                 # errors already reported in the status
        self.step = 0                          # training forwards run before this backward
