"""Machine-code report and roofline estimate of the Triton kernels, without a GPU.

Part 1, measured from the compiler's output: every kernel specialization the launchers can
produce (``tribucket.kernels.machine_code``) compiled for sm_80 (A100) and sm_90 (H100);
per specialization and target the registers, spills (local memory), shared memory, and the
global loads/stores by width in the PTX and the SASS (``cuobjdump -sass``). The aligned
kernels (``ALIGN > 1``) against the scalar ones (``ALIGN = 1``) are the before/after of the
16-byte fast path.

Part 2, on paper: the bytes each call reads and writes (the kernels' docstring formulas)
and the time they take at the published HBM bandwidth of an A100 80GB SXM (2,039 GB/s) and
an H100 SXM (3,350 GB/s), assuming the kernel runs at that peak, plus one launch; next to
DDP's per-parameter copies for the same buckets (one launch per parameter, each taking at
least ``LAUNCH_US``). No GPU ran any of it.

    python perf/kernel_report.py            # writes perf/results/kernels.{json,md,png}
    python perf/update_readme.py kernels    # copies kernels.md into docs/kernels.md
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "perf" / "results"
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import tribucket  # noqa: E402
from _results import save  # noqa: E402  (perf/, the script's directory)
from tribucket.kernels import machine_code as mc  # noqa: E402

#: published peak HBM bandwidth, bytes/s (NVIDIA datasheets)
HBM = {"A100 80GB SXM": 2039e9, "H100 SXM": 3350e9}
#: the least a kernel launch costs, seconds: "a few microseconds" (CPU-side launch of a
#: small PyTorch op); an assumption, not a measurement
LAUNCH_US = 4.0
MIB = 1 << 20

#: specializations shown in the docs table: (label without ALIGN, what it is)
SHOWN = [
    ("_pack_kernel SRC=i32 DST=i32 COPY=1 CHECK=0", "pack, fp32 copy (moved as int32 bits)"),
    ("_pack_kernel SRC=fp32 DST=fp32 COPY=0 CHECK=0", "pack, fp32 x 1/world"),
    ("_pack_kernel SRC=fp32 DST=bf16 COPY=0 CHECK=1", "pack, fp32 -> bf16 x 1/world + found_inf"),
    ("_pack_kernel SRC=i16 DST=i16 COPY=1 CHECK=0", "pack, bf16/fp16 copy"),
    ("_pack_kernel SRC=i8 DST=i8 COPY=1 CHECK=0", "pack, 1-byte copy (bool, int8)"),
    ("_unpack_kernel buffer=i32 DST=i32 COPY=1 ACCUMULATE=0", "unpack, fp32 copy"),
    ("_unpack_kernel buffer=bf16 DST=fp32 COPY=0 ACCUMULATE=0", "unpack, bf16 -> fp32"),
    ("_unpack_kernel buffer=fp32 DST=fp32 COPY=0 ACCUMULATE=1", "unpack, fp32 accumulate"),
    ("_permute_kernel x_ptr=fp32 K=2", "MoE permute, fp32 rows, top-2"),
    ("_permute_kernel x_ptr=bf16 K=2", "MoE permute, bf16 rows, top-2"),
    ("_unpermute_kernel rows_ptr=bf16 K=2 HAS_W=1", "MoE unpermute, bf16, weighted"),
    ("_unpermute_bwd_kernel grad_y_ptr=bf16 K=2", "MoE unpermute backward, bf16"),
]


# -- part 1: machine code ------------------------------------------------------------------
def _widths(counts: dict) -> str:
    """``{"128": 8, "64": 4, "32": 1}`` -> ``8x128 4x64 1x32`` (bits per access)."""
    return " ".join(f"{n}x{w}" for w, n in sorted(counts.items(), key=lambda kv: -int(kv[0])))


def _base(label: str) -> str:
    return " ".join(p for p in label.split() if not p.startswith("ALIGN="))


def machine_code_rows(records: list[dict]) -> list[dict]:
    """One row per shown specialization: its scalar and aligned forms on both targets."""
    by = {}
    for r in records:
        by.setdefault((_base(r["label"]), r["target"]), {})[
            "aligned" if r["align"] > 1 else "scalar"] = r
    rows = []
    for base, what in SHOWN:
        s80, s90 = by[(base, "sm_80")], by[(base, "sm_90")]
        rows.append({
            "what": what, "label": base, "align": s90["aligned"]["align"],
            "registers": {t: [v["scalar"]["registers"], v["aligned"]["registers"]]
                          for t, v in (("sm_80", s80), ("sm_90", s90))},
            "spilled": any(v[k]["spilled"] for v in (s80, s90) for k in v),
            "loads_sm90": [s90["scalar"]["sass"]["ld"], s90["aligned"]["sass"]["ld"]],
            "stores_sm90": [s90["scalar"]["sass"]["st"], s90["aligned"]["sass"]["st"]],
            "sass_instructions_sm90": [s90["scalar"]["sass_instructions"],
                                       s90["aligned"]["sass_instructions"]],
        })
    return rows


def summary(records: list[dict]) -> dict:
    aligned = [r for r in records if r["kernel"] in ("_pack_kernel", "_unpack_kernel")
               and r["align"] > 1]
    return {
        "specializations": len({r["label"] for r in records}),
        "targets": sorted({r["target"] for r in records}),
        "compiled": len(records),
        "spilled": sum(r["spilled"] for r in records),
        "max_registers": max(r["registers"] for r in records),
        "max_shared_bytes": max(r["shared_bytes"] for r in records),
        # the tests check the PTX; the SASS is what runs: say whether they agree
        "sass_equals_ptx_counts": all(r["sass"]["ld"] == r["ptx"]["ld"]
                                      and r["sass"]["st"] == r["ptx"]["st"] for r in aligned),
    }


# -- part 2: roofline --------------------------------------------------------------------------
def gpt2_medium_specs() -> list:
    """The parameter shapes of a GPT-2 medium (24 layers, d=1024, vocab 50257, fp32)."""
    d, shapes = 1024, [(50257, 1024), (1024, 1024)]
    for _ in range(24):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,),
                   (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    shapes += [(d,), (d,)]
    return [tribucket.TensorSpec(s, torch.float32, "cuda") for s in shapes]


def small_specs() -> list:
    """1,000 vectors of 1,024 elements (biases and norm weights), fp32."""
    return [tribucket.TensorSpec((1024,), torch.float32, "cuda") for _ in range(1000)]


def _bucket_ops():
    """(name, tribucket bytes per element, tribucket launches per bucket, DDP model).

    DDP model: (bytes per element of its per-parameter copies, bytes per element of its
    per-bucket passes, per-bucket launches). DDP copies each gradient into its bucket view
    with the 1/world scale (``mul(out=)``: read 4, write 4) and back after the allreduce;
    torch's bf16 compress hook adds one cast of the whole bucket each way.
    """
    return [
        ("pack fp32 x 1/world", 8, 1, (8, 0, 0)),
        ("unpack fp32", 8, 1, (8, 0, 0)),
        ("pack fp32 -> bf16 + found_inf", 6, 1, (8, 6, 2)),  # DDP: + cast, + isfinite check
        ("unpack bf16 -> fp32", 6, 1, (8, 6, 1)),
    ]


def roofline(cap_mb: int = 25) -> list[dict]:
    rows = []
    for model, specs in (("GPT-2 medium (354 M params, 292 tensors)", gpt2_medium_specs()),
                         ("1,000 x 1K-element tensors (4 MiB)", small_specs())):
        layout = tribucket.compute_layout(specs, bucket_cap_bytes=cap_mb * MIB)
        sizes = [n for b in layout.buckets for n in b.sizes]
        nbuckets, elements = len(layout.buckets), sum(sizes)
        for op, tb_bytes, tb_launch, (ddp_param, ddp_bucket, ddp_launch) in _bucket_ops():
            row = {"model": model, "op": op, "buckets": nbuckets, "tensors": len(sizes),
                   "elements": elements, "bytes": tb_bytes * elements, "gpus": {}}
            for gpu, bw in HBM.items():
                tb = nbuckets * tb_launch * LAUNCH_US * 1e-6 + tb_bytes * elements / bw
                per_param = sum(max(LAUNCH_US * 1e-6, ddp_param * n / bw) for n in sizes)
                ddp = (per_param + nbuckets * ddp_launch * LAUNCH_US * 1e-6
                       + ddp_bucket * elements / bw)
                row["gpus"][gpu] = {"tribucket_s": tb, "ddp_s": ddp,
                                    "bytes_only_s": tb_bytes * elements / bw}
            rows.append(row)
    T, D, K, E, size = 8192, 4096, 2, 64, 2  # tokens, model dim, top-k, experts, bf16
    N = T * K
    for op, nbytes in (
            ("MoE counts (8192 x top-2 ids)", 8 * T * K),
            ("MoE permute (8192 tokens, D=4096, bf16, top-2)", T * D * size + 8 * T * K + N * D * size),
            ("MoE unpermute (weighted)", N * D * size + 16 * T * K + T * D * size),
            ("MoE unpermute backward", K * T * D * size + N * D * size + N * D * size + 4 * T * K)):
        row = {"model": f"MoE layer, E={E}", "op": op, "buckets": None, "tensors": None,
               "elements": None, "bytes": nbytes, "gpus": {}}
        for gpu, bw in HBM.items():
            row["gpus"][gpu] = {"tribucket_s": LAUNCH_US * 1e-6 + nbytes / bw, "ddp_s": None,
                                "bytes_only_s": nbytes / bw}
        rows.append(row)
    return rows


# -- output ------------------------------------------------------------------------------------
def _us(s):
    return "-" if s is None else (f"{s * 1e6:,.0f} us" if s >= 1e-4 else f"{s * 1e6:.1f} us")


def markdown(res: dict) -> str:
    s = res["summary"]
    lines = [
        f"**Machine code** (compiled, not run: triton {res['triton']}, "
        f"{' and '.join(s['targets'])}). {s['specializations']} kernel specializations, "
        f"{s['compiled']} compiles, {s['spilled']} with spills; at most "
        f"{s['max_registers']} registers a thread, {s['max_shared_bytes']} bytes of shared "
        f"memory. Scalar -> aligned (`ALIGN`): global accesses per thread on sm_90 "
        f"(SASS, `count x bits`), table reads included.",
        "",
        "| kernel | ALIGN | registers sm_80 | registers sm_90 | loads sm_90 | stores sm_90 | SASS instructions |",
        "| --- | ---: | ---: | ---: | --- | --- | ---: |",
    ]
    for r in res["machine_code"]:
        reg = {t: f"{a} -> {b}" for t, (a, b) in r["registers"].items()}
        ld, st = r["loads_sm90"], r["stores_sm90"]
        lines.append(f"| {r['what']} | {r['align']} | {reg['sm_80']} | {reg['sm_90']} | "
                     f"{_widths(ld[0])} -> {_widths(ld[1])} | {_widths(st[0])} -> "
                     f"{_widths(st[1])} | {r['sass_instructions_sm90'][0]} -> "
                     f"{r['sass_instructions_sm90'][1]} |")
    agree = "equal" if s["sass_equals_ptx_counts"] else "DIFFER FROM"
    lines += ["", f"In every aligned pack/unpack specialization the SASS access counts {agree} "
              f"the PTX ones (the tests check the PTX).", ""]
    gpus = list(HBM)
    lines += [
        f"**Roofline estimate** (on paper: bytes from the kernels' docstring formulas at the "
        f"published HBM peak, {', '.join(f'{g} {bw / 1e9:,.0f} GB/s' for g, bw in HBM.items())}, "
        f"plus {LAUNCH_US:g} us a launch; DDP: one copy launch per parameter, each at least "
        f"{LAUNCH_US:g} us, plus its bucket-wide passes). Whole model, {res['cap_mb']} MiB buckets.",
        "",
        "| model | operation | buckets / tensors | bytes moved | " + " | ".join(
            f"{g}: tribucket | {g}: DDP copies" for g in gpus) + " |",
        "| --- | --- | ---: | ---: | " + " | ".join("---: | ---:" for _ in gpus) + " |",
    ]
    for r in res["roofline"]:
        bt = "-" if r["buckets"] is None else f"{r['buckets']} / {r['tensors']}"
        cells = " | ".join(f"{_us(r['gpus'][g]['tribucket_s'])} | {_us(r['gpus'][g]['ddp_s'])}"
                           for g in gpus)
        lines.append(f"| {r['model']} | {r['op']} | {bt} | {r['bytes'] / MIB:,.1f} MiB | {cells} |")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    rows = res["machine_code"]
    names = [r["what"] for r in rows]
    ax = axes[0]
    ys = range(len(rows))
    ax.barh([y + 0.2 for y in ys], [r["sass_instructions_sm90"][0] for r in rows], 0.4,
            label="scalar (ALIGN=1)", color="#bbbbbb")
    ax.barh([y - 0.2 for y in ys], [r["sass_instructions_sm90"][1] for r in rows], 0.4,
            label="aligned", color="#1f77b4")
    ax.set_yticks(list(ys), names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("SASS instructions, sm_90")
    ax.legend(fontsize=7)
    ax.set_title("compiled kernels: scalar vs 16-byte aligned", fontsize=9)
    ax = axes[1]
    bucket_rows = [r for r in res["roofline"] if r["buckets"] is not None]
    labels = [f"{r['op']}\n{r['model'].split(' (')[0]}" for r in bucket_rows]
    g = "H100 SXM"
    xs = range(len(bucket_rows))
    ax.bar([x - 0.2 for x in xs], [r["gpus"][g]["tribucket_s"] * 1e6 for r in bucket_rows], 0.4,
           label="tribucket (one launch a bucket)", color="#1f77b4")
    ax.bar([x + 0.2 for x in xs], [r["gpus"][g]["ddp_s"] * 1e6 for r in bucket_rows], 0.4,
           label="DDP (one copy launch a parameter)", color="#999999")
    ax.set_xticks(list(xs), labels, fontsize=6, rotation=30, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("us per backward (estimate)")
    ax.set_title(f"roofline estimate on {g} (not measured)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--cap-mb", type=int, default=25)
    args = ap.parse_args(argv)
    import triton

    load_before = os.getloadavg()
    t0 = time.time()
    records = mc.compile_all(sass=True)
    res = {"triton": triton.__version__, "torch": torch.__version__,
           "machine": f"{platform.machine()}, {os.cpu_count()} cores",
           "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
           "compile_wall_s": round(time.time() - t0, 1), "cap_mb": args.cap_mb,
           "hbm_bytes_per_s": HBM, "launch_us": LAUNCH_US,
           "summary": summary(records), "machine_code": machine_code_rows(records),
           "roofline": roofline(args.cap_mb),
           # every compile (the signature is in the label and the constexprs)
           "records": [{k: v for k, v in r.items() if k != "signature"} for r in records]}
    save(args.out, "kernels", res, markdown, plot)


if __name__ == "__main__":
    main()
