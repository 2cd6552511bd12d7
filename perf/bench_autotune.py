"""``bucket_cap_mb="auto"`` against fixed caps: step time on gloo CPU processes, one run.

Two ranks (one intra-op thread each) train the same model on the same data with:

* ``cap <N>``         ``fused_bucketing(bucket_cap_mb=N)`` for N in 1, 2, 5, 10, 50, 100 MiB
* ``default``         no options: 25 MiB buckets, on the CPU a first bucket as large
* ``default first 1``  ``first_bucket_cap_mb=1``: DDP's small first bucket (the GPU default)
* ``auto``            ``bucket_cap_mb="auto"``
* ``auto both``       ``bucket_cap_mb="auto", first_bucket_cap_mb="auto"``

The "auto" variants first train alone until their tuning is done (the steps it took are
reported); then every variant runs round-robin, one step each per round, so drift in
machine load hits all alike, every other round in reverse order (a variant's step can be
faster or slower for the one run before it: each variant's mean position is the same). The
figure is the median over rounds of rank 0's step time
(zero_grad + forward + backward + SGD step). Models: ``perf/bench_step.py``'s MLP and
transformer, and ``small``: 2048 parameter tensors of 64 floats (host cost per parameter).

Then a confirmation run per model: fresh processes (the auto variants tune again), only the
best fixed variant of the sweep, the best variant of the best fixed layout (when another),
the default and the two auto variants, for as many rounds as ``--confirm-s`` seconds allow. On this machine one step's time varies by about 10% from
round to round, so the sweep's 25 rounds cannot tell 1.02x from 1.00x; the confirmation
pairs auto's step with the best fixed one's in each of hundreds of rounds and gives the
median ratio with a 95% bootstrap interval. The best is picked on the sweep and judged on
the confirmation's own rounds, so its time is not flattered by having been picked.

    python perf/bench_autotune.py                 # writes perf/results/autotune.{json,md,png}
    python perf/bench_autotune.py --rounds 5 --confirm-s 0   # quicker, no confirmation
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import random
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import (bar_plot, close_worker, init_worker, round_robin,  # noqa: E402
                    spawn_measure)
from bench_step import make_model as step_model  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
FIXED = {"cap 1": 1, "cap 2": 2, "cap 5": 5, "cap 10": 10, "cap 50": 50, "cap 100": 100}
VARIANTS = list(FIXED) + ["default", "default first 1", "auto", "auto both"]
OPTIONS = {**{k: dict(bucket_cap_mb=v) for k, v in FIXED.items()},
           "default": {}, "default first 1": dict(first_bucket_cap_mb=1),
           "auto": dict(bucket_cap_mb="auto"),
           "auto both": dict(bucket_cap_mb="auto", first_bucket_cap_mb="auto")}


class _Small(nn.Module):
    """2048 parameter tensors of 64 floats: the host cost per parameter dominates."""

    def __init__(self):
        super().__init__()
        self.w = nn.ParameterList(nn.Parameter(torch.randn(64) * 0.1) for _ in range(2048))

    def forward(self, x):
        for w in self.w:
            x = x + w
        return x


def make_model(name: str):
    if name == "small":
        torch.manual_seed(0)
        return _Small(), torch.randn(8, 64)
    return step_model(name)


def _worker(rank: int, world: int, port: int, model_name: str, rounds: int, warmup: int,
            out_path: str, variants: list) -> None:
    init_worker(rank, world, port)
    import tribucket

    steps = {}
    for name in variants:
        model, x = make_model(model_name)
        reducer = tribucket.Reducer(model, **OPTIONS[name])
        steps[name] = (model, x, torch.optim.SGD(model.parameters(), lr=1e-4), reducer)

    def run(name):
        model, x, opt, _ = steps[name]
        opt.zero_grad(set_to_none=True)
        model(x).float().square().mean().backward()
        opt.step()

    tuning = {}
    for name in [v for v in ("auto", "auto both") if v in steps]:
        tuner, t0, n = steps[name][3]._bw.tuner, time.perf_counter(), 0
        while not tuner.done:
            run(name)
            n += 1
        tuning[name] = dict(steps=n, seconds=time.perf_counter() - t0,
                            **steps[name][3].logging_data())
    times = round_robin(run, variants, rounds, warmup)
    if rank == 0:
        model = steps[variants[0]][0]
        out = {
            "model": model_name,
            "params": sum(p.numel() for p in model.parameters()),
            "tensors": len(list(model.parameters())),
            "grad_mib": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
            "median_s": {k: statistics.median(v) for k, v in times.items()},
            "all_s": times,
            "buckets": {k: steps[k][3].stats.buckets for k in variants},
            # each variant's buckets (parameter indices), compact: what by_layout compares
            "layouts": {k: json.dumps(steps[k][3]._bw.layout.bucket_indices(),
                                      separators=(",", ":")) for k in variants},
            "tuning": tuning,
        }
        with open(out_path, "w") as f:
            json.dump(out, f)
    close_worker(r for *_, r in steps.values())


def measure(model_name: str, rounds: int, warmup: int, variants: list = VARIANTS) -> dict:
    return spawn_measure(_worker, RESULTS / f".autotune_{model_name}.json", model_name,
                         rounds, warmup, 2, list(variants))


def confirm(res: dict, seconds: float, warmup: int) -> dict:
    """The confirmation run of one model (see the module's docstring)."""
    variants, best, best_layout = confirm_variants(res)
    per_round = sum(res["median_s"][v] for v in variants)
    rounds = max(50, min(600, int(seconds / per_round)))
    c = measure(res["model"], rounds, warmup, variants)
    autos = ("auto", "auto both")
    return dict(best=best, best_layout=best_layout, rounds=rounds, variants=variants,
                median_s=c["median_s"], all_s=c["all_s"], tuning=c["tuning"],
                buckets=c["buckets"],
                same_buckets={v: [w for w in variants if w != v and c["layouts"][w] == c["layouts"][v]]
                              for v in autos},
                vs_best={v: paired_ratio(c["all_s"], v, best) for v in autos},
                vs_best_layout={v: paired_ratio(c["all_s"], v, best_layout) for v in autos},
                vs_default={v: paired_ratio(c["all_s"], v, "default") for v in autos})


def confirm_variants(res: dict) -> tuple[list[str], str, str]:
    """``(variants, best, best layout)``: the best fixed variant of the sweep (its own median
    step), the fastest variant of the best fixed layout (:func:`verdicts`; often the same),
    the default and the autos."""
    fixed = [v for v in VARIANTS if not v.startswith("auto")]
    best = min(fixed, key=res["median_s"].__getitem__)
    ver = verdicts(res)
    best_layout = min(ver["best_variants"], key=res["median_s"].__getitem__)
    return list(dict.fromkeys([best, best_layout, "default", "auto", "auto both"])), best, \
        best_layout


def paired_ratio(all_s: dict, mine: str, other: str, seed: int = 0) -> dict:
    """``mine``'s step over ``other``'s in the same round: the median over rounds and its 95%
    bootstrap interval (the rounds resampled 2000 times)."""
    r = [a / b for a, b in zip(all_s[mine], all_s[other])]
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(r, k=len(r))) for _ in range(2000))
    return dict(median=statistics.median(r), lo=meds[49], hi=meds[1950], rounds=len(r))


