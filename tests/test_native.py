"""The native (C++) gradient-ready hooks against the Python ones and DDP.

The rest of the suite runs with the native hooks (the default where the extension builds);
here the Python hooks are held to DDP as well, the native path is shown to take the
per-gradient work off Python, and a machine that cannot build the extension falls back.
"""

import os

import pytest
import torch
import torch.distributed as dist

import tribucket
from tribucket.ddp import native
from tribucket.ddp.native import NO_NATIVE
from models import build, batch, loss_of
from test_reducer import CASES, _parity_many

needs_native = pytest.mark.skipif(native.load() is None,
                                  reason=f"native hooks unavailable: {native.unavailable_reason()}")


def test_python_hooks_match_ddp(dist_run):
    cases = [(n, d, dict(t, native_hooks=False)) for n, d, t in CASES]
    dist_run(_parity_many, cases, world_size=2, timeout=240)
    no_sync = [c for c in cases if c[0] in ("mlp", "branchy", "bn")]
    dist_run(_parity_many, no_sync, no_sync_every=3, world_size=2, timeout=240)


class _Counting:
    """A GradHook that counts the calls reaching it."""

    def __init__(self, hook, calls):
        self.hook, self.calls = hook, calls

    def __call__(self, param):
        self.calls.append(self.hook.index)
        return self.hook(param)

    def __getattr__(self, name):
        return getattr(self.hook, name)


def _python_calls_per_step(bucket_cap_mb):
    """Calls reaching the Python per-gradient hook in one step, after the rebuild."""
    model = build("mlp", seed=0)
    with tribucket.fused_bucketing(model, bucket_cap_mb=bucket_cap_mb) as reducer:
        bw = reducer._bw
        calls = []
        for step in range(3):
            if step == 2:  # count what the native path hands to Python
                bw.grad_hooks = [_Counting(h, calls) for h in bw.grad_hooks]
            loss_of(model(batch("mlp", dist.get_rank(), step))).backward()
            model.zero_grad()
        n_params = len(list(model.parameters()))
        return bw.native is not NO_NATIVE, len(calls), n_params, len(bw.buckets)


@needs_native
def test_native_hooks_keep_gradients_out_of_python(dist_run):
    for used, calls, n_params, n_buckets in dist_run(_python_calls_per_step, 0.001,
                                                      world_size=2):
        assert used
        assert n_buckets > 1
        # only the first gradient of the pass (it starts the pass) goes through Python
        assert calls == 1, (calls, n_params)


@needs_native
@pytest.mark.parametrize("path", ["complete", "fallback"])
def test_python_error_in_a_hook_callback_keeps_its_type(path):
    """An exception raised by the Python side of a native hook (a bucket's launch, or the
    Python hook) reaches backward()'s caller as itself, as from a Python hook."""
    w = torch.nn.Parameter(torch.ones(3))

    def fail(i):
        raise ValueError(f"{path} {i} failed on purpose")

    ext = native.load()
    hooks = ext.Hooks([w], fail, fail)
    hooks.layout([0], 1)
    if path == "complete":  # counted natively: the bucket's completion calls Python
        ready = bytearray(1)
        hooks.begin(torch.frombuffer(ready, dtype=torch.uint8), [1], [1], False)
    with pytest.raises(ValueError, match=f"{path} 0 failed on purpose"):
        (w * 2).sum().backward()
    assert hooks.end() == ([0] if path == "complete" else [0])
    hooks.remove()
    assert ext.post_hook_count(w) == 0
    (w * 2).sum().backward()  # no hook left: nothing raises
    assert torch.equal(w.grad, torch.full((3,), 4.0))


def _without_extension(required):
    saved = native._module, native._error
    native._module, native._error = None, "OSError: no C++ compiler"
    try:
        model = build("mlp", seed=0)
        ref = build("mlp", seed=0)
        try:
            reducer = tribucket.Reducer(model, native_hooks=required)
        except RuntimeError as e:
            return "error", str(e)
        with reducer:
            hooks = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
            x = batch("mlp", 0, 0)
            loss_of(model(x)).backward()
            loss_of(ref(x)).backward()
            for p in ref.parameters():
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
            same = all(torch.allclose(a.grad, b.grad, rtol=1e-6, atol=1e-7)
                       for a, b in zip(model.parameters(), ref.parameters()))
            return "python", (reducer._bw.native is NO_NATIVE, hooks, same)
    finally:
        native._module, native._error = saved


