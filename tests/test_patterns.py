"""Training patterns real models and torch's own DDP tests use, against torch DDP on 2 gloo
ranks, bit for bit: accumulation where an expert gets a gradient in one micro-batch on one
rank only, the fused fp16 hook with a parameter unused at first, outputs the loss does not
use, ``backward(create_graph=True)``, buffers reassigned on the module, and several training
forwards before one backward."""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import tribucket
import tribucket.hooks


class Experts(nn.Module):
    """A router-like model: ``route`` picks which of three experts a micro-batch reaches."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 8)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.out = nn.Linear(8, 1)

    def forward(self, x, route):
        h = self.inp(x)
        h = sum(self.experts[e](h) for e in route)
        return self.out(h)


def _assert_same(mine: nn.Module, theirs: nn.Module, what: str) -> None:
    for (n, a), b in zip(mine.named_parameters(), theirs.parameters()):
        if a.grad is None or b.grad is None:
            assert a.grad is None and b.grad is None, \
                f"{what}: {n}.grad is {a.grad is None and 'None' or 'set'} here, " \
                f"{b.grad is None and 'None' or 'set'} under DDP"
        else:
            assert torch.equal(a.grad, b.grad), f"{what}: {n}.grad differs from DDP's"
        assert torch.equal(a, b), f"{what}: {n} differs from DDP's"


def _gathered_equal(model: nn.Module) -> bool:
    """Every rank holds the same parameters (bit for bit)."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat)
    return all(torch.equal(out[0], o) for o in out)


# ---------------------------------------------------------------- accumulation with experts
def _accumulate_expert_one_rank(view: bool):
    """Expert 2 gets a gradient only in a no_sync micro-batch on rank 0, none in the
    synchronised one: DDP averages it (rank 1 contributes zeros), on every rank."""
    rank = dist.get_rank()
    mine, theirs = Experts(), Experts()
    ddp = DDP(theirs, find_unused_parameters=True, gradient_as_bucket_view=view)
    opt_a = torch.optim.AdamW(mine.parameters(), lr=1e-2)
    opt_b = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    with tribucket.fused_bucketing(mine, find_unused_parameters=True,
                                   gradient_as_bucket_view=view) as reducer:
        for step in range(3):
            torch.manual_seed(10 * step + rank)
            xs = [torch.randn(4, 8) for _ in range(2)]
            routes = [[0, 2] if rank == 0 and step != 1 else [0], [1]]
            for model, ctx in ((mine, reducer), (ddp, ddp)):
                with ctx.no_sync():
                    model(xs[0], routes[0]).sum().backward()
                model(xs[1], routes[1]).sum().backward()
            _assert_same(mine, theirs, f"step {step} after backward")
            opt_a.step(); opt_b.step()
            opt_a.zero_grad(); opt_b.zero_grad()
            _assert_same(mine, theirs, f"step {step} after AdamW")
    return _gathered_equal(mine)


@pytest.mark.parametrize("view", [False, True])
def test_accumulation_with_an_expert_used_on_one_rank_averages(dist_run, view):
    assert all(dist_run(_accumulate_expert_one_rank, view, world_size=2))


