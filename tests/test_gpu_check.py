"""``make gpu-check`` (perf/gpu_check.py): refuses clearly without a GPU; its plan runs the
CUDA tests, the pack benchmark, the NCCL step benchmark and the kernel report into one
directory. (The GPU run itself cannot happen here.)"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import types

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "perf" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


gpu_check = _load("gpu_check")


def _fake_torch(cuda_version, available):
    return types.SimpleNamespace(__version__="9.9", version=types.SimpleNamespace(cuda=cuda_version),
                                 cuda=types.SimpleNamespace(is_available=lambda: available))


def test_why_not_names_the_missing_piece():
    cpu_build = gpu_check.why_not(_fake_torch(None, False))
    assert "CPU-only build" in cpu_build and "torch.version.cuda is None" in cpu_build
    no_device = gpu_check.why_not(_fake_torch("12.4", False))
    assert "torch.cuda.is_available() is False" in no_device and "nvidia-smi" in no_device
    assert gpu_check.why_not(_fake_torch("12.4", True)) is None  # triton is installed here


def test_why_not_names_a_checkout_that_is_not_installed():
    def missing(name):
        raise ModuleNotFoundError(f"No module named {name!r}")

    reason = gpu_check.why_not(_fake_torch("12.4", True), import_module=missing)
    assert "tribucket.kernels" in reason and "pip install --no-deps -e ." in reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU machine")
def test_refuses_without_a_gpu_and_runs_nothing(tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "gpu-check: cannot run here" in err and "torch" in err
    assert list(tmp_path.iterdir()) == []  # no step ran, no log written


def test_plan_runs_every_piece_into_one_directory(tmp_path):
    for gpus, world in ((1, "1"), (2, "2"), (8, "2")):
        steps = gpu_check.plan(tmp_path, gpus, python="py")
        assert tuple(s.name for s in steps) == gpu_check.STEPS
        by = {s.name: s.argv for s in steps}
        assert by["tests"][:3] == ("py", "-m", "pytest") and "cuda or compile" in by["tests"]
        assert f"--junitxml={tmp_path / 'tests.xml'}" in by["tests"]
        assert by["pack"][1] == "perf/bench_pack.py"
        assert by["step"][1:5] == ("perf/bench_step.py", "--backend", "nccl", "--world")
        assert by["step"][5] == world
        assert by["kernels"][1] == "perf/kernel_report.py"
        assert by["moe"][1:6] == ("perf/bench_moe.py", "--part", "grouped", "--device", "cuda")
        assert by["moe"][by["moe"].index("--results") + 1] == str(tmp_path)
        assert by["moe_layer"][1:4] == ("perf/bench_moe.py", "--part", "layer")
        for name in ("pack", "step", "kernels"):
            argv = by[name]
            assert argv[argv.index("--out") + 1] == str(tmp_path), name
        assert all(dict(s.env).get("TRITON_INTERPRET") == "0" for s in steps)
        for s in steps:  # every script the plan names exists
            assert (ROOT / s.argv[1]).exists() or s.argv[1] == "-m"


def test_run_logs_every_step_and_reports_failures(tmp_path):
    steps = [gpu_check.Step("ok", ("python", "-c", "print('fine')")),
             gpu_check.Step("bad", ("python", "-c", "import sys; print('broken'); sys.exit(3)"))]
    summary = gpu_check.run(steps, tmp_path)
    assert summary["steps"]["ok"]["returncode"] == 0
    assert summary["steps"]["bad"]["returncode"] == 3  # a failure does not stop the rest
    assert (tmp_path / "ok.log").read_text().strip() == "fine"
    assert (tmp_path / "bad.log").read_text().strip() == "broken"
    assert (tmp_path / "summary.json").exists()


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="checks the refusal without 2 GPUs")
def test_step_benchmark_refuses_more_nccl_ranks_than_gpus(capsys):
    bench_step = _load("bench_step")
    with pytest.raises(SystemExit) as e:
        bench_step.main(["--backend", "nccl", "--world", "2", "--out", "/nonexistent/never"])
    assert e.value.code == 2
    assert "needs 2 GPUs" in capsys.readouterr().err
