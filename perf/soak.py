"""Soak: 2 000 training iterations per comm hook on 2 gloo ranks; does memory grow?

For each hook a fresh model and reducer train a small MLP; rank 0 records its resident set
size (RSS) at iteration 100 and at the end. A leak in the reducer (a buffer, a future, a
graph or a hook kept per iteration) shows up as growth between the two.

    python perf/soak.py                 # writes perf/results/soak.{json,md}
    python perf/soak.py --iters 500     # quicker
"""

from __future__ import annotations

import argparse
import json
import pathlib
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
HOOKS = ["none", "allreduce", "fp16", "bf16", "gossip", "powersgd", "noop"]


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    import os

    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _hook(name):
    import tribucket
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    h = tribucket.hooks
    return {
        "none": (None, None),
        "allreduce": (None, h.allreduce_hook),
        "fp16": (h.CompressionState(check_overflow=True), h.fp16_compress_hook),
        "bf16": (None, h.bf16_compress_hook),
        "gossip": (h.GossipState(), h.gossip_hook),
        "powersgd": (psgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                        start_powerSGD_iter=2, random_seed=0),
                     psgd.powerSGD_hook),
        "noop": (None, h.noop_hook),
    }[name]


def _worker(rank: int, world: int, port: int, iters: int, out: str) -> None:
    import logging

    logging.getLogger("torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook").setLevel(
        logging.ERROR)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    import tribucket

    rows = []
    for name in HOOKS:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                              nn.Linear(64, 8))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x = torch.randn(16, 64)
        rss_100 = None
        t0 = time.perf_counter()
        with tribucket.fused_bucketing(model, bucket_cap_mb=0.01) as reducer:
            state, hook = _hook(name)
            if hook is not None:
                reducer.register_comm_hook(state, hook)
            for it in range(1, iters + 1):
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
                if it == 100:
                    rss_100 = _rss_mb()
            rss_end = _rss_mb()
            buckets = reducer.stats.buckets
        rows.append(dict(hook=name, iters=iters, rss_100_mb=rss_100, rss_end_mb=rss_end,
                         growth_mb=rss_end - rss_100, buckets=buckets,
                         ms_per_iter=(time.perf_counter() - t0) / iters * 1e3))
    if rank == 0:
        pathlib.Path(out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=2000)
    args = p.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    tmp = RESULTS / ".soak.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, port, args.iters, str(tmp)), nprocs=2)
    rows = json.loads(tmp.read_text())
    tmp.unlink()
    (RESULTS / "soak.json").write_text(json.dumps({"torch": torch.__version__, "rows": rows},
                                                  indent=1))
    lines = ["| hook | iterations | RSS at 100 (MiB) | RSS at end (MiB) | growth (MiB) | ms/iter |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['hook']} | {r['iters']} | {r['rss_100_mb']:.1f} | "
                     f"{r['rss_end_mb']:.1f} | {r['growth_mb']:+.2f} | {r['ms_per_iter']:.2f} |")
    md = "\n".join(lines)
    (RESULTS / "soak.md").write_text(md + "\n")
    print(md)
    worst = max(r["growth_mb"] for r in rows)
    print(f"\nlargest growth between iteration 100 and the end: {worst:+.2f} MiB",
          file=sys.stderr)


if __name__ == "__main__":
    main()
