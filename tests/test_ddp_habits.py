"""What DDP users reach for, against torch DDP on 2 gloo ranks: ``reducer.join()``,
buffers under ``no_grad`` forwards, DDP checkpoints, the options as attributes and
``logging_data()``."""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parallel import DistributedDataParallel as DDP

import tribucket
from models import batch, build, loss_of
from test_reducer import assert_states_equal
from test_reliability import _join_throw, _join_vs_ddp


# ---------------------------------------------------------------- reducer.join()
@pytest.mark.parametrize("divide_by_initial", [True, False])
def test_join_method_matches_ddp_join(dist_run, divide_by_initial):
    for name, kwargs in [("bn", {}), ("branchy", dict(find_unused_parameters=True))]:
        results = dist_run(_join_vs_ddp, name, kwargs, divide_by_initial, method=True)
        assert all(torch.equal(a, b) for a, b in zip(results[0], results[1]))


def test_join_method_throws_as_ddp(dist_run):
    messages = dist_run(_join_throw, method=True, world_size=2)
    assert "exhausted" in messages[0]  # rank 0 ran out first
    assert "Detected at least one rank that exhausted inputs" in messages[1]


def _join_disabled():
    """``join(enable=False)`` is a plain block, as DDP's: even inputs train as without it."""
    rank = dist.get_rank()
    mine, theirs = build("bn"), build("bn")
    ddp = DDP(theirs)
    with tribucket.fused_bucketing(mine) as reducer:
        ctx = reducer.join(enable=False)
        assert isinstance(ctx, Join) and not reducer._join_config.enable
        with ctx:
            for step in range(2):
                loss_of(mine(batch("bn", rank, step))).backward()
        with ddp.join(enable=False):
            for step in range(2):
                loss_of(ddp(batch("bn", rank, step))).backward()
        assert_states_equal(mine, theirs)
        for a, b in zip(mine.parameters(), theirs.parameters()):
            torch.testing.assert_close(a.grad, b.grad)


def test_join_disabled_is_a_plain_block(dist_run):
    dist_run(_join_disabled, world_size=2)


# ---------------------------------------------------------------- buffers, no_grad forwards
def _buffers_vs_ddp(mode):
    """BatchNorm model: training, evaluation (eval mode and train mode under no_grad) and
    no_sync forwards in one sequence; after each forward, tribucket's outputs and buffers
    against DDP's on the same rank."""
    rank = dist.get_rank()
    mine, theirs = build("bn", seed=rank), build("bn", seed=rank)
    ddp = DDP(theirs)
    seen = []
    with tribucket.fused_bucketing(mine, broadcast_buffers=mode) as reducer:
        # (mode of the model, grad enabled (None: inference_mode), no_sync)
        steps = [("train", True, False), ("eval", False, False), ("eval", False, False),
                 ("train", True, False), ("train", False, False), ("train", True, False),
                 ("train", True, True), ("eval", False, False), ("train", True, False),
                 ("eval", None, False), ("train", True, False), ("train", None, False)]
        for step, (train, grad, local) in enumerate(steps):
            x = batch("bn", rank, step)
            for model, ctx in ((mine, reducer), (ddp, ddp)):
                model.train(train == "train")
                with torch.set_grad_enabled(bool(grad)), \
                        torch.inference_mode() if grad is None else contextlib.nullcontext(), \
                        ctx.no_sync() if local else contextlib.nullcontext():
                    out = model(x)
                    if grad:
                        loss_of(out).backward()
                seen.append(out.detach())
            what = f"rank {rank}, forward {step} {steps[step]}: "
            torch.testing.assert_close(seen[-2], seen[-1], msg=lambda m: what + "output: " + m)
            assert_states_equal(mine, theirs, what)
    return [b.clone() for b in mine.buffers()]


def test_broadcast_buffers_ddp_matches_ddp(dist_run):
    dist_run(_buffers_vs_ddp, "ddp", world_size=2)


def _evaluate_on_rank0_only():
    """The default: a no_grad forward launches no collective, so rank 0 may evaluate alone."""
    rank = dist.get_rank()
    mine, theirs = build("bn", seed=rank), build("bn", seed=rank)
    ddp = DDP(theirs)
    with tribucket.fused_bucketing(mine) as reducer:
        for step in range(3):
            x = batch("bn", rank, step)
            loss_of(mine(x)).backward()
            loss_of(ddp(x)).backward()
            if rank == 0:
                with torch.no_grad():
                    mine.eval()
                    mine(x)
                    mine.train()
        assert_states_equal(mine, theirs, f"rank {rank}: ")
        return reducer.stats.iterations


def test_default_buffers_allow_rank0_only_evaluation(dist_run):
    assert dist_run(_evaluate_on_rank0_only, world_size=2, timeout=60) == [3, 3]


