"""``make conformance``: torch's own DDP tests through ``tribucket.DistributedDataParallel``,
against torch's DDP in the same configurations; writes docs/conformance.md.

    python tests/conformance/run.py                  # tribucket, both configurations; report
    python tests/conformance/run.py --impl ddp       # re-record DDP's baseline (results/ddp-*.json)
    python tests/conformance/run.py --tests test_ddp_create_graph,test_ddp_broadcast_buffer
    python tests/conformance/run.py --report-only    # the page from the recorded results

Each configuration's tests run in one server process (harness.py) that imports torch's
tests once and forks a process tree per test, under a timeout. Results are kept in
``tests/conformance/results/<impl>-<config>.json``; the page is made from those files and
from the reasons in ``differences.py``, never typed by hand.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
RESULTS = HERE / "results"
PAGE = ROOT / "docs" / "conformance.md"
CONFIGS = ("cpu", "gpu")
sys.path.insert(0, str(HERE))

import harness  # noqa: E402


def gates(config: str, names: list[str]) -> dict[str, str]:
    """The tests ``config`` skips before spawning (computed in a process of its own: the
    harness patches torch's modules)."""
    code = ("import json, sys; sys.path.insert(0, %r); import harness; "
            "print(json.dumps(harness.gates(%r, %r)))" % (str(HERE), config, names))
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, env=_env()).stdout
    return json.loads(out.strip().splitlines()[-1])


def _env() -> dict:
    env = dict(os.environ)
    env.setdefault("PYTHONWARNINGS", "ignore")
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    return env


def run(impl: str, config: str, tests: list[str], timeout: float, log) -> dict[str, dict]:
    """Run ``tests`` in one harness server; return {test: result}."""
    if not tests:
        return {}
    with tempfile.TemporaryDirectory(prefix=f"conformance-{impl}-{config}-") as out_dir:
        # the server's own timeout for the whole batch: every test's, plus its imports
        subprocess.run([sys.executable, str(HERE / "harness.py"), "--impl", impl,
                        "--config", config, "--tests", ",".join(tests), "--out-dir", out_dir,
                        "--timeout", str(timeout)], stdout=log, stderr=subprocess.STDOUT,
                       env=_env(), timeout=timeout * len(tests) + 600, cwd=tempfile.gettempdir())
        results = {}
        for t in tests:
            path = pathlib.Path(out_dir) / f"{t}.json"
            results[t] = json.loads(path.read_text()) if path.exists() else {
                "status": "fail", "detail": "the harness server stopped before this test"}
    return results


_BOILERPLATE = ("To execute this test", "harness.py TestDistBackendWithSpawn",
                "PYTORCH_PRINT_REPRO_ON_FAILURE", "^^^")


def _last_lines(detail: str, n: int = 8) -> str:
    """The end of a failure: the assertion or error, without torch's repro boilerplate."""
    lines = [ln for ln in detail.strip().splitlines()
             if ln.strip() and not any(b in ln for b in _BOILERPLATE)]
    return "\n".join(lines[-n:])


def record(impl: str, config: str, names: list[str], skipped: dict[str, str],
           results: dict[str, dict], elapsed: float) -> dict:
    """Merge a run into results/<impl>-<config>.json (a partial run updates its tests)."""
    path = RESULTS / f"{impl}-{config}.json"
    old = json.loads(path.read_text()) if path.exists() else {"tests": {}}
    tests = old["tests"]
    for name, why in skipped.items():
        tests[name] = {"status": "skip", "detail": why}
    for name, res in results.items():
        tests[name] = {"status": res["status"], "seconds": res.get("seconds"),
                       "detail": _last_lines(res.get("detail", ""))}
    tests = {n: tests[n] for n in sorted(tests) if n in names}
    import torch
    meta = dict(torch=torch.__version__, python=platform.python_version(),
                machine=f"{os.cpu_count()}-core {platform.machine()}",
                date=datetime.date.today().isoformat(), world_size=harness.WORLD_SIZE,
                backend="gloo", last_run_seconds=round(elapsed, 1),
                load_average=round(os.getloadavg()[0], 2))
    data = {"meta": meta, "tests": tests}
    RESULTS.mkdir(exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impl", choices=["tribucket", "ddp"], default="tribucket")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--tests", default="", help="comma-separated names (default: every DDP test)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per test")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--log", default=str(pathlib.Path(tempfile.gettempdir()) / "conformance.log"))
    args = ap.parse_args()
    names = harness.ddp_tests()
    chosen = [t for t in args.tests.split(",") if t] or names
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        sys.exit(f"not DDP tests of torch's _DistTestBase: {unknown}")
    if not args.report_only:
        with open(args.log, "a") as log:
            for config in args.configs.split(","):
                start = time.monotonic()
                skipped = {t: why for t, why in gates(config, names).items() if t in chosen}
                todo = [t for t in chosen if t not in skipped]
                print(f"{args.impl}, {config}: {len(todo)} tests to run, {len(skipped)} "
                      f"skipped before spawning (log: {args.log})", flush=True)
                results = run(args.impl, config, todo, args.timeout, log)
                record(args.impl, config, names, skipped, results, time.monotonic() - start)
                counts = {s: sum(r["status"] == s for r in results.values())
                          for s in ("pass", "fail", "skip")}
                print(f"  {counts} in {time.monotonic() - start:.0f} s", flush=True)
    import report
    PAGE.write_text(report.page(names))
    readme = ROOT / "README.md"
    readme.write_text(report.fill_readme(readme.read_text(), names))
    print(f"wrote {PAGE.relative_to(ROOT)} and the README's summary")
    problems = report.unexplained(names)
    if problems:
        print("tests failing through tribucket.DistributedDataParallel while DDP passes, with "
              f"no reason in differences.py: {problems}")
        sys.exit(1)


if __name__ == "__main__":
    main()