def test_unbuildable_extension_falls_back_or_raises(dist_run):
    n_params = len(list(build("mlp").parameters()))
    for kind, detail in dist_run(_without_extension, None, world_size=2):
        assert kind == "python" and detail == (True, n_params, True)
    for kind, detail in dist_run(_without_extension, True, world_size=2):
        assert kind == "error"
        assert "native_hooks=True" in detail and "no C++ compiler" in detail


def test_native_hooks_option_is_checked():
    with pytest.raises(TypeError, match="native_hooks"):
        tribucket.ReducerConfig(native_hooks="yes")


def _dropped_model_is_collected(native_hooks):
    import gc
    import weakref

    def train_and_drop():
        model = build("mlp", seed=0)
        reducer = tribucket.Reducer(model, native_hooks=native_hooks)  # never closed
        loss_of(model(batch("mlp", dist.get_rank(), 0))).backward()
        return weakref.ref(model), weakref.ref(reducer._bw)

    model, bw = train_and_drop()
    gc.collect()
    return model() is None, bw() is None


@pytest.mark.parametrize("native_hooks", [None, False])
def test_a_dropped_model_and_its_reducer_are_collected(dist_run, native_hooks):
    """Nothing the hooks hold keeps a model, its gradients' buckets or the process group's
    users alive once the script drops them (no close() needed)."""
    for result in dist_run(_dropped_model_is_collected, native_hooks, world_size=2):
        assert result == (True, True)


def _reducer_lives_with_its_model(native_hooks):
    import gc

    model, ref = build("mlp", seed=0), build("mlp", seed=0)
    tribucket.Reducer(model, native_hooks=native_hooks)  # the only reference is dropped
    gc.collect()
    x = batch("mlp", dist.get_rank(), 0)
    loss_of(model(x)).backward()
    loss_of(ref(x)).backward()
    for p in ref.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    return all(torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-6)
               for a, b in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("native_hooks", [None, False])
def test_a_reducer_lives_as_long_as_its_model(dist_run, native_hooks):
    """As DDP's hooks do: dropping the reducer object does not stop the averaging."""
    assert dist_run(_reducer_lives_with_its_model, native_hooks, world_size=2) == [True, True]


