"""MoELayer and MoEDispatcher on gloo ranks against a dense single-process reference.

Shape legend: T tokens, D model dim, E experts (global), K top-k, L experts per rank, W ranks.

Every rank builds all E experts and the router from one seed and can regenerate every
rank's tokens, so each rank computes the whole layer densely (per expert, no permutation, no
communication, capacity drops decided by a Python loop over tokens) and compares its own
``y``, ``x.grad``, router grad and local experts' grads (summed over every rank's tokens).
"""

from __future__ import annotations

import copy
import math
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tribucket._tags import is_expert_parallel
from tribucket.moe import FixedShadowPolicy, GroupedExperts, MoEDispatcher, MoELayer
from tribucket.testing import moe_routings

D, F = 12, 20  # model and expert hidden width of the parity tests

# (atol, rtol) per dtype: fp32 differs only by summation order; bf16 layers round every
# expert matmul to 8 bits of mantissa (compared with an fp32 reference of the same weights)
TOL = {torch.float32: (2e-6, 1e-5), torch.bfloat16: (6e-2, 5e-2)}


def _ffn(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D, F), nn.GELU(), nn.Linear(F, D))


def _build(seed: int, E: int):
    torch.manual_seed(seed)
    router = nn.Linear(D, E, bias=False)
    return router, [_ffn(seed * 100 + e) for e in range(E)]


def _tokens(seed: int, rank: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)


def _capacity(cf, T, K, E):
    return None if cf is None else math.ceil(Fraction(str(cf)) * T * K / E)


def _dense_moe(x_TD, router, experts, K, cf, normalize):
    """The layer, written out densely: returns (y_TD, expert_ids_TK, kept_TK)."""
    probs_TE = torch.softmax(router(x_TD).float(), dim=-1)
    w_TK, ids_TK = torch.topk(probs_TE, K, dim=-1)
    if normalize:
        w_TK = w_TK / w_TK.sum(-1, keepdim=True)
    T, E = x_TD.shape[0], len(experts)
    cap = _capacity(cf, T, K, E)
    kept_TK = torch.ones(T, K, dtype=torch.bool)
    taken = [0] * E
    for t in range(T):  # token order: later tokens are the ones dropped
        for k in range(K):
            e = int(ids_TK[t, k])
            if cap is not None and taken[e] >= cap:
                kept_TK[t, k] = False
            taken[e] += 1
    y_TD = torch.zeros(T, D)
    for e in range(E):
        t_idx, k_idx = torch.nonzero(kept_TK & (ids_TK == e), as_tuple=True)
        if len(t_idx):
            y_TD = y_TD.index_add(0, t_idx, w_TK[t_idx, k_idx, None] * experts[e](x_TD[t_idx]))
    return y_TD, ids_TK, kept_TK


def _close(name, got, want, dtype, rank):
    assert got is not None, f"rank {rank}: {name} is None"
    if want is None:  # the reference saw no token of this rank: its gradient is zero
        want = torch.zeros_like(got)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol,
                               msg=lambda m: f"rank {rank}: {name} differs from the dense reference\n{m}")


def _check_layer_parity(case: dict) -> None:
    rank, W = dist.get_rank(), dist.get_world_size()
    K, cf, L, dtype, seed = case["k"], case["cf"], case["L"], case["dtype"], case["seed"]
    tokens, scale = case.get("tokens") or [11 + 3 * r for r in range(W)], case.get("scale", 1.0)
    E = W * L
    normalize = K > 1
    router, experts = _build(seed, E)
    data = [_tokens(seed, r, tokens[r]) for r in range(W)]

    layer = MoELayer([copy.deepcopy(experts[e]).to(dtype) for e in range(rank * L, rank * L + L)],
                     E, D, top_k=K, router=copy.deepcopy(router), capacity_factor=cf,
                     expert_grad_scale=scale, backend=case.get("backend", "auto"),
                     dedup=case.get("dedup", False))
    x = data[rank][0].to(dtype).requires_grad_()
    y = layer(x)
    (y.float() * data[rank][1]).sum().backward()
    # (checks come after every collective: a failing rank must not leave the others waiting)

    # dense reference over every rank's tokens (fp32, from the same dtype-rounded weights)
    ref_experts = [copy.deepcopy(e).to(dtype).float() for e in experts]
    ref_routers = [copy.deepcopy(router) for _ in range(W)]
    total, recv_E = 0.0, torch.zeros(E, dtype=torch.int64)
    for r in range(W):
        xr = data[r][0].to(dtype).float().requires_grad_()
        yr, ids_TK, kept_TK = _dense_moe(xr, ref_routers[r], ref_experts, K, cf, normalize)
        total = total + (yr * data[r][1]).sum()
        recv_E += torch.bincount(ids_TK[kept_TK], minlength=E)
        if r == rank:
            x_ref, y_ref, my_ids, my_kept = xr, yr, ids_TK, kept_TK
    total.backward()

    assert y.shape == x.shape and y.dtype == dtype, (y.shape, y.dtype)
    s = layer.stats  # integers: exact
    assert s.tokens_per_expert == tuple(torch.bincount(my_ids.reshape(-1), minlength=E).tolist()), s
    assert s.dropped == int((~my_kept).sum()), s
    assert s.tokens_received == tuple(recv_E[rank * L:rank * L + L].tolist()), s
    assert s.capacity == _capacity(cf, tokens[rank], K, E)
    _close("y", y, y_ref, dtype, rank)
    _close("x.grad", x.grad, x_ref.grad, dtype, rank)
    _close("router grad", layer.router.weight.grad, ref_routers[rank].weight.grad, dtype, rank)
    for l in range(L):
        e = rank * L + l
        for (n, p), p_ref in zip(layer.experts[str(e)].named_parameters(), ref_experts[e].parameters()):
            want = None if p_ref.grad is None else scale * p_ref.grad
            _close(f"expert {e} {n}.grad", p.grad, want, dtype, rank)


