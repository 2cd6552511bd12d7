"""Host cost per parameter: tribucket against torch DDP on models of many small tensors.

Two gloo ranks (one intra-op thread each) run ``zero_grad``, forward and backward of
``sum(model(x)**2)`` with, in one run, round-robin (one step of each per round, so drift
in machine load hits all alike):

* ``local``          no data parallelism (the floor of the step)
* ``no-op hook``     local plus a Python post-accumulate-grad hook per parameter that
                     does nothing: the least any Python reducer pays per parameter
* ``counting hook``  local plus a hook per parameter that counts down a per-bucket counter
* ``DDP``            ``DistributedDataParallel``, default options
* ``DDP view``       DDP with ``gradient_as_bucket_view=True``
* ``tribucket``      ``tribucket.Reducer`` with its defaults

Besides the wall clock, each step's CPU time of the rank's main thread (the one that runs
autograd and the hooks) is recorded: it counts the host work alone, not the time the
thread waits for communication or is preempted by the communication threads.

Models: stacks of ``Linear(w, w) + LayerNorm(w)`` blocks (4 tensors per block) from 128 to
2048 parameters, and the 128-tensor MLP of ``bench_step.py``. The figure is the median over
rounds after warm-up of rank 0's step, then the median over ``--repeats`` runs of fresh
ranks (3: where the OS places the ranks moves a whole run); the host cost per parameter is
``(step - local step) / parameters``.

    python perf/bench_overhead.py               # writes perf/results/overhead.{json,md,png}
    python perf/bench_overhead.py --rounds 20 --models 512,2048
    python perf/bench_overhead.py --render      # re-make .md/.png from the JSON
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

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _bench import init_worker, round_robin, spawn  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
VARIANTS = ["local", "no-op hook", "counting hook", "DDP", "DDP view", "tribucket"]
#: parameter count -> (blocks, width) of the Linear+LayerNorm stacks
STACKS = {128: (32, 64), 512: (128, 64), 1024: (256, 32), 2048: (512, 32)}
#: the issue's targets: tribucket's step over the reference's, at most
TARGETS = {("512", "DDP"): 0.90, ("2048", "DDP"): 0.90, ("mlp", "DDP view"): 1.00}


def make_model(name: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if name == "mlp":
        return nn.Sequential(*[nn.Linear(256, 256) for _ in range(64)]), torch.randn(64, 256)
    blocks, width = STACKS[int(name)]
    layers = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.LayerNorm(width)]
    return nn.Sequential(*layers), torch.randn(8, width)


def _add_hooks(model: nn.Module, counting: bool) -> None:
    params = list(model.parameters())
    if not counting:
        for p in params:
            p.register_post_accumulate_grad_hook(lambda p: None)
        return
    left = [len(params)]  # one bucket: count down, reset when it reaches zero

    def count(p):
        left[0] -= 1
        if left[0] == 0:
            left[0] = len(params)

    for p in params:
        p.register_post_accumulate_grad_hook(count)


def build_variant(name: str, model_name: str) -> tuple:
    """``(model, what to call forward on, input, reducer or None)`` of one variant."""
    import tribucket

    model, x = make_model(model_name)
    forward, closer = model, None
    if name in ("no-op hook", "counting hook"):
        _add_hooks(model, counting=name == "counting hook")
    elif name.startswith("DDP"):
        forward = nn.parallel.DistributedDataParallel(
            model, gradient_as_bucket_view=name == "DDP view")
    elif name == "tribucket":
        closer = tribucket.Reducer(model)
    return model, forward, x, closer


def _worker(rank: int, world: int, port: int, model_name: str, rounds: int, warmup: int,
            out_path: str) -> None:
    init_worker(rank, world, port)
    steps = {}
    for name in VARIANTS:
        steps[name] = build_variant(name, model_name)

    def run(name):
        model, forward, x, _ = steps[name]
        model.zero_grad(set_to_none=True)
        forward(x).square().sum().backward()

    # wall clock of each step, and the CPU time of this rank's main (autograd) thread in it:
    # the host work itself, without the time the thread waits or is preempted
    thread_s: dict[str, list[float]] = {k: [] for k in VARIANTS}

    def timed(name):
        t0 = time.thread_time()
        run(name)
        thread_s[name].append(time.thread_time() - t0)

    times = round_robin(timed, VARIANTS, rounds, warmup)
    if rank == 0:
        model = steps["local"][0]
        out = {"model": model_name, "tensors": len(list(model.parameters())),
               "elements": sum(p.numel() for p in model.parameters()),
               "median_s": {k: statistics.median(v) for k, v in times.items()},
               "thread_median_s": {k: statistics.median(v[warmup:])
                                   for k, v in thread_s.items()},
               "all_s": times}
        with open(out_path, "w") as f:
            json.dump(out, f)
    for *_, closer in steps.values():
        if closer is not None:
            closer.close()
    dist.barrier()
    dist.destroy_process_group()


def measure(model_name: str, rounds: int, warmup: int, world: int = 2,
            repeats: int = 1) -> dict:
    """One model's figures: the median over ``repeats`` fresh sets of ranks of each set's
    median (where the OS places two ranks and their communication threads on two CPUs
    shifts a whole run: the spread between runs is larger than within one)."""
    runs = [spawn(_worker, (model_name, rounds, warmup), world,
                  RESULTS / f".overhead_{model_name}.json") for _ in range(repeats)]
    out = dict(runs[0])
    for key in ("median_s", "thread_median_s"):
        out[key] = {k: statistics.median(r[key][k] for r in runs) for k in runs[0][key]}
    out["repeat_median_s"] = [r["median_s"] for r in runs]
    out["all_s"] = {k: [x for r in runs for x in r["all_s"][k]] for k in runs[0]["all_s"]}
    return out


def per_param_us(res: dict, variant: str, key: str = "median_s") -> float:
    med = res[key]
    return (med[variant] - med["local"]) / res["tensors"] * 1e6


def _repeats(meta: dict) -> str:
    n = meta.get("repeats", 1)
    return (f", then the median over {n} runs (fresh ranks each)" if n > 1 else "")


def table(results: list[dict], meta: dict) -> str:
    load = meta["loadavg"]
    lines = [f"Host cost per parameter: `zero_grad` + forward + backward of `sum(model(x)**2)`, "
             f"2 gloo ranks x 1 intra-op thread on a {meta['cpus']}-CPU {meta['machine']} "
             f"machine, torch {meta['torch']}; median of {meta['rounds']} rounds after "
             f"{meta['warmup']} warm-up, variants interleaved (every other round in reverse "
             f"order){_repeats(meta)}; 1-min load "
             f"average {load[0]:.2f} at the start, {meta['loadavg_end'][0]:.2f} at the end.", "",
             "| model | tensors | local (ms) | no-op hook | DDP | DDP view | tribucket | "
             "tribucket / DDP | tribucket / DDP view | us per parameter over local: "
             "no-op hook / counting hook / DDP / tribucket | main-thread CPU us per "
             "parameter over local: DDP / DDP view / tribucket |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for res in results:
        med = {k: v * 1e3 for k, v in res["median_s"].items()}
        what = ("MLP 64 x Linear(256)" if res["model"] == "mlp" else
                "{} x (Linear {w} + LayerNorm {w})".format(*STACKS[int(res["model"])],
                                                           w=STACKS[int(res["model"])][1]))
        us = " / ".join(f"{per_param_us(res, v):.1f}"
                        for v in ("no-op hook", "counting hook", "DDP", "tribucket"))
        cpu = (" / ".join(f"{per_param_us(res, v, 'thread_median_s'):.1f}"
                          for v in ("DDP", "DDP view", "tribucket"))
               if "thread_median_s" in res else "not measured")
        lines.append(f"| {what} | {res['tensors']} | {med['local']:.1f} | "
                     f"{med['no-op hook']:.1f} | {med['DDP']:.1f} | {med['DDP view']:.1f} | "
                     f"**{med['tribucket']:.1f}** | {med['tribucket'] / med['DDP']:.2f}x | "
                     f"{med['tribucket'] / med['DDP view']:.2f}x | {us} | {cpu} |")
    verdicts = []
    for res in results:
        for (model, ref), limit in TARGETS.items():
            if res["model"] == model:
                ratio = res["median_s"]["tribucket"] / res["median_s"][ref]
                verdicts.append(f"{model}: tribucket <= {limit:.2f}x {ref}: {ratio:.2f}x, "
                                f"{'met' if ratio <= limit else 'NOT met'}")
    lines += ["", "Targets: " + "; ".join(verdicts) + "."]
    return "\n".join(lines)


def plot(results: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stacks = sorted((r for r in results if r["model"] != "mlp"), key=lambda r: r["tensors"])
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for variant, style in (("DDP", "s-"), ("DDP view", "s--"), ("tribucket", "o-"),
                           ("counting hook", "^:"), ("no-op hook", "v:")):
        ax.plot([r["tensors"] for r in stacks], [per_param_us(r, variant) for r in stacks],
                style, label=variant)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("parameters (tensors) in the model: Linear + LayerNorm stacks")
    ax.set_ylabel("host us per parameter over local (median)")
    ax.set_ylim(bottom=0)
    ax.set_title("Per-parameter host cost, 2 gloo ranks x 1 thread")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def render(data: dict) -> str:
    md = table(data["results"], data["meta"])
    (RESULTS / "overhead.md").write_text(md + "\n")
    plot(data["results"], RESULTS / "overhead.png")
    return md


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="128,512,1024,2048,mlp")
    p.add_argument("--rounds", type=int, default=25)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3,
                   help="fresh sets of ranks per model; figures are the median of their medians")
    p.add_argument("--render", action="store_true",
                   help="re-make overhead.md and overhead.png from overhead.json")
    p.add_argument("--out", default="overhead", help="results name (perf/results/NAME.json)")
    args = p.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.render:
        print(render(json.loads((RESULTS / "overhead.json").read_text())))
        return
    loadavg = list(os.getloadavg())
    results = []
    for name in args.models.split(","):
        t0 = time.time()
        results.append(measure(name, args.rounds, args.warmup, repeats=args.repeats))
        print(f"{name}: done in {time.time() - t0:.0f}s", file=sys.stderr)
    meta = {"torch": torch.__version__, "machine": platform.machine(), "cpus": os.cpu_count(),
            "rounds": args.rounds, "warmup": args.warmup, "repeats": args.repeats,
            "loadavg": loadavg,
            "loadavg_end": list(os.getloadavg())}
    data = {"meta": meta, "results": results}
    if args.out != "overhead":  # a scratch run: JSON only
        (RESULTS / f"{args.out}.json").write_text(json.dumps(data, indent=1))
        print(table(results, meta))
        return
    (RESULTS / "overhead.json").write_text(json.dumps(data, indent=1))
    print(render(data))


if __name__ == "__main__":
    main()
