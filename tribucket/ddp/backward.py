"""The backward pass of the data-parallel reducer: what spans buckets.

The path of one gradient: a post hook on its accumulator marks it ready and counts it
down in its bucket, nothing more in the common case (in C++, ``native.py``; else in Python,
``bucket.GradHook``, which also takes every other case); when a bucket's count reaches
zero and every earlier bucket is launched, the bucket (``bucket.py``) is packed in one call
(``memory.py`` into ``tribucket.kernels``) and communicated; at the end of backward each
bucket waits for its result and lends it back as ``.grad`` views of the averaged buffer.

Buckets are launched strictly in bucket order on every rank, so every rank issues the same
collectives in the same order. The end of backward is an autograd-engine callback, queued
from a pre-hook on the forward output's ``grad_fn`` (so it belongs to the outermost backward
even under reentrant checkpointing) or, failing that, from the first gradient hook. There
the status (``status.py``) tells every rank whether any rank missed gradients, so an error
is raised on every rank instead of leaving one waiting. As each bucket is finished, the
epilogue (``tribucket/_epilogue.py``) records it: its norm and inf/NaN flag, computed by the
unpack kernel or on first use (``reducer.found_inf``, ``grad_norm()``, clipping, GradScaler).
"""

from __future__ import annotations

import time
import warnings

import torch
import torch.distributed as dist

from .._epilogue import Epilogue
from .._shard import shard_buckets
from ..config import ReducerConfig
from ..layout import BucketLayout
from . import resume
from .allocate import align_bytes, build_buckets
from .autotune import tuner_for
from .bucket import BucketState, Comm, GradHook
from .compat import CommTimings
from .join import JoinFlags
from .native import NO_NATIVE
from .rebuild import LayoutPolicy
from .shard import ShardGrads
from .state import Pass, ReducerStats, log_buckets
from .settle import Settle
from .status import (EntryTypes, Status, replaced_error, second_gradient_error,
                     static_graph_error)
from .watchdog import CommGuard

__all__ = ["Backward"]

