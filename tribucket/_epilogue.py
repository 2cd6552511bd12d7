"""The reducer's epilogue: per bucket, the 2-norm and the non-finite flag of the averaged
gradients, and who may use them (``reducer.grad_norm()``, ``reducer.found_inf``,
``tribucket.clip_grad_norm_``, ``tribucket.amp.GradScaler``).

Passes over gradient memory, per bucket and backward:

* the bucket is *unpacked* by the Triton kernel (CUDA, e.g. a fp16 wire decompressed into
  fp32 ``.grad``): the kernel adds each block's sum of squares and sets the flag while it
  writes the gradients: **zero extra passes**;
* the bucket is *lent* (its averaged buffer becomes the ``.grad`` views: no pass at all),
  or unpacked by the torch path (CPU): the statistics are computed the first time someone
  asks, with one vectorised read of the bucket's gradients (a norm per gradient, combined
  as ``clip_grad_norm_`` combines them: one fp32 sum over millions of elements of a flat
  bucket loses up to ~1e-3 of the norm): **one read**, only in iterations that use them, and
  it replaces the read that
  ``clip_grad_norm_`` (``_foreach_norm``) and ``GradScaler.unscale_`` (the inf check) would
  each make. Nobody asks: nothing is computed.

``found_inf`` needs no collective: every rank holds the same reduced values (an allreduce's
result), so every rank computes the same flag. A hook whose ranks end with different values
(``gossip_hook``) gives a per-rank flag, as ``GradScaler`` under DDP would.

Freshness: each bucket remembers which tensor each ``.grad`` was when the reducer finished
it (a weak reference: holding the gradient would keep the bucket's buffer from being reused)
and its version counter (bumped by every in-place write through the tensor or a view of it).
The flat-bucket fast paths of ``clip_grad_norm_`` and ``GradScaler`` run only while every
gradient is the same tensor with the same version; ``scale_`` multiplies the gradients and
keeps them fresh (the norm scales with the factor, the flag stays).

The version counter does not see every write: ``p.grad.data`` is an alias with a counter of
its own (so ``p.grad.data.mul_(0.5)`` leaves ``p.grad._version`` as it was), and neither do
numpy views. So by default the *figures* live for one call only: each user call (``grad_norm``,
``found_inf``, ``unscale_``, ``clip_grad_norm_``) reads the gradients once, as torch's clip
and GradScaler each do, and shares that read between the norm, the flag and the multiply.
``reuse_grad_figures=True`` keeps them across calls and takes the unpack kernel's (a read
saved per later user; sound only where gradients are never written through such aliases).
"""

from __future__ import annotations

import collections
import operator
import weakref
from typing import Iterable, Sequence

import torch

from ._shard import WIDE as _WIDE
from .kernels.pack import norms_fp32

_grad_of = operator.attrgetter("grad")

__all__ = ["Cover", "Epilogue", "cover"]

_LIVE: "weakref.WeakSet[Epilogue]" = weakref.WeakSet()  # epilogues of attached reducers


def _nonfinite(tensors: Sequence[torch.Tensor], norm: torch.Tensor) -> torch.Tensor:
    """The flag (0-dim float32) of ``tensors`` whose 2-norm is ``norm``.

    A finite norm means every value is finite. A non-finite one may also come from squares
    that overflow float32 (values above ~1.8e19): on the CPU (no device sync to pay) the
    flagged tensors are confirmed exactly with ``aminmax``, as the pack's check does; on
    other devices the norm's finiteness is the flag (no host sync).
    """
    flag = (~torch.isfinite(norm)).float()
    if norm.device.type != "cpu" or not bool(flag):
        return flag
    for t in tensors:
        if t.numel() == 0:
            continue
        lo, hi = torch.aminmax(t.reshape(-1))
        if not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))):
            return flag
    return flag.zero_()


