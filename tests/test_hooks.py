"""Comm hooks: torch's own hooks through tribucket equal DDP; tribucket's built-in hooks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as DDP

import tribucket
from tribucket import hooks
from models import batch, build, loss_of


def _grads(model):
    return [p.grad.clone() if p.grad is not None else None for p in model.parameters()]


def _local_grads(model, x):
    """This rank's own gradients (no communication), on a copy of ``model``."""
    twin = copy.deepcopy(model)
    for p in twin.parameters():
        p.grad = None
    loss_of(twin(x)).backward()
    return _grads(twin)


def _all_local_grads(model, x):
    """Every rank's local gradients, gathered: list (rank) of lists (param)."""
    mine = torch.cat([g.reshape(-1).double() for g in _local_grads(model, x)])
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return out


def _unflatten(flat, model):
    res, pos = [], 0
    for p in model.parameters():
        res.append(flat[pos:pos + p.numel()].view(p.shape))
        pos += p.numel()
    return res


# ---------------------------------------------------------------- built-in hooks vs reference
def _builtin_hooks_vs_reference(hook_name, state_kind, steps=3, chunk_mb=None):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build("mlp")
    hook = getattr(hooks, hook_name)
    state = {"none": None, "group": dist.group.WORLD,
             "state": hooks.GossipState() if hook_name == "gossip_hook"
             else hooks.CompressionState()}[state_kind]
    if hook_name == "gossip_hook" and state_kind != "state":
        state = hooks.GossipState()
    with tribucket.fused_bucketing(model, bucket_cap_mb=0.001, comm_chunk_mb=chunk_mb) \
            as reducer:
        reducer.register_comm_hook(state, hook)
        for step in range(steps):
            x = batch("mlp", rank, step)
            everyone = _all_local_grads(model, x)
            loss_of(model(x)).backward()
            got = _grads(model)
            if hook_name == "allreduce_hook":
                expected = _unflatten(sum(everyone) / world, model)
                for g, e in zip(got, expected):
                    torch.testing.assert_close(g, e.float(), rtol=1e-6, atol=1e-7)
            elif hook_name in ("fp16_compress_hook", "bf16_compress_hook"):
                dt = torch.float16 if hook_name.startswith("fp16") else torch.bfloat16
                # reference: divide, round to the wire dtype, sum exactly, round again
                terms = [(e / world).to(dt).double() for e in everyone]
                expected = _unflatten(sum(terms).to(dt).float(), model)
                eps = torch.finfo(dt).eps
                for g, e in zip(got, expected):
                    torch.testing.assert_close(g, e, rtol=world * eps, atol=1e-6)
            elif hook_name == "noop_hook":
                for g, e in zip(got, _unflatten(everyone[rank], model)):
                    torch.testing.assert_close(g, e.float(), rtol=1e-6, atol=1e-7)
            elif hook_name == "gossip_hook":
                send_to, recv_from = hooks.GossipState(iteration=step).peers(rank, world)
                expected = _unflatten((everyone[rank] + everyone[recv_from]) / 2, model)
                for g, e in zip(got, expected):
                    torch.testing.assert_close(g, e.float(), rtol=1e-6, atol=1e-7)
            model.zero_grad()
        return reducer.stats.bucket_bytes_allocated, getattr(state, "iteration", None)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("hook_name,state_kind", [
    ("allreduce_hook", "none"), ("allreduce_hook", "group"), ("fp16_compress_hook", "state"),
    ("bf16_compress_hook", "none"), ("noop_hook", "none"), ("gossip_hook", "state"),
])
def test_builtin_hook_against_reference(dist_run, world_size, hook_name, state_kind):
    results = dist_run(_builtin_hooks_vs_reference, hook_name, state_kind,
                       world_size=world_size)
    if hook_name == "gossip_hook":
        assert results[0][1] == 3  # the schedule advanced once per iteration


@pytest.mark.parametrize("hook_name", ["allreduce_hook", "fp16_compress_hook",
                                       "bf16_compress_hook"])