def _bad_broadcast_buffers(value):
    try:
        tribucket.ReducerConfig(broadcast_buffers=value)
    except (TypeError, ValueError) as e:
        return str(e)
    return None


@pytest.mark.parametrize("value", ["always", 1, None])
def test_broadcast_buffers_rejects_other_values(value):
    msg = _bad_broadcast_buffers(value)
    assert msg is not None and "broadcast_buffers" in msg and repr(value) in msg
    assert "'ddp'" in msg


# ---------------------------------------------------------------- DDP checkpoints
def _ddp_checkpoint_roundtrip(path):
    """A checkpoint saved from DDP loads (prefix stripped) into the model inside
    fused_bucketing, on every rank or on rank 0 before entering; training then goes on as
    DDP's does from the same checkpoint; tribucket's checkpoint loads into ddp.module."""
    rank = dist.get_rank()
    ddp = DDP(build("bn", seed=rank))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(2):
        loss_of(ddp(batch("bn", rank, step))).backward()
        opt.step()
        opt.zero_grad()
    if rank == 0:
        torch.save(ddp.state_dict(), path)
    dist.barrier()
    state = torch.load(path)
    assert all(k.startswith("module.") for k in state)
    consume_prefix_in_state_dict_if_present(state, "module.")

    saved = build("bn")
    saved.load_state_dict(state)
    ddp.module.load_state_dict(state)         # DDP resumes from it too (its buffers differed)
    everywhere, rank0 = build("bn", seed=10 + rank), build("bn", seed=20 + rank)
    if rank == 0:
        rank0.load_state_dict(state)          # entering broadcasts rank 0's state
    with tribucket.fused_bucketing(everywhere) as r1, tribucket.fused_bucketing(rank0) as r2:
        everywhere.load_state_dict(state)
        assert_states_equal(everywhere, saved, f"rank {rank}, loaded on every rank: ")
        assert_states_equal(rank0, saved, f"rank {rank}, loaded on rank 0: ")
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (everywhere, rank0)]
        for step in range(2, 4):
            x = batch("bn", rank, step)
            for model, o in zip((everywhere, rank0, ddp), (*opts, opt)):
                loss_of(model(x)).backward()
                o.step()
                o.zero_grad()
        assert_states_equal(everywhere, ddp.module, f"rank {rank}, after resuming: ")
        assert_states_equal(rank0, ddp.module, f"rank {rank}, after resuming: ")
        back = DDP(build("bn", seed=30 + rank))
        back.module.load_state_dict(everywhere.state_dict())  # strict: the same keys
        assert_states_equal(back.module, everywhere, f"rank {rank}, back into DDP: ")
        return r1.stats.iterations, r2.stats.iterations


def test_ddp_checkpoint_loads_into_fused_bucketing(dist_run):
    with tempfile.TemporaryDirectory() as tmp:
        results = dist_run(_ddp_checkpoint_roundtrip, os.path.join(tmp, "ddp.pt"),
                           world_size=2)
    assert results == [(2, 2), (2, 2)]


# ---------------------------------------------------------------- options as attributes
_OPTION_CASES = [
    {},
    dict(find_unused_parameters=True, bucket_cap_mb=0.001, gradient_as_bucket_view=True),
    dict(static_graph=True, broadcast_buffers=False, bucket_cap_mb=3),
]
_DDP_ATTRS = ["find_unused_parameters", "static_graph", "gradient_as_bucket_view",
              "broadcast_buffers", "bucket_bytes_cap"]


def _options_vs_ddp():
    out = []
    for kwargs in _OPTION_CASES:
        model = build("mlp")
        ddp = DDP(build("mlp"), **kwargs)
        with tribucket.fused_bucketing(model, **kwargs) as reducer:
            ours = {a: getattr(reducer, a) for a in _DDP_ATTRS + ["bucket_cap_mb"]}
            theirs = {a: getattr(ddp, a) for a in _DDP_ATTRS}
            errors = []
            for a in _DDP_ATTRS + ["bucket_cap_mb"]:
                try:
                    setattr(reducer, a, getattr(reducer, a))
                except AttributeError as e:
                    errors.append(str(e))
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    reducer._set_static_graph()
                static = [str(w.message) for w in caught]
            except RuntimeError as e:
                static = str(e)
            out.append((ours, theirs, errors, static))
    return out


def test_options_read_as_ddp_attributes(dist_run):
    for kwargs, (ours, theirs, errors, static) in zip(_OPTION_CASES,
                                                     dist_run(_options_vs_ddp)[0]):
        for a in _DDP_ATTRS:
            assert ours[a] == theirs[a], f"{kwargs}: reducer.{a}={ours[a]!r}, DDP's {theirs[a]!r}"
        assert ours["bucket_cap_mb"] == kwargs.get("bucket_cap_mb", 25)
        assert len(errors) == len(_DDP_ATTRS) + 1, "an option could be assigned"
        for a, msg in zip(_DDP_ATTRS + ["bucket_cap_mb"], errors):
            assert a in msg and "fused_bucketing" in msg, msg
        if kwargs.get("static_graph"):
            assert len(static) == 1 and "static_graph" in static[0]  # a warning, as DDP
        else:
            assert isinstance(static, str) and "static_graph=True" in static


