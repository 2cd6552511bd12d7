"""Mixed precision: ``found_inf`` of the reduced gradients, the fused epilogue (norm and
non-finite flag), ``clip_grad_norm_`` and ``tribucket.amp.GradScaler`` against torch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tribucket
from tribucket import hooks

FP32_MAX = torch.finfo(torch.float32).max


class _Direct(nn.Module):
    """``loss = (w * c).sum()``: the gradient of ``w`` is ``c``, chosen per rank and step."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(6))
        self.v = nn.Parameter(torch.ones(3))

    def forward(self, c):
        return (self.w * c).sum() + self.v.sum()


def _sum_then_divide_hook(state, bucket):
    """A user hook that sums in fp32 and divides afterwards: inf can appear in the sum only."""
    world = dist.get_world_size()
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].div_(world))


_WIRES = {
    "fp32": (None, None),
    "fp32 sum hook": (None, _sum_then_divide_hook),
    "fp16": ("state", hooks.fp16_compress_hook),
    "bf16": ("state", hooks.bf16_compress_hook),
}

# per step, the gradient c of w on (rank 0, rank 1); v's gradient is always 1
_STEPS = [
    ("finite", 1.0, 2.0),
    ("nan on rank 1 only", 1.0, float("nan")),
    # fp16 wire: 80000 / 2 = 40000 per rank fits fp16 (max 65504), the sum does not;
    # bf16 wire: fp32max / 2 rounds to 2**127 in bf16, the sum 2**128 is inf
    ("sum overflows", 80000.0, 80000.0),
    ("sum overflows bf16", FP32_MAX, FP32_MAX),
    # user sum hook in fp32: each term finite, the sum inf
    ("sum overflows fp32", 0.6 * FP32_MAX, 0.6 * FP32_MAX),
    ("finite again", -3.0, 5.0),
]


def _found_inf_cases(wire):
    rank = dist.get_rank()
    state_kind, hook = _WIRES[wire]
    model = _Direct()
    out = []
    with tribucket.fused_bucketing(model) as reducer:
        if hook is not None:
            state = hooks.CompressionState(check_overflow=True) if state_kind else None
            reducer.register_comm_hook(state, hook)
        for name, c0, c1 in _STEPS:
            c = torch.full((6,), c0 if rank == 0 else c1)
            model(c).backward()
            grads = torch.cat([model.w.grad, model.v.grad])
            out.append((name, float(reducer.found_inf.item()),
                        bool(torch.isfinite(grads).all()), grads.clone()))
            model.zero_grad()
    return out


@pytest.mark.parametrize("wire", list(_WIRES))
def test_found_inf_means_nonfinite_reduced_gradients(dist_run, wire):
    results = dist_run(_found_inf_cases, wire, world_size=2)
    expect_inf = {"nan on rank 1 only"}
    # (on the fp16 wire the two cases past fp16's range already overflow in each rank's term)
    expect_inf |= {"fp16": {"sum overflows", "sum overflows bf16", "sum overflows fp32"},
                   "bf16": {"sum overflows bf16"},
                   "fp32 sum hook": {"sum overflows bf16", "sum overflows fp32"}}.get(wire, set())
    for rank, steps in enumerate(results):
        for name, flag, finite, grads in steps:
            # the definition: found_inf is set exactly when a reduced gradient is inf/NaN
            assert flag == (0.0 if finite else 1.0), \
                f"{wire}, {name}, rank {rank}: found_inf {flag} but .grad finite={finite}"
            assert (flag == 1.0) == (name in expect_inf), \
                f"{wire}, {name}, rank {rank}: found_inf {flag}, grads {grads.tolist()}"
    for (name, f0, _, g0), (_, f1, _, g1) in zip(*results):
        assert f0 == f1, f"{wire}, {name}: ranks disagree on found_inf"
        assert torch.equal(g0.nan_to_num(), g1.nan_to_num()), f"{wire}, {name}: grads differ"


