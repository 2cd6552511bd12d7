"""Scripts that import tribucket exit with status 0, without ``gc.collect()``.

A gloo script can abort at interpreter shutdown ("terminate called without an active
exception") when a process group, or a finished gloo work holding a Python tensor, is still
alive then. Each variant of ``tests/scripts/user_script.py`` (a DDP-style loop, the sharded
optimizer, an MoE model; comm hook or not; native or Python gradient hooks) runs as a fresh
pair of processes and must exit 0 on both ranks.

``make test`` runs two of the variants once. For the full count (50 runs of each)::

    .venv/bin/python tests/test_exit.py --runs 50      # writes perf/results/exit.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "user_script.py"
# (shard_optimizer reduce-scatters each bucket itself and refuses comm hooks)
VARIANTS = [(kind, hook, native) for kind in ("ddp", "zero", "moe")
            for hook in ("none", "fp16") for native in ("1", "0")
            if not (kind == "zero" and hook != "none")]
#: the variants ``make test`` runs (one run each; both drive fused_bucketing's DDP-style
#: loop, one with the sharded optimizer and native hooks, one with MoE layers, the fp16 hook
#: and the Python hooks): a run costs seconds, mostly torch's import
QUICK = [("zero", "none", "1"), ("moe", "fp16", "0")]
TIMEOUT_S = 180


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(kind: str, hook: str, native: str, world: int = 2) -> list[tuple[int, str]]:
    """One run of the script on ``world`` fresh processes: (exit status, output tail) each."""
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PYTHONPATH=str(ROOT))
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), kind, hook, native],
                                      env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    out = []
    deadline = time.monotonic() + TIMEOUT_S
    for p in procs:
        try:
            text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            text, _ = p.communicate()
            out.append((-999, (text or "")[-2000:] + "\n[timed out]"))
            continue
        out.append((p.returncode, (text or "")[-2000:]))
    return out


@pytest.mark.parametrize("kind,hook,native", QUICK,
                         ids=[f"{k}-{h}-{'native' if n == '1' else 'python'}"
                              for k, h, n in QUICK])
def test_script_exits_cleanly(kind, hook, native):
    results = run_once(kind, hook, native)
    bad = [(rank, rc, tail) for rank, (rc, tail) in enumerate(results) if rc != 0]
    assert not bad, "\n\n".join(f"rank {r} exit status {rc}:\n{t}" for r, rc, t in bad)
    assert "losses" in results[0][1], results[0][1]


def _fake_task(root, tid: int, comm: str, state: str) -> None:
    d = root / str(tid)
    d.mkdir()
    (d / "comm").write_text(comm + "\n")
    (d / "stat").write_text(f"{tid} ({comm}) {state} 1 2 3 4\n")


def test_exit_waits_for_running_gloo_workers(tmp_path):
    """The exit handler's last step: it returns once gloo's worker threads are idle (S),
    and gives up after its timeout while one keeps running (R)."""
    from tribucket import _exit

    _fake_task(tmp_path, 11, "python", "R")            # the main thread: not a worker
    _fake_task(tmp_path, 12, "pt_gloo_runloop", "S")   # idle, waiting for work
    _fake_task(tmp_path, 13, "gloo_tcp_loop", "R")     # the transport loop: not a worker
    assert _exit._busy_threads(_exit._GLOO_WORKER, str(tmp_path)) == []
    assert _exit._let_gloo_workers_finish(0.5, str(tmp_path)) is True
    _fake_task(tmp_path, 14, "pt_gloo_runloop", "R")   # still finishing a collective
    assert _exit._busy_threads(_exit._GLOO_WORKER, str(tmp_path)) == [14]
    t0 = time.monotonic()
    assert _exit._let_gloo_workers_finish(0.05, str(tmp_path)) is False
    assert time.monotonic() - t0 < 1.0  # bounded: exit is never held up for long
    assert _exit._busy_threads(_exit._GLOO_WORKER, str(tmp_path / "missing")) == []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--out", default=str(ROOT / "perf" / "results" / "exit.json"))
    args = ap.parse_args()
    counts = {}
    for kind, hook, native in VARIANTS:
        name = f"{kind}, hook {hook}, {'native' if native == '1' else 'Python'} hooks"
        failed = []
        tails = []
        for i in range(args.runs):
            out = run_once(kind, hook, native)
            codes = [rc for rc, _ in out]
            if any(codes):
                failed.append(codes)
                tails.append([tail for rc, tail in out if rc])  # (faulthandler's stacks)
        counts[name] = {"runs": args.runs, "non_zero": len(failed), "codes": failed,
                        "output_of_failed_ranks": tails}
        print(f"{name}: {len(failed)} of {args.runs} runs exited non-zero {failed}",
              flush=True)
    with open(os.getloadavg and "/proc/loadavg") as f:
        load = f.read().split()[0]
    pathlib.Path(args.out).write_text(json.dumps(
        {"variants": counts, "world_size": 2, "load_1min_at_end": float(load)}, indent=1))


if __name__ == "__main__":
    main()
