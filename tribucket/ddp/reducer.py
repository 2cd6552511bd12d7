"""The data-parallel reducer: DDP's gradient averaging, with fused buckets, in Python.

The path of one gradient: the post-accumulate-grad hook (:meth:`Reducer._on_grad_ready`,
here) counts it in its bucket; the bucket (``bucket.py``) is packed when complete (its
memory, ``memory.py``, one fused call into ``tribucket.kernels``), communicated, and at
the end of backward lent back as ``.grad`` views of the averaged buffer.

This object keeps only what spans buckets: the order in which buckets are launched
(strictly in bucket order on every rank, so every rank issues the same collectives in the
same order) and the end of backward. The end of backward is an autograd-engine callback,
queued from a pre-hook on the forward output's ``grad_fn`` (so it belongs to the outermost
backward even under reentrant checkpointing) or, failing that, from the first gradient
hook. There the status (``status.py``) tells every rank whether any rank missed gradients
(and, for fp16 hooks, overflowed), so an error is raised on every rank instead of leaving
one waiting. The layout and its rebuild are ``rebuild.py``; uneven inputs ``join.py``;
checkpoints ``resume.py``; timeouts and debug fingerprints ``watchdog.py``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from .. import kernels
from .._env import describe_backend
from ..comm import broadcast_coalesced
from ..config import ReducerConfig
from ..hooks import _hook_traits
from ..layout import BucketLayout
from . import resume
from .bucket import BucketState, Comm, DenseBucket, SparseBucket
from .graph import output_tensors, reachable_parameters
from .hookcall import HookRef, hook_name
from .join import JoinFlags, ReducerJoinHook
from .memory import BucketMemory
from .model import inspect_model, verify_across_ranks
from .rebuild import DDP_ALIGN_BYTES, LayoutPolicy
from .state import Pass, ReducerStats
from .status import Status
from .watchdog import CommGuard

__all__ = ["Reducer", "ReducerStats", "fused_bucketing"]

logger = logging.getLogger("tribucket")

# Alignment of each gradient inside a bucket for tribucket's own paths on GPU (16 bytes lets
# the kernels use 128-bit accesses). Generic comm hooks, and the CPU, get DDP's unpadded
# buffers.
_ALIGN_BYTES = 16


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

        # collaborators, each given its inputs
        self._policy = LayoutPolicy(config, self._params, view.expect_sparse)
        self._status = Status(self._guard, self.rank, self.world_size, len(self._params),
                              self._device, config.needs_used_map)
        self._join_flags = JoinFlags(self.process_group, self._device, self.rank, self._guard)
        # how buckets are communicated (register_comm_hook may replace the hook)
        self._comm = Comm(self._guard, None, None, _hook_traits(None, None), self._guard.group,
                          self.world_size)
        # layout and the buckets over it (built at the first backward)
        self._layout = self._policy.initial()
        self._buckets: list[DenseBucket | SparseBucket] = []
        self._slot: list = []                  # parameter -> (its bucket, position in it)
        self._allocated = False
        self._piggyback = False                # the status rides on the last bucket
        self._found_inf_arg = None             # found_inf when the hook checks overflow
        # iteration state
        self._pass: Pass | None = None
        self._sync_enabled = True              # False inside no_sync()
        self._fwd_sync: bool | None = None     # decision of the last grad-enabled forward
        self._require_forward_param_sync = True  # broadcast buffers before the next forward
        self._unused: list[int] = []           # parameters the last forward did not reach
        self._static_counts: list[int] | None = None  # static_graph: hooks per parameter
        self._static_used: list | None = None  # static_graph: global used map
        self._ready_order: list[int] = []      # first synced pass: gradient-ready order
        self._rebuilt = False
        self._passes = 0                       # backward passes begun (synced or not): the
        # iteration number that fingerprints and failure reports use, equal on every rank
        self._join_work = None                 # Join: the notify allreduce (ranks active)
        self.found_inf = torch.zeros(1, dtype=torch.float32, device=self._device)
        self.stats = ReducerStats(buckets=len(self._layout.buckets))
        self._handles: list = []
        self._hook_refs: list[HookRef] = []
        self._closed = False
        self._backward_start_ref = self._hook_ref("_on_backward_start")
        self._attach()

    # ------------------------------------------------------------------ set-up
    def _broadcast_states(self, src_rank: int, buffers: bool) -> None:
        tensors = [p.detach() for _, p in self._state_params]
        if buffers:
            tensors += [b.detach() for _, b in self._buffers]
        broadcast_coalesced(tensors, src=src_rank, group=self._guard.group_arg())

    def _attach(self) -> None:
        for i, p in enumerate(self._params):  # tied parameters appear once in the list
            self._handles.append(
                p.register_post_accumulate_grad_hook(self._hook_ref("_on_grad_ready", i)))
        self._handles.append(self.module.register_forward_pre_hook(
            self._hook_ref("_pre_forward")))
        self._handles.append(self.module.register_forward_hook(self._hook_ref("_post_forward")))

    def _hook_ref(self, method: str, *args: Any) -> HookRef:
        ref = HookRef(self, method, args)
        self._hook_refs.append(ref)
        return ref

    # ------------------------------------------------------------------ public API
    @property
    def layout(self) -> BucketLayout:
        """The current bucket layout (DDP's, before and after the rebuild)."""
        return self._layout

    @property
    def parameter_names(self) -> list[str]:
        """Names of the averaged parameters; ``layout`` indices point into this list."""
        return list(self._names)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next backward outside reduces their sum."""
        old, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = old

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
        if self._allocated or self.stats.iterations > 0:
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
        progress = dict(rebuilt=self._rebuilt, iterations=self.stats.iterations,
                        passes=self._passes, static_counts=self._static_counts,
                        static_used=self._static_used)
        return resume.state_dict(self._names, self._layout, progress, self._comm.hook,
                                 self._comm.hook_state)

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` into a reducer over the same model (before training).

        Register the same comm hook (with a fresh state object) before loading, so its
        state — the gossip schedule, PowerSGD's error feedback and random state — is
        restored too.
        """
        if self._pass is not None:
            raise RuntimeError("load_state_dict cannot run during a backward pass")
        self._layout, progress = resume.read_state_dict(
            state, self._names, self._params, self._comm.hook, self._comm.hook_state)
        self._rebuilt = progress["rebuilt"]
        self._static_counts, self._static_used = progress["static_counts"], progress["static_used"]
        self._ready_order = []
        self.stats.iterations, self._passes = progress["iterations"], progress["passes"]
        self.stats.rebuilds = int(self._rebuilt)
        self.stats.buckets = len(self._layout.buckets)
        self._allocated = False  # buckets follow the restored layout at the next backward

    def close(self) -> None:
        """Detach from the model: remove every hook, finish the communication in flight.

        Raises ``RuntimeError`` if a collective in flight failed (after detaching)."""
        self._close(raise_errors=True)

    def __enter__(self) -> "Reducer":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self._close(raise_errors=exc_type is None)  # never mask the body's own exception

    def _close(self, raise_errors: bool) -> None:
        if self._closed:
            return
        self._closed = True
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for ref in self._hook_refs:
            ref.detach()  # graphs still holding a hook no longer reach the reducer
        self._hook_refs.clear()
        p, self._pass = self._pass, None
        if p is None or not p.sync or self._guard.failed:
            return
        # finish what is in flight so no peer is left waiting
        errors = [(b, e) for b in self._buckets if (e := b.wait_quietly()) is not None]
        if not errors:
            return
        b, e = errors[0]
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
            self._join_work = Join.notify_join_context(self)
        if self._require_forward_param_sync:
            # under Join rank 0 may have left: agree on the highest rank still training
            self._broadcast_buffers(lambda: self._join_flags.common_rank(True, self._passes)
                                    if joining else 0)
        if joining:  # tell joined ranks whether this iteration synchronises
            self._join_flags.allreduce(1.0 if self._sync_enabled else 0.0, self._passes)

    def _broadcast_buffers(self, source: Callable[[], int]) -> None:
        if not (self.config.broadcast_buffers and self._buffers and self.world_size > 1):
            return
        src = source()
        self._guard.fingerprint("buffers", self._passes, 0, len(self._buffers), None)
        broadcast_coalesced([b.detach() for _, b in self._buffers], src=src,
                            group=self._guard.group_arg())

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        sync = self._sync_enabled
        self._require_forward_param_sync = sync
        self._fwd_sync = sync
        outs = output_tensors(output)
        if sync and self.config.dynamic_unused:
            reached = reachable_parameters(outs)
            self._unused = [i for i, p in enumerate(self._params) if id(p) not in reached]
        # queue the end-of-backward callback from the outermost backward that reaches
        # an output (a hook on the parameters could fire inside a reentrant backward)
        for t in outs:
            if t.grad_fn is not None:
                t.grad_fn.register_prehook(self._backward_start_ref)

    # ------------------------------------------------------------------ backward
    def _on_backward_start(self, grad_outputs):
        if self._closed:
            return None
        p = self._pass if self._pass is not None else self._begin_pass()
        if not p.callback_queued:
            p.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
        return None

    def _begin_pass(self) -> Pass:
        sync = self._fwd_sync if self._fwd_sync is not None else self._sync_enabled
        self._fwd_sync = None
        self._passes += 1
        p = self._pass = Pass(sync, len(self._params), self._passes)
        return p

    def _on_grad_ready(self, index: int, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook of parameter ``index``: count its gradient in."""
        p = self._pass
        if p is None:
            p = self._begin_pass()
        if not p.callback_queued:
            p.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
        if not p.sync:
            return
        p.fired[index] += 1
        if not p.any_ready:
            p.any_ready = True
            self._first_gradient(p)
        if self.config.static_graph:
            counts = self._static_counts
            if counts is None:
                return  # first iteration of a static graph: everything launches at the end
            if p.fired[index] != counts[index]:
                if p.fired[index] > counts[index]:
                    p.errors.append(
                        f"static_graph=True: parameter {self._names[index]!r} received "
                        f"{p.fired[index]} gradient(s) in this backward but {counts[index]} "
                        "in the first iteration: the graph changed, which static_graph does "
                        "not allow")
                return
        elif p.ready[index]:
            p.errors.append(self._second_gradient_error(index))
            return  # recorded; raised on every rank at the end of backward, after the
            # collectives, so no rank is left waiting
        if p.record_order:
            self._ready_order.append(index)  # gradient-ready order, for the rebuild
        self._mark_ready(p, index)

    def _second_gradient_error(self, index: int) -> str:
        name = self._names[index]
        if index in self._unused:
            return (f"parameter {name!r} was found unused after the forward (no path from the "
                    "forward's outputs reaches it) but then received a gradient; compute the "
                    "loss from the model's outputs")
        return (f"parameter {name!r} received a second gradient in the same backward pass. "
                "Causes: the parameter is used in several reentrant backward passes "
                "(torch.utils.checkpoint with use_reentrant=True: pass static_graph=True or "
                "use use_reentrant=False), or it is used outside the model's forward in "
                "another graph")

    def _first_gradient(self, p: Pass) -> None:
        """The first parameter gradient of a synchronised pass: buckets, unused params."""
        if not self._allocated:
            self._allocate()
        for bucket in self._buckets:
            bucket.reset()
        self._guard.mark_progress(p.iteration)
        p.scale = 1.0 / self._divisor() if self._comm.traits.prescale else 1.0
        if self._found_inf_arg is not None:
            self.found_inf.zero_()  # the pack kernels only ever set it
        cfg = self.config
        p.record_order = (self._policy.may_rebuild(self._rebuilt)
                          and (not cfg.static_graph or self._static_counts is not None))
        if cfg.static_graph and self._static_counts is None:
            return
        if cfg.static_graph or cfg.find_unused_parameters:
            for i in self._unused:
                self._mark_ready(p, i)

    def _divisor(self) -> int:
        """The world size, or under ``Join(divide_by_initial_world_size=False)`` the ranks
        still training (the count the join notification allreduce produced)."""
        work, self._join_work = self._join_work, None
        if work is None or self._join_flags.divide_by_initial_world_size:
            return self.world_size
        self._guard.wait(work, "the Join notification", self._passes)
        return max(1, int(work.result()[0].item()))

    def _mark_ready(self, p: Pass, index: int) -> None:
        p.ready[index] = 1
        bucket, k = self._slot[index]
        if bucket.eager:
            bucket.put(k, p.scale, self._found_inf_arg)
        bucket.pending -= 1
        if bucket.index != p.next_bucket:
            if bucket.pending == 0:
                bucket.state = BucketState.READY  # launched when its predecessors are
            return
        if bucket.pending == 0:
            bucket.state = BucketState.READY
            self._advance(p)
        elif bucket.chunked:
            bucket.send_ready_chunks(p, self._comm)

    def _advance(self, p: Pass) -> None:
        """Launch every complete bucket whose predecessors are launched, in bucket order,
        then the ready chunks of the first incomplete one."""
        buckets, comm = self._buckets, self._comm
        while p.next_bucket < len(buckets) and buckets[p.next_bucket].state == BucketState.READY:
            buckets[p.next_bucket].launch(p, comm, self._found_inf_arg)
            p.next_bucket += 1
        if p.next_bucket < len(buckets) and buckets[p.next_bucket].chunked:
            buckets[p.next_bucket].send_ready_chunks(p, comm)

    # ------------------------------------------------------------------ buckets
    def _allocate(self) -> None:
        """Build the buckets of the current layout for the current hook."""
        cfg, traits = self.config, self._comm.traits
        align = self._align_bytes()
        if align != self._layout.align_bytes:
            encoded = self._layout.to_tensor().clone()
            encoded[2] = align
            self._layout = BucketLayout.from_tensor(encoded, self._params)
        specs = self._layout.buckets
        # the end-of-backward status rides at the end of the last bucket's allreduce when the
        # reducer sends that allreduce itself (one collective fewer per iteration)
        self._piggyback = (self.world_size > 1 and traits.chunkable and bool(specs)
                           and not specs[-1].sparse)
        self._found_inf_arg = self.found_inf if traits.check_overflow else None
        eager = cfg.pack_on_ready if cfg.pack_on_ready is not None \
            else self._device.type == "cpu"
        self._buckets, self._slot = [], [None] * len(self._params)
        prev = None
        for b, spec in enumerate(specs):
            params = [self._params[i] for i in spec.indices]
            last = b == len(specs) - 1
            if spec.sparse:
                bucket = SparseBucket(b, spec, params, last, self._names[spec.indices[0]])
            else:
                plan = kernels.BucketPlan(spec.sizes, spec.offsets, spec.numel, spec.device)
                tail = self._status.length if self._piggyback and last else 0
                mem = BucketMemory(spec, params, self._wire_dtype(spec.dtype), plan,
                                   always_view=cfg.gradient_as_bucket_view, eager=eager,
                                   tail=tail)
                if cfg.gradient_as_bucket_view and any(q.grad is not None for q in params):
                    # (rebuild) carry the accumulated gradients over and view the new bucket
                    buf = mem.pack([q.grad for q in params], 1.0, None)
                    mem.finish(buf, [q.grad is not None for q in params])
                bucket = DenseBucket(b, spec, params, last, mem,
                                     mem.chunk_bounds(cfg.comm_chunk_mb, traits.chunkable),
                                     self._write_status_tail if tail else None, prev)
            for k, i in enumerate(spec.indices):
                self._slot[i] = (bucket, k)
            self._buckets.append(bucket)
            prev = bucket
        self._allocated = True
        self.stats.buckets = len(specs)
        # the buffers one iteration needs (one per bucket, in its wire dtype); a gradient
        # the user keeps across iterations holds on to an older buffer on top of this
        self.stats.bucket_bytes_allocated = sum(b.mem.capacity_bytes() for b in self._buckets
                                                if b.mem is not None)

    def _align_bytes(self) -> int:
        # Padding only helps the GPU kernels; generic hooks get DDP's unpadded buffers
        if self._comm.traits.builtin and self._device.type == "cuda":
            return _ALIGN_BYTES
        return DDP_ALIGN_BYTES

    def _wire_dtype(self, bucket_dtype: torch.dtype) -> torch.dtype:
        wire = self._comm.traits.wire_dtype
        if wire is not None and bucket_dtype in (torch.float32, torch.float16, torch.bfloat16):
            return wire
        return bucket_dtype

    # ------------------------------------------------------------------ end of backward
    def _finalize(self) -> None:
        p, self._pass = self._pass, None
        if p is None or not p.sync:
            return
        if not p.any_ready:
            # a backward that produced no parameter gradient (e.g. torch.autograd.grad
            # w.r.t. inputs): nothing to average, no collective
            return
        t_end = time.perf_counter()
        cfg = self.config
        if cfg.static_graph and self._static_counts is None:
            # the first iteration of a static graph: learn the hook counts, launch all
            self._static_counts = list(p.fired)
            self._unused = [i for i, c in enumerate(p.fired) if c == 0]
            p.ready = bytearray(b"\x01") * len(self._params)
            for bucket in self._buckets:
                bucket.pending, bucket.state = 0, BucketState.READY
        used = self._local_used(p)
        n_missing = p.ready.count(0)
        # launch whatever is left, with zeros for missing gradients, so no peer is left
        # blocked in a collective this rank would never join
        for b in range(p.next_bucket, len(self._buckets)):
            self._buckets[b].launch(p, self._comm, self._found_inf_arg)
        p.next_bucket = len(self._buckets)

        results, status, self.stats.status_check_s = self._exchange_status(
            p, n_missing + len(p.errors), used)
        if self._piggyback and len(p.errors) > p.status_errors:
            # misuse seen after the status was sent with the last bucket: this rank only
            self._status.raise_problems([], [0.0] * self.world_size, p.errors)
        counts = self._status.problems(status)
        if sum(counts) > 0:
            missing = [self._names[i] for i in range(len(self._params)) if not p.ready[i]]
            self._status.raise_problems(missing, counts, p.errors)
        if self._found_inf_arg is not None:
            self.found_inf.fill_(1.0 if self._status.overflow(status) else 0.0)
        global_used = None
        if used is not None:
            global_used = self._status.used(status)
            if cfg.static_graph:
                self._static_used = global_used  # the static graph's used set, once
        elif cfg.static_graph:
            global_used = self._static_used
        for bucket, result in zip(self._buckets, results):
            targets = (bucket.targets_all if global_used is None
                       else [global_used[i] for i in bucket.indices])
            bucket.finish(result, targets)
        done = time.perf_counter()
        st = self.stats
        st.iterations += 1
        st.backward_compute_s = t_end - p.t_start
        st.comm_exposed_s = done - t_end
        st.bytes_communicated = p.bytes
        if cfg.debug:
            st.bucket_comm_s = [done - b.t_launch for b in self._buckets]
            self._log_buckets(st.bucket_comm_s)
        if self._policy.may_rebuild(self._rebuilt) and self._ready_order:
            self._rebuild(self._ready_order)

    def _local_used(self, p: Pass) -> list | None:
        """This rank's used map when the global one is needed this iteration, else None."""
        cfg = self.config
        if not (cfg.find_unused_parameters or (cfg.static_graph and self._static_used is None)):
            return None
        if p.shadow:
            return [0.0] * len(self._params)
        # locally used: the hook fired with a gradient (DDP's local_used_map)
        return [1.0 if (f > 0 and self._params[i].grad is not None) else 0.0
                for i, f in enumerate(p.fired)]

    def _overflow(self) -> float:
        return float(self.found_inf.item()) if self._found_inf_arg is not None else 0.0

    def _write_status_tail(self, p: Pass, buf: torch.Tensor) -> int:
        """Write this rank's status into the tail of the last bucket's buffer."""
        problems = 0 if p.shadow else p.ready.count(0) + len(p.errors)
        p.status_errors = len(p.errors)
        return self._status.write_tail(
            buf, self._status.tensor(problems, self._overflow(), self._local_used(p)))

    def _exchange_status(self, p: Pass, problems: int,
                         used: list | None) -> tuple[list, torch.Tensor, float]:
        """Wait for every bucket's result and agree on the status across ranks: returns the
        results, the reduced status and the seconds spent waiting on the status."""
        start = time.perf_counter()
        if self._piggyback:  # written into the last bucket when it was sent
            results = [b.wait() for b in self._buckets]
            status = self._status.read_tail(self._buckets[-1].mem.active)
            return results, status, time.perf_counter() - start
        status = self._status.tensor(problems, self._overflow(), used)
        serialize = self._comm.traits.serialize  # hook callbacks may issue collectives
        work = None if serialize else self._status.launch(status, p.iteration)
        results = [b.wait() for b in self._buckets]
        if serialize:
            work = self._status.launch(status, p.iteration)
        start = time.perf_counter()
        self._status.wait(work, p.iteration)
        return results, status, time.perf_counter() - start

    def _rebuild(self, order: list[int]) -> None:
        self._ready_order = []
        self._layout = self._policy.rebuilt(order, self._unused, self._layout.align_bytes,
                                            self._guard, self.world_size, self._passes)
        self._rebuilt = True
        self.stats.rebuilds += 1
        self._allocate()

    def _shadow_iteration(self) -> None:
        """On a rank that ran out of inputs (``Join``): issue the collectives one iteration
        of the others issues, contributing zeros."""
        flags = self._join_flags
        if self._require_forward_param_sync:
            self._broadcast_buffers(lambda: flags.common_rank(False, self._passes))
        sync = flags.allreduce(0.0, self._passes) != 0
        self._require_forward_param_sync = sync
        self._passes += 1
        if not sync:
            return
        if not self._allocated:
            self._allocate()
        p = Pass(True, len(self._params), self._passes)
        p.shadow = True
        for bucket in self._buckets:
            bucket.reset()
            bucket.launch(p, self._comm, None, zeros=True)
        cfg = self.config
        used = self._local_used(p)
        # zeros plus the others' gradients: the results are discarded
        _, status, _ = self._exchange_status(p, 0, used)
        if used is not None and cfg.static_graph:
            self._static_used = self._status.used(status)
        if cfg.static_graph and self._static_counts is None:
            self._static_counts = [1] * len(self._params)
        self.stats.iterations += 1
        if self._policy.may_rebuild(self._rebuilt) and not (
                cfg.static_graph and self.stats.iterations < 2):
            self._rebuild(list(range(len(self._params))))

    def _log_buckets(self, seconds: list[float]) -> None:
        for b, (bucket, s) in enumerate(zip(self._layout.buckets, seconds)):
            names = [self._names[i] for i in bucket.indices]
            logger.info("tribucket rank %d iteration %d bucket %d: %d tensors, %d bytes, "
                        "%.2f ms from launch to end of backward: %s", self.rank,
                        self.stats.iterations, b, len(names), bucket.nbytes, s * 1e3,
                        ", ".join(names[:8]) + (" ..." if len(names) > 8 else ""))


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