def _parity_worker(cases):
    """Failures per case (every case runs on every rank, so the ranks stay in step)."""
    failures = []
    for case in cases:
        try:
            _check_layer_parity(case)
        except Exception as e:  # noqa: BLE001 - report, and stay in step with the other ranks
            failures.append(f"rank {dist.get_rank()}, case {case}: {type(e).__name__}: {e}")
    return failures


def _parity_cases(world_size: int) -> list[dict]:
    # every (k, capacity, L) on 2 ranks; on 4 ranks (which oversubscribe 2 cores) a subset
    factors = (None, 1.0, 1.25) if world_size == 2 else (None, 1.25)
    cases = [dict(k=k, cf=cf, L=L, dtype=torch.float32, seed=7 + i)
             for i, (k, cf, L) in enumerate((k, cf, L) for k in (1, 2) for cf in factors
                                            for L in (1, 2))]
    cases += [dict(k=k, cf=cf, L=L, dtype=torch.bfloat16, seed=50 + i)
              for i, (k, cf, L) in enumerate(((1, None, 2), (2, None, 1), (2, 1.0, 2), (2, 1.25, 1)))]
    zero = [0] + [9] * (world_size - 1)  # rank 0 has no tokens at all
    cases += [dict(k=2, cf=None, L=2, dtype=torch.float32, seed=90, tokens=zero),
              dict(k=1, cf=1.0, L=1, dtype=torch.float32, seed=91, tokens=zero[::-1]),
              dict(k=2, cf=1.25, L=2, dtype=torch.float32, seed=92, scale=0.5),
              # the Triton kernels themselves (interpreter on CPU), through the whole layer
              dict(k=2, cf=1.0, L=2, dtype=torch.float32, seed=93, tokens=[5] * world_size,
                   backend="triton")]
    # each token sent once per rank (dedup): with drops, bf16 rows, a rank without tokens,
    # and through the Triton kernels
    cases += [dict(case, dedup=True, seed=case["seed"] + 100) for case in cases
              if case["seed"] in (14, 16, 18, 52, 90, 93)]
    return cases


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 4])
def test_layer_matches_dense_reference(dist_run, world_size):
    cases = _parity_cases(world_size)
    failures = sum(dist_run(_parity_worker, cases, world_size=world_size), [])
    assert not failures, "\n\n".join(failures)


# ---------------------------------------------------------------------------------------
# the dispatcher with fixed routings (hypothesis)
# ---------------------------------------------------------------------------------------
def _expected_layout(all_ids, rank, L, E, cap):
    """Python-loop reference of dispatch: (dest_TK, send_splits, recv_splits, per-expert rows)."""
    W = len(all_ids)
    rows = {e: [] for e in range(E)}  # e -> [(source rank, token)] in arrival order
    dests = []
    for r, ids in enumerate(all_ids):
        T, K = ids.shape
        by_expert = {e: [] for e in range(E)}
        for t in range(T):
            for k in range(K):
                by_expert[int(ids[t, k])].append((t, k))
        dest = torch.full((T, K), -1, dtype=torch.int64)
        n = 0
        for e in range(E):
            for j, (t, k) in enumerate(by_expert[e]):
                if cap[r] is None or j < cap[r]:
                    dest[t, k] = n
                    n += 1
                    rows[e].append((r, t))
        dests.append(dest)
    send = [sum(1 for e in range(w * L, w * L + L) for (src, _) in rows[e] if src == rank)
            for w in range(W)]
    recv = [sum(1 for e in range(rank * L, rank * L + L) for (src, _) in rows[e] if src == w)
            for w in range(W)]
    mine = [rows[e] for e in range(rank * L, rank * L + L)]
    return dests[rank], send, recv, mine


