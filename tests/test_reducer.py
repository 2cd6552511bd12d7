"""fused_bucketing against torch DDP: gradients, parameters, layouts, errors, hooks."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import tribucket
from models import batch, build, loss_of

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-9, atol=1e-12),
       torch.bfloat16: dict(rtol=1.6e-2, atol=1e-3)}


def assert_grads_equal(model_a, model_b, what=""):
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        if b.grad is None:
            assert a.grad is None, f"{what}{name}: DDP left .grad None, tribucket set it"
            continue
        assert a.grad is not None, f"{what}{name}: tribucket left .grad None, DDP set it"
        g = a.grad.to_dense() if a.grad.is_sparse else a.grad
        h = b.grad.to_dense() if b.grad.is_sparse else b.grad
        torch.testing.assert_close(g, h, **TOL[a.dtype], msg=lambda m: f"{what}{name}: {m}")


def assert_states_equal(model_a, model_b, what=""):
    for (name, a), b in zip(model_a.state_dict().items(), model_b.state_dict().values()):
        if a.is_floating_point():
            torch.testing.assert_close(a, b, **TOL[a.dtype], msg=lambda m: f"{what}{name}: {m}")
        else:
            assert torch.equal(a, b), f"{what}{name} differs"


def _parity(name, steps=5, ddp_kwargs=None, tb_kwargs=None, no_sync_every=0,
            set_to_none=True, optim="sgd"):
    """Train the same model under tribucket and DDP on the same data; compare every step."""
    rank = dist.get_rank()
    ddp_kwargs = dict(ddp_kwargs or {})
    tb_kwargs = dict(tb_kwargs or {})
    mine = build(name, seed=rank)       # different on every rank: entering broadcasts rank 0's
    theirs = build(name, seed=rank)
    ddp = DDP(theirs, **ddp_kwargs)
    make = (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)) if optim == "sgd" else \
        (lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    opt_a, opt_b = make(mine.parameters()), make(theirs.parameters())
    with tribucket.fused_bucketing(mine, **tb_kwargs) as reducer:
        assert_states_equal(mine, theirs, "after entering: ")
        for step in range(steps):
            x = batch(name, rank, step)
            local = bool(no_sync_every) and step % no_sync_every != no_sync_every - 1
            with reducer.no_sync() if local else contextlib.nullcontext():
                loss_of(mine(x)).backward()
            with ddp.no_sync() if local else contextlib.nullcontext():
                loss_of(ddp(x)).backward()
            assert_grads_equal(mine, theirs, f"step {step}: ")
            if not local:
                opt_a.step()
                opt_b.step()
                opt_a.zero_grad(set_to_none=set_to_none)
                opt_b.zero_grad(set_to_none=set_to_none)
        assert_states_equal(mine, theirs, "after training: ")
        return dict(stats=reducer.stats.as_dict(), layout=reducer.layout.bucket_indices())


CASES = [
    ("mlp", dict(bucket_cap_mb=0.001), dict(bucket_cap_mb=0.001)),
    ("mlp_wide", {}, {}),
    ("transformer", dict(bucket_cap_mb=0.005), dict(bucket_cap_mb=0.005)),
    ("tied", dict(bucket_cap_mb=0.001), dict(bucket_cap_mb=0.001)),
    ("bn", dict(bucket_cap_mb=0.001), dict(bucket_cap_mb=0.001)),
    ("bn_channels_last", dict(bucket_cap_mb=0.001), dict(bucket_cap_mb=0.001)),
    ("branchy", dict(find_unused_parameters=True, bucket_cap_mb=0.0005),
     dict(find_unused_parameters=True, bucket_cap_mb=0.0005)),
    ("mixed", dict(bucket_cap_mb=0.0005), dict(bucket_cap_mb=0.0005)),
    ("frozen", {}, {}),
    ("one", {}, {}),
    ("ckpt", dict(bucket_cap_mb=0.0005), dict(bucket_cap_mb=0.0005)),
    ("ckpt_reentrant", dict(static_graph=True, bucket_cap_mb=0.0005),
     dict(static_graph=True, bucket_cap_mb=0.0005)),
    ("sparse", {}, {}),
    # the averaging allreduce sent in chunks as their gradients arrive (tiny chunks here)
    ("mlp", dict(bucket_cap_mb=0.002), dict(bucket_cap_mb=0.002, comm_chunk_mb=0.0003)),
    ("transformer", dict(bucket_cap_mb=0.005), dict(bucket_cap_mb=0.005, comm_chunk_mb=0.001)),
    ("branchy", dict(find_unused_parameters=True), dict(find_unused_parameters=True,
                                                        comm_chunk_mb=0.0002)),
]


def _parity_many(cases, eager=None, **kw):
    """Run the cases; ``eager="0"`` forces the one-launch bucket pack (the GPU strategy)."""
    import os

    old = os.environ.get("TRIBUCKET_EAGER_PACK")
    if eager is not None:
        os.environ["TRIBUCKET_EAGER_PACK"] = eager
    try:
        return [_parity(name, ddp_kwargs=d, tb_kwargs=t, **kw) for name, d, t in cases]
    finally:
        if eager is not None:
            if old is None:
                del os.environ["TRIBUCKET_EAGER_PACK"]
            else:
                os.environ["TRIBUCKET_EAGER_PACK"] = old


@pytest.mark.parametrize("world_size", [2, 3])
def test_parity_with_ddp(dist_run, world_size):
    results = dist_run(_parity_many, CASES, world_size=world_size, timeout=240)
    for (name, _, _), res in zip(CASES, results[0]):
        assert res["stats"]["iterations"] == 5, name
    # every rank ended with the same layout
    assert all(r[k]["layout"] == results[0][k]["layout"] for r in results
               for k in range(len(CASES)))



def _config_object():
    """``fused_bucketing(model, config=ReducerConfig(...))`` as documented; the same options
    given both ways are refused, naming them."""
    config = tribucket.ReducerConfig(bucket_cap_mb=0.001, static_graph=True)
    model = build("mlp")
    with tribucket.fused_bucketing(model, config=config) as reducer:
        loss_of(model(batch("mlp", dist.get_rank(), 0))).backward()
        got = (reducer.config is config, reducer.bucket_bytes_cap, reducer.static_graph)
    try:
        tribucket.fused_bucketing(build("mlp"), bucket_cap_mb=5, config=config)
        both = None
    except TypeError as e:
        both = str(e)
    return got, both


def test_fused_bucketing_takes_a_config_object(dist_run):
    # before, fused_bucketing passed its own keyword defaults beside config= and the
    # reducer refused the pair: "pass either config= or keyword options, not both"
    for got, both in dist_run(_config_object, world_size=2):
        assert got == (True, int(0.001 * 2**20), True), got
        assert both is not None and "not both: ['bucket_cap_mb']" in both, both

@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradient_as_bucket_view(dist_run, set_to_none):
    cases = [(n, dict(d, gradient_as_bucket_view=True), dict(t, gradient_as_bucket_view=True))
             for n, d, t in CASES if n in ("mlp", "mixed", "branchy", "bn", "bn_channels_last")]
    dist_run(_parity_many, cases, set_to_none=set_to_none, world_size=2, timeout=240)


def test_no_sync_matches_ddp(dist_run):
    cases = [c for c in CASES if c[0] in ("mlp", "branchy", "bn")]
    cases += [("mlp", dict(bucket_cap_mb=0.001, gradient_as_bucket_view=True),
               dict(bucket_cap_mb=0.001, gradient_as_bucket_view=True, comm_chunk_mb=0.0003))]
    dist_run(_parity_many, cases, no_sync_every=3, world_size=2, timeout=240)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_bucket_pack_strategy_matches_ddp(dist_run, set_to_none):
    """The GPU strategy (pack a bucket in one launch when complete) forced on CPU."""
    cases = [c for c in CASES if c[0] in ("mlp", "mixed", "branchy", "tied", "sparse",
                                          "bn_channels_last")]
    dist_run(_parity_many, cases, eager="0", set_to_none=set_to_none, no_sync_every=3,
             world_size=2, timeout=240)


def test_static_graph_and_adamw(dist_run):
    cases = [("mlp", dict(static_graph=True, bucket_cap_mb=0.001),
              dict(static_graph=True, bucket_cap_mb=0.001)),
             ("branchy_static", dict(static_graph=True), dict(static_graph=True))]
    dist_run(_parity_many, cases, optim="adamw", world_size=3, timeout=240)


# -------------------------------------------------------------------- layouts equal DDP's
def _recording_hook(state, bucket):
    state.append((bucket.index(), [tuple(t.shape) for t in bucket.gradients()]))
    return default_hooks.allreduce_hook(None, bucket)


def _layout_shapes(reducer, model):
    params = [p for p in model.parameters() if p.requires_grad]
    return [(b, [tuple(params[i].shape) for i in bucket.indices])
            for b, bucket in enumerate(reducer.layout.buckets)]


def _layouts_vs_ddp(name, kwargs, tb_kwargs, ddp_kwargs, steps=4):
    """Per iteration: DDP's (bucket index, tensor shapes) as its hook sees them, against
    tribucket's with the same recording hook and tribucket's default-path layout.
    ``tb_kwargs`` / ``ddp_kwargs``: options given to one side only."""
    rank = dist.get_rank()
    ddp_log, tb_log = [], []
    ddp = DDP(build(name), **kwargs, **ddp_kwargs)
    ddp.register_comm_hook(ddp_log, _recording_hook)
    hooked, plain = build(name), build(name)
    out = {"ddp": [], "hooked": [], "plain": []}
    with tribucket.fused_bucketing(hooked, **kwargs, **tb_kwargs) as r1, \
            tribucket.fused_bucketing(plain, **kwargs, **tb_kwargs) as r2:
        r1.register_comm_hook(tb_log, _recording_hook)
        for step in range(steps):
            x = batch(name, rank, step)
            out["plain"].append(_layout_shapes(r2, plain))
            for model in (ddp, hooked, plain):
                loss_of(model(x)).backward()
                model.zero_grad()
            out["ddp"].append(sorted(ddp_log))
            out["hooked"].append(sorted(tb_log))
            ddp_log.clear()
            tb_log.clear()
        out["rebuilds"] = (r1.stats.rebuilds, r2.stats.rebuilds)
    return out


LAYOUT_CASES = [
    ("mlp", dict(bucket_cap_mb=0.001)),
    # DDP's default caps: its 1 MiB first bucket, asked for (on the CPU, tribucket's default
    # first bucket is as large as the others, see the next test)
    ("mlp_wide", dict(tb=dict(first_bucket_cap_mb=1))),
    ("mlp_wide", dict(bucket_cap_mb=0.4)),
    ("mlp", dict(bucket_cap_mb=0.002, find_unused_parameters=True)),
    ("mixed", dict(bucket_cap_mb=0.0003)),
    ("transformer", dict(bucket_cap_mb=0.003)),
    ("mlp", dict(bucket_cap_mb=0.001, static_graph=True)),
]


@pytest.mark.parametrize("name,kwargs", LAYOUT_CASES)
def test_layouts_equal_ddp(dist_run, name, kwargs):
    kwargs = dict(kwargs)
    results = dist_run(_layouts_vs_ddp, name, kwargs, kwargs.pop("tb", {}), {},
                       world_size=2)
    for out in results:
        assert out["hooked"] == out["ddp"], "hook calls differ from DDP's"
        assert out["plain"] == out["ddp"], "default-path layout differs from DDP's"
    expected_rebuilds = 0 if kwargs.get("find_unused_parameters") else 1
    assert results[0]["rebuilds"] == (expected_rebuilds, expected_rebuilds)
    assert results[0]["plain"] == results[1]["plain"]


def test_cpu_default_first_bucket_is_full_size(dist_run):
    """With the caps left at their defaults, a CPU model's first bucket is not split off small
    (gloo reduces on the cores backward computes on): the layout is DDP's with every bucket,
    the first too, at 25 MiB (``bucket_cap_mb=25``)."""
    results = dist_run(_layouts_vs_ddp, "mlp_wide", {}, {}, dict(bucket_cap_mb=25),
                       world_size=2)
    for out in results:
        assert out["hooked"] == out["ddp"] and out["plain"] == out["ddp"]
        # 2.1 MiB of gradients: two buckets under DDP's default caps (the case above), one here
        assert len(out["plain"][-1]) == 1


# -------------------------------------------------------------------- errors
def _mismatched_model():
    rank = dist.get_rank()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3 + (rank == 1)))
    try:
        tribucket.fused_bucketing(model)
    except RuntimeError as e:
        return str(e)
    return None


def test_model_mismatch_names_parameter_and_rank(dist_run):
    messages = dist_run(_mismatched_model, world_size=2)
    for msg in messages:
        assert msg is not None
        assert "'1.weight'" in msg and "rank 1" in msg and "[3, 4]" in msg and "[4, 4]" in msg


def _unused_without_flag(only_rank):
    rank = dist.get_rank()
    model = build("branchy")
    errors = []
    with tribucket.fused_bucketing(model) as reducer:
        for step in range(3):
            x = torch.randn(4, 10)
            x[0, 0] = 1.0 if (only_rank is None or rank == only_rank) else -1.0
            try:
                loss_of(model(x)).backward()
            except RuntimeError as e:
                errors.append(str(e))
            model.zero_grad()
        # the reducer is usable afterwards: a fully used step goes through
        torch.manual_seed(0)
        return errors, reducer.stats.iterations


@pytest.mark.parametrize("only_rank", [None, 1])
def test_unused_parameter_raises_on_every_rank(dist_run, only_rank):
    results = dist_run(_unused_without_flag, only_rank, world_size=2, timeout=60)
    for rank, (errors, _) in enumerate(results):
        assert len(errors) == 3, f"rank {rank}: expected an error at every step, got {errors}"
        assert "find_unused_parameters=True" in errors[0]
        assert "'never.weight'" in errors[0] or "missing" in errors[0]
        if only_rank is None or rank == only_rank:
            assert "never.weight" in errors[0]


def _hook_counts(model):
    from tribucket.ddp import native

    ext = native.load()  # the native hooks sit on the gradient accumulators
    n = sum(len(p._post_accumulate_grad_hooks or {}) + (ext.post_hook_count(p) if ext else 0)
            for p in model.parameters())
    return n + len(model._forward_pre_hooks) + len(model._forward_hooks)


def _enter_exit_twice():
    model = build("mlp")
    counts = [_hook_counts(model)]
    for _ in range(2):
        with tribucket.fused_bucketing(model, bucket_cap_mb=0.001):
            counts.append(_hook_counts(model))
            loss_of(model(torch.randn(4, 16))).backward()
        counts.append(_hook_counts(model))
    return counts


def test_exit_removes_every_hook(dist_run):
    counts = dist_run(_enter_exit_twice, world_size=2)[0]
    n_params = len(list(build("mlp").parameters()))
    assert counts == [0, n_params + 2, 0, n_params + 2, 0]


def test_zero_grad_in_place_default_mode(dist_run):
    """zero_grad(set_to_none=False): autograd accumulates into the lent bucket, in place."""
    cases = [c for c in CASES if c[0] in ("mlp", "mixed", "branchy", "tied", "bn")]
    dist_run(_parity_many, cases, set_to_none=False, no_sync_every=2, world_size=2,
             timeout=240)


def _saved_gradients_stay_intact(which=slice(None), bucket_cap_mb=0.001, derived=False):
    """A gradient the user keeps is never overwritten by a later iteration."""
    rank = dist.get_rank()
    model = build("mlp")
    out = []
    with tribucket.fused_bucketing(model, bucket_cap_mb=bucket_cap_mb) as reducer:
        for step in range(4):
            loss_of(model(batch("mlp", rank, step))).backward()
            kept = [p.grad for p in model.parameters()][which]
            if derived:  # a view of a gradient, not the .grad tensor itself
                kept = [g[:1] for g in kept]
            snapshot = [g.clone() for g in kept]
            model.zero_grad(set_to_none=True)
            loss_of(model(batch("mlp", rank, step + 10))).backward()
            out.append(all(torch.equal(a, b) for a, b in zip(kept, snapshot)))
            model.zero_grad(set_to_none=True)
        return out, reducer.stats.bucket_bytes_allocated


@pytest.mark.parametrize("which", [slice(None), slice(-1, None), slice(1, 2)])
def test_kept_gradients_are_not_overwritten(dist_run, which):
    """All gradients, or one of a bucket lent whole (views reused across iterations)."""
    results = dist_run(_saved_gradients_stay_intact, which, 25.0, world_size=2)
    for intact, _ in results:
        assert intact == [True] * 4
    if which == slice(1, 2):
        results = dist_run(_saved_gradients_stay_intact, which, 25.0, True, world_size=2)
        for intact, _ in results:
            assert intact == [True] * 4
    if which == slice(None):
        results = dist_run(_saved_gradients_stay_intact, world_size=2)
        for intact, _ in results:
            assert intact == [True] * 4


def _gradients_kept_across_steps(how, pack_on_ready, preallocated, which="all"):
    """Four steps with zero_grad(set_to_none=False) while the loop keeps the list of .grad
    tensors (taken after the first backward, or allocated by hand before training), as a
    hand-written clip or a gradient-norm log does; ``which="one"``: only the gradient of one
    parameter in the middle of the one bucket. Per step: whether every kept tensor still is
    its parameter's .grad, and the kept tensors' values."""
    rank = dist.get_rank()
    model = build("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = list(model.parameters())
    chosen = params if which == "all" else params[3:4]
    cap = 0.001 if which == "all" else 25.0
    kept = None
    if preallocated:
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        kept = [p.grad for p in chosen]
    if how == "ddp":
        net, ctx = DDP(model, bucket_cap_mb=cap), contextlib.nullcontext()
    else:
        net, ctx = model, tribucket.fused_bucketing(model, bucket_cap_mb=cap,
                                                    pack_on_ready=pack_on_ready)
    same, values = [], []
    with ctx:
        for step in range(4):
            loss_of(net(batch("mlp", rank, step))).backward()
            if kept is None:
                kept = [p.grad for p in chosen]
            same.append(all(p.grad is g for p, g in zip(chosen, kept)))
            values.append(torch.cat([g.reshape(-1) for g in kept]).clone())
            opt.step()
            opt.zero_grad(set_to_none=False)
    return same, values


@pytest.mark.parametrize("pack_on_ready", [True, False])
@pytest.mark.parametrize("preallocated", [False, True])
@pytest.mark.parametrize("which", ["all", "one"])
def test_gradient_tensors_kept_across_steps_receive_the_average(dist_run, pack_on_ready,
                                                                 preallocated, which):
    """With zero_grad(set_to_none=False), DDP writes the average into the same .grad tensors
    every step: a list of them kept by the loop (or one of them) stays the gradients
    (through the rebuild too), and never holds this rank's own gradient."""
    ddp = dist_run(_gradients_kept_across_steps, "ddp", None, preallocated, which)
    mine = dist_run(_gradients_kept_across_steps, "tribucket", pack_on_ready, preallocated,
                    which)
    for (d_same, d_values), (same, values) in zip(ddp, mine):
        assert d_same == [True] * 4
        assert same == [True] * 4, same
        for step, (a, b) in enumerate(zip(d_values, values)):
            assert (a - b).abs().max().item() < 1e-6, (step, (a - b).abs().max().item())


