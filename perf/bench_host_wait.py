"""Where the host waits for the device in a training step on a GPU: tribucket against torch DDP.

On a GPU the host normally runs ahead of the device: it queues the next kernels while the
device still runs the previous ones, and a step whose device time exceeds its host time is
paced by the device alone. A call that reads a device value back to the host (``.item()``,
``.tolist()``, ``.cpu()``) makes the host wait until the device has caught up, and whatever
the host does next (the optimizer step's launches, the next forward's) then runs while the
device waits for it.

This runs the benchmark MLP and transformer of ``perf/bench_step.py`` on one NCCL rank under
``tribucket.fused_bucketing`` and under DDP, with no extra device work and with a
device-side wait of ``--device-ms`` in each backward (``torch.cuda._sleep``: a stand-in for a
backward whose kernels take longer than their launches, which the host only enqueues). Per
variant: how long ``loss.backward()`` takes on the host, and the step time over 10 steps run
back to back (no synchronisation between them, as in training). tribucket runs twice: with
its default, which on a GPU reads the end-of-backward status one backward later, and with
``deferred_status=False``, which reads it at the end of each backward (the host waits for the
device there). Each round starts with another variant.

    python perf/bench_host_wait.py                      # a CUDA device: writes --out
    python perf/bench_host_wait.py --device cpu --rounds 3 --out /tmp/hw   # a dry run (gloo)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_step import make_model  # noqa: E402

OUT = pathlib.Path(__file__).resolve().parent / "results" / "gpu"
STEPS = 10  # steps per timed run, back to back
AT_ONCE = "tribucket, status read at once"  # deferred_status=False
VARIANTS = ("tribucket", AT_ONCE, "DDP")


def sleep_ms(cycles: int) -> float:
    """Device milliseconds of ``torch.cuda._sleep(cycles)``, timed by CUDA events."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(cycles)
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def sleep_cycles(ms: float) -> int:
    """Cycles of ``torch.cuda._sleep`` that take about ``ms`` on this device."""
    n = 10_000_000
    sleep_ms(n)  # warm
    return int(n * ms / sleep_ms(n))


def measure(name: str, device: torch.device, device_ms: float, rounds: int) -> dict:
    import tribucket

    cuda = device.type == "cuda"
    cycles = sleep_cycles(device_ms) if cuda and device_ms else 0
    runs, exits = {}, []
    for variant in VARIANTS:
        model, x = make_model(name)
        model, x = model.to(device), x.to(device)
        if cycles:  # in every backward, when the first parameter's gradient is computed
            next(model.parameters()).register_hook(lambda g: torch.cuda._sleep(cycles))
        if variant == "DDP":
            net = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[device.index] if cuda else None)
        else:  # the default reads the status one backward later on a GPU
            cm = tribucket.fused_bucketing(
                model, **({"deferred_status": False} if variant == AT_ONCE else {}))
            cm.__enter__()
            exits.append(cm)
            net = model
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        runs[variant] = dict(net=net, opt=opt, backward=[], step=[])

    def sync():
        if cuda:
            torch.cuda.synchronize()

    for rnd in range(2 + rounds):  # two rounds of warm-up
        for variant in VARIANTS[rnd % 3:] + VARIANTS[:rnd % 3]:  # each goes first in turn
            r = runs[variant]
            sync()
            t0 = time.perf_counter()
            backward = []
            for _ in range(STEPS):
                loss = r["net"](x).float().square().mean()
                b0 = time.perf_counter()
                loss.backward()
                backward.append(time.perf_counter() - b0)
                r["opt"].step()
                r["opt"].zero_grad(set_to_none=True)
            sync()
            if rnd >= 2:
                r["step"].append((time.perf_counter() - t0) / STEPS)
                r["backward"].append(statistics.median(backward))
    for cm in exits:
        cm.__exit__(None, None, None)
    out = {v: dict(backward_host_ms=statistics.median(r["backward"]) * 1e3,
                   step_ms=statistics.median(r["step"]) * 1e3) for v, r in runs.items()}
    if cycles:
        out["device_wait_ms"] = sleep_ms(cycles)
    return out


def markdown(res: dict) -> str:
    lines = [f"Where the host waits: one {res['backend']} rank on {res['device_name']} "
             f"(torch {res['torch']}, {res['cpus']} CPU cores); per variant the host time of "
             f"`loss.backward()` and the step time over {STEPS} steps run back to back, "
             f"medians of {res['rounds']} rounds, each round starting with another variant; 1-min load "
             f"average {res['loadavg_1min']:.2f} at the start.", "",
             "| model | device work added to backward | variant | backward returns after (ms) "
             "| step (ms) | step vs DDP |", "| --- | --- | --- | ---: | ---: | ---: |"]
    for row in res["rows"]:
        ddp = row["DDP"]["step_ms"]
        extra = (f"{row['device_wait_ms']:.1f} ms" if row.get("device_wait_ms") else "none")
        for v in VARIANTS:
            if v not in row:  # (a file written before the variant existed)
                continue
            r = row[v]
            lines.append(f"| {row['model']} | {extra} | {v} | {r['backward_host_ms']:.1f} | "
                         f"{r['step_ms']:.1f} | {r['step_ms'] / ddp:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run on gloo")
    ap.add_argument("--device-ms", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_host_wait: no CUDA device here (pass --device cpu for a dry run)",
              file=sys.stderr)
        return 2
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)
    load = os.getloadavg()[0]
    rows = []
    try:
        for name in ("mlp", "transformer"):
            for device_ms in (0.0, args.device_ms) if device.type == "cuda" else (0.0,):
                row = dict(model=name, **measure(name, device, device_ms, args.rounds))
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        dist.destroy_process_group()
    res = dict(backend=dist.Backend.NCCL if device.type == "cuda" else "gloo",
               device_name=torch.cuda.get_device_name(device) if device.type == "cuda"
               else "the CPU", torch=torch.__version__, cpus=os.cpu_count(),
               loadavg_1min=load, rounds=args.rounds, steps=STEPS, rows=rows)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "host_wait.json").write_text(json.dumps(res, indent=1))
    md = markdown(res)
    (out / "host_wait.md").write_text(md)
    print(md, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
