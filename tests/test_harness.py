"""The worker pool itself: results per rank, errors, hangs and dead ranks all fail fast."""

import os
import time

import pytest
import torch
import torch.distributed as dist

import _dist


def _allreduce_rank():
    t = torch.full((3,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t


def _raise_on_rank1():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    return "ok"


def _hang_on_rank0():
    if dist.get_rank() == 0:
        dist.barrier()  # the others never join: a real hang
    return "ok"


def _exit_on_rank1():
    if dist.get_rank() == 1:
        os._exit(3)
    time.sleep(30)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_pool_runs_on_every_rank(dist_run, world_size):
    results = dist_run(_allreduce_rank, world_size=world_size)
    total = world_size * (world_size + 1) / 2
    assert [r[0] for r in results] == list(range(world_size))
    assert all(r[1] == world_size for r in results)
    for _, _, t in results:
        torch.testing.assert_close(t, torch.full((3,), total))


def test_pool_reports_rank_traceback(dist_run):
    with pytest.raises(_dist.DistTestError, match=r"(?s)raised on rank\(s\) \[1\].*boom on rank 1"):
        dist_run(_raise_on_rank1, world_size=2)
    # the next call gets a fresh, working pool
    assert [r[0] for r in dist_run(_allreduce_rank, world_size=2)] == [0, 1]


def test_pool_hang_times_out_with_stacks(dist_run):
    # the message says the call timed out (not that a rank died) and shows the hung stack
    with pytest.raises(_dist.DistTestError, match=r"(?s)timed out.*_hang_on_rank0"):
        dist_run(_hang_on_rank0, world_size=2, timeout=5)


def test_pool_dead_rank_fails_fast(dist_run):
    # reported as a death, not as the 60 s timeout expiring
    with pytest.raises(_dist.DistTestError, match=r"rank\(s\) 1 \(exit code 3\) died"):
        dist_run(_exit_on_rank1, world_size=2, timeout=60)


def _worker_state(name):
    import sys

    return os.environ.get(name), "tribucket" in sys.modules, os.getpid()


def test_pool_workers_get_the_test_process_environment_and_nothing_else(dist_run, monkeypatch):
    """Workers are forked from a fork server that imported torch when the session's first
    pool started: each must still get the test process's environment as it is when its pool
    starts (as a spawned process would), and no module the test process imported since."""
    _dist.get_pool(2).close()  # the next call starts a pool now, after the change below
    monkeypatch.setenv("TRIBUCKET_POOL_PROBE", "set after the fork server started")
    import tribucket  # noqa: F401 - imported here; a worker must import it itself

    got = dist_run(_worker_state, "TRIBUCKET_POOL_PROBE", world_size=2)
    assert [g[0] for g in got] == ["set after the fork server started"] * 2
    assert not any(g[1] for g in got), "a worker inherited tribucket from the test process"
    assert len({g[2] for g in got} | {os.getpid()}) == 3
    _dist.get_pool(2).close()  # the later tests' workers without the variable
