"""Grouped experts, shared experts, sigmoid scores and aux-loss-free balancing, against dense
single-process references.

Shape legend: T tokens, D model dim, F expert hidden width, E experts (global), K top-k,
L experts per rank, W ranks.

As in test_moe: every rank builds every expert, the router and the shared experts from one
seed and regenerates every rank's tokens, so it computes the layer densely (a Python loop
over experts, no permutation, no communication) and compares its own results.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tribucket
from tribucket.kernels.moe import grouped_matmul, grouped_mm_available
from test_moe import _CountCollectives
from test_moe_training import _Net
from tribucket.moe import (GELUExpert, GroupedExperts, MoELayer, SwiGLUExpert, balance_after_step,
                           expert_data_parallel_groups, gathered_experts, update_routing_biases)

D, F = 12, 8  # model and expert hidden width


def _tokens(seed: int, rank: int, T: int):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)


def _experts(kind: str, E: int, seed: int) -> list[nn.Module]:
    torch.manual_seed(seed)
    if kind == "swiglu":
        return [SwiGLUExpert(D, F) for _ in range(E)]
    if kind == "gelu":
        return [GELUExpert(D, F) for _ in range(E)]
    return [nn.Sequential(nn.Linear(D, F), nn.GELU(), nn.Linear(F, D)) for _ in range(E)]


def _dense(x_TD, router, experts, K, *, score="softmax", bias_E=None, shared=(), gate=None,
           groups=None, limited=None, scale=1.0):
    """The layer written out: ``(y_TD, ids_TK, weights_TK)``; the bias picks, scores weigh;
    with ``groups``, each token picks inside its ``limited`` best groups (a group's score:
    the sum of its two best picking scores), token by token."""
    logits_TE = router(x_TD).float()
    scores_TE = logits_TE.softmax(-1) if score == "softmax" else logits_TE.sigmoid()
    pick_TE = scores_TE.detach() + (bias_E if bias_E is not None else 0.0)
    if groups is not None:
        n = pick_TE.shape[1] // groups
        pick_TE = pick_TE.clone()
        for t in range(pick_TE.shape[0]):
            row = pick_TE[t].tolist()
            score_of = [sum(sorted(row[g * n:(g + 1) * n], reverse=True)[:2]) for g in range(groups)]
            best = sorted(range(groups), key=lambda g: -score_of[g])[:limited]
            for g in set(range(groups)) - set(best):
                pick_TE[t, g * n:(g + 1) * n] = float("-inf")
    ids_TK = pick_TE.topk(K, -1).indices
    w_TK = scores_TE.gather(1, ids_TK)
    w_TK = (w_TK / w_TK.sum(-1, keepdim=True) if K > 1 else w_TK) * scale
    y_TD = torch.zeros_like(x_TD)
    for e, expert in enumerate(experts):
        t_idx, k_idx = torch.nonzero(ids_TK == e, as_tuple=True)
        if len(t_idx):
            y_TD = y_TD.index_add(0, t_idx, w_TK[t_idx, k_idx, None] * expert(x_TD[t_idx]))
    if shared:
        s_TD = sum(m(x_TD) for m in shared)
        y_TD = y_TD + (s_TD * torch.sigmoid(gate(x_TD)) if gate is not None else s_TD)
    return y_TD, ids_TK, w_TK


def _both_ways(layer, router, modules, K, x, g, *, bias_E=None, **dense_kw):
    """``layer`` (its bias set to ``bias_E``) and the dense reference, each forward and
    backward of ``(y * g).sum()`` on its own copy of ``x``: ``(y, x)``, ``(y_ref, x_ref,
    the reference's router, ids_TK, weights_TK)``."""
    if bias_E is not None:
        with torch.no_grad():
            layer.expert_bias.copy_(bias_E)
    xl, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = layer(xl)
    (y * g).sum().backward()
    ref_router = copy.deepcopy(router)
    y_ref, ids_TK, w_TK = _dense(xr, ref_router, modules, K, bias_E=bias_E, **dense_kw)
    (y_ref * g).sum().backward()
    return (y, xl), (y_ref, xr, ref_router, ids_TK, w_TK)


def _close(name, got, want, atol=2e-6, rtol=1e-5, rank=0):
    assert got is not None, f"rank {rank}: {name} is None"
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol,
                               msg=lambda m: f"rank {rank}: {name} differs from the reference\n{m}")


# ---------------------------------------------------------------------------------------
# grouped matmul and GroupedExperts (one process; on the GPU too where there is one)
# ---------------------------------------------------------------------------------------
DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["grouped_mm", "bmm", "loop", "auto"])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_grouped_matmul_equals_a_matmul_per_group(impl, dtype, atol, device):
    if impl == "grouped_mm" and not grouped_mm_available(device, dtype):
        pytest.fail(f"torch {torch.__version__} has no {device} grouped_mm for {dtype}")
    torch.manual_seed(0)
    counts = [5, 0, 13, 1, 0]  # odd sizes, empty groups; grouped_mm wants 16-byte rows
    x = torch.randn(sum(counts), 8, dtype=dtype, device=device, requires_grad=True)
    w = torch.randn(5, 8, 16, dtype=dtype, device=device, requires_grad=True)
    y = grouped_matmul(x, w, counts, impl=impl)
    g = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), g)
    xf, wf = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = torch.cat([a @ wf[i] for i, a in enumerate(xf.split(counts))])
    rx, rw = torch.autograd.grad(ref, (xf, wf), g.float(), retain_graph=True)
    assert y.shape == ref.shape and y.dtype == dtype
    for name, a, b in (("y", y, ref), ("x.grad", gx, rx), ("w.grad", gw, rw)):
        _close(f"{impl} {name}", a.float(), b, atol=atol, rtol=atol)
    # a gradient with zero strides (what y.sum() sends back) works too
    gw_sum, = torch.autograd.grad(grouped_matmul(x, w, counts, impl=impl).sum(), (w,))
    _close(f"{impl} w.grad of y.sum()", gw_sum.float(),
           torch.autograd.grad(ref.sum(), (wf,))[0], atol=atol, rtol=atol)
    empty = grouped_matmul(x[:0], w, [0] * 5, impl=impl)
    assert empty.shape == (0, 16)
    with pytest.raises(ValueError, match="one entry per group"):
        grouped_matmul(x, w, counts[:-1], impl=impl)
    if impl in ("auto", "loop", "bmm"):  # rows of 7 and 9 elements: no grouped GEMM, same sums
        x7, w79 = x.detach()[:, :7], w.detach()[:, :7, :9]
        ref7 = torch.cat([a.float() @ w79[i].float() for i, a in enumerate(x7.split(counts))])
        _close(f"{impl} unaligned", grouped_matmul(x7, w79, counts, impl=impl).float(), ref7,
               atol=atol, rtol=atol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["auto", "grouped_mm", "bmm", "loop"])
