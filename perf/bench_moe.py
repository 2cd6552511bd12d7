"""Tokens per second of MoELayer forward+backward against a naive expert-parallel layer.

Shape legend: T tokens per rank, D model dim, E experts, K top-k, L experts per rank, W ranks.

One run, two gloo ranks (processes spawned here, one intra-op thread each), D=512, E=8,
K=2, T=4096 tokens per rank, dropless, fp32. Each expert is an FFN D -> F -> D with
F = 1024 (2·D, GELU). The variants, interleaved step by step so drift hits all alike:

* ``MoELayer`` — tribucket's layer (``backend="auto"``: Triton kernels on CUDA tensors, the
  vectorised PyTorch path on CPU tensors);
* ``MoELayer, reference kernels`` — the same layer with ``backend="reference"`` (on this CPU
  run "auto" resolves to the very same path: the column shows the noise, not a kernel gain);
* ``naive dense`` — the baseline the issue names, as a user would write it: all-gather every
  rank's tokens and dense gate matrix, run each local expert on *every* gathered token and
  mask with its gate column (zero where the token did not pick it), reduce-scatter the sum;
* ``naive gather`` — the same, but each expert runs only on the gathered tokens that picked
  it (``nonzero`` + ``index_add_``): a stronger baseline with the layer's FLOPs.

A step is forward + backward of ``(y * g).sum()``, timed between barriers (so the slowest
rank counts); the figure is the median over the measured steps after warm-up. Before timing,
every variant's ``y`` is checked against MoELayer's on the same input.

    python perf/bench_moe.py [--steps 7] [--warmup 1] [--tokens 4096]

Writes perf/results/moe.json, moe.png and moe.md (copied into the README by
``python perf/update_readme.py moe``).
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
RESULTS = ROOT / "perf" / "results"
D, E, K, F, W = 512, 8, 2, 1024, 2
TARGET = 1.5  # issue 6: MoELayer >= 1.5x the naive baseline's tokens/s


def _ffn(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D, F), nn.GELU(), nn.Linear(F, D))


# -- the naive baseline -----------------------------------------------------------------
# torch >= 2.11 renamed these collectives (the old names warn)
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = x.new_empty((W * x.shape[0],) + x.shape[1:])
        _all_gather(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((grad.shape[0] // W,) + grad.shape[1:])
        _reduce_scatter(out, grad.contiguous())
        return out


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = x.new_empty((x.shape[0] // W,) + x.shape[1:])
        _reduce_scatter(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((W * grad.shape[0],) + grad.shape[1:])
        _all_gather(out, grad.contiguous())
        return out


class NaiveExpertParallel(nn.Module):
    """All-gather tokens and gates, compute the local experts, reduce-scatter (same gate math)."""

    def __init__(self, router, experts, dense: bool):
        super().__init__()
        self.router, self.experts, self.dense = router, nn.ModuleList(experts), dense
        self.first = dist.get_rank() * len(experts)

    def forward(self, x_TD):
        probs_TE = torch.softmax(self.router(x_TD).float(), dim=-1)
        w_TK, ids_TK = torch.topk(probs_TE, K, dim=-1)
        gates_TE = torch.zeros_like(probs_TE).scatter(1, ids_TK, w_TK / w_TK.sum(-1, keepdim=True))
        x_all, gates_all = _AllGather.apply(x_TD), _AllGather.apply(gates_TE)
        y_all = torch.zeros_like(x_all)
        for l, expert in enumerate(self.experts):
            g = gates_all[:, self.first + l]
            if self.dense:  # every token through every local expert, masked by its gate
                y_all = y_all + g[:, None] * expert(x_all)
            else:  # only the tokens that picked this expert
                idx = torch.nonzero(g, as_tuple=True)[0]
                y_all = y_all.index_add(0, idx, g[idx, None] * expert(x_all[idx]))
        return _ReduceScatter.apply(y_all)


# -- the worker -------------------------------------------------------------------------
def _worker(rank: int, init_file: str, args, queue):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=W)
    from tribucket.moe import MoELayer

    L = E // W
    torch.manual_seed(0)
    router = nn.Linear(D, E, bias=False)
    experts = [_ffn(100 + e) for e in range(rank * L, rank * L + L)]
    import copy

    variants = {
        "MoELayer": MoELayer(copy.deepcopy(experts), E, D, top_k=K, router=copy.deepcopy(router)),
        "MoELayer, reference kernels": MoELayer(copy.deepcopy(experts), E, D, top_k=K,
                                                router=copy.deepcopy(router), backend="reference"),
        "naive dense": NaiveExpertParallel(copy.deepcopy(router), copy.deepcopy(experts), dense=True),
        "naive gather": NaiveExpertParallel(copy.deepcopy(router), copy.deepcopy(experts), dense=False),
    }
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(args.tokens, D, generator=g)
    gy = torch.randn(args.tokens, D, generator=g)

    # the variants compute the same function
    with torch.no_grad():
        ys = {name: m(x) for name, m in variants.items()}
    for name, y in ys.items():
        torch.testing.assert_close(y, ys["MoELayer"], atol=1e-4, rtol=1e-4,
                                   msg=lambda m, n=name: f"{n} disagrees with MoELayer: {m}")

    times = {name: [] for name in variants}
    for step in range(args.warmup + args.steps):
        for name, m in variants.items():
            xs = x.clone().requires_grad_()
            m.zero_grad(set_to_none=True)
            dist.barrier()
            t0 = time.perf_counter()
            (m(xs) * gy).sum().backward()
            dist.barrier()
            if step >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    stats = variants["MoELayer"].stats
    queue.put((rank, times, list(stats.tokens_received)))
    dist.destroy_process_group()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank (T)")
    args = p.parse_args(argv)

    load_before = os.getloadavg()[0]  # other work on the machine skews every variant alike
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_worker, args=(r, init_file, args, queue)) for r in range(W)]
        for proc in procs:
            proc.start()
        got = dict((r, (t, s)) for r, t, s in (queue.get(timeout=3600) for _ in range(W)))
        for proc in procs:
            proc.join()
            if proc.exitcode:
                raise SystemExit(f"a benchmark rank exited with code {proc.exitcode}")

    times0 = got[0][0]
    tokens = W * args.tokens
    rows = []
    for name in times0:
        med = statistics.median(times0[name])
        rows.append(dict(variant=name, step_ms=1e3 * med, tokens_per_s=tokens / med,
                         steps_ms=[1e3 * t for t in times0[name]]))
    naive = next(r for r in rows if r["variant"] == "naive dense")
    gather = next(r for r in rows if r["variant"] == "naive gather")
    for r in rows:
        r["vs_naive_dense"] = r["tokens_per_s"] / naive["tokens_per_s"]
        r["vs_naive_gather"] = r["tokens_per_s"] / gather["tokens_per_s"]
    layer = rows[0]
    result = dict(
        config=dict(world_size=W, d_model=D, num_experts=E, top_k=K, ffn_hidden=F,
                    tokens_per_rank=args.tokens, dtype="float32", capacity="dropless",
                    steps=args.steps, warmup=args.warmup, threads_per_rank=1,
                    backend="gloo (CPU processes)"),
        machine=dict(cpu=platform.processor() or platform.machine(), cores=os.cpu_count(),
                     torch=torch.__version__, python=platform.python_version(),
                     load_avg_1min=dict(before=load_before, after=os.getloadavg()[0])),
        rows_per_local_expert={f"rank {r}": got[r][1] for r in sorted(got)},
        results=rows,
        target=dict(metric="MoELayer tokens/s / naive dense tokens/s", threshold=TARGET,
                    value=layer["vs_naive_dense"], met=layer["vs_naive_dense"] >= TARGET),
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "moe.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "moe.md").write_text(_table(result))
    _plot(result, RESULTS / "moe.png")
    print(_table(result))
    return result


def _table(result) -> str:
    c = result["config"]
    lines = [
        f"MoE layer forward+backward, {c['world_size']} gloo ranks x 1 thread "
        f"({result['machine']['cores']}-core CPU, torch {result['machine']['torch']}), "
        f"D={c['d_model']}, E={c['num_experts']}, k={c['top_k']}, T={c['tokens_per_rank']} "
        f"tokens/rank, expert FFN {c['d_model']}->{c['ffn_hidden']}->{c['d_model']}, "
        f"fp32, dropless; median of {c['steps']} steps after {c['warmup']} warm-up, variants "
        f"interleaved (1-min load average {result['machine']['load_avg_1min']['before']:.1f} "
        f"before, {result['machine']['load_avg_1min']['after']:.1f} after).",
        "",
        "| variant | step (ms) | tokens/s (all ranks) | vs naive dense | vs naive gather |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in result["results"]:
        lines.append(f"| {r['variant']} | {r['step_ms']:.0f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['vs_naive_dense']:.2f}x | {r['vs_naive_gather']:.2f}x |")
    t = result["target"]
    lines += ["", f"Target (issue 6): MoELayer >= {t['threshold']}x naive dense tokens/s: "
              f"{t['value']:.2f}x, {'met' if t['met'] else 'NOT met'}."]
    return "\n".join(lines) + "\n"


def _plot(result, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["results"]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = [r["variant"] for r in rows]
    vals = [r["tokens_per_s"] for r in rows]
    bars = ax.barh(names[::-1], vals[::-1], color=["#999", "#999", "#4a7", "#27a"][-len(rows):])
    for b, v in zip(bars, vals[::-1]):
        ax.text(v, b.get_y() + b.get_height() / 2, f" {v:,.0f}", va="center", fontsize=8)
    c = result["config"]
    ax.set_xlabel("tokens/s, forward+backward (higher is better)")
    ax.set_title(f"MoE layer, {c['world_size']} gloo ranks, D={c['d_model']}, E={c['num_experts']}, "
                 f"k={c['top_k']}, T={c['tokens_per_rank']}/rank", fontsize=9)
    ax.set_xlim(0, max(vals) * 1.25)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