def test_builtin_hook_sent_in_chunks(dist_run, hook_name):
    """The single-allreduce hooks may be sent in chunks: same result."""
    dist_run(_builtin_hooks_vs_reference, hook_name, "state" if "fp16" in hook_name else "none",
             chunk_mb=0.0002, world_size=3)


def test_gossip_hypercube_at_four_ranks(dist_run):
    dist_run(_builtin_hooks_vs_reference, "gossip_hook", "state", world_size=4)


def test_gossip_schedule():
    s = hooks.GossipState()
    assert [hooks.GossipState(iteration=t).peers(5, 8) for t in range(3)] == \
        [(4, 4), (7, 7), (1, 1)]
    assert [hooks.GossipState(iteration=t).peers(0, 3) for t in range(2)] == [(1, 2), (2, 1)]
    s.load_state_dict({"iteration": 7})
    assert s.state_dict() == {"iteration": 7}


# ---------------------------------------------------------------- torch's hooks: same as DDP
def _torch_hook_vs_ddp(hook_name, model_name, kwargs, steps=6, powersgd=None):
    rank = dist.get_rank()
    mine, theirs = build(model_name), build(model_name)
    ddp = DDP(theirs, **kwargs)
    if hook_name == "powerSGD_hook":
        s1 = psgd.PowerSGDState(process_group=None, random_seed=0, **powersgd)
        s2 = psgd.PowerSGDState(process_group=None, random_seed=0, **powersgd)
        hook = psgd.powerSGD_hook
    else:
        s1 = s2 = None
        hook = getattr(default_hooks, hook_name)
        if hook_name == "fp16_compress_wrapper":
            hook = default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook)
    # DDP refuses a hook *named* bf16_compress_hook without CUDA/NCCL; the same code under
    # another name runs on gloo
    ddp.register_comm_hook(s2, _bf16_renamed if hook is default_hooks.bf16_compress_hook
                           else hook)
    opt_a = torch.optim.SGD(mine.parameters(), lr=0.05)
    opt_b = torch.optim.SGD(theirs.parameters(), lr=0.05)
    with tribucket.fused_bucketing(mine, **kwargs) as reducer:
        reducer.register_comm_hook(s1, hook)
        for step in range(steps):
            x = batch(model_name, rank, step)
            loss_of(mine(x)).backward()
            loss_of(ddp(x)).backward()
            for (n, a), b in zip(mine.named_parameters(), theirs.parameters()):
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"step {step} {n}: {m}")
            opt_a.step()
            opt_b.step()
            opt_a.zero_grad()
            opt_b.zero_grad()
        return reducer.stats.buckets


def _bf16_renamed(state, bucket):
    return default_hooks.bf16_compress_hook(state, bucket)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("hook_name", ["allreduce_hook", "fp16_compress_hook",
                                       "bf16_compress_hook", "fp16_compress_wrapper"])
def test_torch_default_hooks_equal_ddp(dist_run, world_size, hook_name):
    dist_run(_torch_hook_vs_ddp, hook_name, "mlp", dict(bucket_cap_mb=0.001),
             world_size=world_size)


@pytest.mark.parametrize("world_size", [2, 3])
def test_torch_powersgd_equals_ddp(dist_run, world_size):
    opts = dict(matrix_approximation_rank=2, start_powerSGD_iter=2, use_error_feedback=True,
                warm_start=True, min_compression_rate=0.5)
    # one bucket: with several, DDP itself deadlocks or aborts on gloo (its PowerSGD callbacks
    # launch collectives from worker threads in a different order on each rank); tribucket's
    # multi-bucket PowerSGD is checked against a serial run below
    buckets = dist_run(_torch_hook_vs_ddp, "powerSGD_hook", "mlp", {}, powersgd=opts,
                       world_size=world_size)
    assert buckets[0] == 1