def _check_dispatch(routing, L, cf, seed):
    rank = dist.get_rank()
    E, K = routing.num_experts, routing.top_k
    all_ids = routing.expert_ids
    xs, ws, gys = [], [], []
    for r, ids in enumerate(all_ids):
        g = torch.Generator().manual_seed(seed + r)
        T = ids.shape[0]
        xs.append(torch.randn(T, D, generator=g))
        ws.append(torch.rand(T, K, generator=g) + 0.1)
        gys.append(torch.randn(T, D, generator=g))
    maps = [torch.randn(D, D, generator=torch.Generator().manual_seed(seed + 77 + e)) for e in range(E)]

    disp = MoEDispatcher(E, capacity_factor=cf)
    x = xs[rank].clone().requires_grad_()
    w = ws[rank].clone().requires_grad_()
    expert_input, meta = disp.dispatch(x, all_ids[rank], w)

    caps = [_capacity(cf, ids.shape[0], K, E) for ids in all_ids]
    dest, send, recv, mine = _expected_layout(all_ids, rank, L, E, caps)
    assert meta.dest_TK.dtype == torch.int64, meta.dest_TK.dtype
    assert torch.equal(meta.dest_TK, dest), (meta.dest_TK, dest)
    assert list(meta.send_splits) == send, (meta.send_splits, send)
    assert list(meta.recv_splits) == recv, (meta.recv_splits, recv)
    assert list(meta.tokens_per_expert) == [len(m) for m in mine]
    assert torch.equal(meta.counts_E, torch.bincount(all_ids[rank].reshape(-1), minlength=E))
    want_rows = [xs[src][t] for m in mine for (src, t) in m]
    want = torch.stack(want_rows) if want_rows else torch.empty(0, D)
    assert torch.equal(expert_input.detach(), want), "expert_input rows differ"  # copies: exact

    # linear experts (shared across ranks by seed); their maps are the expert parameters
    local = [maps[e].clone().requires_grad_() for e in range(rank * L, rank * L + L)]
    outs = [c @ m for c, m in zip(expert_input.split(list(meta.tokens_per_expert)), local)]
    y = disp.combine(outs, meta)
    (y * gys[rank]).sum().backward()

    # the same through exchange_by_source: one block per source rank, experts on its pieces
    x2, w2 = xs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_()
    meta2 = disp.plan(x2, all_ids[rank], w2)
    blocks = disp.exchange_by_source(disp.pack(x2, meta2), meta2)
    assert [len(b) for b in blocks] == recv, ([len(b) for b in blocks], recv)
    for source, b in enumerate(blocks):  # that rank's rows by local expert, then token
        rows = [xs[src][t] for m in mine for (src, t) in m if src == source]
        assert torch.equal(b.detach(), torch.stack(rows) if rows else torch.empty(0, D)), source
    local2 = [maps[e].clone().requires_grad_() for e in range(rank * L, rank * L + L)]
    outs2 = [torch.cat([p @ m for p, m in zip(b.split(list(counts)), local2)])
             for b, counts in zip(blocks, meta2.recv_counts_host)]
    y2 = disp.combine(outs2, meta2, by_source=True)
    (y2 * gys[rank]).sum().backward()

    ref_maps = [m.clone().requires_grad_() for m in maps]
    total = 0.0
    for r, ids in enumerate(all_ids):
        xr, wr = xs[r].clone().requires_grad_(), ws[r].clone().requires_grad_()
        dr = _expected_layout(all_ids, r, L, E, caps)[0]
        yr = torch.zeros(ids.shape[0], D)
        for k in range(K):
            kept = dr[:, k] >= 0
            for e in range(E):
                sel = kept & (ids[:, k] == e)
                yr = yr + torch.where(sel[:, None], wr[:, k, None] * (xr @ ref_maps[e]), 0.0)
        total = total + (yr * gys[r]).sum()
        if r == rank:
            x_ref, w_ref, y_ref = xr, wr, yr
    total.backward()
    tol = dict(atol=1e-5, rtol=1e-5)
    for label, (yy, xx, ww, mm) in (("", (y, x, w, local)), ("by source: ", (y2, x2, w2, local2))):
        torch.testing.assert_close(yy, y_ref, **tol, msg=lambda m: label + m)
        torch.testing.assert_close(xx.grad, x_ref.grad, **tol, msg=lambda m: label + m)
        torch.testing.assert_close(ww.grad, w_ref.grad, **tol, msg=lambda m: label + m)
        for l, m in enumerate(mm):
            torch.testing.assert_close(m.grad, ref_maps[rank * L + l].grad, **tol,
                                       msg=lambda m: label + m)


