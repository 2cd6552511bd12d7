"""What tracing costs: the Tracer's calls per bucket, and a training step traced vs not.

Part ``api`` (one process): the calls a reducer makes for one bucket, timed over many
buckets, median of rounds, ns per bucket:

* ``off``            tracing off: the reducer holds ``tracer = None`` and checks it at each
                     of the 5 call sites of a bucket (``is not None``)
* ``on``             ``last_ready`` instant, ``pack`` span, the collective with its
                     done-callback (on a Future completed right after, as a backend would),
                     ``wait`` and ``unpack`` spans, each span with its profiler range
* ``on, no range``   the same with ``record_function=False``
* ``on, profiling``  ``on`` while a ``torch.profiler`` records (what a user profiling pays)

Part ``step`` (2 gloo ranks, one intra-op thread each): ``bench_step``'s models trained by
``tribucket.Reducer`` with its defaults, untraced and traced, interleaved one step each
per round (``trace=False`` and ``trace=DIR``); the figure is the median of rank 0's step
times.

    python perf/bench_trace.py                 # writes perf/results/trace.{json,md,png}
    python perf/bench_trace.py --rounds 20 --models mlp --no-save
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _bench import close_worker, init_worker, spawn_measure  # noqa: E402
from _results import save  # noqa: E402
from bench_step import make_model  # noqa: E402

from tribucket.trace import Tracer  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
API_VARIANTS = ["off", "on", "on, no range", "on, profiling"]


# ------------------------------------------------------------------ api
def _one_bucket(tr, i: int, args: dict, fut) -> None:
    """The reducer's calls for bucket i (the shape of the wiring; no real work)."""
    if tr is not None:
        tr.instant("bucket.last_ready", args=args)
    if tr is not None:
        pk = tr.begin("bucket.pack", args=args)
        tr.end(pk)
    coll = None
    if tr is not None:
        coll = tr.collective("bucket.allreduce", fut, args)
    fut.set_result(None)  # the backend completes it (the callback runs here)
    if tr is not None:
        w = tr.begin("bucket.wait", args=args)
        tr.end(w, completes=coll)
    if tr is not None:
        u = tr.begin("bucket.unpack", args=args)
        tr.end(u)


def _bare_bucket(tr, i: int, args: dict, fut) -> None:
    """The same loop body without the call sites (subtracted from every variant)."""
    fut.set_result(None)


def api(n: int = 5000, rounds: int = 11) -> dict:
    res: dict = {v: [] for v in API_VARIANTS}
    res["bare"] = []  # the loop with no call sites at all (subtracted)
    args = {"bucket": 0, "bytes": 1 << 20}
    for _ in range(rounds):
        for v in ["bare", *API_VARIANTS]:
            futs = [torch.futures.Future() for _ in range(n)]
            tr = None
            if v.startswith("on"):
                tr = Tracer(None, record_function=v != "on, no range", max_events=10 * n)
            prof = None
            if v == "on, profiling":
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                prof.__enter__()
            t0 = time.perf_counter_ns()
            body = _bare_bucket if v == "bare" else _one_bucket
            for i in range(n):
                body(tr, i, args, futs[i])
            dt = (time.perf_counter_ns() - t0) / n
            if prof is not None:
                prof.__exit__(None, None, None)
            if tr is not None:
                tr.closed = True  # nothing to write
            res[v].append(dt)
    bare = res.pop("bare")
    # the median, and the minimum (the cost itself when other processes share the cores)
    return {"ns_per_bucket": {v: statistics.median(x) - statistics.median(bare)
                              for v, x in res.items()},
            "min_ns_per_bucket": {v: min(x) - min(bare) for v, x in res.items()},
            "n": n, "rounds": rounds}


