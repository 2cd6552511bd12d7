"""The data-parallel reducer's public face: DDP's gradient averaging, with fused buckets.

:class:`Reducer` attaches to a model (hooks on its forward and on every parameter), holds
the public API (``no_sync``, ``register_comm_hook``, ``state_dict``, ``close``, ``Join``)
and hands each backward pass to its :class:`~tribucket.ddp.backward.Backward`, which keeps
the cross-bucket order and the end of backward. See ``tribucket/ddp/__init__.py`` for the
files one gradient goes through.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import operator
from dataclasses import replace
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Joinable, JoinHook

from .. import _exit
from .._env import describe_backend
from .._tags import is_expert_parallel, stop_aux_outputs
from ..comm import broadcast_coalesced
from ..config import ReducerConfig, check_process_group
from ..hooks import _hook_traits
from ..layout import BucketLayout
from ..trace.chrome import write_problem
from ..trace.tracer import make_tracer, span_if_tracing, trace_path
from . import autotune, native, optsteps, resume
from .backward import Backward
from .bucket import Comm
from .claims import claim, release
from .compat import DDPCompat, bucket_sizes, logging_data
from .forward import Forward
from .hookcall import (ForwardHookRef, HookRef, check_signature, hook_name,
                       lend_timed_group)
from .join import JoinFlags, ReducerJoinHook, refuse_join_with_experts
from .model import expert_replica_sets, inspect_model, module_buffers, verify_across_ranks
from .shard import ShardAccess
from .state import ReducerStats
from .surgery import Watch
from .watchdog import CommGuard, free_groups, groups_to_reuse

__all__ = ["Reducer", "ReducerStats", "fused_bucketing"]

logger = logging.getLogger("tribucket")



def _all_ignored(module: nn.Module, view) -> str | None:
    """Why a reducer over ``module`` would average nothing although the model trains: every
    trainable parameter it has is in ``ignore_parameters`` (torch DDP refuses it too)."""
    if view.params or view.problem is not None or any(
            is_expert_parallel(p) for p in module.parameters()):
        return None
    return ("every parameter that requires a gradient is in ignore_parameters, so there is "
            "nothing to average across ranks: train the model without fused_bucketing, or "
            "leave the parameters meant to be averaged out of ignore_parameters")


class Reducer(DDPCompat, ShardAccess, Joinable):
    """Average gradients across ranks with DDP's semantics; see :func:`fused_bucketing`.

    Usable directly: ``reducer = Reducer(model)`` attaches, ``reducer.close()`` detaches
    (or use it as a context manager). ``with reducer.join(): ...`` trains on uneven inputs
    as ``DDP.join()`` does (it is a ``torch.distributed.algorithms.Joinable``); DDP's other
    spellings (the options as attributes, ``logging_data()``) are in ``compat.py``.
    """

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None, *,
                 config: ReducerConfig | None = None, _only: list | None = None, **options: Any):
        # _only: manage just these parameters, no buffers (an expert replicas' reducer)
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
        check_process_group(process_group)
        self.config = config
        self.module = module
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        logger.info("tribucket reducer on rank %d/%d: %s", self.rank, self.world_size,
                    describe_backend())

        if _only is None and not any(p.requires_grad for p in module.parameters()):
            raise ValueError(f"{type(module).__name__} has no parameter that requires a "
                             "gradient, so there is nothing to average across ranks: train "
                             "it without fused_bucketing (as torch DDP refuses it too), or "
                             "set requires_grad=True on the parameters meant to train")
        view = inspect_model(module, config.ignore_parameters, only=_only)
        self._state_params = view.state_params
        # the buffers broadcast: the module's as they are at each broadcast (none for an
        # expert replicas' reducer)
        ignored = {n for n in config.ignore_parameters if isinstance(n, str)}
        self._current_buffers = ((lambda: []) if _only is not None else
                                 functools.partial(module_buffers, module, ignored))
        self._names, self._params = view.names, view.params
        self._device = view.device
        if self.world_size > 1 and (stale := [  # (zeros: zero_grad(set_to_none=False))
                n for n, p in view.frozen if p.grad is not None and bool(p.grad.any())]):
            logger.warning(
                "tribucket: %d parameter(s) do not require grad but hold a .grad (%s), from "
                "a backward before fused_bucketing was entered (a no_sync micro-batch before "
                "a layer was frozen?). This reducer does not average them, and an optimizer "
                "steps a .grad it finds: each rank would apply its own. Set their .grad to "
                "None (optimizer.zero_grad()) or finish the accumulation window before "
                "freezing.", len(stale), ", ".join(stale[:10]) + (" ..." if len(stale) > 10
                                                               else ""))
        claim(self, view.names, view.params)  # before any collective: one reducer per param
        try:
            # same model and options everywhere: checked on the user's group, before the
            # timed group is created (ranks that disagree on timeout= would not all create it)
            self._native_ext = self._load_native()
            problems = (self._trace_problem(config.trace),
                        _all_ignored(module, view) if _only is None else None)
            every = verify_across_ranks(
                view, self.process_group, self.world_size, config, self._native_facts(),
                "; ".join(filter(None, problems)) or None,
                side=free_groups(self.process_group, self.world_size, config.timeout,
                                 config.debug))
            # the reducer's own collectives: a group with the timeout, failure diagnosis, debug
            self._guard = CommGuard(self.process_group, self.rank, self.world_size,
                                    self._device, config.timeout, config.debug,
                                    reuse=groups_to_reuse(every))
            self._broadcast_states(src_rank=0, buffers=config.broadcast_buffers)
        except BaseException:
            release(self, view.params)
            raise
        self._lent_to = None  # a hook state given the timed group (given back at close)
        self._python_hooks: list = []  # their handles, while the Python hooks count

        # how buckets are communicated (register_comm_hook may replace the hook)
        self._comm = Comm(self._guard, None, None, _hook_traits(None, None), self._guard.group,
                          self.world_size)
        self.trace_path: str | None = None  # the trace file written at close (rank 0)
        #: the timeline (``trace=`` / ``TRIBUCKET_TRACE``); None: off
        self._comm.tracer = make_tracer(config.trace, group=self._guard.group)
        self._join_flags = JoinFlags(self.process_group, self._device, self.rank, self._guard)
        # the backward passes: buckets, their order, the end of backward
        self._bw = Backward(config, self._params, self._names, view.expect_sparse,
                            self._guard, self._comm, self._join_flags, self._device)
        optsteps.watch(self._bw)  # optimizer steps: the step mark's second half
        _exit.register(self)  # detached, drained and dropped before interpreter shutdown
        self._found_inf = torch.zeros(1, dtype=torch.float32, device=self._device)
        self._initial_sizes = bucket_sizes(self._bw.layout)  # logging_data()'s bucket_sizes
        #: figures of the last backward (:class:`ReducerStats`)
        self.stats = self._bw.stats
        self._handles: list = []
        #: weak references to callables run first at close (ShardedOptimizer.wait_parameters)
        self._before_close: list = []
        self._hook_refs: list[HookRef] = []
        self._forward = Forward(config, self._bw, self._guard, self._join_flags, self._params,
                                self._current_buffers, self.world_size, self,
                                self._hook_ref(self._bw, "on_backward_start"))
        self._forward.frozen = view.frozen
        self._attach()
        if _only is None:  # (the expert replicas' reducers: the model's is this one's)
            self._forward.watch = Watch(module, view.frozen, frozenset(view.ignored),
                                        removal_matters=not config.find_unused_parameters)
            self._handles.append(self._forward.watch)  # (close removes it)
        #: reducers averaging expert replicas over their replica groups (expert x data
        #: parallelism), one per replica group, built with this reducer's options; never
        #: sharded: a ShardedOptimizer steps only this reducer's parameters, the experts'
        #: torch optimizer needs their averages in .grad
        self.expert_reducers: list[Reducer] = [] if _only is not None else [
            Reducer(module, group, config=replace(config, broadcast_buffers=False,
                                                  shard_optimizer=False), _only=params)
            for group, params in expert_replica_sets(module, config.ignore_parameters)]

    # ------------------------------------------------------------------ set-up
    def _broadcast_states(self, src_rank: int, buffers: bool | str) -> None:
        tensors = [p.detach() for _, p in self._state_params]
        if buffers:
            tensors += [b.detach() for _, b in self._current_buffers()]
        broadcast_coalesced(tensors, src=src_rank, group=self._guard.group_arg())

    def _load_native(self):
        """The native hooks' extension, if they are wanted and built. ``native_hooks=None``:
        the hooks if they are built, else None and a build in the background (no rank waits
        for a compiler); ``True``: built now if needed."""
        wanted = self.config.native_hooks
        return None if wanted is False else native.load(wait=wanted is True,
                                                        quiet=wanted is True)

    def _native_facts(self) -> dict:
        """With native_hooks=True, whether this rank could build them: compared across
        ranks before any other collective, so a rank without a compiler makes every rank
        raise at construction instead of leaving the others in their first backward."""
        if self.config.native_hooks is not True:
            return {}
        return {"native hooks (native_hooks=True)":
                "built" if self._native_ext is not None
                else f"not built: {native.unavailable_reason()}"}

    def _attach(self) -> None:
        bw, module = self._bw, self.module
        wanted = self.config.native_hooks
        ext, self._native_ext = self._native_ext, None
        if ext is None and wanted:
            raise RuntimeError("tribucket: native_hooks=True but the native gradient hooks "
                               f"could not be built ({native.unavailable_reason()}); install "
                               "a C++ compiler and `ninja`, or leave native_hooks unset")
        if ext is not None:
            self._use_native(ext)
        else:
            self._python_hooks = [  # tied parameters appear once
                # the bound method: torch calls it through the vectorcall fast path, an
                # object with __call__ through slot_tp_call (~300 instructions more each)
                p.register_post_accumulate_grad_hook(hook.__call__)
                for p, hook in zip(self._params, bw.grad_hooks)]
            self._handles.extend(self._python_hooks)
            if wanted is None and not native.ready():
                self._forward.step_boundary = self._hook_ref(self, "_switch_to_native")
                if self.rank == 0:
                    logger.warning(
                        "tribucket: compiling the native gradient hooks in the background "
                        "(once per machine, ~30 s); training runs on the Python hooks (same "
                        "results) meanwhile. `python -m tribucket.build` compiles them ahead "
                        "of time.")
        self._handles.append(module.register_forward_pre_hook(
            self._hook_ref(self._forward, "pre_forward", kind=ForwardHookRef)))
        self._handles.append(module.register_forward_hook(
            self._hook_ref(self._forward, "post_forward", kind=ForwardHookRef)))
        self._forward.post_hook_id = self._handles[-1].id

    def _trains_another_set(self) -> bool:
        """Whether what the model trains changed since entering: a parameter frozen then
        requires grad, an averaged one does not, or a parameter or submodule was set (a new
        reducer would average another set)."""
        forward, watch = self._forward, self._forward.watch
        return bool((watch is not None and (watch.touched or watch.changes or watch.resized())
                     and watch.check())
                    or any(p.requires_grad for _, p in forward.frozen)
                    or not all(map(_requires_grad, self._params)))

    def _leaving(self) -> list:
        """The averaged parameters that a new reducer would not average (frozen, or no
        longer in the model), every rank the same list (Lightning's rebuild)."""
        watch = self._forward.watch
        model = None if watch is None else watch.model()
        here = None if model is None else {id(p) for p in model.parameters()}
        return [p for p in self._params
                if not p.requires_grad or (here is not None and id(p) not in here)]

    def _use_native(self, ext) -> None:
        self._bw.native = native.NativeHooks(ext, self._params, self._bw)
        self._handles.append(self._bw.native)  # remove() takes its hooks off

    def _switch_to_native(self) -> None:
        """At a step boundary (a training forward, no backward under way): once the
        background build is over, move from the Python hooks to the native ones, or stay on
        the Python ones if it failed. Each rank switches on its own: the two count the same
        gradients into the same buckets in the same order, so results do not change."""
        if not native.ready():
            return
        self._forward.step_boundary = None
        ext = native.load()
        if ext is None or self._bw.closed:
            return
        for h in self._python_hooks:
            h.remove()
            self._handles.remove(h)
        self._python_hooks = []
        self._use_native(ext)

    def _hook_ref(self, target: Any, method: str, *args: Any, kind: type = HookRef) -> HookRef:
        ref = kind(target, method, args)
        self._hook_refs.append(ref)
        return ref

    # ------------------------------------------------------------------ public API
    @property
    def found_inf(self) -> torch.Tensor:
        """1.0 when an averaged gradient of the last backward is inf or NaN, else 0.0.

        A 1-element float32 tensor on the model's device (the same tensor every time),
        computed from the *reduced* gradients, so it covers an overflow of the sum on the
        wire and a NaN on one rank only, with any hook; equal on every rank. Computed on
        first read after each backward from the epilogue's per-bucket flags (see
        ``grad_norm``); gradients changed since are read as they are now.
        """
        if self._bw.epilogue is not None:
            with span_if_tracing("epilogue", args={"op": "found_inf"}):
                self._bw.epilogue.found_inf(self._found_inf)
        return self._found_inf

    def grad_norm(self) -> torch.Tensor:
        """Total 2-norm (0-dim float32; float64 when a gradient is float64 or complex128) of
        the gradients of the parameters this reducer averages, as
        ``torch.nn.utils.clip_grad_norm_`` would compute it.

        From the per-bucket figures of the fused epilogue: on CUDA the unpack kernel computes
        them while it writes the gradients; a bucket lent to ``.grad`` (no pass) is read once,
        flat, on first use. Gradients changed since the backward are read as they are now.
        """
        if self._bw.epilogue is None:
            return torch.zeros((), device=self._device)
        with span_if_tracing("epilogue", args={"op": "grad_norm"}):
            return self._bw.epilogue.grad_norm()

    @property
    def layout(self) -> BucketLayout:
        """The current bucket layout (DDP's, before and after the rebuild)."""
        return self._bw.layout

    @property
    def averaged_parameters(self) -> list[torch.Tensor]:
        """The parameters this reducer averages; the layout's indices point into it."""
        return list(self._params)

    @property
    def device(self) -> torch.device:
        """The device of the averaged parameters."""
        return self._device

    @property
    def parameter_names(self) -> list[str]:
        """Names of the averaged parameters; ``layout`` indices point into this list."""
        return list(self._names)

    def backward_failed(self) -> None:
        """Call where you catch an error raised by ``backward()`` on this rank, if the error
        may have come before the backward reached the model (the loss's own backward, out of
        memory): the reducer issues the collectives that backward owed its peers, with a
        failure status, so every rank raises for this step and the next step is a clean
        pass on every rank. A backward that raised inside the model, or in a hook on its
        output, is settled by the next forward without this call; calling it then (or
        twice) settles nothing more. Without it a backward that never reached the model
        leaves this rank one step ahead of its peers. With a torchft manager call it in
        every case, before ``optim.zero_grad()`` starts the next quorum."""
        self._bw.settle_unbegun()
        for r in self.expert_reducers:
            r.backward_failed()

    @property
    def require_backward_grad_sync(self) -> bool:
        """Whether the next training forward's backward averages gradients (``True``) or
        accumulates them locally (``False``), as DDP's attribute of the same name: set it
        before the forward (nanoGPT's accumulation loop does). ``no_sync()`` sets it for
        the duration of its block."""
        return self._bw.sync_enabled

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._bw.sync_enabled = bool(value)
        for r in self.expert_reducers:
            r.require_backward_grad_sync = value

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next backward outside reduces their sum.

        It holds back the expert reducers too (their replicas sync with the rest)."""
        self._refuse_closed("reducer.no_sync()")
        bw = self._bw
        old, bw.sync_enabled = bw.sync_enabled, False
        try:
            with contextlib.ExitStack() as experts:
                for r in self.expert_reducers:
                    experts.enter_context(r.no_sync())
                yield
        finally:
            bw.sync_enabled = old

    def prepare_for_backward(self, output: Any) -> None:
        """Prepare a backward that starts from ``output`` (tensors, or containers of them)
        rather than from the forward's output, as torch's reducer method of this name: a
        backward run inside the module's forward (Lightning's manual optimization calls
        this from its strategy). It averages if synchronisation is on at this call (not
        under ``no_sync``); with ``find_unused_parameters=True`` the parameters unused in it
        are those ``output`` does not reach."""
        self._forward.prepare_backward(output)

    def register_comm_hook(self, state: Any, hook: Callable) -> None:
        """Register ``hook(state, bucket) -> Future[Tensor]`` to reduce each bucket.

        The contract is torch DDP's: the hook replaces the default averaging (it does its
        own division) and its future's value becomes the bucket's content. torch's own hooks
        (``allreduce_hook``, ``fp16_compress_hook``, ``powerSGD_hook``...) run unchanged.
        """
        self._refuse_closed("register_comm_hook")
        if not callable(hook):
            raise TypeError(f"hook must be callable as hook(state, bucket), got "
                            f"{type(hook).__name__} {hook!r}")
        check_signature(hook)
        if self.config.shard_optimizer:
            raise ValueError(f"cannot register {hook_name(hook)}: with shard_optimizer=True "
                             "each bucket is reduce-scattered by the reducer itself, so no "
                             "comm hook runs; drop shard_optimizer or the hook")
        if self.config.autotune:
            _check_hook_for_autotune(self.config, hook, state)
        if self._comm.hook is not None:
            raise RuntimeError(f"a comm hook ({hook_name(self._comm.hook)}) is already "
                               "registered; register_comm_hook can be called only once per "
                               "reducer")
        if self._bw.allocated or self.stats.iterations > 0:
            raise RuntimeError("register_comm_hook must be called before the first backward "
                               "pass (the buckets are already built for the default hook)")
        check_state = getattr(hook, "check_state", None)  # (a hook's own, e.g. gossip_hook's)
        if check_state is not None:
            check_state(state)
        traits = _hook_traits(hook, state)
        if traits.wire_dtype is not None and self.config.gradient_as_bucket_view:
            raise ValueError(
                f"{hook_name(hook)} packs gradients straight into a {traits.wire_dtype} wire "
                "buffer, so there is no full-precision bucket for .grad to view: use "
                "gradient_as_bucket_view=False with fused compression hooks")
        comm = self._comm
        state, lent = lend_timed_group(self._guard.hook_group, hook, state)
        self._lent_to = lent if lent is not None else self._lent_to
        comm.hook, comm.hook_state, comm.traits = hook, state, traits
        if traits.chunkable:  # the reducer sends it itself, on the group the state names
            named = getattr(state, "process_group", None) if not isinstance(
                state, dist.ProcessGroup) else state
            comm.chunk_group = named if named is not None else self._guard.group

    def logging_data(self) -> dict[str, Any]:
        """The fields of DDP's ``_get_ddp_logging_data()`` that apply here, under DDP's names.

        Sizes in bytes, times in integer nanoseconds as DDP's; flags as 0/1. Unlike DDP's,
        every value is current (DDP logs at the next forward, and samples iterations): times
        are of the last averaged backward and ``avg_*`` their mean over every averaged
        backward. ``backward_comm_exposed_time`` (tribucket's) is the communication that did
        not overlap computation (``reducer.stats.comm_exposed_s``).
        """
        bw = self._bw
        out = logging_data(self, self._params, self._comm.hook, self._initial_sizes,
                           bw.unused, bw.rebuilt, bw.timings)
        if bw.tuner is not None:  # bucket_cap_mb="auto": the caps in use, and the search
            out["bucket_cap_bytes"] = bw.policy.caps[0]
            out.update(bw.tuner.logging_data())
        return out

    def _trace_problem(self, trace: Any) -> str | None:
        """Why rank 0, which writes the trace at close, could not write it (None: it can, or
        this is another rank, or tracing is off): found before training, not at its end."""
        path = trace_path(trace)  # on every rank: a trace= of a wrong type raises on each
        why = write_problem(path) if path is not None and self.rank == 0 else None
        return None if why is None else (
            f"trace={path!r}: {why}; pass a path rank 0 can write (a .json file or a "
            f"directory, created if missing) or trace=False")

    def state_dict(self) -> dict:
        """What a resumed run needs: the (rebuilt) layout, the iteration count, hook state;
        with expert replicas, the expert reducers' too (under a key of this rank's own)."""
        bw = self._bw
        progress = dict(rebuilt=bw.rebuilt, iterations=bw.stats.iterations,
                        passes=bw.passes, static_counts=bw.static_counts,
                        static_used=bw.static_used)
        state = resume.state_dict(self._names, bw.layout, progress, self._comm.hook,
                                  self._comm.hook_state, self.rank, self.world_size)
        if bw.tuner is not None:  # a resumed run does not tune again
            state["autotune"] = autotune.encode_state(bw.tuner.state())
        return resume.with_expert_states(state, self.expert_reducers, self.rank)

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` into a reducer over the same model, on every rank,
        before the first backward.

        Register the same comm hook (with a fresh state object) before loading, so its
        state — the gossip schedule, PowerSGD's error feedback and random state — is
        restored too. The first backward checks that every rank loaded the same state.
        """
        bw = self._bw
        if bw.pass_ is not None or bw.passes > 0:
            raise RuntimeError("load_state_dict must be called before the first backward pass "
                               "(on every rank), right after entering fused_bucketing and "
                               "registering the comm hook")
        try:
            resume.check_is_reducer_state(state)
            expert_states = resume.expert_states(state, len(self.expert_reducers), self.rank)
            layout, progress = resume.read_state_dict(
                state, self._names, self._params, self._comm.hook, self._comm.hook_state,
                self.rank, self.world_size)
        except Exception as e:
            # the peers that loaded theirs wait for this rank in their first backward: the
            # error they report at timeout= names this rank and this cause
            self._guard.report_own_failure(f"load_state_dict raised {type(e).__name__}: {e}")
            raise
        if bw.shards is not None and layout.bucket_indices() != bw.layout.bucket_indices():
            why = ("it was saved by a reducer without shard_optimizer, whose layout was "
                   "rebuilt in the gradients' ready order after its first backward (a "
                   "sharded reducer keeps the model order); load a state saved with "
                   "shard_optimizer=True, or leave the reducer state out (the iteration "
                   "count and layout start afresh)" if progress["rebuilt"] else
                   "use the same bucket_cap_mb as the saved run")
            raise ValueError("this reducer state has another bucket layout than this "
                             "shard_optimizer=True reducer, whose sharded optimizer lives on "
                             f"its own buckets: {why}")
        bw.layout = layout
        bw.rebuilt = progress["rebuilt"]
        saved = autotune.decode_state(state.get("autotune"))
        if bw.tuner is not None and saved is not None:
            bw.tuner.adopt(saved)  # the saved choice (or schedule: tune again)
            if not bw.tuner.done:  # saved while tuning: start again from the first candidate
                bw.layout = bw.policy.relayout(bw.policy.caps, bw.layout.align_bytes)
        elif bw.tuner is not None and bw.rebuilt:
            bw.tuner.adopt_layout()  # a fixed-cap run's layout: kept as it is
        bw.static_counts, bw.static_used = progress["static_counts"], progress["static_used"]
        bw.ready_order = []
        bw.stats.iterations, bw.passes = progress["iterations"], progress["passes"]
        bw.stats.rebuilds = int(bw.rebuilt)
        bw.stats.buckets = len(bw.layout.buckets)
        bw.allocated = False  # buckets follow the restored layout at the next backward
        bw.agree_pending = True
        for r, saved in zip(self.expert_reducers, expert_states):
            r.load_state_dict(saved)

    def close(self) -> None:
        """Detach from the model: remove every hook, finish the communication in flight.

        Raises ``RuntimeError`` if a collective in flight failed (after detaching)."""
        self._close(raise_errors=True)

    def __enter__(self) -> "Reducer":
        self._refuse_closed("with reducer:")
        return self

    def _refuse_closed(self, what: str) -> None:
        if self._bw.closed:
            raise RuntimeError(
                f"{what}: this reducer was closed (its fused_bucketing block ended, or close() "
                "was called), so its hooks are off the model and it would average nothing. "
                "Enter tribucket.fused_bucketing(model) again for a new reducer.")

    def __exit__(self, exc_type, *exc) -> None:
        # never mask the body's own exception; an interrupt (Ctrl-C reaches every rank, each
        # at its own point) or an exit settles nothing: the peers' passes need not pair
        self._close(raise_errors=exc_type is None, interrupted=exc_type is not None and
                    issubclass(exc_type, (KeyboardInterrupt, SystemExit)))

    def _close(self, raise_errors: bool, at_exit: bool = False,
               interrupted: bool = False) -> None:
        if self._bw.closed:
            return
        self._bw.closed = True
        if not self._guard.failed:  # a sharded optimizer's gathers in flight land first
            for ref in self._before_close:
                wait = ref()
                if wait is not None:
                    wait()
        optsteps.unwatch(self._bw)
        release(self, self._params)
        lent, self._lent_to = self._lent_to, None
        if lent is not None and not self._guard.failed:
            # (after a failure a callback may still run: it must not reach the default group)
            lent.process_group = None
        if self._bw.epilogue is not None:
            self._bw.epilogue.close()  # its figures no longer answer for these gradients
        for h in self._handles:
            h.remove()
        self._handles.clear()
        stop_aux_outputs(self._forward)  # (a forward that raised left its collection open)
        for ref in [*self._hook_refs, *self._bw.grad_hooks]:
            ref.detach()  # graphs still holding a hook no longer reach the reducer
        self._hook_refs.clear()
        e = self._bw.finish_in_flight(abandon=interrupted)  # so no peer is left waiting
        for r in self.expert_reducers:
            r._close(raise_errors, interrupted=interrupted)
        tracer, self._comm.tracer = self._comm.tracer, None
        if tracer is not None:
            #: the trace file rank 0 wrote (every rank's events; None elsewhere); after an
            #: exception, a failed collective or at exit, this rank's own (no gather: the
            #: peers may be in their next step's collectives, or gone)
            self.trace_path = tracer.close(local=not (e is None and raise_errors and not
                                                      self._guard.failed and not at_exit))
        self._release()
        if e is None and not interrupted and not at_exit:
            self._guard.give_back()  # (its groups are idle: the next reducer takes them)
        if e is None:
            return
        message = (f"tribucket (rank {self.rank}): close() finished the communication in "
                   f"flight, and it failed: {e}")
        if raise_errors:
            raise RuntimeError(message) from e
        logger.error("%s", message)

    def _settle_at_exit(self) -> None:
        """Interpreter exit (``tribucket._exit``): detach if still attached; drop the works."""
        self._close(raise_errors=False, at_exit=True)  # (no trace gather: peers may be gone)
        self._release()

    def _release(self) -> None:
        """After close: drop what references collectives and their buffers (the finished
        works and futures of the last pass, the Join notification) and cut the reducer's
        reference cycles, so none of it waits for the garbage collector. A gloo work freed
        by a late collection, after ``destroy_process_group()`` or during interpreter
        shutdown, is what aborts a process at exit ('terminate called without an active
        exception')."""
        bw = self._bw
        for bucket in bw.buckets:
            bucket.handle = None
        bw.join_work = bw.join_active = None
        self._forward.joinable = self._forward.backward_start = None
        self._forward.step_boundary = None

    # ------------------------------------------------------------------ Joinable
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """Shadow this reducer's collectives on ranks that ran out of inputs (``Join``).

        ``divide_by_initial_world_size`` (default ``True``, as DDP): divide gradients by the
        initial world size; ``False`` divides by the number of ranks still training.
        """
        self._refuse_closed("Join (reducer.join())")
        refuse_join_with_experts(self.module)
        if self.config.skip_all_reduce_unused_params:
            raise ValueError("Join (uneven inputs) is not supported with "
                             "skip_all_reduce_unused_params=True: a rank out of inputs runs no "
                             "forward, so it cannot tell which buckets its peers skip; leave "
                             "the option off to train on uneven inputs")
        if self.config.shard_optimizer:
            raise ValueError("Join (uneven inputs) is not supported with shard_optimizer=True: "
                             "a rank out of inputs would also have to shadow the sharded "
                             "optimizer's all-gathers; give every rank the same number of "
                             "batches (e.g. a DistributedSampler with drop_last=True)")
        return ReducerJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self._device

    @property
    def join_process_group(self) -> Any:
        return self.process_group


