"""What the reducer's end-of-backward status costs on 2 gloo ranks.

The status (problem count per rank, overflow flag, used map) is either a few extra elements
at the end of the last bucket's allreduce (default allreduce, tribucket's fp16/bf16 hooks) or
an allreduce of its own (behind any other comm hook). This times both against a bucket-sized
allreduce alone, in one run: median of 50 timed calls after 10 warm-up, each after a barrier.

    python perf/bench_status.py        # writes perf/results/status.json and status.md
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
BUCKET_MIB = 4
STATUS = 3  # world_size + 1 floats on 2 ranks


def _worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    n = BUCKET_MIB * 2**20 // 4
    cases = {"status alone": torch.zeros(STATUS),
             f"{BUCKET_MIB} MiB bucket": torch.zeros(n),
             f"{BUCKET_MIB} MiB bucket + status tail": torch.zeros(n + STATUS)}
    medians = {}
    for _ in range(2):  # cases interleaved by repeating the whole sweep
        for name, t in cases.items():
            times = []
            for i in range(35):
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(t)
                times.append(time.perf_counter() - start)
            medians.setdefault(name, []).extend(times[10:])
    if rank == 0:
        res = {k: statistics.median(v) for k, v in medians.items()}
        pathlib.Path(out).write_text(json.dumps(res))
    dist.destroy_process_group()


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    load = os.getloadavg()[0]
    tmp = RESULTS / ".status.json"
    mp.spawn(_worker, args=(port, str(tmp)), nprocs=2)
    res = json.loads(tmp.read_text())
    tmp.unlink()
    meta = {"torch": torch.__version__, "cpus": os.cpu_count(), "loadavg_1min": load}
    (RESULTS / "status.json").write_text(json.dumps({"meta": meta, "median_s": res}, indent=1))
    lines = [f"End-of-backward status cost, 2 gloo ranks x 1 thread ({os.cpu_count()} CPUs, "
             f"torch {torch.__version__}, 1-min load {load:.2f}); median of 50 allreduces "
             "after a barrier each.", "", "| allreduce | ms |", "| --- | ---: |"]
    lines += [f"| {k} | {v * 1e3:.3f} |" for k, v in res.items()]
    md = "\n".join(lines) + "\n"
    (RESULTS / "status.md").write_text(md)
    print(md, end="")


if __name__ == "__main__":
    sys.exit(main())
