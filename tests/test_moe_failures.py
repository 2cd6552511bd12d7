"""MoELayer failure modes on 2 gloo ranks: every rank raises a clear error, none hangs.

Each test reproduces a failure a user met (a hang, an abort, a bare gloo error); the pool's
call timeout turns a hang into a failed test.
"""

from __future__ import annotations

import copy
import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _dist import stall_until_the_others_return
import tribucket
from tribucket.moe import MoELayer, gathered_experts
from test_moe import D, _dense_moe, _error_of, _ffn, _in_step


# ---------------------------------------------------------------- d_model differs by rank
def _d_model_mismatch():
    d = D + 4 if dist.get_rank() == 0 else D
    return _error_of(lambda: MoELayer([nn.Linear(d, d)], 2, d, top_k=1))


@pytest.mark.dist
def test_d_model_mismatch_is_checked_before_the_router_broadcast(dist_run):
    # before: the router broadcast ran first and aborted rank 1 (gloo size mismatch)
    results = dist_run(_d_model_mismatch, world_size=2, timeout=60)
    for rank, (kind, message) in enumerate(results):
        assert kind == "ValueError", (rank, kind, message)
        assert "d_model: 16 on rank 0, 12 on rank 1" in message, message


# ---------------------------------------------------------------- bad input on one rank
class _Router(nn.Module):
    """A router that returns one column too many on ``bad_rank``."""

    def __init__(self, E: int, bad_rank: int):
        super().__init__()
        self.lin = nn.Linear(D, E, bias=False)
        self.bad = dist.get_rank() == bad_rank

    def forward(self, x):
        y = self.lin(x)
        return torch.cat([y, y[:, :1]], 1) if self.bad else y


def _bad_input_on_one_rank():
    rank, W = dist.get_rank(), dist.get_world_size()
    out = {}
    layer = MoELayer([nn.Linear(D, D)], W, D, top_k=1)
    x = torch.randn(4, D + 1 if rank == 1 else D)
    out["x"] = _error_of(lambda: layer(x))
    bad_router = MoELayer([nn.Linear(D, D)], W, D, top_k=1, router=_Router(W, bad_rank=1))
    out["router"] = _error_of(lambda: bad_router(torch.randn(5, D)))
    out["healthy"] = _in_step(layer)
    return out


@pytest.mark.dist
def test_bad_input_on_one_rank_raises_on_every_rank(dist_run):
    # before: rank 1 raised before the counts exchange and rank 0 hung in it
    results = dist_run(_bad_input_on_one_rank, world_size=2, timeout=40)
    assert results[1]["x"][0] == "ValueError" and "d_model=12" in results[1]["x"][1]
    assert results[1]["router"][0] == "ValueError" and "router returned" in results[1]["router"][1]
    for what in ("x", "router"):
        kind, message = results[0][what]
        assert kind == "RuntimeError" and "rank(s) [1]" in message, (what, message)
    assert results[0]["healthy"] and results[1]["healthy"]


