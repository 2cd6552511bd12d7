"""Triton kernels for Mixture-of-Experts token movement: counts, permute, unpermute.

Shape legend (suffixes on tensor names):
    T  tokens on this rank          K  experts per token (top-k)
    D  model dimension              E  experts (global)
    S  token-slots, S = T * K       N  rows of the expert-ordered buffer (kept slots, N <= S)

A token-slot ``s = t * K + k`` is token ``t``'s ``k``-th choice. ``dest_TK[t, k]`` is the row
of the expert-ordered buffer that slot goes to, or ``-1`` when capacity dropped it; the kept
slots map one-to-one onto rows ``0 .. N-1`` (the dispatcher builds ``dest_TK``).

Three layers, as in every kernel file here:

* ``_counts_kernel``, ``_permute_kernel``, ``_unpermute_kernel``, ``_unpermute_bwd_kernel``
  (``@triton.jit``), one launch each;
* launchers ``moe_counts``, ``moe_permute``, ``moe_unpermute``, ``moe_unpermute_backward``:
  validate, allocate, pick the path, launch. ``backend="auto"`` runs Triton on CUDA tensors
  and the PyTorch reference (``kernels/moe_reference.py``, vectorised) on CPU tensors;
  ``backend="triton"`` forces the kernel (on CPU that needs ``TRITON_INTERPRET=1`` in the
  environment before this module is imported), ``backend="reference"`` the PyTorch path;
* differentiable ``permute_tokens`` / ``unpermute_tokens`` (``torch.autograd.Function``):
  the backward of permute is an unweighted unpermute, the backward of unpermute is one
  fused kernel giving both the scattered row gradients and the gate-weight gradients.

``import tribucket`` must work without triton: when it is missing, a stand-in keeps the
kernel definitions importable and ``backend="triton"`` raises a clear error.
"""

from __future__ import annotations

import itertools
import os

import torch

from .host import host_ints
from .moe_reference import (
    moe_counts_reference,
    moe_permute_rows,
    moe_permute_reference,
    moe_unpermute_backward_reference,
    moe_unpermute_backward_rows,
    moe_unpermute_reference,
    moe_unpermute_rows,
)

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised on machines without triton
    HAVE_TRITON = False

    class _NoTriton:
        """Stands in for ``triton`` / ``triton.language`` so the kernels below still define."""

        constexpr = int

        @staticmethod
        def jit(fn=None, **_):
            return fn if fn is not None else (lambda f: f)

    triton = tl = _NoTriton()  # type: ignore[assignment]

#: @triton.jit reads TRITON_INTERPRET when this module is imported: remember what it saw
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

__all__ = [
    "moe_counts",
    "moe_permute",
    "moe_unpermute",
    "moe_unpermute_backward",
    "permute_tokens",
    "unpermute_tokens",
    "grouped_matmul",
    "grouped_mm_available",
    "pick_grouped_impl",
    "GROUPED_IMPLS",
    "HAVE_TRITON",
]

#: ids histogrammed per program: 1024 int64 ids = 8 KiB per load, a few atomics per E bins
_COUNTS_BLOCK = 1024
#: row bytes per program: 2 KiB = 16 bytes (one 128-bit access) per thread with 4 warps,
#: i.e. 512 fp32 or 1024 bf16/fp16 elements; rows longer than this take several programs
#: (or loop iterations)
_BLOCK_D_BYTES = 2048
_BACKENDS = ("auto", "triton", "reference")
#: dtypes of the token rows the kernels move
_ROW_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------
@triton.jit
def _counts_kernel(
    ids_ptr,  # *int64 [S]: expert id of each token-slot
    counts_ptr,  # *int64 [E]: zero-filled histogram, accumulated with atomics
    S,  # number of slots
    E,  # number of experts
    BLOCK: tl.constexpr,  # slots per program
    E_POW2: tl.constexpr,  # next power of two >= E (histogram bins)
):
    """Histogram of expert ids: ``counts[e] = #{s : ids[s] == e}``.

    Example: ids ``[2, 0, 2, 1, 2]``, E = 4 -> counts ``[1, 1, 3, 0]``.
    Bytes: reads 8·S, writes 8·E per program (atomics).
    """
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < S
    ids = tl.load(ids_ptr + offs, mask=mask, other=0)
    hist = tl.histogram(ids.to(tl.int32), E_POW2, mask=mask)
    bins = tl.arange(0, E_POW2)
    tl.atomic_add(counts_ptr + bins, hist.to(tl.int64), mask=bins < E)