# ---------------------------------------------------------------- fp16 hook, unused at first
def _fp16_unused_at_first(hook: str):
    """Expert 2 gets no gradient in the first iteration and one later: DDP with torch's fp16
    hook trains; so must the fused one (against DDP + torch's hook of the same wire dtype, to
    the wire's rounding; the ranks bit for bit)."""
    rank = dist.get_rank()
    mine, theirs = Experts(), Experts()
    ddp = DDP(theirs, find_unused_parameters=True)
    if hook == "fp16":  # (torch's bf16 hook needs NCCL: bf16 is checked against fp32)
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    fused = getattr(tribucket.hooks, f"{hook}_compress_hook")
    opt_a = torch.optim.SGD(mine.parameters(), lr=1e-2)
    opt_b = torch.optim.SGD(theirs.parameters(), lr=1e-2)
    with tribucket.fused_bucketing(mine, find_unused_parameters=True) as reducer:
        reducer.register_comm_hook(None, fused)
        for step in range(4):
            torch.manual_seed(10 * step + rank)
            x = torch.randn(4, 8)
            route = [0, 1] if step == 0 else [0, 1, 2]
            mine(x, route).sum().backward()
            ddp(x, route).sum().backward()
            for (n, a), b in zip(mine.named_parameters(), theirs.parameters()):
                assert (a.grad is None) == (b.grad is None), f"step {step}: {n}"
                if a.grad is not None:
                    # fused: divide, then cast; torch's hook: cast, then divide
                    tol = 2e-3 if hook == "fp16" else 2e-2
                    torch.testing.assert_close(a.grad, b.grad, atol=tol, rtol=tol,
                                               msg=f"step {step}: {n}")
            opt_a.step(); opt_b.step()
            opt_a.zero_grad(); opt_b.zero_grad()
    return _gathered_equal(mine)


@pytest.mark.parametrize("hook", ["fp16", "bf16"])
def test_fused_hook_with_a_parameter_unused_at_first(dist_run, hook):
    assert all(dist_run(_fp16_unused_at_first, hook, world_size=2))


# ---------------------------------------------------------------- outputs the loss leaves out
class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(10, 10)
        self.a = nn.Linear(10, 10, bias=False)
        self.b = nn.Linear(10, 10, bias=False)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return {"a": self.a(h), "b": self.b(h)}


def _unused_output(view: bool):
    """The loss uses output b only (after two steps using both): head a's gradient is left
    untouched, as DDP leaves it (None at first, the last value later)."""
    rank = dist.get_rank()
    mine, theirs = TwoHeads(), TwoHeads()
    ddp = DDP(theirs, find_unused_parameters=True, gradient_as_bucket_view=view)
    with tribucket.fused_bucketing(mine, find_unused_parameters=True,
                                   gradient_as_bucket_view=view):
        for step in range(5):
            torch.manual_seed(step + 10 * rank)
            x = torch.randn(6, 10)
            for model in (mine, ddp):
                out = model(x)
                loss = out["b"].sum() if step in (0, 3, 4) else (out["a"] * out["b"]).sum()
                loss.backward()
            _assert_same(mine, theirs, f"step {step}")
    return _gathered_equal(mine)


@pytest.mark.parametrize("view", [False, True])
def test_outputs_unused_in_the_loss_are_left_alone(dist_run, view):
    assert all(dist_run(_unused_output, view, world_size=2))


# ---------------------------------------------------------------- backward(create_graph=True)
class Scalar(nn.Module):
    """torch's own create_graph test model."""

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.tensor(1.0))

    def forward(self):
        return self.p.pow(2)


def _create_graph_like_ddp():
    mine, theirs = Scalar(), Scalar()
    ddp = DDP(theirs)
    with tribucket.fused_bucketing(mine), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(6):
            mine().backward(create_graph=True)
            ddp().backward(create_graph=True)
            assert torch.equal(mine.p.grad, theirs.p.grad), (step, mine.p.grad, theirs.p.grad)
    assert any("create_graph" in str(w.message) for w in seen), "no create_graph warning"
    return float(mine.p.grad)


def test_create_graph_matches_ddp(dist_run):
    assert dist_run(_create_graph_like_ddp, world_size=2) == [12.0, 12.0]


