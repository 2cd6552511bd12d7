"""Write the benchmark tables from perf/results/ into README.md and docs/*.md.

Every benchmark writes ``perf/results/<name>.json`` (the figures), ``<name>.png`` (a plot)
and ``<name>.md`` (a markdown table made from the JSON). A page holds a table between
``<!-- perf:<name> -->`` and ``<!-- /perf:<name> -->``; this script replaces what is between
the markers, so no figure in the README or the docs is typed by hand:

* ``<name>`` of a results file: the file ``perf/results/<name>.md``;
* ``headline``: one table of the key figures, built here from the JSON files
  (:func:`headline`), each with the baseline measured in the same run.

    python perf/update_readme.py          # all tables, all pages
    python perf/update_readme.py pack     # just one
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "perf" / "results"

__all__ = ["pages", "headline", "fill", "update"]

_MARKER = re.compile(r"(<!-- perf:([\w-]+) -->\n).*?(<!-- /perf:\2 -->)", re.S)
# Result files written before the benchmarks stopped naming the project's issues.
_ISSUE_REF = re.compile(r" ?\(issues? \d+(?: and \d+)?\)|issues? \d+(?: and \d+)?, ")


def pages() -> list[pathlib.Path]:
    """The pages that may hold tables: the README and every docs/ page."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _headline_rows() -> list[tuple[str, str, str, str]]:
    rows = []
    if (RESULTS / "step.json").exists():
        step = _load("step")
        for r in step["results"]:
            med = r["median_s"]
            what = f"training step, {r['model']} ({r['params'] / 1e6:.1f} M params), 2 ranks"
            rows.append((what, _ms(med["tribucket"]), f"DDP {_ms(med['DDP'])}",
                         f"{med['tribucket'] / med['DDP']:.2f}x the time"))
        big = max(step["results"], key=lambda r: r["params"])
        b = big["bucket_bytes"]
        rows.append((f"gradient bucket memory with fp16 compression, {big['model']}",
                     f"{b['tribucket fp16'] / 2**20:.1f} MiB",
                     f"DDP + `fp16_compress_hook` {b['DDP fp16'] / 2**20:.1f} MiB",
                     f"{b['tribucket fp16'] / b['DDP fp16']:.2f}x the memory"))
    if (RESULTS / "pack.json").exists():
        pack = _load("pack")
        rows_1t = next(c for c in pack["cpu"] if c["threads"] == 1)["rows"]
        sel = {r["variant"]: r for r in rows_1t
               if r["case"].startswith("1000 x 1K") and r["op"] == "pack x1/2"}
        if "tribucket" in sel and "mul(out=) loop" in sel:
            t, m = sel["tribucket"]["gbps"], sel["mul(out=) loop"]["gbps"]
            rows.append(("pack 1,000 gradients of 1K elements with the 1/world scale",
                         f"{t:.1f} GB/s", f"per-tensor `torch.mul(out=)` {m:.1f} GB/s",
                         f"{t / m:.1f}x the speed"))
    if (RESULTS / "moe.json").exists():
        res = {r["variant"]: r for r in _load("moe")["results"]}
        t, n = res["MoELayer"]["tokens_per_s"], res["naive dense"]["tokens_per_s"]
        rows.append(("MoE layer forward+backward, 8 experts, top-2, 2 ranks",
                     f"{t:,.0f} tokens/s", f"all-gather + dense experts {n:,.0f} tokens/s",
                     f"{t / n:.1f}x the speed"))
    if (RESULTS / "moe_schedule.json").exists():
        res = {r["variant"].split(" (")[0]: r
               for r in _load("moe_schedule")["summary"]["2"]["skewed"]["results"]}
        shadow = next((v for k, v in res.items() if "shadows" in k), None)
        if shadow is not None:
            a = res["alltoall"]["tokens_per_s"]
            rows.append(("MoE with FasterMoE shadow experts, skewed routing, 2 ranks",
                         f"{shadow['tokens_per_s']:,.0f} tokens/s", f"all-to-all {a:,.0f} tokens/s",
                         f"{shadow['tokens_per_s'] / a:.1f}x the speed"))
    rows += _headline_rows_second()
    return rows


