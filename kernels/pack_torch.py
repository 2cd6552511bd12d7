"""The torch path of ``BucketPlan`` (what CPU tensors get): runs, gathers, scaled pieces.

Chosen by measurement on the 2-core CI box, 1 intra-op thread (``perf/bench_pack.py``):

* copy (same dtype, scale 1): ONE ``torch.cat(out=)`` per maximal gap-free run of tensors
  (memcpy inside). Sources are flattened in C++ by ``torch._chunk_cat`` when they are small
  (~1 us per tensor; a Python ``view(-1)`` costs ~1.4 us, ``torch._foreach_copy_`` ~0.6 us
  plus views shaped like each source) and by ``view(-1)`` + ``torch.cat`` when big
  (``_chunk_cat`` copies ~12% slower per byte); 1-D sources go straight to ``torch.cat``
  (~0.1 us per tensor). A per-tensor ``copy_`` into bucket slots runs at 0.4-0.8x of an
  aligned ``copy_``: slots are 16-byte aligned and this CPU's vector stores want 64.
  Result: the 25 MiB / 128-tensor bucket at ~0.9-1.0x a single-tensor ``copy_``, 1 000
  1-K vectors 4-5x faster than a per-tensor ``torch.mul(out=)`` loop (~9 us per call here).
* same-dtype scale: L2-sized groups of small tensors gathered as above then ``mul_``'d while
  in cache; one ``torch.mul(x, scale, out=)`` per big tensor, its head (up to the first
  64-byte boundary) written apart: ``torch.mul`` into a misaligned ``out=`` runs at half
  speed (25 MiB: 11.3 ms vs 5.5 ms).
* cast (to a narrower dtype), scaled or not: pieces of ``_CPU_CHUNK`` elements (gap-free
  runs of small tensors, or chunks of a big one) computed in an L2-resident float32 scratch
  piece (``torch.mul(x, scale, out=scratch)``), then one rounding ``copy_`` into ``out``
  (vectorised, alignment-insensitive). ``torch.mul`` with a float16 ``out=`` is not
  vectorised on CPU (~1.7x a float32 copy); this way a 25 MiB tensor packs to fp16 with
  scale at 1.1-1.2x a float32 copy, the 128-tensor bucket at 1.4-1.7x (more, smaller ops).
* found_inf: ``piece.sum()`` while the piece is in L2 (a sum is inf/NaN whenever an element
  is; ~10-20% extra), confirmed exactly with ``aminmax`` only for pieces whose sum is not
  finite (a sum of finite values may overflow). ``isfinite().all()`` or an inf-norm cost
  4-5x a copy on this CPU.

``_TorchPath`` holds ``BucketPlan``'s torch-path methods, mixed into the plan by
``kernels/pack.py``; the helpers below are what they call.
"""

from __future__ import annotations

import operator
from typing import Callable, Sequence

import torch

from .reference import _transform, compute_dtype

#: Elements per piece on the torch path: 128 Ki fp32 = 512 KiB, so a piece plus its float32
#: scratch (1 MiB) stays in the 2 MiB L2 of the CI CPU between the gather and the scale/cast
#: pass. Measured (25 MiB fp32 -> fp16 with scale, 1 thread): 64 KiB pieces 11.5 ms,
#: 256 KiB 7.3, 512 KiB 6.9, 1 MiB 7.2, 2 MiB 8.6.
_CPU_CHUNK = 1 << 17

#: Average elements per tensor above which a run is flattened in Python then ``torch.cat``'d
#: rather than ``torch._chunk_cat``'d (128-tensor 25 MiB bucket: 1.05x vs 0.89x of copy_).
_FLATTEN_MIN = 1 << 14

#: Pieces shorter than this are written in one op whatever their alignment.
_ALIGN_MIN = 1 << 12

_NoneType = type(None)
_HAS_CHUNK_CAT = hasattr(torch, "_chunk_cat")

#: Dtypes CUDA's ``_amp_foreach_non_finite_check_and_unscale_`` has kernels for (torch 2.11
#: on an H200 raised "not implemented for 'BFloat16'").
_AMP_CHECK_DTYPES = (torch.float32, torch.float16)

