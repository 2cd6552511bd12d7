"""Pack a bucket's tensors into one flat buffer, and unpack it back: one launch per bucket.

Three layers, as in every kernel file here:

* ``_pack_kernel`` / ``_unpack_kernel`` (``@triton.jit``): one program copies one block of
  one tensor; a block->tensor map tells it which, so a bucket of any number of tensors is a
  single launch.
* the launchers ``pack`` / ``unpack`` and ``BucketPlan``: validate, pick a backend, build the
  tables once per layout, launch.
* (no autograd layer: gradients are what these kernels move, nothing differentiates them.)

The value contract (scale, cast, rounding, found_inf) is written down in
``kernels/reference.py``; every backend equals those references.

Backends (``backend=`` on ``pack``/``unpack``/``BucketPlan``)
--------------------------------------------------------------
* ``"auto"`` (default): Triton for CUDA tensors when triton is installed, the torch path
  otherwise (CPU tensors always take the torch path).
* ``"triton"``: force the Triton kernels. On CPU tensors this needs the Triton interpreter:
  ``TRITON_INTERPRET=1`` in the environment before this module is imported (the tests do
  this). Pairs Triton does not cover (scaling float64, copying 16-byte dtypes such as
  complex128) fall back to the torch path.
* ``"torch"``: the torch path on any device.

The torch path (what CPU tensors get)
-------------------------------------
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

Caching (per plan): the layout tables, views of ``out`` keyed on
``(out.data_ptr(), out.dtype, out.numel())`` (the last 4 buffers), the scratch piece, and on
CUDA the device pointer table keyed on the tuple of source ``data_ptr()`` values. A plan is
not thread-safe: use one plan from one thread at a time (the functional API keeps one plan
cache per thread).
"""

from __future__ import annotations

import operator
import threading
from collections import OrderedDict
from typing import Callable, Sequence

import torch

from .reference import FLOATING, check_value_pair, compute_dtype, is_copy

try:  # triton is optional: the torch path never needs it, and importing tribucket must not
    import triton
    import triton.language as tl

    _TRITON_ERROR: BaseException | None = None
except Exception as e:  # noqa: BLE001 - a broken triton install must not break import tribucket
    triton = None
    tl = None
    _TRITON_ERROR = e

__all__ = ["BucketPlan", "pack", "unpack", "BACKENDS", "BLOCK", "triton_available"]

BACKENDS = ("auto", "triton", "torch")

#: Elements per Triton program. 4096 fp32 = 16 KiB read + 16 KiB written per program: with
#: 4 warps that is 32 elements (eight 16-byte vectors) per thread, enough bytes in flight to
#: saturate HBM for a pure copy, while a tiny tensor (a bias of 10 elements) wastes at most
#: one mostly-masked program. Tables are int64 so no index arithmetic overflows at 2**31.
BLOCK = 4096
_NUM_WARPS = 4

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


def triton_available() -> bool:
    """Whether triton imported (the Triton backend can run)."""
    return triton is not None


# ---------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------
def _jit(fn):
    return triton.jit(fn) if triton is not None else fn


@_jit
def _f32_to_bf16_rne(v):
    """float32 -> bfloat16, round to nearest-even, with integer ops on the bit pattern.

    The Triton 3.9 interpreter's own ``.to(tl.bfloat16)`` truncates; this gives the same bits
    as ``Tensor.to(torch.bfloat16)`` on every backend (NaN -> a quiet NaN of the same sign).
    E.g. 1.00390625 (0x3F808000, exactly half-way) -> 0x3F80 (ties to the even 1.0).
    """
    bits = v.to(tl.uint32, bitcast=True)
    lsb = (bits >> 16) & 1
    rounded = (bits + (lsb + 0x7FFF)) >> 16  # wraps only for NaN patterns, replaced below
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    out = tl.where(is_nan, (bits >> 16) | 0x0040, rounded)
    return out.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@_jit