@pytest.mark.parametrize("kind", ["swiglu", "gelu", "sequential"])
def test_grouped_experts_equal_the_modules_forward_and_backward(kind, impl, device):
    modules = [m.to(device) for m in _experts(kind, 4, seed=1)]
    grouped = GroupedExperts.from_experts(copy.deepcopy(modules), impl=impl)
    assert grouped.w1.device.type == device
    counts = [3, 0, 6, 2]
    x = torch.randn(sum(counts), D, device=device)
    g = torch.randn(sum(counts), D, device=device)
    xg, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    (grouped(xg, counts) * g).sum().backward()
    ref = torch.cat([m(part) for m, part in zip(modules, xr.split(counts))])
    (ref * g).sum().backward()
    _close("y", grouped(x, counts), ref.detach(), atol=1e-5)
    _close("x.grad", xg.grad, xr.grad, atol=1e-5)
    for l, m in enumerate(modules):  # the stacked gradients, in each module's own layout
        linears = [c for c in m.modules() if isinstance(c, nn.Linear)]
        names = ["w1", "w3", "w2"] if kind == "swiglu" else ["w1", "w2"]
        for name, lin in zip(names, linears if kind != "swiglu" else [m.w1, m.w3, m.w2]):
            _close(f"expert {l} {name}.grad", getattr(grouped, name).grad[l].t(), lin.weight.grad,
                   atol=1e-5)
        if kind != "swiglu":
            _close(f"expert {l} b1.grad", grouped.b1.grad[l], linears[0].bias.grad, atol=1e-5)
            _close(f"expert {l} b2.grad", grouped.b2.grad[l], linears[1].bias.grad, atol=1e-5)


def test_auto_runs_few_large_cpu_groups_expert_by_expert(monkeypatch):
    """On the CPU in fp32, ``auto`` takes torch's grouped GEMM for small groups and runs the
    experts one by one (whole MLPs) from CPU_LOOP_MIN_ROWS rows per expert on; bf16 loops."""
    import tribucket.kernels.moe as kmoe
    from tribucket.moe import experts as experts_mod

    min_rows = kmoe.CPU_LOOP_MIN_ROWS
    assert kmoe.pick_grouped_impl("cpu", torch.float32, min_rows - 1) == "grouped_mm"
    assert kmoe.pick_grouped_impl("cpu", torch.float32, min_rows) == "loop"
    assert kmoe.pick_grouped_impl("cpu", torch.float32) == "grouped_mm"
    assert kmoe.pick_grouped_impl("cpu", torch.bfloat16, 10) == "loop"
    calls = []
    real = experts_mod.grouped_matmul
    monkeypatch.setattr(experts_mod, "grouped_matmul",
                        lambda *a, **kw: calls.append(kw["impl"]) or real(*a, **kw))
    m = GroupedExperts(2, 16, 16)
    for rows, want in ((2 * (min_rows - 1), ["grouped_mm"] * 3), (2 * min_rows, [])):
        calls.clear()
        m(torch.randn(rows, 16), [rows // 2, rows // 2])
        assert calls == want, (rows, calls)


def test_grouped_experts_state_dict_is_the_module_list_s():
    modules = _experts("swiglu", 3, seed=2)
    as_list = nn.ModuleDict({str(5 + l): m for l, m in enumerate(modules)})
    grouped = GroupedExperts(3, D, F, first_index=5)
    grouped.load_state_dict(as_list.state_dict())  # a list's checkpoint into the stacks
    sd = grouped.state_dict()
    assert list(sd) == list(as_list.state_dict()), (list(sd), list(as_list.state_dict()))
    for k, v in as_list.state_dict().items():
        assert torch.equal(sd[k], v), k
    back = [SwiGLUExpert(D, F) for _ in range(3)]
    nn.ModuleDict({str(5 + l): m for l, m in enumerate(back)}).load_state_dict(sd)  # and back
    x = torch.randn(4, D)
    for m, b, c in zip(modules, back, grouped.to_experts()):
        assert torch.equal(m(x), b(x)) and torch.equal(m(x), c(x))
    with pytest.raises(TypeError, match="cannot stack"):
        GroupedExperts.from_experts([nn.Linear(D, D)])
    with pytest.raises(ValueError, match="activation"):
        GroupedExperts(2, D, F, activation="relu")


def test_layer_state_dict_round_trip_between_grouped_and_module_list():
    torch.manual_seed(3)
    modules = _experts("swiglu", 4, seed=3)
    shared = SwiGLUExpert(D, F)
    a = MoELayer(copy.deepcopy(modules), 4, D, top_k=2, shared_experts=copy.deepcopy(shared),
                 shared_gate=True, score_func="sigmoid", bias_update_rate=0.1)
    with torch.no_grad():
        a.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))
    b = MoELayer(GroupedExperts(4, D, F), 4, D, top_k=2, shared_experts=SwiGLUExpert(D, F),
                 shared_gate=True, score_func="sigmoid", bias_update_rate=0.1)
    b.load_state_dict(a.state_dict())
    assert sorted(b.state_dict()) == sorted(a.state_dict())
    assert torch.equal(b.expert_bias, a.expert_bias)
    x = torch.randn(9, D)
    _close("grouped layer y", b(x), a(x), atol=1e-5)
    c = MoELayer(copy.deepcopy(modules), 4, D, top_k=2, shared_experts=SwiGLUExpert(D, F),
                 shared_gate=True, score_func="sigmoid", bias_update_rate=0.1)
    c.load_state_dict(b.state_dict())  # and back into a list of modules
    _close("module-list layer y", c(x), a(x), atol=1e-5)


