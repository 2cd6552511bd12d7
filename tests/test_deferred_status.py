"""``deferred_status``: the end-of-backward status read one synchronised backward later (the
default on a GPU, so the host need not wait for the device at the end of each backward),
forced on here on the CPU. Gradients stay equal to torch DDP's; a problem is raised on every
rank at the next synchronised backward (or at ``close()``), naming the backward that had it;
passes that need the status at once (the used map, ``join()``) still read it at once.
``tests/test_cuda_reducer.py`` checks on a GPU that the host no longer waits."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import tribucket
from tribucket import hooks
from models import batch, build, loss_of
from test_failure_modes import _max_error, _reference_grads

TIMEOUT = datetime.timedelta(seconds=4)
STEPS = 4


def _grads_per_step(name, make, hook=None, steps=STEPS):
    """Each step's gradients of ``name`` trained under ``make(model)`` (a context manager
    giving the network), and whether a status was left pending after each backward."""
    model = build(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out, pending = [], []
    with make(model) as (net, reducer):
        if hook is not None:
            reducer.register_comm_hook(None, hook)
        for step in range(steps):
            loss_of(net(batch(name, dist.get_rank(), step))).backward()
            out.append([None if p.grad is None else p.grad.detach().clone()
                        for p in model.parameters()])
            pending.append(getattr(getattr(reducer, "_bw", None), "pending_status", None)
                           is not None)
            opt.step()
            opt.zero_grad()
    return out, pending


class _Ours:
    def __init__(self, **kw):
        self.kw = kw

    def __call__(self, model):
        self.cm = tribucket.fused_bucketing(model, bucket_cap_mb=0.001, **self.kw)
        self.model = model
        return self

    def __enter__(self):
        return self.model, self.cm.__enter__()

    def __exit__(self, *exc):
        return self.cm.__exit__(*exc)


class _Torch:
    def __init__(self, **kw):
        self.kw = kw

    def __call__(self, model):
        self.ddp = DDP(model, bucket_cap_mb=0.001, **self.kw)
        return self

    def __enter__(self):
        return self.ddp, self.ddp

    def __exit__(self, *exc):
        return False


VARIANTS = {
    # (model, tribucket options, DDP options, hook for both)
    "allreduce": ("mlp", {}, {}, None),
    "fp16 hook": ("mlp", {}, {}, "fp16"),
    "torch allreduce hook": ("transformer", {}, {}, "torch_allreduce"),  # status on its own
    "static graph": ("branchy_static", {"static_graph": True}, {"static_graph": True}, None),
    "find unused": ("branchy", {"find_unused_parameters": True},
                    {"find_unused_parameters": True}, None),
}


def _hook(kind, ours):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    if kind == "fp16":
        return hooks.fp16_compress_hook if ours else default_hooks.fp16_compress_hook
    if kind == "torch_allreduce":
        return default_hooks.allreduce_hook
    return None


def _parity(variant):
    name, ours, theirs, hook = VARIANTS[variant]
    a, pending = _grads_per_step(name, _Ours(deferred_status=True, **ours), _hook(hook, True))
    b, _ = _grads_per_step(name, _Torch(**theirs), _hook(hook, False))
    diff = max(((x - y).abs().max().item() if x is not None and y is not None
                else (0.0 if x is None and y is None else float("inf")))
               for sa, sb in zip(a, b) for x, y in zip(sa, sb))
    return diff, pending


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gradients_equal_ddp_with_the_status_read_late(dist_run, variant):
    for rank, (diff, pending) in enumerate(dist_run(_parity, variant, world_size=2)):
        assert diff <= 1e-6, f"rank {rank}: {variant}: max |diff| vs DDP {diff}"
        if variant == "find unused":
            # the used map decides which .grad is written: read at once, nothing pending
            assert not any(pending), pending
        else:
            # the passes that rebuild the layout read it at once; the later ones defer
            assert pending[-2:] == [True, True], pending


def _missing_on_rank1(deferred, last_step_only=False):
    """No find_unused_parameters; rank 1's batch at step 1 leaves ``branch`` unused."""
    rank = dist.get_rank()
    model = build("gated")
    done, where = [], None
    try:
        with tribucket.fused_bucketing(model, bucket_cap_mb=0.001, timeout=TIMEOUT,
                                       deferred_status=deferred):
            for step in range(2 if last_step_only else 3):
                x = torch.ones(4, 6)
                x[0, 0] = -1.0 if (step == 1 and rank == 1) else 1.0
                where = f"backward {step}"
                loss_of(model(x)).backward()
                model.zero_grad()
                done.append(step)
            where = "close"
    except RuntimeError as e:
        return done, where, str(e)
    return done, where, None


def _names_rank1(rank, msg):
    """Rank 1 names its missing gradients; rank 0 names rank 1 as the one with a problem."""
    assert "rank 1: 2" in msg, msg
    if rank == 1:
        assert "received no gradient" in msg and "branch.weight" in msg, msg
    else:
        assert "another rank reported a problem" in msg, msg


