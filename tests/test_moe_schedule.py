"""FasterMoE's smart schedule and shadow experts on gloo ranks.

Shape legend: T tokens, D model dim, E experts (global), K top-k, L experts per rank, W ranks.

* the pairwise pipeline against ``schedule="alltoall"`` (fp32, rtol 1e-5) for the routings
  the dispatcher tests use (uniform, skewed, one expert, a rank with no tokens, one sender),
  dropless and with capacity, on 2 and 4 ranks and group sizes 1, 2, 4 (3: uneven groups);
* the pipeline's issue order (S of step s+1 before C of step s, R of step s still in flight
  during C of step s+1), forward and backward, from a log of the calls;
* shadowing (a fixed set, and the greedy policy on a skewed routing) against the dense
  single-process reference of ``test_moe.py``: y, x.grad, router grad, expert grads;
* the greedy policy's decisions on hand-built counts; bad arguments and failing experts.

Routings are forced with a router whose logits are a fixed table (the wanted top-k order, by
a wide margin) plus a small linear term, so the router still gets gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from test_moe import _close, _dense_moe, _error_of, _ffn
from tribucket.moe import FixedShadowPolicy, GreedyShadowPolicy, MoELayer, ShadowCosts
from tribucket.moe.schedule import exchange_groups, pairwise_steps
from tribucket.testing import _route_tokens  # the dispatcher tests' routings

D = 12
TOL = dict(atol=2e-6, rtol=1e-5)


class _TableRouter(nn.Module):
    """``logits = table_TE + x @ W``: the table fixes the top-k order, W gives gradients."""

    def __init__(self, table_TE: torch.Tensor, E: int, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.lin = nn.Linear(D, E, bias=False)
        with torch.no_grad():
            self.lin.weight.mul_(0.1)
        self.table_TE = table_TE  # a plain attribute: not broadcast, each rank keeps its own

    def forward(self, x_TD):
        return self.table_TE + self.lin(x_TD)


def _table(ids_TK: torch.Tensor, E: int) -> torch.Tensor:
    T, K = ids_TK.shape
    table = torch.zeros(T, E)
    for k in range(K):  # first choice highest, 6 apart: x @ W never reorders them
        table.scatter_(1, ids_TK[:, k:k + 1], 6.0 * (K - k) + 6.0)
    return table


def _routing(kind: str, W: int, E: int, K: int, seed: int) -> list[torch.Tensor]:
    """Every rank's ``[T_r, K]`` choices for ``kind`` (as ``tribucket.testing.moe_routings``)."""
    tokens = [9 + 2 * r for r in range(W)]
    if kind == "zero_tokens":
        tokens[seed % W] = 0
    if kind == "one_sender":  # only rank 0 has tokens
        tokens = [12] + [0] * (W - 1)
    hot = seed % E
    base = "uniform" if kind in ("zero_tokens", "one_sender") else kind
    return [_route_tokens(base, t, E, K, hot, seed * 31 + r) for r, t in enumerate(tokens)]


def _layer(ids_all, L, K, cf, seed, scale=1.0, dtype=torch.float32, **kw):
    rank, W = dist.get_rank(), dist.get_world_size()
    E = W * L
    experts = [_ffn(seed * 100 + e).to(dtype) for e in range(rank * L, rank * L + L)]
    router = _TableRouter(_table(ids_all[rank], E), E, seed)
    return MoELayer(experts, E, D, top_k=K, router=router, capacity_factor=cf,
                    expert_grad_scale=scale, **kw)


def _inputs(seed, T):
    g = torch.Generator().manual_seed(seed * 1000 + dist.get_rank())
    return torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)


def _run(layer, x, gy, x_grad=True):
    x = x.clone().requires_grad_(x_grad)
    y = layer(x)
    (y.float() * gy).sum().backward()
    return y.detach(), x.grad, layer.router.lin.weight.grad, [q.grad for q in layer.experts.parameters()]


class _P2PLog:
    """Records every batch_isend_irecv call (sizes, S or R by tag, peers sent to) and waits."""

    def __enter__(self):
        self.events: list[tuple] = []
        self.sizes: list[int] = []
        self._saved = dist.batch_isend_irecv
        log = self

        class _Logged:
            def __init__(self, work, kind):
                self.work, self.kind = work, kind

            def wait(self):
                log.events.append(("wait", self.kind))
                return self.work.wait()

        def batch(ops):
            log.sizes += [op.tensor.numel() for op in ops]
            kinds = {("S" if op.tag < log.L else "R") for op in ops}
            assert len(kinds) == 1, kinds
            kind = kinds.pop()
            sends = {op.peer for op in ops if op.op in (dist.isend, dist.send)}
            log.events.append(("post", kind, tuple(sorted(sends))))
            return [_Logged(w, kind) for w in log._saved(ops)]

        dist.batch_isend_irecv = batch
        return self

    def __exit__(self, *exc):
        dist.batch_isend_irecv = self._saved


