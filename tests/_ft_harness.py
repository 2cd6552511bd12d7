"""A torchft Lighthouse and replica groups as subprocesses, each bounded in time and killed
on the way out (for tests/test_ft.py and perf/bench_ft.py).

    with FTRun(tmpdir) as run:
        run.lighthouse()
        a = run.replica(0, steps=20)
        b = run.replica(1, steps=20, die_at=5)
        run.wait_for(lambda: run.steps(0) and run.steps(0)[-1]["step"] >= 10, 30, "...")

``FTRun(tmpdir, zygote=Zygote())`` forks the Lighthouse and the replica groups from one
process that has imported torch, torchft and tribucket already: each starts in milliseconds
instead of the 3-5 s of CPU those imports cost (tests/test_ft.py starts about twenty on two
cores). Each is still a process of its own: its own session, environment, output and
process groups, SIGKILLed and restarted like any other. perf/bench_ft.py starts new
interpreters, so the seconds it reports for a restart include a real start-up.
"""

from __future__ import annotations

import json
import os
import queue
import random
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import Callable

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "_ft_worker.py")


def free_port() -> int:
    """A port free now, below Linux's ephemeral range (32768-60999): a port the system hands
    out (bind to 0: torchft's manager servers, gloo's connections) is never one of these,
    so it cannot be taken between this check and the process that binds it (a TCPStore
    once failed with EADDRINUSE so)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")


def lighthouse_binary() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    return here if os.path.exists(here) else (shutil.which("torchft_lighthouse") or here)


class Forked:
    """A process forked by a :class:`Zygote`, with what :class:`FTRun` uses of a ``Popen``."""

    def __init__(self, zygote: "Zygote", pid: int, args: list[str]):
        self.zygote, self.pid, self.args = zygote, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.time() + timeout
        while self.poll() is None:
            if deadline is not None and time.time() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def kill(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Zygote:
    """A process that imports what a replica group imports, then forks one child per
    :meth:`spawn` and reports each child's exit code (as ``Popen`` gives it: ``-9`` for a
    SIGKILL). Use it as a context manager; closing it ends the zygote, not its children."""

    def __init__(self, timeout: float = 120):
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--zygote"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                     OMP_NUM_THREADS="1"))
        self.replies: queue.Queue = queue.Queue()
        self.exits: dict[int, int] = {}
        self.lock, self.spawning = threading.Lock(), threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self.replies.get(timeout=timeout)  # {"ready": true} once the imports are done
        except queue.Empty:
            self.close()
            raise RuntimeError(f"the zygote did not start within {timeout:.0f} s") from None

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            if "exit" in msg:
                with self.lock:
                    self.exits[msg["pid"]] = msg["exit"]
            else:
                self.replies.put(msg)
        self.replies.put({"closed": True})

    def spawn(self, argv: list[str], env: dict, out: str) -> Forked:
        """Run the script ``argv[1]`` with arguments ``argv[2:]`` as ``python`` would, in a
        child with exactly ``env`` as its environment and its output to the file ``out``."""
        with self.spawning:  # one request in flight: its reply is the next one
            self.proc.stdin.write(json.dumps(dict(argv=argv, env=env, out=out)).encode() + b"\n")
            self.proc.stdin.flush()
            msg = self.replies.get(timeout=30)
        if "pid" not in msg:
            raise RuntimeError(f"the zygote exited (code {self.proc.poll()})")
        return Forked(self, msg["pid"], argv)

    def exit_code(self, pid: int) -> int | None:
        with self.lock:
            return self.exits.get(pid)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # the zygote ends when its input does
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def __enter__(self) -> "Zygote":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _zygote_main() -> None:
    """The zygote: import, say ready, then fork on each request and report exits. It
    starts no thread (a child would inherit the locks another thread held at the fork)."""
    import torch  # noqa: F401 - what every replica group imports, once
    import torch._dynamo  # noqa: F401 - torch.optim imports it at the first optimizer (2 s)
    import torch.distributed  # noqa: F401
    import torchft  # noqa: F401

    import tribucket  # noqa: F401

    def send(**msg) -> None:
        os.write(1, json.dumps(msg).encode() + b"\n")

    send(ready=True)
    buf, open_input = b"", True
    while open_input:
        if select.select([0], [], [], 0.02)[0]:
            chunk = os.read(0, 1 << 16)
            open_input = bool(chunk)
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                pid = os.fork()
                if pid == 0:
                    _zygote_child(json.loads(line))
                send(pid=pid)
        while True:  # report the children that ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            send(pid=pid, exit=os.waitstatus_to_exitcode(status))


def _zygote_child(req: dict) -> None:
    """In the forked child: a session, environment, argv and output of its own, then the
    script as ``__main__``; never returns."""
    code = 1
    try:
        os.setsid()
        out = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.close(null)
        os.environ.clear()
        os.environ.update(req["env"])
        script = req["argv"][1]
        sys.argv = req["argv"][1:]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:  # as python exits: None is 0, a message is printed and 1
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - reported as python would, exit code 1
            traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


class FTRun:
    """The processes of one run; ``close()`` (or leaving the ``with``) kills what is left.
    With a ``zygote``, :meth:`replica` forks the replica groups from it."""

    def __init__(self, workdir: str, heartbeat_timeout_ms: int = 5000,
                 join_timeout_ms: int = 2000, min_replicas: int = 1,
                 zygote: Zygote | None = None):
        self.dir = workdir
        self.heartbeat_timeout_ms, self.join_timeout_ms = heartbeat_timeout_ms, join_timeout_ms
        self.min_replicas = min_replicas
        self.zygote = zygote
        self.procs: list[subprocess.Popen] = []
        self.address = ""
        self.logs: dict[str, str] = {}

    def __enter__(self) -> "FTRun":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def lighthouse(self) -> str:
        port = free_port()
        binary, log = lighthouse_binary(), os.path.join(self.dir, "lighthouse.log")
        argv = [binary, "--min_replicas", str(self.min_replicas), "--quorum_tick_ms", "100",
                "--join_timeout_ms", str(self.join_timeout_ms),
                "--heartbeat_timeout_ms", str(self.heartbeat_timeout_ms),
                "--bind", f"127.0.0.1:{port}"]
        if self.zygote is not None:  # the same server, from torchft's Python API
            argv = [sys.executable, os.path.abspath(__file__), "--lighthouse"] + argv[1:]
            self.procs.append(self.zygote.spawn(argv, dict(os.environ), log))
        else:
            with open(log, "w") as out:
                self.procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT))
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
        return self.start(replica, tag, argv, env_over, fork=self.zygote is not None)

    def start(self, replica: int, tag: str, argv: list[str], env_over: dict | None = None,
              fork: bool = False) -> subprocess.Popen | Forked:
        """Run ``argv`` as replica group ``replica`` (one process, its own session), its
        output to ``<tag>.out``; ``fork``: forked from the run's zygote (``argv`` then is
        ``[python, script, ...]``), else a new interpreter."""
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                   RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   REPLICA_GROUP_ID=str(replica), TORCHFT_LIGHTHOUSE=self.address,
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   OMP_NUM_THREADS="1")
        env.update(env_over or {})
        path = os.path.join(self.dir, f"{tag}.out")
        if fork:
            proc = self.zygote.spawn(argv, env, path)
        else:
            with open(path, "w") as out:
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


def _lighthouse_main(flags: list[str]) -> None:
    """``torchft_lighthouse``'s server with the same flags, run from a zygote (the
    command-line entry point reads the process's own argv, which a fork cannot change)."""
    from torchft._torchft import LighthouseServer

    opts = dict(zip(flags[::2], flags[1::2]))
    server = LighthouseServer(
        bind=opts["--bind"], min_replicas=int(opts["--min_replicas"]),
        join_timeout_ms=int(opts["--join_timeout_ms"]),
        quorum_tick_ms=int(opts["--quorum_tick_ms"]),
        heartbeat_timeout_ms=int(opts["--heartbeat_timeout_ms"]))
    print(f"lighthouse listening on {server.address()}", flush=True)
    while True:  # until the run kills it
        time.sleep(3600)


if __name__ == "__main__":
    if sys.argv[1:] == ["--zygote"]:
        _zygote_main()
    elif sys.argv[1:2] == ["--lighthouse"]:
        _lighthouse_main(sys.argv[2:])