# ---------------------------------------------------------------- logging_data()
_LOGGING_CASES = [
    ("mlp", dict(bucket_cap_mb=0.001), None),
    ("branchy_static", dict(find_unused_parameters=True, bucket_cap_mb=0.0005),
     default_hooks.allreduce_hook),
    ("bn", dict(static_graph=True), None),
    # one cap per bucket, the last repeating (DDP's bucket_cap_mb_list): the initial layout
    # and the rebuild both follow the list
    ("mlp", dict(bucket_cap_mb_list=[0.001, 0.003]), None),
    ("branchy_static", dict(find_unused_parameters=True, bucket_cap_mb_list=[0.0005, 0.001]),
     None),
    # `never`'s two tensors fill a bucket of their own, which is not all-reduced
    ("branchy_static", dict(find_unused_parameters=True, bucket_cap_mb=0.0004,
                            skip_all_reduce_unused_params=True), None),
]
# fields whose value must equal DDP's once its (one-iteration-late) logging has caught up
_SAME_AS_DDP = ["world_size", "rank", "module_name", "backend_name", "num_parameter_tensors",
                "total_parameter_size_bytes", "bucket_cap_bytes", "find_unused_parameters",
                "gradient_as_bucket_view", "broadcast_buffers", "bucket_sizes",
                "rebuilt_bucket_sizes", "has_rebuilt_buckets", "rebuilt_per_bucket_param_indices",
                "comm_hook", "unused_parameter_size", "num_buckets_reduced"]


def _logging_vs_ddp(steps=4):
    rank = dist.get_rank()
    out = []
    for name, kwargs, hook in _LOGGING_CASES:
        model = build(name)
        ddp = DDP(build(name), **kwargs)
        with tribucket.fused_bucketing(model, **kwargs) as reducer:
            if hook is not None:
                reducer.register_comm_hook(None, hook)
                ddp.register_comm_hook(None, hook)
            before = reducer.logging_data()
            per_step = []
            for step in range(steps):
                x = batch(name, rank, step)
                for m in (model, ddp):
                    loss_of(m(x)).backward()
                    m.zero_grad()
                data = reducer.logging_data()
                per_step.append((reducer.stats.backward_compute_s, reducer.stats.comm_exposed_s,
                                 data["backward_compute_time"], data["backward_comm_time"],
                                 data["backward_compute_comm_overlap_time"]))
            theirs = ddp._get_ddp_logging_data()
            theirs.setdefault("static_graph", 0)  # DDP leaves out what is not set
            for k in ("comm_hook", "rebuilt_bucket_sizes", "rebuilt_per_bucket_param_indices"):
                theirs.setdefault(k, None)
            out.append((before, data, theirs, per_step))
    return out


def test_logging_data_matches_ddp(dist_run):
    results = dist_run(_logging_vs_ddp, world_size=2)
    for rank, per_rank in enumerate(results):
        for (name, kwargs, _), (before, ours, theirs, per_step) in zip(_LOGGING_CASES, per_rank):
            what = f"rank {rank}, {name} {kwargs}"
            for k in _SAME_AS_DDP + ["static_graph"]:
                assert ours[k] == theirs[k], f"{what}: {k}: ours {ours[k]!r}, DDP's {theirs[k]!r}"
            # before any backward: the initial layout, nothing rebuilt, no times
            assert before["bucket_sizes"] == theirs["bucket_sizes"], what
            assert before["has_rebuilt_buckets"] == 0 and before["rebuilt_bucket_sizes"] is None
            assert before["iteration"] == 0 and before["avg_backward_compute_time"] == 0
            assert ours["iteration"] == len(per_step)
            # averages over every averaged backward, in integer nanoseconds as DDP's
            for k, field in ((0, "avg_backward_compute_time"),
                             (1, "avg_backward_comm_exposed_time")):
                mean = sum(s[k] for s in per_step) / len(per_step) * 1e9
                assert abs(ours[field] - mean) <= 1 + 1e-6 * mean, (what, field)
            for k, field in ((3, "avg_backward_comm_time"),
                             (4, "avg_backward_compute_comm_overlap_time")):
                mean = sum(s[k] for s in per_step) / len(per_step)
                assert abs(ours[field] - mean) <= len(per_step), (what, field)
            for s in per_step:
                assert s[2] == round(s[0] * 1e9)
                assert s[3] >= s[4] >= 0  # overlap is part of the communication time
            assert all(isinstance(ours[k], int) for k in ours if k.endswith("_time"))
