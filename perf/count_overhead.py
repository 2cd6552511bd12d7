"""Host cost per parameter in instructions, which machine load does not change.

One process under ``valgrind --tool=callgrind`` (instrumented only while measuring), a
gloo group of world size 1, one intra-op thread. For each model it runs K steps
(``zero_grad(set_to_none=True)``, forward, backward of ``sum(model(x)**2)``) of each
variant, variants interleaved, and counts the instructions executed (callgrind's ``Ir``;
the hardware counters of ``perf stat`` are not available on every VM). On CPU the autograd
engine runs backward on the calling thread, so the gradient hooks, DDP's C++ reducer and
tribucket's Python one all count:

* ``local``       no data parallelism
* ``no-op hook``  a Python post-accumulate-grad hook per parameter that does nothing: the
                  floor of any reducer that notices gradients from Python
* ``DDP``         ``DistributedDataParallel`` at world size 1: its C++ reducer still runs
                  (buckets, copies into them, the allreduce launch, copy-out or views)
* ``DDP view``    DDP with ``gradient_as_bucket_view=True`` (no copy back)
* ``tribucket``   ``tribucket.Reducer`` with its defaults

Every thread counts, gloo's included (at world size 1 its allreduce is a no-op). At world size 1 tribucket
sends its end-of-backward status on its own instead of in the last bucket's tail, and DDP
skips nothing; both still launch one collective per bucket. The figure per variant is the
median over rounds of (instructions per step - local's) / parameters. Instruction counts
barely vary between rounds, so one round of two steps is the default. The MLP of
``bench_overhead.py`` is not in the default models: its matrix multiplies take tens of
minutes under callgrind, and its 128 parameters make the per-parameter cost a small part of
its step anyway.

    python perf/count_overhead.py               # writes perf/results/overhead_instr.{json,md}
    python perf/count_overhead.py --models 2048 --rounds 3 --steps 5 --no-save
"""

from __future__ import annotations

import argparse
import ctypes
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _bench import free_port  # noqa: E402
from _results import save  # noqa: E402
from bench_overhead import STACKS, build_variant, make_model  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
VARIANTS = ["local", "no-op hook", "DDP", "DDP view", "tribucket"]


_REGIONS_C = r"""
#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_START_INSTRUMENTATION; }
void cg_zero(void) { CALLGRIND_ZERO_STATS; }
void cg_dump(const char *name) { CALLGRIND_DUMP_STATS_AT(name); }
"""


class Regions:
    """Callgrind client requests from Python (a three-function C library built here with
    the system compiler): start instrumenting, zero the counters, dump them under a name.
    Outside valgrind they do nothing."""

    def __init__(self, workdir: pathlib.Path):
        src, lib = workdir / "cg_regions.c", workdir / "cg_regions.so"
        src.write_text(_REGIONS_C)
        subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
        self._lib = ctypes.CDLL(str(lib))

    def start(self) -> None:
        self._lib.cg_start()

    def zero(self) -> None:
        self._lib.cg_zero()

    def dump(self, name: str) -> None:
        self._lib.cg_dump(name.encode())


def read_dumps(out_prefix: pathlib.Path) -> list[tuple[str, int]]:
    """(region name, instructions) of each callgrind dump, in dump order."""
    found = []
    for f in out_prefix.parent.glob(out_prefix.name + ".*"):
        text = f.read_text(errors="replace")
        trig = re.search(r"^desc: Trigger: Client Request: (.*)$", text, re.M)
        tot = re.search(r"^(?:totals|summary): (\d+)", text, re.M)
        part = re.search(r"^part: (\d+)", text, re.M)
        if trig and tot:
            found.append((int(part.group(1)) if part else 0, trig.group(1), int(tot.group(1))))
    return [(name, n) for _, name, n in sorted(found)]