# ---------------------------------------------------------------- the unpack kernel's epilogue
def _epilogue_backends():
    from tribucket.kernels import pack as _  # noqa: F401 - the module defines the kernels
    import importlib
    P = importlib.import_module("tribucket.kernels.pack")
    cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
    interp = pytest.mark.skipif(not P._interpreting_kernels(),
                                reason="kernels not defined under TRITON_INTERPRET=1")
    return [pytest.param("triton", "cpu", marks=interp, id="triton-interpreter"),
            pytest.param("triton", "cuda", marks=cuda, id="triton-cuda"),
            pytest.param("torch", "cpu", id="torch-cpu")]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                            "ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("backend,device", _epilogue_backends())
@pytest.mark.parametrize("buf_dtype,dst_dtype,scale", [
    (torch.float16, torch.float32, 1.0),     # the fp16 wire decompressed into fp32 .grad
    (torch.bfloat16, torch.float32, 0.5),
    (torch.float32, torch.float32, 1.0),     # a copy: loaded as floats for the epilogue
    (torch.float32, torch.bfloat16, 1 / 3),
])
def test_unpack_epilogue_matches_reference(backend, device, buf_dtype, dst_dtype, scale):
    from tribucket import kernels
    # odd sizes, a gap, an empty tensor and one tensor over two Triton blocks (4096)
    sizes = [3, 0, 5000, 7, 1]
    offsets = [0, 3, 5, 5008, 5020]
    numel = 5024
    g = torch.Generator().manual_seed(0)
    buf = (torch.randn(numel, generator=g) * 100).to(buf_dtype).to(device)
    plan = kernels.BucketPlan(sizes, offsets, numel, device, backend=backend)
    for special in (None, float("inf"), float("nan")):
        b = buf.clone()
        if special is not None:
            b[5 + 4097] = special  # in the second block of the big tensor
        outs = [torch.empty(n, dtype=dst_dtype, device=device) for n in sizes]
        refs = [torch.empty(n, dtype=dst_dtype) for n in sizes]
        stats = torch.zeros(2, device=device)
        ref_stats = torch.zeros(2)
        plan.unpack(b, outs, scale=scale, stats=stats)
        kernels.unpack_reference(b.cpu(), refs, offsets, scale=scale, stats=ref_stats)
        for o, r in zip(outs, refs):
            assert torch.equal(o.cpu().nan_to_num(), r.nan_to_num()), "values differ"
        assert stats[1].item() == ref_stats[1].item() == (0.0 if special is None else 1.0), \
            f"non-finite flag {stats[1].item()} (reference {ref_stats[1].item()})"
        if special is None:
            torch.testing.assert_close(stats[0].cpu(), ref_stats[0], rtol=1e-5, atol=0)
            dense = torch.cat([r.double().reshape(-1) for r in refs])
            torch.testing.assert_close(stats[0].cpu().double().sqrt(),
                                       torch.linalg.vector_norm(dense), rtol=1e-5, atol=0)
        stats2 = stats.clone()
        plan.unpack(b, outs, scale=scale, stats=stats2)  # accumulates into stats[0]
        if special is None:
            torch.testing.assert_close(stats2[0].cpu(), 2 * stats[0].cpu(), rtol=1e-6, atol=0)


def test_unpack_stats_must_be_two_float32():
    from tribucket import kernels
    plan = kernels.BucketPlan([3], [0], 3, "cpu")
    with pytest.raises(ValueError, match=r"stats must be a float32 tensor of shape \(2,\)"):
        plan.unpack(torch.zeros(3), [torch.zeros(3)], stats=torch.zeros(1))


# ---------------------------------------------------------------- clip_grad_norm_ and grad_norm
class _Counter:
    """Counts calls of a torch function in this process while installed."""

    def __init__(self, owner, name):
        self.owner, self.name, self.calls = owner, name, 0
        self.orig = getattr(owner, name)

    def __enter__(self):
        def counted(*a, **k):
            self.calls += 1
            return self.orig(*a, **k)
        setattr(self.owner, self.name, counted)
        return self

    def __exit__(self, *exc):
        setattr(self.owner, self.name, self.orig)


