"""The memory of one bucket: its flat buffer, and the ``.grad`` views lent out of it.

After the reduction, the averaged buffer is not copied back into the gradients: the
parameters' ``.grad`` become views into it (the buffer is *lent* to the gradients), which
saves one full pass over the bucket. What happens next depends on what the user does:

* ``zero_grad(set_to_none=True)`` (torch's default) drops the views; the buffer is then
  referenced by the reducer alone and the next pack writes into it (no allocation);
* ``zero_grad(set_to_none=False)`` zeroes the views in place and autograd accumulates the
  next gradients straight into the bucket: the next pack is an in-place scale, no copy;
* if the user keeps a reference to a gradient, the buffer stays theirs and the next pack
  gets a fresh buffer: the reducer never writes into memory a user may still be reading,
  except through the ``.grad`` tensors themselves, whose values DDP would also overwrite;
* if the user keeps the ``.grad`` tensors themselves across steps while they stay the
  gradients (``zero_grad(set_to_none=False)``, or gradients allocated by hand: a list a
  hand-written clip or a norm log reads), autograd accumulates into them and they are not
  views of this bucket: the average is then written into them, as DDP does, instead of
  lending the bucket (which would leave them holding this rank's own gradient). Whether a
  ``.grad`` is kept is read from its reference count (~0.1 us) where the reducer would
  point ``.grad`` elsewhere; a view taken of a ``.grad`` (``g[:1]``) does not count.

``gradient_as_bucket_view=True`` keeps DDP's contract instead: the bucket always backs the
``.grad`` views and is reused whatever the user holds.
"""

from __future__ import annotations

import operator
import sys

import torch

from ..layout import Bucket

__all__ = ["BucketMemory"]

_grad_of = operator.attrgetter("grad")


def _alone() -> int:
    """``sys.getrefcount(p.grad)`` of a gradient nothing else references: the call's
    argument and the reference the tensor keeps to its Python object."""
    p = torch.zeros(1, requires_grad=True)
    p.grad = torch.zeros(1)
    return sys.getrefcount(p.grad)


_ALONE = _alone()


def _use_count(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def memory_strides(p: torch.Tensor) -> tuple[int, ...] | None:
    """The strides of ``p`` when its slot holds it in memory order, as DDP's bucket does (a
    dense layout in a permuted order, such as channels_last or a transposed weight: DDP
    views its slot with the parameter's strides); None when the slot holds it in logical
    order (a contiguous parameter, or one with gaps between its elements)."""
    if p.is_contiguous():
        return None
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(p.stride(), p.shape) if n > 1):
        if stride != expected:
            return None
        expected *= size
    return tuple(p.stride())


def _in_order(g: torch.Tensor, strides: tuple[int, ...]) -> bool:
    """Whether ``g``'s elements lie in memory as a tensor of ``strides`` holds them."""
    return all(a == b for a, b, n in zip(g.stride(), strides, g.shape) if n > 1)