# ---------------------------------------------------------------------------------------
# pairwise == all-to-all
# ---------------------------------------------------------------------------------------
def _pairwise_case(kind, L, K, cf, seed, group_sizes, dtype=torch.float32, x_grad=True):
    W = dist.get_world_size()
    ids_all = _routing(kind, W, W * L, K, seed)
    x, gy = _inputs(seed, ids_all[dist.get_rank()].shape[0])
    x = x.to(dtype)
    # bf16: both schedules round each expert matmul, over different batch splits
    tol = TOL if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    ref_layer = _layer(ids_all, L, K, cf, seed, scale=0.5, dtype=dtype)
    want = _run(ref_layer, x, gy, x_grad)
    for gs in group_sizes:
        layer = _layer(ids_all, L, K, cf, seed, scale=0.5, dtype=dtype, schedule="pairwise",
                       group_size=gs)
        with _P2PLog() as log:
            log.L = L
            got = _run(layer, x, gy, x_grad)
        where = (f"{kind} routing, L={L}, K={K}, capacity_factor={cf}, group_size={gs}, {dtype}, "
                 f"x.requires_grad={x_grad}")
        assert layer.stats == ref_layer.stats, (where, layer.stats, ref_layer.stats)
        assert min(log.sizes, default=1) > 0, f"{where}: a zero-row message was posted"
        for name, g, w in zip(("y", "x.grad", "router grad"), got[:3], want[:3]):
            assert (g is None) == (w is None), (where, name, g, w)
            if g is not None:
                torch.testing.assert_close(g, w, **tol, msg=lambda m, n=name: f"{where}: {n}\n{m}")
        for j, (g, w) in enumerate(zip(got[3], want[3])):
            torch.testing.assert_close(g, w, **tol, msg=lambda m: f"{where}: expert param {j}\n{m}")


def _pairwise_worker(cases, group_sizes):
    failures = []
    for case in cases:
        try:
            _pairwise_case(*case[:5], group_sizes, *case[5:])
        except Exception as e:  # noqa: BLE001 - report, and stay in step with the other ranks
            failures.append(f"rank {dist.get_rank()}, case {case}: {type(e).__name__}: {e}")
    return failures


def _pairwise_cases(W):
    kinds = ("uniform", "skewed", "one_expert", "zero_tokens", "one_sender")
    cases = [(kind, L, K, cf, 10 + i) for i, (kind, L, K, cf) in enumerate(
        (kind, L, K, cf) for kind in kinds for (L, K, cf) in ((1, 1, None), (2, 2, None), (2, 2, 1.0)))]
    if W == 4:  # keep the oversubscribed run short: one capacity case per kind is enough
        cases = [c for c in cases if not (c[1] == 1 and c[0] in ("one_expert", "one_sender"))]
    # bf16 rows and parameters; x without a gradient (the backward then sends no R')
    return cases + [("uniform", 2, 2, None, 40, torch.bfloat16), ("skewed", 2, 2, 1.0, 41, torch.float32, False)]


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 4])
def test_pairwise_matches_alltoall(dist_run, world_size):
    group_sizes = (1, 2, 4) if world_size == 2 else (1, 2, 3, 4)  # 3 of 4: uneven groups
    failures = sum(dist_run(_pairwise_worker, _pairwise_cases(world_size), group_sizes,
                            world_size=world_size), [])
    assert not failures, "\n\n".join(failures)


def test_exchange_groups_and_steps():
    assert exchange_groups(4, 2) == [(0, 1), (2, 3)]
    assert exchange_groups(6, 4) == [(0, 1, 2, 3), (4, 5)]  # the last group takes the rest
    assert exchange_groups(2, 4) == [(0, 1)]  # capped at the world size
    assert pairwise_steps(1, 4, 2) == [((0, 1), (0, 1)), ((2, 3), (2, 3))]
    assert pairwise_steps(2, 4, 1) == [((2,), (2,)), ((3,), (1,)), ((0,), (0,)), ((1,), (3,))]
    for W in range(1, 8):  # every step pairs each send with a receive, any group size
        for gs in range(1, W + 2):
            for s in range(len(exchange_groups(W, gs))):
                sends = {(r, d) for r in range(W) for d in pairwise_steps(r, W, gs)[s][0]}
                recvs = {(q, r) for r in range(W) for q in pairwise_steps(r, W, gs)[s][1]}
                assert sends == recvs, (W, gs, s)