class _FailOnce(torch.autograd.Function):
    """Identity whose backward raises while ``armed``: a backward that fails after it
    started (the reducer saw it begin) and before any parameter gradient."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if _FailOnce.armed:
            raise ValueError("backward failed on purpose")
        return g


class _Head(torch.nn.Module):
    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, x):
        return _FailOnce.apply(self.body(x))


def _after_a_failed_backward(native_hooks):
    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = _Head(build("mlp", seed=0)), _Head(build("mlp", seed=0))
    errors = []
    with tribucket.fused_bucketing(model, bucket_cap_mb=0.001, native_hooks=native_hooks):
        for step in range(5):
            _FailOnce.armed = step == 2  # after the rebuild: passes are plain
            try:
                loss_of(model(batch("mlp", rank, step))).backward()
            except (ValueError, RuntimeError) as e:
                errors.append((step, type(e).__name__))
            finally:
                _FailOnce.armed = False
            if step > 2:  # the steps after the failure average as usual
                loss_of(ref(batch("mlp", rank, step))).backward()
                for p in ref.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= world
                if not all(torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-6)
                           for a, b in zip(model.parameters(), ref.parameters())):
                    errors.append((step, "gradients differ from the average"))
            model.zero_grad()
            ref.zero_grad()
    return errors


@pytest.mark.parametrize("native_hooks", [None, False])
def test_steps_after_a_failed_backward_average(dist_run, native_hooks):
    for errors in dist_run(_after_a_failed_backward, native_hooks, world_size=2, timeout=60):
        assert errors == [(2, "ValueError")], errors


# ---------------------------------------------------------------- building without blocking
class _FakeBuilds:
    """Stand in for the compiler (a real build takes minutes here): ``native._build`` copies
    the extension already built into the folder after ``delay`` seconds (or raises), and
    ``native.build_dir`` points at an empty folder, as on a fresh machine."""

    def __init__(self, folder, delay=0.0, fail=None):
        import pathlib

        self.real = native.load()
        self.folder, self.delay, self.fail = pathlib.Path(folder), delay, fail

    def __enter__(self):
        import sys

        self.saved = (native._module, native._error, native._building, native.build_dir,
                      native._build, native.BUILD_COMMAND)
        native._module = native._error = native._building = None
        native.build_dir = lambda: self.folder
        native._build = self.build
        # the background build is a process of its own: the same stand-in, as a command
        self.folder.mkdir(parents=True, exist_ok=True)
        target = self.folder / f"{native._NAME}.so"
        native.BUILD_COMMAND = [sys.executable, "-c", (
            "import shutil, sys, time\n"
            f"open({str(self.folder / 'builds.log')!r}, 'a').write('background\\n')\n"
            f"time.sleep({self.delay})\n"
            + (f"print({self.fail!r}); sys.exit(1)\n" if self.fail else
               # whole or absent, as the real build's rename makes it: a copy in place
               # could be mapped half-written by a rank that saw the name (SIGBUS)
               f"shutil.copy({self.real.__file__!r}, {str(target) + '.part'!r})\n"
               f"import os; os.replace({str(target) + '.part'!r}, {str(target)!r})\n"))]
        return self

    def build(self, where):
        import shutil
        import time

        with open(where / "builds.log", "a") as log:
            log.write(f"{dist.get_rank()}\n")
        time.sleep(self.delay)
        if self.fail:
            raise RuntimeError(self.fail)
        part = where / f"{native._NAME}.so.part"
        shutil.copy(self.real.__file__, part)
        os.replace(part, where / f"{native._NAME}.so")  # (whole or absent, as above)
        return self.real

    def __exit__(self, *exc):
        if native._building is not None:
            native._building.wait(60)
        (native._module, native._error, native._building, native.build_dir,
         native._build, native.BUILD_COMMAND) = self.saved


def _trains_while_building(folder):
    """A fresh machine: the first step runs at once on the Python hooks, the reducer moves
    to the native hooks once the build is over, and the gradients match DDP's throughout."""
    import time

    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    with _FakeBuilds(f"{folder}/{rank}", delay=1.5):
        mine, theirs = build("mlp", seed=0), build("mlp", seed=0)
        ddp = DDP(theirs)
        kinds, first_step_s = [], None
        t0 = time.perf_counter()
        with tribucket.fused_bucketing(mine) as reducer:
            for step in range(40):
                x = batch("mlp", rank, step)
                loss_of(mine(x)).backward()
                if first_step_s is None:
                    first_step_s = time.perf_counter() - t0
                loss_of(ddp(x)).backward()
                assert all(torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-6)
                           for a, b in zip(mine.parameters(), theirs.parameters())), step
                kinds.append(reducer._bw.native is not NO_NATIVE)
                mine.zero_grad()
                theirs.zero_grad()
                both = torch.tensor([float(kinds[-1])])
                dist.all_reduce(both, op=dist.ReduceOp.MIN)  # ranks leave the loop together
                if both.item() and step > 2:
                    break
                time.sleep(0.1)
    return kinds, first_step_s


@needs_native
def test_training_starts_while_the_hooks_build(dist_run, tmp_path):
    for kinds, first_step_s in dist_run(_trains_while_building, str(tmp_path), world_size=2):
        assert not kinds[0], "the first step waited for the build"
        assert kinds[-1], f"never switched to the native hooks: {kinds}"
        assert kinds == sorted(kinds), kinds  # Python, then native: switched once
        assert first_step_s < 1.5, first_step_s  # before the (fake) compiler finished


def _one_build_for_two_processes(folder):
    with _FakeBuilds(folder, delay=1.0):
        ext = native.load()
        with open(f"{folder}/builds.log") as log:
            return ext is not None, log.read().split()


@needs_native
def test_processes_sharing_a_cache_build_once(dist_run, tmp_path):
    results = dist_run(_one_build_for_two_processes, str(tmp_path), world_size=2)
    assert [ok for ok, _ in results] == [True, True]
    assert len(results[0][1]) == 1, results  # one compile; the other process imported it


def _failing_build(folder, required):
    """A compiler that fails, with a stale torch lock file left in the folder by a build
    that was killed: training goes on on the Python hooks (or native_hooks=True raises)."""
    import os
    import time

    os.makedirs(f"{folder}/build", exist_ok=True)
    open(f"{folder}/build/lock", "w").close()
    with _FakeBuilds(folder, delay=0.2, fail="c++: internal compiler error"):
        model = build("mlp", seed=0)
        try:
            with tribucket.fused_bucketing(model, native_hooks=required) as reducer:
                for step in range(8):
                    loss_of(model(batch("mlp", dist.get_rank(), step))).backward()
                    model.zero_grad()
                    time.sleep(0.1)
                return "python", reducer._bw.native is NO_NATIVE
        except RuntimeError as e:
            return "error", str(e)