class _Permuted(nn.Module):
    """Parameters whose memory order is not their logical order: a channels_last
    convolution and a transposed weight (as a checkpoint's ``W.t()`` loaded as is)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
        self.w = nn.Parameter(torch.randn(12, 8).t())  # shape (8, 12), strides (1, 8)

    def forward(self, x):
        h = torch.tanh(self.conv(x)).mean((2, 3))
        return h @ self.w


def _buffer_recorder(state, bucket):
    state.append(bucket.buffer().clone())
    return default_hooks.allreduce_hook(None, bucket)


def _permuted_vs_ddp(hook_name: str, view: bool, api: str, steps: int = 4):
    """Per step: whether the gradients (and the buffers the ``recorder`` hooks saw) equal
    DDP's, and whether every ``.grad`` has DDP's strides."""
    rank = dist.get_rank()
    mine, theirs = _Permuted(), _Permuted()
    ddp = DDP(theirs, gradient_as_bucket_view=view)
    if api == "ddp":
        model = reducer = tribucket.DistributedDataParallel(mine, gradient_as_bucket_view=view)
    else:
        # ``eager``: each gradient copied into its slot as it arrives (else one pack call)
        reducer = tribucket.fused_bucketing(mine, gradient_as_bucket_view=view,
                                            pack_on_ready=api == "eager").__enter__()
        model = mine
    seen_ours, seen_ddp = [], []
    if hook_name == "powerSGD":
        opts = dict(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                    random_seed=0)
        reducer.register_comm_hook(psgd.PowerSGDState(**opts), psgd.powerSGD_hook)
        ddp.register_comm_hook(psgd.PowerSGDState(**opts), psgd.powerSGD_hook)
    elif hook_name == "recorder":
        reducer.register_comm_hook(seen_ours, _buffer_recorder)
        ddp.register_comm_hook(seen_ddp, _buffer_recorder)
    out = []
    for step in range(steps):
        x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        x = x.to(memory_format=torch.channels_last)
        model(x).square().sum().backward()
        ddp(x).square().sum().backward()
        same = (all(torch.equal(a, b) for a, b in zip(seen_ours, seen_ddp))
                and len(seen_ours) == len(seen_ddp)
                and all(torch.equal(a.grad, b.grad)
                        for a, b in zip(mine.parameters(), theirs.parameters())))
        strides = [(a.grad.stride(), b.grad.stride())
                   for a, b in zip(mine.parameters(), theirs.parameters())]
        out.append((same, all(s == t for s, t in strides), strides))
        for m in (mine, theirs):
            m.zero_grad()
        seen_ours.clear()
        seen_ddp.clear()
    if api != "ddp":
        reducer.close()
    return out


@pytest.mark.parametrize("api", ["fused_bucketing", "eager", "ddp"])
@pytest.mark.parametrize("view", [False, True], ids=["copy", "view"])
@pytest.mark.parametrize("hook_name", ["none", "recorder", "powerSGD"])
def test_permuted_parameters_fill_the_bucket_in_memory_order(dist_run, hook_name, view, api):
    # DDP's bucket holds a channels_last or transposed parameter in its memory order (its
    # slot is viewed with the parameter's strides), so a hook sees those bytes, PowerSGD
    # compresses them, and with gradient_as_bucket_view the .grad has the parameter's
    # strides
    for same, strides_equal, strides in dist_run(_permuted_vs_ddp, hook_name, view, api,
                                                 world_size=2, timeout=60)[0]:
        assert same
        assert strides_equal, strides


def _contiguous_grads_of_permuted_parameters(api: str, hook: bool, steps: int = 3):
    """``.grad`` preset to contiguous zeros before each backward (autograd accumulates into
    them, keeping their layout) on channels_last and transposed parameters: per step, the
    largest difference from DDP's gradients."""
    rank = dist.get_rank()
    mine, theirs = _Permuted(), _Permuted()
    ddp = DDP(theirs)
    reducer = tribucket.fused_bucketing(mine, pack_on_ready=api == "eager").__enter__()
    if hook:  # tribucket's fp16 wire: the result is unpacked into the gradients
        reducer.register_comm_hook(None, hooks.fp16_compress_hook)
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    out = []
    for step in range(steps):
        for m in (mine, theirs):
            for p in m.parameters():
                p.grad = torch.zeros(p.shape)  # contiguous, whatever the parameter's layout
        x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        x = x.to(memory_format=torch.channels_last)
        mine(x).square().sum().backward()
        ddp(x).square().sum().backward()
        out.append(max(((a.grad - b.grad).abs().max() / b.grad.abs().max()).item()
                       for a, b in zip(mine.parameters(), theirs.parameters())))
    reducer.close()
    return out


