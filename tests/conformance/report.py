"""docs/conformance.md, made from ``results/*.json`` and ``differences.py`` (never by hand)."""

from __future__ import annotations

import json
import pathlib

from differences import REASONS

HERE = pathlib.Path(__file__).resolve().parent
CONFIG_NAMES = {"cpu": "torch's CPU configuration",
                "gpu": "GPU-gated tests run on the CPU"}
SHORT = {"cpu": "CPU", "gpu": "GPU-gated on the CPU"}
KINDS = {"documented": "documented difference", "internal": "reads DDP internals",
         "open": "open defect"}


def load(impl: str, config: str) -> dict:
    path = HERE / "results" / f"{impl}-{config}.json"
    return json.loads(path.read_text()) if path.exists() else {"meta": {}, "tests": {}}


def verdict(ddp: dict | None, ours: dict | None) -> str:
    """'skip', 'pass', 'fail', 'not comparable' or 'not run' for one test."""
    if ddp is None or ours is None:
        return "not run"
    if ddp["status"] == "skip" or ours["status"] == "skip":
        return "skip"
    if ddp["status"] != "pass":
        return "not comparable"
    return "pass" if ours["status"] == "pass" else "fail"


def table(config: str, names: list[str]) -> tuple[dict, list[tuple]]:
    ddp, ours = load("ddp", config)["tests"], load("tribucket", config)["tests"]
    rows = []
    for name in names:
        v = verdict(ddp.get(name), ours.get(name))
        rows.append((name, v, (ddp.get(name) or {}).get("status", "-"),
                     (ours.get(name) or {}).get("status", "-")))
    counts = {
        "collected": len(names),
        "run": sum(v not in ("skip", "not run") for _, v, _, _ in rows),
        "ddp_passes": sum(v in ("pass", "fail") for _, v, _, _ in rows),
        "class_passes": sum(v == "pass" for _, v, _, _ in rows),
    }
    failing = [n for n, v, _, _ in rows if v == "fail"]
    for kind in KINDS:
        counts[kind] = sum(REASONS[n].kind == kind for n in failing if n in REASONS)
    counts["unexplained"] = sum(n not in REASONS for n in failing)
    counts["behaviour"] = counts["ddp_passes"] - counts["internal"]
    counts["behaviour_passes"] = counts["class_passes"]
    return counts, rows


def unexplained(names: list[str]) -> list[str]:
    out = []
    for config in CONFIG_NAMES:
        _, rows = table(config, names)
        out += [f"{n} ({config})" for n, v, _, _ in rows if v == "fail" and n not in REASONS]
    return out


def summary(names: list[str]) -> str:
    """One line per configuration, for the README."""
    parts = []
    for config, title in CONFIG_NAMES.items():
        c, _ = table(config, names)
        parts.append(f"{title}: {c['class_passes']} of the {c['behaviour']} behaviour tests "
                     f"DDP passes ({c['run']} run, DDP passes {c['ddp_passes']}, "
                     f"{c['internal']} read DDP internals)")
    return "; ".join(parts)


def _seconds(impl: str) -> int:
    """Seconds the recorded tests of ``impl`` took, both configurations."""
    return round(sum(t.get("seconds") or 0 for config in CONFIG_NAMES
                     for t in load(impl, config)["tests"].values()))