def _dispatch_worker(cases):
    for routing, L, cf, seed in cases:
        try:
            _check_dispatch(routing, L, cf, seed)
        except AssertionError as e:
            raise AssertionError(f"{routing.kind} routing, L={L}, capacity_factor={cf}: {e}") from e
    return len(cases)


@st.composite
def _dispatch_cases(draw, world_size):
    L = draw(st.sampled_from([1, 2]))
    K = draw(st.integers(1, min(3, world_size * L)))
    cf = draw(st.sampled_from([None, 0.5, 1.0, 1.25]))
    routing = draw(moe_routings(world_size, world_size * L, K, max_tokens=12))
    return routing, L, cf, draw(st.integers(0, 10_000))


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 4])
def test_dispatch_routings_hypothesis(dist_run, world_size):
    @settings(max_examples=12, deadline=None, database=None)
    @given(cases=st.lists(_dispatch_cases(world_size), min_size=1, max_size=8))
    def check(cases):
        assert dist_run(_dispatch_worker, cases, world_size=world_size) == [len(cases)] * world_size

    check()


def _fixed_routing_worker(kind):
    """Deterministic extremes: everything to one expert; a rank that sends nothing."""
    from tribucket.testing import MoERouting

    W = dist.get_world_size()
    if kind == "all_to_one":
        ids = tuple(torch.full((7 + r, 1), W - 1, dtype=torch.int64) for r in range(W))
        cases = [(MoERouting(kind, W, 1, ids), 1, None, 1), (MoERouting(kind, W, 1, ids), 1, 1.0, 2)]
    else:  # only rank 0 has tokens, and they all go to rank 0's experts
        ids = tuple(torch.zeros((9 if r == 0 else 0, 1), dtype=torch.int64) for r in range(W))
        cases = [(MoERouting(kind, 2 * W, 1, ids), 2, None, 3)]
    return _dispatch_worker(cases)


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["all_to_one", "one_sender"])
def test_dispatch_extreme_routings(dist_run, kind):
    cases = 2 if kind == "all_to_one" else 1
    assert dist_run(_fixed_routing_worker, kind, world_size=4) == [cases] * 4


# ---------------------------------------------------------------------------------------
# bad input: clear errors, before any collective, on every rank
# ---------------------------------------------------------------------------------------
class _CountCollectives:
    """Counts the torch.distributed collectives issued inside the block."""

    NAMES = ("all_to_all_single", "broadcast", "all_reduce", "all_gather", "barrier")

    def __enter__(self):
        self.calls: list[str] = []
        self._saved = {n: getattr(dist, n) for n in self.NAMES}
        for n, fn in self._saved.items():
            def counted(*a, _n=n, _fn=fn, **kw):
                self.calls.append(_n)
                return _fn(*a, **kw)
            setattr(dist, n, counted)
        return self

    def __exit__(self, *exc):
        for n, fn in self._saved.items():
            setattr(dist, n, fn)


