"""What tribucket's failure guarantees cost per training step, on 2 gloo ranks, in one run.

Two ranks (one intra-op thread each) train the 64-layer MLP of ``bench_step`` with:

* ``DDP``                    ``DistributedDataParallel``, default options (the baseline)
* ``tribucket``              ``fused_bucketing`` with its defaults: the checks that are
  always on (one-reducer-per-parameter claim, entry and first-backward agreement, the
  training step in the end-of-backward status)
* ``tribucket timeout=``     plus ``timeout=30 s``: a timed group and two progress marks per
  iteration in the rendezvous store (a TCPStore, as under torchrun)
* ``tribucket debug``        plus ``debug=True``: an all-gathered fingerprint before every
  reducer collective

Variants run round-robin, one step of each per round, so drift in machine load hits all of
them alike; the figure is the median over rounds after warm-up of rank 0's step time.

    python perf/bench_guard.py              # writes perf/results/guard.{json,md,png}
    python perf/bench_guard.py --rounds 20  # quicker
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _bench import free_port  # noqa: E402
from bench_step import make_model  # noqa: E402  (the step benchmark's model)

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
VARIANTS = ["DDP", "tribucket", "tribucket timeout=", "tribucket debug"]


def _worker(rank: int, port: int, rounds: int, warmup: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    import tribucket

    options = {"tribucket": {}, "tribucket timeout=": {"timeout": datetime.timedelta(seconds=30)},
               "tribucket debug": {"debug": True}}
    runs = {}
    for name in VARIANTS:
        model, x = make_model("mlp")
        if name == "DDP":
            forward, ctx = torch.nn.parallel.DistributedDataParallel(model), None
        else:
            forward = model
            ctx = tribucket.fused_bucketing(model, **options[name])
        runs[name] = (forward, x, torch.optim.SGD(model.parameters(), lr=1e-4), ctx)
    times = {name: [] for name in VARIANTS}
    for i in range(warmup + rounds):
        for name in VARIANTS:
            forward, x, opt, _ = runs[name]
            dist.barrier()
            start = time.perf_counter()
            forward(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    for _, _, _, ctx in runs.values():
        if ctx is not None:
            ctx.close()
    if rank == 0:
        pathlib.Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def table(data: dict) -> str:
    meta, med = data["meta"], data["median_s"]
    lines = [f"Step time of the 64 x Linear(256, 256) MLP, 2 gloo ranks x 1 thread "
             f"({meta['cpus']} CPUs, torch {meta['torch']}, 1-min load {meta['loadavg_1min']:.2f} "
             f"before, {meta['loadavg_1min_after']:.2f} after); median of {meta['rounds']} "
             "round-robin steps after warm-up.", "",
             "| variant | ms / step | vs DDP | vs tribucket defaults |",
             "| --- | ---: | ---: | ---: |"]
    for name in VARIANTS:
        lines.append(f"| {name} | {med[name] * 1e3:.2f} | {med[name] / med['DDP']:.2f}x | "
                     f"{med[name] / med['tribucket']:.2f}x |")
    return "\n".join(lines) + "\n"


def plot(data: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    med = data["median_s"]
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.barh(VARIANTS[::-1], [med[v] * 1e3 for v in VARIANTS[::-1]], color="#4c72b0")
    ax.set_xlabel("ms per training step (median, rank 0)")
    ax.set_title("Cost of the failure guarantees, 2 gloo ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    port, load = free_port(), os.getloadavg()[0]
    tmp = RESULTS / ".guard.json"
    mp.spawn(_worker, args=(port, args.rounds, args.warmup, str(tmp)), nprocs=2)
    times = json.loads(tmp.read_text())
    tmp.unlink()
    meta = {"torch": torch.__version__, "cpus": os.cpu_count(), "loadavg_1min": load,
            "loadavg_1min_after": os.getloadavg()[0], "rounds": args.rounds}
    data = {"meta": meta, "median_s": {k: statistics.median(v) for k, v in times.items()},
            "times_s": times}
    (RESULTS / "guard.json").write_text(json.dumps(data, indent=1))
    md = table(data)
    (RESULTS / "guard.md").write_text(md)
    plot(data, RESULTS / "guard.png")
    print(md, end="")


if __name__ == "__main__":
    main()