def _cast(v, DST: tl.constexpr):
    """float32 -> DST with round-to-nearest-even on every backend."""
    if DST == tl.bfloat16:
        return _f32_to_bf16_rne(v)
    else:
        return v.to(DST)


@_jit
def _this_block(ptrs, sizes, offsets, block_tensor, block_start, BLOCK: tl.constexpr):
    """This program's element indices (int64, inside its tensor) and its tensor's size,
    bucket offset and address: the block->tensor map lookup both kernels start with."""
    pid = tl.program_id(0).to(tl.int64)
    t = tl.load(block_tensor + pid).to(tl.int64)
    idx = tl.load(block_start + pid) + tl.arange(0, BLOCK).to(tl.int64)
    return idx, tl.load(sizes + t), tl.load(offsets + t), tl.load(ptrs + t)


@_jit
def _pack_kernel(
    src_ptrs,       # *int64 [T]: data_ptr() of each source tensor; 0 = zero-fill its slice
    sizes,          # *int64 [T]: elements of each source
    offsets,        # *int64 [T]: element offset of each source in `out`
    block_tensor,   # *int32 [NB]: which tensor program b copies
    block_start,    # *int64 [NB]: first element (inside that tensor) program b copies
    out,            # *DST [numel]: the flat bucket
    found_inf,      # *fp32 [1]: set to 1.0 when a stored value is inf/NaN (used if CHECK)
    scale,          # fp32: multiplier (unused if COPY)
    SRC: tl.constexpr,    # element type behind src_ptrs
    DST: tl.constexpr,    # element type of out
    COPY: tl.constexpr,   # store the loaded bits unchanged (SRC == DST, scale 1)
    CHECK: tl.constexpr,  # update found_inf
    BLOCK: tl.constexpr,
):
    """out[offsets[t] + i] = cast(src_t[i] * scale) for every tensor t, one block per program.

    Example: tensors of 3 and 5 elements at offsets [0, 4], BLOCK = 4 -> programs
    (t=0, start=0), (t=1, start=0), (t=1, start=4) and the bucket ``[a0 a1 a2 _ b0 .. b4]``;
    the gap ``_`` is never written.

    Bytes: reads sum(n_t) * SRC bytes, writes sum(n_t) * DST bytes (+ 12 per program and
    24 per tensor of table reads).
    """
    idx, n, dst_off, addr = _this_block(src_ptrs, sizes, offsets, block_tensor, block_start, BLOCK)
    src = addr.to(tl.pointer_type(SRC))
    mask = idx < n
    present = idx < tl.where(addr != 0, n, 0)  # a null source reads as zeros
    x = tl.load(src + idx, mask=present, other=0)
    if COPY:
        y = x
    else:
        y = _cast(x.to(tl.float32) * scale, DST)
    tl.store(out + dst_off + idx, y, mask=mask)
    if CHECK:
        if DST == tl.float64:
            yf = y
        else:
            yf = y.to(tl.float32)  # exact: inf stays inf, NaN stays NaN
        nonfinite = (tl.abs(yf) == float("inf")) | (yf != yf)
        if tl.max(nonfinite.to(tl.int32), axis=0) > 0:
            tl.store(found_inf, 1.0)  # every writer stores 1.0: the race is benign


