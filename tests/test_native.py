"""The native (C++) gradient-ready hooks against the Python ones and DDP.

The rest of the suite runs with the native hooks (the default where the extension builds);
here the Python hooks are held to DDP as well, the native path is shown to take the
per-gradient work off Python, and a machine that cannot build the extension falls back.
"""

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
        hooks.begin(torch.frombuffer(ready, dtype=torch.uint8), [1], [1])
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
