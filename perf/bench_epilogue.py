"""Step time with gradient clipping and loss scaling: torch's passes against the reducer's
epilogue, on gloo CPU processes, in one run.

Two ranks (one intra-op thread each) train the same model on the same data; every variant
runs forward, backward, ``clip_grad_norm_(max_norm=1.0)`` and an AdamW step:

* ``DDP + torch clip``        DDP, ``torch.nn.utils.clip_grad_norm_`` (the baseline)
* ``tribucket + torch clip``  the reducer, torch's clip (what the reducer alone changes)
* ``tribucket + fused clip``  the reducer, ``tribucket.clip_grad_norm_`` (the reducer's norm)
* ``DDP + torch clip, clipping`` / ``tribucket + fused clip, clipping``  the same two with
  ``max_norm=1e-3``: the clip multiply runs every step (with ``max_norm=1.0`` it is skipped on
  the CPU when the norm is below it; torch's clip multiplies either way). Compared with each
  other: gradients clipped this small make the AdamW step itself slower (tiny squares)
* ``bound: 1 allreduce + 1 read``  no reducer: backward, one allreduce of a flat buffer the
  size of the gradients (as if autograd had written them there: no copy, no hook), one read
  of it for the norm, the AdamW step. What any data-parallel step with a norm must do at
  least on this transport, run without overlap (overlapping the allreduce with backward, as
  DDP does, is slower on this 2-core machine: see perf/bench_step.py's chunked variant); its
  ratio to the baseline is the best a reducer could show here
* ``DDP + GradScaler``        the same with ``torch.amp.GradScaler``: scale, unscale_, clip, step
* ``tribucket + GradScaler``  ``tribucket.amp.GradScaler`` (the reducer's inf flag) and
  ``tribucket.clip_grad_norm_``
* ``tribucket + GradScaler, reuse``  the same with ``reuse_grad_figures=True``: the clip takes
  the norm from unscale_'s read

The scaler variants scale the loss but compute in float32: fp16 autocast on this CPU takes
seconds per step, and what differs between the two scalers (the inf scan, the unscale and
clip multiplies) is the same pass over the gradients either way.

Variants run round-robin (one step of each per round) so drift in machine load hits all of
them alike; the figure is the median over rounds after warm-up, of rank 0's step time. The
1-minute load average is recorded before and after.

    python perf/bench_epilogue.py                # both models, writes perf/results/epilogue.*
    python perf/bench_epilogue.py --rounds 5     # quicker
    python perf/bench_epilogue.py --render       # re-make the .md/.png from the .json
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
from _bench import bar_plot, close_worker, init_worker, spawn_measure  # noqa: E402
from bench_step import make_model  # noqa: E402 - the models of the step bench

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
NAME = "epilogue"
BOUND = "bound: 1 allreduce + 1 read"
VARIANTS = ["DDP + torch clip", "tribucket + torch clip", "tribucket + fused clip", BOUND,
            "DDP + torch clip, clipping", "tribucket + fused clip, clipping", "DDP + GradScaler",
            "tribucket + GradScaler", "tribucket + GradScaler, reuse"]
BASELINE = {"tribucket + torch clip": "DDP + torch clip",
            "tribucket + fused clip": "DDP + torch clip",
            "tribucket + fused clip, clipping": "DDP + torch clip, clipping",
            BOUND: "DDP + torch clip",
            "tribucket + GradScaler": "DDP + GradScaler",
            "tribucket + GradScaler, reuse": "DDP + GradScaler"}
MAX_NORM = 1.0
MAX_NORM_CLIPPING = 1e-3  # below every gradient norm of these models: always clips
#: issue 16's target: backward + clip + AdamW, tribucket's over DDP + torch's clip, on the MLP
TARGETS = {("mlp", "tribucket + fused clip"): 0.90}


def _worker(rank: int, world: int, port: int, model_name: str, rounds: int, warmup: int,
            out_path: str) -> None:
    init_worker(rank, world, port)
    import tribucket

    steps = {}
    for name in VARIANTS:
        model, x = make_model(model_name)
        reducer = (tribucket.Reducer(model, reuse_grad_figures=name.endswith("reuse"))
                   if name.startswith("tribucket") else None)
        forward = (model if reducer is not None or name == BOUND
                   else nn.parallel.DistributedDataParallel(model))
        scaler = None
        if "GradScaler" in name:
            cls = tribucket.amp.GradScaler if reducer is not None else torch.amp.GradScaler
            scaler = cls("cpu", init_scale=2.0**10)
        fused = reducer is not None and ("fused clip" in name or "GradScaler" in name)
        clip = tribucket.clip_grad_norm_ if fused else torch.nn.utils.clip_grad_norm_
        max_norm = MAX_NORM_CLIPPING if name.endswith("clipping") else MAX_NORM
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        steps[name] = (model, forward, opt, reducer, scaler, clip, max_norm)
    x = x + rank  # different data per rank
    flat = torch.zeros(sum(p.numel() for p in steps[BOUND][0].parameters()))  # BOUND's

    def run(name) -> tuple[float, float]:
        """One step; returns the norm and the seconds of unscale_ + clip (what differs)."""
        model, forward, opt, _, scaler, clip, max_norm = steps[name]
        opt.zero_grad(set_to_none=True)
        loss = forward(x).float().square().mean()
        if name == BOUND:
            loss.backward()
            dist.all_reduce(flat)
            t = time.perf_counter()
            norm = torch.linalg.vector_norm(flat)  # the norm's one read; nothing to clip
            t = time.perf_counter() - t
            opt.step()
        elif scaler is None:
            loss.backward()
            t = time.perf_counter()
            norm = clip(model.parameters(), max_norm)
            t = time.perf_counter() - t
            opt.step()
        else:
            scaler.scale(loss).backward()
            t = time.perf_counter()
            scaler.unscale_(opt)
            norm = clip(model.parameters(), max_norm)
            t = time.perf_counter() - t
            scaler.step(opt)
            scaler.update()
        return float(norm), t

    times = {k: [] for k in VARIANTS}
    epilogue = {k: [] for k in VARIANTS}  # seconds of unscale_ + clip_grad_norm_
    norms = {k: [] for k in VARIANTS}
    for it in range(warmup + rounds):
        for name in VARIANTS:
            dist.barrier()
            t0 = time.perf_counter()
            norm, t_clip = run(name)
            dt = time.perf_counter() - t0
            if it >= warmup:
                times[name].append(dt)
                epilogue[name].append(t_clip)
                norms[name].append(norm > steps[name][6])
    if rank == 0:
        out = {
            "model": model_name,
            "params": sum(p.numel() for p in steps[VARIANTS[0]][0].parameters()),
            "tensors": len(list(steps[VARIANTS[0]][0].parameters())),
            "median_s": {k: statistics.median(v) for k, v in times.items()},
            "all_s": times,
            "clip_s": {k: statistics.median(v) for k, v in epilogue.items()},
            # how often clipping was active (the norm above max_norm): the multiply then runs
            "clipped": {k: sum(v) / len(v) for k, v in norms.items()},
        }
        with open(out_path, "w") as f:
            json.dump(out, f)
    close_worker(reducer for *_, reducer, _, _, _ in steps.values())


def _quartiles(xs: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(xs, n=4)
    return q[0], q[2]


def _paired_ratio(res: dict, v: str) -> tuple[float, float, float]:
    """Median and quartiles over rounds of ``v``'s step time over its baseline's step time in
    the same round (the two ran back to back, so a load swing hits both)."""
    ref = BASELINE[v]
    ratios = [a / b for a, b in zip(res["all_s"][v], res["all_s"][ref])]
    return (statistics.median(ratios), *_quartiles(ratios))


def table(results: list[dict], meta: dict) -> str:
    load0, load1 = meta["loadavg_start"][0], meta["loadavg_end"][0]
    lines = [f"Training step (forward, backward, clip_grad_norm_, AdamW), 2 gloo ranks x 1 "
             f"intra-op thread on a {meta['cpus']}-CPU {meta['machine']} machine, torch "
             f"{meta['torch']}; median of {meta['rounds']} rounds after {meta['warmup']} "
             f"warm-up, variants interleaved; 1-min load average {load0:.2f} at the start, "
             f"{load1:.2f} at the end. *vs baseline*: the median over rounds of the step time "
             f"over the baseline's in the same round, with its quartiles. *unscale_ + clip*: "
             f"the median time of those calls alone (what the variants change).", "",
             "| model | variant | step (ms) | quartiles (ms) | vs baseline | unscale_ + clip (ms) "
             "| clipping active |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for res in results:
        med = res["median_s"]
        for v in (v for v in VARIANTS if v in res["all_s"]):
            lo, hi = _quartiles(res["all_s"][v])
            if v in BASELINE:
                r, rlo, rhi = _paired_ratio(res, v)
                vs = f"{r:.2f}× ({rlo:.2f}–{rhi:.2f}) {BASELINE[v]}"
            else:
                vs = "baseline"
            lines.append(f"| {res['model']} ({res['tensors']} tensors, "
                         f"{res['params'] / 1e6:.1f} M params) | {v} | {med[v] * 1e3:.1f} | "
                         f"{lo * 1e3:.0f}–{hi * 1e3:.0f} | {vs} | {res['clip_s'][v] * 1e3:.2f} | "
                         f"{res['clipped'][v]:.0%} of steps |")
    lines.append("")
    verdicts = []
    for res in results:
        for (m, v), limit in TARGETS.items():
            if res["model"] == m:
                ratio = _paired_ratio(res, v)[0]
                verdicts.append(f"{m} {v} <= {limit:.2f}x {BASELINE[v]}: {ratio:.2f}x, "
                                f"{'met' if ratio <= limit else 'NOT met'}")
        if BOUND in res["all_s"]:
            verdicts.append(f"{res['model']} {BOUND} (the least a reducer can take here): "
                            f"{_paired_ratio(res, BOUND)[0]:.2f}x {BASELINE[BOUND]}")
    lines.append("Target: " + "; ".join(verdicts) + ".")
    return "\n".join(lines)


def plot(results: list[dict], path: pathlib.Path) -> None:
    colors = ["#d62728", "#aec7e8", "#1f77b4", "#7f7f7f", "#e377c2", "#08519c", "#ff9896",
              "#6baed6"]
    bar_plot(results, VARIANTS, colors, "{model}: backward + clip + AdamW, 2 gloo ranks", path)


def write(data: dict) -> str:
    md = table(data["results"], data["meta"])
    (RESULTS / f"{NAME}.md").write_text(md + "\n")
    plot(data["results"], RESULTS / f"{NAME}.png")
    return md


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="mlp,transformer")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--render", action="store_true",
                   help=f"re-make {NAME}.md and {NAME}.png from {NAME}.json without measuring")
    args = p.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.render:
        print(write(json.loads((RESULTS / f"{NAME}.json").read_text())))
        return
    loadavg = list(os.getloadavg())
    results = []
    for name in args.models.split(","):
        t0 = time.time()
        results.append(spawn_measure(_worker, RESULTS / f".{NAME}_{name}.json", name,
                                     args.rounds, args.warmup))
        print(f"{name}: done in {time.time() - t0:.0f}s", file=sys.stderr)
    meta = {"torch": torch.__version__, "machine": platform.machine(), "cpus": os.cpu_count(),
            "rounds": args.rounds, "warmup": args.warmup, "loadavg_start": loadavg,
            "loadavg_end": list(os.getloadavg())}
    data = {"meta": meta, "results": results}
    (RESULTS / f"{NAME}.json").write_text(json.dumps(data, indent=1))
    print(write(data))


if __name__ == "__main__":
    main()