def _error_of(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return None


class _BadOnRank(nn.Module):
    """A Linear expert that misbehaves on one rank: wrong output shape, or an exception."""

    def __init__(self, bad_rank: int, how: str):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.bad = dist.get_rank() == bad_rank
        self.how = how

    def forward(self, x):
        if self.bad and self.how == "shape":
            return self.lin(x)[:, : D - 1]
        if self.bad:
            raise KeyError("expert exploded")
        return self.lin(x)


def _bad_input_worker():
    W, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    with _CountCollectives() as c:
        # a local-expert count that does not match num_experts: named after the construction's
        # agreement (one all-gather), so a rank whose count alone is wrong cannot leave its
        # peers waiting in that all-gather
        out["mismatch"] = _error_of(lambda: MoELayer([nn.Linear(D, D)], 2 * W, D))
        out["calls_in_mismatch"] = list(c.calls)
    with _CountCollectives() as c:
        out["indivisible"] = _error_of(lambda: MoELayer([nn.Linear(D, D)], 3, D))
        out["top_k"] = _error_of(lambda: MoELayer([nn.Linear(D, D)], W, D, top_k=W + 1))
        out["dispatcher"] = _error_of(lambda: MoEDispatcher(2 * W + 1))
        out["calls_before_layer"] = list(c.calls)
    layer = MoELayer([nn.Linear(D, D)], W, D)
    with _CountCollectives() as c:
        out["x_dim"] = _error_of(lambda: layer(torch.randn(4, D + 1)))
        out["calls_before_forward"] = list(c.calls)
    # only the last rank's expert ids are out of range: its flag rides on the counts exchange
    disp = MoEDispatcher(W)
    ids = torch.full((3, 1), W if rank == W - 1 else 0)
    with _CountCollectives() as c:
        out["ids_range"] = _error_of(lambda: disp.dispatch(torch.randn(3, D), ids, torch.ones(3, 1)))
        out["calls_in_bad_dispatch"] = list(c.calls)
    for how in ("shape", "raise"):
        bad = MoELayer([_BadOnRank(bad_rank=W - 1, how=how)], W, D, top_k=1)
        out[how] = _error_of(lambda: bad(torch.randn(6, D)))
        # with a shared expert, its second half computed beside the return exchange (with
        # and without autograd): the same errors
        bad = MoELayer([_BadOnRank(bad_rank=W - 1, how=how)], W, D, top_k=1,
                       shared_experts=nn.Linear(D, D))
        out[how + " shared"] = _error_of(lambda: bad(torch.randn(6, D, requires_grad=True)))
        with torch.no_grad():
            out[how + " shared no_grad"] = _error_of(lambda: bad(torch.randn(6, D)))
        # each token sent once per rank (its flag rows and failure path are its own)
        bad = MoELayer([_BadOnRank(bad_rank=W - 1, how=how)], W, D, top_k=1, dedup=True,
                       shared_experts=nn.Linear(D, D))
        out[how + " dedup"] = _error_of(lambda: bad(torch.randn(6, D, requires_grad=True)))
    torch.manual_seed(0)
    out["healthy"] = _in_step(MoELayer([nn.Linear(D, D)], W, D, top_k=1))
    return out


def _bad_shared_expert_worker():
    """A shared expert that returns the wrong shape or raises on the last rank only, in each
    schedule: every rank raises, the bad one its own error."""
    W = dist.get_world_size()
    out = {}
    for how in ("shape", "raise"):
        shared = _BadOnRank(bad_rank=W - 1, how=how)
        for name, kwargs in (("alltoall", {}), ("dedup", dict(dedup=True)),
                             ("pairwise", dict(schedule="pairwise")),
                             ("shadowed", dict(shadow_policy=FixedShadowPolicy([0])))):
            layer = MoELayer([nn.Linear(D, D)], W, D, top_k=1, shared_experts=shared, **kwargs)
            for grad in (True, False):
                with torch.set_grad_enabled(grad):
                    x = torch.randn(6, D, requires_grad=grad)
                    out[f"{how} {name} grad={grad}"] = _error_of(lambda: layer(x))
    torch.manual_seed(0)
    out["healthy"] = _in_step(MoELayer([nn.Linear(D, D)], W, D, top_k=1))
    return out


@pytest.mark.dist
def test_a_bad_shared_expert_on_one_rank_raises_on_every_rank(dist_run):
    # before, a shared expert of the wrong shape raised torch's broadcasting error on its
    # own rank only, after the forward's last exchange: the others went on into backward
    results = dist_run(_bad_shared_expert_worker, world_size=2)
    for key, got in results[1].items():
        if key.startswith("shape"):
            assert got[0] == "ValueError", (key, got)
            assert "shared expert 0 on rank 1 returned (" in got[1], (key, got)
            assert ", 11) for an input of shape [" in got[1], (key, got)
        elif key.startswith("raise"):
            assert got == ("KeyError", "'expert exploded'"), (key, got)
    for key, got in results[0].items():
        if key != "healthy":
            assert got is not None and got[0] == "RuntimeError", (key, got)
            assert "rank(s) [1]" in got[1] and "shared" in got[1], (key, got)
    assert results[0]["healthy"] and results[1]["healthy"]


def _in_step(layer) -> bool:
    """The group is still in step after errors: ``layer`` runs forward and backward on
    every rank (each rank calls this)."""
    x = torch.randn(5, D, requires_grad=True)
    layer(x).sum().backward()
    return x.grad is not None


def _collectives_of_a_step_worker():
    W = dist.get_world_size()
    calls = []
    for dedup in (False, True):
        torch.manual_seed(0)
        layer = MoELayer([nn.Linear(D, D), nn.Linear(D, D)], 2 * W, D, top_k=2, dedup=dedup)
        x = torch.randn(10, D, requires_grad=True)
        with _CountCollectives() as c:
            layer(x).sum().backward()
        calls.append(c.calls)
    return calls


@pytest.mark.dist
def test_a_layer_step_issues_five_all_to_alls_and_nothing_else(dist_run):
    # forward: counts, tokens out, tokens back (each rank's expert-output flag rides on the
    # last one, in a row of its own); backward: the two reverse exchanges. Before, the flag
    # took an all-reduce of its own (6 collectives). Sending each token once per rank
    # (dedup) adds none: its weights and places ride in the token rows.
    for per_slot, dedup in dist_run(_collectives_of_a_step_worker, world_size=2):
        assert per_slot == dedup == ["all_to_all_single"] * 5, (per_slot, dedup)


def _host_reads_of_a_step_worker():
    """Device-to-host reads (``tolist``/``item``) in one forward+backward, with and without
    the expert-output check: each is a stall of the whole stream on a GPU."""
    torch.manual_seed(0)
    W = dist.get_world_size()
    layer = MoELayer([nn.Linear(D, D), nn.Linear(D, D)], 2 * W, D, top_k=2)
    reads = []
    tolist, item = torch.Tensor.tolist, torch.Tensor.item

    def counted(fn):
        def read(self, *a):
            reads.append(fn.__name__)
            return fn(self, *a)
        return read

    out = {}
    for check in (True, False):
        layer.dispatcher.check_expert_output = check
        x = torch.randn(10, D, requires_grad=True)
        reads.clear()
        torch.Tensor.tolist, torch.Tensor.item = counted(tolist), counted(item)
        try:
            layer(x).sum().backward()
        finally:
            torch.Tensor.tolist, torch.Tensor.item = tolist, item
        out[check] = list(reads)
    return out


@pytest.mark.dist
def test_a_layer_step_reads_the_host_once_per_check(dist_run):
    # the counts (the split sizes of the token exchanges) and, with the check on, the
    # expert-output flags; the range check of the expert ids rides on the counts' read.
    # Before, the ids' min and max took a read of their own (3 and 2).
    for out in dist_run(_host_reads_of_a_step_worker, world_size=2):
        assert out[True] == ["tolist"] * 2, out
        assert out[False] == ["tolist"], out


@pytest.mark.dist
def test_bad_input_errors_before_collectives(dist_run):
    results = dist_run(_bad_input_worker, world_size=2)
    for rank, out in enumerate(results):
        assert out["indivisible"][0] == "ValueError" and "num_experts=3" in out["indivisible"][1] \
            and "divisible" in out["indivisible"][1], out["indivisible"]
        assert out["mismatch"][0] == "ValueError" and "num_experts=4" in out["mismatch"][1]
        assert out["top_k"][0] == "ValueError" and "top_k=3" in out["top_k"][1], out["top_k"]
        assert out["dispatcher"][0] == "ValueError" and "num_experts=5" in out["dispatcher"][1]
        # a refused build joins the agreement's all-gather once, with a row saying so: a peer
        # that accepted its arguments waits there (the dispatcher alone sends nothing)
        assert out["calls_before_layer"] == ["all_gather"] * 2, out["calls_before_layer"]
        assert out["calls_in_mismatch"] == ["all_gather"], out["calls_in_mismatch"]
        assert out["x_dim"][0] == "ValueError" and "d_model=12" in out["x_dim"][1], out["x_dim"]
        # a bad x joins the counts exchange (flagged), so a rank with good input cannot hang
        assert out["calls_before_forward"] == ["all_to_all_single"], out["calls_before_forward"]
        assert out["calls_in_bad_dispatch"] == ["all_to_all_single"], out["calls_in_bad_dispatch"]
        assert out["healthy"]
    assert results[1]["ids_range"][0] == "ValueError" and "expert 2" in results[1]["ids_range"][1]
    assert results[0]["ids_range"][0] == "RuntimeError", results[0]["ids_range"]
    assert "rank(s) [1]" in results[0]["ids_range"][1] and "bad input" in results[0]["ids_range"][1]
    # rank 1's expert misbehaves: it raises the real error, rank 0 a RuntimeError naming it
    for extra in ("", " shared", " shared no_grad", " dedup"):
        shape, raised = results[1]["shape" + extra], results[1]["raise" + extra]
        assert shape[0] == "ValueError", shape
        assert "expert 1 (local expert 0 on rank 1) returned (" in shape[1]
        assert ", 11) for an input of shape [" in shape[1], shape
        assert raised == ("KeyError", "'expert exploded'"), raised
        for peer in (results[0]["shape" + extra], results[0]["raise" + extra]):
            assert peer[0] == "RuntimeError" and "rank(s) [1]" in peer[1], peer


def test_bad_arguments_single_process():
    experts = [nn.Linear(D, D) for _ in range(4)]
    with pytest.raises(ValueError, match=r"top_k=5 must be an int in 1..num_experts \(4\)"):
        MoELayer(experts, 4, D, top_k=5)
    with pytest.raises(ValueError, match="schedule='ring'"):
        MoELayer(experts, 4, D, schedule="ring")
    with pytest.raises(ValueError, match="dedup='always' is not one of True, False, 'auto'"):
        MoELayer(experts, 4, D, dedup="always")
    with pytest.raises(ValueError, match="dedup=True sends each token once per rank in the one-step"):
        MoELayer(experts, 4, D, schedule="pairwise", dedup=True)
    with pytest.raises(ValueError, match="capacity_factor"):
        MoELayer(experts, 4, D, capacity_factor=-1.0)
    with pytest.raises(ValueError, match="num_experts=5"):
        MoELayer(experts, 5, D)
    with pytest.raises(TypeError, match="experts"):
        MoELayer([], 4, D)
    layer = MoELayer(experts, 4, D)
    with pytest.raises(ValueError, match=r"last dimension must be d_model=12"):
        layer(torch.randn(2, 3, D + 2))
    layer.experts["2"] = nn.Linear(D, D + 1)
    with pytest.raises(ValueError, match=r"expert 2 \(local expert 2 on rank 0\) returned"):
        layer(torch.randn(40, D))
    disp = MoEDispatcher(4)
    x = torch.randn(3, D)
    _, meta = disp.dispatch(x, torch.zeros(3, 1, dtype=torch.int64), torch.ones(3, 1))
    with pytest.raises(ValueError, match=r"expected \[3, 12\]"):
        disp.combine(torch.zeros(3, D - 1), meta)
    with pytest.raises(ValueError, match="weights_TK"):
        disp.dispatch(x, torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 1))
    with pytest.raises(ValueError, match="expert -1"):
        disp.dispatch(x, torch.full((3, 1), -1), torch.ones(3, 1))


