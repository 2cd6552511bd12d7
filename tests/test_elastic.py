"""Elastic restarts with torchrun alone (``examples/elastic_train.py``): a rank SIGKILLed in
its backward costs the steps since the last checkpoint, and the restarted job ends with the
model of an uninterrupted run, bit for bit.

Two ``torchrun --standalone --nproc-per-node 2 --max-restarts 1`` jobs of the example run at
once (their start-ups overlap): one straight through, saving its checkpoints in the step,
and one that writes them in the background (``--async-save``) and in which rank 1 kills
itself at step K of the first attempt. Each is a process group of its own, bounded in time
and killed (with everything it started) if the test fails.
"""

from __future__ import annotations

import json
import os
import runpy
import shutil
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "elastic_train.py")
#: rank 1 is killed after the checkpoint of step 8 started: the one of step 4 is complete
#: then (each checkpoint waits for the write before it), whether or not that of step 8 is
STEPS, EVERY, KILL_AT = 12, 4, 10


def torchrun() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return here if os.path.exists(here) else (shutil.which("torchrun") or here)


def launch(tmp, name: str, **options) -> subprocess.Popen:
    argv = [torchrun(), "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
            SCRIPT, "--ckpt-dir", str(tmp / name), "--steps", str(STEPS),
            "--ckpt-every", str(EVERY), "--final", str(tmp / f"{name}.pt"),
            "--events", str(tmp / f"{name}.jsonl")]
    for k, v in options.items():
        argv += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = open(tmp / f"{name}.out", "w")
    return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)


def finish(proc: subprocess.Popen, tmp, name: str, timeout: float) -> None:
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        rc = None
    if rc != 0:
        tail = (tmp / f"{name}.out").read_text()[-4000:]
        raise AssertionError(f"torchrun job {name!r}: " +
                             (f"exit code {rc}" if rc is not None else
                              f"still running after {timeout:.0f} s") + f"\n{tail}")


def events(tmp, name: str) -> list[dict]:
    with open(tmp / f"{name}.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.timeout(240)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_sigkilled_rank_resumes_from_checkpoint_bit_for_bit(tmp_path):
    """Rank 1 SIGKILLed in the backward of step 10 (checkpoints every 4 steps, written in the
    background): torchrun restarts both ranks once, they resume from the last complete
    checkpoint (step 8, or 4 when the kill cut the write of 8 short: at most the steps since
    the last complete checkpoint are lost), and the final parameters equal those of the
    uninterrupted job bit for bit. The uninterrupted job saves in the step (``dcp.save``):
    its last checkpoint holds its final parameters."""
    procs = {}
    try:
        procs["straight"] = launch(tmp_path, "straight")
        procs["killed"] = launch(tmp_path, "killed", kill_at=KILL_AT, async_save=True)
        for name, proc in procs.items():
            finish(proc, tmp_path, name, 180)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)

    straight, killed = events(tmp_path, "straight"), events(tmp_path, "killed")
    assert {e["attempt"] for e in straight} == {0}, "the uninterrupted job restarted"
    kill = [e for e in killed if e["event"] == "kill"]
    assert [(e["attempt"], e["rank"], e["step"]) for e in kill] == [(0, 1, KILL_AT)], kill
    # the first attempt got as far as step K - 1 (and its checkpoints of steps 4 and 8)
    first = [e for e in killed if e["attempt"] == 0]
    assert max(e["step"] for e in first if e["event"] == "step") == KILL_AT - 1
    assert [e["step"] for e in first if e["event"] == "checkpoint" and e["rank"] == 0] == [4, 8]
    # the second resumed both ranks from the last complete checkpoint and finished
    second = [e for e in killed if e["attempt"] == 1]
    resumed = {e["rank"]: e["step"] for e in second if e["event"] == "resumed"}
    assert resumed in ({0: 8, 1: 8}, {0: 4, 1: 4}), resumed
    assert os.path.exists(tmp_path / "killed" / f"step_{resumed[0]}" / ".metadata")
    for rank in (0, 1):
        steps = [e["step"] for e in second if e["event"] == "step" and e["rank"] == rank]
        assert steps == list(range(resumed[0], STEPS)), (rank, steps)
    assert {e["rank"] for e in second if e["event"] == "done"} == {0, 1}

    a = torch.load(tmp_path / "straight.pt")
    b = torch.load(tmp_path / "killed.pt")
    assert [t.shape for t in a] == [t.shape for t in b]
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), (f"parameter {i}: the resumed job differs from the "
                                   f"uninterrupted one by {(x - y).abs().max().item():.3g}")
    # the checkpoint saved in the step reads back (here, without a process group)
    saved = {"model": runpy.run_path(SCRIPT)["build_model"]().state_dict()}
    dcp.load(saved, checkpoint_id=str(tmp_path / "straight" / f"step_{STEPS}"), no_dist=True)
    assert all(torch.equal(x, y) for x, y in zip(a, saved["model"].values()))
    init = runpy.run_path(SCRIPT)["build_model"]()
    assert not torch.equal(a[0], init[0].weight.detach()), "the model never trained"
