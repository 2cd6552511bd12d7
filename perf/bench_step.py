"""Training-step time: tribucket against torch DDP, on gloo CPU processes, in one run.

Two ranks (one intra-op thread each) train the same model on the same data with:

* ``local``            forward + backward + SGD step, no communication (the floor)
* ``raw allreduce``    one allreduce of all gradients as a single flat tensor (the wire cost)
* ``tribucket``        ``fused_bucketing`` with the default averaging allreduce
* ``tribucket chunked``  the same, sent in 2 MiB chunks as gradients arrive (``comm_chunk_mb=2``)
* ``tribucket bucket-pack``  gradients packed in one call when a bucket completes (the GPU way)
* ``DDP``              ``DistributedDataParallel`` with its default configuration
* ``DDP view``         DDP with ``gradient_as_bucket_view=True``
* ``tribucket fp16``   the fused ``tribucket.hooks.fp16_compress_hook``
* ``DDP fp16``         DDP with torch's ``fp16_compress_hook``

Variants run round-robin (one step of each per round) so drift in machine load hits all of
them alike; the figure is the median over rounds after warm-up, of rank 0's step time.

    python perf/bench_step.py                 # both models, writes perf/results/step.*
    python perf/bench_step.py --rounds 5      # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import bar_plot, close_worker, init_worker, spawn_measure, turn_order  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
VARIANTS = ["local", "raw allreduce", "tribucket", "tribucket chunked",
            "tribucket bucket-pack", "DDP", "DDP view", "tribucket fp16", "DDP fp16"]


def make_model(name: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if name == "mlp":
        model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(64)])
        x = torch.randn(64, 256)
    else:
        layer = nn.TransformerEncoderLayer(d_model=512, nhead=8, batch_first=True, dropout=0.0)
        model = nn.TransformerEncoder(layer, num_layers=6, enable_nested_tensor=False)
        x = torch.randn(4, 32, 512)
    return model, x


def _worker(rank: int, world: int, port: int, model_name: str, rounds: int, warmup: int,
            out_path: str, backend: str = "gloo") -> None:
    device = init_worker(rank, world, port, backend)
    import tribucket
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    steps = {}

    def add(name, module, forward, opt, reducer=None):
        steps[name] = (module, forward, opt, reducer)

    def fresh():
        model, x = make_model(model_name)
        return model.to(device), x.to(device)

    # local
    m, x = fresh()
    add("local", m, m, torch.optim.SGD(m.parameters(), lr=1e-4))
    # raw allreduce of one flat tensor holding every gradient
    m, x = fresh()
    flat = torch.zeros(sum(p.numel() for p in m.parameters()), device=device)
    add("raw allreduce", m, m, torch.optim.SGD(m.parameters(), lr=1e-4))
    # tribucket
    m, x = fresh()
    r = tribucket.Reducer(m)
    add("tribucket", m, m, torch.optim.SGD(m.parameters(), lr=1e-4), r)
    # the averaging allreduce sent in 2 MiB chunks as their gradients arrive (comm_chunk_mb)
    m, x = fresh()
    rc = tribucket.Reducer(m, comm_chunk_mb=2)
    add("tribucket chunked", m, m, torch.optim.SGD(m.parameters(), lr=1e-4), rc)
    # the GPU strategy on CPU: pack each bucket in one call when its last gradient arrives
    m, x = fresh()
    rb = tribucket.Reducer(m, pack_on_ready=False)
    add("tribucket bucket-pack", m, m, torch.optim.SGD(m.parameters(), lr=1e-4), rb)
    # DDP
    m, x = fresh()
    d = nn.parallel.DistributedDataParallel(m)
    add("DDP", m, d, torch.optim.SGD(m.parameters(), lr=1e-4))
    m, x = fresh()
    d = nn.parallel.DistributedDataParallel(m, gradient_as_bucket_view=True)
    add("DDP view", m, d, torch.optim.SGD(m.parameters(), lr=1e-4))
    # fp16
    m, x = fresh()
    r16 = tribucket.Reducer(m)
    r16.register_comm_hook(None, tribucket.hooks.fp16_compress_hook)
    add("tribucket fp16", m, m, torch.optim.SGD(m.parameters(), lr=1e-4), r16)
    m, x = fresh()
    d16 = nn.parallel.DistributedDataParallel(m)
    d16.register_comm_hook(None, default_hooks.fp16_compress_hook)
    add("DDP fp16", m, d16, torch.optim.SGD(m.parameters(), lr=1e-4))

    def run(name):
        module, forward, opt, reducer = steps[name]
        opt.zero_grad(set_to_none=True)
        forward(x).float().square().mean().backward()
        if name == "raw allreduce":
            dist.all_reduce(flat)
        opt.step()

    times = {k: [] for k in steps}
    stats = {k: [] for k in steps if steps[k][3] is not None}
    for it in range(warmup + rounds):
        for name in turn_order(VARIANTS, it):
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            run(name)
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            if it >= warmup:
                times[name].append(dt)
                if name in stats:
                    stats[name].append(steps[name][3].stats.as_dict())
    if rank == 0:
        bucket_bytes = {
            "tribucket": r.stats.bucket_bytes_allocated,
            "tribucket fp16": r16.stats.bucket_bytes_allocated,
            # DDP's buckets are full-precision; its fp16 hook allocates a half-precision
            # copy of each bucket per call on top
            "DDP": sum(p.numel() * p.element_size() for p in steps["DDP"][0].parameters()),
        }
        bucket_bytes["DDP fp16"] = bucket_bytes["DDP"] + bucket_bytes["DDP"] // 2
        out = {
            "model": model_name,
            "params": sum(p.numel() for p in steps["local"][0].parameters()),
            "tensors": len(list(steps["local"][0].parameters())),
            "median_s": {k: statistics.median(v) for k, v in times.items()},
            "all_s": times,
            "tribucket_stats": {k: {f: statistics.median(s[f] for s in v) for f in
                                    ("backward_compute_s", "comm_exposed_s", "status_check_s")}
                                for k, v in stats.items()},
            "buckets": {k: steps[k][3].stats.buckets for k in stats},
            "bucket_bytes": bucket_bytes,
        }
        with open(out_path, "w") as f:
            json.dump(out, f)
    close_worker(reducer for *_, reducer in steps.values())


def measure(model_name: str, rounds: int, warmup: int, world: int = 2, backend: str = "gloo",
            results: pathlib.Path = RESULTS) -> dict:
    return spawn_measure(_worker, results / f".step_{model_name}.json", model_name, rounds,
                         warmup, world, backend)


# issue 4 and 5's targets: step time of tribucket over its DDP counterpart, at most
TARGETS = {("mlp", "tribucket"): 0.90, ("transformer", "tribucket"): 1.00,
           ("mlp", "tribucket fp16"): 0.90, ("transformer", "tribucket fp16"): 0.90}


def _ref(variant: str) -> str:
    return "DDP fp16" if variant == "tribucket fp16" else "DDP"


def table(results: list[dict], meta: dict | None = None) -> str:
    lines = []
    if meta:
        load = meta.get("loadavg")
        load_s = (f"; 1-min load average {load[0]:.2f} at the start" if load else "")
        lines += [f"Training step (forward, backward, SGD), {meta.get('world', 2)} "
                  f"{meta.get('backend', 'gloo')} ranks x 1 intra-op thread on a "
                  f"{meta['cpus']}-CPU {meta['machine']} machine, torch {meta['torch']}; median "
                  f"of {meta['rounds']} rounds after {meta['warmup']} warm-up, variants "
                  f"interleaved, every other round in reverse order{load_s}.", ""]
    lines += ["| model | variant | step (ms) | vs local | vs DDP | bucket memory |",
              "| --- | --- | ---: | ---: | ---: | ---: |"]
    for res in results:
        med = res["median_s"]
        for v in VARIANTS:
            ref = _ref(v)
            vs_ddp = f"{med[v] / med[ref]:.2f}×" if v.startswith("tribucket") else ""
            mem = res["bucket_bytes"].get(v)
            mem_s = f"{mem / 2**20:.1f} MiB" if mem is not None else ""
            lines.append(f"| {res['model']} ({res['tensors']} tensors, "
                         f"{res['params'] / 1e6:.1f} M params) | {v} | {med[v] * 1e3:.1f} | "
                         f"{med[v] / med['local']:.2f}× | {vs_ddp} | {mem_s} |")
    lines.append("")
    lines.append("tribucket's own accounting (`reducer.stats`, median over rounds, rank 0): "
                 "backward compute (hooks included) / communication exposed after backward / "
                 "of which waiting for the status (with the default allreduce it rides on the "
                 "last bucket, so this includes waiting for that bucket):")
    lines.append("")
    for res in results:
        for k, s in res["tribucket_stats"].items():
            lines.append(f"- {res['model']}, {k}: {s['backward_compute_s'] * 1e3:.1f} ms / "
                         f"{s['comm_exposed_s'] * 1e3:.1f} ms / {s['status_check_s'] * 1e3:.2f} "
                         f"ms ({res['buckets'][k]} buckets)")
    lines.append("")
    verdicts = []
    for res in results:
        model = res["model"].split()[0]
        for (m, v), limit in TARGETS.items():
            if m == model:
                ratio = res["median_s"][v] / res["median_s"][_ref(v)]
                verdicts.append(f"{model} {v} <= {limit:.2f}x {_ref(v)}: {ratio:.2f}x, "
                                f"{'met' if ratio <= limit else 'NOT met'}")
    lines.append("Targets: " + "; ".join(verdicts) + ".")
    return "\n".join(lines)


def plot(results: list[dict], path: pathlib.Path) -> None:
    colors = ["#999999", "#bbbbbb", "#1f77b4", "#9ecae1", "#aec7e8", "#d62728", "#ff9896",
              "#6baed6", "#e377c2"]
    bar_plot(results, VARIANTS, colors, "{model}: 2 gloo ranks, 1 thread each", path)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="mlp,transformer")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--render", action="store_true",
                   help="re-make step.md and step.png from step.json without measuring")
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"],
                   help="nccl: one GPU a rank (cuda:rank)")
    p.add_argument("--world", type=int, default=2, help="ranks (NCCL: at most one a GPU)")
    p.add_argument("--out", default=str(RESULTS), help="directory for step.{json,md,png}")
    args = p.parse_args(argv)
    if args.backend == "nccl" and args.world > torch.cuda.device_count():
        p.error(f"--backend nccl --world {args.world} needs {args.world} GPUs; "
                f"{torch.cuda.device_count()} visible: pass --world {max(1, torch.cuda.device_count())}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.render:  # re-make the table and plot from step.json (no measuring)
        data = json.loads((out / "step.json").read_text())
        md = table(data["results"], data["meta"])
        (out / "step.md").write_text(md + "\n")
        plot(data["results"], out / "step.png")
        print(md)
        return
    loadavg = list(os.getloadavg())
    results = []
    for name in args.models.split(","):
        t0 = time.time()
        res = measure(name, args.rounds, args.warmup, args.world, args.backend, out)
        print(f"{name}: done in {time.time() - t0:.0f}s", file=sys.stderr)
        results.append(res)
    meta = {"torch": torch.__version__, "machine": platform.machine(),
            "cpus": os.cpu_count(), "rounds": args.rounds, "warmup": args.warmup,
            "loadavg": loadavg}
    if args.backend != "gloo" or args.world != 2:
        meta.update(backend=args.backend, world=args.world)
        if args.backend == "nccl":
            meta["gpu"] = torch.cuda.get_device_name()
    (out / "step.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    md = table(results, meta)
    (out / "step.md").write_text(md + "\n")
    plot(results, out / "step.png")
    print(md)


if __name__ == "__main__":
    main()