# ---------------------------------------------------------------------------------------
# gate math, losses, parameters, state_dict
# ---------------------------------------------------------------------------------------
def test_aux_loss_is_switch_balance_plus_z_loss():
    torch.manual_seed(0)
    E, K, T = 4, 2, 37
    layer = MoELayer([_ffn(e) for e in range(E)], E, D, top_k=K, aux_loss_coef=0.3, z_loss_coef=0.02)
    x = torch.randn(T, D)
    layer(x)
    logits = layer.router(x)
    probs = logits.softmax(-1)
    ids = probs.topk(K, dim=-1).indices
    f = torch.bincount(ids.reshape(-1), minlength=E).float() / (T * K)
    want = 0.3 * E * (f * probs.mean(0)).sum() + 0.02 * (torch.logsumexp(logits, -1) ** 2).mean()
    torch.testing.assert_close(layer.aux_loss, want)
    layer.aux_loss.backward()
    assert layer.router.weight.grad.abs().sum() > 0
    assert layer.stats.tokens_per_expert == tuple(torch.bincount(ids.reshape(-1), minlength=E).tolist())
    layer.zero_grad()
    empty = layer(torch.randn(0, D))
    assert empty.shape == (0, D) and float(layer.aux_loss.detach()) == 0.0
    layer.aux_loss.backward()  # still connected to the router (zero gradient)
    assert torch.count_nonzero(layer.router.weight.grad) == 0