def _real(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """``grads`` as real tensors of the same values: a sparse gradient's values, a complex
    one's real view (its 2-norm and finiteness are the complex tensor's); the list itself
    when every gradient is dense and real (the common case: one pass, no copy)."""
    if not any(g.is_sparse or g.is_complex() for g in grads):
        return grads
    out = [g.coalesce()._values() if g.is_sparse else g for g in grads]
    return [torch.view_as_real(g) if g.is_complex() else g for g in out]


def _norm_of(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """2-norm (0-dim float32) of the values of ``tensors``, as ``clip_grad_norm_`` forms it."""
    if len(tensors) == 1 and tensors[0].dtype != torch.float64:
        return torch.linalg.vector_norm(tensors[0], dtype=torch.float32)
    norms = norms_fp32(tensors)
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())


class _Record:
    """What one bucket's gradients were when the reducer finished them, and their figures.

    Two forms. A bucket lent whole: its ``.grad`` are the memory's cached views of one
    buffer (``views``), which share the buffer's version counter, so the record is that
    tuple and one version: O(1) to take, which matters because it is taken for every bucket
    of every backward whether or not anything reads it. Otherwise: a weak reference and a
    version per gradient."""

    __slots__ = ("views", "version", "refs", "versions", "norm", "flag", "pnorms")

    def __init__(self, grads: list | None, views: tuple | None = None):
        self.views = views
        self.version = views[0]._version if views else 0
        self.refs = self.versions = None
        if views is None:
            self.refs = [None if g is None else weakref.ref(g) for g in grads]
            self.versions = [0 if g is None else g._version for g in grads]
        self.norm: torch.Tensor | None = None  # 0-dim float32, computed on demand
        self.flag: torch.Tensor | None = None  # 0-dim float32: 1.0 = some value inf/NaN
        self.pnorms: dict | None = None  # id(parameter) -> its gradient's norm (clipping)

    def is_current(self, params: list[torch.Tensor]) -> bool:
        """Whether every parameter's ``.grad`` is still the tensor recorded, unmodified."""
        views = self.views
        if views is not None:
            return (all(map(operator.is_, map(_grad_of, params), views))
                    and (not views or views[0]._version == self.version))
        for q, ref, v in zip(params, self.refs, self.versions):
            g = q.grad
            if ref is None:
                if g is not None:
                    return False
            elif g is None or g is not ref() or g._version != v:
                return False
        return True

    def grad_count(self) -> int:
        """How many of the bucket's parameters have a gradient while the record is current
        (counted when asked: records are taken every backward, read only by the users)."""
        return len(self.views) if self.views is not None else sum(r is not None
                                                                   for r in self.refs)

    def update_versions(self, params: list[torch.Tensor]) -> None:
        """The recorded gradients were changed in place by the reducer (scaled): still the
        record's."""
        if self.views is not None:
            self.version = self.views[0]._version if self.views else 0
        else:
            self.versions = [0 if q.grad is None else q.grad._version for q in params]


class Epilogue:
    """The per-bucket figures of one reducer's current layout (see the module docstring).

    ``params[b]`` are the parameters of bucket ``b`` (layout order); ``mems[b]`` its
    ``BucketMemory`` (``None``: a sparse bucket, which has no figures: users of a sparse
    gradient fall back to torch).
    """

    def __init__(self, params: list[list[torch.Tensor]], mems: list, device: torch.device,
                 reuse: bool = False):
        self.params = params
        self.mems = mems
        self.device = device
        self.reuse = reuse  # figures kept across calls (see the module docstring)
        self.bucket_of = {id(q): b for b, ps in enumerate(params) for q in ps}
        self.records: list[_Record | None] = [None] * len(params)
        _LIVE.add(self)

    def close(self) -> None:
        _LIVE.discard(self)
        self.records = [None] * len(self.params)

    def begin_call(self) -> None:
        """A user call starts: unless figures are reused across calls, forget those an
        earlier call computed (the gradients may have been written through ``.data``)."""
        if self.reuse:
            return
        for rec in self.records:
            if rec is not None:
                rec.norm = rec.flag = rec.pnorms = None

    # -- written by the reducer ---------------------------------------------------------
    def reset(self) -> None:
        """A new synchronised backward started: the figures of the last one are void."""
        self.records = [None] * len(self.params)

    def fused_stats(self, b: int) -> torch.Tensor | None:
        """A zeroed ``[sum of squares, flag]`` for the unpack kernel of bucket ``b`` to fill,
        or None where the unpack does not compute them (torch path: computed on demand)."""
        mem = self.mems[b]
        if not self.reuse or mem is None or not getattr(mem.plan, "_use_triton", False):
            return None
        return torch.zeros(2, dtype=torch.float32, device=self.device)

    def finished(self, b: int, stats: torch.Tensor | None = None) -> None:
        """Bucket ``b``'s averaged gradients are in ``.grad`` (``stats``: what the unpack
        kernel computed, if it did)."""
        if self.mems[b] is None:
            self.records[b] = None
            return
        views = self.mems[b].lent_views()
        rec = self.records[b] = (_Record(None, views) if views is not None else
                                 _Record([q.grad for q in self.params[b]]))
        if stats is not None:
            rec.norm = stats[0].sqrt()
            rec.flag = (stats[1] > 0).float()

    # -- read by the users ----------------------------------------------------------------
    def fresh(self, b: int) -> _Record | None:
        """Bucket ``b``'s record if every gradient is still what the reducer finished."""
        rec = self.records[b]
        if rec is None or not rec.is_current(self.params[b]):
            return None
        return rec

    def _grads(self, b: int) -> list[torch.Tensor]:
        return [q.grad for q in self.params[b] if q.grad is not None]

    def _flat(self, b: int) -> torch.Tensor | None:
        """The bucket's averaged buffer when every gradient is a view of it (lent). Only for a
        fresh bucket: then a parameter without a gradient has a zero slot (unused on every
        rank: the pack wrote zeros); after a user's ``p.grad = None`` its slot is stale."""
        mem = self.mems[b]
        buf = mem.lent
        rec = self.records[b]
        if buf is not None and rec is not None and rec.views is not None:
            return mem.body(buf)  # (fresh, lent whole: every .grad is one of its views)
        if buf is None or not all(q.grad is None or mem.is_view(k, q.grad, buf)
                                  for k, q in enumerate(self.params[b])):
            return None
        return mem.body(buf)

    def figures(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm, flag)`` of bucket ``b``'s current gradients: the record's when fresh
        (computed now if the unpack did not), else computed from the gradients as they are."""
        rec = self.fresh(b) if self.mems[b] is not None else None
        if rec is not None and rec.norm is not None:
            return rec.norm, rec.flag
        tensors = _real(self._grads(b))
        norm = _norm_of(tensors).to(self.device)
        flag = _nonfinite(tensors, norm)
        if rec is not None:
            rec.norm, rec.flag = norm, flag
        return norm, flag

    def param_norms(self, b: int) -> dict | None:
        """``id(parameter) -> 2-norm`` of each gradient of fresh bucket ``b`` (one
        ``_foreach_norm``, as torch's clip computes them, kept until the gradients change),
        or None when the bucket is not fresh or holds a sparse gradient."""
        rec = self.fresh(b) if self.mems[b] is not None else None
        if rec is None:
            return None
        if rec.pnorms is None:
            qs = [q for q in self.params[b] if q.grad is not None]
            grads = [q.grad for q in qs]
            if any(g.is_sparse for g in grads):
                return None
            rec.pnorms = dict(zip(map(id, qs), norms_fp32(_real(grads)))) if grads else {}
        return rec.pnorms

    def found_inf(self, out: torch.Tensor) -> torch.Tensor:
        """Fill ``out`` (1 element) with 1.0 when a gradient of the reducer is inf/NaN."""
        self.begin_call()
        flags = [self.figures(b)[1] for b in range(len(self.params))]
        if not flags:
            return out.zero_()
        return out.copy_(torch.stack(flags).amax().reshape(out.shape))

    def grad_norm(self) -> torch.Tensor:
        """Total 2-norm of the reducer's gradients (0-dim float32; float64 when a gradient
        is float64 or complex128, taken as torch's ``get_total_norm`` takes it)."""
        self.begin_call()
        if any(ps[0].dtype in _WIDE for ps in self.params):
            # the figures are float32: coarser than torch's float64 norm of these gradients
            grads = _real([g for b in range(len(self.params)) for g in self._grads(b)])
            return torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(g).to(self.device) for g in grads]))
        norms = [self.figures(b)[0] for b in range(len(self.params))]
        if not norms:
            return torch.zeros((), device=self.device)
        return torch.linalg.vector_norm(torch.stack(norms))

    def covering(self, ids: set[int]) -> list[int] | None:
        """The buckets whose figures describe exactly the gradients of the parameters whose
        ``id`` is in ``ids`` (each with a gradient), all fresh; None when one is not this
        reducer's, or a bucket is only partly given, or not fresh.

        A fresh bucket's parameters with a gradient are the record's (``grad_count()``),
        so a bucket is given whole when that many of ``ids`` are its parameters."""
        counts = collections.Counter(map(self.bucket_of.get, ids))
        if None in counts:
            return None
        for b, n in counts.items():
            rec = self.fresh(b) if self.mems[b] is not None else None
            if rec is None or rec.grad_count() != n:
                return None
        return sorted(counts)

    def scale_(self, buckets: list[int], factor: torch.Tensor) -> None:
        """Multiply the gradients of fresh ``buckets`` by ``factor`` (0-dim tensor, or float)
        in place, one op per lent bucket, and keep their figures fresh."""
        recs = [self.fresh(b) for b in buckets]
        assert all(r is not None for r in recs), "scale_ is for fresh buckets (see covering)"
        flats = [self._flat(b) for b in buckets]
        loose = [g for b, flat in zip(buckets, flats) if flat is None for g in self._grads(b)]
        for flat in flats:
            if flat is not None:
                flat.mul_(factor)
        if loose:
            torch._foreach_mul_(loose, factor)
        # versions after every multiply: gradients of two buckets may share a storage (the
        # views of the buffer before a rebuild), whose version counter both writes bump
        for b, rec in zip(buckets, recs):
            rec.update_versions(self.params[b])
            rec.pnorms = None  # read again if asked: torch's clip reads the scaled values
            if rec.norm is not None:
                f = factor if isinstance(factor, torch.Tensor) else torch.tensor(factor)
                # |factor| <= 1 (unscaling, clipping) keeps finite values finite and the flag
                # valid; a larger or NaN one (a NaN norm's clip) may not: recompute on the
                # next read (on the CPU; elsewhere, without a host sync, a non-finite factor
                # sets the flag: it makes every value non-finite)
                f = f.abs().to(rec.norm)
                if f.device.type == "cpu":
                    if bool(f <= 1.0):
                        rec.norm = rec.norm * f
                    else:
                        rec.norm = rec.flag = None
                else:
                    rec.norm = rec.norm * f
                    rec.flag = torch.maximum(rec.flag, (~torch.isfinite(f)).to(rec.flag))


