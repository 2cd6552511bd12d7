"""One bucket of the data-parallel reducer (its slice of the layout, its memory, its chunk
bounds, its state in the current backward pass and its one in-flight communication), and
the per-parameter hook that counts gradients into it (:class:`GradHook`).

State machine of a bucket in one backward pass (every field written here is read here or
by the reducer's cross-bucket order)::

    PENDING ──(its last gradient is counted)──► READY
    READY ──(every earlier bucket launched)──► LAUNCHED   pack, then communicate()
    LAUNCHED ──(wait(): the result arrived)──► DONE       finish(): the average becomes .grad
    DONE ──(reset(): next backward)──► PENDING

How a bucket is communicated is :meth:`DenseBucket.communicate` alone (the averaging
allreduce, whole or in chunks, or the comm hook); where the averaged bucket becomes the
gradients is :meth:`DenseBucket.finish` alone (lend the buffer, or unpack it).
"""

from __future__ import annotations

import enum
import operator
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..grad_bucket import GradBucket
from ..layout import Bucket
from .hookcall import check_result, hook_name, invoke, invoke_after
from .memory import BucketMemory
from .state import Pass
from .watchdog import CommGuard

__all__ = ["BucketState", "Comm", "DenseBucket", "GradHook", "SparseBucket"]

_grad_of = operator.attrgetter("grad")


class BucketState(enum.IntEnum):
    PENDING = 0   # waiting for gradients
    READY = 1     # every gradient is counted; waits for earlier buckets to be launched
    LAUNCHED = 2  # packed and handed to the hook / allreduce; its handle is in flight
    DONE = 3      # result arrived (wait() returned)


@dataclass
class Comm:
    """How a reducer's buckets are communicated: the same for every bucket."""

    guard: CommGuard               # the reducer's group, timeouts, debug fingerprints
    hook: Callable | None          # the comm hook (None: the reducer's own allreduce)
    hook_state: Any                # its state
    traits: Any                    # hooks._HookTraits of the hook
    chunk_group: Any               # where the reducer's own (chunked) allreduces go
    world_size: int
    #: replaces the averaging allreduce (default, allreduce/fp16/bf16 hooks): called with
    #: the packed wire buffer (the last bucket's with the status in its tail) and the
    #: bucket's part of it, returns a Future of that part, averaged (tribucket/ft.py)
    collective: Callable | None = None
    #: with ``collective``: the count a pass averages over, in place of the world size,
    #: asked when the pass's first gradient arrives and fused into the pack (a torchft
    #: quorum's participants, which change from step to step)
    divisor: Callable[[], int] | None = None
    #: with ``collective``: called with the reason, instead of raising, when the status
    #: the collective summed reports a problem of another replica group's pass, or of this
    #: group's abandoned one (a torchft manager then drops the step)
    drop_step: Callable[[str], None] | None = None
    #: with ``collective``: whether this replica group sits out the pass's step (it heals:
    #: the collective sends zeros for it)
    sits_out: Callable[[], bool] | None = None
    #: the run's ``tribucket.trace.Tracer`` (None: tracing off, one check per bucket)
    tracer: Any = None


# ------------------------------------------------------------------ the per-gradient hook
def _no_reducer() -> None:
    return None


