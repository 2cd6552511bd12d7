"""Communication hooks with torch's contract: ``hook(state, bucket) -> Future[Tensor]``.

Every hook here also runs under torch DDP (``ddp.register_comm_hook(state, hook)``). Under
tribucket, the compression hooks are *fused*: the reducer sees their wire dtype and packs
the gradients straight into an fp16/bf16 buffer with the ``1/world_size`` division fused
into the same pass, so no full-precision copy of the bucket exists on that path.

``state`` may be ``None`` (the default process group), a ``ProcessGroup``, or a state
object with a ``process_group`` attribute (:class:`CompressionState`, :class:`GossipState`).
"""

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from .comm.waiter import completed_by_waiter

__all__ = ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "noop_hook",
           "gossip_hook", "CompressionState", "GossipState"]


# ---------------------------------------------------------------------------------------
# what the reducer needs to know about a hook
@dataclass(frozen=True)
class _HookTraits:
    builtin: bool                 # tribucket's own: aligned (padded) buffers are fine
    wire_dtype: torch.dtype | None  # fused compression: pack straight into this dtype
    prescale: bool                # the reducer fuses the 1/world_size division into pack
    serialize: bool               # call only after the previous bucket's future completed
    chunkable: bool = False       # one averaging allreduce: the reducer may send it in chunks


@dataclass(frozen=True)
class _OwnHookTraits:
    """What one of tribucket's own hooks declares (``@_mark``)."""

    wire_dtype: torch.dtype | None  # pack straight into this dtype (fused compression)
    prescale: bool                  # expects the 1/world_size division fused into pack
    chunkable: bool                 # one averaging allreduce: may be sent in chunks


def _mark(wire_dtype=None, prescale=True, chunkable=False):
    def deco(fn):
        fn._tribucket_traits = _OwnHookTraits(wire_dtype=wire_dtype, prescale=prescale,
                                              chunkable=chunkable)
        return fn
    return deco


def _torch_single_collective_hooks() -> tuple:
    """torch's hooks that launch one collective and whose callbacks launch none."""
    try:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as d
    except ImportError:  # pragma: no cover
        return ()
    return (d.allreduce_hook, d.fp16_compress_hook, d.bf16_compress_hook)


def _hook_traits(hook: Callable | None, state: Any) -> _HookTraits:
    if hook is None:  # the reducer's own averaging allreduce
        return _HookTraits(builtin=True, wire_dtype=None, prescale=True, serialize=False,
                           chunkable=True)
    own = getattr(hook, "_tribucket_traits", None)
    if own is not None:
        return _HookTraits(builtin=True, wire_dtype=own.wire_dtype, prescale=own.prescale,
                           serialize=False, chunkable=own.chunkable)
    if hook in _torch_single_collective_hooks():
        return _HookTraits(builtin=False, wire_dtype=None, prescale=False, serialize=False)
    # anything else may launch collectives from its future callbacks (PowerSGD does)
    return _HookTraits(builtin=False, wire_dtype=None, prescale=False, serialize=True)


def _group_of(state: Any, bucket: Any = None) -> dist.ProcessGroup:
    """The group named by ``state``; else the reducer's (which carries its timeout)."""
    if isinstance(state, dist.ProcessGroup):
        return state
    group = getattr(state, "process_group", None) if state is not None else None
    if group is None and bucket is not None:
        group = getattr(bucket, "process_group", lambda: None)()
    return dist.group.WORLD if group is None else group


