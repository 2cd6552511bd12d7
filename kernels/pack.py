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
* ``"torch"``: the torch path on any device. How it packs, and the measurements behind each
  choice, are in ``kernels/pack_torch.py``.

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
from typing import Sequence

import torch

from .pack_torch import _CPU_CHUNK, _getter, _Run, _runs, _TorchPath
from .reference import FLOATING, check_value_pair, is_copy

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
# The plan (its torch path is mixed in from kernels/pack_torch.py)
# ---------------------------------------------------------------------------------------
class BucketPlan(_TorchPath):
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