def page(names: list[str]) -> str:
    meta = load("tribucket", "gpu")["meta"] or load("tribucket", "cpu")["meta"]
    base = load("ddp", "gpu")["meta"]
    out = [
        "# Conformance with torch's own DDP tests",
        "",
        "torch's test suite is the most complete statement of what `DistributedDataParallel` "
        "does. `make conformance` runs its DDP tests (`DistributedTest._DistTestBase` in "
        "torch's installed `torch/testing/_internal/distributed/distributed_test.py`) with "
        "`DistributedDataParallel` replaced by `tribucket.DistributedDataParallel` (in the "
        "test module and on `torch.nn.parallel`), the way torch's own driver runs them: gloo, "
        f"{meta.get('world_size', 2)} ranks, one process tree per test under a timeout. "
        "torch's DDP runs the same tests in the same configurations as the baseline.",
        "",
        "Two configurations:",
        "",
        "- **torch's CPU configuration**: the tests torch runs on a machine without GPUs;",
        "- **GPU-gated tests run on the CPU**: `skip_if_lt_x_gpu` and its friends lifted, every "
        "CUDA device a test names mapped to the CPU, DDP's `device_ids` dropped for the CPU "
        "module, for DDP and tribucket alike.",
        "",
        "A test is *pass* when it passes through both, *fail* when DDP passes it and tribucket "
        "does not (each one listed below with its reason), *not comparable* when DDP fails it "
        "too in that configuration, *skip* when torch skips it there (torch's disabled tests, "
        "GPU gates in the CPU configuration; decided before spawning).",
        "",
        f"Last run: torch {meta.get('torch', '?')}, {meta.get('machine', '?')}, "
        f"{meta.get('date', '?')}; the tests took {_seconds('tribucket')} s through "
        f"tribucket and {_seconds('ddp')} s through DDP, each test a process tree forked "
        "from a server that imported torch's tests once; the machine was shared with other "
        f"jobs (1-min load average {meta.get('load_average', '?')} at the end of the last "
        f"run). DDP's baseline ({base.get('date', '?')}) is kept in "
        "`tests/conformance/results/ddp-*.json`; re-record it with "
        "`python tests/conformance/run.py --impl ddp`.",
        "",
        "| configuration | collected | run | DDP passes | tribucket passes | fails: "
        "documented difference | fails: reads DDP internals | fails: open defect |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    tables = {}
    for config, title in CONFIG_NAMES.items():
        c, rows = table(config, names)
        tables[config] = rows
        out.append(f"| {title} | {c['collected']} | {c['run']} | {c['ddp_passes']} | "
                   f"{c['class_passes']} | {c['documented']} | {c['internal']} | "
                   f"{c['open'] + c['unexplained']} |")
    out += ["", "Of the tests DDP passes that test behaviour (all but those reading DDP's "
            "internals), tribucket passes:", ""]
    for config, title in CONFIG_NAMES.items():
        c, _ = table(config, names)
        out.append(f"- {title}: **{c['class_passes']} of {c['behaviour']}**")
    failing = sorted({n for rows in tables.values() for n, v, _, _ in rows if v == "fail"})
    out += ["", "## Tests DDP passes and tribucket fails", ""]
    if not failing:
        out.append("None.")
    else:
        out += ["| test | configurations | kind | reason |", "| --- | --- | --- | --- |"]
        for n in failing:
            where = ", ".join(SHORT[c] for c, rows in tables.items()
                              if any(r[0] == n and r[1] == "fail" for r in rows))
            r = REASONS.get(n)
            kind = KINDS[r.kind] if r else "unexplained"
            out.append(f"| `{n}` | {where} | {kind} | {r.text if r else ''} |")
    out += ["", "## Every test", "",
            "| test | CPU configuration: verdict (DDP / tribucket) | GPU-gated on the CPU: "
            "verdict (DDP / tribucket) |", "| --- | --- | --- |"]
    for i, n in enumerate(names):
        cells = []
        for config in CONFIG_NAMES:
            _, v, d, o = tables[config][i]
            cells.append(v if v in ("skip", "not run") else f"{v} ({d} / {o})")
        out.append(f"| `{n}` | {cells[0]} | {cells[1]} |")
    return "\n".join(out) + "\n"


README_MARK = ("<!-- conformance:summary -->\n", "<!-- /conformance:summary -->")


def fill_readme(text: str, names: list[str]) -> str:
    """The README with its conformance lines (between the markers) made from the results."""
    start, end = README_MARK
    i, j = text.index(start) + len(start), text.index(end)
    lines = []
    for config, title in CONFIG_NAMES.items():
        c, _ = table(config, names)
        lines.append(f"| {title} | {c['run']} | {c['ddp_passes']} | {c['internal']} | "
                     f"**{c['class_passes']} of {c['behaviour']}** |")
    block = ("| torch's DDP tests, 2 gloo ranks | run | DDP passes | of those, reading DDP's "
             "internals | `tribucket.DistributedDataParallel` passes, of DDP's behaviour "
             "tests |\n| --- | ---: | ---: | ---: | ---: |\n" + "\n".join(lines) + "\n")
    return text[:i] + block + text[j:]
