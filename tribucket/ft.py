"""Per-step fault tolerance across replica groups, on torchft.

``fused_bucketing(model, manager=manager)`` (a ``torchft.Manager``) returns a
:class:`ManagedReducer`: the reducer of one replica group whose buckets are averaged across
the replica groups of the current quorum through ``manager.allreduce``, launched from the
bucket as any bucket's collective (no wait inside a hook: the overlap with backward stays),
with fp16/bf16 fused compression packing straight into the wire buffer the manager sends.

What each piece does::

    manager.start_quorum()          (torchft.Optimizer.zero_grad)  quorum, maybe heal
    first gradient of backward      num_participants(): the pack divides by it
    forward / backward              bucket complete -> pack (/ participants) ->
                                    manager.allreduce(wire buffer, SUM)
    end of backward                 wait the futures -> .grad = average over the
                                    participating replica groups; the status, summed in the
                                    last bucket's tail: a group's failed (abandoned) pass,
                                    the used map -> manager.report_error on every group
    manager.should_commit()         (torchft.Optimizer.step)  False on every replica group
                                    when a peer failed during the step: the step is dropped

Layout: a replica group that joins late must build the buckets the live ones use without
having seen their gradient-ready order, and replica groups never exchange that order (each
one's rank 0 would decide its own). So a managed reducer never rebuilds: from the first step
it uses size-capped buckets filled in reverse parameter order (the order backward usually
produces gradients in), computed from the parameters alone, the same on every replica
group. The layout still travels in the reducer's state (``reducer.state_dict()``) and a
recovering replica checks it.

Live recovery: entering registers the reducer's ``state_dict``/``load_state_dict`` with the
manager (``manager.register_state_dict_fn("tribucket_reducer", ...)``), so the reducer's
state travels with the model and optimizer state the manager was given.

torchft is imported here only, and only when a managed reducer is built.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from . import hooks as _hooks
from .comm.waiter import completed_by_waiter
from ._tags import is_expert_parallel
from .ddp.reducer import Reducer
from .ddp.rebuild import DDP_ALIGN_BYTES, LayoutPolicy
from .layout import compute_layout

__all__ = ["ManagedReducer", "STATE_KEY"]

#: the key of the reducer's state in the manager's state dict
STATE_KEY = "tribucket_reducer"

#: the comm hooks that are one averaging allreduce, which the manager's allreduce replaces
_AVERAGING_HOOKS = (_hooks.allreduce_hook, _hooks.fp16_compress_hook, _hooks.bf16_compress_hook)


def _torch_equivalents() -> dict:
    """torch's single-allreduce hooks -> tribucket's fused equivalents."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as d
    return {d.allreduce_hook: _hooks.allreduce_hook,
            d.fp16_compress_hook: _hooks.fp16_compress_hook,
            d.bf16_compress_hook: _hooks.bf16_compress_hook}


def _require_torchft() -> None:
    try:
        import torchft  # noqa: F401
    except ImportError as e:  # pragma: no cover - the ft extra installs it
        raise ImportError("fused_bucketing(manager=...) needs torchft: pip install "
                          "'tribucket[ft]' (torch pinned in the same command)") from e


def _check_manager(manager: Any) -> None:
    missing = [m for m in ("allreduce", "should_commit", "num_participants", "report_error",
                           "is_participating", "register_state_dict_fn")
               if not callable(getattr(manager, m, None))]
    if missing:
        raise TypeError(f"manager must be a torchft.Manager, got {type(manager).__name__} "
                        f"(no {', '.join(missing)})")


