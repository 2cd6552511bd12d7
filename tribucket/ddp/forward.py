"""The reducer's forward hooks: what a forward decides for the backward that follows.

Before a training forward: settle a backward that raised, broadcast buffers (as DDP does),
tell ranks that ran out of inputs (``Join``) whether this iteration synchronises. After it:
count the training step, record whether the backward synchronises (``no_sync``), which
parameters the forward reached (``find_unused_parameters``), and queue the end-of-backward
callback from the outputs' ``grad_fn``. A rank that joined replays the collectives of one
iteration (:meth:`Forward.shadow_iteration`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.algorithms.join import Join

from .._tags import collect_aux_outputs, stop_aux_outputs
from ..comm import broadcast_coalesced
from ..config import ReducerConfig
from .backward import Backward
from .graph import output_tensors, reachable_parameters
from .join import JoinFlags
from .status import unfrozen_error
from .surgery import Watch, changed_error
from .watchdog import CommGuard

__all__ = ["Forward"]


class Forward:
    """The forward pre-hook and hook of one reducer (registered by it through ``HookRef``).

    ``joinable``: the reducer, as ``torch.distributed.algorithms.Join`` knows it."""

    def __init__(self, config: ReducerConfig, bw: Backward, guard: CommGuard,
                 join_flags: JoinFlags, params: list[torch.Tensor],
                 buffers: Callable[[], list], world_size: int, joinable: Any,
                 backward_start: Callable):
        self.config, self.bw, self.guard, self.join_flags = config, bw, guard, join_flags
        # buffers(): the module's buffers now, (name, tensor) each: read before every
        # broadcast, as DDP does, so a buffer reassigned on the module (an EMA or a step
        # counter written as `self.buf = self.buf + 1`) is the one broadcast
        self.params, self.buffers, self.world_size = params, buffers, world_size
        self.joinable, self.backward_start = joinable, backward_start
        self.require_param_sync = True  # broadcast buffers before the next forward
        # tribucket.DistributedDataParallel: DDP's buffer rule holds for forwards through the
        # wrapper only; ``wrapper.module(x)`` is a plain module's forward, as with DDP
        self.wrapped = False   # the reducer belongs to such a wrapper
        self.via_wrapper = False  # this forward came through it
        self.step_boundary: Callable | None = None  # called before each training forward
        self.post_hook_id: int | None = None  # post_forward's forward-hook handle id
        #: (name, parameter) of the model's parameters that did not require grad on entering
        #: (not averaged): one that requires grad now would train unaveraged on every rank
        self.frozen: list[tuple[str, torch.Tensor]] = []
        self.watch: Watch | None = None  # parameters and submodules set since entering

    def pre_forward(self, module: nn.Module, args: Any) -> None:
        hooks = module._forward_hooks
        if len(hooks) > 1 and next(reversed(hooks)) != self.post_hook_id:
            # forward hooks added since entering (one may change the output) run before
            # post_forward, which must see the output the loss gets, as DDP searches it
            hooks.move_to_end(self.post_hook_id)
        joining = self.joinable._join_config.enable
        bw = self.bw
        if not torch.is_grad_enabled():
            # evaluation: by default no collective, so `if rank == 0: evaluate(model)` works;
            # broadcast_buffers="ddp" decides as DDP (the previous forward was a training
            # one: broadcast), so every rank must then run it
            if self.config.broadcast_buffers == "ddp" and not joining and (
                    self.via_wrapper or not self.wrapped):
                if self.require_param_sync:
                    self.broadcast_buffers(lambda: 0)
                self.require_param_sync = False
            return
        if bw.pass_ is not None and torch._C._current_graph_task_id() == -1:
            bw.settle_abandoned()  # outside any backward: the last one raised
        watch = self.watch
        if watch is not None and (watch.touched or watch.changes or watch.resized()):
            if changes := watch.check():
                raise RuntimeError(changed_error(changes))
        if self.frozen and any(p.requires_grad for _, p in self.frozen):
            # (before this forward's collectives: every rank that unfroze raises here)
            if watch is not None and (changes := watch.check()):  # (drops those gone)
                raise RuntimeError(changed_error(changes))
            if unfrozen := [n for n, p in self.frozen if p.requires_grad]:
                raise RuntimeError(unfrozen_error(unfrozen))
        if bw.entry.changed(bw.entry.sample):  # (model.half(), .to(...))
            raise RuntimeError(bw.entry.error(bw.entry.changed()))
        # a backward begun inside this forward (before its output exists) decides whether it
        # averages when it runs, not by the last forward's decision
        bw.fwd_sync = None
        bw.joining = joining  # (a pass under join() reads its status at once)
        if self.step_boundary is not None and bw.pass_ is None:
            self.step_boundary()
        self.guard.step = bw.forwards
        if bw.comm.tracer is not None and module.training:
            # this forward's spans (an MoE layer's) belong to the step of the synchronised
            # backward that follows (micro-batches under no_sync too); an evaluation
            # forward's stay in the step before
            bw.comm.tracer.next_step(bw.synced + 1)
        if joining:
            bw.join_work = Join.notify_join_context(self.joinable)
        if self.require_param_sync:
            # under Join rank 0 may have left: agree on the highest rank still training
            self.broadcast_buffers(lambda: self.join_flags.common_rank(True, bw.passes)
                                   if joining else 0)
        # under Join: tell joined ranks whether this iteration synchronises; the sum is the
        # count of ranks still training (joined ranks send 0), which torch's notify gives
        # only the first joinable of a Join
        bw.join_active = (self.join_flags.allreduce(1.0 if bw.sync_enabled else 0.0, bw.passes)
                          if joining else None)
        if self.config.dynamic_unused:  # (an MoE layer's aux_loss: an output of the forward)
            (collect_aux_outputs if bw.sync_enabled else stop_aux_outputs)(self)

    def broadcast_buffers(self, source: Callable[[], int]) -> None:
        if not (self.config.broadcast_buffers and self.world_size > 1):
            return
        buffers = tuple(b.detach() for _, b in self.buffers())
        if not buffers:
            return
        src = source()
        self.guard.fingerprint("buffers", self.bw.passes, 0, len(buffers), None)
        # a forward whose backward has not run yet may have saved a buffer (BatchNorm's
        # running statistics): overwriting it in place must not bump its version counter,
        # or that backward fails on this rank (two forwards, then one backward through
        # both). As DDP: the values a backward reads of a running statistic do not matter.
        with torch.autograd._unsafe_preserve_version_counter(buffers):
            # a failure or timeout names the rank behind, as the reducer's other collectives
            self.guard.call(lambda: broadcast_coalesced(buffers, src=src,
                                                        group=self.guard.group_arg()),
                            f"the broadcast of rank {src}'s buffers before the forward",
                            self.bw.passes + 1)

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        bw = self.bw
        sync = bw.sync_enabled
        if module.training:
            bw.forwards += 1  # a training step; compared across ranks at its backward
        self.require_param_sync = sync
        bw.fwd_sync = sync
        # the tensors the forward left beside its output for the loss (an MoE layer's
        # aux_loss) count as outputs: a parameter only they reach is used if the loss takes
        # them, and unused at the end of backward (no gradient) if it does not
        self._await_backward(output_tensors(output), sync, lambda: stop_aux_outputs(self))

    def prepare_backward(self, output: Any) -> None:
        """A backward from ``output`` that the forward's output does not lead to (one run
        inside the forward, as under Lightning's manual optimization): it averages if
        synchronisation is on now, and with ``find_unused_parameters`` the parameters it
        leaves unused are those ``output`` does not reach."""
        if torch.is_grad_enabled():
            bw = self.bw
            bw.fwd_sync = bw.sync_enabled
            self._await_backward(output_tensors(output), bw.fwd_sync, list)

    def _await_backward(self, outs: list, sync: bool, aux: Callable[[], list]) -> None:
        """Expect a backward from ``outs``: with ``find_unused_parameters`` (synchronised),
        the parameters neither they nor ``aux()`` reach are unused."""
        bw = self.bw
        if sync and self.config.dynamic_unused:
            reached = reachable_parameters(outs + aux())
            bw.unused = [i for i, p in enumerate(self.params) if id(p) not in reached]
            if self.config.skip_all_reduce_unused_params:
                bw.start_skip_agreement()
        # queue the end-of-backward callback from the outermost backward that reaches
        # an output (a hook on the parameters could fire inside a reentrant backward). A
        # hook on the tensor itself, registered before any the user adds to the output: it
        # runs first, so a user hook on the output that raises leaves a pass begun, which
        # the next forward settles (its collectives, a failure status) like any backward
        # that raised
        for t in outs:
            if t.grad_fn is not None:
                t.register_hook(self.backward_start)

    def shadow_iteration(self) -> None:
        """On a rank that ran out of inputs (``Join``): issue the collectives one iteration
        of the others issues, contributing zeros."""
        bw, flags = self.bw, self.join_flags
        self.guard.step = -1  # (debug fingerprints: no forward of its own to compare)
        if self.require_param_sync:
            self.broadcast_buffers(lambda: flags.common_rank(False, bw.passes))
        sync = flags.allreduce(0.0, bw.passes) != 0
        self.require_param_sync = sync
        bw.passes += 1
        if sync:
            bw.shadow_pass()