# ------------------------------------------------------------------ step
def _step_worker(rank: int, world: int, port: int, model_name: str, rounds: int, warmup: int,
                 out_path: str, trace_dir: str, backend: str = "gloo") -> None:
    device = init_worker(rank, world, port, backend)
    import tribucket

    cuda = device.type == "cuda"
    names = ["untraced", "traced"] + (["traced + device spans"] if cuda else [])
    runs = {}
    for name in names:
        m, x = make_model(model_name)
        m, x = m.to(device), x.to(device)
        trace = False
        if name == "traced":
            trace = trace_dir or tempfile.mkdtemp()
        elif name == "traced + device spans":  # CUDA-event spans too: what they cost
            trace = Tracer(tempfile.mkdtemp())
            trace.device_spans = True
        runs[name] = (m, x, torch.optim.SGD(m.parameters(), lr=1e-4),
                      tribucket.Reducer(m, trace=trace))
    times: dict = {k: [] for k in runs}
    for it in range(warmup + rounds):
        k = it % len(names)  # each variant goes first as often as the others
        for name in names[k:] + names[:k]:
            m, x, opt, _ = runs[name]
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            m(x).square().mean().backward()
            opt.step()
            if cuda:  # the step is over when the device is done with it
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            if it >= warmup:
                times[name].append(dt)
    buckets = runs["traced"][3].stats.buckets
    close_worker(r for *_, r in runs.values())  # (the traced reducer writes its file)
    if rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        with open(out_path, "w") as f:
            json.dump({"model": model_name, "median_s": med, "all_s": times,
                       "ratio": med["traced"] / med["untraced"],
                       "ratio_device": (med["traced + device spans"] / med["untraced"]
                                        if "traced + device spans" in med else None),
                       "trace": runs["traced"][3].trace_path, "buckets": buckets}, f)


# ------------------------------------------------------------------ report
def markdown(res: dict) -> str:
    meta = res["meta"]
    lines = [f"Tracing overhead on a {meta['cpus']}-CPU {meta['machine']} machine, torch "
             f"{meta['torch']}; 1-min load average {meta['loadavg'][0]:.2f} at the start.", "",
             "Per bucket, the Tracer's calls alone (median of "
             f"{res['api']['rounds']} rounds of {res['api']['n']} buckets):", "",
             "| variant | ns per bucket (median) | ns per bucket (min) |",
             "| --- | ---: | ---: |"]
    for v, ns in res["api"]["ns_per_bucket"].items():
        lines.append(f"| {v} | {ns:,.0f} | {res['api']['min_ns_per_bucket'][v]:,.0f} |")
    if res.get("step"):
        lines += ["", f"Training step, {meta.get('world', 2)} {meta.get('backend', 'gloo')} "
                  f"rank(s){' (' + meta['device'] + ')' if meta.get('device') else ''}, "
                  f"`tribucket.Reducer` defaults, median of "
                  f"{meta['rounds']} rounds after {meta['warmup']} warm-up, interleaved:", "",
                  "| model | buckets | untraced (ms) | traced (ms) | traced / untraced |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for s in res["step"]:
            lines.append(f"| {s['model']} | {s['buckets']} | {s['median_s']['untraced'] * 1e3:.1f}"
                         f" | {s['median_s']['traced'] * 1e3:.1f} | {s['ratio']:.3f}× |")
            if s.get("ratio_device"):
                lines.append(f"| {s['model']}, + device spans | {s['buckets']} | "
                             f"{s['median_s']['untraced'] * 1e3:.1f} | "
                             f"{s['median_s']['traced + device spans'] * 1e3:.1f} | "
                             f"{s['ratio_device']:.3f}× |")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = res["api"]["ns_per_bucket"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(range(len(ns)), [v / 1e3 for v in ns.values()], color="tab:blue")
    ax.set_xticks(range(len(ns)), list(ns), rotation=20, ha="right")
    ax.set_ylabel("us per bucket (median)")
    ax.set_title("Tracer calls per bucket")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=["mlp", "transformer"])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--trace-dir", default="", help="also keep the traced run's trace here")
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                    help="nccl: one GPU a rank, device spans from CUDA events in the trace")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args()
    if a.backend == "nccl" and torch.cuda.device_count() < a.world:
        sys.exit(f"--backend nccl --world {a.world} needs {a.world} GPUs; "
                 f"{torch.cuda.device_count()} visible")
    res = {"meta": {"cpus": os.cpu_count(), "machine": platform.machine(),
                    "torch": torch.__version__, "loadavg": os.getloadavg(),
                    "rounds": a.rounds, "warmup": a.warmup, "backend": a.backend,
                    "world": a.world,
                    "device": torch.cuda.get_device_name(0) if a.backend == "nccl" else None}}
    res["api"] = api()
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res["step"] = [spawn_measure(_step_worker, out / f".trace_{m}.json", m, a.rounds,
                                 a.warmup, a.world, a.trace_dir, a.backend) for m in a.models]
    if a.no_save:
        print(markdown(res))
    else:
        save(out, "trace", res, markdown, plot)


if __name__ == "__main__":
    main()