def test_top1_normalised_gate_gives_router_no_gradient_from_y():
    torch.manual_seed(1)
    E = 4
    for normalize, expect_grad in ((True, False), (None, True)):  # None: top_k > 1 -> False
        layer = MoELayer([_ffn(e) for e in range(E)], E, D, top_k=1, normalize_weights=normalize)
        layer(torch.randn(9, D)).sum().backward(retain_graph=True)
        grad = layer.router.weight.grad
        assert (grad is not None and bool(grad.abs().sum() > 0)) == expect_grad, (normalize, grad)
        layer.aux_loss.backward()  # the router still learns from the balance loss
        assert layer.router.weight.grad.abs().sum() > 0


def test_expert_params_tagged_and_router_not():
    layer = MoELayer([_ffn(e) for e in range(2)], 2, D)
    assert all(is_expert_parallel(p) for p in layer.experts.parameters())
    assert not any(is_expert_parallel(p) for p in layer.router.parameters())


def _state_dict_worker():
    W, rank = dist.get_world_size(), dist.get_rank()
    experts = [_ffn(10 * rank + l) for l in range(2)]
    torch.manual_seed(100 + rank)  # a different router on every rank: creation broadcasts rank 0's
    layer = MoELayer(experts, 2 * W, D, router=nn.Linear(D, 2 * W, bias=False))
    sd = layer.state_dict()
    gathered = [None] * W
    dist.all_gather_object(gathered, {k: v.clone() for k, v in sd.items()})
    merged = {}
    for part in gathered:
        merged.update(part)
    fresh = MoELayer([_ffn(999) for _ in range(2)], 2 * W, D)
    fresh.load_state_dict(merged)  # strict: takes its own experts, ignores the others
    same = all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), sd.values()))
    return sorted(sd), layer.router.weight.clone(), same


