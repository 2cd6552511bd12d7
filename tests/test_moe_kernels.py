"""The MoE token kernels under the Triton interpreter against their PyTorch references.

Shape legend: T tokens, K slots per token, D row length, E experts, N kept rows.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tribucket.kernels import moe as kmoe
from tribucket.kernels.moe_reference import (
    moe_counts_reference,
    moe_permute_reference,
    moe_permute_rows,
    moe_unpermute_backward_reference,
    moe_unpermute_backward_rows,
    moe_unpermute_reference,
    moe_unpermute_rows,
)

_skip_without_triton = pytest.mark.skipif(
    not kmoe.HAVE_TRITON or not (torch.cuda.is_available() or kmoe._INTERPRET),
    reason="needs triton (and TRITON_INTERPRET=1 without a GPU)")


def needs_triton(fn):
    """Runs the Triton kernel: on the GPU, or under the interpreter on CPU."""
    return pytest.mark.interpreter(_skip_without_triton(fn))
DEV = "cuda" if torch.cuda.is_available() else "cpu"

# (T, K, D): empty, single token, odd sizes, rows longer than one block (512 fp32 or 1024
# 16-bit elements)
SHAPES = [(0, 2, 8), (1, 1, 1), (7, 2, 5), (19, 3, 130), (5, 2, 600), (2, 2, 1096)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _ulp_tol(dtype):
    """(atol, rtol) for results that went through fp32 and one rounding to ``dtype``.

    The interpreter rounds fp32 -> bf16 toward zero where torch rounds to nearest, so the
    two may differ by one unit in the last place.
    """
    return {torch.float32: (1e-6, 1e-6), torch.float16: (1e-3, 2 ** -10),
            torch.bfloat16: (1e-2, 2 ** -7)}[dtype]


def _assert_equal(name, got, want):
    """Integer/bit-copy results: shape, then dtype, then values."""
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    assert torch.equal(got, want), f"{name}: values differ\n{got}\n{want}"


def _routing(T, K, drop, seed):
    """A random dest_TK: a random ``drop`` fraction of slots dropped, the rest a bijection."""
    g = torch.Generator().manual_seed(seed)
    kept_S = torch.rand(T * K, generator=g) >= drop
    N = int(kept_S.sum())
    dest_S = torch.full((T * K,), -1, dtype=torch.int64)
    dest_S[kept_S] = torch.randperm(N, generator=g)
    return dest_S.view(T, K).to(DEV), N


def _loop_permute(x_TD, dest_TK, N):
    out = torch.full((N, x_TD.shape[1]), float("nan"), dtype=x_TD.dtype)
    for t in range(dest_TK.shape[0]):
        for k in range(dest_TK.shape[1]):
            if dest_TK[t, k] >= 0:
                out[dest_TK[t, k]] = x_TD[t]
    return out


@needs_triton
@pytest.mark.parametrize("E", [1, 3, 8, 33])
@pytest.mark.parametrize("S", [0, 5, 1500])  # 1500 ids: two programs of _COUNTS_BLOCK
def test_counts_kernel_matches_reference(S, E):
    ids = torch.randint(0, E, (S,), generator=torch.Generator().manual_seed(S + E)).to(DEV)
    got = kmoe.moe_counts(ids, E, backend="triton")
    want = moe_counts_reference(ids, E)
    _assert_equal("counts", got, want)
    assert int(got.sum()) == S


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,K,D", SHAPES)
@pytest.mark.parametrize("drop", [0.0, 0.4])
def test_permute_kernel_matches_reference(T, K, D, dtype, drop):
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(T * D)).to(dtype).to(DEV)
    dest, N = _routing(T, K, drop, seed=T + K)
    got = kmoe.moe_permute(x, dest, N, backend="triton")
    want = moe_permute_reference(x, dest, N)
    _assert_equal("permute (triton vs reference)", got, want)
    if T * K <= 100:
        _assert_equal("permute (reference vs loop)", want.cpu(), _loop_permute(x.cpu(), dest.cpu(), N))


def _misaligned(T, D, dtype, g):
    """A contiguous [T, D] tensor whose storage starts one element past a 16-byte boundary."""
    return torch.randn(T * D + 1, generator=g).to(dtype).to(DEV)[1:].view(T, D)


@pytest.mark.parametrize("dtype,vec", [(torch.float32, 4), (torch.float16, 8), (torch.bfloat16, 8)])
def test_row_align_takes_the_vector_kernel_only_when_every_row_is_aligned(dtype, vec):
    g = torch.Generator().manual_seed(3)
    a = torch.randn(4, 3 * vec, generator=g).to(dtype)
    assert kmoe._row_align(3 * vec, a, a.clone()) == vec
    assert kmoe._row_align(vec + 1, torch.zeros(4, vec + 1, dtype=dtype)) == 1
    assert kmoe._row_align(3 * vec, a, _misaligned(4, 3 * vec, dtype, g)) == 1
    assert kmoe._row_align(3 * vec, a, a.float()) == vec  # mixed: the narrower dtype decides
    assert kmoe._row_align(2, torch.zeros(4, 2, dtype=torch.float32), torch.zeros(4, 2, dtype=dtype)) == 1


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_kernels_on_misaligned_rows_match_reference(dtype):
    """Rows whose storage is one element off a 16-byte boundary take the scalar kernel."""
    g = torch.Generator().manual_seed(11)
    T, K, D = 6, 2, 16
    dest, N = _routing(T, K, 0.3, seed=5)
    x = _misaligned(T, D, dtype, g)
    _assert_equal("permute (misaligned)", kmoe.moe_permute(x, dest, N, backend="triton"),
                  moe_permute_reference(x, dest, N))
    rows, w = _misaligned(N, D, dtype, g), torch.rand(T, K, generator=g).to(DEV)
    atol, rtol = _ulp_tol(dtype)
    torch.testing.assert_close(kmoe.moe_unpermute(rows, dest, w, backend="triton").float(),
                               moe_unpermute_reference(rows, dest, w).float(), atol=atol, rtol=rtol)
    grad_y = _misaligned(T, D, dtype, g)
    got = kmoe.moe_unpermute_backward(grad_y, rows, dest, w, backend="triton")
    want = moe_unpermute_backward_reference(grad_y, rows, dest, w)
    torch.testing.assert_close(got[0].float(), want[0].float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,K,D", SHAPES)
@pytest.mark.parametrize("drop", [0.0, 0.4])
@pytest.mark.parametrize("weighted", [True, False])
def test_unpermute_kernels_match_reference(T, K, D, dtype, drop, weighted):
    g = torch.Generator().manual_seed(7 * T + D)
    dest, N = _routing(T, K, drop, seed=T * K + 1)
    rows = torch.randn(N, D, generator=g).to(dtype).to(DEV)
    w = torch.rand(T, K, generator=g).to(DEV) if weighted else None
    grad_y = torch.randn(T, D, generator=g).to(dtype).to(DEV)
    atol, rtol = _ulp_tol(dtype)

    y = kmoe.moe_unpermute(rows, dest, w, backend="triton")
    y_ref = moe_unpermute_reference(rows, dest, w)
    assert y.dtype == dtype == y_ref.dtype and y.shape == (T, D) == y_ref.shape
    torch.testing.assert_close(y.float(), y_ref.float(), atol=atol, rtol=rtol)
    # the reference itself, against fp64 arithmetic written out per slot
    want = torch.zeros(T, D, dtype=torch.float64)
    for k in range(K):
        kept = dest[:, k].cpu() >= 0
        wk = w[:, k].cpu().double() if weighted else torch.ones(T, dtype=torch.float64)
        want[kept] += wk[kept, None] * rows.cpu().double()[dest[:, k].cpu()[kept]]
    torch.testing.assert_close(y_ref.cpu().double(), want.to(dtype).double(), atol=atol, rtol=rtol)

    grad_rows, grad_w = kmoe.moe_unpermute_backward(grad_y, rows, dest, w, backend="triton")
    grad_rows_ref, grad_w_ref = moe_unpermute_backward_reference(grad_y, rows, dest, w)
    assert grad_rows.dtype == dtype and grad_rows.shape == (N, D)
    torch.testing.assert_close(grad_rows.float(), grad_rows_ref.float(), atol=atol, rtol=rtol)
    if weighted:
        assert grad_w.dtype == w.dtype and grad_w.shape == (T, K)
        torch.testing.assert_close(grad_w, grad_w_ref, atol=1e-4, rtol=1e-5)  # fp32 dots over D
        assert torch.count_nonzero(grad_w[dest < 0]) == 0  # a dropped slot gets no gradient
    else:
        assert grad_w is None and grad_w_ref is None


def _slots(dest_TK, N):
    """The inverse of dest_TK written out slot by slot: the slot filling each row."""
    slot_N = torch.full((N,), -1, dtype=torch.int64)
    for s, d in enumerate(dest_TK.reshape(-1).tolist()):
        if d >= 0:
            slot_N[d] = s
    assert bool((slot_N >= 0).all())
    return slot_N.to(dest_TK.device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,K,D", SHAPES + [(6, 3, 4)])
@pytest.mark.parametrize("drop", [0.0, 0.4])
@pytest.mark.parametrize("weighted", [True, False])
def test_row_path_matches_reference(T, K, D, dtype, drop, weighted):
    """The CPU path by rows (given slot_N) against the dest_TK references it replaces."""
    g = torch.Generator().manual_seed(5 * T + D)
    dest, N = _routing(T, K, drop, seed=T * K + 2)
    slot_N = _slots(dest, N)
    x = torch.randn(T, D, generator=g).to(dtype)
    rows = torch.randn(N, D, generator=g).to(dtype)
    w = torch.rand(T, K, generator=g) if weighted else None
    grad_y = torch.randn(T, D, generator=g).to(dtype)
    atol, rtol = _ulp_tol(dtype)
    _assert_equal("permute", moe_permute_rows(x, slot_N, K), moe_permute_reference(x, dest, N))
    y, y_ref = moe_unpermute_rows(rows, slot_N, K, T, w), moe_unpermute_reference(rows, dest, w)
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape == (T, D)
    torch.testing.assert_close(y.float(), y_ref.float(), atol=atol, rtol=rtol)
    (grad_rows, grad_w), (grad_rows_ref, grad_w_ref) = (
        moe_unpermute_backward_rows(grad_y, rows, slot_N, K, w),
        moe_unpermute_backward_reference(grad_y, rows, dest, w))
    assert grad_rows.dtype == grad_rows_ref.dtype and grad_rows.shape == (N, D)
    torch.testing.assert_close(grad_rows.float(), grad_rows_ref.float(), atol=atol, rtol=rtol)
    if weighted:
        assert grad_w.dtype == w.dtype and grad_w.shape == (T, K)
        torch.testing.assert_close(grad_w, grad_w_ref, atol=1e-4, rtol=1e-5)
        assert torch.count_nonzero(grad_w[dest < 0]) == 0  # a dropped slot gets no gradient
    else:
        assert grad_w is None and grad_w_ref is None


@pytest.mark.parametrize("T,K,D", [(0, 2, 8), (1, 1, 1), (7, 2, 5), (19, 3, 130)])
@pytest.mark.parametrize("weighted", [True, False])
def test_row_path_with_dead_rows(T, K, D, weighted):
    """Rows that belong to no token (slot ``T * K``: the dispatcher's flag rows, one after
    each rank's block) add nothing to y, get a zero gradient and give no gate gradient: the
    results equal the row path without them."""
    g = torch.Generator().manual_seed(T + 17 * D)
    dest, N = _routing(T, K, 0.3, seed=T + 5)
    slot_N = _slots(dest, N)
    rows = torch.randn(N, D, generator=g)
    w = torch.rand(T, K, generator=g) if weighted else None
    grad_y = torch.randn(T, D, generator=g)
    cut = [N // 3, N - N // 3]  # two "ranks": a flag row after each block, garbage in it
    where = [cut[0], N + 1]
    slot_B = torch.cat([slot_N[:cut[0]], torch.tensor([T * K]), slot_N[cut[0]:],
                        torch.tensor([T * K])])
    rows_B = torch.cat([rows[:cut[0]], torch.full((1, D), 7.0), rows[cut[0]:],
                        torch.full((1, D), -3.0)])
    y = moe_unpermute_rows(rows_B, slot_B, K, T, w, dead_rows=True)
    _assert_equal("y", y, moe_unpermute_rows(rows, slot_N, K, T, w))
    grad_rows_B, grad_w = moe_unpermute_backward_rows(grad_y, rows_B, slot_B, K, w, dead_rows=True)
    grad_rows, grad_w_ref = moe_unpermute_backward_rows(grad_y, rows, slot_N, K, w)
    keep = torch.ones(N + 2, dtype=torch.bool)
    keep[where] = False
    _assert_equal("grad of the token rows", grad_rows_B[keep], grad_rows)
    _assert_equal("grad of the dead rows", grad_rows_B[~keep], torch.zeros(2, D))
    if weighted:
        _assert_equal("gate grad", grad_w, grad_w_ref)
    else:
        assert grad_w is None


@pytest.mark.parametrize("backend", [
    "reference", "rows",
    pytest.param("triton", marks=[_skip_without_triton, pytest.mark.interpreter])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_autograd_through_permute_and_unpermute(backend, dtype):
    """x -> permute -> (rows * scale) -> weighted unpermute: gradients of x, scale and w
    against the same computation written with plain torch indexing ("rows": the PyTorch
    path given slot_N, as the dispatcher calls it)."""
    T, K, D = 9, 2, 7
    g = torch.Generator().manual_seed(3)
    dest, N = _routing(T, K, 0.3, seed=11)
    x = torch.randn(T, D, generator=g).to(dtype).to(DEV).requires_grad_()
    scale = torch.randn(N, D, generator=g).to(dtype).to(DEV).requires_grad_()
    w = torch.rand(T, K, generator=g).to(DEV).requires_grad_()
    gy = torch.randn(T, D, generator=g).to(DEV)

    kw = dict(backend="reference", slot_N=_slots(dest, N)) if backend == "rows" else dict(backend=backend)
    rows = kmoe.permute_tokens(x, dest, N, **kw) * scale
    y = kmoe.unpermute_tokens(rows, dest, w, **kw)
    (y.float() * gy).sum().backward()

    xr, sr, wr = (t.detach().clone().float().requires_grad_() for t in (x, scale, w))
    kept = dest >= 0
    t_idx, k_idx = torch.nonzero(kept, as_tuple=True)
    rows_r = torch.zeros(N, D, device=DEV).index_add(0, dest[kept], xr[t_idx]) * sr
    yr = torch.zeros(T, D, device=DEV).index_add(0, t_idx, wr[t_idx, k_idx, None] * rows_r[dest[kept]])
    (yr * gy).sum().backward()
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (5e-2, 5e-2)
    torch.testing.assert_close(y.float(), yr, atol=atol, rtol=rtol)
    torch.testing.assert_close(x.grad.float(), xr.grad, atol=atol, rtol=rtol)
    torch.testing.assert_close(scale.grad.float(), sr.grad, atol=atol, rtol=rtol)
    torch.testing.assert_close(w.grad, wr.grad, atol=atol, rtol=rtol)


def test_launchers_reject_bad_input():
    x = torch.randn(3, 4)
    dest = torch.tensor([[0], [1], [2]])
    with pytest.raises(ValueError, match="backend='cuda'"):
        kmoe.moe_permute(x, dest, 3, backend="cuda")
    with pytest.raises(TypeError, match="expert_ids must be int64"):
        kmoe.moe_counts(dest.int(), 3)
    with pytest.raises(ValueError, match=r"dest_TK must be int64 \[T=3, K\]"):
        kmoe.moe_permute(x, dest[:2], 2)
    with pytest.raises(TypeError, match="float64"):
        kmoe.moe_permute(x.double(), dest, 3)
    with pytest.raises(ValueError, match="weights_TK"):
        kmoe.moe_unpermute(x, dest, torch.ones(3, 2))


def test_import_and_cpu_path_without_triton():
    """`import tribucket.moe` and the CPU path work when triton cannot be imported."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, tribucket, tribucket.moe as m\n"
        "from tribucket.kernels import moe as k\n"
        "assert not k.HAVE_TRITON\n"
        "layer = m.MoELayer([torch.nn.Linear(4, 4) for _ in range(2)], 2, 4, top_k=1)\n"
        "layer(torch.randn(5, 4)).sum().backward()\n"
        "try:\n"
        "    k.moe_counts(torch.zeros(3, dtype=torch.int64), 2, backend='triton')\n"
        "except RuntimeError as e:\n"
        "    assert 'needs triton' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('no error without triton')\n"
        "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_bytes", [4 * 5, 4 * 5 * 7, 1 << 40])
def test_row_path_combine_in_blocks_is_the_one_shot_sum(monkeypatch, dtype, block_bytes):
    """The weighted combine runs a block of rows at a time; whatever the block (one row,
    a ragged last block, one block for everything), every y equals the one-shot sum to the
    bit, dead rows included."""
    from tribucket.kernels import moe_reference

    T, K, D = 23, 3, 5
    g = torch.Generator().manual_seed(11)
    dest, N = _routing(T, K, 0.3, seed=4)
    slot_N = torch.cat([_slots(dest, N), torch.tensor([T * K])])  # a flag row at the end
    rows = torch.randn(N + 1, D, generator=g).to(dtype)
    w = torch.rand(T, K, generator=g)
    token_N = torch.div(slot_N, K, rounding_mode="floor")
    w_N1 = torch.cat([w.reshape(-1), torch.zeros(1)]).index_select(0, slot_N).unsqueeze(1)
    want = torch.zeros(T + 1, D).index_add_(0, token_N, rows.float() * w_N1)[:T].to(dtype)
    monkeypatch.setattr(moe_reference, "ROW_BLOCK_BYTES", block_bytes)
    _assert_equal("y", moe_unpermute_rows(rows, slot_N, K, T, w, dead_rows=True), want)