# ---------------------------------------------------------------------------------------
# the pipeline's issue order
# ---------------------------------------------------------------------------------------
def _order_worker():
    """Log posts, waits and expert calls of one forward+backward, group_size 1 (W steps)."""
    W = dist.get_world_size()
    # every token of every rank goes to expert t % W: each step has rows both ways
    ids_all = [torch.arange(8).remainder(W).view(8, 1) for _ in range(W)]
    layer = _layer(ids_all, 1, 1, None, 3, schedule="pairwise", group_size=1)
    expert = layer.local_experts[0]
    x, gy = _inputs(3, 8)
    saved_grad = torch.autograd.grad
    with _P2PLog() as log:
        log.L = 1
        hook = expert.register_forward_hook(lambda *a: log.events.append(("C",)))

        def logged_grad(*a, **kw):
            log.events.append(("C",))
            return saved_grad(*a, **kw)

        torch.autograd.grad = logged_grad
        try:
            x = x.requires_grad_()
            y = layer(x)
            log.events.append(("backward",))
            (y * gy).sum().backward()
        finally:
            torch.autograd.grad = saved_grad
            hook.remove()
    return log.events


def _check_order(events, rank, W):
    """S of step s+1 posted before C of step s; no R waited on before the last C."""
    for phase in (events[:events.index(("backward",))], events[events.index(("backward",)) + 1:]):
        computes = [i for i, e in enumerate(phase) if e == ("C",)]
        assert len(computes) == W, (phase, "one expert call per step")
        s_post = {}  # step -> index of its S post (step s sends to rank + s)
        r_post = {}
        for i, e in enumerate(phase):
            if e[0] == "post":
                (peer,) = e[2]
                step = (peer - rank) % W if e[1] == "S" else (rank - peer) % W
                (s_post if e[1] == "S" else r_post)[step] = i
        assert sorted(s_post) == sorted(r_post) == list(range(1, W)), (s_post, r_post)
        for s in range(W - 1):
            assert s_post[s + 1] < computes[s], f"S of step {s + 1} not issued before C of step {s}"
        for s in range(1, W - 1):
            assert r_post[s] < computes[s + 1], f"R of step {s} not in flight during C of step {s + 1}"
        r_waits = [i for i, e in enumerate(phase) if e == ("wait", "R")]
        assert r_waits and min(r_waits) > computes[-1], "an R was waited on before the last C"


@pytest.mark.dist
def test_pipeline_overlaps_send_compute_return(dist_run):
    W = 4
    for rank, events in enumerate(dist_run(_order_worker, world_size=W)):
        _check_order(events, rank, W)


# ---------------------------------------------------------------------------------------
# shadow experts against the dense reference
# ---------------------------------------------------------------------------------------
def _shadow_case(case):
    rank, W = dist.get_rank(), dist.get_world_size()
    L, K, cf, seed, policy, schedule = (case[k] for k in ("L", "K", "cf", "seed", "policy", "schedule"))
    E = W * L
    ids_all = _routing(case["kind"], W, E, K, seed)
    layer = _layer(ids_all, L, K, cf, seed, scale=0.5, schedule=schedule,
                   group_size=case.get("gs", 4), shadow_policy=policy)
    x, gy = _inputs(seed, ids_all[rank].shape[0])
    y, x_grad, router_grad, _ = _run(layer, x, gy)

    experts = [_ffn(seed * 100 + e) for e in range(E)]
    total, my = 0.0, None
    for r in range(W):
        router = _TableRouter(_table(ids_all[r], E), E, seed)
        g = torch.Generator().manual_seed(seed * 1000 + r)  # as _inputs on rank r
        xr = torch.randn(ids_all[r].shape[0], D, generator=g).requires_grad_()
        gyr = torch.randn(xr.shape, generator=g)
        yr, _, _ = _dense_moe(xr, router, experts, K, cf, K > 1)
        total = total + (yr * gyr).sum()
        if r == rank:
            my = (yr, xr, router)
    total.backward()
    where = f"case {case}"
    assert layer.stats.shadowed == tuple(sorted(case["expect"])), (where, layer.stats.shadowed)
    f32 = torch.float32  # _close: a reference grad of None (no token) means zeros
    _close(f"{where}: y", y, my[0].detach(), f32, rank)
    _close(f"{where}: x.grad", x_grad, my[1].grad, f32, rank)
    _close(f"{where}: router grad", router_grad, my[2].lin.weight.grad, f32, rank)
    for l in range(L):
        e = rank * L + l
        for (n, q), q_ref in zip(layer.experts[str(e)].named_parameters(), experts[e].parameters()):
            want = None if q_ref.grad is None else 0.5 * q_ref.grad
            _close(f"{where}: expert {e} {n}.grad", q.grad, want, f32, rank)


