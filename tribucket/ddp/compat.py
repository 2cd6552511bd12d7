"""DDP's spellings on the reducer: ``join()``, the options as read-only attributes,
``_set_static_graph()`` and ``logging_data()`` (DDP's ``_get_ddp_logging_data()``)."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch.distributed as dist
from torch.distributed.algorithms.join import Join

from ..config import DEFAULT_BUCKET_CAP_MB, DEFAULT_SHARD_BUCKET_CAP_MB, ReducerConfig

__all__ = ["CommTimings", "DDPCompat", "bucket_sizes", "logging_data"]


def _tuned_cap(reducer: Any) -> int | None:
    """The bucket cap ``bucket_cap_mb="auto"`` has in use, or None without a tuner."""
    tuner = getattr(getattr(reducer, "_bw", None), "tuner", None)
    return None if tuner is None else tuner.policy.caps[0]


class _Option:
    """A read-only attribute showing one reducer option under DDP's name."""

    def __init__(self, read: Callable[[ReducerConfig], Any] | None = None, doc: str = "",
                 live: Callable[[Any], Any] | None = None):
        self._read = read
        self._live = live  # reads the reducer first; None from it: the configured value
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        value = self._live(obj) if self._live is not None else None
        if value is not None:
            return value
        cfg = obj.config
        return self._read(cfg) if self._read is not None else getattr(cfg, self._name)

    def __set__(self, obj: Any, value: Any) -> None:
        raise AttributeError(
            f"reducer.{self._name} is read-only: the options are fixed when the reducer is "
            f"built, the same on every rank; pass {self._name}={value!r} to "
            "tribucket.fused_bucketing(model, ...) or Reducer(model, ...) instead")


class CommTimings:
    """Backward timings of every averaged backward, for ``logging_data()``'s averages.

    Per pass: compute (backward start to the autograd engine finishing), communication
    (first bucket launched to every ``.grad`` averaged), their overlap, and the exposed
    communication (engine finished to every ``.grad`` averaged).
    """

    __slots__ = ("last", "sums", "count")

    def __init__(self) -> None:
        self.last = (0.0, 0.0, 0.0, 0.0)  # compute, comm, overlap, exposed (seconds)
        self.sums = [0.0, 0.0, 0.0, 0.0]
        self.count = 0

    def record(self, t_start: float, t_comm_start: float, t_end: float, t_done: float) -> None:
        """One averaged backward: begun at ``t_start``, first bucket launched at
        ``t_comm_start``, computation ended at ``t_end``, averages in place at ``t_done``."""
        comm_start = min(t_comm_start, t_done)
        self.last = (t_end - t_start, t_done - comm_start,
                     max(0.0, min(t_end, t_done) - comm_start), t_done - t_end)
        self.sums = [s + v for s, v in zip(self.sums, self.last)]
        self.count += 1

    def as_ns(self) -> dict[str, int]:
        names = ("backward_compute_time", "backward_comm_time",
                 "backward_compute_comm_overlap_time", "backward_comm_exposed_time")
        out = {n: round(v * 1e9) for n, v in zip(names, self.last)}
        n = max(self.count, 1)
        out.update({f"avg_{k}": round(s / n * 1e9) for k, s in zip(names, self.sums)})
        return out


def bucket_sizes(layout) -> str:
    """DDP's format of bucket sizes: bytes of each bucket's tensors, in bucket order."""
    return ", ".join(str(b.payload_bytes) for b in layout.buckets)