class GradHook:
    """The post-accumulate-grad hook of one parameter: it runs once per gradient, so the
    common case (a synchronised pass already under way, nothing to record) is done here:
    mark the gradient ready and count it down in its bucket.

    Like ``hookcall.HookRef``, it reaches the reducer only while attached, and a copy of the
    model (``deepcopy``, pickling) gets an inert hook. It holds the reducer weakly: the
    parameter keeps its hooks in a place the garbage collector does not look, so a strong
    reference would keep a dropped model's reducer (and its buffers) alive for good; the
    model keeps the reducer alive through its forward hooks instead.
    """

    __slots__ = ("ref", "index")

    def __init__(self, bw: Any, index: int):
        self.ref = _no_reducer if bw is None else weakref.ref(bw)
        self.index = index

    def __call__(self, param: torch.Tensor) -> None:
        bw = self.ref()
        if bw is None:
            return
        p = bw.pass_
        if p is not None and p.plain and not p.ready[self.index]:
            self.mark(p)
        else:
            bw.on_grad_ready(self.index)

    def mark(self, p: Pass) -> None:
        """Mark this parameter's gradient ready in pass ``p`` and count it down."""
        bw = self.ref()
        bucket, k = bw.slot[self.index]
        native = bw.native
        if native.on and native.native[bucket.index]:
            if native.mark(self.index):  # its count lives in C++ during this pass
                bucket.pending = 0
                bw.bucket_complete(p, bucket)
            return
        p.ready[self.index] = 1
        if bucket.t_first == 0:  # (traced: the bucket's first gradient)
            bucket.t_first = time.perf_counter_ns()
        if bucket.eager and bucket.index not in p.skip:  # (a skipped bucket is not packed:
            bucket.put(k, p.scale)  # its slot may be the parameter's .grad, lent as a view)
        bucket.pending -= 1
        if bucket.pending == 0:
            bw.bucket_complete(p, bucket)
        elif bucket.chunked and bucket.index == p.next_bucket and bucket.index not in p.skip:
            bucket.send_ready_chunks(p, bw.comm)  # (one this rank may skip waits for its end)

    def detach(self) -> None:
        self.ref = _no_reducer

    def __deepcopy__(self, memo: dict) -> "GradHook":
        return GradHook(None, self.index)

    def __reduce__(self):
        return (GradHook, (None, self.index))


# ------------------------------------------------------------------ in-flight handles
class _OwnAllreduce:
    """The reducer's averaging allreduce of one bucket, sent whole or in chunks: the result
    is the bucket's own buffer, reduced in place."""

    __slots__ = ("works", "result", "guard", "what", "iteration")

    def __init__(self, result: torch.Tensor, guard: CommGuard, what: str, iteration: int):
        self.works: list = []
        self.result, self.guard, self.what, self.iteration = result, guard, what, iteration

    def wait(self) -> torch.Tensor:
        for work in self.works:
            self.guard.wait(work, f"the allreduce of {self.what}", self.iteration)
        return self.result


class _HookResult:
    """A comm hook's future: its value, checked, is the bucket's new content."""

    __slots__ = ("future", "hook", "spec", "index", "guard", "what", "iteration")

    def __init__(self, future, hook, spec: Bucket, index: int, guard: CommGuard, what: str,
                 iteration: int):
        self.future, self.hook, self.spec, self.index = future, hook, spec, index
        self.guard, self.what, self.iteration = guard, what, iteration

    def wait(self) -> torch.Tensor:
        # bounded by timeout= (a Future has no timeout of its own), with the diagnosis
        return self.guard.wait_future(
            self.future, f"comm hook {hook_name(self.hook)} on {self.what}", self.iteration,
            own_code=self._checked)

    def _checked(self, value) -> torch.Tensor:
        return check_result(self.hook, self.index, self.spec, value)


class _SparseAllreduce:
    """The allreduce of a lone bucket's gradient: a sparse one's result is a new tensor, a
    dense (complex) one is reduced in place."""

    __slots__ = ("work", "guard", "what", "iteration", "dense")

    def __init__(self, work, guard: CommGuard, what: str, iteration: int,
                 dense: torch.Tensor | None = None):
        self.work, self.guard, self.what, self.iteration = work, guard, what, iteration
        self.dense = dense

    def wait(self) -> torch.Tensor:
        self.guard.wait(self.work, f"the allreduce of {self.what}", self.iteration)
        return self.work.result()[0] if self.dense is None else self.dense


def _futures_of(handle):
    """What a tracer times a bucket's collective by: its works or its hook's future."""
    if isinstance(handle, _OwnAllreduce):
        return list(handle.works)
    if isinstance(handle, _HookResult):
        return handle.future
    return getattr(handle, "work", handle)


# ------------------------------------------------------------------ buckets
class _Nothing:
    """The handle of a bucket that is not communicated in a pass."""

    @staticmethod
    def wait() -> None:
        return None


_NOTHING = _Nothing()