def run_child(models: list[str], rounds: int, steps: int, warmup: int,
              regions: Regions) -> None:
    """Under callgrind: warm every variant up uninstrumented, then dump one region per
    (model, variant, round) of ``steps`` steps."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    started = False
    for model_name in models:
        built = {name: build_variant(name, model_name) for name in VARIANTS}

        def step(name):
            model, forward, x, _ = built[name]
            model.zero_grad(set_to_none=True)
            forward(x).square().sum().backward()

        for _ in range(warmup):  # the first iterations rebuild buckets (DDP and tribucket)
            for name in VARIANTS:
                step(name)
        if not started:
            regions.start()
            started = True
        for r in range(rounds):
            for name in VARIANTS:
                regions.zero()
                for _ in range(steps):
                    step(name)
                regions.dump(f"{model_name}|{name}|{r}")
        for *_, closer in built.values():
            if closer is not None:
                closer.close()
    dist.destroy_process_group()


def measure(models: list[str], rounds: int, steps: int, warmup: int) -> list[dict]:
    """Run the child under callgrind; per model, instructions per step and per parameter."""
    with tempfile.TemporaryDirectory() as tmp:
        prefix = pathlib.Path(tmp) / "cg.out"
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
               f"--callgrind-out-file={prefix}", sys.executable, __file__, "--child",
               "--models", ",".join(models), "--rounds", str(rounds), "--steps", str(steps),
               "--warmup", str(warmup), "--workdir", tmp]
        subprocess.run(cmd, check=True, stderr=subprocess.DEVNULL)
        dumps = read_dumps(prefix)
    per: dict = {}
    for name, n in dumps:
        model, variant, _ = name.split("|")
        per.setdefault(model, {}).setdefault(variant, []).append(n / steps)
    results = []
    for model in models:
        counts = per[model]
        n = sum(1 for _ in make_model(model)[0].parameters())
        results.append({
            "model": model, "tensors": n,
            "instructions_per_step": {k: statistics.median(v) for k, v in counts.items()},
            "per_param": {k: statistics.median((c - l) / n for c, l in
                                               zip(counts[k], counts["local"]))
                          for k in VARIANTS if k != "local"}})
    return results


def table(res: dict) -> str:
    m = res["meta"]
    lines = [f"Instructions executed per step (callgrind) (`zero_grad`, forward, "
             f"backward of `sum(model(x)**2)`), one process, gloo world size 1, 1 intra-op "
             f"thread, torch {m['torch']}; median of {m['rounds']} rounds of {m['steps']} "
             f"steps after {m['warmup']} warm-up, variants interleaved. Instruction counts "
             f"do not depend on machine load (1-min load {m['loadavg'][0]:.1f} during the "
             f"run).", "",
             "| model | tensors | local (M instr / step) | instructions per parameter over "
             "local: no-op hook | DDP | DDP view | tribucket | tribucket / DDP (per parameter) "
             "| tribucket / DDP view |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in res["results"]:
        pp = r["per_param"]
        if r["model"] == "mlp":
            what = "MLP 64 x Linear(256)"
        else:
            blocks, w = STACKS[int(r["model"])]
            what = f"{blocks} x (Linear {w} + LayerNorm {w})"
        view, ratio = ((f"{pp['DDP view']:,.0f}", f"{pp['tribucket'] / pp['DDP view']:.2f}x")
                       if "DDP view" in pp else ("not measured", ""))
        lines.append(f"| {what} | {r['tensors']} | "
                     f"{r['instructions_per_step']['local'] / 1e6:.1f} | "
                     f"{pp['no-op hook']:,.0f} | {pp['DDP']:,.0f} | {view} | "
                     f"**{pp['tribucket']:,.0f}** | {pp['tribucket'] / pp['DDP']:.2f}x | "
                     f"{ratio} |")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = [r["model"] for r in res["results"]]
    for i, v in enumerate(VARIANTS[1:]):
        ax.bar([j + 0.2 * (i - 1.5) for j in range(len(names))],
               [r["per_param"].get(v, 0) for r in res["results"]], width=0.2, label=v)
    ax.set_xticks(range(len(names)), [f"{n} ({r['tensors']} tensors)" if n == "mlp" else n
                                      for n, r in zip(names, res["results"])])
    ax.set_xlabel("model (parameters)")
    ax.set_ylabel("instructions per parameter over local")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="512,2048")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    models = args.models.split(",")
    if args.child:
        run_child(models, args.rounds, args.steps, args.warmup,
                  Regions(pathlib.Path(args.workdir)))
        return
    load0 = os.getloadavg()
    results = measure(models, args.rounds, args.steps, args.warmup)
    res = {"meta": {"torch": torch.__version__, "rounds": args.rounds, "steps": args.steps,
                    "warmup": args.warmup, "loadavg": load0, "loadavg_end": os.getloadavg()},
           "results": results}
    if args.no_save:
        print(table(res))
    else:
        save(RESULTS, "overhead_instr", res, table, plot)


if __name__ == "__main__":
    main()