def _refuse(module: nn.Module, process_group, options: dict) -> None:
    """The combinations a managed reducer does not support, each refused before any
    collective, with the reason."""
    if options.get("shard_optimizer"):
        raise ValueError(
            "fused_bucketing(manager=...) does not support shard_optimizer=True: the manager "
            "averages whole buckets across replica groups (there is no fault-tolerant "
            "reduce-scatter), and the ShardedOptimizer's all-gather inside a replica group "
            "would not be covered by should_commit(); use a plain optimizer wrapped in "
            "torchft.Optimizer")
    for name in ("bucket_cap_mb", "first_bucket_cap_mb"):
        if options.get(name) == "auto":
            raise ValueError(
                f"fused_bucketing(manager=...) does not support {name}='auto': every replica "
                "group must hold the same buckets from the first step (they are fixed from the "
                "parameters alone, never rebuilt or re-laid), and a group that joins later "
                f"could not follow a search; pass a number for {name}")
    if options.get("skip_all_reduce_unused_params"):
        raise ValueError(
            "fused_bucketing(manager=...) does not support skip_all_reduce_unused_params=True: "
            "the ranks agree on the buckets to skip with an allreduce of their own, which "
            "would have to go through the manager's fault-tolerant allreduce (a replica group "
            "that fails or joins mid-step must not leave the others waiting); leave it off")
    if options.get("static_graph"):
        raise ValueError(
            "fused_bucketing(manager=...) does not support static_graph=True: it learns the "
            "used parameters once, from the first backward, but a replica group's first step "
            "can be another's hundredth, and a group that heals sends zeros for that step, "
            "its used parameters too; use find_unused_parameters=True, whose used map the "
            "groups agree on at every step")
    if options.get("comm_chunk_mb"):
        raise ValueError(
            f"fused_bucketing(manager=...) does not support comm_chunk_mb="
            f"{options['comm_chunk_mb']!r}: each bucket goes to the manager as one "
            "fault-tolerant allreduce; leave comm_chunk_mb unset")
    if options.get("timeout") is not None:
        raise ValueError(
            "fused_bucketing(manager=...) takes no timeout=: the manager's own timeout "
            "(torchft.Manager(timeout=...)) bounds every allreduce, and a failure drops the "
            "step instead of raising")
    group_size = dist.get_world_size(process_group) if dist.is_initialized() else 1
    if group_size != 1:
        raise ValueError(
            f"fused_bucketing(manager=...) needs one process per replica group; this group "
            f"has {group_size} ranks. The manager averages each bucket across replica groups "
            "rank by rank (rank i with rank i of the other groups), so ranks of one group "
            "would have to average among themselves first, a second collective per bucket "
            "that is not implemented: run each rank as its own replica group "
            "(torchrun --nproc-per-node 1, a REPLICA_GROUP_ID each)")
    experts = [n for n, p in module.named_parameters() if is_expert_parallel(p)]
    if experts:
        raise ValueError(
            f"fused_bucketing(manager=...) does not support tribucket.moe layers "
            f"({experts[0]!r} is an expert-parallel parameter): expert parameters are left "
            "out of the data-parallel reducer and averaged by expert reducers, and the "
            "all-to-all runs, on process groups the manager does not reconfigure, so they "
            "would not be averaged across replica groups and a lost replica group would hang "
            "them; train MoE models with fault tolerance through torchft's own wrappers, or "
            "without manager=")
    cplx = [n for n, q in module.named_parameters() if q.is_complex()]
    if cplx:
        raise ValueError(
            f"fused_bucketing(manager=...) does not support complex parameters ({cplx[0]!r} "
            f"is complex): the manager's allreduce takes the fused wire buffer, which holds "
            "real values; keep complex parameters as real pairs (torch.view_as_real) or train "
            "without manager=")
    sparse = [n for n, m in module.named_modules()
              if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse]
    if sparse:
        raise ValueError(
            f"fused_bucketing(manager=...) does not support sparse gradients ({sparse[0]!r} "
            "has sparse=True): the manager's allreduce is dense; use sparse=False")


