"""Uneven inputs (Join), peer failure without hangs, divergence detection, resumable state."""

from __future__ import annotations

import datetime
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as DDP

import tribucket
from tribucket import hooks
from _dist import stall_until_the_others_return, tribucket_log
from models import batch, build, loss_of
from test_reducer import _parity, assert_states_equal


# ---------------------------------------------------------------- Join: uneven inputs
def _join_vs_ddp(name, kwargs, divide_by_initial, hook=None, chunk_mb=None, method=False,
                 debug=False):
    """``method``: enter ``reducer.join(...)`` (DDP's spelling) instead of ``Join([reducer])``;
    ``debug``: the reducer's debug=True."""
    rank = dist.get_rank()
    n_batches = 2 + rank  # every rank has a different number of batches
    mine, theirs = build(name), build(name)
    ddp = DDP(theirs, **kwargs)
    opt_a = torch.optim.SGD(mine.parameters(), lr=0.1, momentum=0.9)
    opt_b = torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9)
    with tribucket.fused_bucketing(mine, comm_chunk_mb=chunk_mb, **kwargs,
                                   **(dict(debug=True) if debug else {})) as reducer:
        if hook is not None:
            reducer.register_comm_hook(None, getattr(hooks, hook))
            ddp.register_comm_hook(None, getattr(hooks, hook))
        join = reducer.join if method else lambda **kw: Join([reducer], **kw)
        with join(divide_by_initial_world_size=divide_by_initial):
            for step in range(n_batches):
                loss_of(mine(batch(name, rank, step))).backward()
                opt_a.step()
                opt_a.zero_grad()
        with ddp.join(divide_by_initial_world_size=divide_by_initial):
            for step in range(n_batches):
                loss_of(ddp(batch(name, rank, step))).backward()
                opt_b.step()
                opt_b.zero_grad()
        assert_states_equal(mine, theirs, f"rank {rank} after Join: ")
        return [p.detach().clone() for p in mine.parameters()]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("divide_by_initial", [True, False])
def test_join_matches_ddp_join(dist_run, world_size, divide_by_initial):
    cases = [("mlp", dict(bucket_cap_mb=0.001)), ("bn", {}),
             ("branchy", dict(find_unused_parameters=True))]
    for name, kwargs in cases:
        results = dist_run(_join_vs_ddp, name, kwargs, divide_by_initial,
                           world_size=world_size)
        for r in results[1:]:  # the final sync leaves every rank with the same model
            assert all(torch.equal(a, b) for a, b in zip(results[0], r))


def test_join_with_builtin_hook_and_chunks(dist_run):
    dist_run(_join_vs_ddp, "mlp", dict(bucket_cap_mb=0.001), True, hook="allreduce_hook",
             chunk_mb=0.0002, world_size=3)


class _Counter(Joinable):
    """A joinable of the user's that comes first in ``Join([...])``: it notifies the join
    context at the start of each iteration, as torch asks (its hooks do nothing)."""

    def __init__(self):
        super().__init__()

    def join_hook(self, **kwargs):
        return JoinHook()

    @property
    def join_device(self):
        return torch.device("cpu")

    @property
    def join_process_group(self):
        return dist.group.WORLD


def _second_joinable(divide_by_initial):
    """Every parameter after uneven steps under ``Join([reducer])`` and under
    ``Join([counter, reducer])``."""
    rank = dist.get_rank()
    out = []
    for second in (False, True):
        model = build("mlp")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with tribucket.fused_bucketing(model, bucket_cap_mb=0.001) as reducer:
            counter = _Counter()
            with Join([counter, reducer] if second else [reducer],
                      divide_by_initial_world_size=divide_by_initial):
                for step in range(1 + 2 * rank):
                    Join.notify_join_context(counter)
                    loss_of(model(batch("mlp", rank, step))).backward()
                    opt.step()
                    opt.zero_grad()
        out.append([p.detach().clone() for p in model.parameters()])
    return max((a - b).abs().max().item() for a, b in zip(*out))


@pytest.mark.parametrize("divide_by_initial", [True, False])
def test_the_reducer_divides_alike_as_a_later_joinable(dist_run, divide_by_initial):
    """torch gives the count of ranks still training to the first joinable only; the
    reducer takes it from the allreduce every iteration under Join already runs (DDP,
    second, divides by the initial world size whatever it is told)."""
    for rank, diff in enumerate(dist_run(_second_joinable, divide_by_initial, world_size=3)):
        assert diff == 0.0, f"rank {rank}: second in Join differs from first by {diff}"


