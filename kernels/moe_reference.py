"""PyTorch references for the MoE token kernels in ``kernels/moe.py``.

Shape legend (suffixes on tensor names):
    T  tokens on this rank          K  experts per token (top-k)
    D  model dimension              E  experts (global)
    S  token-slots, S = T * K       N  rows of the expert-ordered buffer (kept slots, N <= S)

A token-slot ``s = t * K + k`` is token ``t``'s ``k``-th choice. ``dest_TK[t, k]`` is the row of
the expert-ordered buffer that slot goes to, or ``-1`` when capacity dropped it; the kept
slots map one-to-one onto rows ``0 .. N-1``.

These are the contracts the Triton kernels implement, and the path the launchers take for
CPU tensors, so they are vectorised (``index_select``, ``bmm``, ``bincount``), never a
Python loop over tokens.
"""

from __future__ import annotations

import torch

__all__ = [
    "moe_counts_reference",
    "moe_permute_reference",
    "moe_unpermute_reference",
    "moe_unpermute_backward_reference",
    "moe_permute_rows",
    "moe_unpermute_rows",
    "moe_unpermute_backward_rows",
]


def moe_counts_reference(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens-slots per expert: an int64 ``[E]`` histogram of ``expert_ids`` (any shape)."""
    return torch.bincount(expert_ids.reshape(-1), minlength=num_experts).to(torch.int64)


def _slots_of_rows(dest_TK: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Inverse of ``dest_TK``: the slot ``t * K + k`` that fills each of the ``N`` rows."""
    dest_S = dest_TK.reshape(-1)
    slot_S = torch.arange(dest_S.numel(), device=dest_S.device)
    kept_S = dest_S >= 0
    slot_N = torch.empty(num_rows, dtype=torch.int64, device=dest_S.device)
    slot_N[dest_S[kept_S]] = slot_S[kept_S]
    return slot_N


def moe_permute_reference(x_TD: torch.Tensor, dest_TK: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``out_ND[dest_TK[t, k]] = x_TD[t]`` for every kept slot (a token is copied once per choice)."""
    K = dest_TK.shape[1]
    token_N = _slots_of_rows(dest_TK, num_rows) // K
    return x_TD.index_select(0, token_N)


def _gather_TKD(rows_ND: torch.Tensor, dest_TK: torch.Tensor) -> torch.Tensor:
    """``rows_ND[dest_TK]`` as fp32 ``[T, K, D]``, zero for dropped slots."""
    T, K = dest_TK.shape
    D = rows_ND.shape[1]
    kept_TK = dest_TK >= 0
    if rows_ND.shape[0] == 0:  # every slot dropped (or no tokens): nothing to gather
        return rows_ND.new_zeros((T, K, D), dtype=torch.float32)
    g_TKD = rows_ND.index_select(0, dest_TK.clamp(min=0).reshape(-1)).view(T, K, D).float()
    if not bool(kept_TK.all()):
        # zero the dropped slots' stand-in rows (row 0): 0 * inf would be nan
        g_TKD = g_TKD.masked_fill(~kept_TK.unsqueeze(-1), 0.0)
    return g_TKD


def _effective_weights(dest_TK: torch.Tensor, weights_TK: torch.Tensor | None) -> torch.Tensor:
    """fp32 gate weights with dropped slots zeroed (all ones when ``weights_TK`` is None)."""
    kept_TK = dest_TK >= 0
    if weights_TK is None:
        return kept_TK.to(torch.float32)
    return weights_TK.float().masked_fill(~kept_TK, 0.0)


def moe_unpermute_reference(rows_ND: torch.Tensor, dest_TK: torch.Tensor,
                            weights_TK: torch.Tensor | None = None) -> torch.Tensor:
    """``y_TD[t] = sum_k weights_TK[t, k] * rows_ND[dest_TK[t, k]]`` over kept slots.

    Accumulates in fp32 and returns ``rows_ND.dtype``; ``weights_TK=None`` means weight 1.
    """
    T, K = dest_TK.shape
    D = rows_ND.shape[1]
    if K == 1 and weights_TK is None and rows_ND.shape[0] == T:
        # a pure row gather (every slot kept): no arithmetic, so no fp32 round trip needed
        return rows_ND.index_select(0, dest_TK.reshape(-1))
    w_T1K = _effective_weights(dest_TK, weights_TK).view(T, 1, K)
    y_TD = torch.bmm(w_T1K, _gather_TKD(rows_ND, dest_TK)).view(T, D)
    return y_TD.to(rows_ND.dtype)


def moe_unpermute_backward_reference(
    grad_y_TD: torch.Tensor, rows_ND: torch.Tensor, dest_TK: torch.Tensor,
    weights_TK: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of :func:`moe_unpermute_reference`.

    ``grad_rows_ND[dest_TK[t, k]] = weights_TK[t, k] * grad_y_TD[t]`` (``rows_ND.dtype``) and
    ``grad_weights_TK[t, k] = <grad_y_TD[t], rows_ND[dest_TK[t, k]]>`` (fp32 dot, 0 for a
    dropped slot, ``weights_TK.dtype``; ``None`` when ``weights_TK`` is None).
    """
    T, K = dest_TK.shape
    D = rows_ND.shape[1]
    N = rows_ND.shape[0]
    slot_N = _slots_of_rows(dest_TK, N)
    g_ND = grad_y_TD.index_select(0, slot_N // K)
    if weights_TK is None:
        grad_rows_ND = g_ND.to(rows_ND.dtype)
        return grad_rows_ND, None
    w_N1 = weights_TK.reshape(-1).float().index_select(0, slot_N).unsqueeze(1)
    grad_rows_ND = (g_ND.float() * w_N1).to(rows_ND.dtype)
    # <grad_y[t], rows[dest[t, k]]> for every slot at once: [T, K, D] @ [T, D, 1]
    dots_TK = torch.bmm(_gather_TKD(rows_ND, dest_TK), grad_y_TD.float().view(T, D, 1)).view(T, K)
    return grad_rows_ND, dots_TK.to(weights_TK.dtype)


# ---------------------------------------------------------------------------------------
# The CPU path by rows. The dispatcher knows, from its sort, which token-slot fills each
# row (``slot_N``, the inverse of ``dest_TK``); given it, each op is one gather or one
# index_add over the N rows, with no inverse to rebuild, no [T, K, D] staging copy and no
# host sync on "were slots dropped?" (dropped slots are simply absent from ``slot_N``).
# Same contracts as the functions above (tests check them against each other).
# ---------------------------------------------------------------------------------------
def moe_permute_rows(x_TD: torch.Tensor, slot_N: torch.Tensor, K: int) -> torch.Tensor:
    """:func:`moe_permute_reference` given ``slot_N``: ``out_ND[n] = x_TD[slot_N[n] // K]``."""
    return x_TD.index_select(0, torch.div(slot_N, K, rounding_mode="floor"))


def moe_unpermute_rows(rows_ND: torch.Tensor, slot_N: torch.Tensor, K: int, num_tokens: int,
                       weights_TK: torch.Tensor | None = None, *,
                       dead_rows: bool = False) -> torch.Tensor:
    """:func:`moe_unpermute_reference` given ``slot_N``: ``y[slot_N[n] // K] += w_N[n] · rows[n]``.

    fp32 accumulation (``index_add_`` over the N rows, in row order); returns
    ``rows_ND.dtype``. Example: K = 2, slot_N ``[0, 2, 1]`` (rows of slots 0, 2, 1), w
    ``[[.7, .3], [1., 0.]]`` -> ``y = [.7·r0 + .3·r2, 1·r1]``. The weighted rows are made a
    block of :data:`ROW_BLOCK_BYTES` at a time in one reused buffer: no ``[N, D]`` temporary
    (a fresh one costs a page fault per 4 KiB on the CPU), and each block is added while it
    is still in cache; every row of ``y`` gets its terms in the same order as in one call.

    ``dead_rows=True``: ``slot_N`` may hold ``S = num_tokens · K`` (one past the last slot)
    for rows that belong to no token (the dispatcher's flag rows); they add nothing to ``y``.
    """
    token_N = torch.div(slot_N, K, rounding_mode="floor")
    N, D = rows_ND.shape
    # a dead row's token is num_tokens: one spare row of y takes it, and is cut off
    y_TD = rows_ND.new_zeros((num_tokens + int(dead_rows), D), dtype=torch.float32)
    if weights_TK is None:
        y_TD.index_add_(0, token_N, rows_ND if rows_ND.dtype == torch.float32 else rows_ND.float())
        return y_TD[:num_tokens].to(rows_ND.dtype)
    w_N1 = _slot_weights(weights_TK, dead_rows).index_select(0, slot_N).unsqueeze(1)
    # blocks on the CPU; elsewhere one block (a launch per block would cost more there than
    # the caching allocator's temporary does)
    block = _block_rows(D) if rows_ND.device.type == "cpu" else max(N, 1)
    buf = y_TD.new_empty((min(block, N), D))
    for start in range(0, N, block):
        end = min(N, start + block)
        part = torch.mul(rows_ND[start:end], w_N1[start:end], out=buf[:end - start])
        y_TD.index_add_(0, token_N[start:end], part)
    return y_TD[:num_tokens].to(rows_ND.dtype)


#: the CPU row path's block: :func:`moe_unpermute_rows` weighs this many bytes of CPU rows at a
#: time (measured on a 2-core EPYC, D 256: 256 KiB ties the one-shot product, 1-2 MiB is
#: 20-25% faster; smaller blocks pay index_add_'s per-call cost)
ROW_BLOCK_BYTES = 1 << 20


def _block_rows(D: int) -> int:
    return max(1, ROW_BLOCK_BYTES // (4 * max(D, 1)))


def _slot_weights(weights_TK: torch.Tensor, dead_rows: bool) -> torch.Tensor:
    """fp32 ``[S]`` gate weights by slot, with a 0 appended (slot ``S``) for dead rows."""
    w_S = weights_TK.reshape(-1).float()
    return torch.cat([w_S, w_S.new_zeros(1)]) if dead_rows else w_S


def moe_unpermute_backward_rows(
    grad_y_TD: torch.Tensor, rows_ND: torch.Tensor, slot_N: torch.Tensor, K: int,
    weights_TK: torch.Tensor | None, *, dead_rows: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`moe_unpermute_backward_reference` given ``slot_N``.

    One gather of ``grad_y`` by row, then ``grad_rows = w_N · g_ND`` and the gate gradients
    ``<g_ND[n], rows[n]>`` from that same gather (0 for dropped slots). ``dead_rows`` as in
    :func:`moe_unpermute_rows`: those rows get a zero gradient (given a finite ``grad_y``)
    and no gate gradient.
    """
    T = grad_y_TD.shape[0]
    token_N = torch.div(slot_N, K, rounding_mode="floor")
    if dead_rows:
        if T == 0:  # every row is dead: nothing flows back
            grad_w = None if weights_TK is None else weights_TK.new_zeros(weights_TK.shape)
            return rows_ND.new_zeros(rows_ND.shape), grad_w
        token_N = token_N.clamp_(max=T - 1)  # any real row: its weight below is 0
    g_ND = grad_y_TD.index_select(0, token_N)
    if weights_TK is None:
        if dead_rows:
            g_ND.masked_fill_((slot_N == T * K).unsqueeze(1), 0)
        return g_ND.to(rows_ND.dtype), None
    g_ND = g_ND.float()
    # one [1, D] @ [D, 1] per row (a batched GEMV reads each operand once; vecdot is slower here)
    dots_N = torch.bmm(g_ND.unsqueeze(1), rows_ND.float().unsqueeze(2)).view(-1)
    S = weights_TK.numel()
    grad_w_S = torch.zeros(S + int(dead_rows), dtype=torch.float32, device=slot_N.device)
    grad_w_S.index_copy_(0, slot_N, dots_N)
    w_N = _slot_weights(weights_TK, dead_rows).index_select(0, slot_N)
    grad_rows_ND = g_ND.mul_(w_N.unsqueeze(1)).to(rows_ND.dtype)
    return grad_rows_ND, grad_w_S[:S].view(weights_TK.shape).to(weights_TK.dtype)