@_jit
def _unpack_kernel(
    dst_ptrs,       # *int64 [T]: data_ptr() of each destination tensor; 0 = skip it
    sizes,          # *int64 [T]: elements of each destination
    offsets,        # *int64 [T]: element offset of each destination in `buffer`
    block_tensor,   # *int32 [NB]: which tensor program b writes
    block_start,    # *int64 [NB]: first element (inside that tensor) program b writes
    buffer,         # *BUF [numel]: the flat bucket
    scale,          # fp32: multiplier (unused if COPY)
    DST: tl.constexpr,         # element type behind dst_ptrs
    COPY: tl.constexpr,        # store the loaded bits unchanged (BUF == DST, scale 1)
    ACCUMULATE: tl.constexpr,  # dst = cast(dst + buffer * scale) instead of cast(buffer * scale)
    BLOCK: tl.constexpr,
):
    """dst_t[i] = cast(buffer[offsets[t] + i] * scale) (+ dst_t[i] if ACCUMULATE).

    Example: bucket ``[a0 a1 a2 _ b0 .. b4]``, offsets [0, 4] -> tensor 0 gets a0..a2 and
    tensor 1 gets b0..b4; the gap is never read.

    Bytes: reads sum(n_t) * BUF bytes (+ sum(n_t) * DST if ACCUMULATE), writes
    sum(n_t) * DST bytes.
    """
    idx, n, src_off, addr = _this_block(dst_ptrs, sizes, offsets, block_tensor, block_start, BLOCK)
    dst = addr.to(tl.pointer_type(DST))
    mask = idx < tl.where(addr != 0, n, 0)  # a null destination is skipped
    x = tl.load(buffer + src_off + idx, mask=mask, other=0)
    if COPY:
        y = x
    else:
        v = x.to(tl.float32) * scale
        if ACCUMULATE:
            # the product is rounded to fp32 before the add (enable_fp_fusion=False below)
            v = tl.load(dst + idx, mask=mask, other=0).to(tl.float32) + v
        y = _cast(v, DST)
    tl.store(dst + idx, y, mask=mask)


# ---------------------------------------------------------------------------------------
# Static tables
# ---------------------------------------------------------------------------------------
def _block_map(sizes: Sequence[int], block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block_tensor int32 [NB], block_start int64 [NB])`` on the CPU, in int64 arithmetic.

    Example: sizes [3, 5], block 4 -> block_tensor [0, 1, 1], block_start [0, 0, 4].
    """
    n = torch.tensor(list(sizes), dtype=torch.int64)
    nblocks = (n + block - 1) // block
    block_tensor = torch.repeat_interleave(torch.arange(len(n), dtype=torch.int64), nblocks)
    first = torch.cumsum(nblocks, 0) - nblocks
    block_start = (torch.arange(len(block_tensor), dtype=torch.int64) - first[block_tensor]) * block
    return block_tensor.to(torch.int32), block_start


class _TritonTables:
    """Device tables for the tensors ``idx`` of a plan (all of them, or one dtype's)."""

    def __init__(self, idx: tuple[int, ...], sizes: Sequence[int], offsets: Sequence[int],
                 device: torch.device):
        self.idx = idx
        self.getter = _getter(idx)
        sz = [sizes[i] for i in idx]
        self.sizes = torch.tensor(sz, dtype=torch.int64, device=device)
        self.offsets = torch.tensor([offsets[i] for i in idx], dtype=torch.int64, device=device)
        bt, bs = _block_map(sz, BLOCK)
        self.block_tensor = bt.to(device)
        self.block_start = bs.to(device)
        self.nblocks = len(bt)
        self.device = device
        self._ptr_key: tuple[int, ...] | None = None
        self._ptrs: torch.Tensor | None = None

    def pointers(self, tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """The int64 pointer table, rebuilt only when the data_ptr()s change."""
        key = tuple([0 if t is None else t.data_ptr() for t in self.getter(tensors)])
        if key != self._ptr_key:
            host = torch.tensor(key, dtype=torch.int64)
            if self.device.type == "cuda":  # async copy: no host sync in a backward hook
                host = host.pin_memory()
            self._ptrs = host.to(self.device, non_blocking=True)
            self._ptr_key = key
        return self._ptrs


_TL_DTYPES: dict = {}
if tl is not None:
    _TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16,
                  torch.bfloat16: tl.bfloat16, torch.float64: tl.float64,
                  torch.int8: tl.int8, torch.int16: tl.int16, torch.int32: tl.int32,
                  torch.int64: tl.int64}
#: a dtype copied bit-exactly moves as the signed integer of its size
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: dtypes the Triton kernels scale and cast
_TRITON_ARITH = (torch.float32, torch.float16, torch.bfloat16)


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

    __slots__ = ("buf", "lists", "tviews", "tshapes")

    def __init__(self, buf):
        self.buf = buf
        self.lists: dict = {}  # id(run list) -> views of each run (see `of`)
        self.tviews = None     # views shaped like the tensors (unpack)
        self.tshapes = None

    def of(self, runs: list) -> list:
        """``[(2-D view, 1-D view, aligned head)]`` of each run."""
        v = self.lists.get(id(runs))
        if v is None:
            v = self.lists[id(runs)] = [
                (self.buf[r.lo:r.hi].view(1, -1), self.buf[r.lo:r.hi],
                 _aligned_head(self.buf[r.lo:r.hi])) for r in runs]
        return v


# ---------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------
def _check_layout(sizes, offsets, numel) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    if len(sizes) != len(offsets):
        raise ValueError(f"sizes has {len(sizes)} entries but offsets has {len(offsets)}: "
                         f"give one size and one offset per tensor")
    try:
        numel = operator.index(numel)
        sizes = tuple(operator.index(s) for s in sizes)
        offsets = tuple(operator.index(o) for o in offsets)
    except TypeError as e:
        raise TypeError(f"sizes, offsets and numel must be integers: {e}") from None
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    for i, (n, o) in enumerate(zip(sizes, offsets)):
        if n < 0:
            raise ValueError(f"sizes[{i}] = {n} is negative")
        if o < 0 or o + n > numel:
            raise ValueError(f"tensor {i}: offsets[{i}] = {o} with {n} elements does not fit "
                             f"in a buffer of {numel} elements (needs 0 <= offset and "
                             f"offset + size <= numel)")
    spans = sorted((o, o + n, i) for i, (n, o) in enumerate(zip(sizes, offsets)) if n)
    for (a0, a1, i), (b0, b1, j) in zip(spans, spans[1:]):
        if b0 < a1:
            raise ValueError(f"tensors {i} and {j} overlap in the buffer: [{a0}, {a1}) and "
                             f"[{b0}, {b1}); give each tensor its own range")
    return sizes, offsets, numel


def _check_buffer(buf, name: str, numel: int, device: torch.device) -> None:
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(buf).__name__}")
    if buf.device != device:
        raise ValueError(f"{name} is on {buf.device} but the plan's device is {device}")
    if buf.numel() != numel:
        raise ValueError(f"{name} has {buf.numel()} elements but the layout needs exactly "
                         f"{numel}: allocate it with the plan's numel")
    if buf.layout != torch.strided or not buf.is_contiguous():
        raise ValueError(f"{name} must be a dense contiguous tensor; call .contiguous()")