class Backward(Settle):
    """The cross-bucket order and the end of backward of one reducer.

    Its inputs are passed in; the fields below are read and written by the
    :class:`~tribucket.ddp.reducer.Reducer` that owns it (forward hooks, ``no_sync``,
    ``state_dict``) and by nothing else.
    """

    def __init__(self, config: ReducerConfig, params: list[torch.Tensor], names: list[str],
                 expect_sparse: list[bool], guard: CommGuard, comm: Comm,
                 join_flags: JoinFlags, device: torch.device):
        self.config, self.params, self.names = config, params, names
        self.guard, self.comm, self.join_flags, self.device = guard, comm, join_flags, device
        self.world_size, self.rank = guard.world_size, guard.rank
        self.policy = LayoutPolicy(config, params, expect_sparse)
        self.tuner = tuner_for(config, self.policy)  # bucket_cap_mb="auto" (autotune.py)
        self.status = Status(guard, self.rank, self.world_size, len(params), device,
                             config.needs_used_map)
        self.status.static_graph = config.static_graph
        self.layout: BucketLayout = self.policy.initial()
        self.buckets: list = []                # built at the first backward (allocate)
        self.slot: list = []                   # parameter -> (its bucket, position in it)
        self.allocated = False                 # buckets match layout and hook
        self.piggyback = False                 # the status rides on the last bucket
        self.epilogue: Epilogue | None = None  # per-bucket norm and inf/NaN flag (allocate)
        self.stats = ReducerStats(buckets=len(self.layout.buckets))
        self.timings = CommTimings()           # every averaged backward (logging_data)
        self.pass_: Pass | None = None         # the backward pass in progress
        self.sync_enabled = True               # False inside no_sync()
        self.fwd_sync: bool | None = None      # decision of the last grad-enabled forward
        self.unused: list[int] = []            # parameters the last forward did not reach
        self.skip_pending = None               # skip_all_reduce_unused_params: the forward's
        # agreement on the buckets to skip, until the backward takes it
        self.static_counts: list[int] | None = None  # static_graph: hooks per parameter
        self.static_used: list | None = None   # static_graph: global used map
        self.ready_order: list[int] = []       # first synced pass: gradient-ready order
        # find_unused_parameters: parameters that got a gradient in a no_sync pass since the
        # last synchronised one; they count as used by this rank at the next (DDP's
        # local_used_map is kept across no_sync iterations the same way)
        self.nosync_used = bytearray(len(params)) if config.dynamic_unused else None
        self.rebuilt = False
        self.forwards = 0                      # training forwards with grad (the step)
        self.opt_steps = 0                     # optimizer steps over these parameters
        self.opt_base = 0                      # ... counted from here (reset with forwards)
        self.param_ids = frozenset(map(id, params))
        self.entry = EntryTypes(params, names)  # dtype and device of each, on entering
        self.agree_pending = self.world_size > 1  # compare hook and state at 1st backward
        self.passes = 0                        # backward passes begun (synced or not): the
        # iteration number that fingerprints and failure reports use, equal on every rank
        self.synced = 0                        # synchronised passes begun: the trace's step
        self.join_work = None                  # Join: the notify allreduce (ranks active)
        self.join_active = None                # Join: ranks still training, as counted by
        # the forward's sync-flag allreduce (for a reducer that is not the first joinable)
        self.closed = False
        self.warned_create_graph = False       # backward(create_graph=True) seen
        # the per-gradient hook's short path applies: no hook counts, no order recorded
        self._plain = not (config.static_graph or config.find_unused_parameters)
        #: the post-accumulate-grad hook of each parameter (the reducer registers them)
        self.grad_hooks = [GradHook(self, i) for i in range(len(params))]
        self.native = NO_NATIVE  # native.NativeHooks when C++ hooks count gradients in
        # deferred_status: a pass's status is read on the host at the end of the next
        # synchronised pass (every rank at the same one), not at its own end
        self.defer_status = (config.deferred_status if config.deferred_status is not None
                             else device.type == "cuda")
        self.pending_status = None             # status.Pending of the last deferred pass
        self.joining = False                   # the last training forward ran under join()
        #: shard_optimizer: this rank's slice of every bucket, and the averaged slices
        self.shards, self.shard_grads = None, None
        if config.shard_optimizer:
            self._init_shards(expect_sparse)

    def _init_shards(self, expect_sparse: list[bool]) -> None:
        lone = [i for i, s in enumerate(expect_sparse) if s]
        complex_ = [self.names[i] for i in lone if self.params[i].is_complex()]
        if complex_:
            raise ValueError(f"shard_optimizer=True does not shard complex parameters "
                             f"({complex_}); store them as real tensors of shape (..., 2) "
                             "(torch.view_as_complex in forward), or pass them in "
                             "ignore_parameters and average them yourself")
        sparse = [self.names[i] for i in lone]
        if sparse:
            raise ValueError(f"shard_optimizer=True does not support sparse gradients "
                             f"(parameters {sparse} come from Embedding(sparse=True)); use "
                             "dense embeddings or ignore_parameters for them")
        self._align_layout()  # (GPU: 16 bytes) fixed now: the shards follow it
        self.shards = shard_buckets(self.layout, self.world_size, self.rank)
        self.shard_grads = ShardGrads(len(self.shards), len(self.params))

    # ------------------------------------------------------------------ per gradient
    def on_backward_start(self, grad_outputs):
        if self.closed:
            return None
        p = self.pass_ if self.pass_ is not None else self._begin_pass()
        if not p.callback_queued:
            p.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finalize)
        return None

    def _begin_pass(self) -> Pass:
        sync = self.fwd_sync if self.fwd_sync is not None else self.sync_enabled
        self.fwd_sync = None
        self.passes += 1
        p = self.pass_ = Pass(sync, len(self.params), self.passes)
        p.step = self.guard.step = self.forwards
        p.opt_step = self.opt_steps - self.opt_base
        if self.tuner is not None:  # bucket_cap_mb="auto" on a GPU: an event marks the start
            self.tuner.backward_begins()
        return p

    def on_grad_ready(self, index: int) -> None:
        """A gradient outside :class:`GradHook`'s common case: the first of a pass,
        ``no_sync``, hook counts (``static_graph``), the used map, the rebuild order, misuse,
        ``backward(create_graph=True)``."""
        if torch.is_grad_enabled():
            # backward(create_graph=True): the gradients carry a graph; the reducer's copies
            # of them must not (autograd refuses out= arguments), and as in DDP only the
            # first-order gradients are averaged. Every gradient of such a pass comes here.
            p = self.pass_ if self.pass_ is not None else self._begin_pass()
            if not p.create_graph:
                p.create_graph = True
                self._warn_create_graph()
            with torch.no_grad():
                return self._on_grad_ready(index)
        return self._on_grad_ready(index)

    def _warn_create_graph(self) -> None:
        if not self.warned_create_graph:
            self.warned_create_graph = True
            warnings.warn("tribucket: backward(create_graph=True): the gradients are averaged "
                          "across ranks as usual, but their graph is not: higher-order "
                          "gradients computed from .grad are this rank's own (torch DDP "
                          "does the same)", UserWarning, stacklevel=4)

    def _on_grad_ready(self, index: int) -> None:
        p = self.pass_
        if p is None:
            p = self._begin_pass()
        if not p.callback_queued:
            p.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finalize)
        if not p.sync:
            if self.nosync_used is not None:
                self.nosync_used[index] = 1
            return
        p.fired[index] += 1
        if not p.any_ready:
            p.any_ready = True
            self._first_gradient(p)
        if self.config.static_graph:
            counts = self.static_counts
            if counts is None:
                return  # first iteration of a static graph: everything launches at the end
            if p.fired[index] != counts[index]:
                if p.fired[index] > counts[index]:
                    p.errors.append(static_graph_error(self.names[index], p.fired[index],
                                                       counts[index]))
                return
        elif p.ready[index]:
            p.errors.append(second_gradient_error(self.names[index], index in self.unused))
            return  # recorded; raised on every rank at the end of backward, after the
            # collectives, so no rank is left waiting
        if p.record_order:
            self.ready_order.append(index)  # gradient-ready order, for the rebuild
        self._mark_ready(p, index)

    def _first_gradient(self, p: Pass) -> None:
        """The first parameter gradient of a synchronised pass: buckets, unused params."""
        if self.agree_pending:
            self.agree_on_state()  # before the first bucket: one all-gather, then never
        if not self.allocated:
            self.allocate()
        stamp = 0 if self.comm.tracer is not None else None  # (first gradients' times)
        for bucket in self.buckets:
            bucket.reset()
            bucket.t_first = stamp
        self.guard.mark_progress(p.iteration)
        self.synced += 1
        if self.comm.tracer is not None:
            self.comm.tracer.next_step(self.synced)
        work, self.join_work = self.join_work, None
        active, self.join_active = self.join_active, None
        if not self.comm.traits.prescale:
            p.scale = 1.0
        elif self.comm.divisor is not None:
            p.scale = 1.0 / self.comm.divisor()
        else:
            p.scale = 1.0 / self.join_flags.divisor(work, self.world_size, self.passes,
                                                    active)
        self.epilogue.reset()  # the figures of the last backward are void
        if self.shards is not None and self.nosync_used is not None and any(self.nosync_used):
            # (a launched sharded bucket releases its parameters' .grad: read them now)
            p.nosync_grads = frozenset(i for i, f in enumerate(self.nosync_used)
                                       if f and self.params[i].grad is not None)
        cfg = self.config
        p.record_order = (self.policy.may_rebuild(self.rebuilt)
                          and (not cfg.static_graph or self.static_counts is not None))
        # later gradients of this pass take GradHook's short path
        p.plain = self._plain and not p.record_order and not p.create_graph
        if p.plain and p is self.pass_:  # (not a pass being settled: it is over)
            self.native.begin(p, self.buckets)
        if cfg.static_graph and self.static_counts is None:
            return
        if cfg.skip_all_reduce_unused_params and not p.shadow:
            p.skip = self._skippable(p)  # (before the unused are counted in and launch)
        if cfg.static_graph or cfg.find_unused_parameters:
            for i in self.unused:
                self._mark_ready(p, i)

    def start_skip_agreement(self) -> None:
        """``skip_all_reduce_unused_params``, after a synchronised forward: the buckets whose
        every parameter it left unused and that got no gradient in a ``no_sync`` pass since
        the last averaged one (DDP's locally unused). Only those unused on every rank are
        skipped: a bucket one rank skipped and another sent would pair the sender's
        allreduce with the skipper's next collective (DDP requires the same unused set on
        every rank instead). So this starts an allreduce of a flag per bucket, here, so that
        it runs while the loss and the first layers' backward do; :meth:`_agree_skip` waits
        for it when a bucket of this rank's set is reached."""
        self._drop_skip_agreement()  # a forward that no backward followed
        unused = set(self.unused)
        if self.nosync_used is not None:
            unused -= {i for i, f in enumerate(self.nosync_used) if f}
        specs = self.layout.buckets
        skip = frozenset(b for b, spec in enumerate(specs)
                         if all(i in unused for i in spec.indices))
        work = flags = None
        if self.world_size > 1:  # (every step: a rank cannot tell whether a peer skips)
            flags = torch.tensor([int(b not in skip) for b in range(len(specs))],
                                 dtype=torch.int32).to(self.guard.device)
            work = dist.all_reduce(flags, group=self.guard.group_arg(), async_op=True)
        self.skip_pending = (self.layout, skip, work, flags)

    def _drop_skip_agreement(self) -> None:
        pending, self.skip_pending = self.skip_pending, None
        if pending is not None and pending[2] is not None:
            self.guard.wait(pending[2], "the agreement on the buckets no rank used",
                            self.passes)

    def _skippable(self, p: Pass) -> frozenset:
        """This pass's share of :meth:`start_skip_agreement` (started now if the forward's
        was for another layout)."""
        if self.skip_pending is None or self.skip_pending[0] is not self.layout:
            self.start_skip_agreement()
        _, skip, work, flags = self.skip_pending
        self.skip_pending = None
        p.skip_agreement = None if work is None else (work, flags)
        return skip

    def _agree_skip(self, p: Pass) -> None:
        """Wait for the agreement :meth:`_skippable` started (once a pass, as late as the
        first bucket that needs it, so that it overlaps backward): the buckets to skip are
        those no rank needed. A bucket this rank had left out of its eager packing is
        packed in full at its launch."""
        if p.skip_agreement is None:
            return
        work, flags = p.skip_agreement
        p.skip_agreement = None
        tr = self.comm.tracer
        rec = None if tr is None else tr.begin("skip_agreement.wait")
        self.guard.wait(work, "the agreement on the buckets no rank used", p.iteration)
        needed = flags.tolist()
        if rec is not None:
            tr.end(rec)
        p.skip = frozenset(b for b in p.skip if needed[b] == 0)

    def _launch(self, p: Pass, bucket) -> None:
        """Pack and communicate ``bucket``, or skip it (every parameter unused, every
        rank)."""
        if bucket.index in p.skip:
            self._agree_skip(p)
        if bucket.index in p.skip:
            bucket.skip()
        else:
            bucket.launch(p, self.comm)

    def _mark_ready(self, p: Pass, index: int) -> None:
        self.grad_hooks[index].mark(p)

    def bucket_complete(self, p: Pass, bucket) -> None:
        """``bucket``'s last gradient is in: launch it, and those after it that are
        complete, if every bucket before it is launched."""
        bucket.state = BucketState.READY
        tr = self.comm.tracer
        if tr is not None:
            b = bucket.index
            first = bucket.t_first or self.native.first_ns(b)
            if first:
                tr.instant(f"bucket{b}.first_ready", args={"bucket": b}, t=first)
            tr.instant(f"bucket{b}.last_ready", args={"bucket": b})
        if bucket.index == p.next_bucket:
            self._advance(p)

    def _advance(self, p: Pass) -> None:
        """Launch every complete bucket whose predecessors are launched, in bucket order,
        then the ready chunks of the first incomplete one."""
        buckets, comm = self.buckets, self.comm
        while p.next_bucket < len(buckets) and buckets[p.next_bucket].state == BucketState.READY:
            self._launch(p, buckets[p.next_bucket])
            p.next_bucket += 1
        if (p.next_bucket < len(buckets) and buckets[p.next_bucket].chunked
                and p.next_bucket not in p.skip):  # (a bucket this rank may skip: at its end)
            buckets[p.next_bucket].send_ready_chunks(p, comm)

    # ------------------------------------------------------------------ buckets
    def allocate(self) -> None:
        """Build the buckets of the current layout for the current hook."""
        self._align_layout()
        specs = self.layout.buckets
        # the end-of-backward status rides at the end of the last bucket's allreduce when the
        # reducer sends that allreduce itself (one collective fewer per iteration); with a
        # torchft manager, always: the replica groups learn of each other's problems
        self.piggyback = ((self.world_size > 1 or self.comm.collective is not None)
                          and self.comm.traits.chunkable and bool(specs)
                          and not specs[-1].sparse and self.shards is None)
        self.buckets, self.slot = build_buckets(
            self.config, self.layout, self.params, self.names, self.comm, self.device,
            self.status.length, self.piggyback, self.shards, self.shard_grads,
            self._write_status_tail)
        self.native.layout(self.buckets, self.slot)
        if self.epilogue is not None:
            self.epilogue.close()
        self.epilogue = Epilogue([b.params for b in self.buckets],
                                 [b.mem for b in self.buckets], self.device,
                                 reuse=self.config.reuse_grad_figures)
        self.allocated = True
        if self.comm.tracer is not None:
            self.comm.tracer.instant("layout", args={"buckets": [
                b.wire_bytes() if hasattr(b, "wire_bytes") else 0 for b in self.buckets]})
        self.stats.buckets = len(specs)
        # the buffers one iteration needs (one per bucket, in its wire dtype); a gradient
        # the user keeps across iterations holds on to an older buffer on top of this
        self.stats.bucket_bytes_allocated = sum(b.mem.capacity_bytes() for b in self.buckets
                                                if b.mem is not None)

    def _align_layout(self) -> None:
        align = align_bytes(self.comm.traits, self.device)
        if align != self.layout.align_bytes:
            encoded = self.layout.to_tensor().clone()
            encoded[2] = align
            self.layout = BucketLayout.from_tensor(encoded, self.params)

    # ------------------------------------------------------------------ end of backward
    def finalize(self) -> None:
        if self.pass_ is not None and self.pass_.create_graph:
            with torch.no_grad():
                return self._finalize()
        return self._finalize()

    def _finalize(self) -> None:
        p, self.pass_ = self.pass_, None
        self.native.end(self.buckets)  # the counts kept in C++ this pass come back
        if p is None or not p.sync:
            return
        if not p.any_ready:
            # a backward that produced no parameter gradient (e.g. torch.autograd.grad
            # w.r.t. inputs): nothing to average, no collective. Unless no hook could fire:
            # torch replaced the accumulators (model.half().float() after entering)
            if stale := self.native.stale():
                raise RuntimeError(replaced_error([self.names[i] for i in stale], {}))
            return
        t_end = time.perf_counter()
        self.guard.mark_progress(p.iteration, finished=True)
        cfg = self.config
        if cfg.static_graph and self.static_counts is None:
            # the first iteration of a static graph: learn the hook counts, launch all
            self.static_counts = list(p.fired)
            self.unused = [i for i, c in enumerate(p.fired) if c == 0]
            p.ready = bytearray(b"\x01") * len(self.params)
            for bucket in self.buckets:
                bucket.pending, bucket.state = 0, BucketState.READY
        used = self._local_used(p)
        n_missing = self._missing(p)
        if cfg.dynamic_unused and p.fired.count(0) > len(self.unused):
            # a parameter the forward reached got no gradient: an output the loss leaves
            # out, or an accumulator torch replaced (reported on every rank, as misuse)
            if stale := self.native.stale():
                p.errors.append(replaced_error([self.names[i] for i in stale], {}, lead=False))
        # launch whatever is left, with zeros for missing gradients, so no peer is left
        # blocked in a collective this rank would never join
        for b in range(p.next_bucket, len(self.buckets)):
            self._launch(p, self.buckets[b])
        p.next_bucket = len(self.buckets)
        self._agree_skip(p)
        self.stats.buckets_skipped = len(p.skip)

        results, status, self.stats.status_check_s = self._exchange_status(
            p, n_missing + len(p.errors), used)
        self._forget_nosync_used()
        self._resolve_pending(f"backward iteration {p.iteration}")  # (every rank, here)
        if self._piggybacked(p) and len(p.errors) > p.status_errors:
            # misuse seen after the status was sent with the last bucket: this rank only
            if self.comm.drop_step is not None:  # (a manager: this group's step too)
                self.comm.drop_step(f"this replica group found misuse in backward iteration "
                                    f"{p.iteration} after its status was sent")
            self.status.raise_problems([], [0.0] * self.world_size, p.errors)
        missing = ([] if cfg.dynamic_unused or not n_missing else
                   [self.names[i] for i in range(len(self.params)) if not p.ready[i]])
        if (self.defer_status and used is None and not self.joining
                and self.comm.divisor is None and not self.policy.may_rebuild(self.rebuilt)):
            # read at the end of the next synchronised pass: the host runs on meanwhile
            self.pending_status = self.status.defer(status, p.iteration, missing,
                                                    list(p.errors))
        else:
            status = status.cpu()  # (on a GPU: waits for the device)
            self._check_steps(status)  # before the gradients reach .grad
            counts = self.status.problems(status)
            own = bool(n_missing or p.errors)
            if sum(counts) > 0 and self.comm.drop_step:  # (a manager: every group drops)
                self.comm.drop_step(f"{'this' if own else 'another'} replica group reported "
                                    f"a problem in backward iteration {p.iteration}")
            if sum(counts) > 0 and (own or not self.comm.drop_step):  # (else another's)
                self.status.raise_problems(missing, counts, p.errors, self._frozen(missing),
                                           self._replaced(missing))
        global_used = None
        if used is not None:
            global_used = self.status.used(status)
            if cfg.static_graph:
                self.static_used = global_used  # the static graph's used set, once
            if self.comm.sits_out is not None and self.comm.sits_out():
                # a replica group that heals in this step sent zeros, its used map too: it
                # takes the live groups' gradients, None where none of them used one
                for i in range(len(self.params)):
                    if not global_used[i]:
                        self.params[i].grad = None
        elif cfg.static_graph:
            global_used = self.static_used
        epi = self.epilogue
        tr = self.comm.tracer
        for bucket, result in zip(self.buckets, results):
            stats = epi.fused_stats(bucket.index)
            if tr is not None:
                args = {"bucket": bucket.index}
                rec = tr.begin(f"bucket{bucket.index}.unpack", args=args)
                stream = tr.on_device(bucket.params[0])
                dev = None if stream is None else tr.device_begin(
                    f"bucket{bucket.index}.unpack", args=args, stream=stream)
            try:
                if global_used is None:
                    filled = bucket.finish(result, bucket.targets_all, True, stats)
                else:
                    filled = bucket.finish(result, [global_used[i] for i in bucket.indices],
                                           False, stats)
            except RuntimeError as e:  # torch refuses a .grad of the bucket's old dtype
                changed = self.entry.changed(bucket.indices)
                if changed:
                    raise RuntimeError(self.entry.error(changed)) from e
                raise
            if tr is not None:
                tr.end(rec)
                if dev is not None:
                    tr.device_end(dev, stream)
            epi.finished(bucket.index, stats if filled else None)
        done = time.perf_counter()
        if tr is not None:
            tr.complete("backward", int(p.t_start * 1e9), int(t_end * 1e9))
        st = self.stats
        st.iterations += 1
        st.backward_compute_s = t_end - p.t_start
        st.comm_exposed_s = done - t_end
        st.bytes_communicated = p.bytes
        self.timings.record(p.t_start, min((b.t_launch for b in self.buckets), default=t_end),
                            t_end, done)
        if cfg.debug:
            st.bucket_comm_s = [done - b.t_launch for b in self.buckets]
            log_buckets(self.rank, st.iterations, self.layout, self.names,
                        st.bucket_comm_s)
        if self.policy.may_rebuild(self.rebuilt) and self.ready_order:
            self.rebuild(self.ready_order)
            for bucket in self.buckets:  # the averaged gradients, re-bucketed
                self.epilogue.finished(bucket.index)
        if self.tuner is not None:  # bucket_cap_mb="auto": measure, maybe re-lay (autotune.py)
            self.tuner.after_step(self, st.backward_compute_s + st.comm_exposed_s)

    def _replaced(self, names: list[str]) -> list[str]:
        """Those of the parameters ``names`` that changed dtype or device, or whose gradient
        accumulator (with the native hooks) torch replaced (for the error)."""
        if not names:
            return []
        changed = {self.names[i] for i in self.entry.changed() + self.native.stale()}
        return [n for n in names if n in changed]

    def _frozen(self, names: list[str]) -> list[str]:
        """Those of the parameters ``names`` that no longer require grad (for the error)."""
        if not names:
            return []
        by_name = dict(zip(self.names, self.params))
        return [n for n in names if n in by_name and not by_name[n].requires_grad]

    def _resolve_pending(self, where: str, swallow: bool = False) -> Exception | None:
        """Read the status a deferred pass left (see ``deferred_status``) and raise what it
        reports, as the pass itself would have (``swallow``: return it instead). Called at
        the end of each synchronised pass, after its collectives, so every rank raises at
        the same pass and none is left waiting in a collective."""
        pending, self.pending_status = self.pending_status, None
        if pending is None:
            return None
        status = self.status.read(pending)
        try:
            self._check_steps(status)
            counts = self.status.problems(status)
            if sum(counts) > 0:
                self.status.raise_problems(pending.missing, counts, pending.errors,
                                           self._frozen(pending.missing),
                                           self._replaced(pending.missing))
        except RuntimeError as e:
            error = RuntimeError(
                f"tribucket (rank {self.rank}): in backward iteration {pending.iteration}, "
                f"reported at {where}: the status of each backward is read one synchronised "
                "backward later on a GPU (deferred_status), so that the host need not wait "
                f"for the device; iteration {pending.iteration}'s gradients were written to "
                ".grad and an optimizer step may have applied them; this backward's were not "
                "written. Pass deferred_status=False (or TRIBUCKET_DEFERRED_STATUS=0) to "
                f"raise in the backward that has the problem. {e}")
            if swallow:
                return error
            raise error from None
        return None

    def _missing(self, p: Pass) -> int:
        """Gradients this rank missed, as problems to report. With find_unused_parameters a
        parameter the forward reached may still get none (an output the loss leaves out): it
        is unused in this pass, as DDP's hooks fired with an undefined gradient make it, so
        its gradient is left as it was unless another rank used it."""
        return 0 if self.config.dynamic_unused else p.ready.count(0)

    def _local_used(self, p: Pass) -> list | None:
        """This rank's used map when the global one is needed this iteration, else None."""
        cfg = self.config
        if not (cfg.find_unused_parameters or (cfg.static_graph and self.static_used is None)):
            return None
        if p.shadow:
            return [0.0] * len(self.params)
        # locally used: the hook fired with a gradient (DDP's local_used_map); sharded
        # buckets release .grad once it is copied in, and a hook fires only with a gradient
        sharded = self.shards is not None
        used = [1.0 if (f > 0 and (sharded or self.params[i].grad is not None)) else 0.0
                for i, f in enumerate(p.fired)]
        if sharded:
            for i in p.nosync_grads:
                used[i] = 1.0
        elif self.nosync_used is not None and any(self.nosync_used):
            for i, f in enumerate(self.nosync_used):
                if f and self.params[i].grad is not None:
                    used[i] = 1.0
        return used

    def _forget_nosync_used(self) -> None:
        if self.nosync_used is not None:
            self.nosync_used[:] = bytes(len(self.nosync_used))

    def _write_status_tail(self, p: Pass, buf: torch.Tensor) -> int:
        """Write this rank's status into the tail of the last bucket's buffer."""
        problems = 0 if p.shadow else self._missing(p) + len(p.errors)
        p.status_errors = len(p.errors)
        return self.status.write_tail(
            buf, self.status.tensor(problems, self._local_used(p), *self.status.marks(p)))

    def _piggybacked(self, p: Pass) -> bool:
        """Whether this pass's status rode in the last bucket's tail (not if it was skipped)."""
        return self.piggyback and self.buckets[-1].index not in p.skip

    def _exchange_status(self, p: Pass, problems: int,
                         used: list | None) -> tuple[list, torch.Tensor, float]:
        last = self.buckets[-1].mem if self._piggybacked(p) else None
        return self.status.exchange(
            self.buckets, None if last is None else last.active,
            lambda: self.status.tensor(problems, used, *self.status.marks(p)),
            self.comm.traits.serialize, p.iteration)

    def rebuild(self, order: list[int]) -> None:
        self.ready_order = []
        self.layout = self.policy.rebuilt(order, self.unused, self.layout.align_bytes,
                                          self.guard, self.world_size, self.passes)
        self.rebuilt = True
        self.stats.rebuilds += 1
        self.allocate()

    def agree_on_state(self) -> None:
        """At the first synchronised backward after entering or loading: every rank must hold
        the same layout, iteration count, comm hook and hook schedule (one all-gather)."""
        self.agree_pending = False
        resume.agree_across_ranks(self.comm.hook, self.comm.hook_state, self.comm.traits,
                                  self.layout, self.rebuilt, self.stats.iterations,
                                  (self.static_counts, self.static_used), self.guard)
