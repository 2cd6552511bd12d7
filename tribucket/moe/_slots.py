"""Token-slots to rows: the stable sort by expert a dispatch plans from, and its inverse.

A slot is ``t * K + k`` (token ``t``'s ``k``-th choice); a row is its place in the rows sent,
grouped by expert (or, for :mod:`tribucket.moe.dedup`, by destination rank).
"""

from __future__ import annotations

import torch


def _route(expert_ids_TK: torch.Tensor, counts_E: torch.Tensor,
           capacity: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dest_TK, sent_E, order_S)``: each slot's row in expert order, rows kept per
    expert, and the sort (``order_S[i]``: the slot in sorted position ``i``; dropless, the
    slot filling row ``i``).

    Slots are ordered by expert, then token (a stable sort of the token-major ids), so with a
    capacity the slots past ``capacity`` in token order are the ones dropped (dest -1).
    """
    T, K = expert_ids_TK.shape
    ids_S = expert_ids_TK.reshape(-1)
    order_S = torch.argsort(ids_S, stable=True)
    pos_S = torch.empty_like(order_S)
    pos_S[order_S] = torch.arange(ids_S.numel(), device=ids_S.device)
    if capacity is None:
        return pos_S.view(T, K), counts_E, order_S
    start_E = torch.cumsum(counts_E, 0) - counts_E
    rank_in_expert_S = pos_S - start_E[ids_S]
    sent_E = counts_E.clamp(max=capacity)
    sent_start_E = torch.cumsum(sent_E, 0) - sent_E
    dest_S = torch.where(rank_in_expert_S < capacity, sent_start_E[ids_S] + rank_in_expert_S,
                         torch.full_like(rank_in_expert_S, -1))
    return dest_S.view(T, K), sent_E, order_S


def _kept_slots(dest_TK: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``slot_N``: the slot filling each of the ``num_rows`` rows (the inverse of ``dest_TK``).

    A scatter with the dropped slots sent to a spare last entry: no boolean mask, so no
    data-dependent size (no host sync on a GPU).
    """
    dest_S = dest_TK.reshape(-1)
    S = dest_S.numel()
    slots = torch.empty(S + 1, dtype=torch.int64, device=dest_S.device)
    slots.scatter_(0, torch.where(dest_S >= 0, dest_S, S), torch.arange(S, device=dest_S.device))
    return slots[:num_rows]
