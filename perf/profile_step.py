"""Where one rank's training step spends its host time: ``torch.profiler`` over a few steps
of ``bench_step``'s models under tribucket and under DDP, one rank (gloo on CPU, NCCL on a
GPU), the ops sorted by self CPU time.

    python perf/profile_step.py                          # CPU, gloo, one rank
    python perf/profile_step.py --backend nccl --models transformer
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_step import make_model  # noqa: E402


def _steps(m, x, opt, n: int, cuda: bool) -> None:
    for _ in range(n):
        opt.zero_grad(set_to_none=True)
        m(x).square().mean().backward()
        opt.step()
    if cuda:
        torch.cuda.synchronize()


def trace_costs(device, n: int = 300) -> None:
    """Host microseconds of what device spans do per bucket: make and record a timing CUDA
    event, and chain a callback to a collective's future (``then`` vs
    ``add_done_callback``), against the bare allreduce."""
    import time

    t = torch.ones(1 << 16, device=device)

    def timed(fn) -> float:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        dt = (time.perf_counter() - t0) / n
        torch.cuda.synchronize()
        return dt * 1e6

    ev = torch.cuda.Event(enable_timing=True)
    keep: list = []
    rows = {
        "new timing Event + record": lambda: keep.append(
            torch.cuda.Event(enable_timing=True).record()),
        "record an existing Event": lambda: ev.record(),
        "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(),
        "all_reduce async + get_future": lambda: dist.all_reduce(
            t, async_op=True).get_future(),
        "... + then(callback)": lambda: dist.all_reduce(
            t, async_op=True).get_future().then(lambda f: None),
        "... + then(callback recording an Event)": lambda: dist.all_reduce(
            t, async_op=True).get_future().then(
                lambda f: torch.cuda.Event(enable_timing=True).record()),
        "... + add_done_callback": lambda: dist.all_reduce(
            t, async_op=True).get_future().add_done_callback(lambda f: None),
    }
    print("\n=== host cost of device-span pieces (us per call) ===")
    for name, fn in rows.items():
        print(f"{name:45s} {timed(fn):8.1f}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    ap.add_argument("--models", nargs="*", default=["mlp", "transformer"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rows", type=int, default=20)
    ap.add_argument("--trace-costs", action="store_true",
                    help="(nccl) time the pieces of a device span instead")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    cuda = a.backend == "nccl"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group(a.backend, init_method=f"file://{store}", rank=0, world_size=1)
    import tribucket
    from torch.nn.parallel import DistributedDataParallel as DDP

    if a.trace_costs:
        trace_costs(device)
        dist.destroy_process_group()
        return
    acts = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    for name in a.models:
        for variant in ("tribucket", "DDP"):
            m, x = make_model(name)
            m, x = m.to(device), x.to(device)
            opt = torch.optim.SGD(m.parameters(), lr=1e-4)
            if variant == "DDP":
                model, red = DDP(m, device_ids=[0] if cuda else None), None
            else:
                model, red = m, tribucket.Reducer(m)
            _steps(model, x, opt, 5, cuda)  # warm-up, layout rebuilt
            with torch.profiler.profile(activities=acts) as prof:
                _steps(model, x, opt, a.steps, cuda)
            print(f"\n=== {name}, {variant}, {a.steps} steps, {a.backend} ===")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows))
            if red is not None:
                red.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
