"""Deduplicated dispatch: each token sent once per destination rank (``dedup``).

With top-k routing a token often chooses several experts of one rank; the per-slot dispatch
sends its row once per choice. Here the sender packs one row per (token, rank) with the
token's gate weights and expert places for that rank in a few extra columns
(:class:`UniqueRows`); the receiver copies each row to its chosen local experts, in the
per-slot dispatch's order (:func:`expand`), sums the weighted outputs of each row
(:func:`combine_rows`) and returns one row; the sender adds a token's rows up
(:func:`sum_returned`). :class:`~tribucket.moe.dispatcher.MoEDispatcher` runs the exchanges
and the flag rows around these steps.

Shape legend, beside the dispatcher's: U rows this rank sends (one per token and rank), V
rows it receives, B the returned rows with one flag row per rank block, C the row width
(D and the extra columns).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ..kernels.moe import (_use_triton, first_order_only, host_ints, moe_unpermute,
                           moe_unpermute_rows, permute_tokens, unpermute_tokens)
from ._slots import _kept_slots

__all__ = ["UniqueRows"]


@dataclass(frozen=True)
class UniqueRows:
    """A dispatch that sends each token once per destination rank (``dedup``).

    Row ``u`` of the rows this rank sends is token ``slot_U[u] // W`` for rank ``slot_U[u] %
    W`` (rank-major, token order inside a rank). After its ``D`` values come ``meta_cols``
    columns: the token's ``K`` gate weights for that rank's experts (fp32 bits, 0 for slots
    elsewhere), then each slot's place there (int64 bits: ``p * L + l`` for the ``p``-th row
    this rank sends to local expert ``l``, -1 for slots elsewhere). The receiving rank copies
    each row once per local expert it chose, into the per-slot dispatch's order (by local
    expert, then source rank and token), and sums the weighted outputs per row before sending
    one row back; the sender adds up a token's rows (one per rank).
    """

    #: [T, W] int64: the sent row of token t for rank w, -1 where t has no expert there
    dest_TW: torch.Tensor
    #: [U] int64: ``t * W + w`` of each sent row (the inverse of ``dest_TW``)
    slot_U: torch.Tensor
    #: [T, K] int64: the sent row carrying slot (t, k), -1 for a dropped slot
    row_TK: torch.Tensor
    #: [U, K] int64: each slot's ``p * L + l`` on the row's rank, -1 for the other ranks'
    code_UK: torch.Tensor
    #: rows sent to / received from each rank
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    #: columns after D, in the row dtype's units: K fp32 weights, then K int64 places
    weight_cols: int
    meta_cols: int
    #: the receiver's index, filled by :func:`expand` for :func:`combine_rows`
    recv: dict


def count_unique(ids_TK: torch.Tensor, dest_TK: torch.Tensor, L: int, W: int):
    """``(rank_TK, hit_TW, unique_W)``: each slot's rank (W for a dropped slot), whether
    token t has a kept slot on rank w, and the rows this rank would send to each rank."""
    rank_TK = torch.where(dest_TK >= 0, ids_TK // L, W)
    hit_TW = torch.zeros(ids_TK.shape[0], W + 1, dtype=torch.bool, device=ids_TK.device)
    hit_TW = hit_TW.scatter_(1, rank_TK, True)[:, :W]
    return rank_TK, hit_TW, hit_TW.sum(0)


def plan_unique(ids_TK: torch.Tensor, dest_TK: torch.Tensor, sent_E: torch.Tensor,
                 hit_TW: torch.Tensor, rank_TK: torch.Tensor, L: int, *,
                 send_splits: tuple[int, ...], recv_splits: tuple[int, ...],
                 row_dtype: torch.dtype) -> UniqueRows:
    """The sender's side of a deduplicated dispatch (no host read: the sizes came with the
    counts). ``hit_TW``: whether token t has a kept slot on rank w; ``rank_TK``: each slot's
    rank (W for a dropped slot); ``sent_E``: rows kept per expert."""
    T, K = ids_TK.shape
    W = hit_TW.shape[1]
    pos = torch.cumsum(hit_TW.t().reshape(-1), 0) - 1  # rows rank-major, tokens in order
    dest_TW = torch.where(hit_TW, pos.view(W, T).t(), -1)
    slot_U = _kept_slots(dest_TW, sum(send_splits))
    tok_U = torch.div(slot_U, W, rounding_mode="floor")
    w_U = (slot_U - tok_U * W).unsqueeze(1)
    row_TK = torch.where(rank_TK < W, dest_TW.gather(1, rank_TK.clamp(max=W - 1)), -1)
    # each slot's place among the rows sent to its expert (the per-slot dispatch's order)
    code_TK = (dest_TK - (torch.cumsum(sent_E, 0) - sent_E)[ids_TK]) * L + ids_TK.remainder(L)
    keep_UK = rank_TK.index_select(0, tok_U) == w_U
    code_UK = torch.where(keep_UK, code_TK.index_select(0, tok_U), -1)
    unit = row_dtype.itemsize
    return UniqueRows(dest_TW=dest_TW, slot_U=slot_U, row_TK=row_TK, code_UK=code_UK,
                      send_splits=send_splits, recv_splits=recv_splits,
                      weight_cols=K * 4 // unit, meta_cols=K * 12 // unit, recv={})


def pack_rows(x_TD: torch.Tensor, weights_TK: torch.Tensor, u: UniqueRows,
              backend: str) -> torch.Tensor:
    """The rows the sender exchanges: ``[U, D + meta_cols]`` (differentiable in both)."""
    return _PackRows.apply(x_TD, weights_TK, u, backend)


def expand(recv_VC: torch.Tensor, u: UniqueRows, *, d_model: int, top_k: int,
           recv_counts_host, flags: bool, backend: str) -> torch.Tensor:
    """The received rows -> ``expert_input_RD``: each row once per local expert it chose,
    by local expert, then source rank and token (the per-slot dispatch's order). Keeps the
    index and the weights in ``u.recv`` for :func:`combine_rows`; ``flags``: the returned
    blocks carry a flag row each."""
    W, L = len(recv_counts_host), len(recv_counts_host[0])
    D, K, V = d_model, top_k, recv_VC.shape[0]
    R = sum(map(sum, recv_counts_host))
    device = recv_VC.device
    x_VD, w_VK = _UnpackRows.apply(recv_VC, D, u.weight_cols)
    code_VK = _bits(recv_VC.detach()[:, D + u.weight_cols:], torch.int64)
    # row p of source w for local expert l goes to start[l][w] + p (local expert, then
    # source rank, then token order): no sort here
    start_LW = list(itertools.accumulate(
        (recv_counts_host[w][l] for l in range(L) for w in range(W)), initial=0))[:-1]
    src_V = torch.arange(W, device=device).repeat_interleave(
        host_ints(u.recv_splits, device, torch.int64), output_size=V)
    l_VK = code_VK.remainder(L)
    dest_VK = torch.where(
        code_VK >= 0, host_ints(start_LW, device, torch.int64)[l_VK * W + src_V[:, None]]
        + torch.div(code_VK, L, rounding_mode="floor"), -1)
    slot_R = _kept_slots(dest_VK, R)
    recv = {"dest_VK": dest_VK, "slot_R": slot_R, "w_VK": w_VK}
    if flags:  # the returned rows: each rank's block and a flag row
        into_B = torch.arange(V, device=device) + src_V  # past the flag rows before it
        recv["into_B"] = into_B
        recv["dest_BK"] = dest_VK.new_full((V + W, K), -1).index_copy_(0, into_B, dest_VK)
        recv["slot_RB"] = slot_R + src_V[torch.div(slot_R, K, rounding_mode="floor")] * K
    u.recv.clear()
    u.recv.update(recv)
    if _use_triton(backend, x_VD):
        x_VD = x_VD.contiguous()
    return permute_tokens(x_VD, dest_VK, R, backend=backend, slot_N=slot_R)


def combine_rows(out_RD: torch.Tensor, u: UniqueRows, *, flags: bool,
                 backend: str) -> torch.Tensor:
    """The rows to return: each received row's weighted sum over its local experts (fp32),
    with a zero flag row after each rank's block when ``flags``."""
    r = u.recv
    # taken out of the plan: the weights carry the step's graph, which holds the plan
    # (_PackRows' ctx), a cycle reference counting alone would never free
    w_VK = r.pop("w_VK")
    if not flags:
        return unpermute_tokens(out_RD, r["dest_VK"], w_VK, backend=backend,
                                slot_N=r["slot_R"])
    # the "tokens" are the rows to return, flag rows included (they get no slot: zero)
    w_BK = w_VK.new_zeros(r["dest_BK"].shape).index_copy(0, r["into_B"], w_VK)
    return unpermute_tokens(out_RD, r["dest_BK"], w_BK, backend=backend, slot_N=r["slot_RB"])


def sum_returned(back: torch.Tensor, u: UniqueRows, num_tokens: int, *, flags: bool,
                 backend: str) -> torch.Tensor:
    """``y_TD``: each token's returned rows added up (one per rank it reached); with
    ``flags`` each rank's block ends with a flag row, which belongs to no token."""
    W, T = u.dest_TW.shape[1], num_tokens
    if not flags:
        return unpermute_tokens(back, u.dest_TW, None, backend=backend, slot_N=u.slot_U)
    if _use_triton(backend, back):
        dest_TW = torch.where(u.dest_TW >= 0,  # past the flag rows before each rank's block
                              u.dest_TW + torch.arange(W, device=u.dest_TW.device), -1)
        return unpermute_tokens(back, dest_TW, None, backend=backend, dead_rows=True)
    # a flag row's token is T: a spare row, cut off
    tok_U = torch.div(u.slot_U, W, rounding_mode="floor")
    spare = tok_U.new_full((1,), T)
    pieces = tok_U.split(list(u.send_splits))
    return _SumRows.apply(back, torch.cat([p for w in range(W) for p in (pieces[w], spare)]), T)


def _bits(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t``'s bytes read as ``dtype`` (the last dimension rescaled): how the fp32 weights and
    int64 places of :class:`UniqueRows` ride in columns of the rows' dtype, unchanged."""
    t = t.contiguous()
    # a column slice of one row; or a last dimension of size 1 (or an empty tensor) with
    # another stride than 1, which torch calls contiguous but will not reinterpret
    if t.stride(-1) != 1 or (t.storage_offset() * t.element_size()) % dtype.itemsize:
        t = t.clone(memory_format=torch.contiguous_format)
    return t.view(dtype)


class _PackRows(torch.autograd.Function):
    """``x_TD`` -> the rows a deduplicated dispatch sends: ``[U, D + meta_cols]``, each
    (token, rank) row with its gate weights and places there (:class:`UniqueRows`).
    Backward: a token's row gradients summed (fp32), and the weights' gradients (computed
    where the experts are, returned in the weight columns) put back in their slots."""

    @staticmethod
    def forward(ctx, x_TD, weights_TK, u: UniqueRows, backend: str = "auto"):
        (T, D), K, W = x_TD.shape, weights_TK.shape[1], u.dest_TW.shape[1]
        half = u.weight_cols
        tok_U = torch.div(u.slot_U, W, rounding_mode="floor")
        out = x_TD.new_empty((u.slot_U.shape[0], D + u.meta_cols))
        torch.index_select(x_TD, 0, tok_U, out=out[:, :D])
        w_UK = torch.where(u.code_UK >= 0, weights_TK.detach().index_select(0, tok_U).float(), 0.0)
        out[:, D:D + half] = _bits(w_UK, x_TD.dtype)
        out[:, D + half:] = _bits(u.code_UK, x_TD.dtype)
        ctx.u, ctx.shape, ctx.backend, ctx.w_dtype = u, (T, K, D), backend, weights_TK.dtype
        return out

    @staticmethod
    def backward(ctx, grad_UC):
        first_order_only()
        u, (T, K, D) = ctx.u, ctx.shape
        W, half = u.dest_TW.shape[1], u.weight_cols
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            g_UD = grad_UC[:, :D]
            if _use_triton(ctx.backend, g_UD):
                grad_x = moe_unpermute(g_UD.contiguous(), u.dest_TW, None, backend=ctx.backend)
            else:
                grad_x = moe_unpermute_rows(g_UD, u.slot_U, W, T)
        if ctx.needs_input_grad[1]:
            grad_w = grad_UC.new_zeros((T, K), dtype=torch.float32)
            if u.slot_U.numel():
                grad_w_UK = _bits(grad_UC[:, D:D + half], torch.float32)
                k = torch.arange(K, device=grad_UC.device)
                grad_w = torch.where(u.row_TK >= 0, grad_w_UK[u.row_TK.clamp(min=0), k], 0.0)
            grad_w = grad_w.to(ctx.w_dtype)
        return grad_x, grad_w, None, None


class _UnpackRows(torch.autograd.Function):
    """Received deduplicated rows -> ``(x_VD, weights_VK)`` (a view of the values and the
    fp32 weights); backward packs both gradients back into the rows' layout for the reverse
    exchange (zeros in the place columns)."""

    @staticmethod
    def forward(ctx, recv_VC, D: int, weight_cols: int):
        ctx.layout = (recv_VC.shape, D, weight_cols, recv_VC.dtype)
        return recv_VC[:, :D], _bits(recv_VC[:, D:D + weight_cols], torch.float32)

    @staticmethod
    def backward(ctx, grad_x_VD, grad_w_VK):
        first_order_only()
        shape, D, weight_cols, dtype = ctx.layout
        device = (grad_x_VD if grad_x_VD is not None else grad_w_VK).device
        grad = torch.empty(shape, dtype=dtype, device=device)
        for cols, g in ((slice(0, D), grad_x_VD), (slice(D, D + weight_cols), grad_w_VK)):
            if g is None:
                grad[:, cols] = 0
            else:
                grad[:, cols] = g if cols.start == 0 else _bits(g.float(), dtype)
        grad[:, D + weight_cols:] = 0  # the places: no gradient
        return grad, None, None


class _SumRows(torch.autograd.Function):
    """``y_TD[t] = sum of rows_BD[b] with tok_B[b] == t`` (fp32 accumulation; ``tok_B`` may
    hold ``T``: a row of no token). Backward: each row gets its token's gradient (zero for
    the rows of no token, from a padded zero row: no mask pass)."""

    @staticmethod
    def forward(ctx, rows_BD, tok_B, T: int):
        src = rows_BD if rows_BD.dtype == torch.float32 else rows_BD.float()
        y = src.new_zeros((T + 1, rows_BD.shape[1])).index_add_(0, tok_B, src)[:T]
        ctx.save_for_backward(tok_B)
        ctx.dtype = rows_BD.dtype
        return y.to(rows_BD.dtype)

    @staticmethod
    def backward(ctx, grad_y_TD):
        first_order_only()
        (tok_B,) = ctx.saved_tensors
        padded = torch.nn.functional.pad(grad_y_TD, (0, 0, 0, 1))
        return padded.index_select(0, tok_B).to(ctx.dtype), None, None