@pytest.mark.parametrize("deferred", [False, True])
def test_missing_gradients_raise_on_every_rank(dist_run, deferred):
    for rank, (done, where, msg) in enumerate(dist_run(_missing_on_rank1, deferred,
                                                       world_size=2, timeout=60)):
        assert msg is not None, f"rank {rank}: no error ({done})"
        _names_rank1(rank, msg)
        if deferred:  # iteration 2's problem, raised at the end of backward 2 (the 3rd pass)
            assert (done, where) == ([0, 1], "backward 2"), (rank, done, where)
            assert "in backward iteration 2, reported at backward iteration 3" in msg, msg
        else:
            assert (done, where) == ([0], "backward 1"), (rank, done, where)
            assert "deferred_status" not in msg, msg


def test_a_problem_in_the_last_backward_raises_at_close(dist_run):
    for rank, (done, where, msg) in enumerate(dist_run(_missing_on_rank1, True, True,
                                                       world_size=2, timeout=60)):
        assert (done, where) == ([0, 1], "close"), (rank, done, where, msg)
        assert msg is not None and "reported at close()" in msg, msg
        _names_rank1(rank, msg)


def _extra_forward(deferred):
    """Rank 1 runs one training forward without a backward before its step 1: the ranks'
    forward counts differ from then on. Per step: ('ok', max |grad - reference|) or
    ('error', message)."""
    rank = dist.get_rank()
    model = build("mlp")
    out = []
    with tribucket.fused_bucketing(model, bucket_cap_mb=0.001, timeout=TIMEOUT,
                                   deferred_status=deferred):
        for step in range(4):
            model.zero_grad()
            if rank == 1 and step == 1:
                model(batch("mlp", rank, step))  # a forward without backward
            try:
                loss_of(model(batch("mlp", rank, step))).backward()
                out.append(("ok", _max_error(model, _reference_grads("mlp", step))))
            except RuntimeError as e:
                out.append(("error", str(e)))
    return out


def test_ranks_out_of_step_raise_on_every_rank_one_backward_later(dist_run):
    """Step 1 is reported at the end of step 2, on both ranks; the counts start afresh
    there, so step 3 is averaged as usual and nothing is reported twice."""
    for rank, out in enumerate(dist_run(_extra_forward, True, world_size=2, timeout=60)):
        assert [kind for kind, _ in out] == ["ok", "ok", "error", "ok"], (rank, out)
        msg = out[2][1]
        assert "not in the backward of the same training step" in msg, msg
        assert "in backward iteration 2, reported at backward iteration 3" in msg, msg
        assert out[0][1] < 1e-6 and out[3][1] < 1e-6, (rank, out)


def _uneven_under_join(deferred):
    rank = dist.get_rank()
    grads = []
    for make in (_Ours(deferred_status=deferred), _Torch()):
        model = build("mlp")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with make(model) as (net, joinable):
            with joinable.join():
                for step in range(3 + rank):  # rank 1 has one more batch
                    loss_of(net(batch("mlp", rank, step))).backward()
                    opt.step()
                    opt.zero_grad()
        grads.append([p.detach().clone() for p in model.parameters()])
    return max((a - b).abs().max().item() for a, b in zip(*grads))


def test_join_with_the_status_read_late_equals_ddp(dist_run):
    for rank, diff in enumerate(dist_run(_uneven_under_join, True, world_size=2, timeout=60)):
        assert diff <= 1e-6, f"rank {rank}: parameters differ from DDP's by {diff}"


def test_deferred_status_option_is_checked():
    with pytest.raises(TypeError, match="deferred_status must be True, False or None"):
        tribucket.ReducerConfig(deferred_status="yes")


def _frozen_with_the_status_read_late():
    """``layers.0.weight`` frozen on every rank before step 2's forward."""
    rank = dist.get_rank()
    model = build("mlp")
    try:
        with tribucket.fused_bucketing(model, bucket_cap_mb=0.001, timeout=TIMEOUT,
                                       deferred_status=True):
            for step in range(4):
                if step == 2:
                    model.layers[0].weight.requires_grad_(False)
                loss_of(model(batch("mlp", rank, step))).backward()
                model.zero_grad()
    except RuntimeError as e:
        return str(e)
    return None


def test_a_parameter_frozen_mid_run_is_named_one_backward_later(dist_run):
    """Read one backward later, the missing gradient of a parameter frozen after entering
    still says that it no longer requires grad, and how to average the new set."""
    for msg in dist_run(_frozen_with_the_status_read_late, world_size=2, timeout=60):
        assert msg is not None, "no error"
        # (iterations count from 1: step 2 is backward iteration 3)
        assert "in backward iteration 3, reported at backward iteration 4" in msg, msg
        assert "layers.0.weight" in msg and "no longer require grad" in msg, msg
        assert "enter it again" in msg, msg
