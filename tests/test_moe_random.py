"""Randomized parity of the MoE layer: hypothesis draws a layer (experts, routing, capacity,
shared experts, schedule, dedup, shadowing...) and two training steps on 2 or 3 gloo ranks;
every rank also computes the same steps densely (every expert here, a Python loop over
experts, no permutation, no communication) and compares the layer's outputs, gradients,
updated weights and routing biases with it. A second test trains the layer inside a model
under ``fused_bucketing`` on 4 ranks, expert-parallel or expert x data parallel, with drawn
reducer options, accumulation and clipping, against the same model written out densely.

At least 40 random layers in CI; set TRIBUCKET_RANDOM_MOE=500 for a longer local run, and
TRIBUCKET_RANDOM_MOE_SEARCH=1 to draw other layers than CI's.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings, strategies as st
from torch import nn

import tribucket
from tribucket.moe import (GroupedExperts, MoELayer, SwiGLUExpert, aux_losses, balance_after_step,
                           expert_data_parallel_groups)
from test_moe_modern import _STACKED, D, F, _as_grouped_names, _experts, _tokens
from test_moe_training import _Net

N_LAYERS = int(os.environ.get("TRIBUCKET_RANDOM_MOE", "40"))
# TRIBUCKET_RANDOM_MOE_SEARCH=1: new draws each run (CI draws the same layers every time)
_DERANDOMIZE = not os.environ.get("TRIBUCKET_RANDOM_MOE_SEARCH")
N_TRAININGS = int(os.environ.get("TRIBUCKET_RANDOM_MOE_TRAININGS", "15"))
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


def _compare_experts(errors, layer, case, ref_experts, first, at):
    """This rank's experts (global ``first`` on) against the reference's, after training."""
    for l in range(case["L"]):
        ref = dict(_as_grouped_names(ref_experts[first + l]))
        if case["grouped"]:
            got = {k: getattr(layer.experts, name) for k, name in _STACKED.items()}
            got = {k: (p.detach()[l].t() if k.endswith("weight") else p.detach()[l])
                   for k, p in got.items() if p is not None}
        else:
            got = {k: p.detach() for k, p in
                   _as_grouped_names(layer.experts[str(first + l)]).items() if p is not None}
        for k, p in got.items():
            if ref.get(k) is not None:
                errors.close(f"{at} expert {first + l} {k} after 2 steps", p, ref[k].detach())


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
    _compare_experts(errors, layer, case, ref_experts, rank * L, f"rank {rank}")
    errors.close(f"rank {rank} router after 2 steps", layer.router.weight.detach(),
                 per_rank[rank][0].weight.detach())
    return list(errors)


def _draws(n: int):
    """The settings of both random tests: ``n`` draws, no shrinking (a case spans collectives
    on every rank, and hypothesis' shrinking of one took longer than the test's timeout,
    which then hid the failing case: the case is printed as drawn)."""
    return settings(max_examples=n, deadline=None, derandomize=_DERANDOMIZE,
                    phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])


@_draws(N_LAYERS)
@given(moe_cases())
def test_random_moe_layers_match_dense_reference(dist_run, case):
    failures = sum(dist_run(_random_moe, case, world_size=case["W"]), [])
    assert not failures, f"case {case}:\n" + "\n".join(failures[:12])


# ---------------------------------------------------------------------------------------
# the layer inside a model, under fused_bucketing, expert x data parallel
# ---------------------------------------------------------------------------------------
_GROUPS: dict = {}  # ep_size -> this worker's (ep, replica) groups, made once (all ranks alike)


def _groups(ep_size: int):
    if ep_size not in _GROUPS:
        _GROUPS[ep_size] = expert_data_parallel_groups(ep_size)
    return _GROUPS[ep_size]


@st.composite
def training_cases(draw):
    """4 ranks: every expert once (EP 4) or twice (EP 2 x 2 replicas), a drawn layer, reducer
    options, accumulation and gradient clipping."""
    ep = draw(st.sampled_from([2, 4]))
    case = draw(moe_cases())
    L, k = case["L"], case["k"]
    E = ep * L
    case.update(W=4, ep=ep, tokens=draw(st.lists(st.integers(0, 7), min_size=4, max_size=4)),
                k=min(k, E), batched=False, grad_scale=None,
                rate=draw(st.sampled_from([0.05, 0.3])),
                micro=draw(st.integers(1, 2)),
                bucket_cap_mb=draw(st.sampled_from([None, 0.0001])),
                find_unused=draw(st.booleans()),
                as_view=draw(st.booleans()),
                clip=draw(st.sampled_from([None, None, 0.05])))
    if case.get("groups") and (E % case["groups"] or case["k"] > case["limited"] * (
            E // case["groups"])):
        case.pop("groups"), case.pop("limited")
    if isinstance(case["shadow"], frozenset):
        case["shadow"] = frozenset(e for e in case["shadow"] if e < E)
    # the status read one backward later (a GPU's default) must not change a value
    case["deferred_status"] = draw(st.sampled_from([None, True]))
    return case


class _Dense(nn.Module):
    """in -> ReLU -> the MoE layer written out (:func:`_reference`) -> head."""

    def __init__(self, router, experts, shared, gate, case, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.inp, self.head = nn.Linear(D, D), nn.Linear(D, D)
        self.router, self.experts = router, nn.ModuleList(experts)
        self.shared, self.gate = nn.ModuleList(shared), gate
        self.case = case
        self.bias_E = torch.randn(len(experts)) * 0.3 if case["bias"] else None
        self.load_E = torch.zeros(len(experts), dtype=torch.long)
        self.aux = 0.0

    def forward(self, x):
        h = torch.relu(self.inp(x))
        y, self.aux, kept_E = _reference(h, self.router, list(self.experts), self.case, self.bias_E)
        if len(self.shared):
            s_TD = sum(m(h) for m in self.shared)
            y = y + (s_TD * torch.sigmoid(self.gate(h)) if self.gate is not None else s_TD)
        self.load_E += kept_E
        return self.head(y)

    def update_bias(self):
        if self.bias_E is not None and int(self.load_E.sum()):
            load = self.load_E.double()
            self.bias_E = self.bias_E + self.case["rate"] * torch.sign(load.mean() - load).float()
        self.load_E.zero_()


def _loss(out, t):  # a sum, not a mean: a rank may have no token (a mean of nothing is NaN)
    return ((out - t) ** 2).sum() * 0.1


def _random_training(case):
    rank, world = dist.get_rank(), dist.get_world_size()
    L, K, seed, ep_size = case["L"], case["k"], case["seed"], case["ep"]
    E = ep_size * L
    ep, replicas = _groups(ep_size)
    experts = _experts(case["kind"], E, seed)
    torch.manual_seed(seed + 1)
    router = nn.Linear(D, E, bias=False)
    shared = [SwiGLUExpert(D, F) for _ in range(case["shared"])]
    gate = nn.Linear(D, 1, bias=False) if case["gate"] else None
    ref = _Dense(copy.deepcopy(router), copy.deepcopy(experts), copy.deepcopy(shared),
                 copy.deepcopy(gate), case, seed)
    first = dist.get_rank(ep) * L
    mine = [copy.deepcopy(experts[e]) for e in range(first, first + L)]
    local = GroupedExperts.from_experts(mine, impl=case["impl"]) if case["grouped"] else mine
    layer = MoELayer(local, E, D, top_k=K, router=copy.deepcopy(router), group=ep,
                     replica_group=replicas, capacity_factor=case["capacity"],
                     normalize_weights=case["normalize"], schedule=case["schedule"],
                     group_size=case.get("group_size", 4), shadow_policy=case["shadow"],
                     aux_loss_coef=case["aux"], z_loss_coef=case["z"], backend=case["backend"],
                     shared_experts=copy.deepcopy(shared) or None, shared_gate=case["gate"],
                     score_func=case["score"],
                     bias_update_rate=case["rate"] if case["bias"] else None,
                     num_expert_groups=case.get("groups"), num_limited_groups=case.get("limited"),
                     route_scale=case["scale"], dedup=case["dedup"])
    if gate is not None:
        layer.shared_gate.load_state_dict(gate.state_dict())
    if ref.bias_E is not None:
        with torch.no_grad():
            layer.expert_bias.copy_(ref.bias_E)
    model = _Net(layer, seed)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    balance_after_step(opt, model)

    def data(r, step, micro):
        return _tokens(seed + 100 * step + 10 * micro, r, case["tokens"][(r + micro) % world])

    errors = _Errors()
    with tribucket.fused_bucketing(model, bucket_cap_mb=case["bucket_cap_mb"],
                                   find_unused_parameters=case["find_unused"],
                                   gradient_as_bucket_view=case["as_view"],
                                   deferred_status=case.get("deferred_status")) as reducer:
        for step in range(2):
            for micro in range(case["micro"]):
                x, t = data(rank, step, micro)
                last = micro == case["micro"] - 1
                with contextlib.nullcontext() if last else reducer.no_sync():
                    out = _loss(model(x), t)
                    (out + aux_losses(model) if case.get("add_aux", True) else out).backward()
            if case.get("clip") is not None:  # the norm over every rank's experts
                tribucket.clip_grad_norm_(model, case["clip"])
            opt.step()
            opt.zero_grad()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for step in range(2):  # every rank's micro-batches; DDP's mean over the ranks
        total = 0.0
        for r in range(world):
            for micro in range(case["micro"]):
                x, t = data(r, step, micro)
                total = total + _loss(ref(x), t) + (ref.aux if case.get("add_aux", True) else 0.0)
        (total / world).backward()
        if case.get("clip") is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), case["clip"])
        ref_opt.step()
        ref_opt.zero_grad()
        ref.update_bias()
    want = {"inp.weight": ref.inp.weight, "inp.bias": ref.inp.bias, "head.weight": ref.head.weight,
            "head.bias": ref.head.bias, "moe.router.weight": ref.router.weight}
    if gate is not None:
        want["moe.shared_gate.weight"] = ref.gate.weight
    for i, m in enumerate(ref.shared):
        for n, p in m.named_parameters():
            want[f"moe.shared_experts.{i}.{n}"] = p
    got = dict(model.named_parameters())
    for n, p in want.items():
        errors.close(f"rank {rank} {n} after 2 steps", got[n].detach(), p.detach())
    _compare_experts(errors, layer, case, list(ref.experts), first, f"rank {rank}")
    if ref.bias_E is not None:
        errors.close(f"rank {rank} expert_bias after 2 steps", layer.expert_bias, ref.bias_E)
    return list(errors)


@_draws(N_TRAININGS)
@given(training_cases())
def test_random_moe_training_matches_dense_reference(dist_run, case):
    failures = sum(dist_run(_random_training, case, world_size=4), [])
    assert not failures, f"case {case}:\n" + "\n".join(failures[:12])


# top-1 with weights renormalised (exactly 1): the router reaches the loss only through the
# layer's aux_loss, which the forward's output does not lead to
_AUX_ONLY = dict(W=4, ep=2, L=2, kind="swiglu", grouped=True, impl="auto", k=1,
                 tokens=[5, 6, 0, 3], batched=False, shared=0, gate=False, score="softmax",
                 bias=False, scale=1.0, normalize=True, capacity=None, aux=0.01, z=1e-3,
                 grad_scale=None, backend="auto", seed=5, schedule="alltoall", shadow=None,
                 dedup=False, rate=0.05, micro=1, bucket_cap_mb=None, find_unused=True,
                 as_view=False)


@pytest.mark.dist
@pytest.mark.parametrize("add_aux", [True, False])
def test_router_reached_only_through_the_aux_loss(dist_run, add_aux):
    """With find_unused_parameters the reducer counts each MoE layer's aux_loss among the
    forward's outputs: a router the loss reaches only through it is used (DDP, which sees
    the returned output only, calls it unused and then fails on its gradient), and if the
    loss leaves the aux loss out, unused, as any parameter the loss does not reach."""
    failures = sum(dist_run(_random_training, dict(_AUX_ONLY, add_aux=add_aux), world_size=4),
                   [])
    assert not failures, "\n".join(failures[:12])
