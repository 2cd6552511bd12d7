"""A sharded optimizer on the reducer's buckets (ZeRO-1/2): each rank steps 1/world of them.

Under ``fused_bucketing(model, shard_optimizer=True)`` every bucket is reduce-scattered as it
completes in backward, and each rank keeps only its slice of the averaged gradients (see
``tribucket._shard``). :class:`ShardedOptimizer` wraps a torch optimizer class around those
slices:

* the model's parameters become views into one flat buffer per bucket (padded to ``world``
  equal shards), so rank ``r``'s slice of the parameters is a view too;
* the wrapped optimizer sees, for each original param group, flat tensors: the runs of this
  rank's shards that belong to the group's parameters (fp32 masters for fp16/bf16
  parameters, views of the parameters otherwise), with the group's options;
* after its step, one all-gather per bucket writes every rank's updated slice back into the
  parameters.

State kept per rank: the optimizer state of ``1/world`` of the parameters, the averaged
gradient of ``1/world`` of them (between backward and ``zero_grad``), and fp32 master
copies of ``1/world`` of any fp16/bf16 parameters.

Only *elementwise* optimizers can be sharded this way: the update of an element may depend
on its own value, gradient and state and on scalar hyperparameters, never on other
elements (no norms, no matrix shapes). See ``ELEMENTWISE_OPTIMIZERS``.
"""

from __future__ import annotations

import collections
import operator
import weakref
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from ._shard import all_gather_single, clip_slices_, slices_partial
from . import _exit
from .ddp import optsteps
from .ddp.hookcall import ForwardHookRef, HookRef, compiling
from ._zero_checks import (ELEMENTWISE_OPTIMIZERS, _agree_across_ranks,  # noqa: F401
                           _check_optimizer_class, _normalize_groups, _refuse_loss_scaling,
                           loss_scaling_refused)
from ._zero_state import (MASTER_KEY, StateDicts, _names, _options,  # noqa: F401
                          merge_sharded_state_dicts)

