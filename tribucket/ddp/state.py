"""The reducer's per-iteration state: one backward pass, and the figures it reports."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

__all__ = ["ReducerStats", "log_buckets"]

logger = logging.getLogger("tribucket")


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
    #: buckets not all-reduced in the last backward: every parameter unused
    #: (``skip_all_reduce_unused_params=True``)
    buckets_skipped: int = 0
    #: times the buckets were rebuilt in gradient-ready order (at most once)
    rebuilds: int = 0
    #: bytes of the bucket buffers one iteration uses
    bucket_bytes_allocated: int = 0
    #: per-bucket seconds from launch to the end of backward, last backward (``debug`` only)
    bucket_comm_s: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class Pass:
    """One backward pass of the model, from its first gradient to the engine callback.

    Per-bucket state (pending counts, in-flight handle) lives in the bucket objects; this
    holds what is per parameter or per pass.
    """

    __slots__ = ("sync", "ready", "fired", "next_bucket", "t_start", "callback_queued",
                 "any_ready", "bytes", "errors", "scale", "shadow", "status_errors",
                 "record_order", "iteration", "plain", "step", "opt_step", "create_graph",
                 "skip", "skip_agreement", "nosync_grads")

    def __init__(self, sync: bool, n_params: int, iteration: int):
        self.sync = sync                       # False: no_sync, gradients stay local
        self.iteration = iteration             # backward passes begun, equal on every rank
        self.ready = bytearray(n_params)       # parameter i's gradient is counted in its bucket
        self.fired = [0] * n_params            # gradient hooks seen per parameter
        self.next_bucket = 0                   # every bucket before this one is launched
        self.t_start = time.perf_counter()     # backward start (output grad_fn or first hook)
        self.callback_queued = False           # the end-of-backward callback is queued
        self.any_ready = False                 # some parameter hook fired in this pass
        self.bytes = 0                         # bytes handed to collectives
        self.errors: list[str] = []            # misuse found during backward, raised at the end
        self.scale = 1.0                       # pre-division fused into the pack (1/world)
        self.shadow = False                    # a Join shadow pass: zeros, no problems
        self.status_errors = 0                 # errors already reported in the status
        self.record_order = False              # append ready parameters to the rebuild order
        self.step = 0                          # training forwards run before this backward
        self.opt_step = 0                      # optimizer steps taken before it (counted
        # from the reducer's last step agreement)
        self.skip: frozenset = frozenset()     # buckets not all-reduced: all params unused
        self.skip_agreement = None             # (work, flags): which of them every rank skips
        self.create_graph = False              # backward(create_graph=True): packs no_grad
        self.nosync_grads: frozenset = frozenset()  # sharded: parameters holding a no_sync
        # gradient at the pass's first gradient (their .grad is released once packed)
        self.plain = False                     # a gradient needs only to be counted in:
        # synced, first gradient seen, no hook counts, no used map, no order to record


def log_buckets(rank: int, iteration: int, layout, names: list[str],
                seconds: list[float]) -> None:
    """``debug=True``: log each bucket's tensors and its time from launch to the end of
    backward."""
    for b, (bucket, s) in enumerate(zip(layout.buckets, seconds)):
        tensors = [names[i] for i in bucket.indices]
        logger.info("tribucket rank %d iteration %d bucket %d: %d tensors, %d bytes, "
                    "%.2f ms from launch to end of backward: %s", rank, iteration, b,
                    len(tensors), bucket.nbytes, s * 1e3,
                    ", ".join(tensors[:8]) + (" ..." if len(tensors) > 8 else ""))