def _shadow_worker(cases):
    failures = []
    for case in cases:
        try:
            _shadow_case(case)
        except Exception as e:  # noqa: BLE001
            failures.append(f"rank {dist.get_rank()}: {type(e).__name__}: {e}")
    return failures


# compute-bound constants: shadowing the hot expert pays off, a cold one never does
_CPU_LIKE = GreedyShadowPolicy(bandwidth=1e9, flop_rate=1e9)


def _shadow_cases(W):
    return [
        dict(kind="uniform", L=2, K=2, cf=None, seed=5, policy={0, 2 * W - 1}, schedule="pairwise",
             gs=1, expect={0, 2 * W - 1}),
        dict(kind="zero_tokens", L=1, K=1, cf=1.0, seed=6, policy={1}, schedule="pairwise", gs=2,
             expect={1}),
        dict(kind="uniform", L=2, K=2, cf=1.25, seed=7, policy=FixedShadowPolicy(frozenset({1})),
             schedule="alltoall", expect={1}),
        # the greedy rule on a skewed routing: it must pick the hot expert (and its runner-up
        # on the same rank may follow), never leave the hot one out
        dict(kind="skewed", L=2, K=2, cf=None, seed=8, policy=_CPU_LIKE, schedule="pairwise",
             gs=1, expect=_expected_greedy(W, 8)),
        dict(kind="one_expert", L=1, K=1, cf=None, seed=5, policy=_CPU_LIKE, schedule="alltoall",
             expect={5 % W}),
    ]


def _expected_greedy(W, seed, L=2, K=2):
    """What the greedy rule decides for _routing('skewed', ...): computed here, single process."""
    ids = _routing("skewed", W, W * L, K, seed)
    counts = [torch.bincount(i.reshape(-1), minlength=W * L).tolist() for i in ids]
    costs = ShadowCosts(num_local_experts=L, d_model=D, expert_numel=sum(
        q.numel() for q in _ffn(0).parameters()), token_bytes=4, param_bytes=4)
    chosen = set(_CPU_LIKE.decide(counts, costs))
    assert seed % (W * L) in chosen, ("the hot expert must be shadowed", chosen, counts)
    return chosen


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 4])
def test_shadowing_matches_dense_reference(dist_run, world_size):
    failures = sum(dist_run(_shadow_worker, _shadow_cases(world_size), world_size=world_size), [])
    assert not failures, "\n\n".join(failures)


# ---------------------------------------------------------------------------------------
# the greedy policy on hand-built counts
# ---------------------------------------------------------------------------------------
_COSTS = ShadowCosts(num_local_experts=2, d_model=512, expert_numel=2 * 512 * 1024,
                     token_bytes=4, param_bytes=4)