def by_layout(res: dict) -> dict:
    """Variants with the same buckets are one configuration measured several times: their
    steps are pooled per round (mean over the variants). Each round is then divided by its
    mean over the layouts (drift in machine load cancels), and a layout's score is the median
    of that over rounds. ``{"of": variant -> layout letter, "median_s": letter -> median
    pooled step (s), "score": letter -> median relative step, "spread": the largest gap
    between two variants of one layout (their medians, max/min - 1): the run's noise
    floor}``."""
    letters, of = {}, {}
    for v in VARIANTS:
        key = repr(res["layouts"][v])
        of[v] = letters.setdefault(key, "ABCDEFGHIJKLMNOP"[len(letters)])
    rounds_s = {}
    for letter in sorted(set(of.values())):
        members = [v for v in VARIANTS if of[v] == letter]
        rounds_s[letter] = [statistics.fmean(r) for r in zip(*(res["all_s"][v] for v in members))]
    round_mean = [statistics.fmean(r) for r in zip(*rounds_s.values())]
    rel = {k: [a / m for a, m in zip(v, round_mean)] for k, v in rounds_s.items()}
    score = {k: statistics.median(v) for k, v in rel.items()}
    spread = max((max(res["median_s"][v] for v in VARIANTS if of[v] == letter)
                  / min(res["median_s"][v] for v in VARIANTS if of[v] == letter) - 1
                  for letter in rounds_s), default=0.0)
    return dict(of=of, median_s={k: statistics.median(v) for k, v in rounds_s.items()},
                score=score, spread=spread, rel=rel)


