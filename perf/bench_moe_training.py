"""Expert x data parallelism: a training step with the expert replicas averaged by
tribucket's reducer against the hand-written averaging a user would otherwise add.

One run, 4 gloo ranks (processes spawned here, one intra-op thread each) as 2 expert-parallel
groups x 2 replicas; model ``Linear(D, D) -> MoELayer -> Linear(D, D)``, D=256, expert FFN
256 -> 512 -> 256, 2 experts per rank (4 in all, each on 2 ranks), top-2, dropless,
T=1024 tokens per rank, fp32. The dense parameters are averaged by ``fused_bucketing`` in
every variant; the variants differ in how the experts' replicas are averaged:

* ``expert reducer`` — tribucket's: a second reducer on the replica group (buckets launched
  during backward);
* ``loop after backward`` — the reducer's expert part closed, then one
  ``dist.all_reduce(p.grad, group=replicas)`` per expert parameter and a division, after
  backward (what the docs of most MoE codes show);
* ``flat after backward`` — the same with one all-reduce of all expert gradients flattened
  into one buffer;
* ``expert reducer, timeout`` — tribucket's with ``MoELayer(timeout=...)`` (the timed group
  and the store progress marks of each phase: the price of the diagnosis).

A step is forward + backward (+ the hand-written averaging), timed between barriers (the
slowest rank counts); variants are interleaved step by step; the figure is the median.
Before timing, every variant's averaged expert gradients are checked against the expert
reducer's. The same run times ``tribucket.clip_grad_norm_`` against
``torch.nn.utils.clip_grad_norm_`` (which is wrong on this model: it sees one rank's experts)
on the same gradients. 4 ranks oversubscribe the 2-core machine: the figures are noisy.

    python perf/bench_moe_training.py [--steps 15] [--warmup 2] [--tokens 1024]

Writes perf/results/moe_training.json, .png and .md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

try:  # run as a script: perf/ is on sys.path
    import bench_moe
    from _results import save
except ImportError:  # pragma: no cover - imported as perf.bench_moe_training
    from perf import bench_moe
    from perf._results import save

WORLD, EP, L, D, F, K = 4, 2, 2, 256, 512, 2
VARIANTS = ("expert reducer", "loop after backward", "flat after backward",
            "expert reducer, timeout")


def _model(seed: int, ep, replicas, **layer_kw) -> nn.Module:
    import tribucket.moe

    rank = dist.get_rank()
    experts = []
    for e in range((rank % EP) * L, (rank % EP) * L + L):
        torch.manual_seed(seed * 100 + e)
        experts.append(nn.Sequential(nn.Linear(D, F), nn.GELU(), nn.Linear(F, D)))
    torch.manual_seed(seed)
    router = nn.Linear(D, EP * L, bias=False)
    inp, out = nn.Linear(D, D), nn.Linear(D, D)
    layer = tribucket.moe.MoELayer(experts, EP * L, D, top_k=K, router=router, group=ep,
                                   replica_group=replicas, **layer_kw)
    return nn.Sequential(inp, layer, out)


def _worker(rank: int, world: int, init_file: str, args, queue):
    import tribucket
    import tribucket.moe

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    ep, replicas = tribucket.moe.expert_data_parallel_groups(EP)
    R = dist.get_world_size(replicas)
    models, reducers = {}, {}
    for name in VARIANTS:  # every rank builds the same variants in the same order
        kw = {"timeout": datetime.timedelta(seconds=120)} if "timeout" in name else {}
        models[name] = _model(1, ep, replicas, **kw)
        reducers[name] = tribucket.fused_bucketing(models[name])
        if "after backward" in name:
            for r in reducers[name].expert_reducers:
                r.close()  # the experts are averaged by hand below
    experts = {n: [p for p in m[1].experts.parameters()] for n, m in models.items()}

    def step(name, x):
        models[name](x).square().mean().backward()
        grads = [p.grad for p in experts[name]]
        if name == "loop after backward":
            for g in grads:
                dist.all_reduce(g, group=replicas)
                g.div_(R)
        elif name == "flat after backward":
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=replicas)
            flat.div_(R)
            for g, f in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(f)

    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.tokens, D, generator=g)
    for name in VARIANTS:  # the same function: the same averaged expert gradients
        step(name, x)
    for name in VARIANTS[1:]:
        for a, b in zip(experts[name], experts[VARIANTS[0]]):
            torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5)
    times = {n: [] for n in VARIANTS}
    clip = {"tribucket.clip_grad_norm_": [], "torch clip_grad_norm_ (local)": []}
    for i in range(args.warmup + args.steps):
        x = torch.randn(args.tokens, D, generator=g)
        for name in VARIANTS:
            models[name].zero_grad()
            dist.barrier()
            t0 = time.perf_counter()
            step(name, x)
            dist.barrier()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)
        m = models[VARIANTS[0]]
        for what, fn in (("tribucket.clip_grad_norm_", lambda: tribucket.clip_grad_norm_(m, 1e9)),
                         ("torch clip_grad_norm_ (local)",
                          lambda: torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9))):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            if i >= args.warmup:
                clip[what].append(time.perf_counter() - t0)
    for r in reducers.values():
        r.close()
    queue.put((rank, times, clip))
    dist.destroy_process_group()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tokens", type=int, default=1024, help="tokens per rank (T)")
    args = p.parse_args(argv)
    load_before = os.getloadavg()[0]
    got = bench_moe._spawn(_worker, WORLD, args)
    times, clip = got[0]
    tokens = WORLD * args.tokens
    base = statistics.median(times[VARIANTS[0]])
    rows = [dict(variant=n, step_ms=1e3 * statistics.median(t),
                 tokens_per_s=tokens / statistics.median(t),
                 time_vs_expert_reducer=statistics.median(t) / base,
                 steps_ms=[1e3 * s for s in t]) for n, t in times.items()]
    result = dict(
        config=dict(world_size=WORLD, ep_size=EP, replicas=WORLD // EP, experts_per_rank=L,
                    d_model=D, ffn_hidden=F, top_k=K, tokens_per_rank=args.tokens,
                    dtype="float32", capacity="dropless", steps=args.steps, warmup=args.warmup,
                    threads_per_rank=1, backend="gloo (CPU processes)"),
        machine=bench_moe._machine(load_before),
        results=rows,
        clip_ms={k: 1e3 * statistics.median(v) for k, v in clip.items()},
    )
    save(bench_moe.ROOT / "perf" / "results", "moe_training", result, _table, _plot)
    return result


def _table(result) -> str:
    c, m = result["config"], result["machine"]
    lines = [
        f"Training step (forward + backward + averaging), {c['world_size']} gloo ranks x 1 "
        f"thread as {c['ep_size']} expert-parallel x {c['replicas']} data-parallel "
        f"({m['cores']}-core CPU, torch {m['torch']}), D={c['d_model']}, expert FFN "
        f"{c['d_model']}->{c['ffn_hidden']}->{c['d_model']}, {c['experts_per_rank']} experts "
        f"per rank, k={c['top_k']}, T={c['tokens_per_rank']} tokens/rank, fp32, dropless; "
        f"median of {c['steps']} steps after {c['warmup']} warm-up, variants interleaved "
        f"(1-min load average {m['load_avg_1min']['before']:.1f} before, "
        f"{m['load_avg_1min']['after']:.1f} after).",
        "",
        "| expert replicas averaged by | step (ms) | tokens/s (all ranks) | time vs expert reducer |",
        "| --- | ---: | ---: | ---: |",
    ]
    for r in result["results"]:
        lines.append(f"| {r['variant']} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['time_vs_expert_reducer']:.2f}x |")
    clip = result["clip_ms"]
    lines += ["", "| gradient clipping, same gradients | time (ms) |", "| --- | ---: |"]
    lines += [f"| {k} | {v:.2f} |" for k, v in clip.items()]
    return "\n".join(lines) + "\n"


def _plot(result, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["results"]
    fig, ax = plt.subplots(figsize=(7, 2.8))
    names = [r["variant"] for r in rows][::-1]
    vals = [r["step_ms"] for r in rows][::-1]
    bars = ax.barh(names, vals, color="#27a")
    for b, v in zip(bars, vals):
        ax.text(v, b.get_y() + b.get_height() / 2, f" {v:.1f} ms", va="center", fontsize=8)
    c = result["config"]
    ax.set_xlabel("step time, ms (lower is better)")
    ax.set_title(f"EP x DP training step, {c['ep_size']} x {c['replicas']} gloo ranks, "
                 f"D={c['d_model']}, T={c['tokens_per_rank']}/rank", fontsize=9)
    ax.set_xlim(0, max(vals) * 1.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
