"""The data-parallel reducer: DDP's gradient averaging, with fused buckets, in Python.

State machine of one bucket in one backward pass::

    PENDING ──(last gradient of the bucket ready)──► READY
    READY ──(every earlier bucket launched)──► LAUNCHED   one fused pack + comm hook / allreduce
    LAUNCHED ──(end of backward: future done)──► DONE     one fused unpack into every .grad
    DONE ──(next backward)──► PENDING

Buckets are launched strictly in bucket order on every rank, so every rank issues the same
collectives in the same order. The end of backward is an autograd-engine callback, queued
from a pre-hook on the forward output's ``grad_fn`` (so it belongs to the outermost backward
even under reentrant checkpointing) or, failing that, from the first gradient hook.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from . import kernels
from ._env import describe_backend
from ._graph import output_tensors, reachable_parameters
from ._tags import is_expert_parallel
from .comm import broadcast_coalesced
from .config import ReducerConfig
from .grad_bucket import GradBucket
from .hooks import _hook_traits
from .layout import NO_CAP, BucketLayout, compute_layout
from ._memory import BucketMemory

__all__ = ["Reducer", "ReducerStats", "fused_bucketing"]

logger = logging.getLogger("tribucket")

# Alignment of each gradient inside a bucket for tribucket's own paths (16 bytes lets the
# GPU kernels use 128-bit accesses). Generic comm hooks get DDP's unpadded buffers instead.
_ALIGN_BYTES = 16
_DDP_ALIGN_BYTES = 1


class _BucketState(enum.IntEnum):
    PENDING = 0   # waiting for gradients
    READY = 1     # every gradient is in; waits for earlier buckets to be launched
    LAUNCHED = 2  # packed and handed to the hook / allreduce; result in flight
    DONE = 3      # result unpacked into the gradients


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
    #: bytes of bucket buffers the reducer holds
    bucket_bytes_allocated: int = 0
    #: per-bucket seconds from launch to result, last backward (``debug`` only)
    bucket_comm_s: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class _Pass:
    """One backward pass of the model, from its first gradient to the engine callback."""

    __slots__ = ("sync", "ready", "fired", "pending", "state", "next_bucket", "handles",
                 "t_start", "callback_queued", "any_ready", "t_launch", "bytes", "errors")

    def __init__(self, sync: bool, n_params: int, pending: list[int]):
        self.sync = sync                       # False: no_sync, gradients stay local
        self.ready = bytearray(n_params)       # parameter i's gradient is in its bucket slot
        self.fired = [0] * n_params            # gradient hooks seen per parameter
        self.pending = list(pending)           # per bucket: parameters not yet ready
        self.state = [_BucketState.PENDING] * len(pending)  # per bucket state (see module doc)
        self.next_bucket = 0                   # every bucket before this one is launched
        self.handles: list[Any] = [None] * len(pending)  # per bucket: Work or Future
        self.t_start = time.perf_counter()     # backward start (output grad_fn or first hook)
        self.callback_queued = False           # the end-of-backward callback is queued
        self.any_ready = False                 # some parameter hook fired in this pass
        self.t_launch = [0.0] * len(pending)   # per bucket launch time (debug stats)
        self.bytes = 0                         # bytes handed to collectives
        self.errors: list[str] = []            # misuse found during backward, raised at the end


class Reducer:
    """Average gradients across ranks with DDP's semantics; see :func:`fused_bucketing`.

    Usable directly: ``reducer = Reducer(model)`` attaches, ``reducer.close()`` detaches
    (or use it as a context manager).
    """

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None, *,
                 config: ReducerConfig | None = None, **options: Any):
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
        self._src = dist.get_global_rank(self.process_group, 0) \
            if process_group is not None else 0
        logger.info("tribucket reducer on rank %d/%d: %s", self.rank, self.world_size,
                    describe_backend())

        self._collect_parameters()
        self._verify_model()
        self._sync_module_states()

        # communication hook (register_comm_hook may replace it before the first backward)
        self._hook: Callable | None = None
        self._hook_state: Any = None
        self._traits = _hook_traits(None, None)
        # layout and the buffers behind it (allocated at the first backward)
        self._layout = self._initial_layout()
        self._mem: list[BucketMemory | None] = []  # per bucket (None: sparse)
        self._bucket_params: list[list[torch.Tensor]] = []
        self._allocated = False
        # iteration state
        self._pass: _Pass | None = None
        self._sync_enabled = True              # False inside no_sync()
        self._fwd_sync: bool | None = None     # decision of the last grad-enabled forward
        self._require_forward_param_sync = True  # broadcast buffers before the next forward
        self._unused: list[int] = []           # parameters the last forward did not reach
        self._static_counts: list[int] | None = None  # static_graph: hooks per parameter
        self._static_used: torch.Tensor | None = None  # static_graph: global used map
        self._ready_order: list[int] = []      # first synced pass: gradient-ready order
        self._rebuilt = False
        self.found_inf = torch.zeros(1, dtype=torch.float32, device=self._device)
        self.stats = ReducerStats(buckets=len(self._layout.buckets))
        self._handles: list = []
        self._hook_refs: list[_HookRef] = []
        self._closed = False
        self._backward_start_ref = self._hook_ref("_on_backward_start")
        self._attach()

    # ------------------------------------------------------------------ set-up
    def _collect_parameters(self) -> None:
        ignore_ids, ignore_names = set(), set()
        for k, item in enumerate(self.config.ignore_parameters):
            if isinstance(item, str):
                ignore_names.add(item)
            elif isinstance(item, torch.Tensor):
                ignore_ids.add(id(item))
            else:
                raise TypeError(f"ignore_parameters[{k}] must be a parameter or its name, got "
                                f"{type(item).__name__}")
        named = list(self.module.named_parameters())
        known_names = {n for n, _ in named} | {n for n, _ in self.module.named_buffers()}
        unknown = sorted(ignore_names - known_names)
        if unknown:
            raise ValueError(f"ignore_parameters names {unknown} are not parameters or buffers of "
                             f"the model; known names look like {sorted(known_names)[:5]}")
        missing = ignore_ids - {id(p) for _, p in named}
        if missing:
            raise ValueError(f"{len(missing)} tensor(s) in ignore_parameters are not parameters "
                             "of the model (pass the model's own parameter objects or names)")

        def ignored(name: str, p: torch.Tensor) -> bool:
            return id(p) in ignore_ids or name in ignore_names or is_expert_parallel(p)

        #: parameters verified and broadcast on entering (frozen ones too, as DDP)
        self._state_params = [(n, p) for n, p in named if not ignored(n, p)]
        #: buffers verified and broadcast
        self._buffers = [(n, b) for n, b in self.module.named_buffers() if n not in ignore_names]
        #: parameters whose gradients this reducer averages, in model order (DDP's order)
        grad_params = [(n, p) for n, p in self._state_params if p.requires_grad]
        self._names = [n for n, _ in grad_params]
        self._params = [p for _, p in grad_params]
        self._index_of = {id(p): i for i, p in enumerate(self._params)}
        devices = {p.device for p in self._params}
        if len(devices) > 1:
            first = self._params[0].device
            other = next(i for i, p in enumerate(self._params) if p.device != first)
            raise ValueError(f"fused_bucketing expects the parameters on one device: "
                             f"{self._names[0]!r} is on {first} but {self._names[other]!r} is on "
                             f"{self._params[other].device}; move the model with model.to(device)")
        self._device = self._params[0].device if self._params else torch.device("cpu")
        sparse_ids = set()
        for m in self.module.modules():
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse:
                sparse_ids.add(id(m.weight))
        self._expect_sparse = [id(p) in sparse_ids for p in self._params]

    def _verify_model(self) -> None:
        """Every rank must hold the same parameters: compare metadata against rank 0's."""
        if self.world_size == 1:
            return
        meta = [("parameter", n, tuple(p.shape), tuple(p.stride()), str(p.dtype),
                 p.requires_grad) for n, p in self._state_params]
        meta += [("buffer", n, tuple(b.shape), tuple(b.stride()), str(b.dtype), False)
                 for n, b in self._buffers]
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, meta, group=self.process_group)
        ref = everyone[0]
        for r in range(1, self.world_size):
            other = everyone[r]
            for k in range(max(len(ref), len(other))):
                a = ref[k] if k < len(ref) else None
                b = other[k] if k < len(other) else None
                if a == b:
                    continue
                if a is None or b is None:
                    have = a if b is None else b
                    raise RuntimeError(
                        f"tribucket: the model differs across ranks: rank 0 has {len(ref)} "
                        f"parameters/buffers, rank {r} has {len(other)}; the first extra one is "
                        f"{have[0]} {have[1]!r} with shape {list(have[2])}. Build the same model "
                        "on every rank before entering fused_bucketing.")
                fields = ["kind", "name", "shape", "stride", "dtype", "requires_grad"]
                diff = [f"{f}: {x!r} on rank 0 vs {y!r} on rank {r}"
                        for f, x, y in zip(fields, a, b) if x != y]
                raise RuntimeError(
                    f"tribucket: the model differs across ranks at {a[0]} {a[1]!r} "
                    f"(shape {list(a[2])} on rank 0, {list(b[2])} on rank {r}): "
                    f"{'; '.join(diff)}. Build the same model on every rank before entering "
                    "fused_bucketing.")

    def _sync_module_states(self) -> None:
        tensors = [p.detach() for _, p in self._state_params]
        if self.config.broadcast_buffers:
            tensors += [b.detach() for _, b in self._buffers]
        broadcast_coalesced(tensors, src=0, group=self._group_arg())

    def _group_arg(self):
        return None if self.process_group is dist.group.WORLD else self.process_group

    def _initial_layout(self) -> BucketLayout:
        cfg = self.config
        if cfg.find_unused_parameters and not cfg.static_graph:
            # DDP keeps its size-capped initial buckets when it will never rebuild
            caps = dict(bucket_cap_bytes=cfg.bucket_cap_bytes,
                        first_bucket_cap_bytes=min(cfg.first_bucket_cap_bytes,
                                                   cfg.bucket_cap_bytes))
        else:
            # DDP 2.x: one bucket per (dtype, device) until the rebuild, because the
            # reverse-parameter-order guess is often wrong
            caps = dict(bucket_cap_bytes=NO_CAP, first_bucket_cap_bytes=NO_CAP)
        return compute_layout(self._params, expect_sparse=self._expect_sparse,
                              align_bytes=_DDP_ALIGN_BYTES, **caps)

    def _attach(self) -> None:
        seen = set()
        for i, p in enumerate(self._params):
            if id(p) in seen:  # tied parameters appear once already; defensive
                continue
            seen.add(id(p))
            self._handles.append(
                p.register_post_accumulate_grad_hook(self._hook_ref("_on_grad_ready", i)))
        self._handles.append(self.module.register_forward_pre_hook(
            self._hook_ref("_pre_forward")))
        self._handles.append(self.module.register_forward_hook(self._hook_ref("_post_forward")))

    def _hook_ref(self, method: str, *args: Any) -> "_HookRef":
        ref = _HookRef(self, method, args)
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
        if self._hook is not None:
            raise RuntimeError(f"a comm hook ({_hook_name(self._hook)}) is already registered; "
                               "register_comm_hook can be called only once per reducer")
        if self._allocated or self.stats.iterations > 0:
            raise RuntimeError("register_comm_hook must be called before the first backward "
                               "pass (the buckets are already built for the default hook)")
        traits = _hook_traits(hook, state)
        if traits.wire_dtype is not None and self.config.gradient_as_bucket_view:
            raise ValueError(
                f"{_hook_name(hook)} packs gradients straight into a {traits.wire_dtype} wire "
                "buffer, so there is no full-precision bucket for .grad to view: use "
                "gradient_as_bucket_view=False with fused compression hooks")
        self._hook, self._hook_state, self._traits = hook, state, traits

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
        if p is not None and p.sync:
            for h in p.handles:  # finish what is in flight so no peer is left waiting
                if h is not None:
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
        if (self.config.broadcast_buffers and self._require_forward_param_sync
                and self._buffers and self.world_size > 1):
            broadcast_coalesced([b.detach() for _, b in self._buffers], src=0,
                                group=self._group_arg())

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
        p = self._pass
        if p is None:
            p = self._begin_pass()
        if not p.callback_queued:
            p.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
        return None

    def _begin_pass(self) -> _Pass:
        sync = self._fwd_sync if self._fwd_sync is not None else self._sync_enabled
        self._fwd_sync = None
        p = self._pass = _Pass(sync, len(self._params),
                               [len(b.indices) for b in self._layout.buckets])
        return p

    def _on_grad_ready(self, index: int, param: torch.Tensor) -> None:
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
        if self._traits.check_overflow:
            self.found_inf.zero_()  # the pack kernels only ever set it
        if self.config.static_graph:
            if self._static_counts is not None:
                for i in self._unused:
                    self._mark_ready(p, i)
        elif self.config.find_unused_parameters:
            for i in self._unused:
                self._mark_ready(p, i)

    def _mark_ready(self, p: _Pass, index: int) -> None:
        p.ready[index] = 1
        b, _ = self._layout.locate(index)
        p.pending[b] -= 1
        if p.pending[b] == 0:
            p.state[b] = _BucketState.READY
            while p.next_bucket < len(p.state) and p.state[p.next_bucket] == _BucketState.READY:
                self._launch(p, p.next_bucket)
                p.next_bucket += 1

    def _recording_order(self) -> bool:
        cfg = self.config
        if self._rebuilt or (cfg.find_unused_parameters and not cfg.static_graph):
            return False
        return not cfg.static_graph or self._static_counts is not None

    # ------------------------------------------------------------------ buffers
    def _allocate(self) -> None:
        """Set up the memory of every bucket of the current layout for the current hook."""
        align = self._align_bytes()
        if align != self._layout.align_bytes:
            self._layout = BucketLayout.from_tensor(
                _realigned(self._layout.to_tensor(), align), self._params)
        self._mem, self._bucket_params = [], []
        for bucket in self._layout.buckets:
            params = [self._params[i] for i in bucket.indices]
            self._bucket_params.append(params)
            if bucket.sparse:
                self._mem.append(None)
                continue
            plan = kernels.BucketPlan(bucket.sizes, bucket.offsets, bucket.numel, bucket.device)
            mem = BucketMemory(bucket, params, self._wire_dtype(bucket.dtype), plan,
                               always_view=self.config.gradient_as_bucket_view)
            if self.config.gradient_as_bucket_view and any(q.grad is not None for q in params):
                # (rebuild) carry the accumulated gradients over and view the new bucket
                buf = mem.pack([q.grad for q in params], 1.0, None)
                mem.finish(buf, [q.grad is not None for q in params])
            self._mem.append(mem)
        self._allocated = True
        self.stats.buckets = len(self._layout.buckets)
        self._update_memory_stats()

    def _update_memory_stats(self) -> None:
        # the buffers one iteration needs (one per bucket, in its wire dtype); a gradient the
        # user keeps across iterations holds on to an older buffer on top of this
        self.stats.bucket_bytes_allocated = sum(m.capacity_bytes() for m in self._mem
                                                if m is not None)

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
        traits = self._traits
        if bucket.sparse:
            self._launch_sparse(p, b, params[0])
            return
        prescale = traits.prescale
        scale = 1.0 / self.world_size if prescale else 1.0
        grads = [q.grad if p.ready[self._index_of[id(q)]] else None for q in params]
        found = self.found_inf if traits.check_overflow else None
        buf = self._mem[b].pack(grads, scale, found)
        p.bytes += buf.numel() * buf.element_size()
        if self._hook is None:
            p.handles[b] = dist.all_reduce(buf, group=self.process_group, async_op=True)
            return
        gb = GradBucket(b, buf, params, bucket.offsets, is_last=b == len(p.state) - 1,
                        prescaled=prescale)
        if traits.serialize:
            p.handles[b] = self._invoke_serialized(p, b, gb)
        else:
            p.handles[b] = self._invoke_hook(b, gb)

    def _invoke_hook(self, b: int, gb: GradBucket) -> torch.futures.Future:
        try:
            fut = self._hook(self._hook_state, gb)
        except Exception as e:
            raise RuntimeError(f"comm hook {_hook_name(self._hook)} raised on bucket {b}: "
                               f"{type(e).__name__}: {e}") from e
        if not isinstance(fut, torch._C.Future):
            raise RuntimeError(f"comm hook {_hook_name(self._hook)} returned "
                               f"{type(fut).__name__} for bucket {b}; a hook must return a "
                               "torch.futures.Future whose value is the bucket's new tensor")
        return fut

    def _invoke_serialized(self, p: _Pass, b: int, gb: GradBucket) -> torch.futures.Future:
        """Call the hook only once the previous bucket's hook future has completed.

        A hook whose callbacks launch collectives (PowerSGD) would otherwise interleave them
        with the next bucket's collectives in a different order on different ranks. The
        call happens on the thread that completes the previous future (gloo's / NCCL's
        worker), so backward is not stalled.
        """
        chain: torch.futures.Future = torch.futures.Future()
        hook, state, name = self._hook, self._hook_state, _hook_name(self._hook)

        def finish(fut: torch.futures.Future) -> None:
            try:
                chain.set_result(fut.value())
            except Exception as e:  # noqa: BLE001 - handed to the waiting main thread
                chain.set_exception(e)

        def invoke(_prev: Any = None) -> None:
            try:
                fut = hook(state, gb)
                if not isinstance(fut, torch._C.Future):
                    raise TypeError(f"returned {type(fut).__name__}, not a torch.futures.Future")
                fut.add_done_callback(finish)
            except Exception as e:  # noqa: BLE001
                chain.set_exception(RuntimeError(f"comm hook {name} raised on bucket {b}: "
                                                 f"{type(e).__name__}: {e}"))

        prev = p.handles[b - 1] if b > 0 else None
        if prev is None or prev.done():
            invoke()
        else:
            prev.add_done_callback(invoke)
        return chain

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
        if self._hook is None or self._traits.builtin:
            g = g * (1.0 / self.world_size)
            p.handles[b] = _SparseWork(dist.all_reduce(g, group=self.process_group,
                                                       async_op=True))
        else:
            gb = GradBucket(b, g, [param], [0], is_last=b == len(p.state) - 1)
            p.handles[b] = self._invoke_hook(b, gb)

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
            used = bytearray(1 if (f > 0 and self._params[i].grad is not None) else 0
                             for i, f in enumerate(p.fired))
        missing = [i for i in range(len(self._params)) if not p.ready[i]]
        # launch whatever is left, with zeros for missing gradients, so no peer is left
        # blocked in a collective this rank would never join
        for b in range(p.next_bucket, len(p.state)):
            self._launch(p, b)
        p.next_bucket = len(p.state)

        status = torch.zeros(self.world_size + 1 + (len(used) if used is not None else 0),
                             dtype=torch.float32, device=self._device)
        status[self.rank] = len(missing) + len(p.errors)
        status_work = None
        if not self._traits.serialize and self.world_size > 1:
            status_work = self._launch_status(status, used)
        results = self._wait_buckets(p)
        if self._traits.serialize and self.world_size > 1:
            status_work = self._launch_status(status, used)
        t_status = time.perf_counter()
        if status_work is not None:
            status_work.wait()
        elif self.world_size == 1:
            self._fill_status_locally(status, used)
        self.stats.status_check_s = time.perf_counter() - t_status
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
        self._unpack_all(p, results, global_used)
        done = time.perf_counter()
        st = self.stats
        st.iterations += 1
        st.backward_compute_s = t_end - p.t_start
        st.comm_exposed_s = done - t_end
        st.bytes_communicated = p.bytes
        if cfg.debug:
            st.bucket_comm_s = [done - t for t in p.t_launch]
        if self._should_rebuild():
            self._rebuild()

    def _launch_status(self, status: torch.Tensor, used) -> Any:
        if self._traits.check_overflow:
            status[self.world_size] = self.found_inf.to(status.device)[0]
        if used is not None:
            status[self.world_size + 1:] = torch.tensor(list(used), dtype=status.dtype)
        return dist.all_reduce(status, group=self.process_group, async_op=True)

    def _fill_status_locally(self, status: torch.Tensor, used) -> None:
        if self._traits.check_overflow:
            status[self.world_size] = self.found_inf[0]
        if used is not None:
            status[self.world_size + 1:] = torch.tensor(list(used), dtype=status.dtype)

    def _wait_buckets(self, p: _Pass) -> list:
        results = []
        for b, h in enumerate(p.handles):
            bucket = self._layout.buckets[b]
            if isinstance(h, torch._C.Future):
                try:
                    value = h.wait()
                except Exception as e:
                    raise RuntimeError(f"comm hook {_hook_name(self._hook)} failed on bucket "
                                       f"{b} ({len(bucket.indices)} tensors): {e}") from e
                results.append(self._check_result(b, value))
            elif isinstance(h, _SparseWork):
                h.work.wait()
                results.append(h.work.result()[0])
            else:
                h.wait()
                results.append(self._mem[b].active)
            p.state[b] = _BucketState.DONE
        return results

    def _check_result(self, b: int, value: Any) -> torch.Tensor:
        if isinstance(value, (list, tuple)) and len(value) == 1:
            value = value[0]
        bucket = self._layout.buckets[b]
        name = _hook_name(self._hook)
        expected = bucket.numel if not bucket.sparse else None
        if not isinstance(value, torch.Tensor):
            raise RuntimeError(f"comm hook {name} completed bucket {b} with "
                               f"{type(value).__name__}; expected a tensor of {expected} "
                               f"elements")
        if bucket.sparse:
            return value
        if value.numel() != expected:
            raise RuntimeError(f"comm hook {name} completed bucket {b} with a tensor of "
                               f"{value.numel()} elements (shape {list(value.shape)}); the "
                               f"bucket holds {expected} elements of {bucket.dtype}")
        if not value.is_floating_point():
            raise RuntimeError(f"comm hook {name} completed bucket {b} with a {value.dtype} "
                               f"tensor; expected a floating-point tensor (the bucket is "
                               f"{bucket.dtype})")
        return value.reshape(-1)

    def _unpack_all(self, p: _Pass, results: list, global_used) -> None:
        for b, result in enumerate(results):
            bucket = self._layout.buckets[b]
            params = self._bucket_params[b]
            if bucket.sparse:
                q = params[0]
                if global_used is None or global_used[self._index_of[id(q)]]:
                    q.grad = result
                continue
            targets = [global_used is None or global_used[self._index_of[id(q)]]
                       for q in params]
            self._mem[b].finish(result, targets)

    def _raise_missing(self, missing: list[int], counts: list[float], errors: list[str]) -> None:
        ranks = [f"rank {r}: {int(c)}" for r, c in enumerate(counts) if c > 0]
        if errors:
            raise RuntimeError(f"tribucket (rank {self.rank}): {errors[0]}"
                               + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""))
        if not missing:
            raise RuntimeError(
                f"tribucket: another rank reported a problem in this backward pass "
                f"({', '.join(ranks)}); see its error. This rank's gradients were not averaged.")
        names = [self._names[i] for i in missing]
        mine = (f" This rank ({self.rank}) got no gradient for: {', '.join(names[:20])}"
                f"{' ...' if len(names) > 20 else ''}." if names else "")
        raise RuntimeError(
            "tribucket: some parameters received no gradient in this backward pass "
            f"({', '.join(ranks)} parameters missing).{mine} Every rank still completed its "
            "collectives, so none is left waiting. If parts of the model are legitimately "
            "unused, pass find_unused_parameters=True to fused_bucketing (or "
            "static_graph=True if the unused set never changes); otherwise make sure every "
            "parameter contributes to the loss.")

    # ------------------------------------------------------------------ rebuild
    def _should_rebuild(self) -> bool:
        cfg = self.config
        if self._rebuilt or (cfg.find_unused_parameters and not cfg.static_graph):
            return False
        return bool(self._ready_order)

    def _rebuild(self) -> None:
        order = list(self._ready_order)
        if self.config.static_graph:
            order += [i for i in self._unused if i not in set(order)]
        self._ready_order = []
        if sorted(order) != list(range(len(self._params))):
            return  # incomplete order (should not happen): keep the current layout
        t = torch.tensor(order, dtype=torch.int64, device=self._device)
        if self.world_size > 1:
            dist.broadcast(t, self._src, group=self._group_arg())  # rank 0's order for all
        cfg = self.config
        self._layout = compute_layout(
            self._params, bucket_cap_bytes=cfg.bucket_cap_bytes,
            first_bucket_cap_bytes=cfg.first_bucket_cap_bytes,
            expect_sparse=self._expect_sparse, order=t.tolist(),
            align_bytes=self._layout.align_bytes)
        self._rebuilt = True
        self.stats.rebuilds += 1
        self._allocate()