def _headline_rows_second() -> list[tuple[str, str, str, str]]:
    """Rows from the host-overhead, sharded-optimizer, clipping and MoE-baseline runs."""
    rows = []
    if (RESULTS / "overhead.json").exists():
        for r in _load("overhead")["results"]:
            if r["model"] in ("512", "2048"):
                med = r["median_s"]
                rows.append((f"backward, {r['model']} small parameters "
                             "(Linear+LayerNorm stack), 2 ranks", _ms(med["tribucket"]),
                             f"DDP {_ms(med['DDP'])}",
                             f"{med['tribucket'] / med['DDP']:.2f}x the time"))
    if (RESULTS / "epilogue.json").exists():
        r = next(r for r in _load("epilogue")["results"] if r["model"] == "mlp")
        med = r["median_s"]
        t, b = med["tribucket + fused clip"], med["DDP + torch clip"]
        # the bench's own figure: the median of the per-round ratios (each round runs both)
        ratio = statistics.median(x / y for x, y in zip(r["all_s"]["tribucket + fused clip"],
                                                        r["all_s"]["DDP + torch clip"]))
        rows.append(("backward + `clip_grad_norm_` + AdamW step, mlp, 2 ranks", _ms(t),
                     f"DDP + torch's clip {_ms(b)}", f"{ratio:.2f}x the time"))
    if (RESULTS / "zero.json").exists():
        r = next(r for r in _load("zero")["results"] if r["model"] == "mlp" and r["world"] == 2)
        pk, med = r["peak_bytes"], r["median_s"]
        rows.append(("optimizer state + gradients per rank, AdamW, mlp, 2 ranks",
                     f"{pk['tribucket sharded'] / 2**20:.1f} MiB (sharded)",
                     f"DDP + AdamW {pk['DDP + AdamW'] / 2**20:.1f} MiB",
                     f"{pk['tribucket sharded'] / pk['DDP + AdamW']:.2f}x the memory"))
        t, z = med["tribucket sharded overlap"], med["DDP + ZeRO"]  # the default options
        rows.append(("sharded AdamW training step, mlp, 2 ranks", _ms(t),
                     f"DDP + `ZeroRedundancyOptimizer` {_ms(z)}", f"{t / z:.2f}x the time"))
    if (RESULTS / "skip.json").exists():
        med = _load("skip")["median_s"]
        rows.append(("training step, two 4 MiB heads with one idle per step, "
                     "`skip_all_reduce_unused_params`, 2 ranks", _ms(med["tribucket skip"]),
                     f"DDP with the option {_ms(med['DDP skip'])}",
                     f"{med['tribucket skip'] / med['DDP skip']:.2f}x the time"))
    if (RESULTS / "lightning.json").exists():
        r = _load("lightning")["results"]
        med = r["median_s"]
        # the bench's own figure: the median of the per-fit ratios (each round runs both)
        rows.append((f"Lightning training step, GPT-2 ({r['params'] / 1e6:.1f} M params), 2 ranks",
                     _ms(med["tribucket"]), f'`strategy="ddp"` {_ms(med["ddp"])}',
                     f"{r['ratio']:.2f}x the time"))
    if (RESULTS / "moe_external.json").exists():
        ext = _load("moe_external")
        for run in ext["runs"]:
            if run["capacity_factor"] is not None:
                continue
            rows_by = {row["system"]: row for row in run["rows"]}
            ours = rows_by.get("tribucket MoELayer")
            size = run["size"].split(" (")[0]
            for name in ("DeepSpeed MoE", "torchtitan MoE"):
                other = rows_by.get(name)
                if ours is None or other is None or not other.get("tokens_per_s"):
                    continue
                # the bench's own figure: the median of the per-step ratios (each step runs
                # every system), as its table and targets give it
                rows.append((f"MoE layer forward+backward, {size} size, dropless, 2 ranks",
                             f"{ours['tokens_per_s']:,.0f} tokens/s",
                             f"{name.replace(' MoE', '')} {other['tokens_per_s']:,.0f} tokens/s",
                             f"{other['tribucket_speedup']:.2f}x the speed"))
            floor = rows_by.get("compute floor")
            target = ext.get("targets", {}).get(f"{size} layer / compute floor")
            if ours is not None and floor is not None and target is not None:
                ratio = target["value"]  # the bench's own paired figure (its target line)
                rows.append((f"MoE layer forward+backward, {size} size, 2 ranks, against the "
                             "same expert matmuls alone", _ms(ours["step_ms"] / 1e3),
                             f"compute floor (1 process, no routing or exchange) "
                             f"{_ms(floor['step_ms'] / 1e3)}", f"{ratio:.2f}x the time"))
    return rows