class Penalised(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(6, 16)
        self.b = nn.Linear(16, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _create_graph_averages_first_order(options: dict, hook: str | None):
    """A gradient penalty (WGAN-GP style): backward(create_graph=True) on every path; each
    .grad is the average over ranks of this rank's first-order gradient (a dense reference:
    torch.autograd.grad on a copy, all-gathered)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = Penalised()
    ref = copy.deepcopy(model)
    torch.manual_seed(rank)
    x = torch.randn(5, 6)
    loss_of = lambda m: m(x).square().mean()  # noqa: E731
    grads = torch.autograd.grad(loss_of(ref), list(ref.parameters()))
    flat = torch.cat([g.reshape(-1) for g in grads])
    every = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(every, flat)
    expected = torch.stack(every).mean(0)
    with tribucket.fused_bucketing(model, **options) as reducer:
        if hook is not None:
            reducer.register_comm_hook(None, getattr(tribucket.hooks, hook))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(2):  # the second pass runs on the rebuilt buckets
                for p in model.parameters():
                    p.grad = None
                loss_of(model).backward(create_graph=True)
                got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
                tol = 2e-3 if hook else 1e-6
                torch.testing.assert_close(got.detach(), expected, atol=tol, rtol=tol)
    return True


def _create_graph_sharded():
    """The same with shard_optimizer=True: one SGD step of tribucket.ShardedOptimizer lands
    where the averaged first-order gradients take the parameters."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = Penalised()
    ref = copy.deepcopy(model)
    torch.manual_seed(rank)
    x = torch.randn(5, 6)
    grads = torch.autograd.grad(ref(x).square().mean(), list(ref.parameters()))
    for q, g in zip(ref.parameters(), grads):
        every = [torch.empty_like(g) for _ in range(world)]
        dist.all_gather(every, g.contiguous())
        q.data.sub_(0.1 * torch.stack(every).mean(0))
    with tribucket.fused_bucketing(model, shard_optimizer=True) as reducer:
        opt = tribucket.ShardedOptimizer(reducer, torch.optim.SGD, lr=0.1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(x).square().mean().backward(create_graph=True)
        opt.step()
        opt.wait_parameters()  # a direct read of the parameters (overlap_param_gather)
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a.detach(), b.detach(), atol=1e-6, rtol=1e-6)
    return True


def test_create_graph_with_the_sharded_optimizer(dist_run):
    assert all(dist_run(_create_graph_sharded, world_size=2))


@pytest.mark.parametrize("options,hook", [
    ({}, None), ({"native_hooks": False}, None), ({"gradient_as_bucket_view": True}, None),
    ({"pack_on_ready": True}, None), ({"find_unused_parameters": True}, None),
    ({}, "fp16_compress_hook"), ({}, "bf16_compress_hook")])
def test_create_graph_averages_first_order_gradients(dist_run, options, hook):
    assert all(dist_run(_create_graph_averages_first_order, options, hook, world_size=2))


# ---------------------------------------------------------------- buffers
class WithBuffers(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(10, 1, bias=False)
        self.register_buffer("buffer", torch.zeros(1, 2))
        self.register_buffer("gone", torch.ones(3))

    def forward(self, x):
        return self.a(x)


def _buffers_follow_the_module():
    """torch's test_ddp_broadcast_buffer pattern, plus a buffer registered after entering and
    one set to None: rank 0's current buffers reach every rank before each forward."""
    rank = dist.get_rank()
    mine, theirs = WithBuffers(), WithBuffers()
    ddp = DDP(theirs)
    seen = []
    with tribucket.fused_bucketing(mine):
        for step in range(3):
            for model in (mine, theirs):
                if rank == 0:
                    model.buffer = model.buffer + 1  # a new tensor under the same name
                if step == 1:
                    model.register_buffer("late", torch.full((2,), float(rank)))
                    model.gone = None
            x = torch.randn(2, 10)
            mine(x).sum().backward()
            ddp(x).sum().backward()
            for name, b in theirs.named_buffers():
                assert torch.equal(dict(mine.named_buffers())[name], b), (step, name)
            seen.append(mine.buffer.clone())
    return seen


def test_reassigned_buffers_are_broadcast_as_ddp(dist_run):
    a, b = dist_run(_buffers_follow_the_module, world_size=2)
    assert [t.tolist() for t in a] == [t.tolist() for t in b] == [[[1.0, 1.0]], [[2.0, 2.0]],
                                                                   [[3.0, 3.0]]]


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.lin(x))))