@pytest.mark.parametrize("api,hook", [("fused_bucketing", False), ("eager", False),
                                      ("fused_bucketing", True)])
def test_contiguous_grads_of_permuted_parameters_as_ddp(dist_run, api, hook):
    tol = 2e-3 if hook else 0.0  # (fp16 on the wire: one rounding of each average)
    for diffs in dist_run(_contiguous_grads_of_permuted_parameters, api, hook, world_size=2,
                          timeout=60):
        assert max(diffs) <= tol, diffs


class _UsedOnRankOne(nn.Module):
    """Two channels_last convolutions; ``b`` is used on rank 1 only."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
        self.b = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)

    def forward(self, x):
        return self.a(x) if dist.get_rank() == 0 else self.a(x) + self.b(x)


def _permuted_used_elsewhere(hook):
    """find_unused_parameters: rank 0's ``b.weight.grad`` is created to receive the
    average (``hook``: tribucket's fp16 hook, whose fp16 result is unpacked, not lent;
    torch's on DDP); per parameter, whether its value and strides are DDP's."""
    mine, theirs = _UsedOnRankOne(), _UsedOnRankOne()
    ddp = DDP(theirs, find_unused_parameters=True)
    with tribucket.fused_bucketing(mine, find_unused_parameters=True) as reducer:
        if hook:
            reducer.register_comm_hook(None, hooks.fp16_compress_hook)
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(dist.get_rank()))
        x = x.to(memory_format=torch.channels_last)
        mine(x).sum().backward()
        ddp(x).sum().backward()
        return [(n, torch.allclose(p.grad, q.grad, rtol=2e-3, atol=1e-3) if hook else
                 torch.equal(p.grad, q.grad), p.grad.stride() == q.grad.stride())
                for (n, p), q in zip(mine.named_parameters(), theirs.parameters())]


@pytest.mark.parametrize("hook", [False, True], ids=["lent", "fp16_hook"])
def test_a_permuted_gradient_created_for_the_average_has_ddps_strides(dist_run, hook):
    for result in dist_run(_permuted_used_elsewhere, hook, world_size=2, timeout=60):
        assert all(same and strides for _, same, strides in result), result


def _powersgd_many_buckets_vs_serial(steps=7):
    """PowerSGD over many buckets (DDP aborts on gloo here): tribucket's result equals
    running torch's hook on the same buckets strictly one after the other."""
    rank = dist.get_rank()
    opts = dict(matrix_approximation_rank=2, start_powerSGD_iter=2, use_error_feedback=True,
                warm_start=True, min_compression_rate=0.5)
    mine = build("mlp_wide")
    ref = copy.deepcopy(mine)
    s1 = psgd.PowerSGDState(process_group=None, random_seed=0, **opts)
    s2 = psgd.PowerSGDState(process_group=None, random_seed=0, **opts)
    with tribucket.fused_bucketing(mine, bucket_cap_mb=0.1) as reducer:
        reducer.register_comm_hook(s1, psgd.powerSGD_hook)
        n_buckets = []
        for step in range(steps):
            x = batch("mlp_wide", rank, step)
            layout = reducer.layout
            n_buckets.append(len(layout.buckets))
            loss_of(mine(x)).backward()
            # serial reference with the same layout
            loss_of(ref(x)).backward()
            params = list(ref.parameters())
            for b, bucket in enumerate(layout.buckets):
                members = [params[i] for i in bucket.indices]
                flat = torch.cat([q.grad.reshape(-1) for q in members])
                gb = tribucket.GradBucket(b, flat, members, bucket.offsets,
                                          is_last=b == len(layout.buckets) - 1)
                out = psgd.powerSGD_hook(s2, gb).wait()
                out = out[0] if isinstance(out, list) else out
                for q, off in zip(members, bucket.offsets):
                    q.grad.copy_(out[off:off + q.numel()].view(q.shape))
            for (n, a), b in zip(mine.named_parameters(), ref.parameters()):
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"step {step} {n}: {m}")
            mine.zero_grad()
            ref.zero_grad()
        return n_buckets


