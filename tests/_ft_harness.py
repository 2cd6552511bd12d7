"""A torchft Lighthouse and replica groups as subprocesses, each bounded in time and killed
on the way out (for tests/test_ft.py and perf/bench_ft.py).

    with FTRun(tmpdir) as run:
        run.lighthouse()
        a = run.replica(0, steps=20)
        b = run.replica(1, steps=20, die_at=5)
        run.wait_for(lambda: run.steps(0) and run.steps(0)[-1]["step"] >= 10, 30, "...")
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Callable

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "_ft_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lighthouse_binary() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    return here if os.path.exists(here) else (shutil.which("torchft_lighthouse") or here)


class FTRun:
    """The processes of one run; ``close()`` (or leaving the ``with``) kills what is left."""

    def __init__(self, workdir: str, heartbeat_timeout_ms: int = 5000,
                 join_timeout_ms: int = 2000, min_replicas: int = 1):
        self.dir = workdir
        self.heartbeat_timeout_ms, self.join_timeout_ms = heartbeat_timeout_ms, join_timeout_ms
        self.min_replicas = min_replicas
        self.procs: list[subprocess.Popen] = []
        self.address = ""
        self.logs: dict[str, str] = {}

    def __enter__(self) -> "FTRun":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def lighthouse(self) -> str:
        port = free_port()
        out = open(os.path.join(self.dir, "lighthouse.log"), "w")
        self.procs.append(subprocess.Popen(
            [lighthouse_binary(), "--min_replicas", str(self.min_replicas), "--quorum_tick_ms", "100",
             "--join_timeout_ms", str(self.join_timeout_ms),
             "--heartbeat_timeout_ms", str(self.heartbeat_timeout_ms),
             "--bind", f"127.0.0.1:{port}"], stdout=out, stderr=subprocess.STDOUT))
        deadline = time.time() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.time() > deadline or self.procs[-1].poll() is not None:
                    raise RuntimeError(f"the lighthouse did not start: {self.tail('lighthouse')}")
                time.sleep(0.05)
        self.address = f"http://127.0.0.1:{port}"
        return self.address

    def replica(self, replica: int, tag: str | None = None, worker: str = WORKER,
                env_over: dict | None = None, **options) -> subprocess.Popen:
        """Start replica group ``replica`` (one process); ``options`` become worker flags
        (``die_at=5`` -> ``--die-at 5``). ``tag`` names its log files (default ``r<id>``);
        ``env_over`` overrides its environment (e.g. one ``MASTER_PORT`` for several)."""
        tag = tag or f"r{replica}"
        log, params = (os.path.join(self.dir, f"{tag}.{ext}") for ext in ("jsonl", "pt"))
        self.logs[tag] = log
        argv = [sys.executable, worker, "--log", log, "--params", params]
        for k, v in options.items():
            argv += [f"--{k.replace('_', '-')}", str(v)]
        return self.start(replica, tag, argv, env_over)

    def start(self, replica: int, tag: str, argv: list[str],
              env_over: dict | None = None) -> subprocess.Popen:
        """Run ``argv`` as replica group ``replica`` (one process, its own session), its
        output to ``<tag>.out``."""
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                   RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   REPLICA_GROUP_ID=str(replica), TORCHFT_LIGHTHOUSE=self.address,
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   OMP_NUM_THREADS="1")
        env.update(env_over or {})
        out = open(os.path.join(self.dir, f"{tag}.out"), "w")
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def records(self, tag: str) -> list[dict]:
        try:
            with open(self.logs[tag]) as f:
                return [json.loads(line) for line in f if line.endswith("\n")]
        except FileNotFoundError:
            return []

    def steps(self, tag: str, committed: bool | None = None) -> list[dict]:
        return [r for r in self.records(tag) if r["event"] == "step"
                and (committed is None or r["committed"] == committed)]

    def params(self, tag: str) -> dict[int, torch.Tensor]:
        return torch.load(self.logs[tag][:-len(".jsonl")] + ".pt")

    def tail(self, tag: str, n: int = 3000) -> str:
        try:
            with open(os.path.join(self.dir, f"{tag}.out" if tag != "lighthouse"
                                   else "lighthouse.log")) as f:
                return f.read()[-n:]
        except FileNotFoundError:
            return "(no output)"

    def wait_for(self, cond: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.time() + timeout
        while not cond():
            if time.time() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n" +
                                     "\n".join(f"--- {t}\n{self.tail(t)}" for t in self.logs))
            time.sleep(0.05)

    def wait_exit(self, proc: subprocess.Popen, timeout: float, tag: str) -> int:
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{tag} did not finish within {timeout:.0f} s\n"
                                 f"{self.tail(tag)}") from None

    def close(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL) if proc.args[0] == sys.executable \
                        else proc.kill()
                except (ProcessLookupError, PermissionError):
                    proc.kill()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()


def start_together(run: FTRun, tags: list[str], go: str, timeout: float = 120) -> None:
    """Wait until every replica in ``tags`` has built its manager, then let them all go."""
    run.wait_for(lambda: all(any(r["event"] == "start" for r in run.records(t)) for t in tags),
                 timeout, f"replicas {tags} to start")
    open(go, "w").close()
