"""``tribucket.DistributedDataParallel`` against torch DDP on 2 gloo ranks: a nanoGPT-style
training loop (compiled and not), ``state_dict`` keys, DDP's methods, the refused keywords and
the reducer's release."""

from __future__ import annotations

import contextlib
import gc
import math
import warnings
import weakref
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import tribucket
from models import batch, build, loss_of
from test_reducer import assert_states_equal


# ---------------------------------------------------------------- a nanoGPT-style model
class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(D, dim=2)
        q, k, v = (t.view(B, T, self.heads, D // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(B, T, D))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's shape: token + position embeddings, blocks, final LayerNorm, a head tied to
    the token embedding; ``forward(idx, targets) -> (logits, loss)``."""

    def __init__(self, vocab=32, block=8, d=16, layers=2, heads=2):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _gpt(seed: int, compiled: bool) -> nn.Module:
    torch.manual_seed(seed)
    model = GPT()
    # aot_eager: dynamo and AOT autograd as inductor runs them, without compiling C++ kernels
    return torch.compile(model, backend="aot_eager") if compiled else model


def _train_nanogpt(model, iters: int = 3, grad_accum: int = 2) -> list[float]:
    """nanoGPT's train.py loop: accumulate by toggling require_backward_grad_sync, clip,
    AdamW over ``model.module``'s parameters."""
    rank = dist.get_rank()
    raw = model.module
    opt = torch.optim.AdamW(raw.parameters(), lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    norms = []
    for _ in range(iters):
        for micro_step in range(grad_accum):
            model.require_backward_grad_sync = micro_step == grad_accum - 1
            x = torch.randint(0, 32, (4, 8), generator=gen)
            y = torch.randint(0, 32, (4, 8), generator=gen)
            _, loss = model(x, y)
            (loss / grad_accum).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return norms


def _nanogpt_vs_ddp(compiled: bool):
    rank = dist.get_rank()
    theirs = DDP(_gpt(seed=rank, compiled=compiled))
    ours = tribucket.DistributedDataParallel(_gpt(seed=10 + rank, compiled=compiled))
    assert list(ours.state_dict()) == list(theirs.state_dict()), "state_dict keys differ"
    prefix = "module._orig_mod." if compiled else "module."
    assert all(k.startswith(prefix) for k in ours.state_dict())
    ours.load_state_dict(theirs.state_dict())  # strict: DDP's checkpoint loads as it is
    ddp_norms, our_norms = _train_nanogpt(theirs), _train_nanogpt(ours)
    for (name, a), b in zip(ours.module.named_parameters(), theirs.module.parameters()):
        torch.testing.assert_close(a, b, msg=lambda m: f"rank {rank}, {name}: {m}")
    torch.testing.assert_close(our_norms, ddp_norms)
    return [p.detach().clone() for p in ours.parameters()], our_norms


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_nanogpt_loop_ends_with_ddp_parameters(dist_run, compiled):
    # (compiled: its workers are not reused; see test_torch_compile_gpt2_like_eager_ddp)
    results = dist_run(_nanogpt_vs_ddp, compiled, timeout=300, teardown=compiled)
    for a, b in zip(results[0][0], results[1][0]):
        assert torch.equal(a, b), "the ranks' parameters differ"
    # accumulation held the micro-batches back: a different loop would give other norms
    assert all(math.isfinite(n) and n > 0 for n in results[0][1])


def _accumulation_is_local():
    """A backward whose forward ran with require_backward_grad_sync=False keeps each rank's
    own gradient (DDP's too), and the next synced one averages the sum."""
    rank = dist.get_rank()
    ours = tribucket.DistributedDataParallel(build("mlp"))
    theirs = DDP(build("mlp"))
    for model in (ours, theirs):
        model.require_backward_grad_sync = False
        loss_of(model(batch("mlp", rank, 0))).backward()
    local = [p.grad.clone() for p in ours.parameters()]
    for a, b in zip(local, theirs.parameters()):
        torch.testing.assert_close(a, b.grad)
    for model in (ours, theirs):
        model.require_backward_grad_sync = True
        loss_of(model(batch("mlp", rank, 1))).backward()
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    return local


def test_require_backward_grad_sync_false_accumulates_locally(dist_run):
    local = dist_run(_accumulation_is_local)
    assert any(not torch.equal(a, b) for a, b in zip(*local)), \
        "rank-local gradients should differ across ranks"


# ---------------------------------------------------------------- DDP's methods
def _methods_vs_ddp():
    rank = dist.get_rank()
    out = {}
    # no_sync, a torch comm hook, model.module, train()/eval() returning the wrapper
    ours = tribucket.DistributedDataParallel(build("mlp"), bucket_cap_mb=0.001)
    theirs = DDP(build("mlp"), bucket_cap_mb=0.001)
    for model in (ours, theirs):
        model.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
        assert model.train() is model
        with model.no_sync():
            loss_of(model(batch("mlp", rank, 0))).backward()
        loss_of(model(batch("mlp", rank, 1))).backward()
    assert isinstance(ours.module, type(theirs.module))
    assert_states_equal(ours, theirs, f"rank {rank}: ")
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    ddp_data, our_data = theirs._get_ddp_logging_data(), ours._get_ddp_logging_data()
    for key in ("world_size", "rank", "module_name", "num_parameter_tensors",
                "total_parameter_size_bytes", "bucket_cap_bytes", "comm_hook",
                "find_unused_parameters", "gradient_as_bucket_view", "broadcast_buffers"):
        assert our_data[key] == ddp_data[key], (key, our_data[key], ddp_data[key])
    for key in ("find_unused_parameters", "static_graph", "gradient_as_bucket_view",
                "bucket_bytes_cap", "broadcast_buffers"):
        assert getattr(ours, key) == getattr(theirs, key), key
    ours.close()

    # _set_static_graph() after construction, with a parameter never used
    ours = tribucket.DistributedDataParallel(build("branchy_static"))
    theirs = DDP(build("branchy_static"))
    for model in (ours, theirs):
        model._set_static_graph()
        for step in range(3):
            loss_of(model(batch("branchy_static", rank, step))).backward()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            model._set_static_graph()
        assert any("static_graph" in str(w.message) for w in seen)
    assert ours.static_graph and ours._get_ddp_logging_data()["static_graph"] == 1
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    ours.close()

    # join() on uneven inputs: rank 1 has one batch more
    ours = tribucket.DistributedDataParallel(build("bn"))
    theirs = DDP(build("bn"))
    for model in (ours, theirs):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with model.join():
            for step in range(2 + rank):
                loss_of(model(batch("bn", rank, step))).backward()
                opt.step()
                opt.zero_grad()
    assert_states_equal(ours, theirs, f"rank {rank}, after join: ")
    out["joined"] = [p.detach().clone() for p in ours.parameters()]
    return out


def test_methods_match_ddp(dist_run):
    results = dist_run(_methods_vs_ddp, timeout=180)
    for a, b in zip(results[0]["joined"], results[1]["joined"]):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- the reducer's release
def _release():
    rank = dist.get_rank()
    model = build("mlp")
    wrapped = tribucket.DistributedDataParallel(model)
    assert model._forward_pre_hooks, "the reducer attaches its forward hooks"
    ref = weakref.ref(wrapped)
    gc.disable()  # freed by reference counting alone, not by a later collection
    try:
        del wrapped
        assert ref() is None, "the dropped wrapper is still referenced (a reference cycle?)"
        assert not model._forward_pre_hooks and not model._forward_hooks, \
            "a dropped wrapper leaves its hooks on the module"
    finally:
        gc.enable()
    again = tribucket.DistributedDataParallel(model)  # the parameters are free again
    loss_of(again(batch("mlp", rank, 0))).backward()
    averaged = [p.grad.clone() for p in model.parameters()]
    again.close()
    assert not model._forward_pre_hooks and not model._forward_hooks
    with pytest.raises(RuntimeError, match="closed"):
        again(batch("mlp", rank, 1))
    model.zero_grad()
    loss_of(model(batch("mlp", rank, 1))).backward()   # a plain module: local gradients
    local = [p.grad.clone() for p in model.parameters()]

    # wrapping again while the first wrapper lives (a loop over options): the newer one
    # averages, the older one refuses to run; a wrapper of a wrapper is refused
    first = tribucket.DistributedDataParallel(model)
    second = tribucket.DistributedDataParallel(model, find_unused_parameters=True)
    theirs = DDP(build("mlp"), find_unused_parameters=True)
    model.zero_grad()
    for m in (second, theirs):
        loss_of(m(batch("mlp", rank, 2))).backward()
    for a, b in zip(model.parameters(), theirs.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    with pytest.raises(RuntimeError, match="wrapped again"):
        first(batch("mlp", rank, 3))
    with pytest.raises(ValueError, match="already averaged by another reducer"):
        tribucket.DistributedDataParallel(second)
    second.close()
    return averaged, local


def test_close_and_garbage_collection_release_the_module(dist_run):
    (avg0, local0), (avg1, local1) = dist_run(_release)
    assert all(torch.equal(a, b) for a, b in zip(avg0, avg1)), "averaged while wrapped"
    assert any(not torch.equal(a, b) for a, b in zip(local0, local1)), "local once closed"


# ---------------------------------------------------------------- DDP's keywords
def _constructor_errors():
    model = build("mlp")
    cases = {
        "mixed_precision": dict(mixed_precision=object()),
        "delay_all_reduce_named_params": dict(delay_all_reduce_named_params=[],
                                              param_to_hook_all_reduce=model.head.weight),
        "device_ids": dict(device_ids=[0]),
        "no_such_option": dict(no_such_option=1),
        "process_group": dict(process_group=5),
    }
    out = {}
    for name, kwargs in cases.items():
        try:
            tribucket.DistributedDataParallel(model, **kwargs)
        except (ValueError, TypeError) as e:
            out[name] = (type(e).__name__, str(e))
    frozen = build("mlp").requires_grad_(False)
    for module in (frozen, nn.ReLU()):
        try:
            tribucket.DistributedDataParallel(module)
        except RuntimeError as e:
            out.setdefault("frozen", []).append(str(e))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tribucket.DistributedDataParallel(model, None, None, 0, True, True, None, 25, False,
                                          True).close()  # DDP's positions; check_reduction
    out["check_reduction"] = [str(w.message) for w in seen if w.category is FutureWarning]
    assert not model._forward_pre_hooks
    return out


def test_ddp_keywords_are_accepted_or_refused_by_name(dist_run):
    out = dist_run(_constructor_errors)[0]
    for name in ("mixed_precision", "delay_all_reduce_named_params",
                 "device_ids"):
        kind, msg = out[name]
        assert kind == "ValueError" and name in msg, (name, msg)
    kind, msg = out["process_group"]  # before, an AttributeError from deep inside
    assert kind == "TypeError" and "process_group must be a torch.distributed.ProcessGroup" in msg \
        and "got int" in msg, msg
    kind, msg = out["no_such_option"]
    assert kind == "TypeError" and "no_such_option" in msg and "timeout" in msg
    assert len(out["frozen"]) == 2
    assert all("doesn't have any parameter that requires a gradient" in m for m in out["frozen"])
    assert any("check_reduction" in m for m in out["check_reduction"])


def _cap_list_vs_ddp():
    """``bucket_cap_mb_list`` as DDP's: one cap per bucket (the last repeating) for the
    initial buckets and the rebuild, ``bucket_cap_mb`` ignored beside it, the caps in bytes
    as ``bucket_bytes_cap_list`` and their largest as ``bucket_bytes_cap``; gradients equal
    DDP's; torch.save keeps the list."""
    import io

    rank = dist.get_rank()
    caps = [0.001, 0.003]
    ours = tribucket.DistributedDataParallel(build("mlp"), bucket_cap_mb=7,
                                             bucket_cap_mb_list=caps)
    theirs = DDP(build("mlp"), bucket_cap_mb=7, bucket_cap_mb_list=caps)
    plain = tribucket.DistributedDataParallel(build("bn"))
    out = dict(attrs=[(m.bucket_bytes_cap_list, m.bucket_bytes_cap) for m in (ours, theirs)],
               plain=(plain.bucket_bytes_cap_list, DDP(build("bn")).bucket_bytes_cap_list))
    plain.close()
    for step in range(3):
        for m in (ours, theirs):
            m.zero_grad()
            loss_of(m(batch("mlp", rank, step))).backward()
        for a, b in zip(ours.parameters(), theirs.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    data = [m._get_ddp_logging_data() for m in (ours, theirs)]
    out["layouts"] = [[d.get(k) for k in ("bucket_sizes", "rebuilt_bucket_sizes",
                                           "rebuilt_per_bucket_param_indices")] for d in data]
    buf = io.BytesIO()
    torch.save(ours, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    out["loaded"] = loaded.bucket_bytes_cap_list
    ours.close()
    loaded.close()
    return out


def test_bucket_cap_mb_list_as_ddp(dist_run):
    for out in dist_run(_cap_list_vs_ddp):
        want = [int(0.001 * 2**20), int(0.003 * 2**20)]
        assert out["attrs"][0] == out["attrs"][1] == (want, max(want))
        assert out["plain"] == ([], [])
        ours, theirs = out["layouts"]
        assert ours == theirs and ours[1] is not None, (ours, theirs)  # rebuilt, as DDP's
        assert len(ours[1].split(",")) > 2, "the small caps give several buckets"
        assert out["loaded"] == want


class _Switch(nn.Module):
    """``a`` always used, ``b`` only when asked (the same on every rank), ``c`` never; with
    4 KiB caps each Linear fills a bucket of its own."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(32, 32, bias=False) for _ in range(3))

    def forward(self, x, use_b=False):
        y = self.a(x)
        return y + self.b(x) if use_b else y


def _switch_steps(ours, theirs, plan) -> list:
    """Train both wrappers of :class:`_Switch` through ``plan`` (``(use_b, sync)`` per step,
    each rank its own batch; ``use_b`` the same on every rank, or a tuple of one per rank);
    after every step their ``.grad`` must be equal to the bit (``None`` alike). Returns
    ``(num_buckets_reduced, bytes sent)`` of each synchronised step."""
    rank, reduced = dist.get_rank(), []
    for step, (use_b, sync) in enumerate(plan):
        use_b = use_b[rank] if isinstance(use_b, tuple) else use_b
        g = torch.Generator().manual_seed(100 * rank + step)
        x = torch.randn(8, 32, generator=g)
        for m in (ours, theirs):
            with contextlib.nullcontext() if sync else m.no_sync():
                m(x, use_b=use_b).square().mean().backward()
        for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
            assert (a.grad is None) == (b.grad is None), (step, name)
            if a.grad is not None:
                torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0,
                                           msg=lambda m: f"step {step} {name}: {m}")
        if sync:
            reduced.append((ours.reducer.logging_data()["num_buckets_reduced"],
                            ours.reducer.stats.bytes_communicated))
    return reduced


def _skip_unused_vs_ddp(**extra):
    """``skip_all_reduce_unused_params=True`` as DDP's: a bucket whose parameters this
    forward left unused (the same on every rank) is not all-reduced and its ``.grad`` stays
    as it was; the others are averaged as usual, equal to DDP's to the bit. ``extra``: more
    options for tribucket only (``gradient_as_bucket_view``, ``pack_on_ready``): they must
    not change a value. (DDP itself, with ``gradient_as_bucket_view=True``, divides a
    skipped bucket's gradients by the world size at every step it skips it; the reference
    here is DDP without it.)"""
    kw = dict(find_unused_parameters=True, bucket_cap_mb=4096 / 2**20,
              skip_all_reduce_unused_params=True)
    torch.manual_seed(0)
    ours = tribucket.DistributedDataParallel(_Switch(), **kw, **extra)
    torch.manual_seed(0)
    theirs = DDP(_Switch(), **kw)
    reduced = _switch_steps(ours, theirs, [(False, True), (True, True), (False, True),
                                           (False, True)])
    nodes = [m._get_ddp_logging_data()["num_buckets_reduced"] for m in (ours, theirs)]
    ours.close()
    return reduced, nodes


@pytest.mark.parametrize("extra", [{}, dict(gradient_as_bucket_view=True, pack_on_ready=True),
                                   dict(pack_on_ready=True), dict(comm_chunk_mb=0.001)],
                         ids=["default", "view", "eager", "chunks"])
def test_skip_all_reduce_unused_params_as_ddp(dist_run, extra):
    for reduced, (ours, theirs) in dist_run(_skip_unused_vs_ddp, **extra):
        counts = [n for n, _ in reduced]
        assert counts == [1, 2, 1, 1], counts  # c never; b in step 1 only
        nbytes = [b for _, b in reduced]
        assert nbytes[1] == 2 * nbytes[0], nbytes  # one bucket's bytes, then two
        assert theirs == 1 and ours == 1  # (DDP reports the step before: also 1)


def _skip_after_no_sync():
    """A parameter the sync forward left unused but that got a gradient in a ``no_sync``
    pass before it is averaged, not skipped: against DDP without the option (DDP with it
    skips the bucket, and each rank keeps its own gradient: the ranks' parameters part)."""
    kw = dict(find_unused_parameters=True, bucket_cap_mb=4096 / 2**20)
    torch.manual_seed(0)
    ours = tribucket.DistributedDataParallel(_Switch(), skip_all_reduce_unused_params=True,
                                             **kw)
    torch.manual_seed(0)
    theirs = DDP(_Switch(), **kw)
    reduced = _switch_steps(ours, theirs, [(False, True), (True, False), (False, True),
                                           (False, True)])
    ours.close()
    return [n for n, _ in reduced]


def test_skip_all_reduce_unused_params_averages_no_sync_gradients(dist_run):
    for reduced in dist_run(_skip_after_no_sync):
        assert reduced == [1, 2, 1], reduced  # b's no_sync gradient is averaged, then skipped


def _averaging_hook(state, bucket):
    """A user's comm hook (tribucket runs such hooks one bucket after another)."""
    t = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])


def _skip_with_a_hook():
    """``skip_all_reduce_unused_params=True`` with a user's comm hook: a skipped bucket
    before a hooked one. Against DDP without the option and with the same hook (DDP with
    it aborts on such tiny buckets)."""
    kw = dict(find_unused_parameters=True, bucket_cap_mb=4096 / 2**20)
    torch.manual_seed(0)
    ours = tribucket.DistributedDataParallel(_Switch(), skip_all_reduce_unused_params=True,
                                             **kw)
    torch.manual_seed(0)
    theirs = DDP(_Switch(), **kw)
    for m in (ours, theirs):
        m.register_comm_hook(None, _averaging_hook)
    reduced = _switch_steps(ours, theirs, [(False, True), (True, True), (False, True)])
    ours.close()
    return [n for n, _ in reduced]


def test_skip_all_reduce_unused_params_with_a_comm_hook(dist_run):
    for reduced in dist_run(_skip_with_a_hook, timeout=60):
        assert reduced == [1, 2, 1], reduced


def _skip_unused_differs_across_ranks(**extra):
    """``skip_all_reduce_unused_params=True`` where the forward leaves a bucket unused on one
    rank and not on the other: the ranks agree before the first bucket, so that bucket is
    averaged (the unused rank contributing zeros), as by DDP without the option; a bucket
    unused on every rank is still skipped. (DDP with the option pairs the used rank's
    allreduce of it with the other rank's next collective.)"""
    kw = dict(find_unused_parameters=True, bucket_cap_mb=4096 / 2**20)
    torch.manual_seed(0)
    ours = tribucket.DistributedDataParallel(_Switch(), skip_all_reduce_unused_params=True,
                                             timeout=timedelta(seconds=30), **kw, **extra)
    torch.manual_seed(0)
    theirs = DDP(_Switch(), **kw)
    reduced = _switch_steps(ours, theirs, [(False, True), ((True, False), True), (False, True),
                                           ((False, True), True), (True, True)])
    ours.close()
    return [n for n, _ in reduced]


@pytest.mark.parametrize("extra", [{}, dict(comm_chunk_mb=0.001)], ids=["default", "chunks"])
def test_skip_all_reduce_unused_params_unused_set_differs_across_ranks(dist_run, extra):
    for reduced in dist_run(_skip_unused_differs_across_ranks, **extra):
        assert reduced == [1, 2, 1, 2, 2], reduced  # b unless no rank used it; c never


def _skip_refusals():
    out = []
    for kwargs in (dict(skip_all_reduce_unused_params=True),
                   dict(skip_all_reduce_unused_params=True, find_unused_parameters=True,
                        static_graph=True),
                   dict(skip_all_reduce_unused_params=True, find_unused_parameters=True,
                        shard_optimizer=True)):
        try:
            tribucket.ReducerConfig(**kwargs)
            out.append(None)
        except ValueError as e:
            out.append(str(e))
    with tribucket.fused_bucketing(build("mlp"), find_unused_parameters=True,
                                   skip_all_reduce_unused_params=True) as reducer:
        try:
            with reducer.join():
                pass
            out.append(None)
        except ValueError as e:
            out.append(str(e))
    return out


def test_skip_all_reduce_unused_params_refusals(dist_run):
    msgs = dist_run(_skip_refusals)[0]
    assert all(m is not None and "skip_all_reduce_unused_params" in m for m in msgs), msgs
    for m, word in zip(msgs, ("find_unused_parameters=True", "static_graph", "shard_optimizer",
                              "Join")):
        assert word in m, (word, m)


# ---------------------------------------------------------------- torch.save of the wrapper
def _pickle_roundtrip():
    """torch.save / torch.load of the wrapper on every rank, as DDP's: the loaded one has
    the same options and parameters and averages gradients as DDP does. (Loading attaches a
    reducer, which broadcasts rank 0's buffers at once; DDP's loaded copy does at its next
    training forward.)"""
    import io

    rank = dist.get_rank()
    ours = tribucket.DistributedDataParallel(build("bn"), find_unused_parameters=True)
    theirs = DDP(build("bn"), find_unused_parameters=True)
    for model in (ours, theirs):
        loss_of(model(batch("bn", rank, 0))).backward()
    buf = io.BytesIO()
    torch.save(ours, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert loaded.find_unused_parameters and loaded.module is not ours.module
    assert list(loaded.state_dict()) == list(theirs.state_dict())
    for a, b in zip(loaded.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b)  # (buffers: loading broadcasts rank 0's, see below)
    ours.close()
    loaded.module.zero_grad()
    theirs.module.zero_grad()
    for model in (loaded, theirs):
        loss_of(model(batch("bn", rank, 1))).backward()
    for a, b in zip(loaded.parameters(), theirs.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    assert_states_equal(loaded, theirs, f"rank {rank}, loaded, after a step: ")
    return [p.grad.clone() for p in loaded.parameters()]


def test_pickled_wrapper_trains_as_ddp(dist_run):
    g0, g1 = dist_run(_pickle_roundtrip)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))


# ------------------------------------------- static_graph with no_sync in the first step
def _static_graph_no_sync_first():
    """``static_graph=True`` whose first iterations accumulate under ``no_sync``: the
    gradients equal DDP's without ``static_graph`` (DDP with it fails an internal assert,
    ``expect_autograd_hooks_``, when its first backward runs under ``no_sync``), and the
    static graph's hook counts are learned at the first synchronised backward."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    ours = tribucket.DistributedDataParallel(build("mlp"), static_graph=True,
                                             bucket_cap_mb=0.05)
    torch.manual_seed(0)
    theirs = DDP(build("mlp"), bucket_cap_mb=0.05)
    for step in range(4):
        for micro in range(3):
            x = batch("mlp", rank, 10 * step + micro)
            for m in (ours, theirs):
                with contextlib.nullcontext() if micro == 2 else m.no_sync():
                    loss_of(m(x)).backward()
        for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0,
                                       msg=lambda m: f"step {step} {name}: {m}")
        for m in (ours, theirs):
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
    out = ours.reducer.logging_data()["rebuilt_bucket_sizes"] is not None
    ours.close()
    return out


def test_static_graph_with_no_sync_from_the_first_step(dist_run):
    assert dist_run(_static_graph_no_sync_first) == [True, True]


def _evaluate_module_on_rank_0(wrapper: str):
    """torch DDP's habit: train through the wrapper, then ``if rank == 0:`` evaluate through
    ``ddp.module``, a plain module with no collective. A BatchNorm model (buffers), under the
    layer's timeout so a collective rank 1 never joins fails fast instead of hanging.
    Returns rank 0's evaluation output (or the error), and the parameters after a second
    training step, which both ranks then take together."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    if wrapper == "torch":
        ddp = DDP(model)
    else:
        ddp = tribucket.DistributedDataParallel(model, timeout=timedelta(seconds=3))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    out = None
    for step in range(2):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        ddp(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if step == 0 and rank == 0:
            ddp.module.eval()
            try:
                with torch.no_grad():
                    out = ddp.module(torch.ones(3, 4))
            except RuntimeError as e:
                return str(e)
            ddp.module.train()
        if step == 0:  # (a collective of the script's own: rank 1 waits there)
            dist.monitored_barrier(timeout=timedelta(seconds=10))
    return out, [p.detach().clone() for p in model.parameters()], \
        [b.clone() for b in model.buffers()]


def test_evaluating_ddp_module_on_one_rank_as_with_torch_ddp(dist_run):
    # before: tribucket's wrapper broadcast rank 0's buffers before that forward (DDP's rule
    # for forwards through the wrapper), which rank 1 never joined: a hang
    theirs = dist_run(_evaluate_module_on_rank_0, "torch", world_size=2, timeout=60)
    mine = dist_run(_evaluate_module_on_rank_0, "tribucket", world_size=2, timeout=60,
                    teardown=True)
    assert not isinstance(mine[0], str), mine[0]
    torch.testing.assert_close(mine[0][0], theirs[0][0], rtol=0, atol=0)
    for (_, p_mine, b_mine), (_, p_theirs, b_theirs) in zip(mine, theirs):
        for a, b in zip(p_mine + b_mine, p_theirs + b_theirs):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def _dcp_across_wrappers(path: str):
    """A torch.distributed.checkpoint of torch DDP + AdamW loaded into the wrapper through
    its ``.module`` (and the way back): the keys, then whether the loaded weights and the
    optimizer's state equal the saved ones."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    rank = dist.get_rank()
    theirs = DDP(build("mlp", seed=0))
    opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    loss_of(theirs(batch("mlp", rank, 0))).backward()
    opt.step()
    saved_model, saved_opt = get_state_dict(theirs, opt)
    dcp.save({"model": saved_model, "opt": saved_opt}, checkpoint_id=path)
    ours = tribucket.DistributedDataParallel(build("mlp", seed=1))
    opt2 = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    loss_of(ours(batch("mlp", rank, 0))).backward()
    opt2.step()  # (a state to load into)
    model_sd, opt_sd = get_state_dict(ours.module, opt2)
    keys_equal = sorted(model_sd) == sorted(saved_model)
    state = {"model": model_sd, "opt": opt_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(ours.module, opt2, model_state_dict=state["model"],
                   optim_state_dict=state["opt"])
    weights = all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters()))
    moments = all(torch.equal(opt2.state[a]["exp_avg"], opt.state[b]["exp_avg"])
                  for a, b in zip(ours.parameters(), theirs.parameters()))
    ours.close()
    return keys_equal, weights, moments


def test_dcp_checkpoints_cross_with_ddp_through_module(dist_run, tmp_path):
    # torch's get_state_dict drops DDP's "module." by DDP's class; the wrapper's .module
    # gives the same keys
    for result in dist_run(_dcp_across_wrappers, str(tmp_path / "ckpt"), world_size=2,
                           timeout=60):
        assert result == (True, True, True), result


def _buffer_members_vs_ddp():
    """DDP's buffer members through a sequence of forwards (a training one, one under
    no_sync, one under no_grad, one after setting the flag by hand, as Lightning's manual
    optimisation does): per step ``(ours, DDP's)`` of ``require_forward_param_sync``,
    ``will_sync_module_buffers()``; then the buffer lists and ``is_multi_device_module``."""
    rank = dist.get_rank()
    ours = tribucket.DistributedDataParallel(build("bn"))
    theirs = DDP(build("bn"))
    seen = []
    for step, how in enumerate(("train", "no_sync", "train", "no_grad", "set", "train")):
        for model in (ours, theirs):
            if how == "set":
                model.require_forward_param_sync = True
                continue
            ctx = (model.no_sync() if how == "no_sync" else
                   torch.no_grad() if how == "no_grad" else contextlib.nullcontext())
            with ctx:
                out = model(batch("bn", rank, step))
            if how != "no_grad":
                loss_of(out).backward()
        seen.append((how, [(m.require_forward_param_sync, m.will_sync_module_buffers())
                           for m in (ours, theirs)]))
    members = [([tuple(b.shape) for b in m.modules_buffers], sorted(m.named_module_buffers),
                m.is_multi_device_module) for m in (ours, theirs)]
    ours.close()
    return seen, members


def test_buffer_members_match_ddp(dist_run):
    # before, the wrapper had no require_forward_param_sync, will_sync_module_buffers(),
    # modules_buffers, named_module_buffers or is_multi_device_module
    for seen, members in dist_run(_buffer_members_vs_ddp):
        for how, (ours, theirs) in seen:
            assert ours == theirs, (how, ours, theirs)
        assert members[0] == members[1], members


class _Adapted(nn.Module):
    """A model whose forward hook (added after wrapping) adds ``adapter(out)`` to the output;
    ``skip`` is never used."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 4)
        self.adapter, self.skip = nn.Linear(4, 4), nn.Linear(8, 4)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))


def _adapter_hook(module, args, out):
    return out + module.adapter(out)


def _hook_added_after_wrapping(how: str):
    """``find_unused_parameters``: a forward hook that uses another parameter, registered on
    the model after entering fused_bucketing (or wrapping it), against torch DDP with the
    same hook: the largest gradient difference over 3 steps (inf: a gradient missing)."""
    rank = dist.get_rank()
    ours, theirs = _Adapted(), _Adapted()
    ddp = DDP(theirs, find_unused_parameters=True)
    theirs.register_forward_hook(_adapter_hook)
    with contextlib.ExitStack() as stack:
        if how == "fused_bucketing":
            stack.enter_context(tribucket.fused_bucketing(ours, find_unused_parameters=True))
            net = ours
        else:
            net = tribucket.DistributedDataParallel(ours, find_unused_parameters=True)
            stack.callback(net.close)
        ours.register_forward_hook(_adapter_hook)
        worst = 0.0
        for step in range(3):
            x = torch.randn(5, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            for model, fwd in ((ours, net), (theirs, ddp)):
                model.zero_grad()
                fwd(x).square().mean().backward()
            for a, b in zip(ours.parameters(), theirs.parameters()):
                if (a.grad is None) != (b.grad is None):
                    return float("inf")
                if a.grad is not None:
                    worst = max(worst, (a.grad - b.grad).abs().max().item())
    return worst


@pytest.mark.parametrize("how", ["fused_bucketing", "wrapper"])
def test_a_forward_hook_added_after_wrapping_is_seen_by_the_unused_search(dist_run, how):
    # before, the reducer's own forward hook ran before the user's and searched the graph
    # from the output the user's hook then replaced: 'adapter.bias' was found unused and
    # then received a gradient, and every rank raised
    for worst in dist_run(_hook_added_after_wrapping, how):
        assert worst == 0.0, worst


def _compiled_after_entering(how: str):
    """A BatchNorm model compiled (dynamo, eager backend) after entering fused_bucketing, or
    the wrapper compiled, 3 steps: the unique graphs dynamo made, and the largest gradient
    difference from torch DDP's (uncompiled)."""
    import torch._dynamo
    rank = dist.get_rank()
    ours, theirs = build("bn"), build("bn")
    ddp = DDP(theirs)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with contextlib.ExitStack() as stack:
        if how == "fused_bucketing":
            stack.enter_context(tribucket.fused_bucketing(ours))
            net = torch.compile(ours, backend="eager")
        else:
            wrapper = tribucket.DistributedDataParallel(ours)
            stack.callback(wrapper.close)
            net = torch.compile(wrapper, backend="eager")
        worst = 0.0
        for step in range(3):
            x = batch("bn", rank, step)
            for model, fwd in ((ours, net), (theirs, ddp)):
                model.zero_grad()
                loss_of(fwd(x)).backward()
            worst = max(worst, max((a.grad - b.grad).abs().max().item()
                                   for a, b in zip(ours.parameters(), theirs.parameters())))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    return graphs, worst


@pytest.mark.parametrize("how", ["fused_bucketing", "wrapper"])
def test_compiling_after_entering_makes_one_graph(dist_run, how):
    # before, dynamo traced the reducer's forward hooks (the buffer broadcast, its waits)
    # into the compiled region and split the forward: 10 graphs on this model, DDP's 1
    for graphs, worst in dist_run(_compiled_after_entering, how, timeout=120):
        assert graphs == 1 and worst < 1e-6, (graphs, worst)