class _BucketBase:
    __slots__ = ("index", "spec", "params", "indices", "is_last", "state", "pending",
                 "handle", "t_launch", "targets_all", "tracer", "trace_rec", "t_first")

    def __init__(self, index: int, spec: Bucket, params: list[torch.Tensor], is_last: bool):
        self.index = index                   # position in reduction order
        self.spec = spec                     # the layout's bucket (sizes, offsets, dtype)
        self.params = params                 # its parameters, in layout order
        self.indices = list(spec.indices)    # their indices in the reducer's parameter list
        self.is_last = is_last               # the last bucket of an iteration
        self.targets_all = [True] * len(params)  # finish() targets when every param is used
        self.state = BucketState.PENDING     # see the module docstring
        self.pending = len(params)           # parameters whose gradient is not yet counted
        self.handle = None                   # the in-flight handle, wait() -> Tensor
        self.t_launch = 0.0                  # launch time (debug timings, logging_data)
        self.tracer = None                   # the tracer of its last launch (None: off)
        self.trace_rec = None                # its collective's trace record
        #: a traced pass: when its first gradient was counted in Python (perf_counter_ns;
        #: 0 until then); None: not traced (the native hooks stamp in C++)
        self.t_first: int | None = None

    def describe(self) -> str:
        return f"bucket {self.index} ({len(self.indices)} tensors, {self.spec.numel} elements)"

    def reset(self) -> None:
        """Back to PENDING for the next backward pass."""
        self.state = BucketState.PENDING
        self.pending = len(self.params)
        self.handle = None

    def skip(self) -> None:
        """Not communicated in this pass (every parameter unused,
        ``skip_all_reduce_unused_params``): ``wait()`` gives None, and ``finish(None, ...)``
        leaves the gradients as they are."""
        self.state, self.t_launch = BucketState.LAUNCHED, time.perf_counter()
        self.handle, self.tracer = _NOTHING, None

    def wait(self) -> torch.Tensor:
        """Wait for the in-flight communication; the reduced bucket."""
        assert self.state == BucketState.LAUNCHED, (self.index, self.state)
        tr = self.tracer
        if tr is None:
            result = self.handle.wait()
        else:
            rec = tr.begin(f"bucket{self.index}.wait", args={"bucket": self.index})
            result = self.handle.wait()
            tr.end(rec, completes=self.trace_rec)
        self.state = BucketState.DONE
        return result

    def wait_quietly(self) -> Exception | None:
        """Finish the in-flight communication if any (``close()``); the error, if one."""
        if self.state != BucketState.LAUNCHED:
            return None
        try:
            self.handle.wait()
        except Exception as e:  # noqa: BLE001 - reported by the caller
            return e
        finally:
            self.state = BucketState.DONE
        return None


class SparseBucket(_BucketBase):
    """A bucket of one sparse-gradient parameter (``Embedding(sparse=True)``), alone as DDP,
    or of one complex parameter, whose dense gradient is all-reduced as it is
    (``torch.distributed`` views complex tensors as real)."""

    __slots__ = ("name",)
    chunked = False
    eager = False
    mem = None

    def __init__(self, index: int, spec: Bucket, params: list, is_last: bool, name: str):
        super().__init__(index, spec, params, is_last)
        self.name = name

    def launch(self, p: Pass, comm: Comm, zeros: bool = False) -> None:
        param = self.params[0]
        g = None if zeros or not p.ready[self.indices[0]] else param.grad
        if param.is_complex() and (g is None or not g.is_sparse):
            dense = (g.contiguous() if g is not None else
                     torch.zeros_like(param, memory_format=torch.contiguous_format))
            self.communicate(p, comm, dense)
            return
        if g is None:
            g = torch.sparse_coo_tensor(torch.empty(1, 0, dtype=torch.long, device=param.device),
                                        torch.empty((0, *param.shape[1:]), dtype=param.dtype,
                                                    device=param.device), param.shape)
        if not g.is_sparse:
            raise RuntimeError(f"parameter {self.name!r} belongs to an embedding with "
                               "sparse=True but its gradient is dense")
        self.communicate(p, comm, g.coalesce())

    def communicate(self, p: Pass, comm: Comm, g: torch.Tensor) -> None:
        self.state, self.t_launch = BucketState.LAUNCHED, time.perf_counter()
        # (the dense size: each rank's rows are its own, and gloo's sparse allreduce pairs them)
        comm.guard.fingerprint("bucket", p.iteration, self.index, g.numel(), g.dtype)
        if comm.hook is None or comm.traits.builtin:
            g = g * p.scale if p.scale != 1.0 else g * (1.0 / comm.world_size)
            self.handle = _SparseAllreduce(dist.all_reduce(g, group=comm.guard.group,
                                                           async_op=True),
                                           comm.guard, self.describe(), p.iteration,
                                           None if g.is_sparse else g)
        else:
            gb = GradBucket(self.index, g, self.params, [0], is_last=self.is_last)
            self.handle = _HookResult(invoke(comm.hook, comm.hook_state, self.index, gb),
                                      comm.hook, self.spec, self.index, comm.guard,
                                      self.describe(), p.iteration)

    def finish(self, result: torch.Tensor, targets: list, all_targets: bool = False,
               stats: torch.Tensor | None = None) -> bool:
        if result is not None and targets[0]:
            param = self.params[0]
            if param.is_complex() and not result.is_complex():
                result = torch.view_as_complex(result)  # a hook's collective: viewed as real
            g = param.grad
            if (g is not None and g is not result and not g.is_sparse and not result.is_sparse
                    and g.shape == result.shape and g.dtype == result.dtype):
                g.copy_(result)  # the .grad tensor stays the gradient (a loop may keep it)
            else:
                param.grad = result
        return False  # no figures for a lone bucket (clipping falls back to torch)


