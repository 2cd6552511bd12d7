"""The Triton path of ``BucketPlan``: the kernels, their device tables, and the launches.

* ``_pack_kernel`` / ``_unpack_kernel`` (``@triton.jit``): one program copies one block of
  one tensor; a block->tensor map tells it which, so a bucket of any number of tensors is a
  single launch. Each comes in two forms: ``ALIGN > 1`` when every address, size and
  offset is a multiple of 16 bytes (128-bit global accesses), ``ALIGN = 1`` otherwise
  (one access per element); ``_TritonTables.align`` picks one per launch.
* ``_block_map`` and ``_TritonTables``: that map and the per-tensor tables, built once per
  layout (the pointer table is rebuilt only when the tensors' ``data_ptr()``s change).
* ``_pack_variant`` / ``_unpack_variant``: which kernel dtypes and flags a call launches
  (``kernels/machine_code.py`` enumerates the specializations from them).
* ``_TritonPath``: ``BucketPlan``'s Triton methods (pick the kernel's dtypes, launch once per
  source dtype), mixed into the plan by ``kernels/pack.py``.

``import tribucket`` must work without triton: when it fails to import, ``triton`` and ``tl``
are None, ``_jit`` leaves the kernel definitions as plain (never called) functions, and
``BucketPlan(backend="triton")`` raises a clear error. On CPU tensors the kernels need the
Triton interpreter: ``TRITON_INTERPRET=1`` in the environment before this module is
imported (``@triton.jit`` reads it at definition time; the tests set it).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .host import host_ints, to_device
from .pack_torch import _getter

try:  # triton is optional: the torch path never needs it, and importing tribucket must not
    import triton
    import triton.language as tl

    _TRITON_ERROR: BaseException | None = None
except Exception as e:  # noqa: BLE001 - a broken triton install must not break import tribucket
    triton = None
    tl = None
    _TRITON_ERROR = e

#: Elements per Triton program. 4096 fp32 = 16 KiB read + 16 KiB written per program: with
#: 4 warps that is 32 elements (eight 16-byte vectors) per thread, enough bytes in flight to
#: saturate HBM for a pure copy, while a tiny tensor (a bias of 10 elements) wastes at most
#: one mostly-masked program. Tables are int64 so no index arithmetic overflows at 2**31.
BLOCK = 4096
_NUM_WARPS = 4
#: Bytes of the widest global access (``ld/st.global.v4.b32``): the aligned kernels promise
#: the compiler that every tensor and slice starts on a multiple of this.
_VEC_BYTES = 16


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
def _this_block(ptrs, sizes, offsets, block_tensor, block_start, BLOCK: tl.constexpr,
                ALIGN: tl.constexpr):
    """This program's element indices (int64, inside its tensor) and its tensor's size,
    bucket offset and address: the block->tensor map lookup both kernels start with.

    With ``ALIGN > 1`` the host has checked that every size and offset is a multiple of
    ALIGN elements and every address of 16 bytes (``_TritonTables.align``): the hints pass
    that on to the compiler, the kernels add the one on the addresses, so that a thread's
    16 contiguous bytes move as one ``ld/st.global.v4.b32`` instead of one access per
    element. (A hint on a jit function's argument is dropped: it must sit on a value
    computed in the function.) A block starts at a multiple of BLOCK inside its tensor
    whatever ALIGN is.
    """
    pid = tl.program_id(0).to(tl.int64)
    t = tl.load(block_tensor + pid).to(tl.int64)
    start = tl.multiple_of(tl.load(block_start + pid), BLOCK)
    idx = start + tl.arange(0, BLOCK).to(tl.int64)
    n = tl.load(sizes + t)
    off = tl.load(offsets + t)
    if ALIGN > 1:
        n = tl.multiple_of(n, ALIGN)
        off = tl.multiple_of(off, ALIGN)
    return idx, n, off, tl.load(ptrs + t)


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
    ALIGN: tl.constexpr,  # 1, or the elements every size and offset is a multiple of (host-checked)
):
    """out[offsets[t] + i] = cast(src_t[i] * scale) for every tensor t, one block per program.

    Example: tensors of 3 and 5 elements at offsets [0, 4], BLOCK = 4 -> programs
    (t=0, start=0), (t=1, start=0), (t=1, start=4) and the bucket ``[a0 a1 a2 _ b0 .. b4]``;
    the gap ``_`` is never written.

    Bytes: reads sum(n_t) * SRC bytes, writes sum(n_t) * DST bytes (+ 12 per program and
    24 per tensor of table reads).
    """
    idx, n, dst_off, addr = _this_block(src_ptrs, sizes, offsets, block_tensor, block_start,
                                        BLOCK, ALIGN)
    src = addr.to(tl.pointer_type(SRC))
    mask = idx < n
    present = idx < tl.where(addr != 0, n, 0)  # a null source reads as zeros
    src_p = src + idx
    if ALIGN > 1:  # an address loaded from a table carries no alignment the compiler sees
        src_p = tl.multiple_of(src_p, 16)  # _VEC_BYTES
    x = tl.load(src_p, mask=present, other=0)
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
    ALIGN: tl.constexpr,  # 1, or the elements every size and offset is a multiple of (host-checked)
    # the epilogue (the reducer's norm and inf/NaN flag), off unless STATS:
    partials=None,             # *fp32 [NB]: program b's sum of squares of what it wrote
    nonfinite=None,            # *fp32 [1]: set to 1.0 when a written value is inf/NaN
    STATS: tl.constexpr = False,
):
    """dst_t[i] = cast(buffer[offsets[t] + i] * scale) (+ dst_t[i] if ACCUMULATE).

    Example: bucket ``[a0 a1 a2 _ b0 .. b4]``, offsets [0, 4] -> tensor 0 gets a0..a2 and
    tensor 1 gets b0..b4; the gap is never read.

    STATS (the reducer's epilogue, ``kernels/reference.py``): program b also writes the sum
    of squares of the values it stored to ``partials[b]`` (float32; the launcher sums the
    NB partials, in a fixed order) and sets ``nonfinite``, from registers: no extra read.

    Bytes: reads sum(n_t) * BUF bytes (+ sum(n_t) * DST if ACCUMULATE), writes
    sum(n_t) * DST bytes (+ 4 per program if STATS).
    """
    idx, n, src_off, addr = _this_block(dst_ptrs, sizes, offsets, block_tensor, block_start,
                                        BLOCK, ALIGN)
    dst = addr.to(tl.pointer_type(DST)) + idx
    if ALIGN > 1:  # (see _pack_kernel)
        dst = tl.multiple_of(dst, 16)  # _VEC_BYTES
    mask = idx < tl.where(addr != 0, n, 0)  # a null destination is skipped
    x = tl.load(buffer + src_off + idx, mask=mask, other=0)
    if COPY:
        y = x
    else:
        v = x.to(tl.float32) * scale
        if ACCUMULATE:
            # the product is rounded to fp32 before the add (enable_fp_fusion=False below)
            v = tl.load(dst, mask=mask, other=0).to(tl.float32) + v
        y = _cast(v, DST)
    tl.store(dst, y, mask=mask)
    if STATS:
        yf = tl.where(mask, y.to(tl.float32), 0.0)  # exact: inf stays inf, NaN stays NaN
        tl.store(partials + tl.program_id(0).to(tl.int64), tl.sum(yf * yf, axis=0))
        bad = (tl.abs(yf) == float("inf")) | (yf != yf)
        if tl.max(bad.to(tl.int32), axis=0) > 0:
            tl.store(nonfinite, 1.0)  # every writer stores 1.0: the race is benign


def _interpreting_kernels() -> bool:
    """Whether the kernels above were defined under the Triton interpreter."""
    return triton is not None and type(_pack_kernel).__name__ == "InterpretedFunction"


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
        off = [offsets[i] for i in idx]
        # built in a backward hook: pinned, non-blocking copies, so the host does not wait
        # for the device's queued work (a pageable copy would) on the first pass of a layout
        self.sizes = host_ints(sz, device, torch.int64)
        self.offsets = host_ints(off, device, torch.int64)
        # the vector widths (in elements) every size and offset allows: 2, 4, 8, 16 or none
        self._aligns = {v for v in (2, 4, 8, 16)
                        if all(x % v == 0 for x in sz) and all(x % v == 0 for x in off)}
        bt, bs = _block_map(sz, BLOCK)
        self.block_tensor = to_device(bt, device)
        self.block_start = to_device(bs, device)
        self.nblocks = len(bt)
        self.device = device
        self._ptr_key: tuple[int, ...] | None = None
        self._ptrs: torch.Tensor | None = None
        self._ptrs_aligned = False  # every data_ptr() in _ptr_key is a multiple of 16
        self._partials: torch.Tensor | None = None  # the unpack epilogue's per-program sums

    def partials(self) -> torch.Tensor:
        """Scratch for the unpack epilogue: one float32 per program, allocated once."""
        if self._partials is None:
            self._partials = torch.empty(max(self.nblocks, 1), dtype=torch.float32,
                                         device=self.device)
        return self._partials

    def pointers(self, tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """The int64 pointer table, rebuilt only when the data_ptr()s change."""
        key = tuple([0 if t is None else t.data_ptr() for t in self.getter(tensors)])
        if key != self._ptr_key:
            self._ptrs = host_ints(key, self.device, torch.int64)
            self._ptr_key = key
            self._ptrs_aligned = all(p % _VEC_BYTES == 0 for p in key)
        return self._ptrs

    def align(self, buf: torch.Tensor, elem_bytes: int) -> int:
        """``ALIGN`` for a launch on the pointers last returned by ``pointers()``.

        ``16 // elem_bytes`` (elements of the narrower of the two dtypes in 16 bytes) when
        ``buf`` and every tensor start on a 16-byte boundary and every size and offset is a
        multiple of that many elements, so every thread's 16 contiguous bytes can move as
        one access; 1 (the scalar kernel) otherwise. E.g. fp32 sizes [1024, 12] at offsets
        [0, 1024] -> 4; sizes [1024, 10] -> 1.
        """
        vec = _VEC_BYTES // elem_bytes
        if (vec in self._aligns and self._ptrs_aligned
                and buf.data_ptr() % _VEC_BYTES == 0):
            return vec
        return 1


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
# Launches
# ---------------------------------------------------------------------------------------
def _pack_variant(src: torch.dtype, out: torch.dtype, copy: bool, check: bool):
    """How ``_pack_kernel`` packs ``src`` tensors into an ``out`` buffer:
    ``(view out as, SRC, DST, COPY)`` in torch dtypes, or None for the torch path.

    ``copy``: same dtype and scale 1; ``check``: found_inf is given. A copy moves the bits
    as the signed integer of the element's size (any dtype of 1-8 bytes), unless it must
    look at the values for inf/NaN. E.g. (bfloat16, bfloat16, copy, no check) ->
    (int16, int16, int16, True). ``kernels/machine_code.py`` enumerates the kernel
    specializations the launches can produce from this function.
    """
    check = check and out.is_floating_point  # an integer buffer holds no inf/NaN
    if copy and not (check and out in _TL_DTYPES):
        bits = _BITS.get(out.itemsize)
        return None if bits is None else (bits, bits, bits, True)
    if copy:  # a float copy that checks for inf/NaN: load the real dtype
        return (out, out, out, True)
    if src in _TRITON_ARITH and out in _TRITON_ARITH:
        return (out, src, out, False)
    return None


def _unpack_variant(dst: torch.dtype, buf: torch.dtype, copy: bool, stats: bool = False):
    """How ``_unpack_kernel`` unpacks a ``buf`` buffer into ``dst`` tensors:
    ``(view buffer as, DST, COPY)`` in torch dtypes, or None for the torch path.
    E.g. (float32, float32, copy) -> (int32, int32, True); (float16, float32) ->
    (float32, float16, False). ``stats`` (the epilogue squares the values): floats of the
    kernel's dtypes only, and a copy loads the real dtype, e.g. (float32, float32, copy,
    stats) -> (float32, float32, True)."""
    if stats:
        if dst not in _TRITON_ARITH or buf not in _TRITON_ARITH:
            return None
        if copy:
            return (buf, buf, True)
    if copy:
        bits = _BITS.get(buf.itemsize)
        return None if bits is None else (bits, bits, True)
    if dst in _TRITON_ARITH and buf in _TRITON_ARITH:
        return (buf, dst, False)
    return None


class _TritonPath:
    """``BucketPlan``'s Triton path, mixed into the plan (``kernels/pack.py``).

    Uses the plan's ``sizes``, ``offsets``, ``device`` and ``_tables`` (device tables per
    subset of tensors, filled on first use), all set by ``BucketPlan.__init__``.
    """

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
        launches = []
        for s, tab in self._dtype_groups(tensors, dtypes):
            s = o if s is None else s
            v = _pack_variant(s, o, s == o and scale == 1.0, found_inf is not None)
            if v is None:
                return False  # float64 arithmetic, 16-byte copies: the torch path
            view, src_t, dst_t, copy = v
            launches.append((tab, min(src_t.itemsize, dst_t.itemsize), out.view(view),
                             _TL_DTYPES[src_t], _TL_DTYPES[dst_t], copy))
        for tab, elem_bytes, dst, src_t, dst_t, copy in launches:
            if tab.nblocks == 0:
                continue
            ptrs = tab.pointers(tensors)
            _pack_kernel[(tab.nblocks,)](
                ptrs, tab.sizes, tab.offsets, tab.block_tensor,
                tab.block_start, dst, tab.sizes if found_inf is None else found_inf, scale,
                SRC=src_t, DST=dst_t, COPY=copy, CHECK=found_inf is not None,
                BLOCK=BLOCK, ALIGN=tab.align(out, elem_bytes), num_warps=_NUM_WARPS,
                enable_fp_fusion=False)
        return True

    def _unpack_triton(self, buffer, tensors, scale, accumulate, dtypes, stats=None) -> bool:
        b = buffer.dtype
        launches = []
        for d, tab in self._dtype_groups(tensors, dtypes):
            if d is None:
                continue  # nothing but None tensors: nothing to write
            v = _unpack_variant(d, b, d == b and scale == 1.0 and not accumulate,
                                stats is not None)
            if v is None:
                return False
            view, dst_t, copy = v
            launches.append((tab, min(view.itemsize, dst_t.itemsize), buffer.view(view),
                             _TL_DTYPES[dst_t], copy))
        for tab, elem_bytes, buf, dst_t, copy in launches:
            if tab.nblocks == 0:
                continue
            epilogue = {}
            if stats is not None:
                epilogue = dict(partials=tab.partials(), nonfinite=stats[1:], STATS=True)
            ptrs = tab.pointers(tensors)
            _unpack_kernel[(tab.nblocks,)](
                ptrs, tab.sizes, tab.offsets, tab.block_tensor,
                tab.block_start, buf, scale, DST=dst_t, COPY=copy, ACCUMULATE=accumulate,
                BLOCK=BLOCK, ALIGN=tab.align(buffer, elem_bytes), num_warps=_NUM_WARPS,
                enable_fp_fusion=False, **epilogue)
            if stats is not None:  # NB floats: one small reduction, no host sync
                stats[0] += epilogue["partials"].sum()
        return True
