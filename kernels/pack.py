"""Pack a bucket's tensors into one flat buffer, and unpack it back: one launch per bucket.

Three layers, as in every kernel file here (in three modules for this one):

* ``_pack_kernel`` / ``_unpack_kernel`` (``@triton.jit``, in ``kernels/pack_triton.py``):
  one program copies one block of one tensor; a block->tensor map tells it which, so a
  bucket of any number of tensors is a single launch.
* the launchers ``pack`` / ``unpack`` and ``BucketPlan`` (this module): validate, pick a
  backend, build the tables once per layout, launch. The plan's two paths sit with what
  they call: the Triton launches in ``kernels/pack_triton.py``, the torch path in
  ``kernels/pack_torch.py``.
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

from .pack_torch import _CPU_CHUNK, _Run, _runs, _TorchPath

# _block_map, the kernels and tl are not used here: the tests reach them through this module.
from .pack_triton import (  # noqa: F401
    _TRITON_ERROR,
    BLOCK,
    _block_map,
    _interpreting_kernels,
    _pack_kernel,
    _TritonPath,
    _unpack_kernel,
    tl,
    triton,
)
from .reference import FLOATING, check_value_pair, is_copy

__all__ = ["BucketPlan", "pack", "unpack", "BACKENDS", "BLOCK", "triton_available"]

BACKENDS = ("auto", "triton", "torch")


def triton_available() -> bool:
    """Whether triton imported (the Triton backend can run)."""
    return triton is not None


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
            and all(map(torch.Tensor.is_contiguous, tensors))
            and not any(map(torch.Tensor.is_conj, tensors))
            and not any(map(torch.Tensor.is_neg, tensors))):
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
        if t.is_conj() or t.is_neg():
            # a lazy view: its values are not its bits, which the kernels read and write
            kind, held, fix = (("conjugate", "the unconjugated", "resolve_conj")
                               if t.is_conj() else ("negative", "the unnegated", "resolve_neg"))
            raise ValueError(f"tensors[{i}] is a {kind} view (its memory holds {held} "
                             f"values); pass t.{fix}()")
        if t.dtype not in dtypes:
            src, dst = (t.dtype, buf_dtype) if pack else (buf_dtype, t.dtype)
            if accumulate and (src not in FLOATING or dst not in FLOATING):
                raise TypeError(f"tensors[{i}]: accumulate needs floating dtypes, got buffer "
                                f"{buf_dtype} and tensor {t.dtype}")
            check_value_pair(src, dst, scale, f"tensors[{i}]")
            dtypes.add(t.dtype)
    return dtypes


def _check_stats(stats, device) -> None:
    if not isinstance(stats, torch.Tensor) or stats.dtype != torch.float32 \
            or stats.shape != (2,) or stats.device != device:
        raise ValueError(f"stats must be a float32 tensor of shape (2,) on {device} "
                         f"([sum of squares, non-finite flag]), got {stats!r:.80}; use "
                         f"torch.zeros(2, device={str(device)!r})")


def norms_fp32(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The 2-norm of each tensor as a 0-dim float32 (half and bf16 tensors are squared and
    summed in float32, float64 ones in float64): one ``_foreach_norm`` per width."""
    narrow = [t for t in tensors if t.dtype != torch.float64]
    wide = [t for t in tensors if t.dtype == torch.float64]
    norms = list(torch._foreach_norm(narrow, 2, dtype=torch.float32)) if narrow else []
    return norms + [n.float() for n in torch._foreach_norm(wide)] if wide else norms


def _stats_torch(tensors, stats) -> None:
    """The unpack epilogue on the torch path: one vectorised read of the written tensors."""
    floats = [t for t in tensors if t.is_floating_point() and t.numel()]
    if not floats:
        return
    norms = torch.stack(norms_fp32(floats))
    stats[0] += norms.square().sum()
    if not bool(torch.isfinite(norms).all()):
        # a norm is inf/NaN: a value is, or finite squares overflowed; tell them apart
        if any(not bool(torch.isfinite(t).all()) for t in floats):
            stats[1] = 1.0


def _check_found_inf(found_inf, device) -> None:
    if not isinstance(found_inf, torch.Tensor):
        raise TypeError(f"found_inf must be a 1-element float32 tensor or None, got "
                        f"{type(found_inf).__name__}")
    if found_inf.dtype != torch.float32 or found_inf.numel() != 1 or found_inf.device != device:
        raise ValueError(f"found_inf must be a 1-element float32 tensor on {device}, got "
                         f"{found_inf.dtype} with {found_inf.numel()} elements on "
                         f"{found_inf.device}; use torch.zeros(1, device={str(device)!r})")


# ---------------------------------------------------------------------------------------
# The plan (its torch path is mixed in from kernels/pack_torch.py, its Triton launches from
# kernels/pack_triton.py)
# ---------------------------------------------------------------------------------------
class BucketPlan(_TorchPath, _TritonPath):
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
               scale: float = 1.0, accumulate: bool = False, check: bool = True,
               stats: torch.Tensor | None = None) -> None:
        """Write each tensor's slice of ``buffer`` into it, scaled and cast to its dtype.

        ``tensors[i] is None`` is skipped. With ``accumulate`` the value is added to what
        the tensor holds. ``check=False`` as for ``pack``. ``stats`` (2-element float32, the
        epilogue): ``stats[0]`` gains the sum of squares of the values written and
        ``stats[1]`` is set to 1.0 if one is inf/NaN; in the same launch on the Triton path,
        one vectorised read of the written tensors on the torch path.
        """
        scale = float(scale)
        if check:
            _check_buffer(buffer, "buffer", self.numel, self.device)
            dtypes = _check_tensors(tensors, self.sizes, self.device, buffer.dtype, scale,
                                    accumulate, pack=False)
            if stats is not None:
                _check_stats(stats, self.device)
        else:
            dtypes = None
        if self._use_triton and self._unpack_triton(buffer, tensors, scale, accumulate, dtypes,
                                                    stats):
            return
        self._unpack_torch(buffer, tensors, scale, accumulate, dtypes, check)
        if stats is not None:
            _stats_torch([t for t in tensors if t is not None], stats)

    def forget(self, buf: torch.Tensor) -> None:
        """Drop the views this plan caches of ``buf`` (they keep its storage referenced).

        The reducer calls this when it lends a bucket to the gradients, so the storage's use
        count tells whether anything but the reducer still holds it.
        """
        ptr = buf.data_ptr()
        for key in [k for k in self._views if k[0] == ptr]:
            del self._views[key]


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