def _two_forwards_one_backward(mode):
    """Siamese / two-view pattern: two training forwards, then one backward through both."""
    rank = dist.get_rank()
    mine, theirs = BNNet(), BNNet()
    ddp = DDP(theirs, broadcast_buffers=bool(mode))
    opt_a = torch.optim.SGD(mine.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(theirs.parameters(), lr=0.1)
    with tribucket.fused_bucketing(mine, broadcast_buffers=mode):
        for step in range(3):
            torch.manual_seed(100 * step + rank)
            x1, x2 = torch.randn(4, 6), torch.randn(4, 6)
            for model, opt in ((mine, opt_a), (ddp, opt_b)):
                o1, o2 = model(x1), model(x2)
                (o1.square().mean() + (o1 - o2).abs().mean()).backward()
                opt.step()
                opt.zero_grad()
            for (n, a), b in zip(mine.state_dict().items(), theirs.state_dict().values()):
                assert torch.equal(a, b), (step, n)
    return _gathered_equal(mine)


@pytest.mark.parametrize("mode", [True, "ddp", False])
def test_two_forwards_then_one_backward_with_batchnorm(dist_run, mode):
    assert all(dist_run(_two_forwards_one_backward, mode, world_size=2))


# ---------------------------------------------------------------- backward inside the forward
class _BackwardInside(nn.Module):
    """A forward that runs its own backward (Lightning's manual optimization runs the
    training step, backward included, through the wrapper's forward) and returns None;
    ``spare`` (if ``spare``) is never used."""

    def __init__(self, spare: bool):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.head = nn.Linear(4, 3), nn.Linear(3, 1)
        self.spare = nn.Linear(3, 1) if spare else None
        self.reducer = None

    def forward(self, x, sync: bool, prepare: bool):
        loss = self.head(torch.tanh(self.lin(x))).square().sum()
        with contextlib.nullcontext() if sync else self.reducer.no_sync():
            if prepare:
                self.reducer.prepare_for_backward(loss)
            loss.backward()


def _backward_inside(find_unused: bool, prepare: bool):
    """Accumulate two micro-batches (the first under no_sync) twice; per micro-batch,
    whether each gradient is what it must be: this rank's own sum under no_sync, else the
    average over the ranks of their sums."""
    rank = dist.get_rank()
    model, local = _BackwardInside(find_unused), _BackwardInside(find_unused)
    out = []
    with tribucket.fused_bucketing(model, find_unused_parameters=find_unused) as reducer:
        model.reducer = reducer
        for step, sync in enumerate([False, True, False, True]):
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(10 * step + rank))
            model(x, sync, prepare)
            local.head(torch.tanh(local.lin(x))).square().sum().backward()
            ok = []
            for (name, p), q in zip(model.named_parameters(), local.parameters()):
                want = None if q.grad is None else q.grad.clone()
                if sync and want is not None:
                    dist.all_reduce(want)
                    want /= dist.get_world_size()
                ok.append((name, want is None and p.grad is None or
                           want is not None and p.grad is not None and
                           torch.allclose(p.grad, want, rtol=1e-6, atol=1e-7)))
            out.append((step, ok))
            if sync:
                model.zero_grad()
                local.zero_grad()
    return out


@pytest.mark.parametrize("find_unused,prepare", [(False, False), (False, True), (True, True)],
                         ids=["plain", "prepared", "find_unused"])
def test_backward_inside_the_forward(dist_run, find_unused, prepare):
    # the backward decides whether it averages when it runs (no_sync inside the forward
    # counts); with find_unused_parameters, reducer.prepare_for_backward(loss) names the
    # parameters it reaches (the forward's output, None, reaches none)
    for step, ok in dist_run(_backward_inside, find_unused, prepare, world_size=2,
                             timeout=60)[0]:
        assert all(good for _, good in ok), (step, ok)