class BucketMemory:
    __slots__ = ("bucket", "params", "dtype", "plan", "always_view", "transfer", "active",
                 "lent", "eager", "_ptr_offsets", "_contiguous", "_gaps", "_base_count",
                 "_mode", "_copied", "_checked", "_checked_unpack", "tail", "_dense",
                 "_packed", "_views", "_views_of", "_views_count", "_whole", "_scale",
                 "_strides", "_lendable", "_kept")

    def __init__(self, bucket: Bucket, params: list[torch.Tensor], wire_dtype: torch.dtype,
                 plan, always_view: bool, eager: bool = False, tail: int = 0,
                 memory_order: bool = True):
        self.bucket = bucket             # layout of the bucket
        self.params = params             # its parameters, in layout order
        self.dtype = wire_dtype          # dtype of the flat buffer (the wire)
        self.plan = plan                 # kernels.BucketPlan: one-launch pack/unpack
        self.always_view = always_view   # gradient_as_bucket_view=True
        # the result can become the gradients only if it has their dtype
        self.transfer = all(p.dtype == wire_dtype for p in params)
        self.active: torch.Tensor | None = None  # buffer the pack writes / comm reduces
        self.lent: torch.Tensor | None = None    # buffer whose slices are the params' .grad
        item = torch.empty((), dtype=wire_dtype).element_size()
        self._ptr_offsets = [off * item for off in bucket.offsets]  # byte offset per param
        self._contiguous = [p.is_contiguous() for p in params]
        # per parameter: its strides when its slot holds it in memory order (channels_last,
        # transposed), else None (``memory_order=False``: every slot in logical order, as the
        # sharded optimizer's flat parameters are)
        self._strides = [memory_strides(p) if memory_order else None for p in params]
        # the slot, viewed with the parameter's strides, can become its .grad
        self._lendable = [c or s is not None for c, s in zip(self._contiguous, self._strides)]
        self._gaps = self._gap_index(bucket)  # padding positions to zero in a new buffer
        self._base_count = None            # storage use count of a buffer nobody else holds
        # eager: copy each gradient into its slot the moment it is ready (CPU: it is still in
        # cache, and the bucket is packed when its last gradient arrives); else pack the
        # whole bucket in one launch when it is complete (GPU: one kernel per bucket)
        self.eager = eager
        # extra elements after the bucket that travel with its allreduce (the reducer's
        # end-of-backward status rides on the last bucket instead of a collective of its own)
        self.tail = tail
        self._mode = None                  # this pass: None, "copy" (eager) or "inplace"
        self._copied = bytearray(len(params))  # this pass: slot already holds its gradient
        self._checked = self._checked_unpack = False  # the kernels validated our tensors once
        # every parameter contiguous and the slots back to back from 0: the whole bucket is
        # lent with one C++ call (unflatten_dense_tensors) instead of a view per parameter
        self._dense = all(self._contiguous) and self._gaps is None and not always_view
        self._packed = False  # this pass: packed by one plan call into a buffer no .grad views
        # the .grad views of the last buffer lent whole (dense case), kept across iterations:
        # lending the same buffer again re-points .grad at them instead of making new views
        # (a view costs ~3 us; re-pointing ~0.4 us). ``_views_count``: the buffer's storage
        # use count with only the reducer and these views holding it.
        self._views: tuple | None = None
        self._views_of: torch.Tensor | None = None
        self._views_count = 0
        self._whole = False  # the last finish lent the buffer whole: .grad are _views
        self._scale: tuple[float, torch.Tensor] | None = None  # (factor, as 0-dim float32)
        self._kept = False  # this pass: a .grad the user keeps was left in place (eager)

    @staticmethod
    def _gap_index(bucket: Bucket) -> torch.Tensor | None:
        gaps, pos = [], 0
        for off, size in zip(bucket.offsets, bucket.sizes):
            gaps.extend(range(pos, off))
            pos = off + size
        gaps.extend(range(pos, bucket.numel))
        if not gaps:
            return None
        return torch.tensor(gaps, dtype=torch.long, device=bucket.device)

    def chunk_bounds(self, chunk_mb: float | None, chunkable: bool) -> list[tuple[int, int]]:
        """Where this bucket's allreduce is cut into chunks of about ``chunk_mb`` MiB (at
        parameter boundaries): ``(parameters before the cut, element end)`` per chunk.
        ``None``/``0``, or gradients packed only when the bucket completes: one piece."""
        bucket = self.bucket
        mb = chunk_mb
        if not mb or not self.eager or not chunkable:  # early chunks need eager packing
            return [(len(bucket.indices), bucket.numel)]
        limit = int(mb * 2**20) // torch.empty((), dtype=self.dtype).element_size()
        cuts, start = [], 0
        for k, (off, size) in enumerate(zip(bucket.offsets, bucket.sizes)):
            if off + size - start >= limit and k < len(bucket.indices) - 1:
                cuts.append((k + 1, off + size))
                start = off + size
        cuts.append((len(bucket.indices), bucket.numel))
        return cuts

    def capacity_bytes(self) -> int:
        """Bytes of the bucket's buffer in its wire dtype."""
        return (self.bucket.numel + self.tail) * torch.empty((), dtype=self.dtype).element_size()

    def body(self, buf: torch.Tensor) -> torch.Tensor:
        """The bucket part of a buffer (without the tail)."""
        return buf if not self.tail else buf.narrow(0, 0, self.bucket.numel)

    def _new_buffer(self) -> torch.Tensor:
        buf = torch.empty(self.bucket.numel + self.tail, dtype=self.dtype,
                          device=self.bucket.device)
        if self._gaps is not None:
            buf.index_fill_(0, self._gaps, 0)  # padding is summed too: keep it finite
        if self.tail:
            buf.narrow(0, self.bucket.numel, self.tail).zero_()  # shard padding, status
        if self._base_count is None:
            self._base_count = _use_count(buf)
        return buf

    def _is_free(self, buf: torch.Tensor) -> bool:
        if buf is self._views_of:
            # nothing holds a view of it but our cached ones, and nobody holds those (a
            # cached view referenced from Python by the list and getrefcount's argument only)
            return (_use_count(buf) <= self._views_count
                    and max(map(sys.getrefcount, self._views)) <= 2)
        return self._base_count is not None and _use_count(buf) <= self._base_count

    def _whole_views(self, buf: torch.Tensor) -> tuple:
        """The .grad views of a whole dense buffer: the cached ones if they view ``buf``."""
        if buf is not self._views_of:
            self._views = self._views_of = None  # drop the old views before counting
            self.plan.forget(self.body(buf))
            before = _use_count(buf)
            views = tuple(torch._C._nn.unflatten_dense_tensors(self.body(buf), self.params))
            self._views, self._views_of = views, buf
            # the buffer alone plus what the views add; not the count now, which includes
            # references an in-flight allreduce still holds
            self._views_count = self._base_count + _use_count(buf) - before
        return self._views

    def _factor(self, scale: float) -> torch.Tensor:
        """``scale`` as a 0-dim float32 tensor on the bucket's device (cached)."""
        cached = self._scale
        if cached is None or cached[0] != scale:
            cached = self._scale = (scale, torch.tensor(scale, dtype=torch.float32,
                                                        device=self.bucket.device))
        return cached[1]

    def lent_views(self) -> tuple | None:
        """The ``.grad`` of every parameter, as the last :meth:`finish` set them, when it lent
        the buffer whole (one view per parameter, in order; they share the buffer's version
        counter); else None."""
        if self._whole and self.lent is not None and self.lent is self._views_of:
            return self._views
        return None

    def slot(self, buf: torch.Tensor, k: int) -> torch.Tensor:
        """Parameter ``k``'s slot of ``buf`` in its shape (with its strides when the slot
        holds it in memory order)."""
        off, strides = self.bucket.offsets[k], self._strides[k]
        if strides is None:
            return buf.narrow(0, off, self.bucket.sizes[k]).view(self.params[k].shape)
        if buf.stride(0) != 1:
            buf = buf.contiguous()  # (a hook's result with a step)
        return buf.as_strided(self.params[k].shape, strides, buf.storage_offset() + off)

    def _flat(self, k: int, g: torch.Tensor) -> torch.Tensor:
        """Gradient ``g`` of parameter ``k`` as the 1-D contiguous run its slot holds: a
        view of ``g`` when its elements already lie in that order, else a copy."""
        strides = self._strides[k]
        if strides is None:
            return g if g.is_contiguous() else g.contiguous()
        if not _in_order(g, strides):
            g = torch.empty_strided(g.shape, strides, dtype=g.dtype,
                                    device=g.device).copy_(g)
        return g.as_strided((g.numel(),), (1,))

    def is_view(self, k: int, g: torch.Tensor | None, buf: torch.Tensor | None) -> bool:
        """Whether gradient ``g`` of parameter ``k`` is its slice of ``buf``."""
        return (g is not None and buf is not None and g.dtype == buf.dtype
                and g.data_ptr() == buf.data_ptr() + self._ptr_offsets[k])

    def _held(self, k: int, ours: int) -> bool:
        """Whether parameter ``k``'s ``.grad`` is referenced beyond the parameter, this
        bucket's cached view of it and the ``ours`` references of the caller: kept by the
        user across steps (see the module docstring)."""
        g = self.params[k].grad
        if g is None:
            return False
        views = self._views
        mine = ours + 1 + (views is not None and views[k] is g)  # (+1: g)
        return sys.getrefcount(g) > _ALONE + mine

    def _any_held(self) -> bool:
        """Whether the user keeps any of the bucket's ``.grad`` (:meth:`_held`)."""
        return any(self._held(k, 0) for k in range(len(self.params)))

    def _acquire(self) -> torch.Tensor:
        """The buffer this pass packs into: the lent one if nothing else holds it."""
        buf = self.active
        if buf is None:
            lent = self.lent
            if lent is not None and (self.always_view or self._is_free(lent)):
                buf, self.lent = lent, None
            else:
                buf = self._new_buffer()
            self.active = buf
        return buf

    def put(self, k: int, g: torch.Tensor | None, scale: float) -> None:
        """Eager mode: put gradient ``k`` (times ``scale``; ``None``: zeros) in its slot now."""
        if self._mode is None:
            if self.transfer and self.lent is not None and self.is_view(k, g, self.lent):
                # autograd accumulated into the bucket (zero_grad(set_to_none=False))
                self.active, self.lent, self._mode = self.lent, None, "inplace"
            else:
                self._acquire()
                self._mode = "copy"
        buf = self.active
        if g is None or self.is_view(k, g, buf):
            view = buf.narrow(0, self.bucket.offsets[k], self.bucket.sizes[k])
            if g is None:
                view.zero_()
            elif scale != 1.0:
                view.mul_(scale)
        else:
            # the slot in the gradient's shape: the buffer's cached .grad views when the
            # bucket is dense (one C++ call per buffer instead of two views per gradient)
            slot = self._whole_views(buf)[k] if self._dense else self.slot(buf, k)
            if scale == 1.0 and g.dtype == buf.dtype:
                slot.copy_(g)
            elif g.dtype == buf.dtype == torch.float32:
                # a 0-dim float32 factor: the same products as a Python float, ~2 us less
                # per call (no wrapped double scalar)
                torch.mul(g, self._factor(scale), out=slot)
            else:
                torch.mul(g, scale, out=slot)  # fp32 math, one rounding cast
            if not (self.transfer and self._lendable[k]):
                pass
            elif not self.always_view and self._held(k, 1):  # (1: the argument g) the
                self._kept = True  # user keeps it: left in place, the average copied back
            else:
                # point .grad at its slot now, as DDP does: autograd's tensor is freed at once
                # and its memory is reused (still in cache) by the next gradient
                self.params[k].grad = slot
        self._copied[k] = 1

    def pack(self, grads: list, scale: float) -> torch.Tensor:
        """Put the bucket's gradients (``None``: zeros) into the buffer, times ``scale``.
        (Whether a value is inf/NaN is read after the sum, by the epilogue: a pack-time
        check would miss a sum that overflows.)"""
        if self._mode is not None:
            # eager: the ready slots are filled; put the rest (zeros for missing gradients)
            for k, g in enumerate(grads):
                if not self._copied[k]:
                    self.put(k, g, scale)
            self._mode = None
            self._copied = bytearray(len(self.params))
            return self.active
        self._mode = None
        lent = self.lent
        if lent is not None and self.transfer and all(
                g is None or self.is_view(k, g, lent) for k, g in enumerate(grads)):
            # autograd accumulated straight into the bucket: scale in place, no copy
            self.lent, self.active = None, lent
            for k, g in enumerate(grads):
                if g is None:
                    lent.narrow(0, self.bucket.offsets[k], self.bucket.sizes[k]).zero_()
            if scale != 1.0:
                lent.mul_(scale)
            return lent
        buf = self._acquire()
        if not self._dense:
            # the kernels take dense, contiguous sources: a channels_last gradient in the
            # parameter's layout is read as it lies (its slot holds it in memory order), one
            # in another layout (a contiguous .grad set by hand) through a copy in that order
            grads = [g if g is None or (g.is_contiguous() and self._strides[k] is None)
                     else self._flat(k, g) for k, g in enumerate(grads)]
        self._packed = True
        self.plan.pack(grads, self.body(buf), scale=scale, check=not self._checked)
        self._checked = True  # same tensors every iteration: validate them once
        return buf

    def finish(self, result: torch.Tensor, targets: list[bool], all_targets: bool = False,
               stats: torch.Tensor | None = None) -> bool:
        """Make ``result`` (the reduced bucket) the gradients of the ``targets`` params
        (``all_targets``: every parameter is a target).

        ``stats`` (``[sum of squares, non-finite flag]``, float32): filled by the unpack
        kernel when the result is unpacked (not lent); returns whether it was filled.
        """
        buf = self.active
        packed, self._packed = self._packed, False
        kept, self._kept = self._kept, False
        self._whole = False
        if self.transfer and buf is not None and result.data_ptr() == buf.data_ptr() \
                and result.dtype == buf.dtype:
            # lent whole: a buffer packed in one call (its cached views become .grad in one
            # loop), or one whose every .grad already is its cached view (copied in as each
            # gradient arrived, or accumulated there by autograd)
            if all_targets and self._dense and not kept and (packed or (
                    buf is self._views_of and all(
                        map(operator.is_, map(_grad_of, self.params), self._views)))):
                self.plan.forget(self.body(buf))
                if packed and not self._any_held():
                    for q, v in zip(self.params, self._whole_views(buf)):
                        q.grad = v
                    self.lent, self.active, self._whole = buf, None, True
                    return False
                if not packed:
                    self.lent, self.active, self._whole = buf, None, True
                    return False
            for k, q in enumerate(self.params):
                if not targets[k]:
                    continue  # unused on every rank: .grad is left as it was
                g = q.grad
                if self.is_view(k, g, buf):
                    continue
                view = self.slot(buf, k)
                if g is not None and not self.always_view and self._held(k, 1):  # (1: g)
                    g.copy_(view)  # the user's tensor stays the gradient (DDP's contract)
                elif self._lendable[k] or self.always_view:
                    q.grad = view
                elif g is None:
                    q.grad = view.clone(memory_format=torch.preserve_format)
                else:
                    g.copy_(view)
            self.lent, self.active = buf, None
            # the plan caches views of the buffers it packs into: drop them, so the storage
            # use count tells whether anything but the reducer still holds the buffer
            self.plan.forget(self.body(buf))
            return False
        if self.always_view and buf is not None and result.numel() == self.bucket.numel:
            self.body(buf).copy_(result)  # a hook returned another tensor: the bucket backs .grad
            return self.finish(buf, targets, all_targets)
        grads, strided = [], []
        for k, q in enumerate(self.params):
            g = q.grad if targets[k] else None
            if targets[k] and g is None:
                # used on another rank only: receives the average
                g = q.grad = torch.empty_like(q, memory_format=torch.preserve_format)
            s = self._strides[k]
            if g is not None and (s is not None or not g.is_contiguous()):
                if s is not None and _in_order(g, s):
                    g = g.as_strided((g.numel(),), (1,))  # in its slot's order: written as is
                else:
                    strided.append((g, k))  # unpacked through a copy
                    g = None
            grads.append(g)
        if strided:
            stats = None  # some gradients are written apart: the figures are read later
        self.plan.unpack(self.body(result) if result.numel() != self.bucket.numel else result,
                         grads, check=not self._checked_unpack, stats=stats)
        self._checked_unpack = True
        for g, k in strided:
            g.copy_(self.slot(result, k))
        return stats is not None

    def zeros(self) -> torch.Tensor:
        """The buffer this pass sends, all zeros (a Join shadow pass)."""
        buf = self.active
        if buf is None:
            buf = self.active = self._new_buffer()
        buf.zero_()
        return buf

    def reset(self) -> None:
        self.active = self.lent = self._views = self._views_of = None
        self._whole = self._kept = False