def test_greedy_shadows_the_hot_expert_not_a_cold_one():
    policy = GreedyShadowPolicy(bandwidth=1e9, flop_rate=2e10)
    # 2 ranks x 2 experts; expert 1 (on rank 0) gets most of both ranks' tokens
    counts = [[300, 3000, 200, 100],
              [200, 3000, 300, 100]]
    assert policy.decide(counts, _COSTS) == {1}
    t_none = policy.predict_step_time(counts, set(), _COSTS)
    assert policy.predict_step_time(counts, {1}, _COSTS) < t_none
    assert policy.predict_step_time(counts, {3}, _COSTS) > t_none  # the cold one costs more
    # the same load on rank 1's expert 2
    swapped = [[r[0], r[3], r[1], r[2]] for r in counts]
    assert policy.decide(swapped, _COSTS) == {2}
    # balanced: nothing to gain, nothing shadowed
    assert policy.decide([[500] * 4, [500] * 4], _COSTS) == frozenset()
    # a hot expert whose load is mostly its owner's own tokens: the broadcast does not pay
    assert policy.decide([[300, 3000, 200, 100], [200, 10, 300, 100]], _COSTS) == frozenset()
    # a small hot expert on a communication-bound layer: its token traffic costs less than
    # broadcasting its parameters, so it stays put; compute-bound, the same load is shadowed
    small = [[30, 300, 20, 10], [20, 300, 30, 10]]
    assert GreedyShadowPolicy(bandwidth=1e9, flop_rate=1e15).decide(small, _COSTS) == frozenset()
    assert policy.decide(small, _COSTS) == {1}
    # two hot experts on one rank: both, most loaded first; max_shadows caps it; experts
    # loaded only by their owner are never worth a broadcast
    two = [[1000, 3000, 0, 0], [1000, 3000, 100, 100]]
    assert policy.decide(two, _COSTS) == {0, 1}
    assert GreedyShadowPolicy(bandwidth=1e9, flop_rate=2e10, max_shadows=1).decide(two, _COSTS) == {1}
    # one rank: nothing to shadow
    assert policy.decide([[5, 9000, 1, 1]], _COSTS) == frozenset()


def test_latency_model_formula():
    policy = GreedyShadowPolicy(bandwidth=1e9, flop_rate=1e10, flops_per_row=1e6)
    costs = ShadowCosts(num_local_experts=1, d_model=100, expert_numel=1000, token_bytes=2,
                        param_bytes=4)
    counts = [[10, 30], [20, 40]]  # rank 0 owns expert 0, rank 1 expert 1
    # no shadows: rank 0 computes 30 rows, sends 30, receives 20; rank 1 computes 70
    t0 = 3 * 1e6 * 30 / 1e10 + 4 * 200 * 30 / 1e9
    t1 = 3 * 1e6 * 70 / 1e10 + 4 * 200 * 30 / 1e9
    assert policy.predict_step_time(counts, set(), costs) == pytest.approx(max(t0, t1))
    # shadow expert 1: rank 0 computes expert 0's 30 rows and its own 30 for expert 1 and
    # receives 20; rank 1 computes its 40 for expert 1 and sends 20
    t0 = 3 * 1e6 * 60 / 1e10 + 4 * 200 * 20 / 1e9
    t1 = 3 * 1e6 * 40 / 1e10 + 4 * 200 * 20 / 1e9
    shadow = 2 * 1000 * 4 / 1e9
    assert policy.predict_step_time(counts, {1}, costs) == pytest.approx(max(t0, t1) + shadow)


# ---------------------------------------------------------------------------------------
# bad arguments, disagreeing ranks, failing experts
# ---------------------------------------------------------------------------------------
def test_bad_arguments_single_process():
    experts = [nn.Linear(D, D) for _ in range(4)]
    with pytest.raises(ValueError, match=r"group_size must be a positive int .* got 0"):
        MoELayer(experts, 4, D, schedule="pairwise", group_size=0)
    with pytest.raises(ValueError, match=r"shadow_policy names expert\(s\) \[4, 9\], outside 0..3"):
        MoELayer(experts, 4, D, shadow_policy={1, 4, 9})
    with pytest.raises(ValueError, match="shadow_policy='best'.*'greedy'"):
        MoELayer(experts, 4, D, shadow_policy="best")
    with pytest.raises(TypeError, match="shadow_policy must be None"):
        MoELayer(experts, 4, D, shadow_policy=3)
    with pytest.raises(ValueError, match="expert ids must be ints >= 0"):
        MoELayer(experts, 4, D, shadow_policy={-1})
    mixed = experts[:3] + [nn.Linear(D, D, bias=False)]
    with pytest.raises(ValueError, match="local expert 3 has parameters"):
        MoELayer(mixed, 4, D, shadow_policy={0})
    with pytest.raises(ValueError, match="bandwidth must be a positive finite number"):
        GreedyShadowPolicy(bandwidth=0)
    with pytest.raises(ValueError, match="max_shadows"):
        GreedyShadowPolicy(max_shadows=-1)
    # one process: the pipeline runs locally; shadowing is moot (every expert is local)
    torch.manual_seed(0)
    a = MoELayer(copy.deepcopy(experts), 4, D)
    b = MoELayer(copy.deepcopy(experts), 4, D, schedule="pairwise", shadow_policy="greedy")
    b.router.load_state_dict(a.router.state_dict())
    x = torch.randn(9, D)
    torch.testing.assert_close(b(x), a(x), **TOL)
    assert b.stats.shadowed == ()


