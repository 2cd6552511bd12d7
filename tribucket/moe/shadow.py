"""Shadow experts (FasterMoE): which experts to replicate on every rank for one forward.

Shape legend (suffixes on names):
    W  ranks in the expert-parallel group   E  experts (global), E = W * L
    L  experts per rank                     D  model dimension
    P  parameters of one expert (elements)

A *shadowed* expert's parameters are broadcast from its owner; every rank then computes its
own tokens for that expert locally instead of sending them, and in backward the copies'
parameter gradients are reduced back to the owner and added to its gradients. That trades
one broadcast and one reduce of ``P`` parameters for the token traffic to a hot expert and,
above all, for the compute imbalance of the rank that owns it.

A policy sees every rank's routing (``counts_WE[w][e]``: rows rank ``w`` sends to expert
``e`` after capacity drops, gathered on the counts exchange) and returns the set of expert
ids to shadow. Every rank runs the same deterministic policy on the same integers, so all
ranks agree without further communication.

* :class:`GreedyShadowPolicy` — FasterMoE's rule: take experts from the most loaded down and
  keep shadowing while the predicted step time falls, with the latency model of
  :meth:`GreedyShadowPolicy.predict_step_time`.
* :class:`FixedShadowPolicy` — always the given experts (tests, or a known hot expert).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

__all__ = ["FixedShadowPolicy", "GreedyShadowPolicy", "ShadowCosts", "resolve_shadow_policy"]


@dataclass(frozen=True)
class ShadowCosts:
    """The sizes a latency model needs, from the layer (the same on every rank)."""

    #: L: experts per rank (expert ``e`` lives on rank ``e // L``)
    num_local_experts: int
    #: D: elements per token row
    d_model: int
    #: P: parameters (elements) of one expert
    expert_numel: int
    #: bytes per element of a token row (the activations' dtype)
    token_bytes: int
    #: bytes per element of the expert parameters
    param_bytes: int


@dataclass(frozen=True)
class GreedyShadowPolicy:
    """FasterMoE's greedy shadowing rule with a latency model whose constants are options.

    Experts are taken from the most loaded (rows from all ranks; ties: lower id) down; each
    is shadowed while that lowers :meth:`predict_step_time`, and the first that would not
    stops the search (so a cold expert is never shadowed ahead of a hot one).

    The defaults are FasterMoE's figures for a V100 cluster (a 50 Gbit/s link, 11.5 TFLOP/s
    of GEMM); on other hardware measure yours (``perf/bench_moe.py`` calibrates both on the
    machine it runs on) — only their ratio matters to the decision.
    """

    #: bytes per second one rank can send (and receive) over its link
    bandwidth: float = 50e9 / 8
    #: FLOP per second one rank's experts sustain
    flop_rate: float = 11.5e12
    #: forward FLOPs of one expert per token row; None: ``2 · P`` (a multiply and an add per
    #: parameter, exact for Linear layers up to the biases)
    flops_per_row: float | None = None
    #: at most this many experts shadowed per forward (None: no cap)
    max_shadows: int | None = None

    def __post_init__(self):
        for name in ("bandwidth", "flop_rate"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
                raise ValueError(f"GreedyShadowPolicy.{name} must be a positive finite number, got {v!r}")
        f = self.flops_per_row
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float))
                              or not (math.isfinite(f) and f > 0)):
            raise ValueError(f"GreedyShadowPolicy.flops_per_row must be None (2 x expert parameters) "
                             f"or a positive number, got {f!r}")
        m = self.max_shadows
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 0):
            raise ValueError(f"GreedyShadowPolicy.max_shadows must be None or an int >= 0, got {m!r}")

    #: the policy reads every rank's routing (the layer gathers it on the counts exchange)
    needs_counts = True

    # -- the latency model ---------------------------------------------------------------
    def predict_step_time(self, counts_WE: Sequence[Sequence[int]], shadowed: Iterable[int],
                          costs: ShadowCosts) -> float:
        """Predicted seconds of one forward+backward of the layer with ``shadowed`` experts.

        With ``c[w][e]`` the rows rank ``w`` sends to expert ``e``, owner ``o(e) = e // L``,
        ``S`` the shadowed set, ``F`` the forward FLOPs per row, ``P`` the expert's
        parameters and ``b_t``, ``b_p`` bytes per token / parameter element::

            rows_r = sum_{e not in S, o(e) = r} sum_w c[w][e]  +  sum_{e in S} c[r][e]
            out_r  = sum_{e not in S, o(e) != r} c[r][e]             # rows r sends away
            in_r   = sum_{e not in S, o(e) = r} sum_{w != r} c[w][e] # rows r receives
            T(S) = max_r ( 3 · F · rows_r / flop_rate                # forward + 2x backward
                         + 4 · D · b_t · max(out_r, in_r) / bandwidth )  # 2 exchanges each way
                   + 2 · |S| · P · b_p / bandwidth                   # broadcast + grad reduce

        The slowest rank sets the pace (the exchanges wait for it); compute and traffic are
        added, not overlapped, as in FasterMoE's model — a pessimistic bound that keeps the
        rule from shadowing when the broadcast would merely hide behind compute.
        """
        shadowed = set(shadowed)
        rows, out, inn = self._loads(counts_WE, shadowed, costs.num_local_experts)
        return self._time(rows, out, inn, len(shadowed), costs)

    def decide(self, counts_WE: Sequence[Sequence[int]], costs: ShadowCosts) -> frozenset[int]:
        """The experts to shadow for this routing (see the class docstring)."""
        W = len(counts_WE)
        E = len(counts_WE[0]) if W else 0
        L = costs.num_local_experts
        if W <= 1:  # every expert is local already
            return frozenset()
        load_E = [sum(counts_WE[w][e] for w in range(W)) for e in range(E)]
        rows, out, inn = self._loads(counts_WE, set(), L)
        best = self._time(rows, out, inn, 0, costs)
        chosen: list[int] = []
        cap = E if self.max_shadows is None else self.max_shadows
        for e in sorted(range(E), key=lambda e: (-load_E[e], e)):
            if len(chosen) >= cap or load_E[e] == 0:
                break
            # shadowing e: its owner keeps only its own rows; every other rank computes its
            # rows for e itself and stops sending them
            o = e // L
            remote = load_E[e] - counts_WE[o][e]
            rows2, out2, inn2 = list(rows), list(out), list(inn)
            rows2[o] -= remote
            inn2[o] -= remote
            for r in range(W):
                if r != o:
                    rows2[r] += counts_WE[r][e]
                    out2[r] -= counts_WE[r][e]
            t = self._time(rows2, out2, inn2, len(chosen) + 1, costs)
            if not t < best:
                break
            best, chosen = t, chosen + [e]
            rows, out, inn = rows2, out2, inn2
        return frozenset(chosen)

    # -------------------------------------------------------------------------------------
    @staticmethod
    def _loads(counts_WE, shadowed: set[int], L: int) -> tuple[list[int], list[int], list[int]]:
        """Per rank: rows computed, rows sent away, rows received (see predict_step_time)."""
        W = len(counts_WE)
        E = len(counts_WE[0]) if W else 0
        rows, out, inn = [0] * W, [0] * W, [0] * W
        for e in range(E):
            o = e // L
            for w in range(W):
                c = counts_WE[w][e]
                if e in shadowed:
                    rows[w] += c
                else:
                    rows[o] += c
                    if w != o:
                        out[w] += c
                        inn[o] += c
        return rows, out, inn

    def _time(self, rows, out, inn, num_shadowed: int, costs: ShadowCosts) -> float:
        flops_per_row = self.flops_per_row if self.flops_per_row is not None else 2.0 * costs.expert_numel
        row_bytes = costs.d_model * costs.token_bytes
        per_rank = [3.0 * flops_per_row * r / self.flop_rate + 4.0 * row_bytes * max(o, i) / self.bandwidth
                    for r, o, i in zip(rows, out, inn)]
        shadow = 2.0 * num_shadowed * costs.expert_numel * costs.param_bytes / self.bandwidth
        return max(per_rank, default=0.0) + shadow


@dataclass(frozen=True)
class FixedShadowPolicy:
    """Shadow the same experts on every forward (``MoELayer(shadow_policy={0, 5})``)."""

    experts: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self):
        ids = list(self.experts)
        bad = [e for e in ids if isinstance(e, bool) or not isinstance(e, int) or e < 0]
        if bad:
            raise ValueError(f"FixedShadowPolicy: expert ids must be ints >= 0, got {bad!r}")
        object.__setattr__(self, "experts", frozenset(ids))

    #: a fixed set needs no routing information (no counts are gathered)
    needs_counts = False

    def decide(self, counts_WE, costs: ShadowCosts) -> frozenset[int]:
        return self.experts


def resolve_shadow_policy(policy, num_experts: int):
    """``MoELayer``'s ``shadow_policy`` argument as a policy object (or None).

    ``None``: no shadowing; ``"greedy"``: :class:`GreedyShadowPolicy` with its defaults; a
    set / frozenset / list / tuple of expert ids: :class:`FixedShadowPolicy`; a policy object
    (anything with ``decide(counts_WE, costs)`` and a ``needs_counts`` attribute) as is.
    """
    if policy is None:
        return None
    if isinstance(policy, str):
        if policy != "greedy":
            raise ValueError(f"shadow_policy={policy!r}: the only named policy is 'greedy' "
                             f"(or pass a set of expert ids, or a policy object)")
        return GreedyShadowPolicy()
    if isinstance(policy, (set, frozenset, list, tuple)):
        policy = FixedShadowPolicy(frozenset(policy))
    if not (callable(getattr(policy, "decide", None)) and hasattr(policy, "needs_counts")):
        raise TypeError(f"shadow_policy must be None, 'greedy', a set of expert ids or a policy "
                        f"object with decide(counts_WE, costs) and needs_counts, got {policy!r}")
    if isinstance(policy, FixedShadowPolicy):
        out = sorted(e for e in policy.experts if e >= num_experts)
        if out:
            raise ValueError(f"shadow_policy names expert(s) {out}, outside 0..{num_experts - 1} "
                             f"(num_experts={num_experts})")
    return policy
