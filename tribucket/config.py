"""Configuration of the data-parallel reducer."""

from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass, field
from typing import Any

from torch import distributed as dist

__all__ = ["ReducerConfig", "MiB", "AUTO", "DEFAULT_BUCKET_CAP_MB", "DEFAULT_FIRST_BUCKET_CAP_MB"]

MiB = 2**20
#: the value of ``bucket_cap_mb`` / ``first_bucket_cap_mb`` that measures the caps
AUTO = "auto"
#: torch DDP's default bucket cap
DEFAULT_BUCKET_CAP_MB = 25
#: torch DDP's first-bucket cap (``dist._DEFAULT_FIRST_BUCKET_BYTES``), used only when
#: ``bucket_cap_mb`` is left at its default: a small first bucket starts communication early
DEFAULT_FIRST_BUCKET_CAP_MB = 1
#: bucket cap under ``shard_optimizer=True`` when ``bucket_cap_mb`` is left unset: a bucket's
#: full buffer is transient there (freed once reduce-scattered), so its size bounds the
#: gradient memory in flight; 4 MiB kept the peak near 1/world of DDP's at 2 and 4 ranks
#: and was also faster than 25 MiB buckets on gloo (docs/zero.md, perf/bench_zero.py)
DEFAULT_SHARD_BUCKET_CAP_MB = 4


def _env_flag(name: str) -> bool | None:
    value = os.environ.get(name)
    return None if value is None else value == "1"


def _positive_mb(name: str, value: Any, auto: bool = False) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number of MiB"
                         + (" or 'auto'" if auto else "") + f", got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number of MiB, got {value!r}: for one bucket, "
                         f"pass a cap larger than the model's gradients")
    if int(value * MiB) < 1:
        raise ValueError(f"{name}={value!r} MiB is less than one byte; use a larger value")


def check_process_group(process_group: Any) -> None:
    """``process_group=`` is a ProcessGroup or None, named before any collective."""
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        hint = (": pass mesh.get_group() (or DistributedDataParallel's device_mesh=)"
                if type(process_group).__name__ == "DeviceMesh" else "")
        raise TypeError(f"process_group must be a torch.distributed.ProcessGroup (or None: the "
                        f"default group), got {type(process_group).__name__}{hint}")