class _Exploding(nn.Module):
    def __init__(self, bad: bool):
        super().__init__()
        self.lin, self.bad = nn.Linear(D, D), bad

    def forward(self, x):
        if self.bad:
            raise KeyError("expert exploded")
        return self.lin(x)


def _errors_worker():
    rank, W = dist.get_rank(), dist.get_world_size()
    out = {}
    # ranks that disagree on the schedule would issue different collectives: caught at build
    out["disagree"] = _error_of(lambda: MoELayer([nn.Linear(D, D)], W, D, schedule="pairwise",
                                                 group_size=1 + rank))
    out["shadow_shapes"] = _error_of(lambda: MoELayer([nn.Linear(D, D, bias=rank == 0)], W, D,
                                                      shadow_policy={0}))
    out["schedule"] = _error_of(lambda: MoELayer([nn.Linear(D, D)], W, D,
                                                 schedule="pairwise" if rank else "alltoall"))
    for schedule, policy in (("pairwise", None), ("pairwise", {0}), ("alltoall", {W - 1})):
        layer = MoELayer([_Exploding(bad=rank == W - 1)], W, D, top_k=1, schedule=schedule,
                         group_size=1, shadow_policy=policy)
        out[schedule, bool(policy)] = _error_of(lambda: layer(torch.randn(6, D)))
    torch.manual_seed(0)  # the group is still in step: a healthy pairwise layer runs
    good = MoELayer([nn.Linear(D, D)], W, D, top_k=1, schedule="pairwise", group_size=1)
    x = torch.randn(5, D, requires_grad=True)
    good(x).sum().backward()
    out["healthy"] = x.grad is not None
    return out


@pytest.mark.dist
def test_disagreeing_ranks_and_failing_experts_raise_everywhere(dist_run):
    results = dist_run(_errors_worker, world_size=2)
    for rank, out in enumerate(results):
        assert out["disagree"][0] == "ValueError", out["disagree"]
        assert "(group_size: 1 on rank 0, 2 on rank 1)" in out["disagree"][1], out["disagree"]
        assert out["shadow_shapes"][0] == "ValueError", out["shadow_shapes"]
        assert "expert parameters (names, shapes, dtypes)" in out["shadow_shapes"][1]
        # a field sent as a checksum: each rank names its own value (before, none)
        own = "'pairwise'" if rank else "'alltoall'"
        assert out["schedule"][0] == "ValueError", out["schedule"]
        assert f"schedule on rank(s) [1] differ from rank 0's (here: {own})" in \
            out["schedule"][1], out["schedule"]
        assert out["healthy"]
        for key in (("pairwise", False), ("pairwise", True), ("alltoall", True)):
            if rank == 1:  # the failing rank raises its own error
                assert out[key] == ("KeyError", "'expert exploded'"), (key, out[key])
            else:
                assert out[key][0] == "RuntimeError" and "rank(s) [1]" in out[key][1], (key, out[key])


def _invalid_on_one_rank(arg: str):
    """An argument valid on rank 0 and invalid on rank 1 (which raises its own error):
    each rank's (error type, message), and whether the group is still usable after."""
    rank, W = dist.get_rank(), dist.get_world_size()
    bad = {"top_k": dict(top_k=5 * W), "score_func": dict(score_func="relu"),
           "route_scale": dict(route_scale=-1.0)}[arg]
    kw = bad if rank == 1 else {}
    got = _error_of(lambda: MoELayer([nn.Linear(D, D)], W, D, **{"top_k": 1, **kw}))
    t = torch.ones(1)
    dist.all_reduce(t)  # (every rank left the build at the same collective)
    return got, t.item() == W


@pytest.mark.dist
@pytest.mark.parametrize("arg", ["top_k", "score_func", "route_scale"])
def test_an_argument_invalid_on_one_rank_is_named_on_every_rank(dist_run, arg):
    # the invalid rank raises its own error; the others, waiting in the build's agreement,
    # raise naming it (before, they waited for the process group's timeout)
    (e0, e1) = [got for got, _ in dist_run(_invalid_on_one_rank, arg, world_size=2,
                                           timeout=30, teardown=True)]
    assert e1[0] == "ValueError" and arg in e1[1], e1
    assert e0[0] == "ValueError" and "rank(s) [1]" in e0[1], e0