_PLAIN_TENSORS = {torch.Tensor, torch.nn.Parameter}
_device = operator.attrgetter("device")
_layout = operator.attrgetter("layout")
_dtype = operator.attrgetter("dtype")


def _check_tensors(tensors, sizes, device, buf_dtype, scale, accumulate, *, pack: bool):
    """Per-call checks of the tensors; returns the set of their dtypes."""
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"tensors must be a list or tuple of tensors, got {type(tensors).__name__}")
    if len(tensors) != len(sizes):
        raise ValueError(f"got {len(tensors)} tensors but the layout has {len(sizes)}")
    # Fast path: the same checks as below, one C-level map per property (~0.5 us per tensor
    # instead of ~1 us); anything unusual takes the loop, which names the culprit.
    if set(map(type, tensors)) <= _PLAIN_TENSORS and (
            set(map(_device, tensors)) <= {device}
            and tuple(map(torch.Tensor.numel, tensors)) == sizes
            and set(map(_layout, tensors)) <= {torch.strided}
            and all(map(torch.Tensor.is_contiguous, tensors))):
        dtypes = set(map(_dtype, tensors))
        for d in dtypes:
            src, dst = (d, buf_dtype) if pack else (buf_dtype, d)
            if accumulate and (src not in FLOATING or dst not in FLOATING):
                break
            if not is_copy(src, dst, scale) and (src not in FLOATING or dst not in FLOATING):
                break
        else:
            return dtypes
    dtypes = set()
    for i, t in enumerate(tensors):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{i}] must be a torch.Tensor or None, got {type(t).__name__}")
        if t.device != device:
            raise ValueError(f"tensors[{i}] is on {t.device} but the buffer is on {device}; "
                             f"move it with .to({str(device)!r})")
        if t.numel() != sizes[i]:
            raise ValueError(f"tensors[{i}] has {t.numel()} elements (shape {tuple(t.shape)}) "
                             f"but the layout reserves {sizes[i]}")
        if t.layout != torch.strided or not t.is_contiguous():
            raise ValueError(f"tensors[{i}] (shape {tuple(t.shape)}, stride {t.stride()}) is not "
                             f"dense and contiguous; pass t.contiguous() (channels_last "
                             f"tensors included)")
        if t.dtype not in dtypes:
            src, dst = (t.dtype, buf_dtype) if pack else (buf_dtype, t.dtype)
            if accumulate and (src not in FLOATING or dst not in FLOATING):
                raise TypeError(f"tensors[{i}]: accumulate needs floating dtypes, got buffer "
                                f"{buf_dtype} and tensor {t.dtype}")
            check_value_pair(src, dst, scale, f"tensors[{i}]")
            dtypes.add(t.dtype)
    return dtypes