class _ManagerAllreduce:
    """The bucket's collective: ``manager.allreduce`` of the packed wire buffer, a sum over
    the replica groups of this step's quorum. The pack already divided each gradient by
    ``num_participants()`` (:func:`_participants`, the reducer's divisor), as it divides by
    the world size without a manager: no pass over the bucket of its own, and for fp16/bf16
    the sum on the wire stays within its largest term. Returns a future at once (the
    overlap with backward stays); errors are swallowed by the manager, which then makes
    ``should_commit()`` return False on every replica group."""

    __slots__ = ("manager",)

    def __init__(self, manager: Any):
        self.manager = manager

    def __call__(self, buf: torch.Tensor, body: torch.Tensor) -> torch.futures.Future:
        from torch.distributed import ReduceOp

        return _completed_by_waiter(self.manager.allreduce(buf, reduce_op=ReduceOp.SUM), body)


def _participants(manager: Any) -> Callable[[], int]:
    """The count a pass divides by: the replica groups of this step's quorum (waits for the
    quorum, which ``start_quorum`` began at ``zero_grad``; 1 before any quorum)."""
    return lambda: max(manager.num_participants(), 1)


def _reporter(manager: Any) -> Callable[[str], None]:
    """How a pass drops its step: the error goes to the manager, whose ``should_commit()``
    is then False on this replica group. Each group reports its own: the failed group when
    it settles its pass, the others when they read its problem in the pass's status, which
    rides in the last bucket through ``manager.allreduce``."""
    return lambda reason: manager.report_error(RuntimeError(f"tribucket: {reason}"))


# torchft's work builds its callback chain (the error handling, the timeout) lazily, when
# wait() is called, and only wait() after the collective completed runs that chain
# correctly (chaining it while the collective is in flight fails in torchft 0.2.0's
# _ManagedWork). So the works are waited on by tribucket's waiter thread, in launch order,
# which completes a plain torch Future with the bucket: the backward pass never waits, and
# the reducer waits for these futures at the end of backward as for any comm hook's.
def _completed_by_waiter(work: Any, buf: torch.Tensor) -> torch.futures.Future:
    return completed_by_waiter([work], lambda: buf)


class _StateSlot:
    """What the manager's ``tribucket_reducer`` state functions reach: the manager's live
    reducer, if any (the functions are registered once per manager; a reducer built later
    on the same manager takes the slot)."""

    __slots__ = ("ref",)

    def __init__(self):
        self.ref: Callable[[], Any] = lambda: None

    def state_dict(self) -> dict:
        reducer = self.ref()
        return {} if reducer is None else reducer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        reducer = self.ref()
        if reducer is not None and state:
            reducer.load_live_state(state)


#: the live managed reducers (for :func:`dropping_step`)
_LIVE: "weakref.WeakSet[ManagedReducer]" = weakref.WeakSet()


def dropping_step() -> bool:
    """Whether this step is being dropped: a live managed reducer's manager holds an error
    (``manager.errored()``; its ``should_commit()`` says no). ``tribucket.amp.GradScaler``
    then leaves its scale as it is, as a group that gave the step up does."""
    for reducer in list(_LIVE):
        errored = getattr(reducer.manager, "errored", None)
        if not reducer._bw.closed and errored is not None and errored() is not None:
            return True
    return False