@dataclass(frozen=True)
class ReducerConfig:
    """Options of :class:`tribucket.Reducer` / :func:`tribucket.fused_bucketing`."""

    #: bucket cap in MiB (``int(mb * 2**20)`` bytes); ``None`` means DDP's default, 25 MiB
    #: (4 MiB with ``shard_optimizer=True``, see DEFAULT_SHARD_BUCKET_CAP_MB); ``"auto"``:
    #: measured over the first steps after the rebuild and chosen the same on every rank
    #: (``tribucket/ddp/autotune.py``; 25 MiB until then)
    bucket_cap_mb: float | str | None = None
    #: cap of the first bucket of each (dtype, device) after the rebuild; ``None`` means
    #: 1 MiB when ``bucket_cap_mb`` is ``None``, else ``bucket_cap_mb`` (torch DDP 2.x),
    #: except for a model all on the CPU: ``bucket_cap_mb``'s value
    #: (see ``ddp.rebuild.LayoutPolicy.first_cap_bytes``); ``"auto"``: measured, as
    #: ``bucket_cap_mb="auto"``
    first_bucket_cap_mb: float | str | None = None
    #: one cap in MiB per bucket of each (dtype, device), in the order the buckets fill
    #: (the first is the first bucket's), the last one repeating: DDP's
    #: ``bucket_cap_mb_list``, for the initial layout and for the rebuild; in place of
    #: ``bucket_cap_mb`` and ``first_bucket_cap_mb`` (leave them unset)
    bucket_cap_mb_list: tuple | None = None
    #: make each ``.grad`` a view into its bucket: no copies in or out, as DDP's option
    gradient_as_bucket_view: bool = False
    #: search the autograd graph after each forward for parameters that will get no
    #: gradient and treat them as ready (their slice of the bucket is zero)
    find_unused_parameters: bool = False
    #: with ``find_unused_parameters``: a bucket whose every parameter the forward left
    #: unused (and that got no gradient in a ``no_sync`` pass since the last averaged one)
    #: is not all-reduced, and its ``.grad`` stay as they were: DDP's option of the same
    #: name. Only the buckets unused on every rank are skipped: the ranks agree on them with
    #: one small allreduce per step (DDP requires the same unused set on every rank)
    skip_all_reduce_unused_params: bool = False
    #: the graph (used parameters, hook order) is the same every iteration: the unused set
    #: is recorded once and the buckets are rebuilt even with unused parameters
    static_graph: bool = False
    #: broadcast rank 0's buffers (BatchNorm statistics...) before each forward with grad
    #: enabled (``True``); ``"ddp"``: also before a forward without grad that follows a
    #: training forward, as DDP decides (a collective under ``no_grad``: every rank must run
    #: evaluation forwards then); ``False``: never
    broadcast_buffers: bool | str = True
    #: parameters (or their qualified names) this reducer leaves alone
    ignore_parameters: tuple = ()
    #: split the averaging allreduce of each bucket into chunks of about this many MiB,
    #: each launched as soon as its gradients are in (CPU, where gradients are packed as
    #: they arrive), so communication overlaps the rest of backward; hooks still see whole,
    #: DDP-equal buckets. ``None`` or ``0``: off, the default: on the 2-core test machine
    #: chunking moved communication into backward and the step was mostly longer
    #: (docs/benchmarks.md); try it where the communication threads have cores of their own.
    #: Applies to the default allreduce and tribucket's allreduce/fp16/bf16 hooks
    comm_chunk_mb: float | None = None
    #: reduce-scatter each bucket instead of allreducing it: every rank keeps only its
    #: 1/world slice of the averaged gradients (``.grad`` stays ``None``) for a
    #: :class:`tribucket.ShardedOptimizer` to step; buckets are sized by the caps from the
    #: first iteration on and never rebuilt (the optimizer's shards follow them)
    shard_optimizer: bool = False
    #: a collective that takes longer than this fails instead of hanging (``None``: the
    #: process group's own timeout); see docs/reliability.md
    timeout: datetime.timedelta | None = None
    #: check each bucket across ranks before its collective and log per-bucket timings;
    #: also switched on by the environment variable ``TRIBUCKET_DEBUG=1``
    debug: bool = field(default_factory=lambda: os.environ.get("TRIBUCKET_DEBUG", "0") == "1")
    #: when a gradient is copied into its bucket: ``True`` as soon as it is ready (one copy
    #: per gradient, the way DDP does it), ``False`` in one pack call when the bucket's
    #: last gradient is ready (one fused launch per bucket, the GPU way), ``None`` (default):
    #: decided per bucket: on GPU one launch per bucket; on CPU, buckets whose gradients
    #: average 64 KiB or more copy each one in while it is still in cache, buckets of
    #: smaller ones are packed in one call (per-gradient Python work would cost more).
    #: Also set by the environment variable ``TRIBUCKET_EAGER_PACK=1``/``0``
    pack_on_ready: bool | None = field(default_factory=lambda: _env_flag("TRIBUCKET_EAGER_PACK"))
    #: count gradients in with C++ hooks (``tribucket/ddp/native.py``: compiled on first use,
    #: about 20 s, then cached): ``None`` (default) when the extension builds, else the
    #: Python hooks with a warning; ``True``: an error if it does not build; ``False``: the
    #: Python hooks. Same results either way. Also set by ``TRIBUCKET_NATIVE_HOOKS=1``/``0``
    native_hooks: bool | None = field(default_factory=lambda: _env_flag("TRIBUCKET_NATIVE_HOOKS"))
    #: when the end-of-backward status (missing gradients, misuse, ranks out of step) is
    #: read on the host: ``False``: at the end of each backward, before ``.grad`` is
    #: written, so a problem raises in the backward that had it; ``True``: at the end of the
    #: next synchronised backward (or at ``close()``), so the host need not wait for the
    #: device to finish a backward before it queues the optimizer step and the next forward;
    #: a problem then raises one backward later, on every rank, after its gradients were
    #: written (DDP's errors also come one iteration later). ``None`` (default): ``True`` on
    #: a GPU, ``False`` on the CPU (where nothing runs ahead of the host). Also set by
    #: ``TRIBUCKET_DEFERRED_STATUS=1``/``0``. Passes that need the used map on the host
    #: (``find_unused_parameters``) and passes under ``join()`` read it at once
    deferred_status: bool | None = field(
        default_factory=lambda: _env_flag("TRIBUCKET_DEFERRED_STATUS"))
    #: reuse the gradients' norm and inf/NaN flag across calls (``grad_norm()``,
    #: ``found_inf``, ``GradScaler.unscale_``, ``clip_grad_norm_``) and take them from the
    #: unpack kernel where it computes them (CUDA): no read of the gradients for the second
    #: and later users in an iteration. Only sound if gradients are never written in a way
    #: autograd's version counter misses (``p.grad.data.mul_()``, numpy views, ctypes):
    #: ``False`` (default) reads the gradients once per call, as torch's clip and
    #: GradScaler do, and sees every edit
    reuse_grad_figures: bool = False
    #: write a per-bucket timeline (Chrome trace JSON, one file per run, rank 0 writes it at
    #: close): a path (file or directory), ``True`` (``TRIBUCKET_TRACE`` or the current
    #: directory), ``False``; ``None`` (default): on when ``TRIBUCKET_TRACE=DIR`` is set.
    #: See docs/trace.md; ``python -m tribucket.trace FILE`` reads it
    trace: Any = None

    def __post_init__(self) -> None:
        if self.bucket_cap_mb_list is not None:
            self._check_cap_list()
        if self.bucket_cap_mb != AUTO:
            _positive_mb("bucket_cap_mb", self.bucket_cap_mb, auto=True)
        if self.first_bucket_cap_mb != AUTO:
            _positive_mb("first_bucket_cap_mb", self.first_bucket_cap_mb, auto=True)
        if self.autotune:
            self._check_autotune()
        if self.comm_chunk_mb is not None and self.comm_chunk_mb != 0:
            _positive_mb("comm_chunk_mb", self.comm_chunk_mb)
        for name in ("gradient_as_bucket_view", "find_unused_parameters", "static_graph",
                     "debug", "shard_optimizer", "reuse_grad_figures",
                     "skip_all_reduce_unused_params"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not (isinstance(self.broadcast_buffers, bool) or self.broadcast_buffers == "ddp"):
            raise ValueError(f"broadcast_buffers must be True, False or 'ddp' (also before "
                             f"evaluation forwards, as DDP), got {self.broadcast_buffers!r}")
        if self.native_hooks is not None and not isinstance(self.native_hooks, bool):
            raise TypeError(f"native_hooks must be True, False or None, got "
                            f"{self.native_hooks!r}")
        if self.deferred_status is not None and not isinstance(self.deferred_status, bool):
            raise TypeError(f"deferred_status must be True, False or None, got "
                            f"{self.deferred_status!r}")
        if self.pack_on_ready is not None and not isinstance(self.pack_on_ready, bool):
            raise TypeError(f"pack_on_ready must be True, False or None, got "
                            f"{self.pack_on_ready!r}")
        if self.shard_optimizer and self.comm_chunk_mb:
            raise ValueError(f"comm_chunk_mb={self.comm_chunk_mb!r} cannot be combined with "
                             "shard_optimizer=True (a bucket is reduce-scattered whole); "
                             "leave comm_chunk_mb unset")
        if self.skip_all_reduce_unused_params:
            self._check_skip()
        if isinstance(self.ignore_parameters, (str, bytes)):
            raise TypeError("ignore_parameters must be a collection of parameters or names, "
                            f"got the string {self.ignore_parameters!r}; wrap it in a tuple")
        object.__setattr__(self, "ignore_parameters", tuple(self.ignore_parameters))
        if self.timeout is not None:
            if not isinstance(self.timeout, datetime.timedelta):
                raise TypeError("timeout must be a datetime.timedelta, got "
                                f"{type(self.timeout).__name__} {self.timeout!r}")
            if self.timeout.total_seconds() <= 0:
                raise ValueError(f"timeout must be positive, got {self.timeout}")

    def _check_cap_list(self) -> None:
        caps = self.bucket_cap_mb_list
        if isinstance(caps, (str, bytes)) or not hasattr(caps, "__iter__"):
            raise ValueError(f"bucket_cap_mb_list must be a list of positive numbers of MiB "
                             f"(one cap per bucket), got {caps!r}")
        caps = tuple(caps)
        if not caps:
            raise ValueError("bucket_cap_mb_list must be a non-empty list of MiB (one cap per "
                             "bucket, the last repeating), got an empty one; leave it None "
                             "for the default caps")
        for k, mb in enumerate(caps):
            _positive_mb(f"bucket_cap_mb_list[{k}]", mb)
        for name in ("bucket_cap_mb", "first_bucket_cap_mb"):
            if getattr(self, name) is not None:
                raise ValueError(f"bucket_cap_mb_list={list(caps)!r} gives every bucket's cap, "
                                 f"the first's included, and cannot be combined with "
                                 f"{name}={getattr(self, name)!r}: leave {name} unset")
        object.__setattr__(self, "bucket_cap_mb_list", caps)

    def _check_skip(self) -> None:
        why = None
        if not self.find_unused_parameters:
            why = ("it needs find_unused_parameters=True (the unused parameters are found by "
                   "searching the graph after each forward)")
        elif self.static_graph:
            why = ("it is not supported with static_graph=True (the static graph's used set "
                   "is learned once); leave static_graph off")
        elif self.shard_optimizer:
            why = ("it is not supported with shard_optimizer=True (every bucket is "
                   "reduce-scattered into the optimizer's shards)")
        if why is not None:
            raise ValueError(f"skip_all_reduce_unused_params=True: {why}")

    @property
    def autotune(self) -> bool:
        """A cap is ``"auto"``: the caps are measured after the rebuild (``ddp/autotune.py``)."""
        return AUTO in (self.bucket_cap_mb, self.first_bucket_cap_mb)

    def _check_autotune(self) -> None:
        which = "bucket_cap_mb" if self.bucket_cap_mb == AUTO else "first_bucket_cap_mb"
        if self.shard_optimizer:
            raise ValueError(f"{which}='auto' cannot be combined with shard_optimizer=True: the "
                             "sharded optimizer's state lives on the buckets, so they are never "
                             f"re-laid; pass a number ({which}=4, the default under "
                             "shard_optimizer, or a value measured with bucket_cap_mb='auto' "
                             "without sharding)")
        if self.dynamic_unused:
            raise ValueError(f"{which}='auto' cannot be combined with "
                             "find_unused_parameters=True (without static_graph): those buckets "
                             "are never rebuilt, as in DDP, so there is no gradient-ready order "
                             f"to lay them out in; pass a number for {which}, or "
                             "static_graph=True if the graph is the same every step")

    @property
    def dynamic_unused(self) -> bool:
        """The unused set is searched after every forward (``find_unused_parameters``
        without ``static_graph``): the buckets are never rebuilt, as in DDP."""
        return self.find_unused_parameters and not self.static_graph

    @property
    def needs_used_map(self) -> bool:
        """The status may carry the global used map (which parameters got a gradient on
        some rank): with ``find_unused_parameters`` or ``static_graph``."""
        return self.find_unused_parameters or self.static_graph

    @property
    def bucket_cap_bytes_list(self) -> list[int] | None:
        """``bucket_cap_mb_list`` in bytes (``int(mb * 2**20)`` each, as DDP), or None."""
        if self.bucket_cap_mb_list is None:
            return None
        return [int(mb * MiB) for mb in self.bucket_cap_mb_list]

    @property
    def bucket_cap_bytes(self) -> int:
        """The bucket cap in bytes (with ``bucket_cap_mb_list``: its largest, as DDP's
        ``bucket_bytes_cap``)."""
        if self.bucket_cap_mb_list is not None:
            return max(self.bucket_cap_bytes_list)
        mb = self.bucket_cap_mb
        if mb is None or mb == AUTO:  # "auto": the cap until it is measured
            mb = DEFAULT_SHARD_BUCKET_CAP_MB if self.shard_optimizer else DEFAULT_BUCKET_CAP_MB
        return int(mb * MiB)

    @property
    def first_bucket_cap_bytes(self) -> int:
        if self.bucket_cap_mb_list is not None:
            return self.bucket_cap_bytes_list[0]
        if self.first_bucket_cap_mb == AUTO:
            return self.bucket_cap_bytes  # until it is measured
        if self.first_bucket_cap_mb is not None:
            return int(self.first_bucket_cap_mb * MiB)
        if self.bucket_cap_mb is None:
            return dist._DEFAULT_FIRST_BUCKET_BYTES if dist.is_available() \
                else DEFAULT_FIRST_BUCKET_CAP_MB * MiB
        return self.bucket_cap_bytes