def _twins(name, find_unused=False, device="cpu", **reducer_kw):
    """The same model under tribucket (a reducer) and under DDP."""
    from models import build
    ours, ref = build(name).to(device), build(name).to(device)
    reducer = tribucket.Reducer(ours, find_unused_parameters=find_unused, **reducer_kw)
    ddp = nn.parallel.DistributedDataParallel(ref, find_unused_parameters=find_unused)
    return ours, ref, ddp, reducer


def _clip_vs_torch(name, wire, eager=None, device="cpu"):
    from models import batch, loss_of
    rank = dist.get_rank()
    ours, ref, ddp, reducer = _twins(name, device=device, bucket_cap_mb=0.001,
                                     pack_on_ready=eager)
    if wire == "fp16":  # the same wire on both sides: the fused hook and the generic one
        reducer.register_comm_hook(None, hooks.fp16_compress_hook)
        ddp.register_comm_hook(None, hooks.fp16_compress_hook)
    checks = []
    # max_norm: clips (small), does not clip (large), then the fallbacks
    hows = ["clip", "no clip", "inf norm", "subset", "modified", "dropped", "clip"]
    for step, how in enumerate(hows):
        x = batch(name, rank, step).to(device)
        loss_of(ours(x)).backward()
        loss_of(ddp(x)).backward()
        mine, theirs = list(ours.parameters()), list(ref.parameters())
        kw = {"max_norm": 0.05 if how != "no clip" else 1e6}
        if how == "inf norm":
            kw["norm_type"] = float("inf")
        if how == "subset":
            mine, theirs = mine[:3], theirs[:3]
        if how == "modified":  # a gradient changed after the backward: the figures are stale
            for p in (ours, ref):
                next(p.parameters()).grad.mul_(3.0)
        if how == "dropped":  # a gradient set to None: its slot of the bucket must not count
            for p in (ours, ref):
                next(p.parameters()).grad = None
        norm_ours = reducer.grad_norm()  # the norm of the gradients as they are now
        norm_torch = torch.nn.utils.get_total_norm(
            [p.grad for p in ref.parameters() if p.grad is not None])
        # the fast path multiplies the buckets itself; the general one calls torch's
        with _Counter(torch.nn.utils, "clip_grads_with_norm_") as torch_clip:
            got = tribucket.clip_grad_norm_(mine, **kw)
        fast = torch_clip.calls == 0
        want = torch.nn.utils.clip_grad_norm_(theirs, **kw)
        grads_equal = all((a.grad is None and b.grad is None) or
                          torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7)
                          for a, b in zip(ours.parameters(), ref.parameters()))
        checks.append(dict(how=how, got=got.item(), want=want.item(), fast=fast,
                           grad_norm=norm_ours.item(), norm_torch=norm_torch.item(),
                           grads_equal=grads_equal))
        for m in (ours, ref):
            with torch.no_grad():
                for p in m.parameters():
                    if p.grad is not None:
                        p -= 0.1 * p.grad
            m.zero_grad()
    params_equal = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                       for a, b in zip(ours.parameters(), ref.parameters()))
    reducer.close()
    return checks, params_equal


@pytest.mark.parametrize("name,wire,eager", [("mlp", "fp32", None), ("transformer", "fp32", None),
                                             ("mlp", "fp16", None),
                                             # each gradient copied into the bucket as it
                                             # arrives (the default for large gradients)
                                             ("mlp", "fp32", True)])
def test_clip_grad_norm_equals_torch(dist_run, name, wire, eager):
    for checks, params_equal in dist_run(_clip_vs_torch, name, wire, eager, world_size=2):
        check_clip_vs_torch(checks, params_equal)


def check_clip_vs_torch(checks, params_equal):
    """The assertions on :func:`_clip_vs_torch`'s result (also on a GPU)."""
    for c in checks:
        assert c["got"] == pytest.approx(c["want"], rel=1e-5), c
        assert c["grads_equal"], f"gradients after clipping differ from torch's: {c}"
        # the fast path exactly where the reducer's figures describe the gradients
        assert c["fast"] == (c["how"] in ("clip", "no clip")), c
        assert c["grad_norm"] == pytest.approx(c["norm_torch"], rel=1e-5), c
    assert params_equal