@pytest.mark.parametrize("world_size", [2, 3])
def test_powersgd_several_buckets_no_abort(dist_run, world_size):
    results = dist_run(_powersgd_many_buckets_vs_serial, world_size=world_size, timeout=180)
    assert max(results[0]) >= 5  # really several buckets after the rebuild


def _identical_on_every_rank_powersgd(steps=6):
    model = build("mlp_wide")
    state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                               start_powerSGD_iter=2, random_seed=3)
    with tribucket.fused_bucketing(model, bucket_cap_mb=0.1) as reducer:
        reducer.register_comm_hook(state, psgd.powerSGD_hook)
        sums = []
        for step in range(steps):
            loss_of(model(batch("mlp_wide", dist.get_rank(), step))).backward()
            sums.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
            model.zero_grad()
    return sums


def test_powersgd_gradients_identical_across_ranks(dist_run):
    results = dist_run(_identical_on_every_rank_powersgd, world_size=3)
    for r in results[1:]:
        for a, b in zip(results[0], r):
            assert torch.equal(a, b)


# ---------------------------------------------------------------- fused fp16 vs torch's hook
def _ulp16(v):
    """Spacing of fp16 numbers at magnitude ``v`` (subnormal spacing below 2**-14)."""
    e = torch.floor(torch.log2(v.clamp_min(2.0**-14)))
    return torch.pow(2.0, e - 10)


def _fused_fp16_vs_torch(steps=4):
    rank, world = dist.get_rank(), dist.get_world_size()
    mine, theirs = build("mlp"), build("mlp")
    ddp = DDP(theirs, bucket_cap_mb=0.001)
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    not_exact = total = 0
    with tribucket.fused_bucketing(mine, bucket_cap_mb=0.001) as reducer:
        reducer.register_comm_hook(None, hooks.fp16_compress_hook)
        for step in range(steps):
            x = batch("mlp", rank, step)
            # scale the loss so the gradients sit in fp16's normal range, as a loss scaler
            # would put them (1024 is exact: it does not change any rounding)
            everyone = [_unflatten(e, mine) for e in _all_local_grads(mine, x)]
            (1024 * loss_of(mine(x))).backward()
            (1024 * loss_of(ddp(x))).backward()
            for k, (a, b) in enumerate(zip(mine.parameters(), theirs.parameters())):
                largest = torch.stack([1024 * e[k].abs() for e in everyone]).amax(0) / world
                if world == 2:
                    # x/2 commutes with rounding: bit-equal except where a term is subnormal
                    # (torch rounds it twice): one subnormal ulp per term, which the fp16
                    # addition can turn into one ulp of the sum
                    bound = 2 * _ulp16(torch.maximum(largest, b.grad.abs()).double())
                else:
                    # torch rounds x to fp16 and then x/3 (two roundings per term),
                    # tribucket rounds x/3 once: each term may differ by one ulp of the
                    # largest term, and each of gloo's world-1 fp16 additions may round the
                    # other way: at most world + 2 ulps of the largest term or of the sum
                    bound = (world + 2) * _ulp16(torch.maximum(largest, b.grad.abs()).double())
                diff = (a.grad.double() - b.grad.double()).abs()
                assert bool((diff <= bound).all()), f"step {step} param {k}: {diff.max()}"
                not_exact += int((a.grad != b.grad).sum())
                total += a.grad.numel()
            mine.zero_grad()
            ddp.zero_grad()
        return not_exact / total, reducer.stats.bucket_bytes_allocated