def _allreduce(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.futures.Future[torch.Tensor]:
    # DDP needs the future's value to be the tensor itself (a work's own future holds a list)
    return dist.all_reduce(tensor, group=group, async_op=True).get_future().then(
        lambda fut: fut.value()[0])


def _is_prescaled(bucket) -> bool:
    return bool(getattr(bucket, "is_prescaled", lambda: False)())


# ---------------------------------------------------------------------------------------
class CompressionState:
    """State of the compression hooks.

    Args:
        process_group: the group to reduce over (``None``: the default group).
        check_overflow: under torch DDP (the generic path), set ``state.found_inf`` to 1.0
            when the reduced bucket holds an inf/NaN (an overflow of the sum included);
            never cleared by the hook. Under tribucket it is not needed:
            ``reducer.found_inf`` covers every averaged gradient, whatever the hook.
    """

    __slots__ = ("process_group", "check_overflow", "found_inf")

    def __init__(self, process_group: dist.ProcessGroup | None = None,
                 check_overflow: bool = False):
        self.process_group = process_group
        self.check_overflow = bool(check_overflow)
        #: set by the generic (non-fused, e.g. under torch DDP) path: the reduced bucket's
        self.found_inf = torch.zeros(1)


@_mark(prescale=True, chunkable=True)
def allreduce_hook(state: Any, bucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over the group with one allreduce (the default behaviour).

    Under tribucket the bucket arrives already divided by the world size (fused into the
    pack); elsewhere the hook divides before the allreduce, as torch's ``allreduce_hook``.

    Example::
        >>> reducer.register_comm_hook(None, tribucket.hooks.allreduce_hook)
    """
    group = _group_of(state, bucket)
    buf = bucket.buffer()
    if not _is_prescaled(bucket):
        buf.div_(group.size())
    return _allreduce(buf, group)


def _compress(dtype: torch.dtype, state: Any, bucket) -> torch.futures.Future[torch.Tensor]:
    group = _group_of(state, bucket)
    buf = bucket.buffer()
    if _is_prescaled(bucket):
        # fused path: the reducer already packed the gradients into `dtype` with 1/world
        # folded in, and will unpack the result straight into the fp32 gradients
        return _allreduce(buf, group)
    # generic path (torch DDP, or a caller that hands us a full-precision bucket):
    # divide *before* the cast, in full precision, so the cast sees the averaged
    # magnitude (torch's hook casts first and divides in half precision)
    compressed = buf.mul(1.0 / group.size()).to(dtype)

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        buf.copy_(fut.value())
        # checked after the sum: each rank's term can be finite and the sum not
        if getattr(state, "check_overflow", False) and not bool(torch.isfinite(buf).all()):
            state.found_inf.fill_(1.0)
        return buf

    return _allreduce(compressed, group).then(decompress)


@_mark(wire_dtype=torch.float16, chunkable=True)
def fp16_compress_hook(state: Any, bucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in ``torch.float16``: half the bytes on the wire.

    Fused under tribucket: gradients are scaled by ``1/world_size`` and cast to fp16 in the
    one pack pass (no fp32 staging bucket: the reducer allocates half the bucket memory),
    allreduced, and unpacked straight into the fp32 ``.grad``. Dividing before the cast
    (torch's ``fp16_compress_hook`` casts first, then divides in fp16) keeps each rank's
    term from overflowing: it is at most ``max|g| / world``. The *sum* of the terms can
    still overflow fp16 (two ranks with a gradient of 80000: terms of 40000, sum 80000 >
    65504); ``reducer.found_inf`` reports it, as any inf/NaN in the averaged gradients
    (``tribucket.amp.GradScaler`` skips such steps). Values below fp16's subnormal range
    (~6e-8 after division) flush to zero.

    Example::
        >>> reducer.register_comm_hook(None, tribucket.hooks.fp16_compress_hook)
    """
    return _compress(torch.float16, state, bucket)


@_mark(wire_dtype=torch.bfloat16, chunkable=True)
def bf16_compress_hook(state: Any, bucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in ``torch.bfloat16``: fp32's range with 8 bits of mantissa.

    Fused exactly as :func:`fp16_compress_hook` (scale before a round-to-nearest-even
    cast, no fp32 staging bucket). bf16 has fp32's range (only sums within a rounding step
    of fp32's largest value overflow) but keeps only ~3 significant digits.

    Example::
        >>> reducer.register_comm_hook(None, tribucket.hooks.bf16_compress_hook)
    """
    return _compress(torch.bfloat16, state, bucket)


@_mark(prescale=False)
def noop_hook(state: Any, bucket) -> torch.futures.Future[torch.Tensor]:
    """Return the bucket untouched: everything but the communication, for measurements.

    Example::
        >>> reducer.register_comm_hook(None, tribucket.hooks.noop_hook)
    """
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


class GossipState:
    """State of :func:`gossip_hook`: the process group and where the schedule stands.

    Power-of-two worlds use a hypercube schedule (at iteration ``t`` rank ``r`` pairs with
    ``r XOR 2**(t mod log2(world))``: after ``log2(world)`` iterations every rank's
    gradient has reached every other rank); other worlds shift around a ring (send to
    ``r + s``, receive from ``r - s``, ``s = 1 + t mod (world - 1)``).
    """

    __slots__ = ("process_group", "iteration")

    def __init__(self, process_group: dist.ProcessGroup | None = None, iteration: int = 0):
        self.process_group = process_group
        self.iteration = int(iteration)

    def peers(self, rank: int, world: int) -> tuple[int, int]:
        """``(send_to, receive_from)`` of ``rank`` at the current iteration."""
        if world <= 1:
            return rank, rank
        if world & (world - 1) == 0:
            bit = 1 << (self.iteration % (world.bit_length() - 1))
            return rank ^ bit, rank ^ bit
        shift = 1 + self.iteration % (world - 1)
        return (rank + shift) % world, (rank - shift) % world

    def state_dict(self) -> dict:
        return {"iteration": self.iteration}

    def load_state_dict(self, sd: dict) -> None:
        self.iteration = int(sd["iteration"])


@_mark(prescale=False)
def gossip_hook(state: GossipState, bucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with one peer instead of all ranks (GossipGrad).

    Each iteration a rank sends its bucket to one peer and averages it with the one it
    receives, ``(mine + theirs) / 2``, with ``dist.batch_isend_irecv``: constant traffic per
    rank whatever the world size. Models on different ranks drift apart between exchanges
    and mix over iterations; see :class:`GossipState` for the schedule.

    Example::
        >>> state = tribucket.hooks.GossipState()
        >>> reducer.register_comm_hook(state, tribucket.hooks.gossip_hook)
    """
    _needs_gossip_state(state)
    group = _group_of(state, bucket)
    world, rank = group.size(), dist.get_rank(group)
    buf = bucket.buffer()
    send_to, recv_from = state.peers(rank, world)
    if bucket.is_last():
        state.iteration += 1  # every bucket of this iteration used the same peers
    if world == 1:
        return noop_hook(None, bucket)
    recv = torch.empty_like(buf)
    to_global = (lambda r: r) if group is dist.group.WORLD \
        else (lambda r: dist.get_global_rank(group, r))
    ops = [dist.P2POp(dist.isend, buf, to_global(send_to), group),
           dist.P2POp(dist.irecv, recv, to_global(recv_from), group)]
    works = dist.batch_isend_irecv(ops)
    return _p2p_future(works, lambda: buf.add_(recv).mul_(0.5))


def _needs_gossip_state(state: Any) -> None:
    if not isinstance(state, GossipState):
        raise TypeError(f"gossip_hook needs a tribucket.hooks.GossipState, got "
                        f"{type(state).__name__}")


#: checked by register_comm_hook, before any collective
gossip_hook.check_state = _needs_gossip_state


def _p2p_future(works: list, then: Callable[[], torch.Tensor]) -> torch.futures.Future[torch.Tensor]:
    """A Future completed with ``then()`` once every point-to-point work has finished (gloo's
    point-to-point Work has no ``get_future()``)."""
    return completed_by_waiter(works, then)