# ---------------------------------------------------------------- evaluation on one rank
def _evaluate_on_rank_0(cf):
    rank, W = dist.get_rank(), dist.get_world_size()
    L, K, seed = 2, 2, 5
    E = W * L
    torch.manual_seed(seed)
    router = nn.Linear(D, E, bias=False)
    experts = [_ffn(seed * 100 + e) for e in range(E)]
    layer = MoELayer([copy.deepcopy(experts[e]) for e in range(rank * L, rank * L + L)], E, D,
                     top_k=K, router=copy.deepcopy(router), capacity_factor=cf)
    model = nn.Sequential(nn.Identity(), layer)
    x = torch.randn(9, D, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        y_dist = model(x)  # every rank: the distributed forward
    out = None
    with gathered_experts(model):  # every rank enters: one gather of the experts
        if rank == 0:  # then rank 0 alone evaluates, with no collective
            model.eval()
            with torch.no_grad():
                y_local = model(x)
            want, _, _ = _dense_moe(x, router, experts, K, cf, True)
            out = (y_local, y_dist, want, layer.stats)
    with torch.no_grad():  # leaving restores the expert-parallel layer
        y_again = model(x)
    return out, torch.equal(y_again, y_dist)


@pytest.mark.dist
@pytest.mark.parametrize("cf", [None, 1.0])
def test_evaluate_on_one_rank_inside_gathered_experts(dist_run, cf):
    results = dist_run(_evaluate_on_rank_0, cf, world_size=2, timeout=60)
    (y_local, y_dist, want, stats), same_after = results[0]
    torch.testing.assert_close(y_local, y_dist, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(y_local, want, atol=2e-6, rtol=1e-5)
    assert stats.capacity == (None if cf is None else 5), stats  # ceil(1.0 * 9 * 2 / 4)
    assert results[1][0] is None and same_after and results[1][1]


# ---------------------------------------------------------------- stalls and dead peers
def _peer_fails(mode, timeout_s=1.5):
    rank = dist.get_rank()
    torch.manual_seed(0)
    # with a shared expert, a stall in backward is met in an exchange with the shared
    # expert's backward beside it (the return's reverse)
    layer = MoELayer([nn.Linear(D, D)], 2, D, top_k=1, name="block3.moe",
                     timeout=datetime.timedelta(seconds=timeout_s),
                     shared_experts=nn.Linear(D, D) if mode == "backward" else None)
    try:
        for step in range(3):
            x = torch.randn(5, D, requires_grad=True)
            if step == 1 and rank == 1:
                if mode == "exit":
                    os._exit(7)
                if mode == "forward":
                    stall_until_the_others_return(timeout_s * 2.5)
                    return "slept", time.monotonic()
                if mode == "evaluate":  # `if rank == 0: evaluate(model)`: rank 1 goes on
                    return "skipped", time.monotonic()
            y = layer(x)
            if step == 1 and rank == 1 and mode == "backward":
                stall_until_the_others_return(timeout_s * 2.5)
                return "slept", time.monotonic()
            y.sum().backward()
    except RuntimeError as e:
        return str(e), time.monotonic()
    return "no error", time.monotonic()


@pytest.mark.dist
@pytest.mark.parametrize("mode", ["forward", "backward", "exit", "evaluate"])
def test_peer_failure_names_layer_phase_and_rank(dist_run, mode):
    # before: a stall blocked rank 0 for the process group's timeout (30 min on gloo), a
    # dead peer surfaced as a bare gloo error
    results = dist_run(_peer_fails, mode, world_size=2, timeout=60, teardown=True,
                       expect_dead=(1,) if mode == "exit" else ())
    message, raised_at = results[0]
    assert "MoE layer 'block3.moe'" in message, message
    phase = "backward" if mode == "backward" else "counts"
    assert f"in its {phase} phase" in message, message
    assert "rank 1" in message, message
    if mode in ("forward", "backward"):
        assert "timed out" in message.lower(), message
        assert raised_at < results[1][1], (raised_at, results[1])  # while rank 1 slept
    if mode == "evaluate":
        assert "gathered_experts" in message, message


def _clip_with_a_stalled_peer(timeout_s=1.5):
    """tribucket.clip_grad_norm_ sums the experts' norms over the expert-parallel group: with
    the layer's ``timeout``, a peer that never calls it must not hold the others longer."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    layer = MoELayer([nn.Linear(D, D)], 2, D, top_k=1, name="block3.moe",
                     timeout=datetime.timedelta(seconds=timeout_s))
    layer(torch.randn(5, D)).sum().backward()
    if rank == 1:
        stall_until_the_others_return(timeout_s * 2.5)
        return "slept", time.monotonic()
    try:
        tribucket.clip_grad_norm_(layer, 1.0)
    except RuntimeError as e:
        return str(e), time.monotonic()
    return "no error", time.monotonic()


@pytest.mark.dist
def test_clip_with_a_stalled_peer_is_bounded_by_the_layers_timeout(dist_run):
    results = dist_run(_clip_with_a_stalled_peer, world_size=2, timeout=60, teardown=True)
    message, raised_at = results[0]
    assert "tribucket.clip_grad_norm_" in message and "expert-parallel" in message, message
    assert "timed out" in message.lower(), message
    assert raised_at < results[1][1], (raised_at, results[1])  # while rank 1 slept


# ---------------------------------------------------------------- training inside the gather
def _step_inside_gathered():
    """An optimizer step taken inside gathered_experts: each rank's copies of the other
    ranks' experts are detached, and its own experts would see only its own tokens."""
    rank, W = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(3)
    router = nn.Linear(D, 2 * W, bias=False)
    layer = MoELayer([_ffn(10 * rank + e) for e in range(2)], 2 * W, D, top_k=2,
                     router=router)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    before = [p.detach().clone() for p in layer.parameters()]
    x = torch.randn(8, D, generator=torch.Generator().manual_seed(rank))
    error = None
    with gathered_experts(layer):
        try:
            layer(x).square().sum().backward()
            opt.step()
        except RuntimeError as e:
            error = str(e)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, layer.parameters()))
    return error, unchanged


@pytest.mark.dist
def test_backward_inside_gathered_experts_is_refused(dist_run):
    for error, unchanged in dist_run(_step_inside_gathered, world_size=2, timeout=60):
        assert error is not None and "gathered_experts" in error and "evaluation" in error, error
        assert unchanged


# ---------------------------------------------------------------- construction on one rank
def _local_experts_differ():
    rank = dist.get_rank()
    experts = [_ffn(10 * rank + e) for e in range(1 if rank == 1 else 2)]
    try:
        MoELayer(experts, 4, D, top_k=2)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.dist
def test_local_expert_counts_that_differ_are_named_on_every_rank(dist_run):
    # before: rank 1 raised alone; rank 0 waited in the construction's all-gather
    for rank, msg in enumerate(dist_run(_local_experts_differ, world_size=2, timeout=40,
                                        teardown=True)):
        assert msg is not None and "local experts" in msg, (rank, msg)
        assert "2 on rank 0" in msg and "1 on rank 1" in msg, (rank, msg)


def _gathered_on_one_rank(timeout_s=1.5):
    rank = dist.get_rank()
    torch.manual_seed(0)
    layer = MoELayer([nn.Linear(D, D)], 2, D, top_k=1, name="block1.moe",
                     timeout=datetime.timedelta(seconds=timeout_s))
    try:
        if rank == 0:
            with gathered_experts(layer):
                pass
        else:
            with torch.no_grad():
                layer(torch.randn(5, D))
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.dist
def test_gathered_experts_entered_on_one_rank_is_named(dist_run):
    results = dist_run(_gathered_on_one_rank, world_size=2, timeout=60, teardown=True)
    for rank, msg in enumerate(results):
        assert msg is not None and "gathered_experts" in msg, (rank, msg)
        assert "block1.moe" in msg and "rank" in msg, (rank, msg)