@triton.jit
def _row_len(D, ALIGN: tl.constexpr):
    """``D``, written so the compiler can see it is a multiple of ALIGN (``ALIGN > 1``: the
    host checked that it is, and that every base pointer is 16-byte aligned).

    Then every row starts on a 16-byte boundary and the row mask is constant over ALIGN
    elements, so a thread's 16 contiguous bytes move as one ``ld/st.global.v4`` instead of
    one access per element (the row index comes from a table, so nothing else tells the
    compiler). ``D // ALIGN * ALIGN`` is exact given the host's check; a ``tl.multiple_of``
    hint on D itself would be dropped (it is an argument, not a value computed here).
    """
    if ALIGN > 1:
        D = D // ALIGN * ALIGN
    return D


@triton.jit
def _permute_kernel(
    x_ptr,  # *dtype [T, D] (contiguous): token rows
    dest_ptr,  # *int64 [T, K]: destination row of each slot, -1 = dropped
    out_ptr,  # *dtype [N, D] (contiguous): expert-ordered rows, every row written once
    D,  # row length
    K: tl.constexpr,  # slots per token (top-k)
    BLOCK_D: tl.constexpr,  # row elements per program
    ALIGN: tl.constexpr,  # 1, or the elements D is a multiple of (rows on 16-byte boundaries)
):
    """Copy token ``t``'s row to each of its ``K`` destinations (program ``(t, column block)``).

    Example: K = 2, dest ``[[0, 2], [1, -1]]`` -> out ``[x0, x1, x0]`` (token 1's second
    choice was dropped). Bytes: reads D·size per token + 8·K, writes D·size per kept slot.
    """
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    D = _row_len(D, ALIGN)
    cmask = cols < D
    row = tl.load(x_ptr + t * D + cols, mask=cmask)
    for k in tl.static_range(K):
        d = tl.load(dest_ptr + t * K + k)
        # broadcast d before comparing: the interpreter turns `vector & scalar_bool` into int32
        keep = cmask & (tl.broadcast_to(d, [BLOCK_D]) >= 0)
        tl.store(out_ptr + d * D + cols, row, mask=keep)