def _default_bucket_bytes():
    model = build("mlp")
    with tribucket.fused_bucketing(model, bucket_cap_mb=0.001) as reducer:
        loss_of(model(batch("mlp", dist.get_rank(), 0))).backward()
        return reducer.stats.bucket_bytes_allocated


@pytest.mark.parametrize("world_size", [2, 3])
def test_fused_fp16_agrees_with_torch_fp16_hook(dist_run, world_size):
    (worst, fused_bytes), *_ = dist_run(_fused_fp16_vs_torch, world_size=world_size)
    if world_size == 2:
        assert worst < 0.02  # elements not bit-equal: only those with a subnormal term
    default_bytes = dist_run(_default_bucket_bytes, world_size=world_size)[0]
    assert fused_bytes * 2 == default_bytes  # no fp32 staging bucket on the fused path


# ---------------------------------------------------------------- overflow detection
def _overflow(scale_on_rank):
    rank = dist.get_rank()
    model = build("mlp")
    state = hooks.CompressionState(check_overflow=True)
    flags = []
    with tribucket.fused_bucketing(model, bucket_cap_mb=0.001) as reducer:
        reducer.register_comm_hook(state, hooks.fp16_compress_hook)
        for step, big in enumerate([False, True, False]):
            x = batch("mlp", rank, step)
            loss = loss_of(model(x))
            if big and rank == scale_on_rank:
                loss = loss * 1e12  # gradients far past fp16's 65504 after /world
            loss.backward()
            flags.append(reducer.found_inf.item())
            model.zero_grad()
    return flags


def test_found_inf_set_on_overflow_only(dist_run):
    results = dist_run(_overflow, 1, world_size=2)
    for flags in results:  # agreed on every rank, even though only rank 1 overflowed
        assert flags == [0.0, 1.0, 0.0]


# ---------------------------------------------------------------- GradBucket contract
def _inspect_hook(state, bucket):
    buf = bucket.buffer()
    views_ok = all(g.data_ptr() >= buf.data_ptr() and
                   g.data_ptr() < buf.data_ptr() + buf.numel() * buf.element_size()
                   for g in bucket.gradients())
    state.append(dict(index=bucket.index(), dtype=buf.dtype, views_ok=views_ok,
                      shapes=[tuple(g.shape) for g in bucket.gradients()],
                      params=[tuple(p.shape) for p in bucket.parameters()],
                      is_last=bucket.is_last(), numel=buf.numel(),
                      total=sum(g.numel() for g in bucket.gradients())))
    return default_hooks.allreduce_hook(None, bucket)


def _bucket_contract():
    model = build("mixed")
    seen = []
    with tribucket.fused_bucketing(model, bucket_cap_mb=0.0003) as reducer:
        reducer.register_comm_hook(seen, _inspect_hook)
        loss_of(model(batch("mixed", dist.get_rank(), 0))).backward()
    return seen


def test_grad_bucket_contract(dist_run):
    seen = dist_run(_bucket_contract, world_size=2)[0]
    assert {s["dtype"] for s in seen} == {torch.float32, torch.bfloat16, torch.float64}
    for s in seen:
        assert s["views_ok"] and s["shapes"] == s["params"]
        assert s["numel"] == s["total"]  # generic hooks get DDP's unpadded buffer
    assert [s["is_last"] for s in seen] == [False] * (len(seen) - 1) + [True]
    assert sorted(s["index"] for s in seen) == list(range(len(seen)))


