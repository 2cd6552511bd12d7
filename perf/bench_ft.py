"""Fault-tolerant data parallelism on torchft: tribucket's reducer with a ``torchft.Manager``
against ``torchft.DistributedDataParallel`` (the baseline a torchft user picks), 2 replica
groups of one process each (gloo, one intra-op thread), one Lighthouse, in one run.

(a) Step time. Each replica group builds the model of ``bench_step`` (the 64 x Linear(256,
    256) MLP, or the 6-layer transformer) once per variant and trains them in turn, one step
    of each per round, the torchft ones through the same manager (every step is a quorum, the
    averaging, a ``should_commit``):

    * ``torchft DDP``               ``torchft.DistributedDataParallel`` + ``torchft.Optimizer``
    * ``tribucket+torchft``         ``fused_bucketing(model, manager=manager)`` + ``torchft.Optimizer``
    * ``tribucket+torchft fp16``    the same with ``fp16_compress_hook`` (fused compression)
    * ``tribucket``                 plain ``fused_bucketing(model)`` over a 2-process gloo
                                    group spanning the replica groups, no torchft (what the
                                    fault tolerance costs)

    and two references, whose gradients are not averaged: what torchft's per-step protocol
    costs by itself, apart from any allreduce:

    * ``no allreduce, torchft quorum``  the model alone + ``torchft.Optimizer`` (a quorum
                                        started at ``zero_grad``, ``should_commit`` at ``step``)
    * ``no allreduce``                  the model alone + its optimizer

    The figure is the median over rounds after warm-up of replica group 0's step time (from
    ``zero_grad``, which starts the quorum, to the end of ``step``, which asks
    ``should_commit``).

(b) Time lost per failure (``--failure``), with the small MLP of tests/_ft_worker.py: replica
    group 1 is SIGKILLed in its backward; the figure is the time from the kill to the
    survivor's next committed step (the Lighthouse's heartbeat timeout decides most of it),
    and, for the restarted replica group, from its launch to its first committed step and
    from its manager being up (imports and start-up excluded) to that step.

    The baseline without torchft: ``examples/elastic_train.py`` (the same MLP, optimizer and
    batches) under ``torchrun --nproc-per-node 2 --max-restarts 1``, a checkpoint
    (``torch.distributed.checkpoint``: model, optimizer, reducer state) every
    ``--ckpt-every`` steps; rank 1 is SIGKILLed in its backward at step ``--kill-at``, the
    whole job restarts and resumes from the last checkpoint. The figures: the time from the
    kill to the restarted job's first step, to it being back at the step of the kill, the
    steps lost (done again), and the time a checkpoint takes.

    python perf/bench_ft.py                    # (a) on the MLP -> perf/results/ft.{json,md,png}
                                               # ((b) kept from the results file)
    python perf/bench_ft.py --failure          # (a) and (b)
    python perf/bench_ft.py --failure-only     # (b); (a) kept from perf/results/ft.json
    python perf/bench_ft.py --elastic-only     # the torchrun recipe alone (in-step and background checkpoints)
    python perf/bench_ft.py --model transformer --rounds 20
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import statistics
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

RESULTS = HERE / "results"
VARIANTS = ["torchft DDP", "tribucket+torchft", "tribucket+torchft fp16", "tribucket",
            "no allreduce, torchft quorum", "no allreduce"]
#: the variants through the torchft manager (a quorum and should_commit every step)
FT_VARIANTS = VARIANTS[:3] + ["no allreduce, torchft quorum"]
#: the variants whose gradients are averaged by a tribucket reducer
TRIBUCKET_VARIANTS = VARIANTS[1:4]


# ------------------------------------------------------------------ one replica group
def replica_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--log", required=True)
    ap.add_argument("--params", default="")
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--go", default="")
    ap.add_argument("--plain-port", type=int, required=True)
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist
    import torchft

    import tribucket
    from _bench import turn_order
    from bench_step import make_model

    torch.set_num_threads(1)
    replica = int(os.environ["REPLICA_GROUP_ID"])
    # the default group spans the 2 replica groups (plain tribucket's); each replica group's
    # own group (one process) is what the torchft variants are given
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.plain_port}",
                            rank=replica, world_size=2)
    own = [dist.new_group([r]) for r in range(2)][replica]
    # the replica group's own store (MASTER_PORT), which the manager connects to; an env://
    # group of one process would have hosted it
    group_store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), 1,  # noqa: F841
                                is_master=True, wait_for_workers=False)
    log = open(args.log, "a", buffering=1)

    def emit(**rec) -> None:
        log.write(json.dumps(dict(t=time.time(), replica=replica, **rec)) + "\n")

    models, opts = {}, {}
    for name in VARIANTS:
        model, x = make_model(args.model)
        models[name] = model
        opts[name] = torch.optim.SGD(model.parameters(), lr=1e-3)
    torch.manual_seed(replica)
    x = torch.randn_like(x)

    def state_dict() -> dict:
        return {n: (models[n].state_dict(), opts[n].state_dict()) for n in VARIANTS}

    def load_state_dict(sd: dict) -> None:
        for n in VARIANTS:
            models[n].load_state_dict(sd[n][0])
            opts[n].load_state_dict(sd[n][1])

    timeout = datetime.timedelta(seconds=60)
    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=timeout), min_replica_size=1,
        load_state_dict=load_state_dict, state_dict=state_dict,
        replica_id=f"bench_{replica}", timeout=timeout)
    nets = {"torchft DDP": torchft.DistributedDataParallel(manager, models["torchft DDP"])}
    reducers = []
    for name in VARIANTS[1:]:
        nets[name] = models[name]
        if name not in TRIBUCKET_VARIANTS:  # the references: each replica group's own model
            continue
        if name in FT_VARIANTS:
            reducers.append(tribucket.fused_bucketing(models[name], own, manager=manager))
        else:  # plain tribucket across the 2 processes, no torchft
            reducers.append(tribucket.fused_bucketing(models[name]))
        if name.endswith("fp16"):
            reducers[-1].register_comm_hook(None, tribucket.hooks.fp16_compress_hook)
    optims = {n: torchft.Optimizer(manager, opts[n]) if n in FT_VARIANTS else opts[n]
              for n in VARIANTS}
    emit(event="start")
    while args.go and not os.path.exists(args.go):
        time.sleep(0.02)

    times: dict[str, list[float]] = {n: [] for n in VARIANTS}
    phases: dict[str, list[list[float]]] = {n: [] for n in VARIANTS}
    committed = {n: 0 for n in VARIANTS}
    for it in range(args.warmup + args.rounds):
        for name in turn_order(VARIANTS, it):  # the same order on every replica group
            t0 = time.perf_counter()
            optims[name].zero_grad()
            before = manager.current_step()
            t1 = time.perf_counter()
            loss = nets[name](x).float().square().mean()
            tf = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            optims[name].step()
            dt = time.perf_counter() - t0
            if it >= args.warmup:  # zero_grad (starts the quorum), forward, backward, step
                phases[name].append([t1 - t0, tf - t1, t2 - tf, t0 + dt - t2])
            committed[name] += (manager.current_step() == before + 1
                                if name in FT_VARIANTS else 1)
            if it >= args.warmup:
                times[name].append(dt)
    emit(event="times", times=times, committed=committed, phases=phases,
         participants=manager.num_participants())
    for r in reducers:
        r.close()
    manager.shutdown(wait=False)
    log.close()
    os._exit(0)


# ------------------------------------------------------------------ the orchestrator
def step_times(model: str, rounds: int, warmup: int) -> dict:
    from _ft_harness import FTRun, start_together

    with tempfile.TemporaryDirectory() as tmp, FTRun(tmp) as run:
        run.lighthouse()
        go = os.path.join(tmp, "go")
        from _ft_harness import free_port

        plain = free_port()
        procs = [run.replica(r, worker=__file__, model=model, rounds=rounds, warmup=warmup,
                             go=go, plain_port=plain) for r in (0, 1)]
        start_together(run, ["r0", "r1"], go, timeout=300)
        for r, p in enumerate(procs):
            if run.wait_exit(p, 1800, f"r{r}") != 0:
                raise RuntimeError(run.tail(f"r{r}"))
        rec = next(r for r in run.records("r0") if r["event"] == "times")
    if rec["participants"] != 2:
        raise RuntimeError(f"the last quorum had {rec['participants']} replica groups, not 2")
    med = {n: statistics.median(ts) for n, ts in rec["times"].items()}
    phases = {n: [statistics.median(col) for col in zip(*ps)]
              for n, ps in rec.get("phases", {}).items() if ps}
    return {"model": model, "median_s": med, "phase_median_s": phases,
            "steps_per_s": {n: 1.0 / s for n, s in med.items()},
            "committed": rec["committed"], "rounds": rounds}


def failure_times(impl: str, heartbeat_ms: int) -> dict:
    """Kill replica group 1 in its backward; restart it once the survivor went on alone."""
    from _ft_harness import FTRun, start_together

    with tempfile.TemporaryDirectory() as tmp, FTRun(tmp, heartbeat_timeout_ms=heartbeat_ms) \
            as run:
        run.lighthouse()
        go, stop = os.path.join(tmp, "go"), os.path.join(tmp, "stop")
        a = run.replica(0, impl=impl, steps=10_000, sleep=0.1, go=go, stop_file=stop)
        run.replica(1, impl=impl, steps=10_000, die_at=4, go=go)
        start_together(run, ["r0", "r1"], go, timeout=300)
        run.wait_for(lambda: a.poll() is not None or
                     sum(r["participants"] == 1 for r in run.steps("r0", True)) >= 2,
                     120, "the survivor to commit alone")
        if a.poll() is not None:  # the survivor did not survive: say how it ended
            lines = [ln for ln in run.tail("r0", 20000).splitlines() if ln.strip()]
            error = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1])
            where = next((ln.strip() for ln in reversed(lines) if ln.strip().startswith(
                "[rank0]:   File")), "")
            return {"impl": impl, "heartbeat_timeout_s": heartbeat_ms / 1000,
                    "survivor_exit_code": a.returncode,
                    "survivor_error": _short(f"{error.replace('[rank0]: ', '')} "
                                             f"({where.replace('[rank0]:   ', '')})")}
        t_restart = time.time()
        b = run.replica(1, tag="r1b", impl=impl, steps=10_000, stop_file=stop)
        run.wait_for(lambda: len(run.steps("r1b", True)) >= 2, 300, "the restarted replica")
        with open(stop, "w") as f:
            f.write(str(max(r["step"] for r in run.steps("r0", True)) + 3))
        run.wait_exit(b, 120, "r1b")
        run.wait_exit(a, 120, "r0")
        kill = next(r for r in run.records("r1") if r["event"] == "kill")
        alone = next(r for r in run.steps("r0", True) if r["participants"] == 1)
        dropped = [r for r in run.steps("r0", False)]
        started = next(r for r in run.records("r1b") if r["event"] == "start")["t"]
        first = run.steps("r1b", True)[0]
        p0, p1 = run.params("r0"), run.params("r1b")
        equal = all(bool((p1[s] == p0[s]).all()) for s in p1)
    return {"impl": impl, "heartbeat_timeout_s": heartbeat_ms / 1000,
            "kill_to_survivor_commit_s": alone["t"] - kill["t"],
            "steps_dropped_by_survivor": len(dropped),
            "restart_to_first_commit_s": first["t"] - t_restart,
            "manager_up_to_first_commit_s": first["t"] - started,
            "recovered_equal_bit_for_bit": equal}


def elastic_times(steps: int, every: int, kill_at: int, async_save: bool = False) -> dict:
    """The torchrun --max-restarts + checkpoint recipe: kill rank 1 at ``kill_at``; with
    ``async_save``, each checkpoint written in the background (the step waits only while the
    state is copied aside)."""
    import shutil
    import signal
    import subprocess

    script = HERE.parent / "examples" / "elastic_train.py"
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    torchrun = torchrun if os.path.exists(torchrun) else shutil.which("torchrun")
    with tempfile.TemporaryDirectory() as tmp:
        events = os.path.join(tmp, "events.jsonl")
        env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                   PYTHONPATH=str(HERE.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        with open(os.path.join(tmp, "out"), "w") as out:
            proc = subprocess.Popen(
                [torchrun, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                 str(script), "--ckpt-dir", os.path.join(tmp, "ckpt"), "--steps", str(steps),
                 "--ckpt-every", str(every), "--kill-at", str(kill_at), "--events", events]
                + (["--async-save"] if async_save else []),
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(600)
            except subprocess.TimeoutExpired:
                rc = None
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)
        if rc != 0:
            with open(os.path.join(tmp, "out")) as f:
                raise RuntimeError(f"the torchrun job ended with {rc}:\n{f.read()[-3000:]}")
        with open(events) as f:
            recs = [json.loads(line) for line in f]
    kill = next(r for r in recs if r["event"] == "kill")
    second = [r for r in recs if r["attempt"] == 1]
    start = min(r["t"] for r in second if r["event"] == "start")
    resumed = next(r for r in second if r["event"] == "resumed")["step"]
    first = min(r["t"] for r in second if r["event"] == "step")
    back = max(r["t"] for r in second if r["event"] == "step" and r["step"] == kill["step"] - 1)
    ckpt = [r["seconds"] for r in recs if r["event"] == "checkpoint" and r["rank"] == 0]
    return {"impl": "torchrun --max-restarts + checkpoint" + (
                " written in the background (`--async-save`)" if async_save else ""),
            "ckpt_every": every,
            "kill_at": kill["step"], "resumed_from": resumed,
            "steps_lost": kill["step"] - resumed,
            "kill_to_restart_s": start - kill["t"],
            "kill_to_first_step_s": first - kill["t"],
            "kill_to_back_at_kill_step_s": back - kill["t"],
            "checkpoint_s_median": statistics.median(ckpt), "checkpoints": len(ckpt)}


def _short(text: str) -> str:
    """File paths from site-packages on (``torchft/ddp.py``), not this machine's."""
    return re.sub(r'File "[^"]*site-packages/([^"]+)"', r"\1", text)


