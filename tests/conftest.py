"""Suite-wide set-up: the Triton interpreter on CPU-only machines, the gloo worker pools,
and a guard so a run in which nothing passed can never look green."""

from __future__ import annotations

import os
import sys

import pytest
import torch

# @triton.jit reads TRITON_INTERPRET when a kernel module is imported, so this must happen
# before anything imports tribucket.kernels. Workers spawned by the pool inherit it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(__file__))
import _dist  # noqa: E402

try:  # hypothesis profiles: "ci" (the default here) and "dev" (quick local runs)
    from hypothesis import HealthCheck, settings

    settings.register_profile("ci", max_examples=300, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("dev", max_examples=50, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # pragma: no cover
    pass


@pytest.fixture
def dist_run():
    """``dist_run(fn, *args, world_size=2, timeout=120, **kwargs)`` -> per-rank results."""
    return _dist.run


def pytest_collection_finish(session):
    """The machine-code tests compile every kernel specialization for the GPU targets (about a
    minute of CPU on a fresh machine): start that now, at the lowest priority, so it runs on
    the cores the distributed tests leave idle while they wait on their peers; the tests'
    fixture then waits for it (or finds the cache already filled)."""
    if not any(item.path.name == "test_kernel_compile.py" for item in session.items):
        return
    from tribucket import kernels

    if kernels.triton_available():
        from tribucket.kernels import machine_code

        machine_code.compile_in_background()


def pytest_sessionfinish(session, exitstatus):
    _dist.close_all()
    if "tribucket.kernels.machine_code" in sys.modules:
        sys.modules["tribucket.kernels.machine_code"].stop_background()
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    passed = len(reporter.stats.get("passed", [])) if reporter else 0
    if exitstatus == 0 and passed == 0:
        # Everything skipped or deselected: that is not a green run.
        session.exitstatus = 1
        if reporter:
            reporter.write_line("tribucket: no test passed (all skipped?) - failing the run",
                                red=True)