@triton.jit
def _unpermute_kernel(
    rows_ptr,  # *dtype [N, D] (contiguous): expert-ordered rows (expert outputs)
    dest_ptr,  # *int64 [T, K]: row of each slot, -1 = dropped
    w_ptr,  # *float [T, K]: gate weights (unused when HAS_W is False)
    y_ptr,  # *dtype [T, D] (contiguous): combined token rows
    D,  # row length
    K: tl.constexpr,  # slots per token (top-k)
    HAS_W: tl.constexpr,  # weight each slot (else weight 1)
    BLOCK_D: tl.constexpr,  # row elements per program
    ALIGN: tl.constexpr,  # 1, or the elements D is a multiple of (rows on 16-byte boundaries)
):
    """``y[t] = sum_k w[t, k] * rows[dest[t, k]]``, accumulated in fp32 (program ``(t, block)``).

    Example: K = 2, dest ``[[0, 2], [1, -1]]``, w ``[[.7, .3], [1., 0.]]`` ->
    ``y = [.7·r0 + .3·r2, 1·r1]``. Bytes: reads D·size per kept slot + 16·K per token
    (dest, weights), writes D·size per token.
    """
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    D = _row_len(D, ALIGN)
    cmask = cols < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for k in tl.static_range(K):
        d = tl.load(dest_ptr + t * K + k)
        keep = cmask & (tl.broadcast_to(d, [BLOCK_D]) >= 0)  # (broadcast: see _permute_kernel)
        r = tl.load(rows_ptr + d * D + cols, mask=keep, other=0.0).to(tl.float32)
        if HAS_W:
            w = tl.load(w_ptr + t * K + k).to(tl.float32)
            r = r * tl.where(d >= 0, w, 0.0)
        acc += r
    tl.store(y_ptr + t * D + cols, acc.to(y_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _unpermute_bwd_kernel(
    grad_y_ptr,  # *dtype [T, D] (contiguous): gradient of the combined rows
    rows_ptr,  # *dtype [N, D] (contiguous): the rows unpermute combined (saved input)
    dest_ptr,  # *int64 [T, K]: row of each slot, -1 = dropped
    w_ptr,  # *float [T, K]: gate weights
    grad_rows_ptr,  # *dtype [N, D] (contiguous): out, gradient of the rows
    grad_w_ptr,  # *float [T, K]: out, gradient of the gate weights
    D,  # row length
    K: tl.constexpr,  # slots per token (top-k)
    BLOCK_D: tl.constexpr,  # row elements per loop iteration
    ALIGN: tl.constexpr,  # 1, or the elements D is a multiple of (rows on 16-byte boundaries)
):
    """Both gradients of weighted unpermute, one program per token (loop over D).

    ``grad_rows[dest[t, k]] = w[t, k] · grad_y[t]`` and
    ``grad_w[t, k] = <grad_y[t], rows[dest[t, k]]>`` (fp32 dot; 0 for a dropped slot).
    Example: K = 1, dest ``[[1], [0]]``, w ``[[2.], [3.]]``, grad_y ``[g0, g1]`` ->
    grad_rows ``[3·g1, 2·g0]``, grad_w ``[[<g0, r1>], [<g1, r0>]]``.
    Bytes: reads K·D·size of grad_y (cached) + D·size per kept slot, writes D·size per
    kept slot + K·4 per token.
    """
    t = tl.program_id(0).to(tl.int64)
    D = _row_len(D, ALIGN)
    for k in tl.static_range(K):
        d = tl.load(dest_ptr + t * K + k)
        w = tl.load(w_ptr + t * K + k).to(tl.float32)
        dot = tl.zeros([BLOCK_D], dtype=tl.float32)
        for c in range(0, D, BLOCK_D):
            cols = c + tl.arange(0, BLOCK_D)
            m = (cols < D) & (tl.broadcast_to(d, [BLOCK_D]) >= 0)  # (see _permute_kernel)
            g = tl.load(grad_y_ptr + t * D + cols, mask=m, other=0.0).to(tl.float32)
            r = tl.load(rows_ptr + d * D + cols, mask=m, other=0.0).to(tl.float32)
            dot += g * r
            tl.store(grad_rows_ptr + d * D + cols, (g * w).to(grad_rows_ptr.dtype.element_ty), mask=m)
        tl.store(grad_w_ptr + t * K + k, tl.sum(dot, axis=0).to(grad_w_ptr.dtype.element_ty))


# ---------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------
def _use_triton(backend: str, *tensors: torch.Tensor) -> bool:
    """Resolve ``backend`` for tensors on one device: True means launch the Triton kernel."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {_BACKENDS}")
    if backend == "reference":
        return False
    on_cuda = tensors[0].is_cuda
    if backend == "auto":
        return on_cuda and HAVE_TRITON
    if not HAVE_TRITON:
        raise RuntimeError("backend='triton' needs triton: `pip install 'tribucket[triton]'`")
    if not on_cuda and not _INTERPRET:
        raise RuntimeError(
            "backend='triton' on CPU tensors needs the Triton interpreter: set "
            "TRITON_INTERPRET=1 in the environment before tribucket is imported")
    return True


def _check_dest(dest_TK: torch.Tensor, num_tokens: int, device: torch.device) -> None:
    if dest_TK.dtype != torch.int64 or dest_TK.dim() != 2 or dest_TK.shape[0] != num_tokens:
        raise ValueError(f"dest_TK must be int64 [T={num_tokens}, K], got {dest_TK.dtype} "
                         f"{tuple(dest_TK.shape)}")
    if dest_TK.device != device:
        raise ValueError(f"dest_TK is on {dest_TK.device}, the rows on {device}")


def _check_rows(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [rows, D], got shape {tuple(t.shape)}")
    if t.dtype not in _ROW_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def _check_weights(weights_TK: torch.Tensor | None, dest_TK: torch.Tensor) -> None:
    if weights_TK is not None and (weights_TK.shape != dest_TK.shape
                                   or not weights_TK.is_floating_point()):
        raise ValueError(f"weights_TK must be floating point with dest_TK's shape "
                         f"{tuple(dest_TK.shape)}, got {weights_TK.dtype} {tuple(weights_TK.shape)}")


def _block_d(dtype: torch.dtype) -> int:
    """Row elements per program for rows of ``dtype``: 512 fp32, 1024 bf16/fp16."""
    return _BLOCK_D_BYTES // dtype.itemsize


def _row_align(D: int, *rows: torch.Tensor) -> int:
    """``ALIGN`` for the row kernels: the elements of the narrowest dtype in 16 bytes when D
    is a multiple of that and every row tensor starts on a 16-byte boundary (then so does
    every row), else 1 (the scalar kernel). E.g. fp32 rows, D = 1000 -> 4; D = 1001 -> 1."""
    vec = 16 // min(t.element_size() for t in rows)
    if D % vec == 0 and all(t.data_ptr() % 16 == 0 for t in rows):
        return vec
    return 1


def moe_counts(expert_ids: torch.Tensor, num_experts: int, *, backend: str = "auto") -> torch.Tensor:
    """Token-slots per expert: int64 ``[E]`` histogram of ``expert_ids`` (any shape, ids in [0, E))."""
    if expert_ids.dtype != torch.int64:
        raise TypeError(f"expert_ids must be int64, got {expert_ids.dtype}")
    if not _use_triton(backend, expert_ids):
        return moe_counts_reference(expert_ids, num_experts)
    ids_S = expert_ids.reshape(-1).contiguous()
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=ids_S.device)
    S = ids_S.numel()
    if S:
        grid = (triton.cdiv(S, _COUNTS_BLOCK),)
        e_pow2 = max(2, triton.next_power_of_2(num_experts))
        _counts_kernel[grid](ids_S, counts_E, S, num_experts, BLOCK=_COUNTS_BLOCK, E_POW2=e_pow2)
    return counts_E


def moe_permute(x_TD: torch.Tensor, dest_TK: torch.Tensor, num_rows: int, *,
                backend: str = "auto") -> torch.Tensor:
    """Expert-ordered rows: ``out_ND[dest_TK[t, k]] = x_TD[t]`` for every kept slot.

    ``dest_TK`` must map the kept slots one-to-one onto ``0 .. num_rows-1``.
    """
    _check_rows("x_TD", x_TD)
    _check_dest(dest_TK, x_TD.shape[0], x_TD.device)
    if not _use_triton(backend, x_TD):
        return moe_permute_reference(x_TD, dest_TK, num_rows)
    x_TD, dest_TK = x_TD.contiguous(), dest_TK.contiguous()
    (T, D), K = x_TD.shape, dest_TK.shape[1]
    out_ND = x_TD.new_empty((num_rows, D))
    if T and D and K and num_rows:
        block_d = _block_d(x_TD.dtype)
        _permute_kernel[(T, triton.cdiv(D, block_d))](
            x_TD, dest_TK, out_ND, D, K=K, BLOCK_D=block_d, ALIGN=_row_align(D, x_TD, out_ND))
    return out_ND


def moe_unpermute(rows_ND: torch.Tensor, dest_TK: torch.Tensor,
                  weights_TK: torch.Tensor | None = None, *, backend: str = "auto") -> torch.Tensor:
    """Combined rows: ``y_TD[t] = sum_k weights_TK[t, k] · rows_ND[dest_TK[t, k]]`` (fp32 sum).

    ``weights_TK=None`` weighs every kept slot 1 (with K = 1: a row gather). Dropped slots
    contribute nothing; a token with every slot dropped gets a zero row.
    """
    _check_rows("rows_ND", rows_ND)
    _check_dest(dest_TK, dest_TK.shape[0], rows_ND.device)
    _check_weights(weights_TK, dest_TK)
    if not _use_triton(backend, rows_ND):
        return moe_unpermute_reference(rows_ND, dest_TK, weights_TK)
    rows_ND, dest_TK = rows_ND.contiguous(), dest_TK.contiguous()
    (T, K), D = dest_TK.shape, rows_ND.shape[1]
    y_TD = rows_ND.new_empty((T, D))
    if T and D:
        w = weights_TK.contiguous() if weights_TK is not None else dest_TK  # dummy pointer
        block_d = _block_d(rows_ND.dtype)
        _unpermute_kernel[(T, triton.cdiv(D, block_d))](
            rows_ND, dest_TK, w, y_TD, D, K=K, HAS_W=weights_TK is not None, BLOCK_D=block_d,
            ALIGN=_row_align(D, rows_ND, y_TD))
    return y_TD


def moe_unpermute_backward(grad_y_TD: torch.Tensor, rows_ND: torch.Tensor, dest_TK: torch.Tensor,
                           weights_TK: torch.Tensor | None, *,
                           backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of :func:`moe_unpermute`: ``(grad_rows_ND, grad_weights_TK)``.

    Without weights, ``grad_rows_ND`` is ``moe_permute(grad_y_TD)`` and ``grad_weights_TK``
    is ``None``; with weights one fused launch produces both.
    """
    _check_rows("grad_y_TD", grad_y_TD)
    _check_rows("rows_ND", rows_ND)
    _check_weights(weights_TK, dest_TK)
    if weights_TK is None:
        grad_rows_ND = moe_permute(grad_y_TD.to(rows_ND.dtype), dest_TK, rows_ND.shape[0],
                                   backend=backend)
        return grad_rows_ND, None
    if not _use_triton(backend, rows_ND):
        return moe_unpermute_backward_reference(grad_y_TD, rows_ND, dest_TK, weights_TK)
    grad_y_TD, rows_ND = grad_y_TD.contiguous(), rows_ND.contiguous()
    dest_TK, weights_TK = dest_TK.contiguous(), weights_TK.contiguous()
    (T, K), D = dest_TK.shape, rows_ND.shape[1]
    grad_rows_ND = torch.empty_like(rows_ND)
    grad_w_TK = torch.zeros_like(weights_TK)
    if T and K:
        _unpermute_bwd_kernel[(T,)](grad_y_TD, rows_ND, dest_TK, weights_TK, grad_rows_ND,
                                    grad_w_TK, D, K=K, BLOCK_D=_block_d(rows_ND.dtype),
                                    ALIGN=_row_align(D, grad_y_TD, rows_ND, grad_rows_ND))
    return grad_rows_ND, grad_w_TK


# ---------------------------------------------------------------------------------------
# autograd
# ---------------------------------------------------------------------------------------
def first_order_only() -> None:
    """Raise in an MoE autograd function's backward run with ``create_graph=True``.

    The layer's backward is first order (its custom functions compute their gradients
    without a graph): second-order gradients through it would be wrong (the experts' None,
    the input's off). Every rank runs the same backward, so every rank raises here."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            "tribucket's MoE layer does not support a double backward: a backward or "
            "torch.autograd.grad with create_graph=True through an MoE layer (a gradient "
            "penalty, MAML's second-order terms) would give wrong second-order gradients. "
            "Take the penalty with respect to a part of the model without MoE layers, or use "
            "first-order gradients (create_graph=False)")


def freed_graph_error() -> RuntimeError:
    """The error of a second backward through the graphs an MoE layer frees after the first
    (its shared experts beside the exchange, the pairwise pipeline's chunks)."""
    return RuntimeError(
        "Trying to backward through an MoE layer a second time (retain_graph=True): the "
        "layer frees the graphs of its shared experts and of the pairwise schedule's "
        "pipeline after the first backward. Run the forward again for another backward, "
        "or add the losses and call backward once")


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, dest_TK, num_rows, backend, slot_N):
        by_rows = slot_N is not None and not _use_triton(backend, x_TD)
        ctx.save_for_backward(slot_N if by_rows else dest_TK)
        ctx.backend, ctx.by_rows, ctx.shape_TK = backend, by_rows, tuple(dest_TK.shape)
        if by_rows:
            _check_rows("x_TD", x_TD)
            return moe_permute_rows(x_TD, slot_N, dest_TK.shape[1])
        return moe_permute(x_TD, dest_TK, num_rows, backend=backend)

    @staticmethod
    def backward(ctx, grad_out_ND):
        first_order_only()
        (index,) = ctx.saved_tensors
        # every copy of token t sends its gradient back: an unweighted unpermute
        if ctx.by_rows:
            T, K = ctx.shape_TK
            grad_x_TD = moe_unpermute_rows(grad_out_ND, index, K, T)
        else:
            grad_x_TD = moe_unpermute(grad_out_ND.contiguous(), index, None, backend=ctx.backend)
        return grad_x_TD, None, None, None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows_ND, dest_TK, weights_TK, backend, slot_N, dead_rows):
        by_rows = slot_N is not None and not _use_triton(backend, rows_ND)
        ctx.save_for_backward(rows_ND, slot_N if by_rows else dest_TK, weights_TK)
        ctx.backend, ctx.by_rows, ctx.shape_TK = backend, by_rows, tuple(dest_TK.shape)
        ctx.dead_rows = dead_rows
        if by_rows:
            _check_rows("rows_ND", rows_ND)
            _check_weights(weights_TK, dest_TK)
            return moe_unpermute_rows(rows_ND, slot_N, dest_TK.shape[1], dest_TK.shape[0],
                                      weights_TK, dead_rows=dead_rows)
        return moe_unpermute(rows_ND, dest_TK, weights_TK, backend=backend)

    @staticmethod
    def backward(ctx, grad_y_TD):
        first_order_only()
        rows_ND, index, weights_TK = ctx.saved_tensors
        if ctx.by_rows:
            grad_rows_ND, grad_w_TK = moe_unpermute_backward_rows(
                grad_y_TD, rows_ND, index, ctx.shape_TK[1], weights_TK, dead_rows=ctx.dead_rows)
        else:
            grad_rows_ND, grad_w_TK = moe_unpermute_backward(
                grad_y_TD, rows_ND, index, weights_TK, backend=ctx.backend)
        if not ctx.needs_input_grad[2]:
            grad_w_TK = None
        return grad_rows_ND, None, grad_w_TK, None, None, None


def permute_tokens(x_TD: torch.Tensor, dest_TK: torch.Tensor, num_rows: int, *,
                   backend: str = "auto", slot_N: torch.Tensor | None = None) -> torch.Tensor:
    """Differentiable :func:`moe_permute`; gradients flow back to ``x_TD``.

    ``slot_N`` (optional, int64 ``[num_rows]``): the token-slot ``t * K + k`` that fills each
    row, i.e. the inverse of ``dest_TK``, when the caller has it (the dispatcher gets it from
    its sort). The PyTorch path then works by rows (:func:`moe_permute_rows`); the Triton
    kernels ignore it.
    """
    return _Permute.apply(x_TD, dest_TK, num_rows, backend, slot_N)


def unpermute_tokens(rows_ND: torch.Tensor, dest_TK: torch.Tensor,
                     weights_TK: torch.Tensor | None = None, *, backend: str = "auto",
                     slot_N: torch.Tensor | None = None, dead_rows: bool = False) -> torch.Tensor:
    """Differentiable :func:`moe_unpermute`; gradients flow to ``rows_ND`` and ``weights_TK``.

    ``slot_N``: as in :func:`permute_tokens` (``rows_ND.shape[0]`` entries).

    ``dead_rows=True``: some rows of ``rows_ND`` belong to no token-slot (rows that carried
    something else over the wire): ``dest_TK`` never points at them, and in ``slot_N`` they
    hold ``T * K``. They add nothing to ``y`` and get a zero gradient (given a finite
    ``grad_y``) on the PyTorch path; on the Triton path their gradient is left unwritten.
    """
    return _Unpermute.apply(rows_ND, dest_TK, weights_TK, backend, slot_N, dead_rows)


# ---------------------------------------------------------------------------------------
# grouped matmul: every local expert's rows times its own weight, one call
# ---------------------------------------------------------------------------------------
#: the ways :func:`grouped_matmul` can run: torch's grouped GEMM, one padded bmm, a loop of mm
GROUPED_IMPLS = ("auto", "grouped_mm", "bmm", "loop")


def _torch_grouped_mm():
    """torch's grouped GEMM (``F.grouped_mm``, else ``torch._grouped_mm``), or None."""
    fn = getattr(torch.nn.functional, "grouped_mm", None)
    return fn if fn is not None else getattr(torch, "_grouped_mm", None)


def grouped_mm_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether torch's grouped GEMM runs here (tried once per device type and dtype)."""
    key = (torch.device(device).type, dtype)
    if key not in _GROUPED_MM_WORKS:
        fn = _torch_grouped_mm()
        ok = False
        if fn is not None:
            try:  # 2 groups of 1 and 2 rows, 16-wide: the smallest call that exercises offsets
                a = torch.ones(3, 16, device=device, dtype=dtype)
                b = torch.ones(2, 16, 16, device=device, dtype=dtype)
                offs = torch.tensor([1, 3], device=device, dtype=torch.int32)
                ok = bool(torch.allclose(fn(a, b, offs=offs).float(),
                                         torch.full((3, 16), 16.0, device=device)))
            except (RuntimeError, TypeError, NotImplementedError):
                ok = False
        _GROUPED_MM_WORKS[key] = ok
    return _GROUPED_MM_WORKS[key]


_GROUPED_MM_WORKS: dict[tuple[str, torch.dtype], bool] = {}


#: on the CPU in fp32, GroupedExperts runs experts of at least this many rows on average one
#: after another (each one's whole MLP), smaller ones through torch's grouped GEMM (measured:
#: :func:`pick_grouped_impl`)
CPU_LOOP_MIN_ROWS = 1536


def pick_grouped_impl(device: torch.device | str, dtype: torch.dtype,
                      rows_per_group: float | None = None) -> str:
    """What ``impl="auto"`` runs, measured forward + backward (``perf/bench_moe.py --part
    grouped [--device cuda]``, results in ``perf/results/moe_grouped.md`` and
    ``perf/results/gpu/moe_grouped.md``).

    On a 2-core CPU, torch 2.13, fp32: torch's grouped GEMM wins with many small groups (16
    experts of ~1,000 rows, D 256 -> F 128: 1-6% faster than the loop; 8 of 512 rows: 3%);
    :class:`GroupedExperts`' loop of whole expert MLPs wins with few large ones (4 experts of
    ~2,100 rows, 256 -> 1024: 12-15% less time; 2 of ~2,050 rows, 64 -> 128: within 3%
    either way). So ``rows_per_group`` (the mean; GroupedExperts passes it) decides, at
    :data:`CPU_LOOP_MIN_ROWS`. In bf16 the CPU's grouped GEMM is no faster than the loop:
    only fp32 takes it. On an H200, torch 2.11: in bf16 the grouped GEMM is the fastest at 7
    of 8 shapes (up to 3.9x the loop with many small experts, within 8% of it at the 8th), in
    fp32 within 1% of the loop at model sizes: it is taken wherever it runs. Under
    ``torch.compile`` only bf16 takes it: torch's compiled (fake) grouped GEMM accepts bf16
    alone."""
    if dtype != torch.bfloat16 and torch.compiler.is_compiling():
        return "loop"
    if torch.device(device).type == "cpu":
        if dtype != torch.float32:
            return "loop"
        if rows_per_group is not None and rows_per_group >= CPU_LOOP_MIN_ROWS:
            return "loop"
    return "grouped_mm" if grouped_mm_available(device, dtype) else "loop"


def grouped_mm_aligned(w_GIO: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM takes ``w_GIO``: rows of a multiple of 16 bytes (its last
    two dimensions: 4 fp32, 8 bf16 elements)."""
    return all(n * w_GIO.element_size() % 16 == 0 for n in w_GIO.shape[1:])


def grouped_matmul(x_RI: torch.Tensor, w_GIO: torch.Tensor, counts: list[int] | tuple[int, ...],
                   *, impl: str = "auto", offs: torch.Tensor | None = None) -> torch.Tensor:
    """``y[rows of group g] = x[rows of group g] @ w_GIO[g]``: G matmuls in one call.

    ``x_RI`` holds the groups' rows one after another (``counts[g]`` rows for group ``g``,
    ``sum(counts) == R``); the result is ``[R, O]`` in the same order. Differentiable in
    both operands. Example: counts ``[1, 2]``, rows ``[a, b0, b1]`` -> ``[a @ w[0], b0 @
    w[1], b1 @ w[1]]``.

    ``impl``: ``"grouped_mm"`` (torch's grouped GEMM, ``torch.nn.functional.grouped_mm`` /
    ``torch._grouped_mm``: one kernel over every group), ``"bmm"`` (pad every group to the
    largest, one ``bmm``: wasted work when the counts are uneven), ``"loop"`` (one ``mm``
    per group), ``"auto"``: :func:`pick_grouped_impl`. ``offs``: the running sums of
    ``counts`` as int32 on x's device, for callers that run several grouped matmuls over the
    same groups (built from ``counts`` when None).
    """
    if impl not in GROUPED_IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {GROUPED_IMPLS}")
    if x_RI.dim() != 2 or w_GIO.dim() != 3 or x_RI.shape[1] != w_GIO.shape[1]:
        raise ValueError(f"grouped_matmul needs x [R, I] and w [G, I, O], got "
                         f"{tuple(x_RI.shape)} and {tuple(w_GIO.shape)}")
    G = w_GIO.shape[0]
    if len(counts) != G or sum(counts) != x_RI.shape[0]:
        raise ValueError(f"counts {list(counts)} must have one entry per group ({G}) adding up "
                         f"to x's {x_RI.shape[0]} rows")
    # torch's grouped GEMM needs rows of a multiple of 16 bytes (I and O: 4 fp32, 8 bf16)
    aligned = grouped_mm_aligned(w_GIO)
    if impl == "auto":
        # (no rows rule here: it is for GroupedExperts' loop of whole expert MLPs; one
        # projection's loop is no faster than the grouped GEMM on large groups)
        impl = pick_grouped_impl(x_RI.device, x_RI.dtype) if aligned else "loop"
    if impl == "grouped_mm":
        if not grouped_mm_available(x_RI.device, x_RI.dtype):
            raise RuntimeError(f"torch {torch.__version__} has no grouped GEMM for "
                               f"{x_RI.device.type} {x_RI.dtype}: pass impl='loop' or 'bmm'")
        if not aligned:
            raise ValueError(f"impl='grouped_mm' needs w's last two dimensions "
                             f"{tuple(w_GIO.shape[1:])} to be multiples of 16 bytes "
                             f"({16 // x_RI.element_size()} {x_RI.dtype} elements): pad them, or "
                             f"pass impl='auto' (then such shapes run the loop)")
        x_RI, w_GIO = x_RI.contiguous(), w_GIO.contiguous()
        if offs is None:
            offs = host_ints(list(itertools.accumulate(counts)), x_RI.device)
        # its backward refuses gradients with zero strides (``y.sum()``'s): make them dense
        return _DenseGrad.apply(_torch_grouped_mm()(x_RI, w_GIO, offs=offs))
    if impl == "loop":  # unbind: one gradient for the stacked weight, not one per slice
        parts = [x @ w for x, w in zip(x_RI.split(list(counts)), w_GIO.unbind(0))]
        return torch.cat(parts) if parts else x_RI.new_empty(0, w_GIO.shape[2])
    # bmm: [G, C, I] with the groups padded to the largest count C
    C = max(counts, default=0)
    mask_GC = torch.arange(C, device=x_RI.device) < torch.tensor(counts, device=x_RI.device)[:, None]
    pad_GCI = x_RI.new_zeros(G, C, x_RI.shape[1]).masked_scatter(mask_GC[..., None], x_RI)
    return torch.bmm(pad_GCI, w_GIO)[mask_GC]


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient."""

    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()