def markdown(res: dict) -> str:
    m = res["meta"]
    lines = [f"Step time of 2 replica groups x 1 gloo process (1 thread) with a torchft "
             f"Manager and Lighthouse ({m['cpus']} CPUs, torch {m['torch']}, torchft "
             f"{m['torchft']}, 1-min load {m['loadavg_1min']:.2f} before, "
             f"{m['loadavg_1min_after']:.2f} after); median of {m['rounds']} round-robin "
             "steps after warm-up (every other round in reverse order), replica group 0.", "",
             "| model | variant | ms / step | steps / s | vs torchft DDP | vs tribucket |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in res["step_time"]:
        base = r["median_s"]["torchft DDP"]
        plain = r["median_s"].get("tribucket")
        for n in VARIANTS:
            if n not in r["median_s"]:
                continue  # (a result file from before the plain variant)
            s = r["median_s"][n]
            vs_plain = f"{s / plain:.2f}x" if plain else "-"
            lines.append(f"| {r['model']} | {n} | {s * 1e3:.2f} | {1 / s:.2f} | "
                         f"{s / base:.2f}x | {vs_plain} |")
    for r in res["step_time"]:
        ph = r.get("phase_median_s")
        if ph:
            lines += ["", f"{r['model']}, medians per phase (zero_grad, which starts the "
                      "quorum / forward / backward / optimizer step, which asks "
                      "should_commit): " + "; ".join(
                          f"{n} " + " / ".join(f"{v * 1e3:.1f}" for v in ph[n]) + " ms"
                          for n in VARIANTS if n in ph)]
    if res.get("failure"):
        fm = res.get("failure_meta")
        load = (f"; 1-min load {fm['loadavg_1min']:.2f} before, "
                f"{fm['loadavg_1min_after']:.2f} after" if fm else "")
        lines += ["", "Time lost per failure (replica group 1 SIGKILLed in its backward, "
                  f"restarted once the survivor trains alone; small MLP{load}):", "",
                  "| variant | heartbeat timeout | kill -> survivor's next commit | steps the "
                  "survivor dropped | restart -> first commit | manager up -> first commit | "
                  "recovered bit for bit |", "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
        for f in res["failure"]:
            if "survivor_error" in f:
                lines.append(f"| {f['impl']} | {f['heartbeat_timeout_s']:.1f} s | the survivor "
                             f"crashed (exit {f['survivor_exit_code']}): "
                             f"{f['survivor_error']} | - | - | - | - |")
                continue
            lines.append(f"| {f['impl']} | {f['heartbeat_timeout_s']:.1f} s | "
                         f"{f['kill_to_survivor_commit_s']:.2f} s | "
                         f"{f['steps_dropped_by_survivor']} | "
                         f"{f['restart_to_first_commit_s']:.2f} s | "
                         f"{f['manager_up_to_first_commit_s']:.2f} s | "
                         f"{'yes' if f['recovered_equal_bit_for_bit'] else 'NO'} |")
    if res.get("elastic"):
        e = res["elastic"]
        lines += ["", f"The same failure without torchft: `torchrun --nproc-per-node 2 "
                  f"--max-restarts 1` with a `torch.distributed.checkpoint` of model, "
                  f"optimizer and reducer state every {e['ckpt_every']} steps "
                  f"(`examples/elastic_train.py`, same MLP, batches and optimizer); "
                  f"rank 1 SIGKILLed in its backward at step {e['kill_at']}; both ranks "
                  f"restart and resume from step {e['resumed_from']}:", "",
                  "| variant | kill -> ranks restarted (imports, process group) | "
                  "kill -> first step after resume | "
                  "kill -> back at the step of the kill | steps lost | "
                  "one checkpoint (the step waits, median) |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for e in [e] + ([res["elastic_async"]] if res.get("elastic_async") else []):
            lines.append(f"| {e['impl']} | {e['kill_to_restart_s']:.2f} s | "
                         f"{e['kill_to_first_step_s']:.2f} s | "
                         f"{e['kill_to_back_at_kill_step_s']:.2f} s | {e['steps_lost']} | "
                         f"{e['checkpoint_s_median'] * 1e3:.0f} ms |")
        if res.get("elastic_meta"):
            em = res["elastic_meta"]
            lines += ["", f"(These two rows: 1-min load {em['loadavg_1min']:.2f} before, "
                      f"{em['loadavg_1min_after']:.2f} after; {em['checkpoints']} checkpoints "
                      "of each.)"]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["step_time"]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    width = 0.8 / len(VARIANTS)
    for k, n in enumerate(VARIANTS):
        ax.bar([i + k * width for i in range(len(rows))],
               [r["median_s"].get(n, 0.0) * 1e3 for r in rows], width, label=n)
    ax.set_xticks([i + width * (len(VARIANTS) - 1) / 2 for i in range(len(rows))],
                  [r["model"] for r in rows])
    ax.set_ylabel("ms / step (median)")
    ax.set_title("2 replica groups on torchft (gloo, CPU)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    if os.environ.get("REPLICA_GROUP_ID") is not None:
        return replica_main(sys.argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", choices=["mlp", "transformer"])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--failure", action="store_true", help="also measure (b)")
    ap.add_argument("--failure-only", action="store_true",
                    help="measure (b) only; keep (a) from the results file in --out")
    ap.add_argument("--elastic-only", action="store_true",
                    help="measure the torchrun recipe only (checkpoints in the step and in "
                         "the background); keep the rest from the results file in --out")
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--kill-at", type=int, default=25)
    ap.add_argument("--heartbeat-ms", type=int, default=5000)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    import torch
    import torchft  # noqa: F401
    from importlib.metadata import version

    from _results import save

    if args.elastic_only:  # everything else as measured before
        res = json.loads((pathlib.Path(args.out) / "ft.json").read_text())
        load = os.getloadavg()[0]
        res["elastic"], res["elastic_async"] = (
            elastic_times(args.kill_at + 15, args.ckpt_every, args.kill_at, async_save=a)
            for a in (False, True))
        res["elastic_meta"] = {"loadavg_1min": load, "loadavg_1min_after": os.getloadavg()[0],
                               "checkpoints": res["elastic"]["checkpoints"]}
        return save(args.out, "ft", res, markdown, plot)
    if args.failure_only:  # (a) as measured before
        old = json.loads((pathlib.Path(args.out) / "ft.json").read_text())
        res = {"step_time": old["step_time"], "meta": old["meta"]}
    else:
        load = os.getloadavg()[0]
        res = {"step_time": [step_times(m, args.rounds, args.warmup)
                             for m in (args.model or ["mlp"])]}
        res["meta"] = {"torch": torch.__version__, "torchft": version("torchft"),
                       "cpus": os.cpu_count(), "loadavg_1min": load,
                       "loadavg_1min_after": os.getloadavg()[0], "rounds": args.rounds}
    old_file = pathlib.Path(args.out) / "ft.json"
    if not (args.failure or args.failure_only) and old_file.exists():  # (b) as measured before
        old = json.loads(old_file.read_text())
        res.update({k: old[k] for k in ("failure", "elastic", "elastic_async", "elastic_meta",
                                         "failure_meta") if k in old})
    if args.failure or args.failure_only:
        load = os.getloadavg()[0]
        res["failure"] = [failure_times(impl, args.heartbeat_ms)
                          for impl in ("tribucket", "torchft")]
        res["elastic"], res["elastic_async"] = (
            elastic_times(args.kill_at + 15, args.ckpt_every, args.kill_at, async_save=a)
            for a in (False, True))
        res["elastic_meta"] = {"loadavg_1min": load, "loadavg_1min_after": os.getloadavg()[0],
                               "checkpoints": res["elastic"]["checkpoints"]}
        res["failure_meta"] = {"loadavg_1min": load, "loadavg_1min_after": os.getloadavg()[0],
                               "torch": torch.__version__, "torchft": version("torchft")}
    save(args.out, "ft", res, markdown, plot)


if __name__ == "__main__":
    main()