__all__ = ["ShardedOptimizer", "ELEMENTWISE_OPTIMIZERS", "merge_sharded_state_dicts"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class _Segment:
    """A run of one rank's shard of one bucket that the wrapped optimizer sees as a tensor."""

    __slots__ = ("bucket", "start", "length", "group", "pieces", "params", "tensor")

    def __init__(self, bucket: int, group: int):
        self.bucket = bucket   # bucket index
        self.start = 0         # first element in the bucket's shard
        self.length = 0        # elements
        self.group = group     # original param group
        #: (user param index, first element of the param, first element in the segment, n)
        self.pieces: list[tuple[int, int, int, int]] = []
        self.params: list[int] = []  # the reducer's indices of those parameters
        self.tensor: torch.Tensor | None = None  # the view the optimizer steps


class ShardedOptimizer(StateDicts, torch.optim.Optimizer):
    """Step ``optimizer_class`` on this rank's 1/world shard of every gradient bucket.

    Example::

        with tribucket.fused_bucketing(model, shard_optimizer=True) as reducer:
            opt = tribucket.ShardedOptimizer(reducer, torch.optim.AdamW, lr=1e-3,
                                             weight_decay=0.1)
            for x, y in loader:
                loss_fn(model(x), y).backward()  # each bucket is reduce-scattered
                opt.clip_grad_norm_(1.0)         # optional: one small allreduce
                opt.step()                       # steps the shard, all-gathers parameters
                opt.zero_grad()

    Args:
        reducer: the reducer of ``fused_bucketing(..., shard_optimizer=True)``.
        optimizer_class: an elementwise ``torch.optim.Optimizer`` subclass (see
            ``ELEMENTWISE_OPTIMIZERS``).
        params: parameters or param-group dicts, as for ``optimizer_class`` (default: the
            model's parameters). Frozen parameters are skipped, as torch's optimizers skip
            parameters without gradient.
        assume_elementwise: accept an optimizer class outside ``ELEMENTWISE_OPTIMIZERS``.
        overlap_param_gather: ``True`` (default): return from ``step()`` with the
            all-gathers in flight; each module waits for the buckets of its own parameters in
            a forward pre-hook, so the gathers overlap the next forward, and in a
            ``state_dict`` pre-hook, so a checkpoint taken right after ``step()`` is current;
            leaving ``fused_bucketing`` waits for them too. A forward that reads parameters
            of a module it does not call, or a read of the parameter tensors themselves (an
            average of weights over ``model.parameters()``), must call
            :meth:`wait_parameters` first. The default because it was faster on every model
            and rank count of ``perf/bench_zero.py`` (docs/zero.md). ``False``: ``step()``
            returns with the parameters updated.
        **defaults: the optimizer's options (``lr``, ``weight_decay``...).

    Between ``backward`` and ``step`` the parameters have no ``.grad``: the averaged
    gradients live, sharded, in the reducer. Every method that communicates
    (``step``, ``clip_grad_norm_``, ``state_dict``) must be called on every rank.

    It is a ``torch.optim.Optimizer`` (as torch's ``ZeroRedundancyOptimizer`` is): LR
    schedulers, step and state-dict hooks and torch.distributed.checkpoint's
    ``get_state_dict``/``set_state_dict`` take it. ``param_groups`` hold the model's
    parameters with the wrapped optimizer's options; ``state`` and ``defaults`` are the
    wrapped optimizer's (its state keyed by this rank's shard tensors).
    """

    # torch.amp.GradScaler hands such an optimizer its scale instead of unscaling .grad
    # (there is none here): step() sees it and refuses, with the reason
    _step_supports_amp_scaling = True
    # it steps the reducer's shards and counts its steps itself (optsteps.stepped)
    steps_shards = True

    def __init__(self, reducer, optimizer_class: type, params: Iterable | None = None, *,
                 assume_elementwise: bool = False, overlap_param_gather: bool = True,
                 **defaults: Any):
        _check_optimizer_class(optimizer_class, assume_elementwise)
        shards = reducer.shards  # raises unless the reducer shards
        if params is not None and not isinstance(params, torch.Tensor):
            params = list(params)  # (read twice: a generator would be spent)
        _agree_across_ranks(reducer, optimizer_class, params, assume_elementwise,
                            overlap_param_gather, defaults)
        self.reducer = reducer
        # the reducer's group: with timeout= it is the one created with that timeout, so
        # the optimizer's collectives are bounded as the reducer's are (_bounded)
        self._guard = reducer._guard
        self._group = reducer._guard.group
        self._world, self._rank = reducer.world_size, reducer.rank
        module = reducer.module
        groups = _normalize_groups(module.parameters() if params is None else params)
        names = {id(p): n for n, p in module.named_parameters()}
        averaged = reducer.averaged_parameters
        index_of = {id(p): i for i, p in enumerate(averaged)}
        # the user's parameters, flattened over the groups (torch's state_dict indices)
        self._user_params: list[torch.Tensor] = []
        self._user_groups: list[list[int]] = []
        where: dict[int, tuple[int, int]] = {}  # reducer index -> (group, user index)
        seen: set[int] = set()
        for g, group in enumerate(groups):
            self._user_groups.append([])
            for p in group["params"]:
                if not isinstance(p, torch.Tensor):
                    raise TypeError(f"param group {g} holds a {type(p).__name__}, not a tensor")
                if id(p) in seen:
                    raise ValueError(f"parameter {names.get(id(p), '?')!r} appears in more "
                                     "than one param group (or twice in one)")
                seen.add(id(p))
                u = len(self._user_params)
                self._user_params.append(p)
                self._user_groups[g].append(u)
                i = index_of.get(id(p))
                if i is not None:
                    where[i] = (g, u)
                elif p.requires_grad:
                    raise ValueError(
                        f"parameter {names.get(id(p), tuple(p.shape))!r} in param group {g} is "
                        "not averaged by this reducer (ignored, expert-parallel, or not part "
                        "of the reducer's model), so it has no gradient shard; give it to a "
                        "separate torch optimizer")
        self._flat, self._master, self._segments = self._build(shards, where, averaged)
        self._bound_params = [p for p, _, _ in self._bound]
        self._ptrs = [view.data_ptr() for _, view, _ in self._bound]
        self._where = where
        # the saved state of parameters in the groups that have no shard here (frozen when
        # fused_bucketing was entered), kept as loaded and given back by state_dict(), as a
        # torch optimizer keeps a frozen parameter's state: it resumes when unfrozen
        self._unsharded = sorted(set(range(len(self._user_params)))
                                 - {u for _, u in where.values()})
        self._parked: dict[int, dict] = {}
        # per low-precision bucket: its parameters, and the sum of their version counters
        # when its fp32 master slice last rounded to them; a write through a parameter
        # since (the model's load_state_dict) is taken into the master at the next step
        # (None: an fp32 bucket, whose master is its own shard)
        self._low = [[averaged[i] for i in bucket.indices]
                     if master.dtype != bucket.dtype else None
                     for bucket, master in zip(self.reducer.layout.buckets, self._master)]
        self._seen: list[int | None] = [None if ps is None else _versions(ps)
                                        for ps in self._low]
        # zero_grad(set_to_none=False) keeps a zero .grad on every parameter that had one:
        # torch's optimizer steps those even where unused (momentum, weight decay)
        self._set_to_none = True
        self._had_grad: set[int] = set()  # reducer indices, since the last set_to_none
        inner_groups: list[dict] = []
        self._inner: list[_Segment | None] = []  # per wrapped-optimizer tensor
        for g, group in enumerate(groups):
            segs = [s for s in self._segments if s.group == g]
            tensors = [s.tensor for s in segs]
            self._inner += segs
            if not tensors:  # no slice of this group here: torch rejects empty groups
                tensors = [torch.empty(0, device=reducer.device)]
                self._inner.append(None)
            inner_groups.append({**_options(group), "params": tensors})
        self.optim = optimizer_class(inner_groups, **defaults)
        # torch's view (``param_groups``): per original group its parameters and the wrapped
        # group's options; schedulers write the options here, step() hands them on
        self._groups = [{**_options(inner), **_names(group),
                         "params": [self._user_params[u] for u in users]}
                        for inner, group, users in zip(self.optim.param_groups, groups,
                                                       self._user_groups)]
        self._init_optimizer_interface()
        self._gathers: list = [None] * len(self._flat)  # per bucket: all-gather in flight
        self._landed = True  # no gather in flight (set by wait_parameters(), not by _wait)
        self._overlap = bool(overlap_param_gather)
        _exit.register(self)  # gathers drained, groups dropped before interpreter shutdown
        self._hooks = self._wait_hooks(module, averaged) if self._overlap else []
        if self._overlap:  # leaving fused_bucketing waits for the gathers in flight
            reducer._before_close.append(weakref.WeakMethod(self._release))

    def _init_optimizer_interface(self) -> None:
        """What ``torch.optim.Optimizer.__init__`` sets, but ``param_groups`` (built above),
        ``state`` and ``defaults`` (the wrapped optimizer's): its ``__init__`` would build
        them through ``add_param_group``, which is refused here."""
        for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
                     "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                     "_optimizer_load_state_dict_pre_hooks",
                     "_optimizer_load_state_dict_post_hooks"):
            setattr(self, name, collections.OrderedDict())
        self._patch_step_function()  # step pre/post hooks, the profiler's step range

    def _wait_hooks(self, module, averaged: list) -> list:
        """A forward pre-hook and a state_dict pre-hook on every module holding parameters:
        wait for their buckets (``model.state_dict()`` right after ``step()``, or a layer's,
        holds the gathered parameters). And, first on the model, a forward pre-hook that
        waits for every bucket when ``torch.compile`` traces the forward: there the modules'
        waits are left out of the graph (each would split it)."""
        bucket_of = {id(averaged[i]): b for b, bucket in enumerate(self.reducer.layout.buckets)
                     for i in bucket.indices}
        handles = [module.register_forward_pre_hook(
            _CompiledForwardWait(self, "_wait_all_hook"), prepend=True)]
        for m in module.modules():
            buckets = sorted({bucket_of[id(q)] for q in m.parameters(recurse=False)
                              if id(q) in bucket_of})
            if buckets:  # (a copy or a pickle of the model gets inert hooks: see HookRef)
                hook = _ModuleWait(self, "_wait_hook", (tuple(buckets),))
                handles.append(m.register_forward_pre_hook(hook))
                handles.append(m.register_state_dict_pre_hook(hook))
                handles.append(m.register_load_state_dict_pre_hook(hook))
        return handles

    def _wait_all_hook(self, *_module_and_args) -> None:
        self.wait_parameters()

    def _wait_hook(self, buckets, *_module_and_args) -> None:
        self._wait(buckets)

    def _release(self) -> None:
        """At the reducer's close: the gathers land, and the hooks come off the model (they
        would keep this optimizer alive for as long as the model lives); a step after it
        waits for its own gathers, as with ``overlap_param_gather=False``."""
        self.wait_parameters()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._overlap = False

    def _wait(self, buckets) -> None:
        for b in buckets:
            work, self._gathers[b] = self._gathers[b], None
            if work is not None:
                self._bounded(work.wait, f"all-gather of bucket {b}'s parameters")

    def _bounded(self, fn, what: str):
        """``fn()``: one of this optimizer's collectives or its wait. A failure (the group's
        timeout passed, a peer died) says which, and what to do; the group is dead then."""
        try:
            return self._guard.bounded(fn, f"the ShardedOptimizer's {what}")
        except RuntimeError:
            self._gathers = [None] * len(self._gathers)  # nothing more to wait for
            raise

    def _settle_at_exit(self) -> None:
        self.wait_parameters()

    def wait_parameters(self) -> None:
        """Wait for the parameters' all-gathers (``overlap_param_gather=True``)."""
        self._wait(range(len(self._gathers)))
        self._landed = True

    def _build(self, shards, where: dict, averaged: list):
        """Flat parameter buffers per bucket (parameters become views), master shards, and
        the segments of this rank's shards, per param group."""
        layout = self.reducer.layout
        flats, masters, segments = [], [], []
        self._bound: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # (param, view, bucket)
        for shard, bucket in zip(shards, layout.buckets):
            flat = torch.zeros(shard.padded_numel, dtype=bucket.dtype, device=bucket.device)
            with torch.no_grad():
                for i, off, n in zip(bucket.indices, bucket.offsets, bucket.sizes):
                    p = averaged[i]
                    view = flat.narrow(0, off, n).view(p.shape)
                    view.copy_(p)
                    p.data = view  # the parameter now lives in the bucket's buffer
                    self._bound.append((p, view, shard.index))
            mine = flat.narrow(0, shard.lo, shard.shard_numel)
            # fp32 master copies of low-precision shards (Megatron's distributed optimizer)
            master = mine.float() if bucket.dtype in _LOW_PRECISION else mine
            flats.append(flat)
            masters.append(master)
            split = self.reducer.config.find_unused_parameters or \
                self.reducer.config.static_graph
            seg = None
            for piece in shard.pieces:
                if piece.param not in where:
                    seg = None  # not optimized: ends the run
                    continue
                g, u = where[piece.param]
                if (seg is None or seg.group != g or split
                        or seg.start + seg.length != piece.shard_start):
                    # per parameter when a parameter may be unused: torch skips it then
                    seg = _Segment(shard.index, g)
                    seg.start = piece.shard_start
                    segments.append(seg)
                seg.pieces.append((u, piece.param_start, piece.shard_start - seg.start,
                                   piece.length))
                seg.params.append(piece.param)
                seg.length = piece.shard_start + piece.length - seg.start
        for seg in segments:
            seg.tensor = masters[seg.bucket].narrow(0, seg.start, seg.length)
        return flats, masters, segments

    # ------------------------------------------------------------------ torch's interface
    @property
    def param_groups(self) -> list[dict]:
        """One group per original group, as a torch optimizer over the model's parameters
        has them: its parameters and options. An option changed here (an LR scheduler's
        ``lr``) reaches the wrapped optimizer's groups at the next ``step()``."""
        return self._groups

    def _options_down(self) -> None:
        """The options of ``param_groups`` into the wrapped optimizer's groups."""
        for mine, inner in zip(self._groups, self.optim.param_groups):
            inner.update(_options(mine))

    def _options_up(self) -> None:
        """The wrapped optimizer's options (just loaded) into ``param_groups``."""
        for mine, inner in zip(self._groups, self.optim.param_groups):
            mine.update(_options(inner))

    def add_param_group(self, param_group: dict) -> None:
        """Refused: the shards are slices of the reducer's buckets, laid out when
        ``fused_bucketing`` was entered, so parameters cannot join later."""
        raise RuntimeError(
            "ShardedOptimizer cannot add a param group after construction: its shards are "
            "slices of the reducer's buckets, fixed when fused_bucketing was entered. Pass "
            "every param group to the constructor (a group's lr and other options can still "
            "change through param_groups), or give the new parameters to a separate torch "
            "optimizer (ignore_parameters keeps them out of the reducer)")

    @property
    def state(self):
        """The wrapped optimizer's state, keyed by this rank's shard tensors."""
        return self.optim.state

    @property
    def defaults(self) -> dict:
        return self.optim.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradient shards; reset any local ``.grad`` (from ``no_sync`` passes)."""
        self.reducer.clear_grad_shards()
        for seg in self._segments:
            seg.tensor.grad = None
        self._set_to_none = set_to_none
        if set_to_none:
            self._had_grad.clear()
        for p in self._user_params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_()
                    p.grad.zero_()

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        """Step this rank's shards, then all-gather the parameters (one collective per
        bucket). Call on every rank."""
        _refuse_loss_scaling(self)
        self._guard.mark_call("opt.step()")
        self.wait_parameters()  # a step before the next forward: the last gathers are done
        if list(map(_data_ptr, self._bound_params)) != self._ptrs:
            self._take_rebound_parameters()
        self._take_written_parameters()
        tr = self.reducer._comm.tracer
        rec = tr.begin("optimizer.step") if tr is not None else None
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._options_down()
        grads, used = self.reducer.grad_shards, self.reducer.shard_used
        if all(g is None for g in grads):  # no backward under the reducer since zero_grad
            self._grads_from_dot_grad()
        else:
            master_grads = []
            for g, m in zip(grads, self._master):
                master_grads.append(None if g is None else g if g.dtype == m.dtype
                                    else g.to(m.dtype))
            for seg in self._segments:
                g = master_grads[seg.bucket]
                if g is not None and (used is None or any(used[i] for i in seg.params)):
                    seg.tensor.grad = g.narrow(0, seg.start, seg.length)
                    self._had_grad.update(seg.params)
                elif not self._set_to_none and self._had_grad.intersection(seg.params):
                    # unused now, but torch's .grad is a zero tensor it steps (the shard
                    # holds zeros where no rank had a gradient)
                    seg.tensor.grad = (g.narrow(0, seg.start, seg.length) if g is not None
                                       else torch.zeros_like(seg.tensor))
                else:
                    seg.tensor.grad = None  # no rank used it: torch skips the parameter
        self.optim.step()
        optsteps.stepped(self.reducer._bw)  # (its optimizer holds shards: not matched)
        self._gather_parameters()
        if rec is not None:
            tr.end(rec)
        return loss

    def _grads_from_dot_grad(self) -> None:
        """No averaged gradient since ``zero_grad``: this rank's slices step with the
        parameters' own ``.grad`` (torch.distributed.checkpoint's ``get_state_dict`` creates
        a fresh optimizer's state so: zero ``.grad``, lr 0). Each slice steps with its
        owner's ``.grad``, so a ``.grad`` set by hand must be the same on every rank. A
        slice none of whose parameters has a ``.grad`` is skipped."""
        for seg in self._segments:
            pieces = [(self._user_params[u].grad, p_start, s_start, n)
                      for u, p_start, s_start, n in seg.pieces]
            if all(g is None for g, *_ in pieces):
                seg.tensor.grad = None
                continue
            flat = torch.zeros_like(seg.tensor)
            for g, p_start, s_start, n in pieces:
                if g is not None:
                    flat[s_start:s_start + n] = g.detach().reshape(-1)[p_start:p_start + n]
            seg.tensor.grad = flat

    def _gather_parameters(self) -> None:
        # the last bucket holds the first layers: gathered first, needed first
        for b in reversed(range(len(self._flat))):
            flat, master, mine = self._flat[b], self._master[b], self._mine(b)
            if master.data_ptr() != mine.data_ptr():
                mine.copy_(master)  # one rounding of the fp32 master to the parameter dtype
            if self._world > 1:
                self._gathers[b] = all_gather_single(flat, mine, group=self._group,
                                                     async_op=True)
                self._landed = False
        if not self._overlap:
            self.wait_parameters()

    def _mine(self, b: int) -> torch.Tensor:
        """This rank's shard of bucket ``b``'s parameters (in their buffer)."""
        return self._flat[b].narrow(0, self.reducer.shards[b].lo, self._master[b].numel())

    def _take_rebound_parameters(self) -> None:
        """A parameter whose ``.data`` was set to another tensor (``p.data = merged``, as
        adapter-merging code does) no longer lives in its bucket's buffer, which the step
        updates and the all-gather fills: its values go into the buffer (the master takes
        them as any write), and it lives there again."""
        for p, view, b in self._bound:
            if p.data_ptr() == view.data_ptr():
                continue
            if p.shape != view.shape or p.dtype != view.dtype or p.device != view.device:
                raise RuntimeError(
                    f"ShardedOptimizer: a parameter's .data was set to a tensor of shape "
                    f"{tuple(p.shape)}, {p.dtype} on {p.device}; it was {tuple(view.shape)}, "
                    f"{view.dtype} on {view.device} when fused_bucketing was entered. Its "
                    "bucket holds that shape and dtype: leave fused_bucketing, change the "
                    "model, enter again and build the optimizer again")
            with torch.no_grad():
                view.copy_(p.data)
            p.data = view
            if self._low[b] is not None:
                self._seen[b] = -1  # the master takes the buffer's new values

    def _take_written_parameters(self) -> None:
        """Parameters of a low-precision bucket written since its master last rounded to
        them (the model's ``load_state_dict``, an in-place initialisation) go into the fp32
        master slice, which the step updates: elementwise, where the parameter is not the
        master's rounding (a master loaded with the optimizer's state is kept, exact). The
        parameters' own writes are seen (their version counters; the buffer's writes, the
        optimizer's own, are not)."""
        for b, (params, seen) in enumerate(zip(self._low, self._seen)):
            if params is None:
                continue
            now = _versions(params)
            if now != seen:
                master, mine = self._master[b], self._mine(b)
                master.copy_(torch.where(mine == master.to(mine.dtype), master, mine.float()))
                self._seen[b] = now

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Scale the averaged gradients so their total norm is at most ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` would; return the total
        norm. One allreduce of one number; call on every rank after backward."""
        norm_type = float(norm_type)
        if not max_norm > 0:
            raise ValueError(f"max_norm must be positive, got {max_norm!r}")
        if norm_type <= 0:
            raise ValueError(f"norm_type must be positive or inf, got {norm_type!r}")
        grads = [g for g in self.reducer.grad_shards if g is not None]
        local = slices_partial(grads, norm_type, self.reducer.device)
        if self._world > 1:
            self._guard.mark_call("opt.clip_grad_norm_()")
            op = dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM
            self._bounded(lambda: dist.all_reduce(local, op=op, group=self._group),
                          "clip_grad_norm_ all-reduce")
        total = local if norm_type == float("inf") else local ** (1.0 / norm_type)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is "
                               f"{total.item()}; pass error_if_nonfinite=False to skip this "
                               "check")
        clip_slices_(grads, max_norm, total)
        return total


_data_ptr = torch.Tensor.data_ptr


def _versions(params: list[torch.Tensor]) -> int:
    """The sum of the tensors' version counters (grows with each in-place write)."""
    return sum(map(_version_of, params))


_version_of = operator.attrgetter("_version")


class _CompiledForwardWait(ForwardHookRef):
    """The model's first forward pre-hook: in a forward ``torch.compile`` traces, it waits for
    every bucket's all-gather outside the graph (a break at the forward's start, as the
    reducer's own forward hooks); in an eager forward it does nothing (the modules wait)."""

    __slots__ = ()

    def __call__(self, *a: Any) -> Any:
        return super().__call__(*a) if compiling() else None


class _ModuleWait(ForwardHookRef):
    """A module's wait for its buckets' all-gathers. Traced by ``torch.compile``: nothing when
    every gather has landed (the model's :class:`_CompiledForwardWait` waited for all, or no
    step ran since), else the wait outside the graph (a submodule compiled on its own)."""

    __slots__ = ()

    def __call__(self, *a: Any) -> Any:
        if compiling():
            fn = self.fn
            if fn is None or fn.__self__._landed:
                return None
            return super().__call__(*a)
        fn = self.fn
        return None if fn is None else fn(*self.args, *a)
