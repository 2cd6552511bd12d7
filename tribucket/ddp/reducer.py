"""The data-parallel reducer's public face: DDP's gradient averaging, with fused buckets.

:class:`Reducer` attaches to a model (hooks on its forward and on every parameter), holds
the public API (``no_sync``, ``register_comm_hook``, ``state_dict``, ``close``, ``Join``)
and hands each backward pass to its :class:`~tribucket.ddp.backward.Backward`, which keeps
the cross-bucket order and the end of backward. See ``tribucket/ddp/__init__.py`` for the
files one gradient goes through.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from .._env import describe_backend
from ..comm import broadcast_coalesced
from ..config import ReducerConfig
from ..hooks import _hook_traits
from ..layout import BucketLayout
from . import resume
from .backward import Backward
from .bucket import Comm
from .graph import output_tensors, reachable_parameters
from .hookcall import HookRef, hook_name
from .join import JoinFlags, ReducerJoinHook
from .model import inspect_model, verify_across_ranks
from .state import ReducerStats
from .watchdog import CommGuard

__all__ = ["Reducer", "ReducerStats", "fused_bucketing"]

logger = logging.getLogger("tribucket")


class Reducer(Joinable):
    """Average gradients across ranks with DDP's semantics; see :func:`fused_bucketing`.

    Usable directly: ``reducer = Reducer(model)`` attaches, ``reducer.close()`` detaches
    (or use it as a context manager). It is a ``torch.distributed.algorithms.Joinable``:
    ``with Join([reducer]): ...`` trains on uneven inputs as ``DDP.join()`` does.
    """

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None, *,
                 config: ReducerConfig | None = None, **options: Any):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(module).__name__}")
        if config is None:
            config = ReducerConfig(**options)
        elif options:
            raise TypeError(f"pass either config= or keyword options, not both: {sorted(options)}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("tribucket needs torch.distributed: call "
                               "dist.init_process_group(...) (or launch with torchrun) first")
        self.config = config
        self.module = module
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        logger.info("tribucket reducer on rank %d/%d: %s", self.rank, self.world_size,
                    describe_backend())

        view = inspect_model(module, config.ignore_parameters)
        self._state_params, self._buffers = view.state_params, view.buffers
        self._names, self._params = view.names, view.params
        self._device = view.device
        # the reducer's own collectives: a group with the timeout, failure diagnosis, debug
        self._guard = CommGuard(self.process_group, self.rank, self.world_size, self._device,
                                config.timeout, config.debug)
        verify_across_ranks(view, self._guard.group, self.world_size)
        self._broadcast_states(src_rank=0, buffers=config.broadcast_buffers)

        # how buckets are communicated (register_comm_hook may replace the hook)
        self._comm = Comm(self._guard, None, None, _hook_traits(None, None), self._guard.group,
                          self.world_size)
        self._join_flags = JoinFlags(self.process_group, self._device, self.rank, self._guard)
        # the backward passes: buckets, their order, the end of backward
        self._bw = Backward(config, self._params, self._names, view.expect_sparse,
                            self._guard, self._comm, self._join_flags, self._device)
        self._require_forward_param_sync = True  # broadcast buffers before the next forward
        #: set to 1.0 by a compression hook with ``check_overflow`` when the averaged
        #: gradients overflowed in the last backward
        self.found_inf = self._bw.found_inf
        #: figures of the last backward (:class:`ReducerStats`)
        self.stats = self._bw.stats
        self._handles: list = []
        self._hook_refs: list[HookRef] = []
        self._backward_start_ref = self._hook_ref(self._bw, "on_backward_start")
        self._attach()

    # ------------------------------------------------------------------ set-up
    def _broadcast_states(self, src_rank: int, buffers: bool) -> None:
        tensors = [p.detach() for _, p in self._state_params]
        if buffers:
            tensors += [b.detach() for _, b in self._buffers]
        broadcast_coalesced(tensors, src=src_rank, group=self._guard.group_arg())

    def _attach(self) -> None:
        bw, module = self._bw, self.module
        for p, hook in zip(self._params, bw.grad_hooks):  # tied parameters appear once
            # the bound method: torch calls it through the vectorcall fast path, an object
            # with __call__ through slot_tp_call (~300 instructions more per gradient)
            self._handles.append(p.register_post_accumulate_grad_hook(hook.__call__))
        self._handles.append(module.register_forward_pre_hook(
            self._hook_ref(self, "_pre_forward")))
        self._handles.append(module.register_forward_hook(self._hook_ref(self, "_post_forward")))

    def _hook_ref(self, target: Any, method: str, *args: Any) -> HookRef:
        ref = HookRef(target, method, args)
        self._hook_refs.append(ref)
        return ref

    # ------------------------------------------------------------------ public API
    @property
    def layout(self) -> BucketLayout:
        """The current bucket layout (DDP's, before and after the rebuild)."""
        return self._bw.layout

    @property
    def parameter_names(self) -> list[str]:
        """Names of the averaged parameters; ``layout`` indices point into this list."""
        return list(self._names)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next backward outside reduces their sum."""
        bw = self._bw
        old, bw.sync_enabled = bw.sync_enabled, False
        try:
            yield
        finally:
            bw.sync_enabled = old

    def register_comm_hook(self, state: Any, hook: Callable) -> None:
        """Register ``hook(state, bucket) -> Future[Tensor]`` to reduce each bucket.

        The contract is torch DDP's: the hook replaces the default averaging (it does its
        own division) and its future's value becomes the bucket's content. torch's own hooks
        (``allreduce_hook``, ``fp16_compress_hook``, ``powerSGD_hook``...) run unchanged.
        """
        if not callable(hook):
            raise TypeError(f"hook must be callable as hook(state, bucket), got "
                            f"{type(hook).__name__} {hook!r}")
        if self._comm.hook is not None:
            raise RuntimeError(f"a comm hook ({hook_name(self._comm.hook)}) is already "
                               "registered; register_comm_hook can be called only once per "
                               "reducer")
        if self._bw.allocated or self.stats.iterations > 0:
            raise RuntimeError("register_comm_hook must be called before the first backward "
                               "pass (the buckets are already built for the default hook)")
        traits = _hook_traits(hook, state)
        if traits.wire_dtype is not None and self.config.gradient_as_bucket_view:
            raise ValueError(
                f"{hook_name(hook)} packs gradients straight into a {traits.wire_dtype} wire "
                "buffer, so there is no full-precision bucket for .grad to view: use "
                "gradient_as_bucket_view=False with fused compression hooks")
        comm = self._comm
        comm.hook, comm.hook_state, comm.traits = hook, state, traits
        if traits.chunkable:  # the reducer sends it itself, on the group the state names
            named = getattr(state, "process_group", None) if not isinstance(
                state, dist.ProcessGroup) else state
            comm.chunk_group = named if named is not None else self._guard.group

    def state_dict(self) -> dict:
        """What a resumed run needs: the (rebuilt) layout, the iteration count, hook state."""
        bw = self._bw
        progress = dict(rebuilt=bw.rebuilt, iterations=bw.stats.iterations,
                        passes=bw.passes, static_counts=bw.static_counts,
                        static_used=bw.static_used)
        return resume.state_dict(self._names, bw.layout, progress, self._comm.hook,
                                 self._comm.hook_state)

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` into a reducer over the same model (before training).

        Register the same comm hook (with a fresh state object) before loading, so its
        state — the gossip schedule, PowerSGD's error feedback and random state — is
        restored too.
        """
        bw = self._bw
        if bw.pass_ is not None:
            raise RuntimeError("load_state_dict cannot run during a backward pass")
        bw.layout, progress = resume.read_state_dict(
            state, self._names, self._params, self._comm.hook, self._comm.hook_state)
        bw.rebuilt = progress["rebuilt"]
        bw.static_counts, bw.static_used = progress["static_counts"], progress["static_used"]
        bw.ready_order = []
        bw.stats.iterations, bw.passes = progress["iterations"], progress["passes"]
        bw.stats.rebuilds = int(bw.rebuilt)
        bw.stats.buckets = len(bw.layout.buckets)
        bw.allocated = False  # buckets follow the restored layout at the next backward

    def close(self) -> None:
        """Detach from the model: remove every hook, finish the communication in flight.

        Raises ``RuntimeError`` if a collective in flight failed (after detaching)."""
        self._close(raise_errors=True)

    def __enter__(self) -> "Reducer":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self._close(raise_errors=exc_type is None)  # never mask the body's own exception

    def _close(self, raise_errors: bool) -> None:
        if self._bw.closed:
            return
        self._bw.closed = True
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for ref in [*self._hook_refs, *self._bw.grad_hooks]:
            ref.detach()  # graphs still holding a hook no longer reach the reducer
        self._hook_refs.clear()
        failed = self._bw.finish_in_flight()  # so no peer is left waiting
        if failed is None:
            return
        b, e = failed
        message = (f"tribucket (rank {self.rank}): close() finished the communication in "
                   f"flight, and that of {b.describe()} failed: {e}")
        if raise_errors:
            raise RuntimeError(message) from e
        logger.error("%s", message)

    # ------------------------------------------------------------------ Joinable
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """Shadow this reducer's collectives on ranks that ran out of inputs (``Join``).

        ``divide_by_initial_world_size`` (default ``True``, as DDP): divide gradients by the
        initial world size; ``False`` divides by the number of ranks still training.
        """
        return ReducerJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self._device

    @property
    def join_process_group(self) -> Any:
        return self.process_group

    # ------------------------------------------------------------------ forward hooks
    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():
            return  # evaluation: no collective, so `if rank == 0: evaluate(model)` works
        joining = self._join_config.enable
        if joining:
            self._bw.join_work = Join.notify_join_context(self)
        if self._require_forward_param_sync:
            # under Join rank 0 may have left: agree on the highest rank still training
            self._broadcast_buffers(lambda: self._join_flags.common_rank(True, self._bw.passes)
                                    if joining else 0)
        if joining:  # tell joined ranks whether this iteration synchronises
            self._join_flags.allreduce(1.0 if self._bw.sync_enabled else 0.0, self._bw.passes)

    def _broadcast_buffers(self, source: Callable[[], int]) -> None:
        if not (self.config.broadcast_buffers and self._buffers and self.world_size > 1):
            return
        src = source()
        self._guard.fingerprint("buffers", self._bw.passes, 0, len(self._buffers), None)
        broadcast_coalesced([b.detach() for _, b in self._buffers], src=src,
                            group=self._guard.group_arg())

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        bw = self._bw
        sync = bw.sync_enabled
        self._require_forward_param_sync = sync
        bw.fwd_sync = sync
        outs = output_tensors(output)
        if sync and self.config.dynamic_unused:
            reached = reachable_parameters(outs)
            bw.unused = [i for i, p in enumerate(self._params) if id(p) not in reached]
        # queue the end-of-backward callback from the outermost backward that reaches
        # an output (a hook on the parameters could fire inside a reentrant backward)
        for t in outs:
            if t.grad_fn is not None:
                t.grad_fn.register_prehook(self._backward_start_ref)

    def _shadow_iteration(self) -> None:
        """On a rank that ran out of inputs (``Join``): issue the collectives one iteration
        of the others issues, contributing zeros."""
        bw, flags = self._bw, self._join_flags
        if self._require_forward_param_sync:
            self._broadcast_buffers(lambda: flags.common_rank(False, bw.passes))
        sync = flags.allreduce(0.0, bw.passes) != 0
        self._require_forward_param_sync = sync
        bw.passes += 1
        if sync:
            bw.shadow_pass()