# ---------------------------------------------------------------- close() mid-backward
class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("backward failed on purpose")


def _close_mid_backward(late_s):
    import time

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    reducer = tribucket.Reducer(model, bucket_cap_mb=0.01)  # about a layer per bucket
    loss_of(model(torch.randn(2, 64))).backward()  # iteration 1: the rebuild
    if rank == 1:
        time.sleep(late_s)  # rank 1 launches its buckets late
    started = time.monotonic()
    h = model[1](model[0](torch.randn(2, 64)))
    h = model[3](model[2](_RaiseInBackward.apply(h)))
    try:  # the buckets of layers 3 and 2 are sent, then backward raises before 1 and 0
        loss_of(h).backward()
    except ValueError:
        pass
    reducer.close()  # must finish the allreduces in flight (they need rank 1)
    closed = time.monotonic()
    t = torch.ones(1)
    dist.all_reduce(t)  # the group still pairs collectives
    return started, closed, t.item(), reducer.stats.iterations


def test_close_finishes_the_communication_in_flight(dist_run):
    late_s = 1.0
    results = dist_run(_close_mid_backward, late_s, world_size=2, timeout=60)
    (_, closed0, sum0, it0), (started1, _, sum1, _) = results
    # CLOCK_MONOTONIC is one clock per host: rank 0's close() returned only after rank 1
    # started the backward that sends the other half of rank 0's allreduces
    assert closed0 >= started1, (closed0, started1)
    assert sum0 == sum1 == 2.0 and it0 == 1


def _freed_without_the_collector(hook):
    """After leaving the context and dropping the names, the reducer, its buckets' handles
    and the model are freed by reference counting alone: nothing of theirs waits for a
    garbage collection that may come after destroy_process_group() or at interpreter exit."""
    import gc
    import weakref

    gc.collect()
    gc.disable()
    try:
        model = build("mlp")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with tribucket.fused_bucketing(model, bucket_cap_mb=0.001) as reducer:
            if hook:
                reducer.register_comm_hook(None, getattr(tribucket.hooks, hook))
            for step in range(2):
                loss_of(model(batch("mlp", dist.get_rank(), step))).backward()
                opt.step()
                opt.zero_grad()
        handles = [b.handle for b in reducer._bw.buckets]
        refs = weakref.ref(reducer), weakref.ref(model)
        del reducer, model, opt
        return [h is None for h in handles], [r() is None for r in refs]
    finally:
        gc.enable()


@pytest.mark.parametrize("hook", [None, "fp16_compress_hook"])
def test_a_closed_reducer_is_freed_without_the_collector(dist_run, hook):
    for handles_dropped, freed in dist_run(_freed_without_the_collector, hook, world_size=2):
        assert all(handles_dropped), handles_dropped
        assert freed == [True, True], freed