def _check_hook_for_autotune(config: ReducerConfig, hook: Callable, state: Any) -> None:
    """A hook whose state may be per bucket (torch's PowerSGD keeps error feedback per bucket
    index) would be handed buckets of another layout mid-run: refuse it under "auto"."""
    if state is None or isinstance(state, dist.ProcessGroup) or \
            type(state).__module__.startswith("tribucket."):
        return
    which = "bucket_cap_mb" if config.bucket_cap_mb == "auto" else "first_bucket_cap_mb"
    raise ValueError(
        f"cannot register {hook_name(hook)} with {which}='auto': its state "
        f"({type(state).__name__}) may be kept per bucket (as PowerSGD's error feedback is), "
        "and 'auto' changes the buckets during the first steps. Pass a number for "
        f"{which} (run once with 'auto' and the default hook, and read "
        "reducer.logging_data()['autotune_bucket_cap_mb'])")


def fused_bucketing(model: nn.Module, process_group: dist.ProcessGroup | None = None, *,
                    bucket_cap_mb: float | str | None = None,
                    first_bucket_cap_mb: float | str | None = None,
                    gradient_as_bucket_view: bool = False,
                    find_unused_parameters: bool = False,
                    static_graph: bool = False,
                    broadcast_buffers: bool | str = True,
                    ignore_parameters=(),
                    manager: Any = None,
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
    ``manager``: a ``torchft.Manager``; each bucket is averaged across replica groups through
    its fault-tolerant allreduce (see ``tribucket/ft.py`` and docs/reliability.md).
    """
    named = dict(bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=first_bucket_cap_mb,
                 gradient_as_bucket_view=gradient_as_bucket_view,
                 find_unused_parameters=find_unused_parameters, static_graph=static_graph,
                 broadcast_buffers=broadcast_buffers, ignore_parameters=ignore_parameters)
    if options.get("config") is not None:  # it holds every option: pass on only those given
        defaults = inspect.signature(fused_bucketing).parameters
        named = {k: v for k, v in named.items() if v != defaults[k].default}
    if manager is not None:
        from ..ft import ManagedReducer
        return ManagedReducer(model, manager, process_group, **named, **options)
    return Reducer(model, process_group, **named, **options)


_requires_grad = operator.attrgetter("requires_grad")