def _join_throw(method=False):
    rank = dist.get_rank()
    model = build("mlp")
    try:
        with tribucket.fused_bucketing(model) as reducer:
            join = reducer.join if method else lambda **kw: Join([reducer], **kw)
            with join(throw_on_early_termination=True):
                for step in range(2 + rank):
                    loss_of(model(batch("mlp", rank, step))).backward()
    except RuntimeError as e:
        return str(e)
    return None


def test_join_throw_on_early_termination(dist_run):
    messages = dist_run(_join_throw, world_size=2)
    assert "exhausted" in messages[0]  # rank 0 ran out first
    assert "Detected at least one rank that exhausted inputs" in messages[1]


# ---------------------------------------------------------------- peer failure
def _peer_fails(mode, timeout_s=2.0):
    rank = dist.get_rank()
    model = build("mlp")
    try:
        with tribucket.fused_bucketing(model, bucket_cap_mb=0.001,
                                       timeout=datetime.timedelta(seconds=timeout_s)):
            for step in range(6):
                if step == 3 and rank == 1:
                    if mode == "exit":
                        os._exit(7)
                    stall_until_the_others_return(timeout_s * 2.5)  # past their timeout
                    return "slept", time.monotonic()  # (CLOCK_MONOTONIC: one clock per host)
                loss_of(model(batch("mlp", rank, step))).backward()
    except RuntimeError as e:
        return str(e), time.monotonic()
    return "no error"


@pytest.mark.parametrize("mode", ["exit", "stall"])
def test_peer_failure_raises_instead_of_hanging(dist_run, mode):
    # a hang fails the call at its 60 s timeout
    results = dist_run(_peer_fails, mode, world_size=3, timeout=60, teardown=True,
                       expect_dead=(1,) if mode == "exit" else ())
    for rank in (0, 2):
        message, raised_at = results[rank]
        assert "tribucket" in message and "bucket" in message, message
        assert "rank 1" in message, message  # the progress marks name the missing rank
        assert "timed out" in message.lower() or mode == "exit", message
        if mode == "stall":
            # raised by the timeout while rank 1 was still asleep, not when it came back
            assert raised_at < results[1][1], (raised_at, results[1])
    if mode == "stall":
        assert results[1][0] == "slept"


# ---------------------------------------------------------------- divergence detection
def _diverged(kind):
    """The error, and what close() logged after it (nothing: the group is given up)."""
    rank = dist.get_rank()
    model = build("mlp")
    with tribucket_log() as logged:
        try:
            with tribucket.fused_bucketing(model, debug=True,
                                           timeout=datetime.timedelta(seconds=20)) as reducer:
                if kind == "hooks" and rank == 1:
                    reducer.register_comm_hook(None, hooks.fp16_compress_hook)
                for step in range(4):
                    x = batch("mlp", rank, step)
                    if kind == "no_sync" and rank == 1 and step == 1:
                        with reducer.no_sync():  # control flow differs on rank 1
                            loss_of(model(x)).backward()
                        continue
                    loss_of(model(x)).backward()
        except RuntimeError as e:
            return str(e), [m for m in logged if "close()" in m]
    return None, logged


@pytest.mark.parametrize("kind", ["no_sync", "hooks"])
def test_debug_names_first_differing_bucket(dist_run, kind):
    results = dist_run(_diverged, kind, world_size=2, timeout=60)
    messages = [msg for msg, _ in results]
    # before, close() then waited on the works of the pass the divergence broke, and logged
    # "'NoneType' object has no attribute 'wait'"
    assert [logged for _, logged in results] == [[], []], results
    if kind == "hooks":  # caught before any bucket: the first backward compares the hooks
        for msg in messages:
            assert msg is not None and "fp16_compress_hook" in msg and "rank 1" in msg, msg
        return
    for msg in messages:
        assert msg is not None and "diverged" in msg and "bucket 0" in msg, msg
        assert "rank 0:" in msg and "rank 1:" in msg


def _debug_where_the_ranks_agree():
    """debug=True on runs whose collectives pair up: sparse gradients (each rank's own rows)
    and Join (a rank out of inputs shadows the others' collectives without forwards)."""
    out = []
    for name in ("sparse", "mlp"):
        try:
            if name == "sparse":
                _parity("sparse", tb_kwargs=dict(debug=True))
            else:
                _join_vs_ddp("mlp", dict(bucket_cap_mb=0.001), True, debug=True)
            out.append(None)
        except Exception as e:  # noqa: BLE001
            out.append(str(e)[:300])
    return out