# ---------------------------------------------------------------- unusual parameters
class OddParameters(nn.Module):
    """``gapped``: a parameter that is a column slice of a larger tensor (strides with gaps,
    as a slice of a pretrained fused QKV weight); ``complex``: complex64 and complex128
    parameters beside a real one. Initial values differ per rank: entering broadcasts
    rank 0's."""

    def __init__(self, case: str, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.lin = nn.Linear(8, 8)
        if case == "gapped":
            self.w = nn.Parameter(torch.randn(8, 24, generator=g)[:, 4:20])
        else:
            self.w = nn.Parameter(torch.randn(8, 16, generator=g, dtype=torch.complex64))
            self.v = nn.Parameter(torch.randn(16, generator=g, dtype=torch.complex128))

    def forward(self, x):
        h = self.lin(x)
        if self.w.is_complex():
            return ((h.to(self.w.dtype) @ self.w) * self.v).abs().to(h.dtype)
        return torch.tanh(h @ self.w)


def _odd_parameters_train(case: str, view: bool, api: str):
    """``case`` + ``"+hook"``: torch's ``allreduce_hook`` registered on both."""
    rank = dist.get_rank()
    case, _, hook = case.partition("+")
    torch.manual_seed(0)
    mine, theirs = OddParameters(case, 10 + rank), OddParameters(case, 10 + rank)
    theirs.load_state_dict(mine.state_dict())
    ddp = DDP(theirs, gradient_as_bucket_view=view)
    opt_a = torch.optim.SGD(mine.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(theirs.parameters(), lr=0.1)
    if api == "ddp":
        ctx, model = contextlib.nullcontext(), tribucket.DistributedDataParallel(
            mine, gradient_as_bucket_view=view)
        reducer = model
    else:
        ctx = reducer = tribucket.fused_bucketing(mine, gradient_as_bucket_view=view)
        model = mine
    if hook:
        for target in (ddp, reducer):
            target.register_comm_hook(None, default_hooks.allreduce_hook)
    with ctx:
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))
            for m, opt in ((model, opt_a), (ddp, opt_b)):
                m(x).square().mean().backward()
                opt.step()
            _assert_same(mine, theirs, f"{case} step {step}")
            opt_a.zero_grad()
            opt_b.zero_grad()
    return _gathered_equal(mine)


@pytest.mark.parametrize("api", ["fused_bucketing", "ddp"])
@pytest.mark.parametrize("view", [False, True])
@pytest.mark.parametrize("case", ["gapped", "complex", "complex+hook"])
def test_unusual_parameters_train_as_with_ddp(dist_run, case, view, api):
    # complex parameters: a bucket of their own each, all-reduced as torch.distributed does
    assert all(dist_run(_odd_parameters_train, case, view, api, world_size=2, timeout=60))


def _odd_gradients_kept(case: str):
    """Three steps with zero_grad(set_to_none=False) while the loop keeps the .grad tensors
    from the first step on, under DDP and under fused_bucketing: per step, whether each kept
    tensor still is its .grad, and the largest difference between the two runs' kept
    gradients."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    mine, theirs = OddParameters(case, 10 + rank), OddParameters(case, 10 + rank)
    theirs.load_state_dict(mine.state_dict())
    ddp = DDP(theirs)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (mine, theirs)]
    kept: dict = {}
    out = []
    with tribucket.fused_bucketing(mine):
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))
            for name, m, model in (("mine", mine, mine), ("ddp", ddp, theirs)):
                m(x).square().mean().backward()
                grads = kept.setdefault(name, [p.grad for p in model.parameters()])
                same = all(p.grad is g for p, g in zip(model.parameters(), grads))
                out.append((name, step, same))
            diff = max((a - b).abs().max().item() for a, b in zip(kept["mine"], kept["ddp"]))
            out.append(("diff", step, diff))
            for opt in opts:
                opt.step()
                opt.zero_grad(set_to_none=False)
    return out


@pytest.mark.parametrize("case", ["gapped", "complex"])
def test_unusual_parameters_kept_gradients_stay_the_gradients(dist_run, case):
    # with set_to_none=False DDP writes the average into the same .grad tensors; a complex
    # parameter's own bucket must too
    for rows in dist_run(_odd_gradients_kept, case, world_size=2, timeout=60):
        for name, step, value in rows:
            if name == "diff":
                assert value < 1e-6, (case, step, value)
            else:
                assert value is True, (case, name, step)


def _entry_refusal(model: nn.Module, **options) -> str | None:
    """The ValueError that entering fused_bucketing(model, **options) raises, or None."""
    try:
        tribucket.fused_bucketing(model, **options)
    except ValueError as e:
        return str(e)
    return None


def _complex_sharded():
    return _entry_refusal(OddParameters("complex", 0), shard_optimizer=True)


def test_sharding_complex_parameters_is_refused_by_name(dist_run):
    for message in dist_run(_complex_sharded, world_size=2, timeout=60):
        assert message is not None and "does not shard complex parameters" in message, message
        assert "['w', 'v']" in message, message


class _OneComplex(nn.Module):
    """A real layer and one complex parameter of ``dtype``."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.lin = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8, 16, generator=g, dtype=dtype))

    def forward(self, x):
        return (self.lin(x).to(self.w.dtype) @ self.w).abs().float()


