"""Pack/unpack bandwidth: tribucket against what a user would otherwise write, in one run.

Buckets (fp32 gradients):

* ``128 tensors, 25 MiB``: 64 (weight ``(r, 256)``, bias ``(r,)``) pairs, r drawn log-normal,
  laid out by ``tribucket.compute_layout`` (16-byte aligned: odd r leave gaps);
* ``1000 x 1K (1-D)``: 1 000 vectors of 1 024 elements (biases, norm weights);
* ``1000 x 32x32 (2-D)``: the same bytes as 1 000 small matrices;
* ``1 tensor, 25 MiB``.

Operations: pack with scale 1 (a copy), pack with scale 1/2 (DDP's ``grad / world``), pack
into float16 with scale 1/2 (fp16 compression), pack into float16 with scale 1/2 and
``found_inf``, unpack (copy back) and unpack from float16 (decompress into fp32).

Baselines, written as a user would: a per-tensor ``torch.mul(g, scale, out=view)`` loop
(what DDP's reducer does for every gradient), a per-tensor ``copy_`` loop,
``torch._utils._flatten_dense_tensors`` and ``torch.cat`` (both allocate a new buffer); for
unpack: per-tensor ``copy_``, ``torch._foreach_copy_`` and ``_unflatten_dense_tensors`` +
``copy_``. The limit is ``dst.copy_(src)`` of one float32 tensor with the bucket's element
count, measured in the same rounds.

Every variant runs once per round, round-robin, so drifting machine load hits all alike; a
figure is the median over rounds of the calling thread's CPU time with 1 intra-op thread
(this 2-core machine is shared: wall-clock time counts the minutes other jobs hold the
cores; the wall-clock medians are kept in the JSON) and of the wall clock with 2. GB/s = (bytes read + bytes written) / time, with
read = elements x source element size and written = elements x destination element size.
"x limit" = limit time / variant time.

    python perf/bench_pack.py                 # CPU: 1 thread (the table) and 2 threads
    python perf/bench_pack.py --rounds 9      # quicker
    python perf/update_readme.py pack         # copy perf/results/pack.md into docs/benchmarks.md

On a CUDA machine it also times the Triton kernels with ``triton.testing.do_bench``.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import platform
import random
import statistics
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "perf" / "results"
sys.path.insert(0, str(ROOT))

import tribucket  # noqa: E402
from _results import save  # noqa: E402  (perf/, the script's directory)
from tribucket import kernels  # noqa: E402

F32, F16 = torch.float32, torch.float16
TARGET_LIMIT_FRACTION = 0.80   # 128-tensor bucket copy vs the copy_ limit
TARGET_TINY_SPEEDUP = 3.0      # 1000 x 1K, scale 1/2, vs the mul(out=) loop
TARGET_FP16_RATIO = 1.10       # fp32 -> fp16 with scale vs a plain fp32 copy


# -- buckets ---------------------------------------------------------------------------------
def bucket_shapes(name: str) -> list[tuple[int, ...]]:
    if name == "128 tensors, 25 MiB":
        rng = random.Random(0)
        w = [rng.lognormvariate(0, 1) for _ in range(64)]
        rows = [max(1, round(x / sum(w) * (25 * 2**20 // 4) / 257)) for x in w]
        return [s for r in rows for s in ((r, 256), (r,))]
    if name == "1000 x 1K (1-D)":
        return [(1024,)] * 1000
    if name == "1000 x 32x32 (2-D)":
        return [(32, 32)] * 1000
    if name == "1 tensor, 25 MiB":
        return [(25 * 2**20 // 4,)]
    raise ValueError(name)


CASES = ["128 tensors, 25 MiB", "1000 x 1K (1-D)", "1000 x 32x32 (2-D)", "1 tensor, 25 MiB"]


class Bucket:
    """Gradients, their layout (from tribucket.compute_layout) and buffers."""

    def __init__(self, name: str, device: str):
        shapes = bucket_shapes(name)
        specs = [tribucket.TensorSpec(s, F32, device) for s in shapes]
        (b,) = tribucket.compute_layout(specs, bucket_cap_bytes=tribucket.NO_CAP,
                                        first_bucket_cap_bytes=None).buckets
        gen = torch.Generator().manual_seed(0)
        self.name = name
        self.grads = [torch.randn(shapes[i], generator=gen).to(device) for i in b.indices]
        self.offsets, self.sizes, self.numel = list(b.offsets), list(b.sizes), b.numel
        self.elements = sum(self.sizes)
        self.plan = kernels.BucketPlan(self.sizes, self.offsets, self.numel, device)
        self.out = {d: torch.zeros(self.numel, dtype=d, device=device) for d in (F32, F16)}
        # bucket views shaped like the gradients, built once (as DDP does)
        self.views = {d: [o[off:off + n].view(g.shape) for g, off, n in
                          zip(self.grads, self.offsets, self.sizes)] for d, o in self.out.items()}
        self.src = torch.randn(self.elements, generator=gen).to(device)
        self.dst = torch.empty(self.elements, device=device)
        self.found_inf = torch.zeros(1, device=device)


def pack_variants(b: Bucket, op: str) -> dict:
    """name -> zero-argument callable, for pack operation ``op``."""
    grads, flat = b.grads, torch._utils._flatten_dense_tensors
    scale = 1.0 if op == "pack" else 0.5
    dt = F16 if "fp16" in op else F32
    out, views, plan, fi = b.out[dt], b.views[dt], b.plan, b.found_inf
    check_inf = "found_inf" in op

    def tribucket_plan():
        plan.pack(grads, out, scale=scale, found_inf=fi if check_inf else None, check=False)

    def mul_loop():
        for g, v in zip(grads, views):
            torch.mul(g, scale, out=v)
        if check_inf and not bool(torch.isfinite(out).all()):
            fi.fill_(1.0)

    def copy_loop():  # copy_ each gradient into an fp32 bucket, then scale/cast the bucket
        for g, v in zip(grads, b.views[F32]):
            v.copy_(g)
        if scale != 1.0 or dt != F32:
            torch.mul(b.out[F32], scale, out=out)
        if check_inf and not bool(torch.isfinite(out).all()):
            fi.fill_(1.0)

    def allocating(cat):
        def run():
            r = cat()
            if scale != 1.0:
                r.mul_(scale)
            if dt != F32:
                r = r.to(dt)
            if check_inf and not bool(torch.isfinite(r).all()):
                fi.fill_(1.0)
            return r
        return run

    def foreach_copy():  # one _foreach_copy_ into the fp32 bucket views, then scale/cast
        torch._foreach_copy_(b.views[F32], grads)
        if scale != 1.0 or dt != F32:
            torch.mul(b.out[F32], scale, out=out)
        if check_inf and not bool(torch.isfinite(out).all()):
            fi.fill_(1.0)

    variants = {"tribucket": tribucket_plan, "mul(out=) loop": mul_loop,
                "copy_ loop": copy_loop, "_flatten_dense_tensors": allocating(lambda: flat(grads)),
                "torch.cat": allocating(lambda: torch.cat([g.view(-1) for g in grads]))}
    if grads[0].is_cuda:  # the GPU user's one-call copy (the CPU table predates it)
        variants["_foreach_copy_"] = foreach_copy
    if len(grads) == 1:  # one tensor: it returns a view of it (copies nothing; mul_ on it
        del variants["_flatten_dense_tensors"]  # would scale the gradient itself)
    return variants


def unpack_variants(b: Bucket, op: str) -> dict:
    grads, plan = b.grads, b.plan
    dt = F16 if "fp16" in op else F32
    buf, views = b.out[dt], b.views[dt]

    def copy_loop():
        for g, v in zip(grads, views):
            g.copy_(v)

    payload = _payload(b, buf)  # the gaps removed once, outside the timing

    def unflatten():
        for g, u in zip(grads, torch._utils._unflatten_dense_tensors(payload, grads)):
            g.copy_(u)

    return {"tribucket": lambda: plan.unpack(buf, grads, check=False), "copy_ loop": copy_loop,
            "_foreach_copy_": lambda: torch._foreach_copy_(grads, views),
            "_unflatten_dense_tensors": unflatten}


def _payload(b: Bucket, buf: torch.Tensor) -> torch.Tensor:
    """The bucket without its padding (what _unflatten_dense_tensors expects)."""
    if b.numel == b.elements:
        return buf
    return torch.cat([buf[o:o + n] for o, n in zip(b.offsets, b.sizes)])


PACK_OPS = ["pack", "pack x1/2", "pack fp16 x1/2", "pack fp16 x1/2 + found_inf"]
UNPACK_OPS = ["unpack", "unpack from fp16"]
OP_BYTES = {"pack": (4, 4), "pack x1/2": (4, 4), "pack fp16 x1/2": (4, 2),
            "pack fp16 x1/2 + found_inf": (4, 2), "unpack": (4, 4), "unpack from fp16": (2, 4)}


def check_results(b: Bucket) -> None:
    """tribucket's output equals the mul(out=) loop's, bit for bit (sanity, not timed)."""
    for op in ("pack x1/2", "pack fp16 x1/2"):
        v = pack_variants(b, op)
        dt = F16 if "fp16" in op else F32
        v["mul(out=) loop"]()
        want = b.out[dt].clone()
        b.out[dt].zero_()
        v["tribucket"]()
        assert torch.equal(b.out[dt].view(torch.int16 if dt == F16 else torch.int32),
                           want.view(torch.int16 if dt == F16 else torch.int32)), (b.name, op)


# -- timing ----------------------------------------------------------------------------------
def time_round_robin(variants: dict, rounds: int, warmup: int = 2) -> dict:
    """Median seconds per variant, by two clocks: ``{"cpu": ..., "wall": ...}``.

    ``cpu`` is the calling thread's CPU time (``time.thread_time``): with one intra-op thread
    all the work runs on it, and unlike the wall clock it does not count the time this
    process spends descheduled while other jobs share the 2 cores.
    """
    names = list(variants)
    for _ in range(warmup):
        for n in names:
            variants[n]()
    cpu = {n: [] for n in names}
    wall = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:  # rotate the order
            w0, c0 = time.perf_counter(), time.thread_time()
            variants[n]()
            c1, w1 = time.thread_time(), time.perf_counter()
            cpu[n].append(c1 - c0)
            wall[n].append(w1 - w0)
    return {"cpu": {n: statistics.median(v) for n, v in cpu.items()},
            "wall": {n: statistics.median(v) for n, v in wall.items()}}


def run_cases(device: str, timer, label: str) -> list:
    """Every case and operation on ``device``; ``timer(variants) -> {name: seconds}``."""
    rows = []
    for case in CASES:
        b = Bucket(case, device)
        check_results(b)
        for op in PACK_OPS + UNPACK_OPS:
            variants = (pack_variants if op in PACK_OPS else unpack_variants)(b, op)
            variants = {"limit: copy_": lambda b=b: b.dst.copy_(b.src), **variants}
            t, wall = timer(variants)
            rb, wb = OP_BYTES[op]
            for name, sec in t.items():
                nbytes = b.elements * (8 if name.startswith("limit") else rb + wb)
                rows.append(dict(case=case, op=op, variant=name, ms=sec * 1e3,
                                 gbps=nbytes / sec / 1e9, x_limit=t["limit: copy_"] / sec,
                                 wall_ms=None if wall is None else wall[name] * 1e3))
            print(f"[{label}] {case:22s} {op:28s} " + "  ".join(
                f"{k}={v * 1e3:.2f}ms" for k, v in t.items()), flush=True)
    return rows


def bench_cpu(threads: int, rounds: int) -> dict:
    """One thread: thread CPU time (wall clock kept in the JSON). More threads: wall clock
    (the calling thread's CPU time would miss the other threads' share)."""
    torch.set_num_threads(threads)
    clock = "cpu" if threads == 1 else "wall"

    def timer(variants):
        t = time_round_robin(variants, rounds)
        return t[clock], t["wall"]

    rows = run_cases("cpu", timer, f"{threads} thread(s)")
    return {"threads": threads, "clock": clock, "rows": rows + overhead_rows(rounds, clock)}


def overhead_rows(rounds: int, clock: str) -> list:
    """Per-call cost with 128 tiny (4x4) tensors: what a call costs beyond the bytes."""
    grads = [torch.randn(4, 4) for _ in range(128)]
    offsets = [16 * i for i in range(128)]
    plan = kernels.BucketPlan([16] * 128, offsets, 2048, "cpu")
    out = torch.zeros(2048)
    views = [out[o:o + 16].view(4, 4) for o in offsets]
    variants = {
        "BucketPlan.pack(check=False)": lambda: plan.pack(grads, out, check=False),
        "BucketPlan.pack(check=True)": lambda: plan.pack(grads, out),
        "BucketPlan.unpack(check=False)": lambda: plan.unpack(out, grads, check=False),
        "kernels.pack (functional)": lambda: kernels.pack(grads, out, offsets),
        "copy_ loop": lambda: [v.copy_(g) for g, v in zip(grads, views)],
        "mul(out=) loop": lambda: [torch.mul(g, 1.0, out=v) for g, v in zip(grads, views)],
    }
    t = time_round_robin(variants, max(rounds * 10, 50))[clock]
    return [dict(case="128 x 4x4 (per-call cost)", op="overhead", variant=n, us=s * 1e6)
            for n, s in t.items()]


def bench_cuda() -> dict | None:
    """The same cases on the GPU: Triton kernels and baselines timed with do_bench."""
    if not torch.cuda.is_available() or not kernels.triton_available():
        return None
    from triton.testing import do_bench

    def timer(variants):  # do_bench reports milliseconds
        return {n: do_bench(f, warmup=25, rep=100) / 1e3 for n, f in variants.items()}, None

    rows = run_cases("cuda", timer, "cuda")
    return {"device": torch.cuda.get_device_name(), "rows": rows}


# -- report ----------------------------------------------------------------------------------
def _get(rows, case, op, variant, key="ms"):
    for r in rows:
        if r["case"] == case and r["op"] == op and r["variant"] == variant:
            return r[key]
    return math.nan


def targets(rows: list) -> list[dict]:
    big, tiny, one = CASES[0], CASES[1], CASES[3]
    t = []
    frac = _get(rows, big, "pack", "tribucket", "x_limit")
    t.append(dict(name=f"pack, {big}: >= {TARGET_LIMIT_FRACTION:.0%} of the copy_ limit",
                  value=f"{frac:.0%}", met=frac >= TARGET_LIMIT_FRACTION))
    sp = _get(rows, tiny, "pack x1/2", "mul(out=) loop") / _get(rows, tiny, "pack x1/2", "tribucket")
    t.append(dict(name=f"pack x1/2, {tiny}: >= {TARGET_TINY_SPEEDUP:.0f}x faster than the "
                       f"mul(out=) loop", value=f"{sp:.1f}x", met=sp >= TARGET_TINY_SPEEDUP))
    for case in (big, one):
        ratio = 1 / _get(rows, case, "pack fp16 x1/2", "tribucket", "x_limit")
        t.append(dict(name=f"pack fp32->fp16 x1/2, {case}: within {TARGET_FP16_RATIO}x of a "
                           f"plain fp32 copy_", value=f"{ratio:.2f}x",
                      met=ratio <= TARGET_FP16_RATIO))
    return t


def markdown(res: dict) -> str:
    one = next(r for r in res["cpu"] if r["threads"] == 1)
    rows = one["rows"]
    lines = [f"CPU: {res['machine']}, torch {res['torch']}, 1 intra-op thread; median of "
             f"{res['rounds']} round-robin rounds of thread CPU time (the machine is shared: "
             f"load average {res['loadavg_before'][0]:.1f} before, "
             f"{res['loadavg_after'][0]:.1f} after; wall-clock medians are in the JSON). "
             f"Cells: GB/s (x the single-tensor `copy_` limit measured in the same rounds).",
             ""]
    for title, ops, variants in (
            ("pack", PACK_OPS, ["tribucket", "mul(out=) loop", "copy_ loop",
                                "_flatten_dense_tensors", "torch.cat"]),
            ("unpack", UNPACK_OPS, ["tribucket", "copy_ loop", "_foreach_copy_",
                                    "_unflatten_dense_tensors"])):
        lines.append("| bucket | " + title + " | limit `copy_` | " + " | ".join(
            f"`{v}`" if v[0] in "_t" and v != "tribucket" else v for v in variants) + " |")
        lines.append("| --- | --- | ---: |" + " ---: |" * len(variants))
        for case in CASES:
            for op in ops:
                cells = [f"{_get(rows, case, op, 'limit: copy_', 'gbps'):.2f}"]
                for v in variants:
                    g, x = _get(rows, case, op, v, "gbps"), _get(rows, case, op, v, "x_limit")
                    cell = "view" if math.isnan(g) else f"{g:.2f} ({x:.2f})"
                    cells.append(f"**{cell}**" if v == "tribucket" else cell)
                lines.append(f"| {case} | {op} | " + " | ".join(cells) + " |")
        lines.append("")
    lines.append("\"view\": `_flatten_dense_tensors` of a single tensor returns a view and "
                 "copies nothing.")
    lines.append("")
    over = [r for r in rows if r["op"] == "overhead"]
    lines.append("Per-call cost, 128 tensors of 4x4 (almost no bytes): " + ", ".join(
        f"{r['variant']} {r['us']:.0f} us" for r in over) + ".")
    lines.append("")
    lines.append("Targets (ratios from this run, 1 thread):")
    lines.append("")
    for t in targets(rows):
        lines.append(f"- {'met' if t['met'] else 'NOT met'}: {t['name']}: {t['value']}")
    two = [r for r in res["cpu"] if r["threads"] == 2]
    if two:
        r2 = two[0]["rows"]
        lines.append("")
        lines.append("The same targets with 2 intra-op threads (wall clock): " + "; ".join(
            f"{t['value']} ({'met' if t['met'] else 'not met'})" for t in targets(r2)) +
            ". tribucket x limit with 2 threads: " + ", ".join(
                f"{c.split(',')[0]} {_get(r2, c, 'pack', 'tribucket', 'x_limit'):.2f}"
                for c in CASES) + " (pack), limit copy_ " + ", ".join(
                f"{_get(r2, c, 'pack', 'limit: copy_', 'gbps'):.1f}" for c in CASES) +
            " GB/s.")
    if res.get("cuda"):
        lines.append("")
        lines.append(f"CUDA ({res['cuda']['device']}, `triton.testing.do_bench`): see "
                     f"`perf/results/pack.json`.")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = next(r for r in res["cpu"] if r["threads"] == 1)["rows"]
    variants = ["tribucket", "mul(out=) loop", "copy_ loop", "_flatten_dense_tensors",
                "torch.cat", "_foreach_copy_", "_unflatten_dense_tensors"]
    ops = PACK_OPS + UNPACK_OPS
    fig, axes = plt.subplots(len(CASES), 1, figsize=(12, 3.2 * len(CASES)), sharex=True)
    width = 0.8 / len(variants)
    for ax, case in zip(axes, CASES):
        for k, v in enumerate(variants):
            ys = [_get(rows, case, op, v, "x_limit") for op in ops]
            xs = [i + (k - len(variants) / 2) * width + width / 2 for i in range(len(ops))]
            label = ("torch._utils." if "flatten" in v else "torch.") + v if v[0] == "_" else v
            ax.bar(xs, [0 if math.isnan(y) else y for y in ys], width, label=label)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_ylabel("x copy_ limit")
        ax.set_title(case, fontsize=10)
    axes[-1].set_xticks(range(len(ops)))
    axes[-1].set_xticklabels(ops, fontsize=8)
    axes[0].legend(ncol=4, fontsize=7)
    fig.suptitle("pack/unpack throughput relative to a single-tensor copy_ (1 thread, higher "
                 "is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    res = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
           "torch": torch.__version__, "rounds": args.rounds,
           "loadavg_before": os.getloadavg(),
           "cpu": [bench_cpu(n, args.rounds) for n in args.threads],
           "cuda": bench_cuda()}
    res["loadavg_after"] = os.getloadavg()
    res["targets"] = targets(next(r for r in res["cpu"] if r["threads"] == 1)["rows"])
    save(args.out, "pack", res, markdown, plot)


if __name__ == "__main__":
    main()