def test_debug_raises_nothing_where_the_ranks_agree(dist_run):
    # before, debug mode compared a sparse bucket's row count (each rank's own) and the
    # forward count of a rank shadowing the others under Join: it reported both runs as
    # diverged, though their collectives paired up and the gradients equal DDP's
    for out in dist_run(_debug_where_the_ranks_agree, world_size=2, timeout=120):
        assert out == [None, None], out


def _debug_logs_bucket_timings():
    import logging

    with tribucket_log(logging.INFO) as records:
        model = build("mlp")
        with tribucket.fused_bucketing(model, bucket_cap_mb=0.001, debug=True) as reducer:
            for step in range(2):
                loss_of(model(batch("mlp", dist.get_rank(), step))).backward()
            timings = reducer.stats.bucket_comm_s
    return [r for r in records if "bucket" in r and "ms from launch" in r], timings


def test_debug_logs_per_bucket_timings(dist_run):
    lines, timings = dist_run(_debug_logs_bucket_timings, world_size=2)[0]
    assert len(timings) > 1 and all(t >= 0 for t in timings)
    assert any("layers." in line or "head." in line for line in lines)


# ---------------------------------------------------------------- resumable state
def _make_hook(kind):
    if kind == "gossip":
        return hooks.GossipState(), hooks.gossip_hook
    if kind == "powersgd":
        return (psgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                   start_powerSGD_iter=2, random_seed=5), psgd.powerSGD_hook)
    return None, None


def _train(kind, steps, start, path=None, save_at=None):
    rank = dist.get_rank()
    model = build("mlp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with tribucket.fused_bucketing(model, bucket_cap_mb=0.001) as reducer:
        state, hook = _make_hook(kind)
        if hook is not None:
            reducer.register_comm_hook(state, hook)
        if start > 0:
            saved = torch.load(f"{path}.{rank}", weights_only=False)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            reducer.load_state_dict(saved["reducer"])
        for step in range(start, start + steps):
            loss_of(model(batch("mlp", rank, step))).backward()
            opt.step()
            opt.zero_grad()
            if save_at is not None and step + 1 == save_at:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                            "reducer": reducer.state_dict()}, f"{path}.{rank}")
        return [p.detach().clone() for p in model.parameters()], reducer.stats.rebuilds


@pytest.mark.parametrize("kind,world_size", [("default", 2), ("gossip", 3), ("powersgd", 2)])
def test_resume_is_bit_exact(dist_run, kind, world_size):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        # six steps straight, checkpointed after the third; then the last three again,
        # resumed from that checkpoint in fresh processes
        straight = dist_run(_train, kind, 6, 0, path, 3, world_size=world_size, teardown=True)
        resumed = dist_run(_train, kind, 3, 3, path, world_size=world_size)
    for (a, _), (b, rebuilds) in zip(straight, resumed):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        assert rebuilds == 1  # the rebuilt layout came from the checkpoint, not a new rebuild


def _load_mismatched_state():
    a = tribucket.Reducer(build("mlp"))
    b = tribucket.Reducer(build("tied"))
    try:
        b.load_state_dict(a.state_dict())
    except ValueError as e:
        return str(e)
    finally:
        a.close()
        b.close()


def test_load_state_dict_rejects_other_model(dist_run):
    msg = dist_run(_load_mismatched_state, world_size=2)[0]
    assert "other parameters" in msg


def _load_other_kinds_of_state():
    model = build("mlp")
    out = []
    for wrong in (model.state_dict(), None):
        reducer = tribucket.Reducer(model)
        try:
            reducer.load_state_dict(wrong)
        except TypeError as e:
            out.append(str(e))
        finally:
            reducer.close()
    return out


def test_load_state_dict_names_a_state_of_another_kind(dist_run):
    # the model's state_dict, or None, given to the reducer: before, "reducer state version
    # None is not supported" and Python's "'NoneType' object is not iterable"
    for msgs in dist_run(_load_other_kinds_of_state, world_size=2):
        assert len(msgs) == 2, msgs
        assert all("load_state_dict expects the dict of reducer.state_dict()" in m for m in msgs)
        assert "got a dict with keys ['" in msgs[0] and "weight'" in msgs[0], msgs
        assert "got NoneType" in msgs[1], msgs