def headline() -> str:
    """The README's headline table, built from the JSON files of perf/results/."""
    rows = _headline_rows()
    lines = ["| measured | tribucket | baseline, same run | ratio |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    loads = []
    for name, get in (("step", lambda d: d["meta"]["loadavg"][0]),
                      ("pack", lambda d: d["loadavg_before"][0]),
                      ("moe", lambda d: d["machine"]["load_avg_1min"]["before"]),
                      ("overhead", lambda d: d["meta"]["loadavg"][0]),
                      ("epilogue", lambda d: d["meta"]["loadavg_start"][0]),
                      ("zero", lambda d: d["meta"]["loadavg"][0]),
                      ("moe_external", lambda d: d["machine"]["load_avg_1min"]["before"]),
                      ("lightning", lambda d: d["meta"]["loadavg"][0])):
        if (RESULTS / f"{name}.json").exists():
            loads.append(get(_load(name)))
    note = ("2-core x86_64 CPU, gloo, one thread per rank, torch 2.13.0+cpu; the machine was "
            "shared with other jobs")
    if loads:
        note += f" (1-min load average {min(loads):.1f} to {max(loads):.1f} at the starts)"
    return "\n".join(lines) + f"\n\n{note}. Details and analysis: [docs/benchmarks.md](docs/benchmarks.md).\n"


def gpu() -> str | None:
    """The GPU run's figures (``make gpu-check`` into ``perf/results/gpu/``): the pack and
    unpack kernels timed on the device, and the step table."""
    d = RESULTS / "gpu"
    if not (d / "pack.json").exists():
        return None
    pack = json.loads((d / "pack.json").read_text())
    cuda = pack.get("cuda") or {}
    cols = ("limit: copy_", "tribucket", "copy_ loop", "mul(out=) loop", "_foreach_copy_",
            "torch.cat")
    by: dict = {}
    for r in cuda.get("rows", []):
        by.setdefault((r["case"], r["op"]), {})[r["variant"]] = r["ms"] * 1e3
    lines = [f"{cuda.get('device', 'GPU')}, torch {pack['torch']}, `triton.testing.do_bench` "
             f"(median, CUDA events): microseconds per call (x the single-tensor `copy_` of "
             f"the same bytes).", "",
             "| bucket | op | " + " | ".join(c.replace("limit: ", "limit ") for c in cols) + " |",
             "| --- | --- |" + " ---: |" * len(cols)]
    for (case, op), v in by.items():
        lim = v.get("limit: copy_")
        cells = []
        for c in cols:
            if c not in v:
                cells.append("-")
            elif c == "limit: copy_" or not lim:
                cells.append(f"{v[c]:.1f}")
            else:
                cell = f"{v[c]:.1f} ({v[c] / lim:.1f})"
                cells.append(f"**{cell}**" if c == "tribucket" else cell)
        lines.append(f"| {case} | {op} | " + " | ".join(cells) + " |")
    out = "\n".join(lines) + "\n"
    step = d / "step.md"
    if step.exists():
        out += "\n" + _step_table(step.read_text()) + "\n"
    summary = d / "summary.json"
    if summary.exists():
        note = json.loads(summary.read_text()).get("tests_result")
        if note:
            out += f"\nCUDA tests (`pytest -m \"cuda or compile\"`): {note}.\n"
    return out


def _body(name: str) -> str | None:
    if name == "headline":
        return headline()
    if name == "gpu":
        return gpu()
    md = RESULTS / f"{name}.md"
    if name.startswith("gpu-"):  # a table of the GPU run: perf/results/gpu/<rest>.md, and
        # gpu-<machine>--<rest>: another GPU's run, perf/results/gpu/<machine>/<rest>.md
        md = RESULTS / "gpu" / f"{name[4:].replace('--', '/', 1)}.md"
    if not md.exists():
        return None
    text = _ISSUE_REF.sub("", md.read_text())
    if name.startswith("gpu-") and md.stem == "step":
        text = _step_table(text)  # as gpu() shows it
    return text.rstrip("\n") + "\n"


def _step_table(text: str) -> str:
    """A GPU run's step table: its header line and the table (the accounting and the CPU
    benchmark's targets do not apply to a one-GPU run)."""
    lines = text.splitlines()
    return "\n".join([lines[0], ""] + [ln for ln in lines if ln.startswith("|")])


def fill(text: str, names: list[str] | None = None) -> tuple[str, list[str]]:
    """``text`` with the tables between its markers rewritten, and the names written."""
    written = []

    def one(m: re.Match) -> str:
        name = m.group(2)
        body = _body(name) if not names or name in names else None
        if body is None:
            return m.group(0)
        written.append(name)
        return m.group(1) + body + m.group(3)

    return _MARKER.sub(one, text), written


def update(names: list[str] | None = None) -> list[str]:
    """Fill every marker pair of every page; return ``page:name`` for each table written."""
    done, seen = [], set()
    for page in pages():
        text = page.read_text()
        new, written = fill(text, names)
        if new != text:
            page.write_text(new)
        seen.update(written)
        done += [f"{page.relative_to(ROOT)}:{name}" for name in written]
    for md in sorted(RESULTS.glob("*.md")):
        if md.stem not in seen and (not names or md.stem in names):
            print(f"no page has <!-- perf:{md.stem} --> markers; skipped", file=sys.stderr)
    return done


def known_tables() -> set[str]:
    """The table names the pages' markers hold."""
    return {m.group(2) for page in pages() for m in _MARKER.finditer(page.read_text())}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="tables to rewrite (default: every one)")
    args = parser.parse_args()
    known = known_tables()
    unknown = sorted(set(args.names) - known)
    if unknown:
        parser.error(f"no page has the tables {unknown}; the tables are {sorted(known)}")
    print("updated:", ", ".join(update(args.names or None)) or "nothing")
