"""The data-parallel reducer: DDP's gradient averaging, with fused buckets, in Python.

State machine of one bucket in one backward pass::

    PENDING ──(last gradient of the bucket ready)──► READY
    READY ──(every earlier bucket launched)──► LAUNCHED   one fused pack + comm hook / allreduce
    LAUNCHED ──(end of backward: result arrived)──► DONE  the average becomes every .grad
    DONE ──(next backward)──► PENDING

Buckets are launched strictly in bucket order on every rank, so every rank issues the same
collectives in the same order. The end of backward is an autograd-engine callback, queued
from a pre-hook on the forward output's ``grad_fn`` (so it belongs to the outermost backward
even under reentrant checkpointing) or, failing that, from the first gradient hook. There a
tiny status allreduce (the tail of the last bucket's allreduce when the reducer sends that
itself) tells every rank whether any rank missed gradients (and, for fp16 hooks,
overflowed), so an error is raised on every rank instead of leaving one waiting.

This module holds the backward path; the rest of the class lives next to it, one part per
concern: ``_rebuild`` (which layout: DDP's initial one, the rebuild), ``_memory`` (a
bucket's buffers and the ``.grad`` views lent out of them), ``_status`` (the end-of-backward
status), ``_join`` (uneven inputs), ``_resume`` (``state_dict``), ``_watchdog`` (timeouts,
failure reports, debug fingerprints) and ``_hookcall`` (calling comm hooks).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join

from . import kernels
from ._env import describe_backend
from ._graph import output_tensors, reachable_parameters
from ._hookcall import HookRef, SparseWork, check_result, hook_name, invoke, invoke_after
from ._join import JoinSupport
from ._pass import ReducerStats, _BucketState, _Pass
from ._rebuild import _DDP_ALIGN_BYTES, LayoutSupport
from ._resume import ResumeSupport
from ._shard import ShardSupport, _ShardWork
from ._status import StatusSupport
from ._memory import BucketMemory
from ._model import inspect_model, verify_across_ranks
from ._watchdog import CommGuard
from .comm import broadcast_coalesced
from .config import ReducerConfig
from .grad_bucket import GradBucket
from .hooks import _hook_traits
from .layout import BucketLayout

__all__ = ["Reducer", "ReducerStats", "fused_bucketing"]

logger = logging.getLogger("tribucket")

# Alignment of each gradient inside a bucket for tribucket's own paths on GPU (16 bytes lets
# the kernels use 128-bit accesses). Generic comm hooks, and the CPU, get DDP's unpadded
# buffers.
_ALIGN_BYTES = 16


class Reducer(LayoutSupport, JoinSupport, StatusSupport, ResumeSupport, ShardSupport):
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
        self._names, self._params, self._index_of = view.names, view.params, view.index_of
        self._device, self._expect_sparse = view.device, view.expect_sparse
        # the reducer's own collectives: a group with the timeout, failure diagnosis, debug
        self._guard = CommGuard(self.process_group, self.rank, self.world_size, self._device,
                                config.timeout, config.debug)
        verify_across_ranks(view, self._guard.group, self.world_size)
        self._broadcast_states(src_rank=0, buffers=config.broadcast_buffers)

        # communication hook (register_comm_hook may replace it before the first backward)
        self._hook: Callable | None = None
        self._hook_state: Any = None
        self._traits = _hook_traits(None, None)
        self._chunk_group = self._guard.group  # where chunked averaging allreduces go
        # layout and the memory behind it (buffers are allocated at the first backward)
        self._layout = self._initial_layout()
        self._init_shards()  # shard_optimizer: this rank's slice of every bucket
        self._mem: list[BucketMemory | None] = []  # per bucket (None: sparse)
        self._bucket_params: list[list[torch.Tensor]] = []
        self._bucket_index: list[list[int]] = []   # per bucket: parameter indices
        self._chunks: list[list[tuple[int, int]]] = []  # per bucket: how it is sent
        self._allocated = False
        self._pack_mode = os.environ.get("TRIBUCKET_EAGER_PACK")
        # iteration state
        self._pass: _Pass | None = None
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
        self._divide_by_initial_world_size = True
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
        if self.config.shard_optimizer:
            raise ValueError(f"cannot register {hook_name(hook)}: with shard_optimizer=True "
                             "each bucket is reduce-scattered by the reducer itself, so no "
                             "comm hook runs; drop shard_optimizer or the hook")
        if self._hook is not None:
            raise RuntimeError(f"a comm hook ({hook_name(self._hook)}) is already registered; "
                               "register_comm_hook can be called only once per reducer")
        if self._allocated or self.stats.iterations > 0:
            raise RuntimeError("register_comm_hook must be called before the first backward "
                               "pass (the buckets are already built for the default hook)")
        traits = _hook_traits(hook, state)
        if traits.wire_dtype is not None and self.config.gradient_as_bucket_view:
            raise ValueError(
                f"{hook_name(hook)} packs gradients straight into a {traits.wire_dtype} wire "
                "buffer, so there is no full-precision bucket for .grad to view: use "
                "gradient_as_bucket_view=False with fused compression hooks")
        self._hook, self._hook_state, self._traits = hook, state, traits
        if traits.chunkable:  # the reducer sends it itself, on the group the state names
            named = getattr(state, "process_group", None) if not isinstance(
                state, dist.ProcessGroup) else state
            self._chunk_group = named if named is not None else self._guard.group

    def close(self) -> None:
        """Detach from the model: remove every hook, finish pending communication."""
        if self._closed:
            return
        self._closed = True
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for ref in self._hook_refs:
            ref.reducer = None  # graphs still holding a hook no longer reach the reducer
        self._hook_refs.clear()
        p, self._pass = self._pass, None
        if p is not None and p.sync and not self._guard.failed:
            for h in p.handles:  # finish what is in flight so no peer is left waiting
                if h is not None and not isinstance(h, torch._C.Future):
                    with contextlib.suppress(Exception):
                        h.wait()

    def __enter__(self) -> "Reducer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ forward hooks
    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():
            return  # evaluation: no collective, so `if rank == 0: evaluate(model)` works
        joining = self._join_config.enable
        if joining:
            self._join_work = Join.notify_join_context(self)
        if (self.config.broadcast_buffers and self._require_forward_param_sync
                and self._buffers and self.world_size > 1):
            # under Join rank 0 may have left: agree on the highest rank still training
            src = self._common_rank(True) if joining else 0
            self._guard.fingerprint("buffers", self._passes, 0, len(self._buffers),
                                    None)
            broadcast_coalesced([b.detach() for _, b in self._buffers], src=src,
                                group=self._guard.group_arg())
        if joining:
            self._allreduce_flag(1.0 if self._sync_enabled else 0.0)  # tell joined ranks

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        sync = self._sync_enabled
        self._require_forward_param_sync = sync
        self._fwd_sync = sync
        outs = output_tensors(output)
        cfg = self.config
        if sync and cfg.find_unused_parameters and not cfg.static_graph:
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

    def _begin_pass(self) -> _Pass:
        sync = self._fwd_sync if self._fwd_sync is not None else self._sync_enabled
        self._fwd_sync = None
        self._passes += 1
        p = self._pass = _Pass(sync, len(self._params),
                               [len(b.indices) for b in self._layout.buckets])
        return p

    def _on_grad_ready(self, index: int, param: torch.Tensor) -> None:
        p = self._pass if self._pass is not None else self._begin_pass()
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
            if p.fired[index] > counts[index]:
                p.errors.append(
                    f"static_graph=True: parameter {self._names[index]!r} received "
                    f"{p.fired[index]} gradient(s) in this backward but {counts[index]} in the "
                    "first iteration: the graph changed, which static_graph does not allow")
                return
            if p.fired[index] < counts[index]:
                return
        elif p.ready[index]:
            if index in self._unused:
                p.errors.append(
                    f"parameter {self._names[index]!r} was found unused after the forward (no "
                    "path from the forward's outputs reaches it) but then received a "
                    "gradient; compute the loss from the model's outputs")
            else:
                p.errors.append(
                    f"parameter {self._names[index]!r} received a second gradient in the same "
                    "backward pass. Causes: the parameter is used in several reentrant "
                    "backward passes (torch.utils.checkpoint with use_reentrant=True: pass "
                    "static_graph=True or use use_reentrant=False), or it is used outside "
                    "the model's forward in another graph")
            return  # recorded; raised on every rank at the end of backward, after the
            # collectives, so no rank is left waiting
        if self._recording_order():
            self._ready_order.append(index)  # gradient-ready order, for the rebuild
        self._mark_ready(p, index)

    def _first_gradient(self, p: _Pass) -> None:
        """The first parameter gradient of a synchronised pass: buffers, unused params."""
        if not self._allocated:
            self._allocate()
        self._guard.mark_progress(self._passes)
        p.scale = 1.0 / self._divisor() if self._traits.prescale else 1.0
        if self._traits.check_overflow:
            self.found_inf.zero_()  # the pack kernels only ever set it
        if self.config.static_graph:
            if self._static_counts is not None:
                for i in self._unused:
                    self._mark_ready(p, i)
        elif self.config.find_unused_parameters:
            for i in self._unused:
                self._mark_ready(p, i)

    def _divisor(self) -> int:
        """The world size, or under ``Join(divide_by_initial_world_size=False)`` the ranks
        still training (the count the join notification allreduce produced)."""
        work, self._join_work = self._join_work, None
        if work is None or self._divide_by_initial_world_size:
            return self.world_size
        self._guard.wait(work, "the Join notification", self._passes)
        return max(1, int(work.result()[0].item()))

    def _mark_ready(self, p: _Pass, index: int) -> None:
        p.ready[index] = 1
        b, k = self._slot[index]
        mem = self._mem[b]
        if mem is not None and mem.eager:
            mem.put(k, self._params[index].grad, p.scale,
                    self.found_inf if self._traits.check_overflow else None)
        p.pending[b] -= 1
        if p.pending[b] == 0:
            p.state[b] = _BucketState.READY
            self._advance(p)
        elif b == p.next_bucket and len(self._chunks[b]) > 1:
            self._send_ready_chunks(p, b)

    def _advance(self, p: _Pass) -> None:
        """Launch every complete bucket whose predecessors are launched, in bucket order,
        then the ready chunks of the first incomplete one."""
        while p.next_bucket < len(p.state) and p.state[p.next_bucket] == _BucketState.READY:
            self._launch(p, p.next_bucket)
            p.next_bucket += 1
        b = p.next_bucket
        if b < len(p.state) and len(self._chunks[b]) > 1:
            self._send_ready_chunks(p, b)

    def _send_ready_chunks(self, p: _Pass, b: int) -> None:
        """Send each chunk of bucket ``b`` whose gradients are all in (never the last one:
        that goes when the bucket completes and is packed)."""
        idx, k = self._bucket_index[b], p.prefix[b]
        while k < len(idx) and p.ready[idx[k]]:
            k += 1
        p.prefix[b] = k
        chunks = self._chunks[b]
        while p.chunk_next[b] < len(chunks) - 1 and chunks[p.chunk_next[b]][0] <= k:
            self._send_chunk(p, b, self._mem[b].active, p.chunk_next[b])
            p.chunk_next[b] += 1

    def _send_chunk(self, p: _Pass, b: int, buf: torch.Tensor, c: int) -> None:
        chunks = self._chunks[b]
        lo = chunks[c - 1][1] if c else 0
        hi = chunks[c][1]
        n_status = 0
        if self._piggyback and b == len(self._chunks) - 1 and c == len(chunks) - 1:
            n_status = self._write_status(p, buf)  # the status travels with the last chunk
        seg = buf.narrow(0, lo, hi + n_status - lo)
        p.bytes += (hi - lo) * seg.element_size()  # gradient bytes; the status is not counted
        self._guard.fingerprint("bucket", self._passes, b, seg.numel(), seg.dtype)
        if p.handles[b] is None:
            p.handles[b] = []
        p.handles[b].append(dist.all_reduce(seg, group=self._chunk_group, async_op=True))

    def _recording_order(self) -> bool:
        cfg = self.config
        if self._rebuilt or cfg.shard_optimizer or (cfg.find_unused_parameters
                                                    and not cfg.static_graph):
            return False
        return not cfg.static_graph or self._static_counts is not None

    # ------------------------------------------------------------------ buffers
    def _allocate(self) -> None:
        """Set up the memory of every bucket of the current layout for the current hook."""
        align = self._align_bytes()
        if align != self._layout.align_bytes:
            encoded = self._layout.to_tensor().clone()
            encoded[2] = align
            self._layout = BucketLayout.from_tensor(encoded, self._params)
        self._mem, self._bucket_params, self._bucket_index = [], [], []
        self._every_target: list[list[bool]] = []
        self._slot = [(0, 0)] * len(self._params)  # parameter -> (bucket, position in it)
        # per bucket: (parameters before the cut, element end) of each chunk it is sent in
        self._chunks = [[(len(b.indices), b.numel)] for b in self._layout.buckets]
        for b, bucket in enumerate(self._layout.buckets):
            for k, i in enumerate(bucket.indices):
                self._slot[i] = (b, k)
        # the end-of-backward status rides at the end of the last bucket's allreduce when the
        # reducer sends that allreduce itself (one collective fewer per iteration)
        buckets = self._layout.buckets
        self._piggyback = (self.world_size > 1 and self._traits.chunkable and bool(buckets)
                           and not buckets[-1].sparse and self._shards is None)
        for b, bucket in enumerate(buckets):
            params = [self._params[i] for i in bucket.indices]
            self._bucket_params.append(params)
            self._bucket_index.append(list(bucket.indices))
            self._every_target.append([True] * len(bucket.indices))  # no used map: all
            if bucket.sparse:
                self._mem.append(None)
                continue
            plan = kernels.BucketPlan(bucket.sizes, bucket.offsets, bucket.numel, bucket.device)
            last = self._piggyback and b == len(buckets) - 1
            mem = BucketMemory(bucket, params, self._wire_dtype(bucket.dtype), plan,
                               always_view=self.config.gradient_as_bucket_view,
                               eager=self._eager_pack(),
                               tail=self._status_len() if last else
                               self._shard_pad(b))
            self._chunks[b] = mem.chunk_bounds(self.config.comm_chunk_mb,
                                               self._traits.chunkable)
            if self.config.gradient_as_bucket_view and any(q.grad is not None for q in params):
                # (rebuild) carry the accumulated gradients over and view the new bucket
                buf = mem.pack([q.grad for q in params], 1.0, None)
                mem.finish(buf, [q.grad is not None for q in params])
            self._mem.append(mem)
        self._allocated = True
        self.stats.buckets = len(self._layout.buckets)
        # the buffers one iteration needs (one per bucket, in its wire dtype); a gradient
        # the user keeps across iterations holds on to an older buffer on top of this
        self.stats.bucket_bytes_allocated = sum(m.capacity_bytes() for m in self._mem
                                                if m is not None)

    def _eager_pack(self) -> bool:
        """CPU: copy each gradient into its bucket when it is ready, as DDP does (the copy
        reads it from cache, and a bucket is ready to send when its last gradient lands).
        GPU: one fused pack launch per complete bucket (see kernels.BucketPlan)."""
        if self._pack_mode is not None:  # "1"/"0": forced (tests and benchmarks)
            return self._pack_mode == "1"
        return self._device.type == "cpu"

    def _align_bytes(self) -> int:
        # Padding only helps the GPU kernels; generic hooks get DDP's unpadded buffers
        if self._traits.builtin and self._device.type == "cuda":
            return _ALIGN_BYTES
        return _DDP_ALIGN_BYTES

    def _wire_dtype(self, bucket_dtype: torch.dtype) -> torch.dtype:
        wire = self._traits.wire_dtype
        if wire is not None and bucket_dtype in (torch.float32, torch.float16, torch.bfloat16):
            return wire
        return bucket_dtype

    # ------------------------------------------------------------------ launching
    def _launch(self, p: _Pass, b: int) -> None:
        """Pack bucket ``b`` (one fused launch) and hand it to the hook / allreduce."""
        bucket = self._layout.buckets[b]
        params = self._bucket_params[b]
        p.state[b] = _BucketState.LAUNCHED
        p.t_launch[b] = time.perf_counter()
        if bucket.sparse:
            self._launch_sparse(p, b, params[0])
            return
        ready = p.ready
        grads = [q.grad if ready[i] else None for q, i in zip(params, self._bucket_index[b])]
        found = self.found_inf if self._traits.check_overflow else None
        buf = self._mem[b].pack(grads, p.scale, found)
        if self._shards is not None:
            self._send_shard(p, b, buf)
            return
        self._send(p, b, buf, params, bucket)

    def _send(self, p: _Pass, b: int, buf: torch.Tensor, params: list, bucket) -> None:
        """Hand a packed bucket to the default allreduce (whole or its remaining chunks) or
        to the comm hook."""
        if self._traits.chunkable:  # an averaging allreduce the reducer sends itself
            while p.chunk_next[b] < len(self._chunks[b]):
                self._send_chunk(p, b, buf, p.chunk_next[b])
                p.chunk_next[b] += 1
            return
        p.bytes += buf.numel() * buf.element_size()
        self._guard.fingerprint("bucket", self._passes, b, buf.numel(), buf.dtype)
        gb = GradBucket(b, buf, params, bucket.offsets, is_last=b == len(p.state) - 1,
                        prescaled=self._traits.prescale, process_group=self._guard.group)
        if self._traits.serialize:
            p.handles[b] = invoke_after(p.handles[b - 1] if b else None, self._hook,
                                        self._hook_state, b, gb)
        else:
            p.handles[b] = invoke(self._hook, self._hook_state, b, gb)

    def _launch_sparse(self, p: _Pass, b: int, param: torch.Tensor) -> None:
        index = self._index_of[id(param)]
        g = param.grad if p.ready[index] else None
        if g is None:
            g = torch.sparse_coo_tensor(torch.empty(1, 0, dtype=torch.long, device=param.device),
                                        torch.empty((0, *param.shape[1:]), dtype=param.dtype,
                                                    device=param.device), param.shape)
        if not g.is_sparse:
            raise RuntimeError(f"parameter {self._names[index]!r} belongs to an embedding with "
                               "sparse=True but its gradient is dense")
        g = g.coalesce()
        self._guard.fingerprint("bucket", self._passes, b, g.values().numel(), g.dtype)
        if self._hook is None or self._traits.builtin:
            g = g * p.scale if p.scale != 1.0 else g * (1.0 / self.world_size)
            p.handles[b] = SparseWork(dist.all_reduce(g, group=self._guard.group,
                                                      async_op=True))
        else:
            gb = GradBucket(b, g, [param], [0], is_last=b == len(p.state) - 1)
            p.handles[b] = invoke(self._hook, self._hook_state, b, gb)

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
            for i in range(len(self._params)):
                if not p.ready[i]:
                    p.ready[i] = 1
                    b, _ = self._layout.locate(i)
                    p.pending[b] -= 1
            for b in range(len(p.state)):
                p.state[b] = _BucketState.READY
        used = None
        if cfg.find_unused_parameters or (cfg.static_graph and self._static_used is None):
            # locally used: the hook fired with a gradient (DDP's local_used_map)
            used = [1.0 if (f > 0 and (self._shards is not None
                                               or self._params[i].grad is not None)) else 0.0
                    for i, f in enumerate(p.fired)]
        missing = [i for i in range(len(self._params)) if not p.ready[i]]
        # launch whatever is left, with zeros for missing gradients, so no peer is left
        # blocked in a collective this rank would never join
        for b in range(p.next_bucket, len(p.state)):
            self._launch(p, b)
        p.next_bucket = len(p.state)

        results, status, self.stats.status_check_s = self._exchange_status(
            p, len(missing) + len(p.errors), used)
        if self._piggyback and len(p.errors) > p.status_errors:
            # misuse seen after the status was sent with the last bucket: this rank only
            self._raise_missing([], [0.0] * self.world_size, p.errors)
        counts = status[: self.world_size].tolist()
        if sum(counts) > 0:
            self._raise_missing(missing, counts, p.errors)
        if self._traits.check_overflow:
            self.found_inf.fill_(1.0 if status[self.world_size].item() > 0 else 0.0)
        global_used = None
        if used is not None:
            global_used = (status[self.world_size + 1:] > 0).tolist()
            if cfg.static_graph:
                self._static_used = global_used  # the static graph's used set, once
        elif cfg.static_graph:
            global_used = self._static_used
        self._unpack_all(results, global_used)
        done = time.perf_counter()
        st = self.stats
        st.iterations += 1
        st.backward_compute_s = t_end - p.t_start
        st.comm_exposed_s = done - t_end
        st.bytes_communicated = p.bytes
        if cfg.debug:
            st.bucket_comm_s = [done - t for t in p.t_launch]
            self._log_buckets(st.bucket_comm_s)
        if self._should_rebuild():
            self._rebuild(self._ready_order)

    def _wait_buckets(self, p: _Pass) -> list:
        results = []
        it = self._passes
        for b, h in enumerate(p.handles):
            bucket = self._layout.buckets[b]
            what = f"bucket {b} ({len(bucket.indices)} tensors, {bucket.numel} elements)"
            if isinstance(h, torch._C.Future):
                try:
                    value = h.wait()
                except Exception as e:
                    self._guard.failed = True
                    raise RuntimeError(f"tribucket (rank {self.rank}): comm hook "
                                       f"{hook_name(self._hook)} failed on {what}: {e}") from e
                results.append(check_result(self._hook, b, bucket, value))
            elif isinstance(h, list):  # sent by the reducer (whole or in chunks)
                for work in h:
                    self._guard.wait(work, f"the allreduce of {what}", it)
                results.append(self._mem[b].body(self._mem[b].active))
            elif isinstance(h, _ShardWork):
                results.append(self._collect_shard(p, b))
            elif isinstance(h, SparseWork):
                self._guard.wait(h.work, f"the allreduce of {what}", it)
                results.append(h.work.result()[0])
            else:
                self._guard.wait(h, f"the allreduce of {what}", it)
                results.append(self._mem[b].active)
            p.state[b] = _BucketState.DONE
        return results

    def _unpack_all(self, results: list, global_used) -> None:
        if self._shards is not None:
            self._finish_shards(results, global_used)
            return
        for b, result in enumerate(results):
            params = self._bucket_params[b]
            targets = (self._every_target[b] if global_used is None
                       else [global_used[i] for i in self._bucket_index[b]])
            if self._layout.buckets[b].sparse:
                if targets[0]:
                    params[0].grad = result
                continue
            self._mem[b].finish(result, targets)

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
