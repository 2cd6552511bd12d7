"""Where expert parallelism pays: training-step time of one MoE layer, expert-parallel
(tribucket) against replicated experts (torch DDP), over experts per rank and expert width.

Shape legend: T tokens per rank, D model dim, F expert hidden width, L experts per rank,
E = W·L experts, K top-k, W ranks.

Two gloo ranks (one intra-op thread each). For every (L, F) of the grid, the same layer is
trained both ways, with the same weights and tokens, interleaved step by step:

* ``tribucket EP`` — ``MoELayer`` with this rank's L experts, inside ``fused_bucketing``
  (the router's gradient is averaged; each expert lives on one rank, so its gradient is not
  communicated, ``expert_grad_scale=1/W``), AdamW over what the rank holds;
* ``DDP replicated`` — every rank holds all E experts (the demo's ``AllExpertsMoE``, the
  same gate math) inside ``DistributedDataParallel``, which averages every expert's
  gradient; AdamW over all of them.

A step is forward + backward + optimizer step of ``(y · g).sum()`` + the aux loss. Two
figures per step: the wall time between barriers (the slowest rank), and the CPU time of
the slowest rank's process (its compute and gloo's transport threads, not the time it
waits). On a machine shared with other jobs the wall time mostly measures the others'
load; the CPU time is what the step costs, and with a core per rank it is what the step
takes, so the crossover is judged on it. Figures are medians of the measured steps.
Expert parallelism moves tokens (two all-to-alls each way, independent of F and L) where
replication all-reduces E experts' gradients and runs the optimizer on E experts (growing
with F·L): the table shows where one overtakes the other. Per-rank memory of the expert
parameters and AdamW state is counted from the tensors.

    python perf/bench_moe_crossover.py [--steps 5] [--warmup 2] [--tokens 2048]

Writes perf/results/moe_crossover.json, .png and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

ROOT = pathlib.Path(__file__).resolve().parent.parent
D, K, W = 64, 2, 2  # the demo's width and top-k
EXPERTS_PER_RANK = (1, 2, 4, 8)
WIDTHS = (128, 512, 2048)


def _build(L: int, F: int, rank: int, expert_parallel: bool) -> nn.Module:
    from tribucket.demo.model import FFN, AllExpertsMoE
    from tribucket.moe import MoELayer

    E = W * L
    torch.manual_seed(1000 * L + F)
    router = nn.Linear(D, E, bias=False)
    experts = []
    for e in range(E):
        torch.manual_seed(1000 * L + F + 1 + e)
        experts.append(FFN(D, F))
    if expert_parallel:
        return MoELayer(experts[rank * L:(rank + 1) * L], E, D, top_k=K, router=router,
                        expert_grad_scale=1.0 / W)
    return AllExpertsMoE(experts, router, K, aux_loss_coef=0.01)


def _memory(module: nn.Module, opt: torch.optim.Optimizer) -> tuple[int, int]:
    experts = [p for n, p in module.named_parameters() if n.startswith("experts.")]
    params = sum(p.numel() * p.element_size() for p in experts)
    state = sum(t.numel() * t.element_size() for p in experts
                for t in opt.state.get(p, {}).values() if isinstance(t, torch.Tensor))
    return params, state


def _worker(rank: int, world: int, init_file: str, args, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=W)
    import tribucket

    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(args.tokens, D, generator=g)
    gy = torch.randn(args.tokens, D, generator=g)
    out = []
    for L in EXPERTS_PER_RANK:
        for F in WIDTHS:
            ep = _build(L, F, rank, expert_parallel=True)
            rep = _build(L, F, rank, expert_parallel=False)
            ddp = nn.parallel.DistributedDataParallel(rep)
            with tribucket.fused_bucketing(ep):
                with torch.no_grad():  # the same function before training
                    torch.testing.assert_close(ep(x), rep(x), atol=1e-5, rtol=1e-5)
                systems = {"tribucket EP": (ep, ep), "DDP replicated": (ddp, rep)}
                opts = {n: torch.optim.AdamW(m.parameters(), lr=1e-3) for n, (_, m) in systems.items()}
                times = {n: [] for n in systems}
                cpu = {n: [] for n in systems}
                for step in range(args.warmup + args.steps):
                    for name, (fwd, module) in systems.items():
                        dist.barrier()
                        t0, c0 = time.perf_counter(), time.process_time()
                        ((fwd(x) * gy).sum() + module.aux_loss).backward()
                        opts[name].step()
                        opts[name].zero_grad(set_to_none=True)
                        c = torch.tensor([time.process_time() - c0], dtype=torch.float64)
                        dist.barrier()
                        t = time.perf_counter() - t0
                        dist.all_reduce(c, op=dist.ReduceOp.MAX)  # the slowest rank's CPU
                        if step >= args.warmup:
                            times[name].append(t)
                            cpu[name].append(float(c))
            mem = {n: _memory(m, opts[n]) for n, (_, m) in systems.items()}
            out.append(dict(experts_per_rank=L, ffn_hidden=F,
                            step_ms={n: 1e3 * statistics.median(t) for n, t in times.items()},
                            steps_ms={n: [1e3 * s for s in t] for n, t in times.items()},
                            cpu_ms={n: 1e3 * statistics.median(t) for n, t in cpu.items()},
                            cpu_steps_ms={n: [1e3 * s for s in t] for n, t in cpu.items()},
                            expert_param_bytes={n: m[0] for n, m in mem.items()},
                            expert_opt_bytes={n: m[1] for n, m in mem.items()},
                            load_avg_1min=os.getloadavg()[0]))
            if rank == 0:
                r = out[-1]["cpu_ms"]
                print(f"L={L} F={F}: CPU EP {r['tribucket EP']:.1f} ms, DDP "
                      f"{r['DDP replicated']:.1f} ms", flush=True)
    queue.put((rank, out))
    dist.destroy_process_group()


def _crossover(points: list) -> list[dict]:
    """Per L: the smallest F from which expert parallelism is at least as fast, if any."""
    found = []
    for L in EXPERTS_PER_RANK:
        row = [p for p in points if p["experts_per_rank"] == L]
        wins = [p["ffn_hidden"] for p in row if p["speedup"] >= 1.0]
        first = next((F for F in WIDTHS if all(q in wins for q in WIDTHS if q >= F)), None)
        found.append(dict(experts_per_rank=L, from_ffn_hidden=first))
    return found


def _table(result) -> str:
    c, m = result["config"], result["machine"]
    mib = 1024 ** 2
    lines = [
        f"One MoE layer's training step (forward + backward + AdamW), expert-parallel tribucket "
        f"against DDP with every expert replicated, {c['world_size']} gloo ranks x 1 thread "
        f"({m['cores']}-core CPU shared with other jobs, torch {m['torch']}), D={c['d_model']}, "
        f"k={c['top_k']}, T={c['tokens_per_rank']} tokens/rank, experts D->F->D (GELU), fp32; "
        f"median of {c['steps']} steps after {c['warmup']} warm-up, the two interleaved; 1-min "
        f"load average {m['load_avg_1min']['before']:.1f} before, "
        f"{m['load_avg_1min']['after']:.1f} after. CPU: the slowest rank's CPU time in the step "
        f"(what the step takes with a core per rank; the speed-up is judged on it); wall: the "
        f"step as the loaded machine ran it. Memory: expert parameters + AdamW state, per rank.",
        "",
        "| experts/rank | F | EP CPU (ms) | DDP CPU (ms) | EP speed-up | EP wall (ms) | DDP wall "
        "(ms) | EP expert memory (params + AdamW) | DDP expert memory |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for p in result["points"]:
        ep, dd = "tribucket EP", "DDP replicated"
        mem = {n: (p["expert_param_bytes"][n] + p["expert_opt_bytes"][n]) / mib for n in (ep, dd)}
        lines.append(f"| {p['experts_per_rank']} | {p['ffn_hidden']} | {p['cpu_ms'][ep]:.1f} | "
                     f"{p['cpu_ms'][dd]:.1f} | {p['speedup']:.2f}x | {p['step_ms'][ep]:.1f} | "
                     f"{p['step_ms'][dd]:.1f} | {mem[ep]:.2f} MiB | {mem[dd]:.2f} MiB |")
    lines += ["", _statement(result)]
    return "\n".join(lines) + "\n"


def _statement(result) -> str:
    parts = []
    for x in result["crossover"]:
        L, F = x["experts_per_rank"], x["from_ffn_hidden"]
        parts.append(f"{L} expert{'s' if L > 1 else ''}/rank: " +
                     ("replicated experts stay faster up to F=" + str(WIDTHS[-1]) if F is None
                      else f"EP faster from F={F}" if F != WIDTHS[0] else "EP faster at every width"))
    return "Crossover (EP at least as fast as DDP from this width up): " + "; ".join(parts) + "."


def _plot(result, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(EXPERTS_PER_RANK), figsize=(3.2 * len(EXPERTS_PER_RANK), 3.2),
                             sharey=False)
    for ax, L in zip(axes, EXPERTS_PER_RANK):
        row = [p for p in result["points"] if p["experts_per_rank"] == L]
        for name, style in (("tribucket EP", dict(color="C0", marker="o")),
                            ("DDP replicated", dict(color="C3", marker="s", ls="--"))):
            ax.plot([p["ffn_hidden"] for p in row], [p["cpu_ms"][name] for p in row],
                    label=name, **style)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("expert width F")
        ax.set_title(f"{L} expert{'s' if L > 1 else ''}/rank (E={W * L})", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("step, slowest rank's CPU time (ms)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank (T)")
    p.add_argument("--results", default=str(ROOT / "perf" / "results"))
    args = p.parse_args(argv)
    load_before = os.getloadavg()[0]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, W, os.path.join(tmp, "rdv"), args, queue))
                 for r in range(W)]
        for proc in procs:
            proc.start()
        got = dict(queue.get(timeout=3600) for _ in range(W))
        for proc in procs:
            proc.join()
            if proc.exitcode:
                raise SystemExit(f"a benchmark rank exited with code {proc.exitcode}")
    points = got[0]
    for pt in points:
        pt["speedup"] = pt["cpu_ms"]["DDP replicated"] / pt["cpu_ms"]["tribucket EP"]
    result = dict(
        config=dict(world_size=W, d_model=D, top_k=K, tokens_per_rank=args.tokens,
                    experts_per_rank=EXPERTS_PER_RANK, ffn_hidden=WIDTHS, steps=args.steps,
                    warmup=args.warmup, dtype="float32", threads_per_rank=1,
                    backend="gloo (CPU processes)", optimizer="AdamW"),
        machine=dict(cpu=platform.processor() or platform.machine(), cores=os.cpu_count(),
                     torch=torch.__version__, python=platform.python_version(),
                     load_avg_1min=dict(before=load_before, after=os.getloadavg()[0])),
        points=points)
    result["crossover"] = _crossover(points)
    out = pathlib.Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe_crossover.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "moe_crossover.md").write_text(_table(result))
    _plot(result, out / "moe_crossover.png")
    print(_table(result))
    return result


if __name__ == "__main__":
    main()