class ManagedReducer(Reducer):
    """A :class:`~tribucket.Reducer` whose buckets are averaged across replica groups by a
    torchft ``Manager``; built by ``fused_bucketing(model, manager=manager)``."""

    def __init__(self, module: nn.Module, manager: Any,
                 process_group: dist.ProcessGroup | None = None, **options: Any):
        _require_torchft()
        _check_manager(manager)
        config = options.get("config")
        _refuse(module, process_group, options if config is None else
                {f.name: getattr(config, f.name) for f in dataclasses.fields(config)})
        super().__init__(module, process_group, **options)
        try:
            self.manager = manager
            self._comm.collective = _ManagerAllreduce(manager)
            self._comm.divisor = _participants(manager)
            self._comm.drop_step = _reporter(manager)
            self._comm.sits_out = lambda: not manager.is_participating()
            self._fix_layout()
            slot = getattr(manager, "_tribucket_state_slot", None)
            if slot is None:
                slot = _StateSlot()
                manager.register_state_dict_fn(STATE_KEY, slot.load_state_dict,
                                               slot.state_dict)
                manager._tribucket_state_slot = slot
            slot.ref = weakref.ref(self)
            self._slot = slot
            _LIVE.add(self)
        except BaseException:
            self._close(raise_errors=False)
            raise

    def fixed_layout(self):
        """The layout every replica group uses, from the parameters alone (a managed reducer
        never rebuilds): size-capped buckets filled in reverse parameter order, the order
        backward usually produces gradients in, as a rebuild in that order would lay them.
        So the bucket sent last, which nothing overlaps, holds the remainder. (DDP's initial
        guess fills in parameter order and reverses the buckets, which puts the remainder
        first and a full bucket last.)"""
        policy = LayoutPolicy(self.config, self._params, [False] * len(self._params))
        return compute_layout(self._params, order=range(len(self._params) - 1, -1, -1),
                              align_bytes=DDP_ALIGN_BYTES, **policy.cap_kwargs())

    def _fix_layout(self) -> None:
        state = super().state_dict()
        state["layout"] = self.fixed_layout().to_tensor().tolist()
        state["rebuilt"] = True  # never rebuilt in gradient-ready order
        super().load_state_dict(state)

    def register_comm_hook(self, state: Any, hook: Callable) -> None:
        """Register one of the averaging hooks: tribucket's ``allreduce_hook``,
        ``fp16_compress_hook``, ``bf16_compress_hook`` (or torch's hooks of the same names,
        run as tribucket's fused ones). The manager sends the bucket (in the hook's wire
        dtype); ``state`` is not used. Other hooks are refused: their collectives would
        bypass the manager (a lost peer would raise instead of dropping the step) and hook
        state such as PowerSGD's error feedback would absorb a dropped step."""
        hook = _torch_equivalents().get(hook, hook)
        if hook not in _AVERAGING_HOOKS:
            name = getattr(hook, "__qualname__", repr(hook))
            raise ValueError(
                f"fused_bucketing(manager=...) cannot run comm hook {name}: only the averaging "
                "hooks (tribucket.hooks.allreduce_hook, fp16_compress_hook, "
                "bf16_compress_hook, or torch's of the same names) go through the manager's "
                "fault-tolerant allreduce. A hook that sends its own collectives (PowerSGD, "
                "gossip) would bypass it: a lost replica group would raise instead of dropping "
                "the step, and its state (error feedback) would keep the dropped step's part")
        super().register_comm_hook(None, hook)
        self._comm.collective = _ManagerAllreduce(self.manager)

    def load_live_state(self, state: dict) -> None:
        """Load a live peer's :meth:`state_dict` (the manager calls this when this replica
        group recovers). Before the first backward it is :meth:`load_state_dict`; after it
        (a replica group that fell behind by a dropped step) the peer's layout and hook must
        be this reducer's, and there is nothing else to take: the layout is fixed and the
        averaging hooks keep no state."""
        if self._bw.passes == 0 and self._bw.pass_ is None:
            self.load_state_dict(state)
            return
        mine = self.state_dict()
        for key in ("parameter_names", "layout", "hook"):
            if state.get(key) != mine[key]:
                raise RuntimeError(
                    f"tribucket: the reducer state sent by the recovering peer differs in "
                    f"{key!r} from this replica group's: build the same model, options and "
                    "comm hook on every replica group")

    def _close(self, raise_errors: bool, at_exit: bool = False,
               interrupted: bool = False) -> None:
        slot = getattr(self, "_slot", None)
        if slot is not None and slot.ref() is self:
            slot.ref = lambda: None
        super()._close(raise_errors, at_exit, interrupted)
