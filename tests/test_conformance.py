"""A fast subset of the conformance run (``make conformance``): torch's own DDP tests that
once failed through ``tribucket.DistributedDataParallel`` while DDP passes them, run through
the class on 2 ranks (GPU-gated tests on the CPU). Each must pass, as DDP does in the
recorded baseline; the page docs/conformance.md must be the one the results give."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import tempfile

import pytest

HERE = pathlib.Path(__file__).resolve().parent
CONFORMANCE = HERE / "conformance"
sys.path.insert(0, str(CONFORMANCE))

FAST = ["test_ddp_create_graph", "test_ddp_broadcast_buffer",
        "test_grads_same_across_ranks_with_no_sync", "test_output_unused_in_loss_tuple_module",
        "test_output_unused_in_loss_dict_module", "test_DistributedDataParallel_requires_grad"]


@pytest.fixture(scope="module")
def fast_results():
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run(
            [sys.executable, str(CONFORMANCE / "harness.py"), "--impl", "tribucket",
             "--config", "gpu", "--tests", ",".join(FAST), "--out-dir", out,
             "--timeout", "120"], capture_output=True, text=True, timeout=600,
            cwd=tempfile.gettempdir())
        results = {}
        for t in FAST:
            path = pathlib.Path(out, f"{t}.json")
            assert path.exists(), f"{t}: no result; harness output:\n{proc.stdout[-3000:]}"
            results[t] = json.loads(path.read_text())
    return results


@pytest.mark.parametrize("test", FAST)
def test_torch_ddp_test_passes_through_the_class(fast_results, test):
    baseline = json.loads((CONFORMANCE / "results" / "ddp-gpu.json").read_text())["tests"]
    assert baseline[test]["status"] == "pass", f"DDP's recorded baseline: {baseline[test]}"
    res = fast_results[test]
    assert res["status"] == "pass", f"{test} through tribucket.DistributedDataParallel: " \
                                    f"{res['status']}\n{res['detail'][-3000:]}"


def test_conformance_page_is_generated_from_the_results():
    import harness
    import report

    page = (HERE.parent / "docs" / "conformance.md").read_text()
    assert page == report.page(harness.ddp_tests()), \
        "docs/conformance.md differs from the recorded results: run " \
        "python tests/conformance/run.py --report-only"
    readme = (HERE.parent / "README.md").read_text()
    assert readme == report.fill_readme(readme, harness.ddp_tests()), \
        "the README's conformance lines differ from the recorded results: run " \
        "python tests/conformance/run.py --report-only"
    assert not report.unexplained(harness.ddp_tests()), \
        "a test DDP passes fails through the class with no reason in differences.py"