def _check_found_inf(found_inf, device) -> None:
    if not isinstance(found_inf, torch.Tensor):
        raise TypeError(f"found_inf must be a 1-element float32 tensor or None, got "
                        f"{type(found_inf).__name__}")
    if found_inf.dtype != torch.float32 or found_inf.numel() != 1 or found_inf.device != device:
        raise ValueError(f"found_inf must be a 1-element float32 tensor on {device}, got "
                         f"{found_inf.dtype} with {found_inf.numel()} elements on "
                         f"{found_inf.device}; use torch.zeros(1, device={str(device)!r})")


# ---------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------
class BucketPlan:
    """Everything static about packing one bucket layout, built once and reused.

    ``sizes[i]`` and ``offsets[i]`` are the element count and element offset of tensor ``i``
    in a flat buffer of ``numel`` elements (gaps allowed, no overlaps).

    Example::

        >>> plan = BucketPlan([3, 5], [0, 4], 9, "cpu")
        >>> out = torch.zeros(9)
        >>> plan.pack([torch.ones(3), torch.full((5,), 2.0)], out, scale=0.5)
        tensor([0.5000, 0.5000, 0.5000, 0.0000, 1.0000, 1.0000, 1.0000, 1.0000, 1.0000])
        >>> a, b = torch.empty(3), torch.empty(5)
        >>> plan.unpack(out, [a, b], scale=2.0); b
        tensor([2., 2., 2., 2., 2.])
    """

    def __init__(self, sizes: Sequence[int], offsets: Sequence[int], numel: int,
                 device: torch.device | str, *, backend: str = "auto"):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.sizes, self.offsets, self.numel = _check_layout(sizes, offsets, numel)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.backend = backend
        if backend == "triton":
            if triton is None:
                raise ValueError(f"backend='triton' needs triton, which failed to import "
                                 f"({_TRITON_ERROR!r}); `pip install 'tribucket[triton]'` or "
                                 f"use backend='torch'")
            if self.device.type != "cuda" and not _interpreting_kernels():
                raise ValueError(
                    f"backend='triton' on {self.device} tensors needs the Triton interpreter: "
                    f"set TRITON_INTERPRET=1 in the environment before tribucket.kernels is "
                    f"imported, or use backend='torch'")
        self._use_triton = backend == "triton" or (
            backend == "auto" and triton is not None and self.device.type == "cuda")
        # torch path: maximal gap-free runs for copies; L2-sized groups of small tensors
        # (big ones whole) for scaling in place; L2-sized pieces (big tensors cut) for casts
        # through the scratch piece and for found_inf
        self._runs = [_Run(*r) for r in _runs(self.sizes, self.offsets, None)]
        self._groups = [_Run(*r) for r in _runs(self.sizes, self.offsets, _CPU_CHUNK, False)]
        self._pieces = [_Run(*r) for r in _runs(self.sizes, self.offsets, _CPU_CHUNK)]
        self._views: OrderedDict = OrderedDict()
        self._scratch: dict = {}
        # Triton path: device tables per subset of tensors (all, or those of one dtype)
        self._tables: dict = {}

    def __repr__(self) -> str:
        return (f"BucketPlan({len(self.sizes)} tensors, numel={self.numel}, "
                f"device={self.device}, backend={self.backend!r})")

    # -- public API ---------------------------------------------------------------------
    def pack(self, tensors: Sequence[torch.Tensor | None], out: torch.Tensor, *,
             scale: float = 1.0, found_inf: torch.Tensor | None = None,
             check: bool = True) -> torch.Tensor:
        """Write every tensor into ``out`` at its offset, scaled and cast; return ``out``.

        ``tensors[i] is None`` zero-fills its slice. Elements of ``out`` between tensors are
        never written. ``found_inf`` (1-element float32) is set to 1.0 when a packed value is
        inf/NaN, never cleared. ``check=False`` skips the per-tensor checks (device, size,
        contiguity, dtype) and assumes every tensor has the first tensor's dtype: use it on
        the hot path once the same tensors have passed with ``check=True``.
        """
        scale = float(scale)
        if check:
            _check_buffer(out, "out", self.numel, self.device)
            dtypes = _check_tensors(tensors, self.sizes, self.device, out.dtype, scale, False,
                                    pack=True)
            if found_inf is not None:
                _check_found_inf(found_inf, self.device)
        else:
            dtypes = None
        if found_inf is not None and not out.is_floating_point():
            found_inf = None  # an integer buffer holds no inf/NaN
        if self._use_triton and self._pack_triton(tensors, out, scale, found_inf, dtypes):
            return out
        self._pack_torch(tensors, out, scale, found_inf, dtypes)
        return out

    def unpack(self, buffer: torch.Tensor, tensors: Sequence[torch.Tensor | None], *,
               scale: float = 1.0, accumulate: bool = False, check: bool = True) -> None:
        """Write each tensor's slice of ``buffer`` into it, scaled and cast to its dtype.

        ``tensors[i] is None`` is skipped. With ``accumulate`` the value is added to what
        the tensor holds. ``check=False`` as for ``pack``.
        """
        scale = float(scale)
        if check:
            _check_buffer(buffer, "buffer", self.numel, self.device)
            dtypes = _check_tensors(tensors, self.sizes, self.device, buffer.dtype, scale,
                                    accumulate, pack=False)
        else:
            dtypes = None
        if self._use_triton and self._unpack_triton(buffer, tensors, scale, accumulate, dtypes):
            return
        self._unpack_torch(buffer, tensors, scale, accumulate, dtypes, check)

    def forget(self, buf: torch.Tensor) -> None:
        """Drop the views this plan caches of ``buf`` (they keep its storage referenced).

        The reducer calls this when it lends a bucket to the gradients, so the storage's use
        count tells whether anything but the reducer still holds it.
        """
        ptr = buf.data_ptr()
        for key in [k for k in self._views if k[0] == ptr]:
            del self._views[key]

    # -- torch path ---------------------------------------------------------------------
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
        if found_inf is None and dtypes == {o} and scale == 1.0:
            # a copy: one cat per maximal run (cat copies with memcpy, which beats copy_
            # when the destination is not 64-byte aligned, as bucket slots are not)
            for run, (v2, v1, _) in zip(self._runs, views.of(self._runs)):
                _gather(run, run.get(tensors), v2, v1)
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
        if self.device.type != "cpu":  # no host sync: torch's AMP check (multiplies by 1)
            one = torch.ones((), device=self.device)
            torch._amp_foreach_non_finite_check_and_unscale_(
                [v1 for _, v1, _ in pieces], found_inf, one)
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
        broadcast with equal numel have the same element order, so they are still right).
        """
        shapes = None
        if check or views.tviews is None:
            shapes = [None if t is None else t.shape for t in tensors]
        if views.tviews is None or (shapes is not None and shapes != views.tshapes):
            buf = views.buf
            views.tviews = [buf[o:o + n].view(n if sh is None else sh)
                            for sh, n, o in zip(shapes, self.sizes, self.offsets)]
            views.tshapes = shapes
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
            torch._foreach_copy_(dsts, srcs)  # a copy, or one rounding cast
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
        else:  # narrow destinations with arithmetic: one tensor at a time
            for d, s in zip(dsts, srcs):
                y = s.to(c) * scale
                if accumulate:
                    y = d.to(c) + y
                d.copy_(y)

    # -- Triton path --------------------------------------------------------------------
    def _tables_for(self, idx: tuple[int, ...]) -> _TritonTables:
        tab = self._tables.get(idx)
        if tab is None:
            tab = self._tables[idx] = _TritonTables(idx, self.sizes, self.offsets, self.device)
        return tab

    def _dtype_groups(self, tensors, dtypes):
        """``[(dtype, tables)]``: one launch per source dtype (a bucket has one)."""
        if dtypes is None or len(dtypes) <= 1:
            first = next((t.dtype for t in tensors if t is not None), None)
            return [(first, self._tables_for(tuple(range(len(self.sizes)))))]
        by: dict = {}
        for i, t in enumerate(tensors):
            by.setdefault(None if t is None else t.dtype, []).append(i)
        nones = by.pop(None, [])
        groups = []
        for j, (d, idx) in enumerate(sorted(by.items(), key=lambda kv: kv[1][0])):
            idx = tuple(sorted(idx + nones)) if j == 0 else tuple(idx)
            groups.append((d, self._tables_for(idx)))
        return groups

    def _pack_triton(self, tensors, out, scale, found_inf, dtypes) -> bool:
        o = out.dtype
        groups = self._dtype_groups(tensors, dtypes)
        launches = []
        for s, tab in groups:
            s = o if s is None else s
            copy = s == o and scale == 1.0
            if copy and (found_inf is None or o not in _TL_DTYPES):
                if out.element_size() not in _BITS:
                    return False  # e.g. complex128: the torch path copies it
                bits = _BITS[out.element_size()]
                args = (out.view(bits), _TL_DTYPES[bits], _TL_DTYPES[bits], True)
            elif copy:  # a float copy that checks for inf/NaN: load the real dtype
                args = (out, _TL_DTYPES[o], _TL_DTYPES[o], True)
            elif s in _TRITON_ARITH and o in _TRITON_ARITH:
                args = (out, _TL_DTYPES[s], _TL_DTYPES[o], False)
            else:
                return False  # float64 arithmetic: the torch path
            launches.append((tab, *args))
        for tab, dst, src_t, dst_t, copy in launches:
            if tab.nblocks == 0:
                continue
            _pack_kernel[(tab.nblocks,)](
                tab.pointers(tensors), tab.sizes, tab.offsets, tab.block_tensor,
                tab.block_start, dst, tab.sizes if found_inf is None else found_inf, scale,
                SRC=src_t, DST=dst_t, COPY=copy, CHECK=found_inf is not None,
                BLOCK=BLOCK, num_warps=_NUM_WARPS, enable_fp_fusion=False)
        return True

    def _unpack_triton(self, buffer, tensors, scale, accumulate, dtypes) -> bool:
        b = buffer.dtype
        launches = []
        for d, tab in self._dtype_groups(tensors, dtypes):
            if d is None:
                continue  # nothing but None tensors: nothing to write
            copy = d == b and scale == 1.0 and not accumulate
            if copy:
                if buffer.element_size() not in _BITS:
                    return False
                bits = _BITS[buffer.element_size()]
                args = (buffer.view(bits), _TL_DTYPES[bits], True)
            elif d in _TRITON_ARITH and b in _TRITON_ARITH:
                args = (buffer, _TL_DTYPES[d], False)
            else:
                return False
            launches.append((tab, *args))
        for tab, buf, dst_t, copy in launches:
            if tab.nblocks == 0:
                continue
            _unpack_kernel[(tab.nblocks,)](
                tab.pointers(tensors), tab.sizes, tab.offsets, tab.block_tensor,
                tab.block_start, buf, scale, DST=dst_t, COPY=copy, ACCUMULATE=accumulate,
                BLOCK=BLOCK, num_warps=_NUM_WARPS, enable_fp_fusion=False)
        return True


def _interpreting_kernels() -> bool:
    """Whether the kernels above were defined under the Triton interpreter."""
    return triton is not None and type(_pack_kernel).__name__ == "InterpretedFunction"


# ---------------------------------------------------------------------------------------
# Functional API
# ---------------------------------------------------------------------------------------
_local = threading.local()
_PLAN_CACHE_SIZE = 32


def _plan_for(tensors, offsets, numel, device, backend, what: str) -> BucketPlan:
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"tensors must be a list or tuple of tensors, got {type(tensors).__name__}")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{i}] must be a torch.Tensor, got {type(t).__name__} "
                            f"(only BucketPlan.{what} accepts None entries)")
    try:
        offsets = tuple(operator.index(o) for o in offsets)
    except TypeError as e:
        raise TypeError(f"offsets must be integers: {e}") from None
    if len(offsets) != len(tensors):
        raise ValueError(f"got {len(tensors)} tensors but {len(offsets)} offsets")
    sizes = tuple(t.numel() for t in tensors)
    key = (sizes, offsets, numel, device, backend)
    cache = getattr(_local, "plans", None)
    if cache is None:
        cache = _local.plans = OrderedDict()
    plan = cache.get(key)
    if plan is None:
        plan = cache[key] = BucketPlan(sizes, offsets, numel, device, backend=backend)
        if len(cache) > _PLAN_CACHE_SIZE:
            cache.popitem(last=False)
    else:
        cache.move_to_end(key)
    return plan


def pack(tensors: Sequence[torch.Tensor], out: torch.Tensor, offsets: Sequence[int], *,
         scale: float = 1.0, found_inf: torch.Tensor | None = None,
         backend: str = "auto") -> torch.Tensor:
    """Write ``tensors[i] * scale`` (cast to ``out.dtype``) at ``out[offsets[i]:]``; return ``out``.

    One Triton launch per bucket on CUDA; the torch path on CPU. The layout's tables are
    cached (per thread) by (sizes, offsets, numel, device, backend); hold a ``BucketPlan``
    to skip even that lookup. See ``BucketPlan.pack`` for ``found_inf``.

    Example::

        >>> out = torch.zeros(9)
        >>> pack([torch.ones(3), torch.ones(5)], out, [0, 4], scale=0.25)
        tensor([0.2500, 0.2500, 0.2500, 0.0000, 0.2500, 0.2500, 0.2500, 0.2500, 0.2500])
    """
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    plan = _plan_for(tensors, offsets, out.numel(), out.device, backend, "pack")
    return plan.pack(tensors, out, scale=scale, found_inf=found_inf)


def unpack(buffer: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int], *,
           scale: float = 1.0, accumulate: bool = False, backend: str = "auto") -> None:
    """Write ``buffer[offsets[i]:] * scale`` (cast to each tensor's dtype) into ``tensors[i]``.

    With ``accumulate`` the value is added to what the tensor holds.

    Example::

        >>> a, b = torch.zeros(3), torch.ones(5)
        >>> unpack(torch.arange(9.), [a, b], [0, 4], accumulate=True); b
        tensor([5., 6., 7., 8., 9.])
    """
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"buffer must be a torch.Tensor, got {type(buffer).__name__}")
    plan = _plan_for(tensors, offsets, buffer.numel(), buffer.device, backend, "unpack")
    plan.unpack(buffer, tensors, scale=scale, accumulate=accumulate)