# ---------------------------------------------------------------------------------------
# routing bias and sigmoid scores (one process)
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_bias_changes_the_selection_but_not_the_weights(score):
    E, K = 6, 2
    modules = _experts("swiglu", E, seed=4)
    torch.manual_seed(4)
    router = nn.Linear(D, E, bias=False)
    layer = MoELayer(copy.deepcopy(modules), E, D, top_k=K, router=copy.deepcopy(router),
                     score_func=score, bias_update_rate=0.01, aux_loss_coef=0.0)
    bias_E = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 5.0])  # expert 5 always chosen
    x, g = _tokens(4, 0, 10)
    (y, xl), (y_ref, xr, ref_router, ids_TK, w_TK) = _both_ways(
        layer, router, modules, K, x, g, score=score, bias_E=bias_E)
    assert (ids_TK == 5).any(-1).all(), "the reference must pick expert 5 for every token"
    assert layer.stats.tokens_per_expert[5] == 10, layer.stats
    _, ids_nobias, _ = _dense(x, router, modules, K, score=score)
    assert not torch.equal(ids_nobias, ids_TK), "the bias must have changed the selection"
    # the weights are the scores themselves (renormalised over the chosen), not score + bias
    scores_TE = router(x).float()
    scores_TE = scores_TE.softmax(-1) if score == "softmax" else scores_TE.sigmoid()
    want_w = scores_TE.gather(1, ids_TK)
    _close("weights", w_TK.detach(), (want_w / want_w.sum(-1, keepdim=True)).detach())
    _close("y", y.detach(), y_ref.detach(), atol=1e-5)
    _close("x.grad", xl.grad, xr.grad, atol=1e-5)
    _close("router grad", layer.router.weight.grad, ref_router.weight.grad, atol=1e-5)
    assert layer.aux_loss is not None and float(layer.aux_loss.detach()) == 0.0  # aux loss off


def test_bias_update_follows_the_sign_rule_and_is_saved():
    E, K, rate = 4, 1, 0.25
    layer = MoELayer(_experts("swiglu", E, seed=5), E, D, top_k=K, bias_update_rate=rate)
    x = torch.randn(16, D)
    layer(x)
    load_E = torch.tensor(layer.stats.tokens_per_expert, dtype=torch.float64)
    layer(x)  # two forwards before one step: the counts add up
    update_routing_biases(layer)
    want = rate * torch.sign(load_E.mean() - load_E).float()
    _close("expert_bias", layer.expert_bias, want)
    assert "expert_bias" in layer.state_dict()
    before = layer.expert_bias.clone()
    update_routing_biases(layer)  # no token since: unchanged
    assert torch.equal(layer.expert_bias, before)
    layer.eval()  # evaluation forwards do not count
    layer(x)
    update_routing_biases(layer)
    assert torch.equal(layer.expert_bias, before)


@pytest.mark.parametrize("cast", ["to", "half", "bfloat16"])
def test_the_routing_bias_stays_fp32_in_a_low_precision_model(cast):
    """DeepSeek-V3's 1e-3 steps vanish in a bf16 bias once it nears 0.25 (bf16 spaces its
    values there by 2e-3): the bias stays fp32 when the model is cast, as Megatron keeps it,
    and its value is kept exactly across the cast."""
    layer = MoELayer(_experts("swiglu", 4, seed=5), 4, D, top_k=1, bias_update_rate=1e-3,
                     score_func="sigmoid")
    with torch.no_grad():
        layer.expert_bias.copy_(torch.tensor([0.5, -0.3, 0.1234567, 0.0]))
    before = layer.expert_bias.clone()
    layer = {"to": lambda m: m.to(torch.bfloat16), "half": lambda m: m.half(),
             "bfloat16": lambda m: m.bfloat16()}[cast](layer)
    assert layer.router.weight.dtype != torch.float32  # the cast happened
    assert layer.expert_bias.dtype == torch.float32
    assert torch.equal(layer.expert_bias, before)
    y = layer(torch.randn(8, D, dtype=layer.router.weight.dtype))  # routes with the fp32 bias
    assert y.dtype == layer.router.weight.dtype
    layer._apply_bias_update(torch.tensor([1.0, 5.0, 1.0, 1.0], dtype=torch.float64))
    assert layer.expert_bias[0] == before[0] + 1e-3, layer.expert_bias  # not lost in rounding
    layer.float()
    assert layer.expert_bias.dtype == torch.float32