class DDPCompat:
    """DDP's spellings on :class:`tribucket.Reducer` that read only its ``config``: the
    options as attributes, ``join()``, ``_set_static_graph()``."""

    find_unused_parameters = _Option(doc="DDP's ``find_unused_parameters`` (read-only).")
    static_graph = _Option(doc="DDP's ``static_graph`` (read-only).")
    gradient_as_bucket_view = _Option(doc="DDP's ``gradient_as_bucket_view`` (read-only).")
    broadcast_buffers = _Option(doc="``True``, ``False`` or ``'ddp'`` (read-only).")
    bucket_cap_mb = _Option(lambda c: max(c.bucket_cap_mb_list) if c.bucket_cap_mb_list
                            else (DEFAULT_SHARD_BUCKET_CAP_MB if c.shard_optimizer
                                  else DEFAULT_BUCKET_CAP_MB)
                            if c.bucket_cap_mb is None else c.bucket_cap_mb,
                            "The bucket cap in MiB (with ``bucket_cap_mb_list``, its largest; "
                            "read-only).")
    bucket_bytes_cap = _Option(lambda c: c.bucket_cap_bytes,
                               "DDP's ``bucket_bytes_cap``: the bucket cap in bytes in use "
                               "(with ``bucket_cap_mb='auto'``, the candidate being measured, "
                               "then the choice; read-only).", live=_tuned_cap)

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """Train on uneven inputs, as ``DDP.join()``: ``with reducer.join(): ...``.

        Returns torch's ``Join`` context over this reducer; same as ``Join([reducer],
        enable, throw_on_early_termination, divide_by_initial_world_size=...)``. To join
        other ``Joinable`` objects too (a ``ZeroRedundancyOptimizer``), use ``Join``.
        """
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def _set_static_graph(self) -> None:
        """DDP's ``_set_static_graph()``: here the option is passed when building."""
        if self.config.static_graph:
            warnings.warn("static_graph=True is already set; no need to set it again",
                          stacklevel=2)
            return
        raise RuntimeError(
            "reducer._set_static_graph() cannot change the options of a built reducer "
            "(they are fixed when it is built, the same on every rank): pass static_graph=True to "
            "tribucket.fused_bucketing(model, static_graph=True) or Reducer(model, ...)")


def logging_data(reducer: Any, params: list, hook: Callable | None, initial_sizes: str,
                 unused: list[int], rebuilt: bool, timings: CommTimings) -> dict[str, Any]:
    """``reducer.logging_data()``: see :meth:`tribucket.Reducer.logging_data`.

    ``params`` are the averaged parameters, ``hook`` the registered comm hook (``None``:
    the default allreduce), ``initial_sizes`` the initial layout's :func:`bucket_sizes`,
    ``unused`` the indices of the parameters the last forward did not reach.
    """
    cfg = reducer.config
    mode = cfg.broadcast_buffers
    layout = reducer.layout
    out: dict[str, Any] = dict(
        world_size=reducer.world_size,
        rank=reducer.rank,
        module_name=type(reducer.module).__name__,
        backend_name=dist.get_backend(reducer.process_group),
        dtypes=", ".join(sorted({str(p.dtype).replace("torch.", "") for p in params})),
        num_parameter_tensors=len(params),
        total_parameter_size_bytes=sum(p.numel() * p.element_size() for p in params),
        bucket_cap_bytes=cfg.bucket_cap_bytes,
        find_unused_parameters=int(cfg.find_unused_parameters),
        static_graph=int(cfg.static_graph),
        gradient_as_bucket_view=int(cfg.gradient_as_bucket_view),
        broadcast_buffers=mode if isinstance(mode, str) else int(mode),
        comm_hook=None if hook is None else getattr(hook, "__qualname__", repr(hook)),
        iteration=reducer.stats.iterations,
        bucket_sizes=initial_sizes,
        has_rebuilt_buckets=int(rebuilt),
        rebuilt_bucket_sizes=bucket_sizes(layout) if rebuilt else None,
        rebuilt_per_bucket_param_indices=", ".join(
            " ".join(map(str, b.indices)) for b in layout.buckets) if rebuilt else None,
        num_buckets_reduced=len(layout.buckets) - reducer.stats.buckets_skipped,
        unused_parameter_size=sum(params[i].numel() * params[i].element_size()
                                  for i in unused),
    )
    out.update(timings.as_ns())
    return out