class _Fp64(nn.Module):
    """float64 layers (``mixed``: the last only, after a float32 one)."""

    def __init__(self, mixed: bool):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4).double()
        if not mixed:
            self.a.double()

    def forward(self, x):
        h = torch.tanh(self.a(x.to(self.a.weight.dtype)))
        return self.b(h.to(torch.float64))


def _clip_in_fp64(kind: str):
    """tribucket.clip_grad_norm_ (``sharded``: the optimizer's) of a model with float64
    parameters against torch's clip after DDP: ``[(our norm's dtype, torch's, ours, torch's,
    largest relative gradient difference after clipping)]`` per step."""
    rank = dist.get_rank()
    ours, ref = _Fp64(kind == "mixed"), _Fp64(kind == "mixed")
    ddp = nn.parallel.DistributedDataParallel(ref)
    out = []
    with tribucket.fused_bucketing(ours, bucket_cap_mb=0.0005,
                                   shard_optimizer=kind == "sharded") as reducer:
        opt = (tribucket.ShardedOptimizer(reducer, torch.optim.SGD, lr=0.0)
               if kind == "sharded" else None)
        for step in range(2):
            x = torch.randn(6, 8, generator=torch.Generator().manual_seed(10 * step + rank),
                            dtype=torch.float64)
            ours(x).square().mean().backward()
            ddp(x).square().mean().backward()
            want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
            if opt is not None:
                got, diff = opt.clip_grad_norm_(0.01), 0.0  # (the shards: not in .grad)
                opt.zero_grad()
            else:
                got = tribucket.clip_grad_norm_(ours, 0.01)
                diff = max(((a.grad - b.grad).abs().max() / b.grad.abs().max()).item()
                           for a, b in zip(ours.parameters(), ref.parameters()))
            out.append((got.dtype, want.dtype, got.item(), want.item(), diff))
            ours.zero_grad()
            ref.zero_grad()
    return out


@pytest.mark.parametrize("kind", ["fp64", "mixed", "sharded"])
def test_clip_of_fp64_gradients_keeps_fp64_precision(dist_run, kind):
    # torch's clip takes the norm of float64 gradients in float64; so must tribucket's
    for got_dtype, want_dtype, got, want, diff in dist_run(_clip_in_fp64, kind,
                                                           world_size=2, timeout=60)[0]:
        assert got_dtype == want_dtype == torch.float64, (got_dtype, want_dtype)
        assert got == pytest.approx(want, rel=1e-12, abs=0), (got, want)
        assert diff <= 1e-12, diff


class _TwoBranch(nn.Module):
    """``a(x)``'s square plus ``b(z)``'s mean: a NaN in ``z`` makes ``b.weight``'s gradient
    NaN and leaves the others finite."""

    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)
        self.b = nn.Linear(3, 4).to(dtype)

    def forward(self, x, z):
        return self.a(x).float().square().mean() + self.b(z).float().mean()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan()) and \
        torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def _clip_bits(dtype, device="cpu"):
    """tribucket.clip_grad_norm_ against DDP + torch's clip, step after step: the whole model
    (the reducer's figures), a part of it (the general path), a list naming parameters twice,
    and a NaN gradient on the last rank (the norm NaN, some gradients finite). Per step:
    ``(how, the norms have the same dtype and bits, the gradients after the clip have)``."""
    rank = dist.get_rank()
    ours, ref = _TwoBranch(dtype).to(device), _TwoBranch(dtype).to(device)
    ddp = nn.parallel.DistributedDataParallel(ref)
    out = []
    with tribucket.fused_bucketing(ours, bucket_cap_mb=0.001):
        for step in range(16):
            how = ("whole", "part", "twice", "nan")[step % 4]
            g = torch.Generator().manual_seed(100 * step + rank)
            x, z = torch.randn(6, 8, generator=g).to(dtype), torch.randn(6, 3, generator=g)
            if how == "nan" and rank == dist.get_world_size() - 1:
                z[2, 1] = float("nan")
            x, z = x.to(device), z.to(device, dtype)
            ours(x, z).backward()
            ddp(x, z).backward()
            mine, theirs = list(ours.parameters()), list(ref.parameters())
            if how == "part":
                mine, theirs = mine[1:4], theirs[1:4]
            if how == "twice":
                mine, theirs = mine + mine[-2:], theirs + theirs[-2:]
            got = tribucket.clip_grad_norm_(mine, max_norm=0.05)
            want = torch.nn.utils.clip_grad_norm_(theirs, max_norm=0.05)
            out.append((how, _same_bits(got, want), all(
                _same_bits(a.grad, b.grad) for a, b in zip(ours.parameters(), ref.parameters())),
                got.item(), want.item()))
            for m in (ours, ref):
                with torch.no_grad():
                    if bool(torch.isfinite(want)):  # (a scaler would skip the step)
                        for p in m.parameters():
                            p -= 0.5 * p.grad
                m.zero_grad()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_clip_is_torchs_to_the_bit(dist_run, dtype):
    # the norm in the gradients' dtype, a NaN norm makes every gradient NaN, a parameter
    # named twice is multiplied twice: as torch's clip_grad_norm_ after DDP, bit for bit
    steps = dist_run(_clip_bits, dtype, world_size=2, timeout=60)[0]
    assert [s for s in steps if not (s[1] and s[2])] == []