@pytest.mark.dist
def test_state_dict_uses_global_expert_index_and_router_is_broadcast(dist_run):
    results = dist_run(_state_dict_worker, world_size=2)
    for rank, (keys, router_w, same) in enumerate(results):
        experts = sorted({k.split(".")[1] for k in keys if k.startswith("experts.")})
        assert experts == [str(2 * rank), str(2 * rank + 1)], keys
        assert same
        torch.testing.assert_close(router_w, results[0][1], rtol=0, atol=0)
    torch.manual_seed(100)
    assert torch.equal(results[0][1], nn.Linear(D, 4, bias=False).weight)


# ------------------------------------------------------------------ copies of a layer
def _model_with_experts(kind: str) -> nn.Module:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    inp = nn.Linear(D, D)
    torch.manual_seed(100 + rank)  # each rank its own experts
    experts = (GroupedExperts(2, D, F, first_index=2 * rank, impl="loop") if kind == "grouped"
               else nn.ModuleList(_ffn(100 + 2 * rank + e) for e in range(2)))
    torch.manual_seed(1)
    return nn.Sequential(inp, MoELayer(experts, num_experts=2 * world, d_model=D, top_k=2))


def _copy_trains_as_the_original(kind: str, how: str):
    """A copy of a trained model with an MoE layer (``deepcopy`` after a training forward,
    or ``assign``: load_state_dict(assign=True) into a new model): per expert parameter,
    whether it is tagged expert-parallel, and the largest gradient difference from the
    original's under fused_bucketing, one step each on the same tokens."""
    import tribucket

    rank = dist.get_rank()
    original = _model_with_experts(kind)
    x = torch.randn(6, D, generator=torch.Generator().manual_seed(rank))
    original(x).square().mean().backward()  # (the layer keeps this forward's aux_loss)
    original.zero_grad()
    if how == "deepcopy":
        twin = copy.deepcopy(original)
    else:
        twin = _model_with_experts(kind)
        twin.load_state_dict(original.state_dict(), assign=True)
    grads = []
    for m in (original, twin):
        with tribucket.fused_bucketing(m):
            (m(x).square().mean() + m[1].aux_loss).backward()
        grads.append([p.grad.clone() for p in m[1].experts.parameters()])
    tagged = [is_expert_parallel(p) for p in twin[1].experts.parameters()]
    return tagged, max((a - b).abs().max().item() for a, b in zip(*grads))


@pytest.mark.parametrize("how", ["deepcopy", "assign"])
@pytest.mark.parametrize("kind", ["list", "grouped"])
def test_a_copy_of_an_moe_model_trains_as_the_original(dist_run, kind, how):
    # the expert parameters' tags and gradient scale live on the Parameter objects
    for tagged, diff in dist_run(_copy_trains_as_the_original, kind, how, world_size=2,
                                 timeout=60):
        assert all(tagged), tagged
        assert diff == 0.0, diff


def _compiled_grouped_layer(backend: str):
    """A model with GroupedExperts(impl="auto") compiled (``backend``) against eager: the
    largest difference of the output and of the expert gradients."""
    eager = _model_with_experts("grouped")
    eager[1].experts.impl = "auto"
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend=backend)
    x = torch.randn(6, D, generator=torch.Generator().manual_seed(dist.get_rank()))
    outs = [m(x) for m in (eager, compiled)]
    for y in outs:
        y.square().mean().backward()
    grads = [[p.grad for p in m[1].experts.parameters()] for m in (eager, compiled_model)]
    return max([(outs[0] - outs[1]).abs().max().item()] +
               [(a - b).abs().max().item() for a, b in zip(*grads)])


def test_torch_compile_of_grouped_experts_runs_as_eager(dist_run):
    # torch's grouped GEMM has no compiled (fake) kernel for float32: "auto" takes the loop
    for diff in dist_run(_compiled_grouped_layer, "aot_eager", world_size=2, timeout=120,
                         teardown=True):
        assert diff <= 1e-6, diff
