"""What ``skip_all_reduce_unused_params`` saves: a two-head model, one head per step, on 2
gloo ranks, in one run.

The model: a trunk of 8 x Linear(256, 256) and two output heads of Linear(256, 4096) each
(4 MiB a head, no bias); a step trains one head, the same on every rank (task ``step % 2``,
as a multi-task loop alternates tasks), so the other head is unused in that step. Both
wrappers run with ``find_unused_parameters=True`` and 2 MiB buckets (each head fills one of
its own), with and without ``skip_all_reduce_unused_params=True``:

* ``DDP``                   torch's ``DistributedDataParallel``
* ``DDP skip``              plus the option
* ``tribucket``             ``tribucket.DistributedDataParallel``
* ``tribucket skip``        plus the option

Variants run round-robin (every other round in reverse order), one step of each per round,
each round's task the same for all; the figure is the median over rounds of rank 0's step
(forward, backward, SGD step).

    python perf/bench_skip.py              # writes perf/results/skip.{json,md,png}
    python perf/bench_skip.py --rounds 10  # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _bench import bar_plot, close_worker, init_worker, round_robin, spawn  # noqa: E402
from _results import save  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
VARIANTS = ["DDP", "DDP skip", "tribucket", "tribucket skip"]
CAP_MB = 2


class TwoHeads(nn.Module):
    def __init__(self, width: int = 256, depth: int = 8, out: int = 4096):
        super().__init__()
        # the heads first: DDP's initial buckets fill in parameter order, so each 4 MiB head
        # closes a 2 MiB bucket of its own
        self.heads = nn.ModuleList(nn.Linear(width, out, bias=False) for _ in range(2))
        self.trunk = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU())
                                     for _ in range(depth)])

    def forward(self, x, task: int):
        return self.heads[task](self.trunk(x))


def _worker(rank: int, world: int, port: int, rounds: int, warmup: int, out: str) -> None:
    init_worker(rank, world, port)
    import tribucket

    runs = {}
    for name in VARIANTS:
        torch.manual_seed(0)
        model = TwoHeads()
        kw = dict(find_unused_parameters=True, bucket_cap_mb=CAP_MB,
                  skip_all_reduce_unused_params=name.endswith("skip"))
        wrap = (nn.parallel.DistributedDataParallel(model, **kw) if name.startswith("DDP")
                else tribucket.DistributedDataParallel(model, **kw))
        runs[name] = (wrap, torch.optim.SGD(model.parameters(), lr=1e-4))
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 256, generator=g)
    calls = [0]

    def run(name: str) -> None:  # round_robin runs every variant once a round
        wrap, opt = runs[name]
        task = calls[0] // len(VARIANTS) % 2  # the round's task, the same for every variant
        calls[0] += 1
        wrap(x, task).square().mean().backward()
        opt.step()
        opt.zero_grad()

    times = round_robin(run, VARIANTS, rounds, warmup)
    reduced = {name: runs[name][0].reducer.logging_data()["num_buckets_reduced"]
               for name in VARIANTS if name.startswith("tribucket")}
    if rank == 0:
        pathlib.Path(out).write_text(json.dumps(dict(times=times, reduced=reduced)))
    close_worker(runs[name][0] for name in VARIANTS if name.startswith("tribucket"))


def table(data: dict) -> str:
    meta, med = data["meta"], data["median_s"]
    lines = [f"Training step of a trunk of 8 x Linear(256, 256) and two Linear(256, 4096, "
             f"bias=False) heads "
             f"(one per step, alternating), `find_unused_parameters=True`, {CAP_MB} MiB "
             f"buckets, 2 gloo ranks x 1 thread ({meta['cpus']} CPUs, torch {meta['torch']}, "
             f"1-min load {meta['loadavg_1min']:.2f} before, {meta['loadavg_1min_after']:.2f} "
             f"after); median of {meta['rounds']} round-robin steps after warm-up, every "
             "other round in reverse order.", "",
             "| variant | ms / step | vs DDP | vs the same without skip |",
             "| --- | ---: | ---: | ---: |"]
    for name in VARIANTS:
        plain = name.replace(" skip", "")
        lines.append(f"| {name} | {med[name] * 1e3:.2f} | {med[name] / med['DDP']:.2f}x | "
                     f"{med[name] / med[plain]:.2f}x |")
    return "\n".join(lines) + "\n"


def plot(data: dict, path: pathlib.Path) -> None:
    bar_plot([dict(model="two heads", median_s=data["median_s"])], VARIANTS,
             ["#999", "#bbb", "#4c72b0", "#55a868"],
             "skip_all_reduce_unused_params, {model}, 2 gloo ranks", path)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=4)
    args = ap.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    got = spawn(_worker, (args.rounds, args.warmup), 2, RESULTS / ".skip.json")
    meta = {"torch": torch.__version__, "cpus": os.cpu_count(), "loadavg_1min": load,
            "loadavg_1min_after": os.getloadavg()[0], "rounds": args.rounds}
    times = got["times"]
    save(RESULTS, "skip", {"meta": meta, "times_s": times,
                           "median_s": {k: statistics.median(v) for k, v in times.items()},
                           "num_buckets_reduced_last_step": got["reduced"]}, table, plot)


if __name__ == "__main__":
    main()
