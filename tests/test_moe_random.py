"""Randomized parity of the MoE layer: hypothesis draws a layer (experts, routing, capacity,
shared experts, schedule, dedup, shadowing...) and two training steps on 2 or 3 gloo ranks;
every rank also computes the same steps densely (every expert here, a Python loop over
experts, no permutation, no communication) and compares the layer's outputs, gradients,
updated weights and routing biases with it.

At least 40 random layers in CI; set TRIBUCKET_RANDOM_MOE=500 for a longer local run, and
TRIBUCKET_RANDOM_MOE_SEARCH=1 to draw other layers than CI's.
"""

from __future__ import annotations

import copy
import math
import os
from fractions import Fraction

import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings, strategies as st
from torch import nn

from tribucket.moe import GroupedExperts, MoELayer, SwiGLUExpert
from test_moe_modern import _STACKED, D, F, _as_grouped_names, _experts, _tokens

N_LAYERS = int(os.environ.get("TRIBUCKET_RANDOM_MOE", "40"))
# TRIBUCKET_RANDOM_MOE_SEARCH=1: new draws each run (CI draws the same layers every time)
_DERANDOMIZE = not os.environ.get("TRIBUCKET_RANDOM_MOE_SEARCH")
LR = 0.1


@st.composite
def moe_cases(draw):
    W = draw(st.sampled_from([2, 2, 3]))
    L = draw(st.integers(1, 3))
    E = W * L
    kind = draw(st.sampled_from(["swiglu", "gelu", "sequential"]))
    grouped = kind != "sequential" and draw(st.booleans())
    k = draw(st.integers(1, min(E, 4)))
    case = dict(W=W, L=L, kind=kind, grouped=grouped, k=k,
                tokens=draw(st.lists(st.integers(0, 9), min_size=W, max_size=W)),
                batched=draw(st.booleans()),  # x as [1, T, D] instead of [T, D]
                shared=draw(st.sampled_from([0, 0, 1, 2])),
                score=draw(st.sampled_from(["softmax", "sigmoid"])),
                bias=draw(st.booleans()),
                scale=draw(st.sampled_from([1.0, 2.5])),
                normalize=draw(st.sampled_from([None, True, False])),
                capacity=draw(st.sampled_from([None, None, 0.5, 1.0, 2.0])),
                aux=draw(st.sampled_from([0.0, 0.01])),
                z=draw(st.sampled_from([0.0, 1e-3])),
                grad_scale=draw(st.sampled_from([None, 1.0])),
                backend=draw(st.sampled_from(["auto", "auto", "auto", "reference", "triton"])),
                seed=draw(st.integers(0, 10 ** 6)))
    case["gate"] = bool(case["shared"]) and draw(st.booleans())
    divisors = [g for g in range(2, E + 1) if E % g == 0]
    if divisors and draw(st.booleans()):
        g = draw(st.sampled_from(divisors))
        fits = [m for m in range(1, g + 1) if k <= m * (E // g)]
        case["groups"], case["limited"] = g, draw(st.sampled_from(fits))
    if grouped:
        case["impl"] = draw(st.sampled_from(["auto", "loop", "grouped_mm", "bmm"]))
        case["schedule"], case["shadow"] = "alltoall", None
    else:
        case["schedule"] = draw(st.sampled_from(["alltoall", "alltoall", "pairwise"]))
        case["group_size"] = draw(st.integers(1, 3))
        case["shadow"] = draw(st.sampled_from(
            [None, None, "greedy", frozenset(draw(st.sets(st.integers(0, E - 1), max_size=2)))]))
    plain = case["schedule"] == "alltoall" and case["shadow"] is None
    case["dedup"] = draw(st.sampled_from([False, True, "auto"])) if plain else False
    return case


def _reference(x_TD, router, experts, case, bias_E):
    """The layer written out for one rank's tokens: ``(y_TD, aux_loss, kept_E)``, the last
    the token-slots each expert computed (what the routing bias balances)."""
    K, E = case["k"], len(experts)
    T = x_TD.shape[0]
    logits_TE = router(x_TD).float()
    if case["score"] == "softmax":
        scores_TE = probs_TE = logits_TE.softmax(-1)
    else:
        scores_TE = logits_TE.sigmoid()
        probs_TE = scores_TE / scores_TE.sum(-1, keepdim=True).clamp_min(1e-20)
    pick_TE = scores_TE.detach().clone()
    if bias_E is not None:
        pick_TE += bias_E
    if case.get("groups"):  # each token keeps its best groups (a group: its two best picks)
        G, n = case["groups"], E // case["groups"]
        for t in range(T):
            row = pick_TE[t].tolist()
            score_of = [sum(sorted(row[g * n:(g + 1) * n], reverse=True)[:2]) for g in range(G)]
            kept = sorted(range(G), key=lambda g: -score_of[g])[:case["limited"]]
            for g in set(range(G)) - set(kept):
                pick_TE[t, g * n:(g + 1) * n] = float("-inf")
    ids_TK = pick_TE.topk(K, -1).indices
    w_TK = scores_TE.gather(1, ids_TK)
    normalize = case["normalize"] if case["normalize"] is not None else K > 1
    if normalize:
        w_TK = torch.ones_like(w_TK) if K == 1 else w_TK / w_TK.sum(-1, keepdim=True)
    w_TK = w_TK * case["scale"]
    counts_E = torch.bincount(ids_TK.reshape(-1), minlength=E)
    keep_TK = torch.ones_like(ids_TK, dtype=torch.bool)
    if case["capacity"] is not None:  # each expert takes the first slots in token order
        cap = math.ceil(Fraction(repr(case["capacity"])) * T * K / E)
        seen = [0] * E
        for t in range(T):
            for j in range(K):
                e = int(ids_TK[t, j])
                keep_TK[t, j] = seen[e] < cap
                seen[e] += 1
    y_TD = torch.zeros_like(x_TD)
    for e, expert in enumerate(experts):
        t_idx, k_idx = torch.nonzero((ids_TK == e) & keep_TK, as_tuple=True)
        if len(t_idx):
            y_TD = y_TD.index_add(0, t_idx, w_TK[t_idx, k_idx, None] * expert(x_TD[t_idx]))
    if T == 0:
        aux = logits_TE.sum() * 0.0
    else:
        aux = case["aux"] * E * torch.dot(counts_E.float() / (T * K), probs_TE.mean(0))
        if case["z"]:
            aux = aux + case["z"] * torch.logsumexp(logits_TE, -1).square().mean()
    return y_TD, aux, torch.bincount(ids_TK[keep_TK], minlength=E)


class _Errors(list):
    def close(self, name, got, want, none_is_zero=False):
        """Record a mismatch (with ``none_is_zero``, a None gradient counts as zeros: an
        expert no row reached)."""
        if got is None and want is None:
            return
        if not none_is_zero and (got is None) != (want is None):
            self.append(f"{name}: got {'None' if got is None else 'a tensor'}, expected "
                        f"{'None' if want is None else 'a tensor'}")
            return
        if got is None or want is None:
            other = want if got is None else got
            if torch.count_nonzero(other):
                self.append(f"{name}: {'got None' if got is None else 'expected None'}, "
                            f"the other is nonzero")
            return
        try:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        except AssertionError as e:
            self.append(f"{name}: {e}")


def _layer_grads(layer, case, l):
    """Local expert ``l``'s gradients, named as its module's parameters."""
    if case["grouped"]:
        out = {}
        for k, name in _STACKED.items():
            p = getattr(layer.experts, name)
            if p is not None:
                g = p.grad[l] if p.grad is not None else None
                out[k] = g.t() if g is not None and k.endswith("weight") else g
        return out
    e = layer.expert_offset + l
    return {k: v.grad for k, v in _as_grouped_names(layer.experts[str(e)]).items()}


def _random_moe(case):
    rank, W = dist.get_rank(), dist.get_world_size()
    L, K, seed = case["L"], case["k"], case["seed"]
    E = W * L
    experts = _experts(case["kind"], E, seed)
    torch.manual_seed(seed + 1)
    router = nn.Linear(D, E, bias=False)
    shared = [SwiGLUExpert(D, F) for _ in range(case["shared"])]
    gate = nn.Linear(D, 1, bias=False) if case["gate"] else None
    bias_E = torch.randn(E) * 0.3 if case["bias"] else None

    mine = [copy.deepcopy(experts[e]) for e in range(rank * L, rank * L + L)]
    local = GroupedExperts.from_experts(mine, impl=case["impl"]) if case["grouped"] else mine
    layer = MoELayer(local, E, D, top_k=K, router=copy.deepcopy(router),
                     capacity_factor=case["capacity"], normalize_weights=case["normalize"],
                     schedule=case["schedule"], group_size=case.get("group_size", 4),
                     shadow_policy=case["shadow"], expert_grad_scale=case["grad_scale"],
                     aux_loss_coef=case["aux"], z_loss_coef=case["z"], backend=case["backend"],
                     shared_experts=copy.deepcopy(shared) or None, shared_gate=case["gate"],
                     score_func=case["score"], bias_update_rate=0.01 if case["bias"] else None,
                     num_expert_groups=case.get("groups"), num_limited_groups=case.get("limited"),
                     route_scale=case["scale"], dedup=case["dedup"])
    if gate is not None:
        layer.shared_gate.load_state_dict(gate.state_dict())
    if bias_E is not None:
        with torch.no_grad():
            layer.expert_bias.copy_(bias_E)
    opt = torch.optim.SGD(layer.parameters(), lr=LR)
    # the reference: the experts shared by every rank; a router, shared experts and gate per
    # rank (their gradients stay local in the layer, so each rank's copy moves on its own)
    ref_experts = copy.deepcopy(experts)
    per_rank = [(copy.deepcopy(router), copy.deepcopy(shared), copy.deepcopy(gate))
                for _ in range(W)]
    ref_params = [p for m in ref_experts for p in m.parameters()]
    ref_opt = torch.optim.SGD(ref_params + [p for r, s, g in per_rank
                                            for m in [r, *s] + ([g] if g is not None else [])
                                            for p in m.parameters()], lr=LR)
    grad_scale = case["grad_scale"] if case["grad_scale"] is not None else 1.0 / W
    errors = _Errors()
    for step in range(2):
        data = [_tokens(seed + 7 * step, r, case["tokens"][r]) for r in range(W)]
        x = data[rank][0].clone()
        x = (x.unsqueeze(0) if case["batched"] else x).requires_grad_()
        y = layer(x)
        ((y * data[rank][1].view_as(y)).sum() + layer.aux_loss).backward()

        total, load_E = 0.0, torch.zeros(E, dtype=torch.long)
        for r in range(W):
            ref_router, ref_shared, ref_gate = per_rank[r]
            xr = data[r][0].clone().requires_grad_()
            yr, aux_r, kept_E = _reference(xr, ref_router, ref_experts, case, bias_E)
            if ref_shared:
                s_TD = sum(m(xr) for m in ref_shared)
                yr = yr + (s_TD * torch.sigmoid(ref_gate(xr)) if ref_gate is not None else s_TD)
            total = total + (yr * data[r][1]).sum() + aux_r
            load_E += kept_E
            if r == rank:
                x_ref, y_ref, aux_ref = xr, yr, aux_r
        total.backward()
        for p in ref_params:
            if p.grad is not None:
                p.grad.mul_(grad_scale)

        at = f"rank {rank} step {step}"
        errors.close(f"{at} y", y.detach().reshape(-1, D), y_ref.detach())
        errors.close(f"{at} aux_loss", layer.aux_loss.detach(), aux_ref.detach())
        errors.close(f"{at} x.grad", x.grad.reshape(-1, D), x_ref.grad)
        my_router, my_shared, my_gate = per_rank[rank]
        errors.close(f"{at} router grad", layer.router.weight.grad, my_router.weight.grad)
        for i, (m, ref) in enumerate(zip(layer.shared_experts or [], my_shared)):
            for (n, p), q in zip(m.named_parameters(), ref.parameters()):
                errors.close(f"{at} shared {i} {n}.grad", p.grad, q.grad)
        if my_gate is not None:
            errors.close(f"{at} gate grad", layer.shared_gate.weight.grad, my_gate.weight.grad)
        for l in range(L):
            e = rank * L + l
            want = {k: v.grad for k, v in _as_grouped_names(ref_experts[e]).items()}
            got = _layer_grads(layer, case, l)
            for k in want:
                errors.close(f"{at} expert {e} {k}.grad", got.get(k), want[k],
                             none_is_zero=True)

        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        layer.update_bias()
        if bias_E is not None and int(load_E.sum()):  # DeepSeek-V3's rule, the group's slots kept
            load = load_E.double()
            bias_E = bias_E + 0.01 * torch.sign(load.mean() - load).float()
        if bias_E is not None:
            errors.close(f"{at} expert_bias after update", layer.expert_bias, bias_E)
    for l in range(L):  # the weights after two steps
        e = rank * L + l
        ref = dict(_as_grouped_names(ref_experts[e]))
        if case["grouped"]:
            for k, name in _STACKED.items():
                p = getattr(layer.experts, name)
                if p is not None and ref.get(k) is not None:
                    errors.close(f"rank {rank} expert {e} {k} after 2 steps",
                                 p.detach()[l].t() if k.endswith("weight") else p.detach()[l],
                                 ref[k].detach())
        else:
            for k, p in _as_grouped_names(layer.experts[str(e)]).items():
                if p is not None:
                    errors.close(f"rank {rank} expert {e} {k} after 2 steps", p.detach(),
                                 ref[k].detach())
    errors.close(f"rank {rank} router after 2 steps", layer.router.weight.detach(),
                 per_rank[rank][0].weight.detach())
    return list(errors)


# no shrinking: a layer spans collectives on every rank, and hypothesis' shrinking of one took
# longer than the test's timeout, which then hid the failing case; the case is printed as drawn
@settings(max_examples=N_LAYERS, deadline=None, derandomize=_DERANDOMIZE,
          phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(moe_cases())
def test_random_moe_layers_match_dense_reference(dist_run, case):
    failures = sum(dist_run(_random_moe, case, world_size=case["W"]), [])
    assert not failures, f"case {case}:\n" + "\n".join(failures[:12])