# ---------------------------------------------------------------------------------------
# Lookups across the live reducers (for clip_grad_norm_ and the GradScaler)
# ---------------------------------------------------------------------------------------
class Cover:
    """Fresh figures of the live reducers that describe exactly the gradients of a set of
    parameters: ``parts`` is ``[(epilogue, buckets)]``. Found once per call of
    ``clip_grad_norm_`` or ``unscale_`` (see :func:`cover`) and then used for the norm, the
    flag and the multiply."""

    __slots__ = ("parts",)

    def __init__(self, parts: list[tuple[Epilogue, list[int]]]):
        self.parts = parts

    def float32(self) -> bool:
        """Whether every bucket holds float32 gradients, whose norms torch takes in float32
        as these figures are (float64 ones in float64, fp16/bf16 ones in their own dtype)."""
        return all(epi.params[b][0].dtype == torch.float32
                   for epi, buckets in self.parts for b in buckets)

    def norm(self) -> torch.Tensor:
        """The total 2-norm of the gradients (0-dim float32)."""
        norms = [epi.figures(b)[0] for epi, buckets in self.parts for b in buckets]
        return torch.linalg.vector_norm(torch.stack(norms))

    def norm_of(self, params: list[torch.Tensor]) -> torch.Tensor | None:
        """The total 2-norm of ``params``' gradients formed as torch's ``clip_grad_norm_``
        forms it (one norm per gradient, stacked in ``params``' order, then the norm of
        those), so the clip coefficient is torch's to the bit; None if a bucket has no
        per-gradient norms to give (sparse)."""
        found: dict = {}
        for epi, buckets in self.parts:
            for b in buckets:
                norms = epi.param_norms(b)
                if norms is None:
                    return None
                found.update(norms)
        return torch.linalg.vector_norm(torch.stack([found[id(q)] for q in params]))

    def found_inf(self) -> torch.Tensor:
        """1.0/0.0 (0-dim float32): whether a gradient is inf/NaN."""
        flags = [epi.figures(b)[1] for epi, buckets in self.parts for b in buckets]
        return torch.stack(flags).amax()

    def scale_(self, factor) -> None:
        """Multiply the gradients by ``factor`` through the buckets (one op per lent
        bucket), keeping their figures fresh."""
        for epi, buckets in self.parts:
            epi.scale_(buckets, factor)

    def clip_with_norm_(self, max_norm: float, total: torch.Tensor) -> None:
        """``torch.nn.utils.clip_grads_with_norm_`` on the gradients: torch's coefficient
        ``min(max_norm / (total + 1e-6), 1)``, one multiply per lent bucket, skipped on the
        CPU when the coefficient is 1 (a multiply by 1 changes nothing; on other devices it
        runs, as in torch, to avoid a host sync). ``total`` may be larger than these
        gradients' own norm (expert-parallel parameters counted in it, clipped by the
        caller)."""
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        if total.device.type != "cpu" or not bool(coef >= 1.0):  # (a NaN norm: NaN)
            self.scale_(coef)


def cover(params: Iterable[torch.Tensor]) -> Cover | None:
    """The live reducers' figures for ``params``' gradients, or None.

    None unless every parameter with a gradient is owned by a live reducer, the buckets it
    belongs to are given whole, and their gradients are unchanged since the reducer finished
    them (or changed only through :meth:`Cover.scale_`). Then no pass over the gradients is
    needed beyond the epilogue's (see the module docstring).
    """
    given = [id(q) for q in params if q.grad is not None]
    rest = set(given)
    if not rest or len(rest) != len(given):  # (one named twice: torch multiplies it twice)
        return None
    parts = []
    for epi in list(_LIVE):
        mine = rest & epi.bucket_of.keys()
        if not mine:
            continue
        buckets = epi.covering(mine)
        if buckets is None:
            return None
        parts.append((epi, buckets))
        rest -= mine
    for epi, _ in parts:
        epi.begin_call()
    return Cover(parts) if not rest else None  # the rest: expert-parallel, ignored, ...
