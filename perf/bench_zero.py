"""Sharded AdamW: optimizer-state + gradient memory per rank and step time, against DDP +
AdamW and DDP + torch's ``ZeroRedundancyOptimizer(AdamW)``, on gloo CPU processes, one run.

Variants (same model, same data, one intra-op thread per rank):

* ``DDP + AdamW``        ``DistributedDataParallel`` (default options) and ``torch.optim.AdamW``
* ``DDP + ZeRO``         the same DDP with ``ZeroRedundancyOptimizer(optimizer_class=AdamW)``
* ``tribucket sharded``  ``fused_bucketing(shard_optimizer=True)`` + ``ShardedOptimizer(AdamW,
  overlap_param_gather=False)`` (buckets of the shard_optimizer default cap, 4 MiB): ``step()``
  returns with the parameters gathered
* ``tribucket sharded overlap``  the same with ``overlap_param_gather=True`` (the default):
  the parameter all-gathers overlap the next forward
* ``tribucket sharded 25 MiB``  ``bucket_cap_mb=25`` (DDP's default): larger transient buckets

Memory is counted, not sampled from the OS: the bytes of the distinct storages holding
gradients (every ``.grad``, DDP's bucket buffers, tribucket's bucket buffers and gradient
shards) and optimizer state (every state tensor; fp32 master shards where there are any),
sampled after each gradient hook, after backward, after the step and after ``zero_grad`` of
one steady-state iteration; "peak" is the largest sample, "kept" the one after ``zero_grad``
(what stays between steps). Parameters and activations, equal in all variants, are not
counted. Step time (``zero_grad`` + forward + backward + step) is the median over rounds of
rank 0, variants interleaved round-robin so load drift hits all alike, every other round in
reverse order.

    python perf/bench_zero.py                       # writes perf/results/zero.{json,md,png}
    python perf/bench_zero.py --rounds 5 --worlds 2 # quicker
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

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _bench import close_worker, init_worker, round_robin, spawn  # noqa: E402
from bench_step import make_model  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
VARIANTS = ["DDP + AdamW", "DDP + ZeRO", "tribucket sharded", "tribucket sharded overlap",
            "tribucket sharded 25 MiB"]
# the targets are for the default options: the gathers overlapped
BASE, ZERO, OURS = VARIANTS[0], VARIANTS[1], VARIANTS[3]
LR = 1e-4


def _bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen = {}
    for t in tensors:
        if t is not None and t.numel():
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _state_tensors(optim) -> list:
    return [v for st in optim.state.values() for v in st.values()
            if isinstance(v, torch.Tensor)]


class _Variant:
    """One way of training the model: how to step it and which tensors to count."""

    def __init__(self, name: str, model_name: str):
        import tribucket
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.name = name
        self.model, self.x = make_model(model_name)
        self.reducer = None
        self.fixed = 0  # bytes not visible as tensors (DDP's bucket buffers)
        if name.startswith("tribucket"):
            cap = 25 if name.endswith("25 MiB") else None
            self.reducer = tribucket.Reducer(self.model, shard_optimizer=True, bucket_cap_mb=cap)
            self.forward = self.model
            self.opt = tribucket.ShardedOptimizer(self.reducer, torch.optim.AdamW, lr=LR,
                                                  overlap_param_gather=name.endswith("overlap"))
            self.inner = self.opt.optim
        else:
            ddp = DDP(self.model)
            self.forward = ddp
            self.ddp = ddp
            if name == ZERO:
                self.opt = ZeroRedundancyOptimizer(self.model.parameters(),
                                                   optimizer_class=torch.optim.AdamW, lr=LR)
                self.inner = self.opt.optim
            else:
                self.opt = self.inner = torch.optim.AdamW(self.model.parameters(), lr=LR)

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.forward(self.x).float().square().mean().backward()
        self.opt.step()

    def held(self) -> int:
        ts = [p.grad for p in self.model.parameters()] + _state_tensors(self.inner)
        if self.reducer is not None:
            ts += list(self.reducer.grad_shards)
            ts += [t for b in self.reducer._bw.buckets
                   for t in (b.mem.active, b.mem.lent)]
            ts += [m for m, f in zip(self.opt._master, self.opt._flat)
                   if m.untyped_storage().data_ptr() != f.untyped_storage().data_ptr()]
        return _bytes(ts) + self.fixed

    def measure_memory(self) -> dict:
        """Run one more step, sampling the counted bytes along the way."""
        if self.reducer is None:
            sizes = self.ddp._get_ddp_logging_data().get("bucket_sizes", "")
            self.fixed = sum(int(s) for s in str(sizes).split(",") if s.strip())
        samples = []
        handles = [p.register_post_accumulate_grad_hook(lambda _p: samples.append(self.held()))
                   for p in self.model.parameters() if p.requires_grad]
        self.opt.zero_grad(set_to_none=True)
        samples.append(self.held())
        self.forward(self.x).float().square().mean().backward()
        samples.append(self.held())
        self.opt.step()
        samples.append(self.held())
        self.opt.zero_grad(set_to_none=True)
        kept = self.held()
        for h in handles:
            h.remove()
        return dict(peak=max(samples + [kept]), kept=kept)


def _worker(rank: int, world: int, port: int, model_name: str, rounds: int, warmup: int,
            out_path: str) -> None:
    init_worker(rank, world, port)
    variants = {name: _Variant(name, model_name) for name in VARIANTS}
    times = round_robin(lambda name: variants[name].step(), VARIANTS, rounds, warmup)
    memory = {}
    for name, v in variants.items():
        dist.barrier()
        memory[name] = v.measure_memory()
    # every rank's memory: ZeRO's uneven shards make the ranks differ
    every = [None] * world
    dist.all_gather_object(every, memory)
    if rank == 0:
        model = variants[BASE].model
        out = {"model": model_name, "world": world,
               "params": sum(p.numel() for p in model.parameters()),
               "tensors": len(list(model.parameters())),
               "buckets": {k: len(v.reducer.layout.buckets) for k, v in variants.items()
                           if v.reducer is not None},
               "median_s": {k: statistics.median(t) for k, t in times.items()},
               "all_s": times,
               "peak_bytes": {k: max(m[k]["peak"] for m in every) for k in variants},
               "kept_bytes": {k: max(m[k]["kept"] for m in every) for k in variants}}
        with open(out_path, "w") as f:
            json.dump(out, f)
    close_worker([v.reducer for v in variants.values()])


def measure(model_name: str, world: int, rounds: int, warmup: int) -> dict:
    return spawn(_worker, (model_name, rounds, warmup), world,
                 RESULTS / f".zero_{model_name}_{world}.json")


def table(results: list[dict], meta: dict) -> str:
    load = meta["loadavg"]
    lines = [f"AdamW training step, gloo ranks x 1 intra-op thread on a {meta['cpus']}-CPU "
             f"{meta['machine']} machine, torch {meta['torch']}; step: median of "
             f"{meta['rounds']} rounds after {meta['warmup']} warm-up, variants interleaved (every "
             "other round in reverse order); "
             f"1-min load average {load[0]:.2f} at the start, {meta['load_end'][0]:.2f} at "
             "the end. Memory: optimizer state + gradients per rank (the largest rank), "
             "peak over one step and kept between steps.", "",
             "| model | ranks | variant | step (ms) | vs DDP | vs ZeRO | peak (MiB) | "
             "peak vs DDP | kept (MiB) | kept vs DDP |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    verdicts = []
    for res in results:
        med, peak, kept = res["median_s"], res["peak_bytes"], res["kept_bytes"]
        what = f"{res['model']} ({res['params'] / 1e6:.1f} M params)"
        for v in VARIANTS:
            ours = v.startswith("tribucket")
            vs_zero = f"{med[v] / med[ZERO]:.2f}×" if ours else ""
            vs_ddp = f"{med[v] / med[BASE]:.2f}×" if v != BASE else ""
            lines.append(
                f"| {what} | {res['world']} | {v} | {med[v] * 1e3:.1f} | {vs_ddp} | {vs_zero} "
                f"| {peak[v] / 2**20:.1f} | {peak[v] / peak[BASE]:.2f} | "
                f"{kept[v] / 2**20:.1f} | {kept[v] / kept[BASE]:.2f} |")
        w = res["world"]
        mem_limit = 1 / w + 0.05
        r_peak = peak[OURS] / peak[BASE]
        text = (f"{res['model']}, {w} ranks: peak memory {r_peak:.2f} of DDP's (target "
                f"<= {mem_limit:.2f}: {'met' if r_peak <= mem_limit else 'NOT met'})")
        if w == 2:
            t_zero, t_ddp = med[OURS] / med[ZERO], med[OURS] / med[BASE]
            text += (f", step {t_zero:.2f}x ZeRO's (<= 0.90: "
                     f"{'met' if t_zero <= 0.9 else 'NOT met'}) and {t_ddp:.2f}x DDP's "
                     f"(<= 1.25: {'met' if t_ddp <= 1.25 else 'NOT met'})")
            o = VARIANTS[2]
            text += (f"; without the overlap {med[o] / med[ZERO]:.2f}x ZeRO's and "
                     f"{med[o] / med[BASE]:.2f}x DDP's")
        verdicts.append(text)
    lines += ["", "Targets, for `tribucket sharded overlap` (default options): "
              + "; ".join(verdicts) + "."]
    lines += ["", "Buckets of the sharded variants: " + "; ".join(
        f"{r['model']} {r['world']} ranks: " + ", ".join(f"{k} {n}" for k, n in
                                                           r["buckets"].items())
        for r in results) + "."]
    return "\n".join(lines)


def plot(results: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(results), figsize=(4.5 * len(results), 7), squeeze=False)
    colors = ["#d62728", "#ff9896", "#1f77b4", "#6baed6", "#9ecae1"]
    for k, res in enumerate(results):
        title = f"{res['model']}, {res['world']} ranks"
        ax = axes[0][k]
        ax.bar(range(len(VARIANTS)), [res["median_s"][v] * 1e3 for v in VARIANTS], color=colors)
        ax.set_ylabel("step, ms (median)")
        ax.set_title(title)
        ax.set_xticks(range(len(VARIANTS)), [])
        ax = axes[1][k]
        ax.bar(range(len(VARIANTS)), [res["peak_bytes"][v] / 2**20 for v in VARIANTS],
               color=colors, label="peak")
        ax.scatter(range(len(VARIANTS)), [res["kept_bytes"][v] / 2**20 for v in VARIANTS],
                   color="black", marker="_", s=400, label="kept between steps")
        ax.set_ylabel("state + gradients per rank, MiB")
        ax.set_xticks(range(len(VARIANTS)), VARIANTS, rotation=30, ha="right")
        if k == 0:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="mlp,transformer")
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--render", action="store_true",
                   help="re-make zero.md and zero.png from zero.json without measuring")
    args = p.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.render:
        data = json.loads((RESULTS / "zero.json").read_text())
    else:
        loadavg = list(os.getloadavg())
        results = []
        for world in (int(w) for w in args.worlds.split(",")):
            for name in args.models.split(","):
                t0 = time.time()
                results.append(measure(name, world, args.rounds, args.warmup))
                print(f"{name}, {world} ranks: {time.time() - t0:.0f}s", file=sys.stderr)
        meta = {"torch": torch.__version__, "machine": platform.machine(),
                "cpus": os.cpu_count(), "rounds": args.rounds, "warmup": args.warmup,
                "loadavg": loadavg, "load_end": list(os.getloadavg())}
        data = {"meta": meta, "results": results}
        (RESULTS / "zero.json").write_text(json.dumps(data, indent=1))
    md = table(data["results"], data["meta"])
    (RESULTS / "zero.md").write_text(md + "\n")
    plot(data["results"], RESULTS / "zero.png")
    print(md)


if __name__ == "__main__":
    main()