def _grad_norm_in_fp64(mixed: bool):
    """reducer.grad_norm() of a model with float64 parameters against torch's
    ``get_total_norm`` of DDP's gradients: ``(our dtype, torch's, ours, torch's)``."""
    rank = dist.get_rank()
    ours, ref = _Fp64(mixed), _Fp64(mixed)
    ddp = nn.parallel.DistributedDataParallel(ref)
    with tribucket.fused_bucketing(ours, bucket_cap_mb=0.0005) as reducer:
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(rank),
                        dtype=torch.float64)
        ours(x).square().mean().backward()
        ddp(x).square().mean().backward()
        got = reducer.grad_norm()
    want = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    return got.dtype, want.dtype, got.item(), want.item()


@pytest.mark.parametrize("mixed", [False, True], ids=["fp64", "mixed"])
def test_grad_norm_of_fp64_gradients_is_fp64(dist_run, mixed):
    # as torch's total norm: taken in float64 when a gradient is float64
    for got_dtype, want_dtype, got, want in dist_run(_grad_norm_in_fp64, mixed,
                                                     world_size=2):
        assert got_dtype == want_dtype == torch.float64
        assert abs(got - want) <= 1e-12 * want, (got, want)


def _grad_norm_vs_dense(name):
    """reducer.grad_norm() against the norm of the dense averaged gradient."""
    from models import batch, loss_of
    unused = name == "branchy"  # a branch used on one rank only, a layer never used
    ours, ref, ddp, reducer = _twins(name, bucket_cap_mb=0.001, find_unused=unused)
    for step in range(2):  # the second after the rebuild
        for m in (ours, ref):
            m.zero_grad()
        x = batch(name, dist.get_rank(), step)
        loss_of(ours(x)).backward()
        loss_of(ddp(x)).backward()
    dense = torch.cat([p.grad.double().reshape(-1) for p in ref.parameters()
                       if p.grad is not None])
    got = reducer.grad_norm().item()
    reducer.close()
    return got, torch.linalg.vector_norm(dense).item()


@pytest.mark.parametrize("name", ["mixed", "bn_channels_last", "tied", "branchy"])
def test_grad_norm_equals_dense_reference(dist_run, name):
    for got, want in dist_run(_grad_norm_vs_dense, name, world_size=2):
        assert got == pytest.approx(want, rel=2e-3 if name == "mixed" else 1e-5)