def held_out(rel: dict, mine: str, fixed: set) -> float:
    """``mine`` against the best fixed layout, without the winner's curse: the best is picked
    on one half of the rounds and judged on the other (each round's ratio, the median), then
    the other way round; the mean of the two. (Picked and judged on the same rounds, the best
    of several noisy layouts looks better than it is, and every ratio against it worse.) The
    halves take the rounds two by two (0 1, 4 5, ... and 2 3, 6 7, ...), so each holds as many
    rounds in the reversed order as in the first."""
    n = len(next(iter(rel.values())))
    halves = [[i for i in range(n) if i // 2 % 2 == h] for h in (0, 1)]
    out = []
    for pick, judge in (halves, halves[::-1]):
        best = min(fixed, key=lambda k: (statistics.median(rel[k][i] for i in pick), k))
        out.append(statistics.median(rel[mine][i] / rel[best][i] for i in judge))
    return statistics.fmean(out)


def verdicts(res: dict) -> dict:
    """auto against the best fixed cap and the default, by layout (pooled, per round)."""
    lay = by_layout(res)
    fixed = [v for v in VARIANTS if not v.startswith("auto")]
    best = min({lay["of"][v] for v in fixed}, key=lambda k: (lay["score"][k], k))
    out = dict(best_layout=best, best_variants=[v for v in fixed if lay["of"][v] == best],
               noise_floor=lay["spread"], layout_of=lay["of"])
    sc = lay["score"]
    for v in ("auto", "auto both"):
        mine = lay["of"][v]
        out[v] = dict(layout=mine, vs_best=sc[mine] / sc[best],
                      vs_best_held_out=held_out(lay["rel"], mine, {lay["of"][f] for f in fixed}),
                      vs_default=sc[mine] / sc[lay["of"]["default"]],
                      same_layout_as_best=mine == best)
    return out


def table(results: list[dict], meta: dict) -> str:
    load = meta["loadavg"]
    lines = [f"Training step (forward, backward, SGD), 2 gloo ranks x 1 intra-op thread on a "
             f"{meta['cpus']}-CPU {meta['machine']} machine, torch {meta['torch']}; median of "
             f"{meta['rounds']} rounds after {meta['warmup']} warm-up, variants interleaved "
             f"({'every other round in reverse order; ' if meta.get('alternate') else ''}"
             f"the auto variants tuned first); 1-min load average {load[0]:.2f} at the start, "
             f"{meta['load_end'][0]:.2f} at the end. Layout: variants with the same letter have "
             f"the same buckets; by layout: their steps pooled per round (layout (ms): the median "
             f"over rounds); layout vs best: each round divided by its mean over the layouts, "
             f"the median over rounds, against the best layout of a fixed cap.", "",
             "| model | variant | step (ms) | vs best fixed | vs default | buckets | layout | "
             "layout (ms) | layout vs best |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    notes = []
    for res in results:
        med = res["median_s"]
        fixed = [v for v in VARIANTS if not v.startswith("auto")]
        best_v = min(fixed, key=med.__getitem__)
        label = f"{res['model']} ({res['tensors']} tensors, {res['grad_mib']:.1f} MiB)"
        if "layouts" not in res:  # a run from before the layouts were recorded
            lay, ver = None, None
        else:
            lay, ver = by_layout(res), verdicts(res)
        for v in VARIANTS:
            row = (f"| {label} | {v} | {med[v] * 1e3:.1f} | {med[v] / med[best_v]:.2f}× | "
                   f"{med[v] / med['default']:.2f}× | {res['buckets'][v]} |")
            if lay is None:
                row += " - | - | - |"
            else:
                letter = lay["of"][v]
                row += (f" {letter} | {lay['median_s'][letter] * 1e3:.1f} | "
                        f"{lay['score'][letter] / lay['score'][ver['best_layout']]:.2f}× |")
            lines.append(row)
        for v in ("auto", "auto both"):
            t = res["tuning"][v]
            head = f"{res['model']} {v}: "
            if ver is not None:
                a = ver[v]
                head += (f"layout {a['layout']}, {a['vs_best']:.2f}x the best layout of a fixed "
                         f"cap ({ver['best_layout']}: {', '.join(ver['best_variants'])}), "
                         f"{a['vs_best_held_out']:.2f}x the best picked on the other half of "
                         f"the rounds (held out), {a['vs_default']:.2f}x the default's (by "
                         f"layout); ")
            notes.append(
                head + f"as its own variant {med[v] / med[best_v]:.2f}x the best fixed "
                f"({best_v}) and {med[v] / med['default']:.2f}x the default; tuned in "
                f"{t['steps']} steps ({t['seconds']:.1f} s), candidates (cap/first MiB) "
                f"{t['autotune_candidates_mb']}, median step ns (max over ranks) "
                f"{t['autotune_median_step_ns']}, chose {t['autotune_bucket_cap_mb']}/"
                f"{t['autotune_first_bucket_cap_mb']} MiB")
        if ver is not None:
            notes.append(f"{res['model']}: noise floor of this run {ver['noise_floor'] * 100:.1f}% "
                         f"(the largest gap between two variants with the same buckets)")
    lines += ["", "Tuning:", ""] + [f"- {n}" for n in notes]
    confirmed = [res for res in results if "confirm" in res]
    if confirmed:
        lines += ["", "Confirmation (fresh processes; the best fixed variant of the sweep, the "
                  "best variant of its best fixed layout, the default and the auto variants, "
                  "tuned again, interleaved, every other round in reverse order; per round "
                  "auto's step over the other's, the median over rounds [95% bootstrap "
                  "interval]):", "",
                  "| model | variant | rounds | chose (cap/first MiB) | same buckets as | vs best "
                  "fixed of the sweep | vs best fixed layout of the sweep | vs default | "
                  "step (ms) |",
                  "| --- | --- | ---: | --- | --- | --- | --- | --- | ---: |"]
        ratio = lambda r: f"{r['median']:.3f}× [{r['lo']:.3f}-{r['hi']:.3f}]"  # noqa: E731
        for res in confirmed:
            c = res["confirm"]
            for v in ("auto", "auto both"):
                t = c["tuning"][v]
                lines.append(
                    f"| {res['model']} | {v} | {c['rounds']} | "
                    f"{t['autotune_bucket_cap_mb']}/{t['autotune_first_bucket_cap_mb']} | "
                    f"{', '.join(c['same_buckets'][v]) or '-'} | "
                    f"{ratio(c['vs_best'][v])} ({c['best']}) | "
                    f"{ratio(c['vs_best_layout'][v])} ({c['best_layout']}) | "
                    f"{ratio(c['vs_default'][v])} | {c['median_s'][v] * 1e3:.1f} |")
    return "\n".join(lines)


def plot(results: list[dict], path: pathlib.Path) -> None:
    colors = ["#c6dbef"] * len(FIXED) + ["#1f77b4", "#6baed6", "#d62728", "#ff9896"]
    bar_plot(results, VARIANTS, colors, "{model}: 2 gloo ranks, 1 thread each", path)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="mlp,transformer,small")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--confirm-s", type=float, default=300.0,
                   help="seconds of confirmation rounds per model (0: none)")
    p.add_argument("--render", action="store_true",
                   help="re-make autotune.md and .png from autotune.json without measuring")
    args = p.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.render:
        data = json.loads((RESULTS / "autotune.json").read_text())
    else:
        loadavg = list(os.getloadavg())
        results = []
        for name in args.models.split(","):
            t0 = time.time()
            res = measure(name, args.rounds, args.warmup)
            print(f"{name}: {time.time() - t0:.0f}s", file=sys.stderr)
            if args.confirm_s > 0:
                res["confirm"] = confirm(res, args.confirm_s, args.warmup)
                print(f"{name} confirmed: {time.time() - t0:.0f}s", file=sys.stderr)
            results.append(res)
        meta = {"torch": torch.__version__, "machine": platform.machine(),
                "cpus": os.cpu_count(), "rounds": args.rounds, "warmup": args.warmup,
                "confirm_s": args.confirm_s, "alternate": True,
                "loadavg": loadavg, "load_end": list(os.getloadavg())}
        data = {"meta": meta, "results": results}
        (RESULTS / "autotune.json").write_text(json.dumps(data, indent=1))
    md = table(data["results"], data["meta"])
    (RESULTS / "autotune.md").write_text(md + "\n")
    plot(data["results"], RESULTS / "autotune.png")
    print(md)


if __name__ == "__main__":
    main()