def _complex_figures(dtype: torch.dtype):
    """The reducer's norm and flag and ``tribucket.clip_grad_norm_`` of a model with a
    complex parameter against torch's after DDP: ``(our norm's dtype, torch's, ours,
    torch's, found_inf, our clipped norm, torch's, largest gradient difference)``."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    mine, theirs = _OneComplex(dtype), _OneComplex(dtype)
    theirs.load_state_dict(mine.state_dict())
    ddp = DDP(theirs)
    with tribucket.fused_bucketing(mine) as reducer:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
        mine(x).square().mean().backward()
        ddp(x).square().mean().backward()
        norm = reducer.grad_norm()
        want = torch.nn.utils.get_total_norm([p.grad for p in theirs.parameters()])
        flag = reducer.found_inf.item()
        clipped = tribucket.clip_grad_norm_(mine.parameters(), 0.01)
        torch_clipped = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.01)
        diff = max((a.grad - b.grad).abs().max().item()
                   for a, b in zip(mine.parameters(), theirs.parameters()))
    return (norm.dtype, want.dtype, norm.item(), want.item(), flag, clipped.item(),
            torch_clipped.item(), diff)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_complex_gradients_norm_flag_and_clip_as_torch(dist_run, dtype):
    # a complex gradient's norm is a real number: float32 for complex64, float64 for
    # complex128, as torch's get_total_norm and clip_grad_norm_ give it
    for (got_dtype, want_dtype, got, want, flag, clipped, torch_clipped,
         diff) in dist_run(_complex_figures, dtype, world_size=2, timeout=60):
        assert got_dtype == want_dtype, (got_dtype, want_dtype)
        assert got == pytest.approx(want, rel=1e-6, abs=0), (got, want)
        assert flag == 0.0
        assert clipped == pytest.approx(torch_clipped, rel=1e-6, abs=0)
        assert diff <= 1e-9, diff


# ---------------------------------------------------------------- checks and messages
def _no_trainable_parameter():
    return _entry_refusal(nn.Linear(3, 3).requires_grad_(False))


def test_a_model_without_trainable_parameters_is_refused(dist_run):
    for message in dist_run(_no_trainable_parameter, world_size=2):
        assert message is not None and "no parameter that requires a gradient" in message


def _every_parameter_ignored():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    return _entry_refusal(model, ignore_parameters=list(model.parameters()))


def test_ignoring_every_parameter_is_refused(dist_run):
    # as torch DDP: nothing would be averaged
    for message in dist_run(_every_parameter_ignored, world_size=2, timeout=60):
        assert message is not None and "ignore_parameters" in message, message
        assert "nothing to average" in message, message


def _unmaterialized(kind: str, api: str):
    """A model whose parameters have no storage yet: built on the meta device (to be
    materialized with ``to_empty``), or holding a lazy module before its first forward."""
    if kind == "meta":
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    else:
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.LazyLinear(2))
    try:
        if api == "ddp":
            tribucket.DistributedDataParallel(model)
        else:
            tribucket.fused_bucketing(model)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("api", ["fused_bucketing", "ddp"])
@pytest.mark.parametrize("kind", ["meta", "lazy"])
def test_parameters_without_storage_are_refused_by_name(dist_run, kind, api):
    # a meta model materialized after entering gets new parameter objects, which the reducer
    # never sees: it trained with no averaging and no error. Refused at entry, as DDP does.
    for message in dist_run(_unmaterialized, kind, api, world_size=2, timeout=60):
        assert message is not None, "accepted"
        if kind == "meta":
            assert "'0.weight' is on the meta device" in message, message
            assert "to_empty" in message, message
        else:
            assert "'2.weight' is not initialized" in message, message
            assert "forward" in message, message


class Reentrant(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 1)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(self.a, x, use_reentrant=True)
        return self.b(h)


def _reentrant_with_find_unused():
    model = Reentrant()
    with tribucket.fused_bucketing(model, find_unused_parameters=True):
        try:
            model(torch.randn(2, 4, requires_grad=True)).sum().backward()
        except RuntimeError as e:
            return str(e)
    return None


def test_reentrant_checkpointing_error_names_the_cause_and_fix(dist_run):
    for message in dist_run(_reentrant_with_find_unused, world_size=2):
        assert message is not None
        assert "use_reentrant=True" in message and "use_reentrant=False" in message \
            and "static_graph=True" in message, message


def _bucket_annotated_int(state, bucket: int):
    return default_hooks.allreduce_hook(state, bucket)


def _returns_annotated_int(state, bucket) -> int:
    return default_hooks.allreduce_hook(state, bucket)


def _annotated_hooks():
    model = nn.Linear(3, 3)
    messages = []
    with tribucket.fused_bucketing(model) as reducer:
        for hook in (_bucket_annotated_int, _returns_annotated_int):
            try:
                reducer.register_comm_hook(None, hook)
                messages.append(None)
            except ValueError as e:
                messages.append(str(e))
        reducer.register_comm_hook(None, default_hooks.allreduce_hook)  # annotated right
        model(torch.randn(2, 3)).sum().backward()
    return messages


def test_comm_hook_annotations_are_checked_as_ddp(dist_run):
    for bucket_msg, return_msg in dist_run(_annotated_hooks, world_size=2):
        assert bucket_msg is not None and "GradBucket" in bucket_msg
        assert return_msg is not None and "Future" in return_msg


# ---------------------------------------------------------------- require_backward_grad_sync
def _require_backward_grad_sync():
    """nanoGPT's accumulation: the attribute set before each micro-batch's forward."""
    rank = dist.get_rank()
    mine, theirs = Penalised(), Penalised()
    ddp = DDP(theirs)
    opt_a = torch.optim.AdamW(mine.parameters(), lr=1e-2)
    opt_b = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    with tribucket.fused_bucketing(mine) as reducer:
        for step in range(3):
            for micro in range(3):
                torch.manual_seed(10 * step + micro + 100 * rank)
                x = torch.randn(4, 6)
                reducer.require_backward_grad_sync = micro == 2
                ddp.require_backward_grad_sync = micro == 2
                mine(x).square().mean().backward()
                ddp(x).square().mean().backward()
            torch.nn.utils.clip_grad_norm_(mine.parameters(), 0.5)
            torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5)
            opt_a.step(); opt_b.step()
            opt_a.zero_grad(set_to_none=True); opt_b.zero_grad(set_to_none=True)
        for a, b in zip(mine.parameters(), theirs.parameters()):
            assert torch.equal(a, b)
    return _gathered_equal(mine)


def test_require_backward_grad_sync_accumulates_as_ddp(dist_run):
    assert all(dist_run(_require_backward_grad_sync, world_size=2))


# ------------------------------------------------- patterns of the models users bring
class _WeightNormed(nn.Module):
    """A weight-norm parametrization (its two tensors are the parameters) and two heads."""

    def __init__(self):
        super().__init__()
        self.a = nn.utils.parametrizations.weight_norm(nn.Linear(8, 8))
        self.b = nn.Linear(8, 4)
        self.c = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h), self.c(h)


def _train_weight_normed(kind: str, variant: str) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = _WeightNormed()
    if variant == "tensor_hook":  # a hook of the user's on a parameter's gradient
        model.b.weight.register_hook(lambda g: g * 3)
    ctx = tribucket.fused_bucketing(model) if kind == "tribucket" else contextlib.nullcontext()
    with ctx:
        run = model if kind == "tribucket" else DDP(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            x = torch.randn(5, 8, generator=torch.Generator().manual_seed(rank * 10 + step))
            o1, o2 = run(x)
            if variant == "two_losses":  # torch.autograd.backward over several roots
                torch.autograd.backward([o1.square().mean(), o2.abs().mean()])
            else:
                (o1.square().mean() + o2.abs().mean()).backward()
            opt.step()
            opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _weight_normed_both(variant: str) -> list[str]:
    mine, theirs = _train_weight_normed("tribucket", variant), _train_weight_normed("ddp", variant)
    return [n for n in theirs if not torch.allclose(mine[n], theirs[n], rtol=1e-5, atol=1e-6)]


@pytest.mark.parametrize("variant", ["plain", "two_losses", "tensor_hook"])
def test_weight_norm_several_losses_and_tensor_hooks_train_as_with_ddp(dist_run, variant):
    for differ in dist_run(_weight_normed_both, variant, world_size=2, timeout=60):
        assert differ == [], differ


def _after_close(use: str):
    """A reducer used after its block ended: ``use`` is how. The error's text, or what
    the backward left: whether the ranks' gradients differ."""
    from models import batch, build, loss_of
    rank = dist.get_rank()
    model = build("mlp")
    with tribucket.fused_bucketing(model) as reducer:
        loss_of(model(batch("mlp", rank, 0))).backward()
    model.zero_grad()
    try:
        if use == "with":
            with reducer:
                loss_of(model(batch("mlp", rank, 1))).backward()
        elif use == "no_sync":
            with reducer.no_sync():
                pass
        elif use == "join":
            with reducer.join():
                pass
        else:
            reducer.register_comm_hook(None, tribucket.hooks.fp16_compress_hook)
    except RuntimeError as e:
        return str(e)
    grads = [p.grad for p in model.parameters()] if use == "with" else []
    return f"no error (gradients differ across ranks: {_differ_across_ranks(grads)})"


def _differ_across_ranks(grads: list) -> bool:
    flat = torch.cat([g.reshape(-1) for g in grads]) if grads else torch.zeros(1)
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat)
    return any(not torch.equal(every[0], e) for e in every[1:])


@pytest.mark.parametrize("use", ["with", "no_sync", "join", "register_comm_hook"])
def test_a_closed_reducer_refuses_to_be_used_again(dist_run, use):
    # its hooks are off the model: `with reducer:` again averaged nothing, silently
    for message in dist_run(_after_close, use):
        assert "closed" in message and "fused_bucketing" in message, message


def _ignored_on_rank_1():
    from models import build
    model = build("mlp")
    ignored = ["layers.0.bias"] if dist.get_rank() == 1 else []
    try:
        tribucket.fused_bucketing(model, ignore_parameters=ignored)
    except RuntimeError as e:
        return str(e)
    return None


def test_ignore_parameters_that_differ_across_ranks_are_named(dist_run):
    # not "the model differs across ranks" (it does not): the option does
    for message in dist_run(_ignored_on_rank_1, world_size=2, timeout=60):
        assert message is not None and "ignore_parameters" in message, message
        assert "layers.0.bias" in message and "model differs" not in message, message