# ---------------------------------------------------------------- bad hooks and registration
def _bad_result_hook(state, bucket):
    kind = state
    fut = torch.futures.Future()
    if kind == "size":
        fut.set_result(bucket.buffer()[:-1])
    elif kind == "dtype":
        fut.set_result(bucket.buffer().to(torch.int32))
    elif kind == "exception":
        fut.set_exception(ValueError("hook exploded"))
    elif kind == "not_future":
        return bucket.buffer()
    return fut


def _bad_hooks():
    out = {}
    for kind in ("size", "dtype", "exception", "not_future"):
        model = build("mlp")
        with tribucket.fused_bucketing(model, bucket_cap_mb=0.001) as reducer:
            reducer.register_comm_hook(kind, _bad_result_hook)
            try:
                loss_of(model(batch("mlp", dist.get_rank(), 0))).backward()
                out[kind] = None
            except RuntimeError as e:
                out[kind] = str(e)
    model = build("mlp")
    with tribucket.fused_bucketing(model) as reducer:
        for name, call in [
            ("not_callable", lambda: reducer.register_comm_hook(None, 3)),
            # a state the hook cannot use: refused when registering (before, the first
            # backward raised, then close() raised it again)
            ("gossip_state", lambda: reducer.register_comm_hook(None, hooks.gossip_hook)),
            ("twice", lambda: (reducer.register_comm_hook(None, hooks.allreduce_hook),
                               reducer.register_comm_hook(None, hooks.allreduce_hook))),
        ]:
            try:
                call()
                out[name] = None
            except (TypeError, RuntimeError) as e:
                out[name] = f"{type(e).__name__}: {e}"
    model = build("mlp")
    with tribucket.fused_bucketing(model) as reducer:
        loss_of(model(batch("mlp", dist.get_rank(), 0))).backward()
        try:
            reducer.register_comm_hook(None, hooks.allreduce_hook)
            out["after_backward"] = None
        except RuntimeError as e:
            out["after_backward"] = str(e)
    model = build("mlp")
    with tribucket.fused_bucketing(model, gradient_as_bucket_view=True) as reducer:
        try:
            reducer.register_comm_hook(None, hooks.fp16_compress_hook)
            out["fused_view"] = None
        except ValueError as e:
            out["fused_view"] = str(e)
    return out


def test_bad_hooks_raise_named_errors(dist_run):
    out = dist_run(_bad_hooks, world_size=2)[0]
    assert "bucket" in out["size"] and "elements" in out["size"]
    assert "int32" in out["dtype"] and "bucket" in out["dtype"]
    assert "hook exploded" in out["exception"] and "bucket" in out["exception"]
    assert "Future" in out["not_future"]
    assert out["not_callable"].startswith("TypeError") and "callable" in out["not_callable"]
    assert out["twice"].startswith("RuntimeError") and "already registered" in out["twice"]
    assert out["gossip_state"] == ("TypeError: gossip_hook needs a tribucket.hooks.GossipState, "
                                   "got NoneType"), out["gossip_state"]
    assert "before the first backward" in out["after_backward"]
    assert "gradient_as_bucket_view" in out["fused_view"]


def test_builtin_hooks_run_under_torch_ddp(dist_run):
    """tribucket's hooks follow torch's contract: DDP can run them too."""
    dist_run(_builtin_under_ddp, world_size=2)


def _builtin_under_ddp():
    rank, world = dist.get_rank(), dist.get_world_size()
    for hook, state, tol in [(hooks.allreduce_hook, None, 1e-6),
                             (hooks.fp16_compress_hook, hooks.CompressionState(), 2e-3)]:
        # (DDP refuses any hook named bf16_compress_hook without CUDA and NCCL)
        model = build("mlp")
        ddp = DDP(model, bucket_cap_mb=0.001)
        ddp.register_comm_hook(state, hook)
        x = batch("mlp", rank, 0)
        everyone = _all_local_grads(model, x)
        loss_of(ddp(x)).backward()
        for g, e in zip(_grads(model), _unflatten(sum(everyone) / world, model)):
            torch.testing.assert_close(g, e.float(), rtol=tol, atol=1e-6)
