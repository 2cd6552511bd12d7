"""The gate of :class:`~tribucket.moe.MoELayer`: router logits to each token's experts and
combine weights, and the balancing loss. Pure tensor math, no communication.

Shape legend: T tokens, E experts (global), K experts per token (top-k).
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

import torch

__all__ = ["SCORE_FUNCS", "TrainedLoad", "aux_loss", "check_group_limits", "limit_to_groups",
           "route"]

#: how router logits become scores: softmax over experts, or a sigmoid per expert (DeepSeek-V3)
SCORE_FUNCS = ("softmax", "sigmoid")


def route(logits_TE: torch.Tensor, top_k: int, *, score_func: str = "softmax",
          normalize_weights: bool = True, bias_E: torch.Tensor | None = None,
          groups: tuple[int, int] | None = None, route_scale: float = 1.0,
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(probs_TE, weights_TK, expert_ids_TK)`` from fp32 logits.

    Scores are ``softmax(logits)`` or ``sigmoid(logits)``; ``probs_TE`` are the scores as a
    distribution per token (what the balancing loss takes). The choice is the top-k of the
    scores, plus ``bias_E`` when given, limited to each token's best groups when ``groups =
    (expert groups, groups kept)`` (:func:`limit_to_groups`); bias and groups move the choice
    only: the weights are the chosen scores, renormalised to sum to 1 when
    ``normalize_weights`` (exactly 1 with ``top_k=1``, so ``y`` gives the router no gradient),
    then times ``route_scale``. ``torch.topk``'s order on ties.
    """
    if score_func == "softmax":
        scores_TE = torch.softmax(logits_TE, dim=-1)
        probs_TE = scores_TE
    else:
        scores_TE = torch.sigmoid(logits_TE)
        # the balance loss wants a distribution per token: the scores, normalised
        probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    if bias_E is not None or groups is not None:
        choice_TE = scores_TE.detach()
        if bias_E is not None:
            choice_TE = choice_TE + bias_E
        if groups is not None:
            choice_TE = limit_to_groups(choice_TE, *groups)
        _, expert_ids_TK = torch.topk(choice_TE, top_k, dim=-1)
        weights_TK = scores_TE.gather(1, expert_ids_TK)
    else:
        weights_TK, expert_ids_TK = torch.topk(scores_TE, top_k, dim=-1)
    if normalize_weights and top_k == 1:
        # p / p is 1 up to rounding: use exactly 1, so y gives the router no gradient
        weights_TK = torch.ones_like(weights_TK)
    elif normalize_weights:
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    if route_scale != 1.0:
        weights_TK = weights_TK * route_scale
    return probs_TE, weights_TK, expert_ids_TK


def limit_to_groups(choice_TE: torch.Tensor, groups: int, limited: int) -> torch.Tensor:
    """DeepSeek-V3's group-limited choice: experts in ``groups`` runs of consecutive ids, a
    group's score the sum of its two best choice scores (its one score with one expert per
    group); each token keeps its ``limited`` best groups and the others' experts get -inf,
    so the top-k picks inside the kept groups only.

    Example: 4 experts in 2 groups, scores ``[.9, .1, .5, .4]``, 1 group kept: group 0 has
    1.0, group 1 has 0.9, so ``[.9, .1, -inf, -inf]``.
    """
    T, E = choice_TE.shape
    by_group_TGN = choice_TE.view(T, groups, E // groups)
    group_TG = by_group_TGN.topk(min(2, E // groups), dim=-1).values.sum(-1)
    kept_TM = group_TG.topk(limited, dim=-1).indices
    dropped_TG = torch.ones_like(group_TG, dtype=torch.bool).scatter_(1, kept_TM, False)
    return by_group_TGN.masked_fill(dropped_TG.unsqueeze(-1), float("-inf")).view(T, E)


def check_group_limits(groups, limited, num_experts: int, top_k: int) -> None:
    """``num_expert_groups`` / ``num_limited_groups``: both None, or ints that fit."""
    if groups is None and limited is None:
        return
    for name, v in (("num_expert_groups", groups), ("num_limited_groups", limited)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int (group-limited routing needs both "
                             f"num_expert_groups and num_limited_groups), got {v!r}")
    if num_experts % groups:
        raise ValueError(f"num_expert_groups={groups} does not divide num_experts={num_experts}: "
                         f"the groups are equal runs of consecutive expert ids")
    if limited > groups:
        raise ValueError(f"num_limited_groups={limited} is more than num_expert_groups={groups}")
    if top_k > limited * (num_experts // groups):
        raise ValueError(f"top_k={top_k} experts cannot be chosen from num_limited_groups="
                         f"{limited} group(s) of {num_experts // groups} experts: raise "
                         f"num_limited_groups or lower top_k")


def aux_loss(logits_TE: torch.Tensor, probs_TE: torch.Tensor, counts_E: torch.Tensor,
             top_k: int, aux_loss_coef: float, z_loss_coef: float) -> torch.Tensor:
    """``aux_loss_coef · E · sum_e f_e · P_e + z_loss_coef · mean_t(logsumexp(logits_t)²)``
    (Switch's balancing loss, ``f_e`` the fraction of the T·k token-slots routed to ``e``,
    ``P_e`` the mean of ``probs[:, e]``; ST-MoE's z-loss); a zero that still reaches the
    router when there are no tokens."""
    T, E = logits_TE.shape
    if T == 0:
        return logits_TE.sum() * 0.0
    f_E = counts_E.to(torch.float32) / (T * top_k)
    loss = aux_loss_coef * (E * torch.dot(f_E, probs_TE.mean(dim=0)))
    if z_loss_coef:
        loss = loss + z_loss_coef * torch.logsumexp(logits_TE, dim=-1).square().mean()
    return loss


class TrainedLoad:
    """The token-slots routed to each expert by the forwards that train, since the last
    routing-bias update: what aux-loss-free balancing learns from. Each forward counts once:

    - a training-mode forward with autograd counts;
    - one without autograd does not (an EMA target, a look at the routing, the first pass of
      a reentrant activation checkpoint);
    - a forward run again inside backward (an activation checkpoint's recompute) counts only
      when its first pass did not: a non-reentrant checkpoint repeats a counted pass, a
      reentrant one the pass without autograd. A recompute routes exactly as its first pass
      (same input, weights and bias), so the first pass's counts identify it.

    ``counts`` is a plain list (read by the bias update); the same on every rank of the group
    when fed the group's counts.
    """

    #: counted passes remembered for their recompute; a checkpoint's recompute comes in the
    #: backward of its own micro-batch, long before this many forwards have run
    REMEMBERED = 128

    def __init__(self, num_experts: int):
        self.counts: list[int] = [0] * num_experts
        self._counted: deque[tuple[int, ...]] = deque(maxlen=self.REMEMBERED)

    def add(self, counts_E: Sequence[int]) -> None:
        """Count one training-mode forward's ``counts_E`` (token-slots per expert) if it trains
        and was not counted before."""
        key = tuple(counts_E)
        if torch._C._current_graph_task_id() != -1:  # run again inside backward
            if key in self._counted:
                self._counted.remove(key)  # its first pass counted
                return
        elif not torch.is_grad_enabled():
            return
        else:
            self._counted.append(key)
        self.counts = [a + c for a, c in zip(self.counts, key)]

    def take(self) -> list[int]:
        """The counts so far; the count restarts."""
        counts, self.counts = self.counts, [0] * len(self.counts)
        self._counted.clear()
        return counts