#: 16-bit floats copied as integers off the CPU: CUDA's ``_foreach_copy_`` goes through
#: float32 for them, which quiets signalling NaNs (seen on an H200, torch 2.11).
_BITS16 = {torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _copy_all(dsts: list, srcs: list, buffer: torch.Tensor) -> None:
    """``dst.copy_(src)`` for every pair, bit-exact when the dtypes match."""
    as_int = _BITS16.get(buffer.dtype)
    if (as_int is not None and buffer.device.type != "cpu"
            and all(d.dtype == buffer.dtype for d in dsts)):
        dsts = [d.view(as_int) for d in dsts]
        srcs = [s.view(as_int) for s in srcs]
    torch._foreach_copy_(dsts, srcs)


# ---------------------------------------------------------------------------------------
# Runs, gathers and views
# ---------------------------------------------------------------------------------------
def _getter(idx: Sequence[int]) -> Callable[[Sequence], tuple]:
    """A C-speed ``lambda ts: tuple(ts[i] for i in idx)``."""
    if len(idx) == 1:
        i = idx[0]
        return lambda ts: (ts[i],)
    if not idx:
        return lambda ts: ()
    return operator.itemgetter(*idx)


def _runs(sizes: Sequence[int], offsets: Sequence[int], limit: int | None, split: bool = True):
    """Group tensors (in index order, empty ones dropped) into gap-free runs.

    Each run is ``(idx, lo, hi, sub)``: tensors ``idx`` fill ``out[lo:hi]`` with no gap.
    With ``limit``, a run of several tensors holds at most ``limit`` elements and a tensor
    larger than ``limit`` is a run of its own; with ``split`` that tensor is cut into runs
    ``(idx=(i,), lo, hi, sub=(k, limit))``, its k-th chunk each.
    Example: sizes [3, 5, 2], offsets [0, 4, 9] -> ((0,), 0, 3), ((1, 2), 4, 11).
    """
    runs: list = []
    cur: list[int] = []
    lo = hi = 0

    def close():
        if cur:
            runs.append((tuple(cur), lo, hi, None))
            cur.clear()

    for i, (n, off) in enumerate(zip(sizes, offsets)):
        if n == 0:
            continue
        if limit is not None and n > limit:
            close()
            if not split:
                runs.append(((i,), off, off + n, None))
                continue
            for k, a in enumerate(range(0, n, limit)):
                runs.append(((i,), off + a, off + min(n, a + limit), (k, limit)))
            continue
        if cur and off == hi and (limit is None or hi + n - lo <= limit):
            cur.append(i)
            hi += n
        else:
            close()
            cur.append(i)
            lo, hi = off, off + n
    close()
    return runs


class _Run:
    """One run of ``_runs`` with its getter and a sticky fallback flag."""

    __slots__ = ("idx", "get", "lo", "hi", "sub", "use_cat")

    def __init__(self, idx, lo, hi, sub):
        self.idx, self.lo, self.hi, self.sub = idx, lo, hi, sub
        self.get = _getter(idx)
        # _chunk_cat copies ~12% slower per byte than cat's memcpy; a Python view(-1) costs
        # ~1.4 us: flatten in Python when the run's tensors average >= 16 Ki elements.
        # torch._chunk_cat also rejects mixed-dtype sources: such a run switches to cat from
        # then on (a bucket's dtypes are static).
        self.use_cat = not _HAS_CHUNK_CAT or hi - lo >= _FLATTEN_MIN * len(idx)


_dim = torch.Tensor.dim


def _gather(run: _Run, srcs: Sequence[torch.Tensor], out2: torch.Tensor,
            out1: torch.Tensor) -> None:
    """Concatenate ``srcs`` (any shapes) into ``out1`` (1-D) / ``out2`` (its (1, n) view).

    1-D sources: ``torch.cat`` (~0.1 us per tensor on top of the bytes). Small n-D sources:
    ``torch._chunk_cat``, which flattens in C++ (~1 us per tensor; a Python ``view(-1)`` is
    ~1.4 us). Big ones (``run.use_cat``), 0-dim ones (torch 2.13's ``_chunk_cat`` raises on
    them, or crashes when every source is 0-dim) and mixed dtypes: ``view(-1)`` + ``cat``.
    """
    dims = set(map(_dim, srcs))
    try:
        if dims == {1}:
            torch.cat(srcs, out=out1)
            return
        if not run.use_cat and 0 not in dims:
            try:
                torch._chunk_cat(srcs, 0, 1, out=out2)
                return
            except RuntimeError:  # mixed dtypes (or the overlap below): cat casts each source
                run.use_cat = True
        torch.cat([s.reshape(-1) for s in srcs], out=out1)
    except RuntimeError:
        # cat refuses sources that overlap `out`: a gradient that already is a view of its own
        # slot of the bucket. Copy one by one (copying a slot onto itself is a no-op).
        pos = 0
        for s in srcs:
            n = s.numel()
            out1[pos:pos + n].copy_(s.reshape(-1))
            pos += n


def _scaled(run: _Run, tensors, x, dst2: torch.Tensor, dst1: torch.Tensor, scale: float,
            head: int = 0) -> None:
    """``dst1 = piece * scale`` where dst1 has the compute dtype (exact until the multiply).

    The piece is ``x`` (a 1-D chunk of one big tensor, or a whole single tensor) or the
    run's tensors. ``head``: elements of dst1 before its first 64-byte boundary (see
    ``_aligned_head``); an out-of-place op writes them separately.
    """
    if x is not None:
        if x.dtype == dst1.dtype and scale != 1.0:
            op = lambda src, dst: torch.mul(src, scale, out=dst)  # noqa: E731 - one pass
        else:
            op = lambda src, dst: dst.copy_(src)  # noqa: E731 - a copy or an exact upcast
        if head:
            op(x[:head], dst1[:head])
            op(x[head:], dst1[head:])
        else:
            op(x, dst1)
        if x.dtype == dst1.dtype:
            return
    else:
        _gather(run, run.get(tensors), dst2, dst1)
    if scale != 1.0:
        dst1.mul_(scale)  # the piece is still in L2 (in place: alignment matters little)


def _aligned_head(v: torch.Tensor) -> int:
    """Elements before v's first 64-byte boundary, or 0 when v is small or aligned.

    An out-of-place elementwise op (``torch.mul(out=)``, ``copy_``) whose destination is not
    64-byte aligned runs at half speed on the CI CPU (25 MiB fp32 ``mul``: 11.3 ms vs 5.5 ms;
    bucket slots are only 16-byte aligned); writing the head apart aligns the rest.
    """
    head = (-v.data_ptr() % 64) // v.element_size()
    return head if v.numel() >= _ALIGN_MIN and v.data_ptr() % v.element_size() == 0 else 0


class _OutViews:
    """Views of one buffer, built once per (data_ptr, dtype, numel)."""

    __slots__ = ("buf", "lists", "tviews", "tshapes", "tpartial")

    def __init__(self, buf):
        self.buf = buf
        self.lists: dict = {}  # id(run list) -> views of each run (see `of`)
        self.tviews = None     # views shaped like the tensors (unpack)
        self.tshapes = None
        self.tpartial = False  # some tensor was None at the build: its view is flat

    def of(self, runs: list) -> list:
        """``[(2-D view, 1-D view, aligned head)]`` of each run."""
        v = self.lists.get(id(runs))
        if v is None:
            v = self.lists[id(runs)] = [
                (self.buf[r.lo:r.hi].view(1, -1), self.buf[r.lo:r.hi],
                 _aligned_head(self.buf[r.lo:r.hi])) for r in runs]
        return v


# ---------------------------------------------------------------------------------------
# The plan's torch path
# ---------------------------------------------------------------------------------------
class _TorchPath:
    """``BucketPlan``'s torch path, mixed into the plan (``kernels/pack.py``).

    Uses the plan's ``sizes``, ``offsets``, ``device`` and the state ``BucketPlan.__init__``
    builds for it: the runs ``_runs`` / ``_groups`` / ``_pieces`` (``_Run`` lists), the
    buffer views ``_views`` (an OrderedDict) and the scratch pieces ``_scratch``.
    """

    def _out_views(self, buf: torch.Tensor) -> _OutViews:
        key = (buf.data_ptr(), buf.dtype, buf.numel())
        v = self._views.get(key)
        if v is None:
            v = self._views[key] = _OutViews(buf)
            if len(self._views) > 4:
                self._views.popitem(last=False)
        return v

    def _scratch_views(self, dtype: torch.dtype) -> list:
        s = self._scratch.get(dtype)
        if s is None:
            buf = torch.empty(_CPU_CHUNK, dtype=dtype, device=self.device)
            s = self._scratch[dtype] = [(buf[:r.hi - r.lo].view(1, -1), buf[:r.hi - r.lo])
                                        for r in self._pieces]
        return s

    def _with_zeros(self, tensors, dtype):
        """``tensors`` with each None replaced by a (broadcast, allocation-free) zero source."""
        zero = torch.zeros((), dtype=dtype, device=self.device)
        return [zero.expand(n) if t is None else t for t, n in zip(tensors, self.sizes)]

    def _pack_torch(self, tensors, out, scale, found_inf, dtypes) -> None:
        if _NoneType in set(map(type, tensors)):
            first = next((t for t in tensors if t is not None), None)
            tensors = self._with_zeros(tensors, out.dtype if first is None else first.dtype)
        if not tensors:
            return
        if dtypes is None:
            dtypes = {tensors[0].dtype}
        views = self._out_views(out)
        o = out.dtype
        c = compute_dtype(o, *dtypes)
        if o != torch.float64 and len(dtypes) > 1 and torch.float64 in dtypes:
            # float64 beside narrower tensors: each tensor's arithmetic in its own compute
            # dtype (a float32 product stays float32's, as DDP's), one tensor at a time
            slots = [out.narrow(0, off, t.numel()) for t, off in zip(tensors, self.offsets)]
            for t, slot in zip(tensors, slots):
                slot.copy_(_transform(t, o, scale))
            if found_inf is not None and not all(bool(torch.isfinite(v).all()) for v in slots):
                found_inf.fill_(1.0)
            return
        if dtypes == {o} and scale == 1.0:
            # a copy: one cat per maximal run (cat copies with memcpy, which beats copy_
            # when the destination is not 64-byte aligned, as bucket slots are not). It
            # stays a copy with found_inf (a trip through the compute dtype would rewrite
            # NaN payloads); the check then reads the packed pieces once more.
            for run, (v2, v1, _) in zip(self._runs, views.of(self._runs)):
                _gather(run, run.get(tensors), v2, v1)
            if found_inf is not None:
                pieces = views.of(self._pieces)
                sums = [v1.sum() for _, v1, _ in pieces] if self.device.type == "cpu" else []
                self._flag_nonfinite(pieces, sums, found_inf)
            return
        if found_inf is None and dtypes == {o} == {c}:
            # a same-dtype scale: gather + mul_ per L2-sized group of small tensors, one
            # torch.mul(out=) per big tensor
            for run, (v2, v1, head) in zip(self._groups, views.of(self._groups)):
                x = tensors[run.idx[0]].reshape(-1) if len(run.idx) == 1 else None
                _scaled(run, tensors, x, v2, v1, scale, head)
            return
        scratch = self._scratch_views(c) if o != c else None
        parts: dict = {}
        sums = []
        pieces = views.of(self._pieces)
        for k, (run, (v2, v1, head)) in enumerate(zip(self._pieces, pieces)):
            if run.sub is None:
                x = None
            else:  # a chunk of one big tensor
                i = run.idx[0]
                chunks = parts.get(i)
                if chunks is None:
                    chunks = parts[i] = tensors[i].reshape(-1).split(run.sub[1])
                x = chunks[run.sub[0]]
            if o == c:  # out holds the compute dtype: gather in place, then scale in L2
                _scaled(run, tensors, x, v2, v1, scale, head)
            elif x is not None and scale == 1.0:  # a single rounding cast
                v1.copy_(x)
            else:  # compute in an L2-resident scratch piece, then one rounding copy_
                s2, s1 = scratch[k]
                _scaled(run, tensors, x, s2, s1, scale)
                v1.copy_(s1)
            if found_inf is not None and self.device.type == "cpu":
                sums.append(v1.sum())
        if found_inf is not None:
            self._flag_nonfinite(pieces, sums, found_inf)

    def _flag_nonfinite(self, pieces: list, sums, found_inf) -> None:
        if self.device.type != "cpu":  # no host sync
            vs = [v1 for _, v1, _ in pieces]
            if vs and vs[0].dtype in _AMP_CHECK_DTYPES:  # torch's AMP check (multiplies by 1)
                one = torch.ones((), device=self.device)
                torch._amp_foreach_non_finite_check_and_unscale_(vs, found_inf, one)
            elif vs:  # bfloat16: CUDA's AMP check has no kernel for it
                bad = torch.stack([v.isfinite().all() for v in vs]).logical_not().any()
                torch.maximum(found_inf, bad.to(found_inf.dtype), out=found_inf)
            return
        if not sums:
            return
        finite = torch.isfinite(torch.stack(sums))
        if bool(finite.all()):
            return
        # A sum of finite values can overflow: confirm on the flagged pieces only.
        for k in (~finite).nonzero().flatten().tolist():
            lo, hi = torch.aminmax(pieces[k][1])
            if not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))):
                found_inf.fill_(1.0)
                return

    def _tensor_views(self, views: _OutViews, tensors, check: bool) -> list:
        """Views of the buffer shaped like ``tensors``, cached with the buffer's views.

        Rebuilt when a checked call brings other shapes; unchecked calls trust the shapes of
        the last build (``_foreach_copy_`` raises if they no longer broadcast; shapes that do
        broadcast with equal numel have the same element order, so they are still right),
        unless a tensor was missing at that build (a parameter without a gradient then, with
        one now): those calls compare the shapes again.
        """
        shapes = None
        if check or views.tviews is None or views.tpartial:
            shapes = [None if t is None else t.shape for t in tensors]
        if views.tviews is None or (shapes is not None and shapes != views.tshapes):
            buf = views.buf
            views.tviews = [buf[o:o + n].view(n if sh is None else sh)
                            for sh, n, o in zip(shapes, self.sizes, self.offsets)]
            views.tshapes = shapes
            views.tpartial = None in shapes
        return views.tviews

    def _unpack_torch(self, buffer, tensors, scale, accumulate, dtypes, check) -> None:
        tv = self._tensor_views(self._out_views(buffer), tensors, check)
        if _NoneType in set(map(type, tensors)):
            keep = [i for i, t in enumerate(tensors) if t is not None]
            dsts, srcs = [tensors[i] for i in keep], [tv[i] for i in keep]
        else:
            dsts, srcs = list(tensors), tv
        if not dsts:
            return
        if dtypes is None and (scale != 1.0 or accumulate):
            dtypes = set(map(operator.attrgetter("dtype"), dsts))
        c = compute_dtype(buffer.dtype, *(dtypes or ()))
        if not accumulate and scale == 1.0:
            _copy_all(dsts, srcs, buffer)  # a copy, or one rounding cast
        elif dtypes == {c}:  # the destinations hold the compute dtype
            if accumulate and scale == 1.0:
                torch._foreach_add_(dsts, srcs)
            elif accumulate:
                # t + fl(x * s): two roundings (foreach_add_'s alpha= would fuse them)
                torch._foreach_add_(dsts, torch._foreach_mul(
                    srcs if buffer.dtype == c else [s.to(c) for s in srcs], scale))
            else:
                torch._foreach_copy_(dsts, srcs)  # exact: c holds every buffer value
                torch._foreach_mul_(dsts, scale)
        else:  # narrow destinations with arithmetic: one tensor at a time, each in its
            # own compute dtype (float32's for a float32 one beside a float64 one)
            for d, s in zip(dsts, srcs):
                y = s.to(compute_dtype(buffer.dtype, d.dtype)) * scale
                if accumulate:
                    y = d.to(y.dtype) + y
                d.copy_(y)