class _HookRef:
    """A hook the reducer installs on the model, its parameters or autograd nodes.

    It holds the reducer only while attached (``close()`` cuts it), and copying or
    pickling the model (``copy.deepcopy(model)`` for an EMA copy, ``torch.save(model)``)
    gives the copy an inert hook instead of a copy of the reducer.
    """

    __slots__ = ("reducer", "method", "args")

    def __init__(self, reducer: "Reducer | None", method: str, args: tuple = ()):
        self.reducer, self.method, self.args = reducer, method, args

    def __call__(self, *a: Any) -> Any:
        r = self.reducer
        if r is None:
            return None
        return getattr(r, self.method)(*self.args, *a)

    def __deepcopy__(self, memo: dict) -> "_HookRef":
        return _HookRef(None, self.method)

    def __reduce__(self):
        return (_HookRef, (None, self.method))


class _SparseWork:
    """The allreduce of a sparse gradient: its result is a new tensor, not the input."""

    __slots__ = ("work",)

    def __init__(self, work):
        self.work = work

    def wait(self):
        return self.work.wait()


def _realigned(encoded: torch.Tensor, align: int) -> torch.Tensor:
    out = encoded.clone()
    out[2] = align
    return out


def _hook_name(hook: Callable | None) -> str:
    if hook is None:
        return "allreduce (default)"
    return getattr(hook, "__qualname__", None) or getattr(hook, "__name__", None) or repr(hook)


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
    for the options (they mean what DDP's do).
    """
    return Reducer(model, process_group, bucket_cap_mb=bucket_cap_mb,
                   first_bucket_cap_mb=first_bucket_cap_mb,
                   gradient_as_bucket_view=gradient_as_bucket_view,
                   find_unused_parameters=find_unused_parameters, static_graph=static_graph,
                   broadcast_buffers=broadcast_buffers, ignore_parameters=ignore_parameters,
                   **options)