@needs_native
def test_a_failing_build_never_blocks_training(dist_run, tmp_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for kind, detail in dist_run(_failing_build, str(tmp_path / "a"), None, world_size=2):
            assert (kind, detail) == ("python", True)
        for kind, detail in dist_run(_failing_build, str(tmp_path / "b"), True, world_size=2):
            assert kind == "error" and "internal compiler error" in detail, detail


def _unwritable_cache(required):
    import os

    saved = (native._module, native._error, native._building, os.environ.get(
        "TORCH_EXTENSIONS_DIR"))
    native._module = native._error = native._building = None
    os.environ["TORCH_EXTENSIONS_DIR"] = "/dev/null/cache"  # under a file: never writable
    try:
        model = build("mlp", seed=0)
        try:
            with tribucket.fused_bucketing(model, native_hooks=required) as reducer:
                loss_of(model(batch("mlp", dist.get_rank(), 0))).backward()
                if native._building is not None:
                    native._building.wait(60)
                loss_of(model(batch("mlp", dist.get_rank(), 1))).backward()
                return "python", reducer._bw.native is NO_NATIVE
        except RuntimeError as e:
            return "error", str(e)
    finally:
        if native._building is not None:
            native._building.wait(60)
        native._module, native._error, native._building, env = saved
        os.environ.pop("TORCH_EXTENSIONS_DIR")
        if env is not None:
            os.environ["TORCH_EXTENSIONS_DIR"] = env


def _unwritable_cache_warnings(required):
    import warnings
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        outcome = _unwritable_cache(required)
    return outcome, [str(w.message) for w in seen if "native gradient hooks" in str(w.message)]


def test_native_hooks_required_does_not_announce_the_python_hooks(dist_run):
    # before: native_hooks=True warned "using the Python hooks", then raised
    for (kind, detail), said in dist_run(_unwritable_cache_warnings, True, world_size=2):
        assert kind == "error" and "native_hooks=True" in detail, detail
        assert not any("using the Python hooks" in w for w in said), said
    for (kind, _), said in dist_run(_unwritable_cache_warnings, None, world_size=2):
        assert kind == "python" and any("using the Python hooks" in w for w in said), said


def test_an_unwritable_cache_falls_back_or_raises(dist_run):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for kind, detail in dist_run(_unwritable_cache, None, world_size=2):
            assert (kind, detail) == ("python", True)
        for kind, detail in dist_run(_unwritable_cache, True, world_size=2):
            assert kind == "error" and "native_hooks=True" in detail, detail


def _required_but_missing_on_one_rank():
    """native_hooks=True where rank 1 cannot build them: every rank raises at construction,
    naming rank 1 (none is left waiting in its first backward)."""
    rank = dist.get_rank()
    saved = native._module, native._error
    if rank == 1:
        native._module, native._error = None, "OSError: no C++ compiler"
    try:
        model = build("mlp", seed=0)
        with tribucket.fused_bucketing(model, native_hooks=True):
            loss_of(model(batch("mlp", rank, 0))).backward()
    except RuntimeError as e:
        return str(e)
    finally:
        native._module, native._error = saved
    return None


@needs_native
def test_required_native_hooks_missing_on_one_rank_raise_everywhere(dist_run):
    for msg in dist_run(_required_but_missing_on_one_rank, world_size=2, timeout=60):
        assert msg is not None and "rank 1" in msg and "no C++ compiler" in msg, msg


def test_build_report_builds_nothing_even_with_quiet(capsys, monkeypatch):
    """``--report`` means build nothing: with ``--quiet`` too it is refused (exit 2), not
    taken for a quiet build."""
    from tribucket import build as build_cli

    monkeypatch.setattr(native, "load", lambda: pytest.fail("--report built the hooks"))
    with pytest.raises(SystemExit) as exc:
        build_cli.main(["--report", "--quiet"])
    assert exc.value.code == 2
    assert "--report" in capsys.readouterr().err


def test_build_report_names_the_compiler_torch_uses(capsys, monkeypatch):
    """torch's extension builder compiles with $CXX when it is set: the report says so."""
    from tribucket import build as build_cli

    monkeypatch.setenv("CXX", "/opt/my-g++")
    assert build_cli.main(["--report"]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("C++ compiler"))
    assert "/opt/my-g++" in line, line