def fused_bucketing(model: nn.Module, process_group: dist.ProcessGroup | None = None, *,
                    bucket_cap_mb: float | None = None,
                    first_bucket_cap_mb: float | None = None,
                    gradient_as_bucket_view: bool = False,
                    find_unused_parameters: bool = False,
                    static_graph: bool = False,
                    broadcast_buffers: bool = True,
                    ignore_parameters=(),
                    **options: Any) -> Reducer:
    """Average ``model``'s gradients across ranks, as DDP does, while the context is open.

    Example::

        with tribucket.fused_bucketing(model) as reducer:
            for x, y in loader:
                loss_fn(model(x), y).backward()   # .grad holds the average over ranks
                opt.step(); opt.zero_grad()

    Entering verifies the model is the same on every rank, broadcasts rank 0's parameters
    and buffers, and attaches hooks; leaving removes every hook. See :class:`ReducerConfig`
    for the options (they mean what DDP's do, plus ``timeout`` and ``debug``).
    """
    return Reducer(model, process_group, bucket_cap_mb=bucket_cap_mb,
                   first_bucket_cap_mb=first_bucket_cap_mb,
                   gradient_as_bucket_view=gradient_as_bucket_view,
                   find_unused_parameters=find_unused_parameters, static_graph=static_graph,
                   broadcast_buffers=broadcast_buffers, ignore_parameters=ignore_parameters,
                   **options)