# ---------------------------------------------------------------- GradScaler
def _scaler_vs_torch(dtype, mode, device="cpu"):
    from models import batch, loss_of
    rank = dist.get_rank()
    ours, ref, ddp, reducer = _twins("mlp", device=device, bucket_cap_mb=0.001)
    enabled = dtype == torch.float16  # bf16 needs no loss scaling: the scaler is off
    # a huge initial scale: the first steps overflow in fp16 and are skipped
    kw = dict(init_scale=2.0**30, growth_interval=2, enabled=enabled)
    s_ours, s_ref = tribucket.amp.GradScaler(device, **kw), torch.amp.GradScaler(device, **kw)
    # "fused": AdamW(fused=True) unscales inside its step (no unscale_): the scaler only asks
    # for the inf flag (GradScaler._check_inf_per_device)
    fused = mode == "fused optimizer"
    o_ours = torch.optim.AdamW(ours.parameters(), lr=1e-2, fused=fused)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=fused)
    log = []
    for step in range(8):
        x = batch("mlp", rank, step).to(device)
        x = x * (1e4 if step == 5 else 1.0)  # a late overflow after the scale has dropped
        scans = []
        for model, fwd, scaler, opt in ((ours, ours, s_ours, o_ours), (ref, ddp, s_ref, o_ref)):
            with torch.autocast(device, dtype=dtype):
                loss = loss_of(fwd(x))
            with _Counter(torch, "_amp_foreach_non_finite_check_and_unscale_") as scan:
                scaler.scale(loss).backward()
                if not fused:
                    scaler.unscale_(opt)
                if mode == "unscale + clip":
                    (tribucket.clip_grad_norm_ if model is ours
                     else torch.nn.utils.clip_grad_norm_)(model.parameters(), 1.0)
                scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            scans.append(scan.calls)
        log.append((s_ours.get_scale() if enabled else 1.0,
                    s_ref.get_scale() if enabled else 1.0, scans[0]))
    same = [torch.allclose(a, b, rtol=1e-4, atol=1e-6)
            for a, b in zip(ours.parameters(), ref.parameters())]
    finite = all(bool(torch.isfinite(p).all()) for p in ours.parameters())
    reducer.close()
    return log, same, finite


@pytest.mark.parametrize("dtype,mode", [(torch.float16, "unscale + clip"),
                                        (torch.float16, "unscale"),
                                        (torch.float16, "fused optimizer"),
                                        (torch.bfloat16, "unscale + clip")])
def test_grad_scaler_matches_torch_on_ddp(dist_run, dtype, mode):
    for log, same, finite in dist_run(_scaler_vs_torch, dtype, mode, world_size=2):
        check_scaler_vs_torch(dtype, log, same, finite)


def check_scaler_vs_torch(dtype, log, same, finite):
    """The assertions on :func:`_scaler_vs_torch`'s result (also on a GPU)."""
    scales = [(a, b) for a, b, _ in log]
    assert all(a == b for a, b in scales), f"loss scales differ: {scales}"
    if dtype == torch.float16:
        # steps were skipped (the scale dropped from 2**30) and the scale grew back
        assert scales[-1][0] < 2.0**30 and len({a for a, _ in scales}) > 2, scales
        # no second inf scan: the reducer's flag served every unscale_
        assert all(n == 0 for _, _, n in log), f"inf scans per step: {log}"
    assert finite and all(same), f"parameters differ from torch's: {same}"


def _ddp_generic_overflow():
    """tribucket's fp16 hook under torch DDP (the generic path), CompressionState's flag."""
    model = nn.parallel.DistributedDataParallel(_Direct())
    state = hooks.CompressionState(check_overflow=True)
    model.register_comm_hook(state, hooks.fp16_compress_hook)
    flags = []
    for c in (1.0, 80000.0):  # 80000 / 2 fits fp16 on each rank, the sum does not
        state.found_inf.zero_()
        model(torch.full((6,), c)).backward()
        flags.append((state.found_inf.item(), bool(torch.isfinite(model.module.w.grad).all())))
        model.zero_grad()
    return flags


def test_compression_state_flags_the_sum_under_ddp(dist_run):
    for flags in dist_run(_ddp_generic_overflow, world_size=2):
        assert flags == [(0.0, True), (1.0, False)], flags