class DenseBucket(_BucketBase):
    """A bucket of dense gradients: one flat buffer, one pack, one communication, one lend."""

    __slots__ = ("mem", "chunks", "eager", "chunked", "prefix", "chunk_next", "tail_writer",
                 "prev", "native_ok")

    def __init__(self, index: int, spec: Bucket, params: list, is_last: bool,
                 mem: BucketMemory, chunks: list[tuple[int, int]],
                 tail_writer: Callable | None = None, prev: "_BucketBase | None" = None):
        super().__init__(index, spec, params, is_last)
        self.mem = mem                       # its buffers and the .grad views lent from them
        self.eager = mem.eager               # gradients are copied in as they become ready
        self.chunks = chunks                 # (parameters before the cut, element end) each
        self.chunked = len(chunks) > 1       # sent in several allreduces
        self.native_ok = not (self.eager or self.chunked)  # counted by the native hooks
        self.tail_writer = tail_writer       # writes the status into the buffer's tail
        self.prev = prev                     # the bucket before (serialized hooks chain)
        self.prefix = 0                      # this pass: leading parameters all ready
        self.chunk_next = 0                  # this pass: next chunk to send

    def reset(self) -> None:
        super().reset()
        self.prefix = self.chunk_next = 0

    # ---------------------------------------------------------------- pack
    def put(self, k: int, scale: float) -> None:
        """Eager packing: copy parameter ``k``'s gradient into its slot now."""
        self.mem.put(k, self.params[k].grad, scale)

    def launch(self, p: Pass, comm: Comm, zeros: bool = False) -> None:
        """Pack the bucket (one fused call) and communicate it. A gradient missing in this
        pass goes as the parameter's ``.grad`` as it is (zeros where None), as DDP sends it:
        an output the loss left out under ``find_unused_parameters`` keeps its earlier
        gradient, and a rank that did not use a parameter another rank used contributes
        what it accumulated. ``zeros``: a Join shadow pass, the whole bucket is zeros."""
        tr = self.tracer = comm.tracer
        if tr is not None:
            args = {"bucket": self.index, "bytes": self.wire_bytes()}
            rec = tr.begin(f"bucket{self.index}.pack", args=args)
            stream = tr.on_device(self.params[0])
            dev = None if stream is None else tr.device_begin(
                f"bucket{self.index}.pack", args=args, stream=stream)
        if zeros:
            buf = self.mem.zeros()
        else:
            buf = self.mem.pack(list(map(_grad_of, self.params)), p.scale)
        if tr is not None:
            tr.end(rec)
            if dev is not None:
                tr.device_end(dev, stream)
        self.communicate(p, comm, buf)
        if tr is not None:
            futs = _futures_of(self.handle)
            self.trace_rec = tr.collective(f"bucket{self.index}.allreduce", futs, args)
            if dev is not None:
                tr.device_collective(f"bucket{self.index}.allreduce", futs, args,
                                     stream=stream)

    def wire_bytes(self) -> int:
        """The bucket's size on the wire (elements x the wire dtype's size)."""
        return self.spec.numel * self.mem.dtype.itemsize

    # ---------------------------------------------------------------- communicate
    def communicate(self, p: Pass, comm: Comm, buf: torch.Tensor) -> None:
        """Hand the packed bucket to the averaging allreduce (whole or its remaining chunks)
        or to the comm hook. Every rank calls this for bucket b after bucket b-1."""
        if self.state != BucketState.LAUNCHED:
            self.state, self.t_launch = BucketState.LAUNCHED, time.perf_counter()
        if comm.collective is not None and comm.traits.chunkable:  # e.g. a torchft Manager
            if self.tail_writer is not None:
                self.tail_writer(p, buf)  # the status goes to the other replica groups too
            body = self.mem.body(buf)
            p.bytes += body.numel() * body.element_size()
            self.handle = _HookResult(comm.collective(buf, body), comm.hook, self.spec,
                                      self.index, comm.guard, self.describe(), p.iteration)
            return
        if comm.traits.chunkable:  # an averaging allreduce the reducer sends itself
            while self.chunk_next < len(self.chunks):
                self._send_chunk(p, comm, buf)
            return
        p.bytes += buf.numel() * buf.element_size()
        comm.guard.fingerprint("bucket", p.iteration, self.index, buf.numel(), buf.dtype)
        gb = GradBucket(self.index, buf, self.params, self.spec.offsets, is_last=self.is_last,
                        prescaled=comm.traits.prescale, process_group=comm.guard.group)
        if comm.traits.serialize:
            fut = invoke_after(self._previous_future(), comm.hook, comm.hook_state,
                               self.index, gb)
        else:
            fut = invoke(comm.hook, comm.hook_state, self.index, gb)
        self.handle = _HookResult(fut, comm.hook, self.spec, self.index, comm.guard,
                                  self.describe(), p.iteration)

    def _previous_future(self):
        """The future of the last bucket before this one whose hook ran in this pass (a
        skipped bucket, ``skip_all_reduce_unused_params``, ran none), or None."""
        b = self.prev
        while b is not None and b.handle is _NOTHING:
            b = b.prev if isinstance(b, DenseBucket) else None
        return None if b is None else getattr(b.handle, "future", None)

    def send_ready_chunks(self, p: Pass, comm: Comm) -> None:
        """Send each chunk whose gradients are all in (never the last one: that goes when the
        bucket completes). Only for the first incomplete bucket, so the order is kept."""
        idx, k, ready = self.indices, self.prefix, p.ready
        while k < len(idx) and ready[idx[k]]:
            k += 1
        self.prefix = k
        chunks = self.chunks
        while self.chunk_next < len(chunks) - 1 and chunks[self.chunk_next][0] <= k:
            if self.state != BucketState.LAUNCHED:
                self.state, self.t_launch = BucketState.LAUNCHED, time.perf_counter()
            self._send_chunk(p, comm, self.mem.active)

    def _send_chunk(self, p: Pass, comm: Comm, buf: torch.Tensor) -> None:
        c = self.chunk_next
        self.chunk_next += 1
        lo = self.chunks[c - 1][1] if c else 0
        hi = self.chunks[c][1]
        n_status = 0
        if self.tail_writer is not None and c == len(self.chunks) - 1:
            n_status = self.tail_writer(p, buf)  # the status travels with the last chunk
        seg = buf.narrow(0, lo, hi + n_status - lo)
        p.bytes += (hi - lo) * seg.element_size()  # gradient bytes; the status is not counted
        comm.guard.fingerprint("bucket", p.iteration, self.index, seg.numel(), seg.dtype)
        if self.handle is None:
            self.handle = _OwnAllreduce(self.mem.body(buf), comm.guard, self.describe(),
                                        p.iteration)
        self.handle.works.append(dist.all_reduce(seg, group=comm.chunk_group, async_op=True))

    # ---------------------------------------------------------------- finish
    def finish(self, result: torch.Tensor, targets: list, all_targets: bool = False,
               stats: torch.Tensor | None = None) -> bool:
        """The averaged bucket becomes the gradients of the ``targets`` parameters (lent as
        views of the buffer, or unpacked into them): the one place a reduced bucket ends.
        ``all_targets``: every parameter of the bucket is a target. ``stats``: the epilogue's
        ``[sum of squares, flag]``, filled by an unpack kernel; returns whether it was.
        ``result`` None: the bucket was skipped, its gradients stay as they are."""
        if result is None:
            return False
        return self.mem.finish(result, targets, all_targets, stats)
