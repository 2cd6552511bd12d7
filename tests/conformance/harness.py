"""Run one of torch's own DDP tests (``DistributedTest._DistTestBase`` in torch's installed
``torch/testing/_internal/distributed/distributed_test.py``) through torch's DDP or
``tribucket.DistributedDataParallel``, the way torch's driver
(``test/distributed/test_distributed_spawn.py``) runs it: gloo, ``WORLD_SIZE`` ranks, a
test class built from ``TestDistBackend`` + ``_DistTestBase``.

Two configurations:

* ``cpu``: torch's own CPU configuration: tests gated on GPUs are skipped;
* ``gpu``: the GPU-gated tests run on the CPU: ``skip_if_lt_x_gpu`` and its friends are
  lifted, every CUDA device a test names (``"cuda:1"``, ``torch.device("cuda", 1)``, a bare
  device index) is mapped to the CPU, and ``torch.cuda``'s device calls answer as a machine
  with one device per rank would. DDP's ``device_ids`` / ``output_device`` are dropped for
  the CPU module (DDP refuses them there), for both implementations alike.

``python harness.py --impl tribucket --config gpu --tests test_ddp_create_graph,... --out-dir d``
imports torch's tests once, then runs each test in a process tree of its own (forked, its
ranks forked from it) under a timeout, and writes ``d/<test>.json``:
``{"status": "pass" | "fail" | "skip", "detail": ..., "seconds": ...}``. ``gates(config,
names)`` says, without running anything, which tests that configuration skips and why.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import tempfile
import traceback

WORLD_SIZE = 2

#: torch's GPU gates (in common_distributed); lifted in the "gpu" configuration
_GPU_GATES = ("skip_if_lt_x_gpu", "skip_if_no_gpu", "nccl_skip_if_lt_x_gpu",
              "require_n_gpus_for_nccl_backend")


def _source_path() -> str:
    import importlib.util
    spec = importlib.util.find_spec("torch.testing._internal.distributed.distributed_test")
    return spec.origin


def ddp_tests() -> list[str]:
    """The DDP tests of ``_DistTestBase``, read from its source without importing it: those
    whose name names DDP, and those whose body (or a helper it calls) builds one."""
    src = open(_source_path()).read()
    tree = ast.parse(src)
    base = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)
                and n.name == "_DistTestBase")
    funcs = {f.name: f for f in base.body if isinstance(f, ast.FunctionDef)}
    lines = src.splitlines()
    text = {n: "\n".join(lines[f.lineno - 1:f.end_lineno]) for n, f in funcs.items()}

    def builds_ddp(name: str, seen: set) -> bool:
        if name in seen or name not in funcs:
            return False
        seen.add(name)
        f = funcs[name]
        if "DistributedDataParallel" in text[name]:
            return True
        return any(isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                   and n.value.id == "self" and builds_ddp(n.attr, seen)
                   for n in ast.walk(f))

    return sorted(n for n in funcs if n.startswith("test_") and (
        "ddp" in n.lower() or "distributeddataparallel" in n.lower() or builds_ddp(n, set())))


# ------------------------------------------------------------------ environment and patches
def _environment() -> None:
    os.environ.setdefault("BACKEND", "gloo")
    os.environ.setdefault("WORLD_SIZE", str(WORLD_SIZE))
    os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="tribucket-conformance-"))


def _gate_decorators(config: str) -> None:
    """Replace torch's GPU gates before distributed_test imports them: each marks the test
    (``_conformance_gate``); under "cpu" it still skips at run time as torch's does, under
    "gpu" it runs the test."""
    from torch.testing._internal import common_distributed as cd

    def marking(name: str, original):
        def factory(*args, **kwargs):
            def decorator(func):
                gated = func if config == "gpu" else original(*args, **kwargs)(func)
                # the nccl_ variants gate nothing under gloo
                if not (name.startswith(("nccl_", "require_n_gpus_for_nccl"))
                        and "nccl" not in args):
                    gated._conformance_gate = f"{name}({', '.join(map(repr, args))})"
                return gated
            return decorator
        return factory

    for name in _GPU_GATES:
        original = getattr(cd, name)
        if name == "skip_if_no_gpu":  # used bare: @skip_if_no_gpu
            def bare(func, _original=original, _name=name):
                gated = func if config == "gpu" else _original(func)
                gated._conformance_gate = _name
                return gated
            setattr(cd, name, bare)
        else:
            setattr(cd, name, marking(name, original))


def _map_cuda_to_cpu() -> None:
    """Make the GPU-gated tests run on the CPU: device arguments naming CUDA become the CPU,
    ``torch.cuda``'s device calls answer as a machine with one device per rank."""
    import torch
    from torch.overrides import TorchFunctionMode

    def cpu_device(d):
        if isinstance(d, torch.device):
            return torch.device("cpu") if d.type == "cuda" else d
        if isinstance(d, str) and d.startswith("cuda"):
            return torch.device("cpu")
        if isinstance(d, int) and not isinstance(d, bool):
            return torch.device("cpu")
        return d

    class CudaToCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if "device" in kwargs:
                kwargs["device"] = cpu_device(kwargs["device"])
            name = getattr(func, "__name__", "")
            if name == "cuda":  # Tensor.cuda(device): stays where it is (the CPU)
                return args[0]
            if name == "to" and len(args) > 1 and not isinstance(args[1], (torch.dtype, torch.Tensor)):
                args = (args[0], cpu_device(args[1]), *args[2:])
            return func(*args, **kwargs)

    # nn.Module.to parses its arguments itself (no torch function sees "cuda:1")
    module_to = torch.nn.Module.to

    def to(self, *args, **kwargs):
        if args and not isinstance(args[0], (torch.dtype, torch.Tensor)):
            args = (cpu_device(args[0]), *args[1:])
        if "device" in kwargs:
            kwargs["device"] = cpu_device(kwargs["device"])
        return module_to(self, *args, **kwargs)

    torch.nn.Module.to = to
    torch.nn.Module.cuda = lambda self, device=None: self
    torch.accelerator.current_device_index = lambda: 0
    torch.accelerator.device_count = lambda: WORLD_SIZE
    torch.cuda.device_count = lambda: WORLD_SIZE
    torch.cuda.current_device = lambda: 0
    for name in ("set_device", "synchronize", "empty_cache", "manual_seed", "manual_seed_all",
                 "reset_peak_memory_stats"):
        setattr(torch.cuda, name, lambda *a, **k: None)
    mode = CudaToCpu()
    mode.__enter__()  # for the rest of this process (forked ranks inherit it)