def _passes_during_backward(wire):
    """Reads of the gradients the reducer makes for the epilogue during a plain backward."""
    from models import batch, loss_of
    ours, ref, ddp, reducer = _twins("mlp", bucket_cap_mb=0.001)
    if wire == "fp16":
        reducer.register_comm_hook(None, hooks.fp16_compress_hook)
    reads = []
    for step in range(3):
        with _Counter(torch.linalg, "vector_norm") as vn, \
                _Counter(torch, "_foreach_norm") as fn, _Counter(torch, "isfinite") as fin:
            loss_of(ours(batch("mlp", dist.get_rank(), step))).backward()
        reads.append(vn.calls + fn.calls + fin.calls)
        ours.zero_grad()
    first = reducer.found_inf.item()  # asked for: computed now, once per bucket
    reducer.close()
    return reads, first


@pytest.mark.parametrize("wire", ["fp32", "fp16"])
def test_epilogue_costs_nothing_when_nobody_asks(dist_run, wire):
    for reads, flag in dist_run(_passes_during_backward, wire, world_size=2):
        assert reads == [0, 0, 0], f"norm/isfinite calls during backward: {reads}"
        assert flag == 0.0



def _clip_norm_of_large_buckets():
    """Buckets of millions of elements after the rebuild: the norm tribucket.clip_grad_norm_
    takes from the buckets is as close to the exact norm as torch's (a single fp32 sum over a
    flat 7M-element bucket was 1.9e-3 off from the second step on)."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    out = []
    with tribucket.fused_bucketing(model):
        for step in range(3):
            torch.manual_seed(10 * rank + step)
            model(torch.randn(8, 1024)).square().mean().backward()
            grads = [p.grad for p in model.parameters()]
            exact = torch.sqrt(sum(g.double().square().sum() for g in grads)).item()
            theirs = torch.nn.utils.get_total_norm(grads).item()
            mine = float(tribucket.clip_grad_norm_(model, 1e9))
            out.append((abs(mine / exact - 1), abs(theirs / exact - 1)))
            model.zero_grad(set_to_none=True)
    return out


def test_clip_norm_of_large_buckets_is_as_accurate_as_torch(dist_run):
    for steps in dist_run(_clip_norm_of_large_buckets, world_size=2):
        for mine, theirs in steps:
            assert mine <= 2 * theirs + 1e-6, steps


# ---------------------------------------------------------------- untracked edits
def _edit_untracked(params, how):
    """Change gradients through ``.data`` (a view whose writes autograd's version counter
    does not see), as older training code does: scaled, clamped, one layer zeroed."""
    if how == "scale":
        for q in params:
            q.grad.data.mul_(0.5)
    elif how == "clamp":
        for q in params:
            q.grad.data.clamp_(-1e-3, 1e-3)
    elif how == "zero layer":
        params[0].grad.data.zero_()
    elif how == "inf":
        params[0].grad.data.view(-1)[0] = float("inf")


def _figures_after_untracked_edit(gbv):
    """For each (consumer asked first, edit through .data): the reducer's norm, its flag and
    tribucket's clip against torch's on the same gradients."""
    from models import batch, loss_of
    rank = dist.get_rank()
    ours, ref, ddp, reducer = _twins("mlp", bucket_cap_mb=0.001, gradient_as_bucket_view=gbv)
    out = []
    step = 0
    for first in ("grad_norm", "found_inf", "unscale_", "clip"):
        for how in ("scale", "clamp", "zero layer", "inf"):
            s_ours = tribucket.amp.GradScaler("cpu", init_scale=4.0)
            s_ref = torch.amp.GradScaler("cpu", init_scale=4.0)
            o_ours = torch.optim.SGD(ours.parameters(), lr=0.0)
            o_ref = torch.optim.SGD(ref.parameters(), lr=0.0)
            x = batch("mlp", rank, step)
            step += 1
            for m in (ours, ref):
                m.zero_grad()
            s_ours.scale(loss_of(ours(x))).backward()
            s_ref.scale(loss_of(ddp(x))).backward()
            mine, theirs = list(ours.parameters()), list(ref.parameters())
            if first == "grad_norm":
                reducer.grad_norm()
            elif first == "found_inf":
                reducer.found_inf
            elif first == "unscale_":
                s_ours.unscale_(o_ours)
                s_ref.unscale_(o_ref)
            elif first == "clip":
                tribucket.clip_grad_norm_(mine, max_norm=1e6)  # asks, does not clip
                torch.nn.utils.clip_grad_norm_(theirs, max_norm=1e6)
            _edit_untracked(mine, how)
            _edit_untracked(theirs, how)
            want_norm = torch.nn.utils.get_total_norm([q.grad for q in theirs])
            row = dict(first=first, how=how, norm=reducer.grad_norm().item(),
                       want_norm=want_norm.item(), flag=reducer.found_inf.item(),
                       want_flag=float(not torch.isfinite(want_norm)))
            if how != "inf":
                got = tribucket.clip_grad_norm_(mine, max_norm=want_norm.item() / 4)
                want = torch.nn.utils.clip_grad_norm_(theirs, max_norm=want_norm.item() / 4)
                row.update(clip=got.item(), want_clip=want.item(), grads_equal=all(
                    torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-8)
                    for a, b in zip(mine, theirs)))
            out.append(row)
    reducer.close()
    return out


@pytest.mark.parametrize("gbv", [False, True], ids=["copy", "bucket_view"])
def test_figures_see_gradients_edited_through_data(dist_run, gbv):
    """``p.grad.data`` writes bypass autograd's version counter: figures taken before such an
    edit (by grad_norm, found_inf, unscale_ or an earlier clip) must not be reused after it."""
    for rows in dist_run(_figures_after_untracked_edit, gbv, world_size=2):
        bad = [r for r in rows
               if r["norm"] != pytest.approx(r["want_norm"], rel=1e-5)
               or r["flag"] != r["want_flag"]
               or ("clip" in r and (r["clip"] != pytest.approx(r["want_clip"], rel=1e-5)
                                    or not r["grads_equal"]))]
        assert not bad, f"{len(bad)} of {len(rows)} cases stale: {bad}"


def _reads_of_a_second_call(reuse):
    from models import batch, loss_of
    ours, ref, ddp, reducer = _twins("mlp", bucket_cap_mb=0.001, reuse_grad_figures=reuse)
    loss_of(ours(batch("mlp", dist.get_rank(), 0))).backward()
    first = reducer.grad_norm().item()
    with _Counter(torch.linalg, "vector_norm") as vn, _Counter(torch, "_foreach_norm") as fn:
        second = reducer.grad_norm().item()
    reducer.close()
    return first, second, vn.calls + fn.calls - 1  # the total's own vector_norm


@pytest.mark.parametrize("reuse", [False, True])
def test_reuse_grad_figures_saves_the_second_read(dist_run, reuse):
    """Opted in, a second user of the figures in an iteration reads no gradient; by default
    every call reads them (and so sees edits autograd does not track)."""
    for first, second, reads in dist_run(_reads_of_a_second_call, reuse, world_size=2):
        assert first == second
        assert (reads == 0) == reuse, reads


def _clip_orders(norm_types):
    """tribucket.clip_grad_norm_ against DDP + torch's clip for the orders torch takes that
    do not sum across buckets (0, negative, -inf): ``[(order, norms same bits, gradients
    same bits)]``."""
    from models import batch, loss_of
    rank = dist.get_rank()
    out = []
    for norm_type in norm_types:
        ours, ref, ddp, reducer = _twins("mlp", bucket_cap_mb=0.001)
        x = batch("mlp", rank, 0)
        loss_of(ours(x)).backward()
        loss_of(ddp(x)).backward()
        got = tribucket.clip_grad_norm_(ours, 0.05, norm_type=norm_type)
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type=norm_type)
        out.append((norm_type, _same_bits(got, want), all(
            _same_bits(a.grad, b.grad) for a, b in zip(ours.parameters(), ref.parameters()))))
        reducer.close()
    return out


def test_clip_takes_every_order_torch_takes(dist_run):
    # before, norm_type 0 and negative orders were refused, where torch's clip takes them
    for results in dist_run(_clip_orders, (0.0, -1.0, -2.5, float("-inf")), world_size=2):
        assert [r for r in results if not (r[1] and r[2])] == [], results