@pytest.mark.parametrize("score,bias", [("sigmoid", True), ("softmax", False)])
def test_group_limited_routing_and_route_scale_match_the_reference(score, bias):
    # DeepSeek-V3's routing: 8 experts in 4 groups, each token inside its 2 best groups,
    # weights scaled by 2.5; against the dense reference (which masks token by token)
    E, K, G, M, scale = 8, 3, 4, 2, 2.5
    modules = _experts("swiglu", E, seed=7)
    torch.manual_seed(7)
    router = nn.Linear(D, E, bias=False)
    layer = MoELayer(copy.deepcopy(modules), E, D, top_k=K, router=copy.deepcopy(router),
                     score_func=score, bias_update_rate=0.01 if bias else None,
                     num_expert_groups=G, num_limited_groups=M, route_scale=scale,
                     aux_loss_coef=0.0)
    bias_E = torch.randn(E) * 0.2 if bias else None
    x, g = _tokens(7, 0, 40)
    (y, xl), (y_ref, xr, ref_router, ids_TK, w_TK) = _both_ways(
        layer, router, modules, K, x, g, score=score, bias_E=bias_E, groups=G, limited=M,
        scale=scale)
    groups_per_token = [len(set((ids // (E // G)).tolist())) for ids in ids_TK]
    assert max(groups_per_token) <= M, groups_per_token
    _, unlimited, _ = _dense(x, router, modules, K, score=score, bias_E=bias_E)
    assert not torch.equal(unlimited, ids_TK), "the group limit must have changed some choice"
    assert torch.allclose(w_TK.sum(-1), torch.full((40,), scale)), "weights sum to route_scale"
    assert list(layer.stats.tokens_per_expert) == torch.bincount(
        ids_TK.reshape(-1), minlength=E).tolist(), layer.stats
    _close("y", y.detach(), y_ref.detach(), atol=1e-5)
    _close("x.grad", xl.grad, xr.grad, atol=1e-5)
    _close("router grad", layer.router.weight.grad, ref_router.weight.grad, atol=1e-5)
    # every group kept: the same routing as without groups
    every = MoELayer(copy.deepcopy(modules), E, D, top_k=K, router=copy.deepcopy(router),
                     score_func=score, num_expert_groups=G, num_limited_groups=G)
    plain = MoELayer(copy.deepcopy(modules), E, D, top_k=K, router=copy.deepcopy(router),
                     score_func=score)
    with torch.no_grad():
        assert torch.equal(every(x), plain(x))


def test_new_arguments_are_checked():
    ex = _experts("swiglu", 2, seed=6)
    with pytest.raises(ValueError, match="score_func"):
        MoELayer(ex, 2, D, score_func="relu")
    with pytest.raises(ValueError, match="bias_update_rate"):
        MoELayer(ex, 2, D, bias_update_rate=-1.0)
    with pytest.raises(ValueError, match="shared_experts=") :
        MoELayer(ex, 2, D, shared_gate=True)
    for bad in ([1], 3):  # not iterable: named too (before, Python's "not iterable")
        with pytest.raises(TypeError, match="shared_experts must be a module"):
            MoELayer(ex, 2, D, shared_experts=bad)
    wide = MoELayer(ex, 2, D, shared_experts=[nn.Linear(D, D), nn.Linear(D, D + 1)])
    with pytest.raises(ValueError, match=r"shared expert 1 on rank 0 returned \(5, 13\) for an "
                                         r"input of shape \[5, 12\]"):
        wide(torch.randn(5, D))
    with pytest.raises(ValueError, match="to_experts"):
        MoELayer(GroupedExperts(2, D, F), 2, D, schedule="pairwise")
    ex4 = _experts("swiglu", 4, seed=6)
    with pytest.raises(ValueError, match="num_limited_groups must be a positive int"):
        MoELayer(ex4, 4, D, num_expert_groups=2)
    with pytest.raises(ValueError, match="num_expert_groups=3 does not divide num_experts=4"):
        MoELayer(ex4, 4, D, num_expert_groups=3, num_limited_groups=1)
    with pytest.raises(ValueError, match="num_limited_groups=3 is more than num_expert_groups=2"):
        MoELayer(ex4, 4, D, num_expert_groups=2, num_limited_groups=3)
    with pytest.raises(ValueError, match="top_k=3 experts cannot be chosen from num_limited_"):
        MoELayer(ex4, 4, D, top_k=3, num_expert_groups=2, num_limited_groups=1)
    with pytest.raises(ValueError, match="route_scale"):
        MoELayer(ex4, 4, D, route_scale=0.0)


# ---------------------------------------------------------------------------------------
# on gloo ranks
# ---------------------------------------------------------------------------------------
def _check_parity(case: dict) -> None:
    rank, W = dist.get_rank(), dist.get_world_size()
    K, L, kind, seed = case["k"], case["L"], case["kind"], case["seed"]
    dev = torch.device(case.get("device", "cpu"))  # drawn on the CPU, then moved: same values
    E = W * L
    tokens = case.get("tokens", [9 + 4 * r for r in range(W)])
    experts = [m.to(dev) for m in _experts(kind, E, seed)]
    torch.manual_seed(seed + 1)
    router = nn.Linear(D, E, bias=False).to(dev)
    shared = [SwiGLUExpert(D, F).to(dev) for _ in range(case.get("shared", 0))]
    gate = nn.Linear(D, 1, bias=False).to(dev) if case.get("gate") else None
    bias_E = torch.randn(E).to(dev) * 0.3 if case.get("bias") else None
    data = [tuple(t.to(dev) for t in _tokens(seed, r, tokens[r])) for r in range(W)]

    mine = [copy.deepcopy(experts[e]) for e in range(rank * L, rank * L + L)]
    local = (GroupedExperts.from_experts(mine, impl=case.get("impl", "auto"))
             if case.get("grouped") else mine)
    layer = MoELayer(local, E, D, top_k=K, router=copy.deepcopy(router), expert_grad_scale=1.0,
                     shared_experts=copy.deepcopy(shared) or None, shared_gate=gate is not None,
                     score_func=case.get("score", "softmax"),
                     bias_update_rate=0.01 if bias_E is not None else None,
                     num_expert_groups=case.get("groups"), num_limited_groups=case.get("limited"),
                     route_scale=case.get("scale", 1.0), dedup=case.get("dedup", False)).to(dev)
    if gate is not None:
        layer.shared_gate.load_state_dict(gate.state_dict())
    if bias_E is not None:
        with torch.no_grad():
            layer.expert_bias.copy_(bias_E)
    calls = []
    if case.get("grouped"):  # on the CPU, grouped experts run once per source rank's block
        layer.experts.register_forward_hook(lambda m, args, out: calls.append(len(args[0])))
    x = data[rank][0].clone().requires_grad_()
    y = layer(x)
    (y * data[rank][1]).sum().backward()
    if "expert_calls" in case and dev.type == "cpu":
        assert len(calls) == case["expert_calls"], (calls, case)
    if "deduplicated" in case:
        assert layer.stats.deduplicated == case["deduplicated"], layer.stats

    ref_experts = copy.deepcopy(experts)
    total = 0.0
    for r in range(W):  # router and shared experts: a copy per rank (their gradient is local)
        ref_router, ref_shared, ref_gate = (copy.deepcopy(router), copy.deepcopy(shared),
                                            copy.deepcopy(gate))
        xr = data[r][0].clone().requires_grad_()
        yr, _, _ = _dense(xr, ref_router, ref_experts, K, score=case.get("score", "softmax"),
                          bias_E=bias_E, shared=ref_shared, gate=ref_gate,
                          groups=case.get("groups"), limited=case.get("limited"),
                          scale=case.get("scale", 1.0))
        total = total + (yr * data[r][1]).sum()
        if r == rank:
            x_ref, y_ref, my_router, my_shared, my_gate = xr, yr, ref_router, ref_shared, ref_gate
    total.backward()
    _close("y", y, y_ref.detach(), atol=1e-5, rank=rank)
    # (a rank without tokens, at top-1: the reference's y depends on neither x nor the
    # router; the layer's gradients are zeros)
    _close("x.grad", x.grad, _or_zeros(x_ref.grad, x_ref), atol=1e-5, rank=rank)
    _close("router grad", layer.router.weight.grad,
           _or_zeros(my_router.weight.grad, my_router.weight), atol=1e-5, rank=rank)
    for i, (m, ref) in enumerate(zip(layer.shared_experts or [], my_shared)):
        for (n, p), q in zip(m.named_parameters(), ref.parameters()):
            _close(f"shared {i} {n}.grad", p.grad, q.grad, atol=1e-5, rank=rank)
    if gate is not None:
        _close("gate grad", layer.shared_gate.weight.grad, my_gate.weight.grad, atol=1e-5, rank=rank)
    for l in range(L):
        e = rank * L + l
        ref_grads = {k: v.grad for k, v in _as_grouped_names(ref_experts[e]).items()}
        if case.get("grouped"):
            got = {k: getattr(layer.experts, name).grad[l] for k, name in _STACKED.items()
                   if k in ref_grads}
            got = {k: (g.t() if k.endswith("weight") else g) for k, g in got.items()}
        else:
            got = {k: v.grad for k, v in _as_grouped_names(layer.experts[str(e)]).items()}
        for k in ref_grads:
            want = ref_grads[k] if ref_grads[k] is not None else torch.zeros_like(got[k])
            _close(f"expert {e} {k}.grad", got[k], want, atol=1e-5, rank=rank)


def _or_zeros(grad, like):
    return grad if grad is not None else torch.zeros_like(like)


_STACKED = {"w1.weight": "w1", "w2.weight": "w2", "w3.weight": "w3", "w1.bias": "b1",
            "w2.bias": "b2"}


def _as_grouped_names(m: nn.Module) -> dict[str, torch.Tensor]:
    if isinstance(m, nn.Sequential):
        return {"w1.weight": m[0].weight, "w1.bias": m[0].bias, "w2.weight": m[2].weight,
                "w2.bias": m[2].bias}
    return dict(m.named_parameters())


def _parity_worker(cases):
    failures = []
    for case in cases:
        try:
            _check_parity(case)
        except Exception as e:  # noqa: BLE001 - report, and stay in step with the other ranks
            failures.append(f"rank {dist.get_rank()}, case {case}: {type(e).__name__}: {e}")
    return failures


PARITY = [
    # DeepSeek-like: grouped SwiGLU experts, a gated shared expert, sigmoid scores, a bias
    dict(kind="swiglu", grouped=True, L=3, k=2, shared=1, gate=True, score="sigmoid", bias=True,
         seed=11, expert_calls=2),
    # the same with the experts one after another: on the regrouped rows, one call
    dict(kind="swiglu", grouped=True, impl="loop", L=3, k=2, shared=1, gate=True,
         score="sigmoid", bias=True, seed=16, expert_calls=1),
    # two ungated shared experts beside a list of Sequential GELU experts, softmax, top-1
    dict(kind="sequential", L=2, k=1, shared=2, seed=12),
    # grouped GELU experts with biases, softmax scores moved by a bias, no shared expert
    dict(kind="gelu", grouped=True, L=2, k=2, bias=True, seed=13, expert_calls=2),
    # sigmoid with a list of SwiGLU experts and one shared expert
    dict(kind="swiglu", L=1, k=2, shared=1, score="sigmoid", seed=14),
    # DeepSeek-V3's routing with a group per rank: each token's rows go to one rank only,
    # the weights scaled by 2.5
    dict(kind="swiglu", grouped=True, L=3, k=2, shared=1, score="sigmoid", bias=True,
         groups=2, limited=1, scale=2.5, seed=15),
]


@pytest.mark.dist
def test_layer_features_match_dense_reference(dist_run):
    failures = sum(dist_run(_parity_worker, PARITY, world_size=2), [])
    assert not failures, "\n\n".join(failures)


# every case above with each token sent once per rank (dedup=True), and "auto" where it
# pays: with a group per rank each token reaches one rank, so at top-2 the rows halve
DEDUP_PARITY = [dict(case, dedup=True, deduplicated=True, seed=case["seed"] + 10,
                     **({"expert_calls": 1} if case.get("grouped") else {}))
                for case in PARITY] + [
    dict(kind="swiglu", grouped=True, L=3, k=2, shared=1, score="sigmoid", groups=2, limited=1,
         seed=31, dedup="auto", deduplicated=True),
    dict(kind="swiglu", grouped=True, L=3, k=2, score="sigmoid", seed=33, dedup="auto",
         deduplicated=False),
    dict(kind="swiglu", grouped=True, L=3, k=3, score="sigmoid", bias=True, seed=32,
         dedup=True, deduplicated=True),
    # top-1 with a rank that has no token this step (its places column was a [0, 1] tensor
    # of stride 0, which torch calls contiguous and would not reinterpret)
    dict(kind="swiglu", grouped=True, L=2, k=1, seed=34, dedup=True, deduplicated=True,
         tokens=[0, 6])]


def _gradient_penalty(options):
    """``torch.autograd.grad(..., create_graph=True)`` through the layer (a gradient
    penalty): the error's message, or None if it ran."""
    import datetime

    kw = dict(options)
    shared = SwiGLUExpert(D, F) if kw.pop("shared", False) else None
    torch.manual_seed(0)
    layer = MoELayer([SwiGLUExpert(D, F) for _ in range(2)], 2 * dist.get_world_size(), D,
                     top_k=2, shared_experts=shared, timeout=datetime.timedelta(seconds=10),
                     **kw)
    x = torch.randn(8, D, requires_grad=True)
    try:
        g, = torch.autograd.grad(layer(x).square().sum(), x, create_graph=True)
        g.square().sum().backward()
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.dist
@pytest.mark.parametrize("options", [{}, {"dedup": True}, {"shared": True},
                                     {"schedule": "pairwise", "group_size": 2}])
def test_a_double_backward_through_the_layer_is_refused(dist_run, options):
    """The layer's backward is first order: second-order gradients through it (a gradient
    penalty) were wrong without an error (dedup: the experts' None, x's off by 0.8) or
    failed in an unrelated in-place check. Refused on every rank, naming the cause."""
    for message in dist_run(_gradient_penalty, options, world_size=2, timeout=60):
        assert message is not None and "create_graph=True" in message, message
        assert "MoE" in message, message


def _backward_twice(options):
    """Two backwards through one forward (``retain_graph=True``): the second's error, or
    None if it ran."""
    import datetime

    kw = dict(options)
    shared = SwiGLUExpert(D, F) if kw.pop("shared", False) else None
    torch.manual_seed(0)
    layer = MoELayer([SwiGLUExpert(D, F) for _ in range(2)], 2 * dist.get_world_size(), D,
                     top_k=2, shared_experts=shared, timeout=datetime.timedelta(seconds=10),
                     **kw)
    y = layer(torch.randn(8, D, requires_grad=True))
    y.sum().backward(retain_graph=True)
    try:
        y.sum().backward()
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.dist
@pytest.mark.parametrize("options", [{"shared": True}, {"schedule": "pairwise",
                                                         "group_size": 2}])
def test_a_second_backward_through_graphs_the_layer_freed_is_named(dist_run, options):
    # the layer frees its own graphs (shared experts beside the exchange, the pipeline's
    # chunks) after the first backward: the second was an AttributeError on None
    for message in dist_run(_backward_twice, options, world_size=2, timeout=60):
        assert message is not None and "second time" in message, message


def _freed_after_steps(dedup, backward):
    """Three steps of a layer; whether each step's input (and with it its graph) is freed by
    reference counting once the step's names are dropped (no garbage collection)."""
    import gc
    import weakref

    torch.manual_seed(0)
    layer = MoELayer(GroupedExperts(2, 16, 16), num_experts=2 * dist.get_world_size(),
                     d_model=16, top_k=2, dedup=dedup)
    alive = []
    gc.disable()
    try:
        for step in range(3):
            x = torch.randn(32, 16, requires_grad=True)
            y = layer(x)
            if backward:
                y.square().mean().backward()
            alive.append(weakref.ref(x))
            del x, y
            layer.aux_loss = None
    finally:
        gc.enable()
    return [r() is None for r in alive]


@pytest.mark.dist
@pytest.mark.parametrize("backward", [True, False])
@pytest.mark.parametrize("dedup", [False, True])
def test_each_steps_graph_is_freed(dist_run, dedup, backward):
    """A step's autograd graph and its tensors are freed when the step's names go, with
    deduplicated rows too (a cycle through the rows' plan kept every step alive). The last
    step's may wait for the next collective (the process group may still hold its last
    exchange's buffers): the steps before it are checked."""
    for freed in dist_run(_freed_after_steps, dedup, backward, world_size=2):
        assert freed[:-1] == [True, True], freed


@pytest.mark.dist
def test_deduplicated_dispatch_matches_dense_reference(dist_run):
    failures = sum(dist_run(_parity_worker, DEDUP_PARITY, world_size=2), [])
    assert not failures, "\n\n".join(failures)


def test_deduplicated_rows_of_a_rank_without_tokens():
    """A rank with no token packs ``[0, D + meta_cols]`` rows, at any top-k (top-1 made a
    ``[0, 1]`` places tensor of stride 0 that could not be reinterpreted), and its backward
    gives empty gradients."""
    from tribucket.moe import dedup as _dedup
    from tribucket.moe._slots import _route

    W, L, E = 2, 2, 4
    for K in (1, 2, 3):
        ids_TK = torch.zeros(0, K, dtype=torch.int64)
        dest_TK, sent_E, _ = _route(ids_TK, torch.zeros(E, dtype=torch.int64), None)
        rank_TK, hit_TW, _ = _dedup.count_unique(ids_TK, dest_TK, L, W)
        u = _dedup.plan_unique(ids_TK, dest_TK, sent_E, hit_TW, rank_TK, L, send_splits=(0, 0),
                               recv_splits=(0, 0), row_dtype=torch.float32)
        x = torch.zeros(0, D, requires_grad=True)
        w = torch.zeros(0, K, requires_grad=True)
        rows = _dedup.pack_rows(x, w, u, "auto")
        assert rows.shape == (0, D + u.meta_cols), (K, rows.shape)
        rows.sum().backward()
        assert x.grad.shape == (0, D) and w.grad.shape == (0, K)


def _dedup_against_per_slot_worker():
    """The same layer and tokens with and without deduplication (top-3 with drops, top-4,
    one expert per rank; test_moe checks bf16 rows, empty ranks and the Triton kernels
    against its dense reference): ``[(case, {dedup: (y, x.grad, grads, stats...)})]``."""
    rank, W = dist.get_rank(), dist.get_world_size()
    out = []
    for case in (dict(k=3, L=2, cf=1.0), dict(k=4, L=4), dict(k=2, L=1)):
        got = {}
        for dedup in (False, True):
            torch.manual_seed(5)
            experts = GroupedExperts(case["L"] * W, D, F)
            local = GroupedExperts(case["L"], D, F, first_index=rank * case["L"])
            with torch.no_grad():
                for n in ("w1", "w2", "w3"):
                    getattr(local, n).copy_(getattr(experts, n)[rank * case["L"]:][:case["L"]])
            torch.manual_seed(6)
            layer = MoELayer(local, case["L"] * W, D, top_k=case["k"], dedup=dedup,
                             capacity_factor=case.get("cf"), expert_grad_scale=1.0)
            x, g = _tokens(7, rank, 11 + 3 * rank)
            x.requires_grad_()
            y = layer(x)
            (y * g).sum().backward()
            got[dedup] = (y.detach(), x.grad, [p.grad for p in layer.parameters()],
                          layer.stats.rows_sent, layer.stats.deduplicated, layer.stats.dropped)
        out.append((case, got))
    return out


@pytest.mark.dist
def test_deduplicated_dispatch_equals_per_slot_rows(dist_run):
    for rank, results in enumerate(dist_run(_dedup_against_per_slot_worker, world_size=2)):
        for case, got in results:
            (y0, gx0, gp0, rows0, dd0, drop0), (y1, gx1, gp1, rows1, dd1, drop1) = got[False], got[True]
            tol = dict(atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(y1, y0, **tol, msg=lambda m: f"rank {rank} {case}: y {m}")
            torch.testing.assert_close(gx1, gx0, **tol, msg=lambda m: f"rank {rank} {case}: x.grad {m}")
            for a, b in zip(gp1, gp0):
                torch.testing.assert_close(a, b, **tol, msg=lambda m: f"rank {rank} {case}: grad {m}")
            assert (dd0, dd1) == (False, True) and drop0 == drop1, (case, dd0, dd1, drop0, drop1)
            # one row per (token, rank): never more than one per slot, fewer when a token
            # chose several experts of one rank (with one expert per rank and top-2, none)
            assert rows1 <= rows0 and (rows1 < rows0 or case["L"] == 1), (case, rows0, rows1)


def _overlap_order_worker():
    """Events in order: when each asynchronous all-to-all starts and is waited for, and
    when the shared expert runs forward and backward."""
    log: list[str] = []
    real = dist.all_to_all_single

    class _Work:
        def __init__(self, work):
            self.work = work

        def wait(self):
            log.append("wait")
            return self.work.wait()

    def a2a(*args, async_op=False, **kw):
        if not async_op:
            log.append("a2a")
            return real(*args, **kw)
        log.append("start")
        return _Work(real(*args, async_op=True, **kw))

    class Shared(SwiGLUExpert):
        def forward(self, x):
            log.append("shared forward")
            y = super().forward(x)
            if y.requires_grad:
                y.register_hook(lambda g: log.append("shared backward"))
            return y

    torch.manual_seed(0)
    W = dist.get_world_size()
    layer = MoELayer(GroupedExperts(2, D, F), 2 * W, D, top_k=2, shared_experts=Shared(D, F),
                     bias_update_rate=0.1)
    x = torch.randn(10 + 3 * dist.get_rank(), D, requires_grad=True)
    dist.all_to_all_single = a2a
    try:
        layer(x).sum().backward()
    finally:
        dist.all_to_all_single = real
    order = list(log)
    with _CountCollectives() as counted:  # the bias update needs no collective
        update_routing_biases(layer)
    # every expert on this rank (grouped experts unstacked, shared expert, bias): the same y
    # as the expert-parallel forward, with no collective
    with torch.no_grad():
        y_ep = layer(x)
        with gathered_experts(layer), _CountCollectives() as inside:
            y_here = layer(x)
    torch.testing.assert_close(y_here, y_ep, atol=1e-5, rtol=1e-5)
    assert inside.calls == [], inside.calls
    return order, counted.calls, layer.expert_bias


@pytest.mark.dist
def test_shared_expert_runs_while_the_tokens_travel(dist_run):
    # forward: counts, then the token exchange started, the shared expert on the first half
    # of the tokens, its wait, then the return exchange started, the shared expert on the
    # second half, its wait; backward: the return's reverse started beside the second half's
    # backward, then the dispatch's reverse beside the first half's. Five all-to-alls, as
    # without a shared expert.
    beside = ["start", "shared forward", "wait"]
    want = ["a2a"] + beside * 2 + ["start", "shared backward", "wait"] * 2
    results = dist_run(_overlap_order_worker, world_size=2)
    for log, calls, bias in results:
        assert log == want, log
        assert calls == [], calls
        assert torch.equal(bias, results[0][2]) and bias.abs().sum() > 0, bias


class _DenseNet(nn.Module):
    """in -> ReLU -> (MoE written out, every expert here) -> head; the bias trained by hand."""

    def __init__(self, router, experts, shared, gate, seed, K, rate):
        super().__init__()
        torch.manual_seed(seed)
        self.inp, self.head = nn.Linear(D, D), nn.Linear(D, D)
        self.router, self.experts = router, nn.ModuleList(experts)
        self.shared, self.gate = nn.ModuleList(shared), gate
        self.K, self.rate = K, rate
        self.bias_E = torch.zeros(len(experts))
        self.load_E = torch.zeros(len(experts))

    def forward(self, x):
        h = torch.relu(self.inp(x))
        y, ids_TK, _ = _dense(h, self.router, list(self.experts), self.K, score="sigmoid",
                              bias_E=self.bias_E, shared=list(self.shared), gate=self.gate)
        self.load_E += torch.bincount(ids_TK.reshape(-1), minlength=len(self.experts)).float()
        return self.head(y)

    def update(self):
        self.bias_E += self.rate * torch.sign(self.load_E.mean() - self.load_E)
        self.load_E.zero_()


def _train_worker(ep_size: int):
    rank, world = dist.get_rank(), dist.get_world_size()
    L, K, seed, steps, rate = 2, 2, 21, 3, 0.05
    E = ep_size * L
    ep, replicas = expert_data_parallel_groups(ep_size)
    experts = _experts("swiglu", E, seed)
    torch.manual_seed(seed + 1)
    router, shared, gate = nn.Linear(D, E, bias=False), [SwiGLUExpert(D, F)], nn.Linear(D, 1, bias=False)
    ref = _DenseNet(copy.deepcopy(router), copy.deepcopy(experts), copy.deepcopy(shared),
                    copy.deepcopy(gate), seed, K, rate)
    first = dist.get_rank(ep) * L
    local = GroupedExperts.from_experts([copy.deepcopy(experts[e]) for e in range(first, first + L)])
    layer = MoELayer(local, E, D, top_k=K, router=copy.deepcopy(router), group=ep,
                     replica_group=replicas, shared_experts=copy.deepcopy(shared), shared_gate=True,
                     score_func="sigmoid", bias_update_rate=rate, aux_loss_coef=0.0)
    layer.shared_gate.load_state_dict(gate.state_dict())
    model = _Net(layer, seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    balance_after_step(opt, model)
    data = lambda r, s: _tokens(seed * 10 + s, r, 6 + 3 * r)  # noqa: E731
    biases = []
    with tribucket.fused_bucketing(model):
        for step in range(steps):
            x, t = data(rank, step)
            nn.functional.mse_loss(model(x), t).backward()
            opt.step()
            opt.zero_grad()
            biases.append(layer.expert_bias.clone())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.3)
    ref_biases = []
    for step in range(steps):
        total = sum(nn.functional.mse_loss(ref(data(r, step)[0]), data(r, step)[1])
                    for r in range(world))
        (total / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref.update()
        ref_biases.append(ref.bias_E.clone())
    got = dict(model.named_parameters())
    want = {"inp.weight": ref.inp.weight, "inp.bias": ref.inp.bias, "head.weight": ref.head.weight,
            "head.bias": ref.head.bias, "moe.router.weight": ref.router.weight,
            "moe.shared_gate.weight": ref.gate.weight}
    for n, p in ref.shared[0].named_parameters():
        want[f"moe.shared_experts.0.{n}"] = p
    for name in ("w1", "w2", "w3"):
        want[f"moe.experts.{name}"] = torch.stack(
            [getattr(ref.experts[e], name).weight.t() for e in range(first, first + L)])
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    return {"got": {n: p.detach().clone() for n, p in got.items()},
            "want": {n: p.detach().clone() for n, p in want.items()},
            "biases": biases, "ref_biases": ref_biases}


@pytest.mark.dist
def test_training_with_every_feature_matches_dense_reference(dist_run):
    # 2 expert-parallel groups x 2 replicas: the bias counts summed over the replica group,
    # so every rank of the world moves its bias alike
    results = dist_run(_train_worker, 2, world_size=4)
    for rank, out in enumerate(results):
        for n, p in out["got"].items():
            _close(f"{n} after training", p, out["want"][n], atol=2e-5, rtol=1e-4, rank=rank)
        for step, (b, rb) in enumerate(zip(out["biases"], out["ref_biases"])):
            _close(f"expert_bias after step {step}", b, rb, rank=rank)
            # every rank of the world holds the same bias, to the bit
            assert torch.equal(b, results[0]["biases"][step]), (rank, step)
    assert results[0]["biases"][-1].abs().sum() > 0, "the bias must have moved"


def _checkpointed_training(case: dict, checkpointed: bool, steps: int = 3):
    """``in -> MoE -> head`` trained under fused_bucketing with SGD and the routing bias, the
    MoE layer run under ``torch.utils.checkpoint`` (non-reentrant: its forward runs again,
    exchanges included, in backward) or plainly: ``(losses, parameters, bias)``."""
    from torch.utils.checkpoint import checkpoint
    kw = dict(case)
    grouped, shared = kw.pop("grouped", False), kw.pop("shared", False)
    rank, W = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    experts = GroupedExperts(2, D, F) if grouped else [SwiGLUExpert(D, F) for _ in range(2)]
    layer = MoELayer(experts, 2 * W, D, top_k=2, bias_update_rate=0.01,
                     shared_experts=SwiGLUExpert(D, F) if shared else None, **kw)
    model = nn.ModuleDict(dict(inp=nn.Linear(D, D), moe=layer, head=nn.Linear(D, D)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    with tribucket.fused_bucketing(model):
        for step in range(steps):
            x, _ = _tokens(step, rank, 9 + 3 * rank)
            h = model["inp"](x)
            y = checkpoint(layer, h, use_reentrant=False) if checkpointed else layer(h)
            loss = model["head"](y).square().mean() + layer.aux_loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            update_routing_biases(model)
            losses.append(loss.detach())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, \
        layer.expert_bias.clone()


def _checkpointed_vs_plain(cases):
    return [(_checkpointed_training(c, True), _checkpointed_training(c, False)) for c in cases]


@pytest.mark.dist
def test_activation_checkpointing_of_the_layer_trains_as_without(dist_run):
    cases = [dict(), dict(schedule="pairwise", group_size=2), dict(shared=True),
             dict(grouped=True, score_func="sigmoid"), dict(dedup=True)]
    for per_rank in dist_run(_checkpointed_vs_plain, cases, world_size=2, timeout=120):
        for case, ((l1, p1, b1), (l0, p0, b0)) in zip(cases, per_rank):
            torch.testing.assert_close(torch.stack(l1), torch.stack(l0), rtol=0, atol=0)
            assert not torch.equal(b0, torch.zeros_like(b0)), "the bias never moved"
            torch.testing.assert_close(b1, b0, rtol=0, atol=0)
            for name in p0:
                torch.testing.assert_close(p1[name], p0[name], rtol=1e-6, atol=1e-7,
                                           msg=lambda m: f"{case} {name}: {m}")


def _bias_counts(pattern: str, options: dict | None = None):
    """The token-slots the routing bias counted over two accumulated micro-batches, run as
    ``pattern`` says, and the same two micro-batches run plainly (one forward and backward
    each), on the same layer weights (``options``: the layer's, ``shared`` for a shared
    expert): ``(counted, plain)``."""
    import datetime

    from torch.utils.checkpoint import checkpoint
    rank, W = dist.get_rank(), dist.get_world_size()
    kw = dict(options or {})
    shared = SwiGLUExpert(D, F) if kw.pop("shared", False) else None

    def run(how: str) -> list[int]:
        torch.manual_seed(0)
        layer = MoELayer([SwiGLUExpert(D, F) for _ in range(2)], 2 * W, D, top_k=2,
                         bias_update_rate=0.01, shared_experts=copy.deepcopy(shared),
                         timeout=datetime.timedelta(seconds=10), **kw)
        for micro in range(2):
            x, _ = _tokens(micro, rank, 7 + 2 * rank + 3 * micro)
            x.requires_grad_(True)
            if how == "no_grad forward" and micro == 1:
                with torch.no_grad():  # a training-mode forward that nothing trains on
                    layer(x)
            if how == "checkpoint first" and micro == 0:
                y = checkpoint(layer, x, use_reentrant=False)  # runs again in backward
            elif how == "reentrant":  # its first pass runs without autograd
                y = checkpoint(layer, x, use_reentrant=True)
            else:
                y = layer(x)
            y.square().mean().backward()
        return list(layer._load.counts)

    return run(pattern), run("plain")


@pytest.mark.dist
@pytest.mark.parametrize("pattern,options", [
    ("checkpoint first", None), ("reentrant", None), ("no_grad forward", None),
    # layers whose backward runs graphs of their own (the shared experts beside the
    # exchange, the pairwise pipeline's chunks, shadow experts): the checkpoint's
    # recompute must run once, not once per such graph (each with its exchanges)
    ("checkpoint first", {"shared": True}),
    ("checkpoint first", {"schedule": "pairwise", "group_size": 2}),
    ("checkpoint first", {"schedule": "pairwise", "group_size": 2, "shadow_policy": {0}}),
    ("checkpoint first", {"shadow_policy": {1}, "shared": True})])
def test_the_routing_bias_counts_each_trained_micro_batch_once(dist_run, pattern, options):
    # an activation checkpoint of some micro-batches only must not weigh them twice, and a
    # forward without autograd (an EMA target, a look at the routing) trains nothing
    for counted, plain in dist_run(_bias_counts, pattern, options, world_size=2, timeout=60):
        assert sum(plain) > 0
        assert counted == plain, (pattern, counted, plain)