def _drop_cpu_device_ids(cls):
    """``cls`` with ``device_ids`` / ``output_device`` dropped for a module on the CPU (the
    "gpu" configuration maps the tests' GPUs to the CPU, where DDP refuses them)."""

    class Mapped(cls):
        def __init__(self, module, device_ids=None, output_device=None, *args, **kwargs):
            on_cpu = all(p.device.type == "cpu" for p in module.parameters())
            if on_cpu:
                device_ids, output_device = None, None
            super().__init__(module, device_ids, output_device, *args, **kwargs)

    # picklable by reference (torch.save of a wrapped model), under a name of its own
    Mapped.__name__ = Mapped.__qualname__ = f"Mapped{cls.__name__}"
    Mapped.__module__ = __name__
    globals()[Mapped.__name__] = Mapped
    return Mapped


def load(impl: str, config: str):
    """Patch, import distributed_test, and return (the spawn test class, the module)."""
    _environment()
    _gate_decorators(config)
    import torch
    import torch.nn.parallel
    import torch.nn.parallel.distributed

    if impl == "tribucket":
        import tribucket
        cls = tribucket.DistributedDataParallel
    elif impl == "ddp":
        cls = torch.nn.parallel.DistributedDataParallel
    else:
        raise ValueError(f"impl must be 'ddp' or 'tribucket', got {impl!r}")
    if config == "gpu":
        cls = _drop_cpu_device_ids(cls)
    elif config != "cpu":
        raise ValueError(f"config must be 'cpu' or 'gpu', got {config!r}")
    torch.nn.parallel.DistributedDataParallel = cls
    from torch.testing._internal.distributed import distributed_test as dt
    dt.DistributedDataParallel = cls

    class TestDistBackendWithSpawn(dt.TestDistBackend, dt.DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            # fork, not spawn: the ranks inherit the patches and the imports (a spawn
            # re-imports torch in every rank)
            import torch.multiprocessing as tmp
            self._start_processes(tmp.get_context("fork").Process)

        @classmethod
        def _run(cls, rank, test_name, file_name, pipe, **kwargs):
            if config == "gpu":
                _map_cuda_to_cpu()
            super()._run(rank, test_name, file_name, pipe, **kwargs)

    return TestDistBackendWithSpawn, dt


def gates(config: str, names: list[str]) -> dict[str, str]:
    """Which of ``names`` the configuration skips, and why, decided before spawning: torch's
    ``unittest`` skips (disabled tests, other backends) and, under "cpu", the GPU gates."""
    cls, _ = load("ddp", config)
    out = {}
    for name in names:
        fn = getattr(cls, name)
        if getattr(fn, "__unittest_skip__", False):
            out[name] = "skipped by torch: " + str(getattr(fn, "__unittest_skip_why__", ""))
        elif config == "cpu" and getattr(fn, "_conformance_gate", None):
            out[name] = "needs GPUs: " + fn._conformance_gate
    return out


def _run_in_this_process(cls, test: str) -> dict:
    import unittest

    result = unittest.TestResult()
    cls(test).run(result)
    if result.skipped:
        return {"status": "skip", "detail": result.skipped[0][1]}
    problems = result.failures + result.errors
    if problems:
        return {"status": "fail", "detail": problems[0][1]}
    if result.testsRun != 1:
        return {"status": "fail", "detail": f"ran {result.testsRun} tests"}
    return {"status": "pass", "detail": ""}


def serve(impl: str, config: str, tests: list[str], out_dir: str, timeout: float) -> None:
    """Import once, then run each test in a process tree of its own, forked from this one
    (a process group: its ranks are killed with it), under ``timeout`` seconds; write
    ``out_dir/<test>.json``."""
    import signal
    import time

    cls, _ = load(impl, config)
    from torch.testing._internal import common_distributed as cd
    if impl == "tribucket":
        from tribucket.ddp import native
        native.load()  # build or load the native hooks once; every test inherits them
    for test in tests:
        path = os.path.join(out_dir, f"{test}.json")
        start = time.monotonic()
        # torch gives its longest tests a longer watchdog (400-500 s on its CI machines);
        # on a shared machine give them twice that, and torch's watchdog as much
        limit = max(timeout, 2 * cd.TIMEOUT_OVERRIDE.get(test, 0))
        cd.TIMEOUT_OVERRIDE[test] = limit - 10  # torch reports first, with the stacks
        pid = os.fork()
        if pid == 0:  # the test's own process tree
            os.setpgid(0, 0)
            try:
                res = _run_in_this_process(cls, test)
            except BaseException:  # noqa: BLE001 - recorded as a failure
                res = {"status": "fail", "detail": "harness: " + traceback.format_exc()}
            with open(path, "w") as f:
                json.dump(res, f)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        status = None
        while time.monotonic() - start < limit:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.1)
        else:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            res = {"status": "fail", "detail": f"timed out after {limit:.0f} s (killed)"}
            with open(path, "w") as f:
                json.dump(res, f)
        try:  # ranks left behind by a test that failed early
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if not os.path.exists(path):
            with open(path, "w") as f:
                json.dump({"status": "fail", "detail": f"the test process exited ({status}) "
                           "without a result"}, f)
        with open(path) as f:
            res = json.load(f)
        res["seconds"] = round(time.monotonic() - start, 1)
        with open(path, "w") as f:
            json.dump(res, f)
        print(f"{impl} {config} {test}: {res['status']} ({res['seconds']} s)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impl", choices=["ddp", "tribucket"], required=True)
    ap.add_argument("--config", choices=["cpu", "gpu"], required=True)
    ap.add_argument("--tests", required=True, help="comma-separated test names")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--timeout", type=float, default=120.0)
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    serve(args.impl, args.config, args.tests.split(","), args.out_dir, args.timeout)
    sys.stdout.flush()
    os._exit(0)  # no atexit handlers of torch's test utilities


if __name__ == "__main__":
    main()
