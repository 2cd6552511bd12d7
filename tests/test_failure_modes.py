"""Failure modes of the reducer: each test reproduces a way a run went silently wrong or hung
(a backward that raised, two reducers on one model, ranks whose steps diverged, a partial
resume, a hook that never completes, a model on another device, mismatched options) and
checks that every rank now either gets the dense reference's gradients or raises a clear
error. Every call runs under the pool's timeout, so a hang fails the test."""

from __future__ import annotations

import copy
import datetime
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import tribucket
from tribucket import hooks
from tribucket.ddp.native import NO_NATIVE
from _dist import stall_until_the_others_return, tribucket_log
from models import batch, build, loss_of

TIMEOUT = datetime.timedelta(seconds=4)


def _reference_grads(model_name, step, seed=0):
    """The dense reference: every rank's gradient of its batch on a plain copy, averaged."""
    ref = build(model_name, seed)
    loss_of(ref(batch(model_name, dist.get_rank(), step))).backward()
    grads = [p.grad.detach().clone() for p in ref.parameters()]
    for g in grads:
        dist.all_reduce(g)
        g.div_(dist.get_world_size())
    return grads


def _max_error(model, grads):
    return max((p.grad - g).abs().max().item() if p.grad is not None else float("inf")
               for p, g in zip(model.parameters(), grads))


def _outcome(fn):
    """('ok', value) or ('error', message) of one call."""
    try:
        return "ok", fn()
    except RuntimeError as e:
        return "error", str(e)


def _assert_never_mixed(results, steps):
    """Each step either matched the reference on every rank or raised on every rank."""
    for s in range(steps):
        kinds = {r[s][0] for r in results}
        assert len(kinds) == 1, f"step {s}: ranks disagree: {[r[s] for r in results]}"
        if kinds == {"ok"}:
            errs = [r[s][1] for r in results]
            assert max(errs) < 1e-6, f"step {s}: gradients differ from the reference: {errs}"


# ------------------------------------------------------------ 1. a backward that raised
class _FailInLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        raise ValueError("the loss's backward failed")


def _backward_raises(raising, where="middle"):
    rank = dist.get_rank()
    model = build("mlp")
    out = []
    with tribucket.fused_bucketing(model, bucket_cap_mb=0.001, timeout=TIMEOUT) as reducer:
        # step 0: a user hook raises on the ranks in `raising`: in the middle of the model,
        # or on the model's output (it runs before anything of the reducer's in backward)
        def boom(g):
            raise ValueError("user hook failed")
        handle = model.layers[3].weight.register_hook(boom) if (
            rank in raising and where == "middle") else None
        try:
            output = model(batch("mlp", rank, 0))
            if rank in raising and where == "output":
                output.register_hook(boom)
            loss = loss_of(output)
            if rank in raising and where == "loss":
                loss = _FailInLoss.apply(loss)
            loss.backward()
            out.append(("ok", None))
        except (ValueError, RuntimeError) as e:  # the user catches it and goes on
            out.append(("error", f"{type(e).__name__}: {e}"))
            if where == "loss":
                reducer.backward_failed()  # (the backward never reached the model)
        if handle is not None:
            handle.remove()
        for step in (1, 2, 3):
            model.zero_grad()

            def one():
                loss_of(model(batch("mlp", rank, step))).backward()
                return _max_error(model, _reference_grads("mlp", step))
            out.append(_outcome(one))
    return out


@pytest.mark.parametrize("raising,where", [((0, 1), "middle"), ((1,), "middle"),
                                           ((1,), "output"), ((0, 1), "output"),
                                           ((1,), "loss"), ((0, 1), "loss")])
def test_backward_that_raised_never_mixes(dist_run, raising, where):
    results = dist_run(_backward_raises, raising, where, world_size=2, timeout=60)
    for rank, steps in enumerate(results):
        # the failed step raised on every rank: where the hook raised, the user's error;
        # elsewhere the reducer's, naming the rank that failed
        kind, msg = steps[0]
        assert kind == "error", (rank, steps[0])
        if rank not in raising:
            assert "RuntimeError" in msg and "rank 1: " in msg, msg
    _assert_never_mixed([r[1:] for r in results], 3)
    # and the next steps are clean passes on every rank: the reducer recovered
    assert all(kind == "ok" for r in results for kind, _ in r[1:]), results


# ------------------------------------------------------------ 2. two reducers, one model
def _two_reducers(kind):
    model = build("mlp")
    first = tribucket.Reducer(model)
    try:
        if kind == "twice":
            tribucket.Reducer(model)
        elif kind == "nested":
            with tribucket.fused_bucketing(model.layers[2]):
                pass
        elif kind == "disjoint":  # the expert-parallel pattern: another reducer, other params
            first.close()
            head = ["head.weight", "head.bias"]
            with tribucket.fused_bucketing(model, ignore_parameters=head), \
                    tribucket.fused_bucketing(model.head):
                loss_of(model(batch("mlp", dist.get_rank(), 0))).backward()
                return _max_error(model, _reference_grads("mlp", 0))
        elif kind == "closed":  # closing releases the claim
            first.close()
            with tribucket.fused_bucketing(model):
                loss_of(model(batch("mlp", dist.get_rank(), 0))).backward()
                return _max_error(model, _reference_grads("mlp", 0))
    except ValueError as e:
        return str(e)
    finally:
        first.close()
    return None


@pytest.mark.parametrize("kind", ["twice", "nested"])
def test_second_reducer_on_the_same_parameters_raises(dist_run, kind):
    for msg in dist_run(_two_reducers, kind, world_size=2):
        assert msg is not None and "already averaged by another reducer" in msg, msg
        # names the first shared parameter (by its name in the second reducer's module)
        assert ("'layers.0.weight'" if kind == "twice" else "'weight'") in msg, msg


@pytest.mark.parametrize("kind", ["disjoint", "closed"])
def test_reducers_on_disjoint_parameters_average_once(dist_run, kind):
    for err in dist_run(_two_reducers, kind, world_size=2):
        assert err < 1e-6, err


# ------------------------------------------------------------ 10, 12: the entry check
def _entry_mismatch(what):
    rank = dist.get_rank()
    model = build("mlp")
    options = dict(bucket_cap_mb=0.001)
    if what == "device" and rank == 1:
        model = model.to("meta")
    elif what == "find_unused_parameters" and rank == 1:
        options["find_unused_parameters"] = True
    elif what == "static_graph" and rank == 1:
        options["static_graph"] = True
    elif what == "bucket_cap_mb" and rank == 1:
        options["bucket_cap_mb"] = 0.002
    elif what == "timeout" and rank == 1:
        options["timeout"] = TIMEOUT
    try:
        with tribucket.fused_bucketing(model, **options) as reducer:
            if what == "hook" and rank == 1:
                reducer.register_comm_hook(None, hooks.fp16_compress_hook)
            loss_of(model(batch("mlp", rank, 0))).backward()
    except (RuntimeError, ValueError) as e:
        return str(e)
    return None


@pytest.mark.parametrize("what", ["device", "find_unused_parameters", "static_graph",
                                  "bucket_cap_mb", "timeout", "hook"])
def test_mismatch_across_ranks_is_named_on_every_rank(dist_run, what):
    messages = dist_run(_entry_mismatch, what, world_size=2, timeout=45)
    name = {"device": "meta", "hook": "fp16_compress_hook"}.get(what, what)
    for rank, msg in enumerate(messages):
        if what == "device" and rank == 1:  # its own parameters, refused (no data)
            assert msg is not None and "'layers.0.weight' is on the meta device" in msg, msg
            continue
        assert msg is not None and name in msg and "rank 1" in msg, msg


# ------------------------------------------------------------ 3. ranks at different steps
def _steps_diverge(kind, debug, model_name="mlp"):
    rank = dist.get_rank()
    model = build(model_name)
    done = []
    try:
        with tribucket.fused_bucketing(model, bucket_cap_mb=0.001, timeout=TIMEOUT,
                                       debug=debug):
            for step in range(4):
                model.zero_grad()
                if kind == "none" and rank == 0:  # evaluation on rank 0 only: not a step
                    model.eval()
                    model(batch(model_name, rank, step))
                    model.train()
                    with torch.no_grad():
                        model(batch(model_name, rank, step))
                loss = loss_of(model(batch(model_name, rank, step)))
                if kind == "skip" and rank == 1 and step == 1:
                    continue  # a forward without backward on rank 1
                loss.backward(retain_graph=True)
                if kind == "extra" and rank == 1 and step == 0:
                    loss.backward()  # one more backward on rank 1
                done.append(_max_error(model, _reference_grads(model_name, step))
                            if kind == "none" else step)
    except RuntimeError as e:
        return done, str(e)
    return done, None


@pytest.mark.parametrize("debug", [False, True])
@pytest.mark.parametrize("kind", ["skip", "extra"])
def test_ranks_at_different_steps_raise_on_every_rank(dist_run, kind, debug):
    results = dist_run(_steps_diverge, kind, debug, world_size=2, timeout=60)
    for rank, (done, msg) in enumerate(results):
        assert msg is not None, f"rank {rank} finished without an error: {done}"
        # named before the mixed gradients reach .grad: the diverged backward did not count
        assert "forward" in msg and "rank 0" in msg and "rank 1" in msg, msg
        if debug:
            assert "diverged" in msg, msg
    assert results[0][0] == [0], results  # rank 0 completed step 0, then learnt of it


def test_same_steps_everywhere_train_normally(dist_run):
    # eval-mode and no_grad forwards on one rank only are not steps
    for done, msg in dist_run(_steps_diverge, "none", False, world_size=2):
        assert msg is None and len(done) == 4 and max(done) < 1e-6, (done, msg)


# ------------------------------------------------------------ 6. timeout= covers every hook
def _never_completes(state, bucket):
    return torch.futures.Future()  # a hook whose future nobody completes


def _hook_with_stalled_peer(kind, timeout_s=2.0):
    import time
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    rank = dist.get_rank()
    model = build("mlp")
    try:
        with tribucket.fused_bucketing(model, bucket_cap_mb=0.001,
                                       timeout=datetime.timedelta(seconds=timeout_s)) as red:
            if kind == "allreduce":
                red.register_comm_hook(None, default_hooks.allreduce_hook)
            elif kind == "gossip":
                red.register_comm_hook(hooks.GossipState(), hooks.gossip_hook)
            elif kind == "powersgd":
                red.register_comm_hook(psgd.PowerSGDState(process_group=None,
                                                          start_powerSGD_iter=2),
                                       psgd.powerSGD_hook)
            else:
                red.register_comm_hook(None, _never_completes)
            for step in range(5):
                if step == 3 and rank == 1 and kind != "never":
                    stall_until_the_others_return(timeout_s * 3)  # past their timeout
                    return "slept", time.monotonic()
                loss_of(model(batch("mlp", rank, step))).backward()
    except RuntimeError as e:
        return str(e), time.monotonic()
    return "no error", time.monotonic()


@pytest.mark.parametrize("kind", ["allreduce", "powersgd", "never", "gossip"])
def test_timeout_bounds_every_hook(dist_run, kind):
    # without the bound, the hooks' collectives wait for the default group's 300 s
    # (what the stall breaks is the reducer's timed groups; the pool's own group is intact)
    results = dist_run(_hook_with_stalled_peer, kind, world_size=2, timeout=60)
    waiting = results if kind == "never" else results[:1]
    for message, raised_at in waiting:
        assert "tribucket" in message and "did not complete" in message, message
        assert "bucket" in message, message
        if kind != "never":
            assert "rank 1" in message, message  # names the rank that fell behind
            assert raised_at < results[1][1], (message, results[1])  # while it still slept


# ------------------------------------------------------------ 13. failure reports
def _stall_mid_backward(debug=False, timeout_s=2.0):
    import time

    rank = dist.get_rank()
    model = build("mlp")
    woke = []

    def stall(g):  # rank 1 stalls in the middle of its backward, after some buckets left
        stall_until_the_others_return(timeout_s * 3)
        woke.append(time.monotonic())
        return g
    try:
        with tribucket.fused_bucketing(model, bucket_cap_mb=0.001, debug=debug,
                                       timeout=datetime.timedelta(seconds=timeout_s)):
            for step in range(4):
                handle = (model.layers[2].weight.register_hook(stall)
                          if step == 2 and rank == 1 else None)
                loss_of(model(batch("mlp", rank, step))).backward()
                if handle is not None:
                    handle.remove()
    except RuntimeError as e:
        return str(e), time.monotonic(), woke
    return None, time.monotonic(), woke


@pytest.mark.parametrize("debug", [False, True])
def test_stall_mid_backward_names_the_rank(dist_run, debug):
    # debug=True: rank 0 meets the stall in a fingerprint's all-gather, in the middle of a
    # backward both ranks started: the fingerprints' own marks name the rank behind
    results = dist_run(_stall_mid_backward, debug, world_size=2, timeout=60)
    message, raised_at, _ = results[0]
    assert message is not None and "did not complete" in message, message
    if debug:
        assert "behind it: rank 1 (last entered the reducer's collective" in message, message
        assert "(bucket " in message and "Every rank reached" not in message, message
    else:
        assert "rank 1" in message and "not finished" in message, message
    assert raised_at < results[1][2][0], (raised_at, results[1])  # while rank 1 still slept


def _rank0_dies_with_tcp_store():
    import socket
    import sys

    rank = dist.get_rank()
    port = [None]
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    dist.broadcast_object_list(port, src=0)
    # the rendezvous store torchrun gives: a TCPStore hosted by rank 0
    store = dist.TCPStore("127.0.0.1", port[0], 2, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=10))
    model = build("mlp")
    with tribucket.fused_bucketing(model, bucket_cap_mb=0.001,
                                   timeout=datetime.timedelta(seconds=3)) as reducer:
        reducer._guard._store = store
        for step in range(2):
            loss_of(model(batch("mlp", rank, step))).backward()
        dist.barrier()
        if rank == 0:
            os._exit(7)
        # rank 1: capture what the process writes on its stderr (C++ warnings included)
        sys.stderr.flush()
        saved = os.dup(2)
        with tempfile.TemporaryFile() as err:
            os.dup2(err.fileno(), 2)
            try:
                loss_of(model(batch("mlp", rank, 2))).backward()
                message = None
            except RuntimeError as e:
                message = str(e)
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                os.close(saved)
            err.seek(0)
            printed = err.read().decode(errors="replace")
        return message, printed


def test_dead_rank0_gives_a_short_message(dist_run):
    results = dist_run(_rank0_dies_with_tcp_store, world_size=2, timeout=60, teardown=True,
                       expect_dead=(0,))
    message, printed = results[1]
    assert message is not None and "did not complete" in message, message
    assert "rank 0" in message and "frame #" not in message, message
    assert "frame #" not in printed and "TCPStore" not in printed, printed


# ------------------------------------------------------------ 4. resumed state
def _hook_for(kind):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    if kind == "powersgd":
        return (psgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                   start_powerSGD_iter=2, random_seed=5), psgd.powerSGD_hook)
    return None, None


def _train_resumable(kind, steps, start, path, save_at=None, load_from=None, via="torch"):
    """Train ``steps`` steps from ``start``; save at ``save_at``; before training, load the
    checkpoint of step ``load_from[rank]`` (None: this rank loads nothing)."""
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank()
    model = build("mlp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with tribucket.fused_bucketing(model, bucket_cap_mb=0.001, timeout=TIMEOUT) as reducer:
        state, hook = _hook_for(kind)
        if hook is not None:
            reducer.register_comm_hook(state, hook)
        at = None if load_from is None else load_from[rank]
        if at is not None:
            saved = torch.load(f"{path}.{at}.{rank}", weights_only=False)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            if via == "dcp":
                target = {"reducer": reducer.state_dict()}  # a fresh reducer's: other sizes
                dcp.load(target, checkpoint_id=f"{path}.{at}.dcp")
                reducer.load_state_dict(target["reducer"])
            else:
                reducer.load_state_dict(saved["reducer"])
        for step in range(start, start + steps):
            loss_of(model(batch("mlp", rank, step))).backward()
            opt.step()
            opt.zero_grad()
            if step + 1 == save_at or (save_at == "every"):
                n = step + 1
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                            "reducer": reducer.state_dict()}, f"{path}.{n}.{rank}")
                if via == "dcp":
                    dcp.save({"reducer": reducer.state_dict()}, checkpoint_id=f"{path}.{n}.dcp")
        return [p.detach().clone() for p in model.parameters()]


def _try_train_resumable(*args, **kwargs):
    try:
        return _train_resumable(*args, **kwargs)
    except (RuntimeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"


@pytest.mark.parametrize("load_from,field", [((3, None), "rebuilt layout"),
                                             ((3, 2), "iterations")])
def test_resume_from_different_states_is_named_on_every_rank(dist_run, load_from, field):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        dist_run(_train_resumable, "default", 3, 0, path, "every", world_size=2)
        results = dist_run(_try_train_resumable, "default", 2, 3, path, load_from=load_from,
                           world_size=2, timeout=60)
    for msg in results:
        assert isinstance(msg, str) and "differ across ranks" in msg, msg
        assert field in msg and "rank 1" in msg and "load_state_dict" in msg, msg


def _load_rank0_powersgd(path):
    rank = dist.get_rank()
    model = build("mlp")
    with tribucket.fused_bucketing(model, bucket_cap_mb=0.001) as reducer:
        state, hook = _hook_for("powersgd")
        reducer.register_comm_hook(state, hook)
        saved = torch.load(f"{path}.3.0", weights_only=False)  # the usual habit: rank 0's
        try:
            reducer.load_state_dict(saved["reducer"])
        except ValueError as e:
            return str(e)
        return None if rank == 0 else "loaded"


def test_per_rank_hook_state_is_not_loaded_on_another_rank(dist_run):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        dist_run(_train_resumable, "powersgd", 3, 0, path, 3, world_size=2)
        results = dist_run(_load_rank0_powersgd, path, world_size=2)
    assert results[0] is None  # rank 0 loads its own state
    assert "saved by rank 0 of 2" in results[1] and "rank 1" in results[1], results[1]


@pytest.mark.parametrize("kind", ["default", "powersgd"])
def test_state_loads_with_distributed_checkpoint(dist_run, kind):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        straight = dist_run(_train_resumable, kind, 6, 0, path, world_size=2)
        dist_run(_train_resumable, kind, 3, 0, path, 3, via="dcp", world_size=2)
        resumed = dist_run(_train_resumable, kind, 3, 3, path, load_from=(3, 3), via="dcp",
                           world_size=2)
    for a, b in zip(straight, resumed):
        assert all(torch.equal(x, y) for x, y in zip(a, b))  # bit for bit


def _extra_forward_then_recover():
    """Rank 1 runs one training forward without a backward (no collective: the model has
    no buffers): that step raises on every rank, and the steps after it average as usual."""
    rank = dist.get_rank()
    model = build("mlp")
    out = []
    with tribucket.fused_bucketing(model, bucket_cap_mb=0.001, timeout=TIMEOUT):
        for step in range(4):
            model.zero_grad()
            if rank == 1 and step == 1:
                model(batch("mlp", rank, step))  # a forward without backward

            def one():
                loss_of(model(batch("mlp", rank, step))).backward()
                return _max_error(model, _reference_grads("mlp", step))
            out.append(_outcome(one))
    return out


def test_steps_after_a_step_mismatch_are_clean(dist_run):
    results = dist_run(_extra_forward_then_recover, world_size=2, timeout=60)
    for steps in results:
        assert steps[1][0] == "error" and "same training step" in steps[1][1], steps[1]
    _assert_never_mixed([[r[0], *r[2:]] for r in results], 3)
    assert all(r[s][0] == "ok" for r in results for s in (0, 2, 3)), results


def _extra_pass_on_one_rank(debug):
    """Rank 1 runs one extra forward and backward (no optimizer step) before its step 1: its
    forward count stays equal to its peers' (one forward per backward), so only the optimizer
    steps taken since tell the passes apart."""
    rank = dist.get_rank()
    model = build("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log = []
    with tribucket.fused_bucketing(model, bucket_cap_mb=0.001, timeout=TIMEOUT, debug=debug):
        for step in range(3):
            def one():
                model.zero_grad()
                if rank == 1 and step == 1:
                    loss_of(model(batch("mlp", rank, 9))).backward()  # the extra pass
                    model.zero_grad()
                loss_of(model(batch("mlp", rank, step))).backward()
                opt.step()
            log.append(_outcome(one))
    return log


@pytest.mark.parametrize("debug", [False, True])
def test_an_extra_pass_on_one_rank_is_named_at_the_next_backward(dist_run, debug):
    r0, r1 = dist_run(_extra_pass_on_one_rank, debug, world_size=2, timeout=60)
    # rank 1's extra pass pairs with rank 0's step 1 (nothing can tell them apart yet); its
    # step 1 pairs with rank 0's step 2: one optimizer step apart, named on both ranks
    assert r0[0][0] == r1[0][0] == "ok", (r0, r1)
    assert r1[1][0] == "error" and r0[2][0] == "error", (r0, r1)
    for msg in (r1[1][1], r0[2][1]):
        assert "optimizer step" in msg and "rank 0" in msg and "rank 1" in msg, msg
        assert "timed out" not in msg, msg


def _late_for_the_first_backward(timeout_s=2.0):
    """Rank 1 reaches its first backward late (slow start, a long first batch)."""
    rank = dist.get_rank()
    model = build("mlp")
    try:
        with tribucket.fused_bucketing(model, bucket_cap_mb=0.001,
                                       timeout=datetime.timedelta(seconds=timeout_s)):
            if rank == 1:
                stall_until_the_others_return(timeout_s * 3)
            loss_of(model(batch("mlp", rank, 0))).backward()
    except RuntimeError as e:
        return str(e)
    return None


def test_rank_late_for_the_first_backward_is_named(dist_run):
    message = dist_run(_late_for_the_first_backward, world_size=2, timeout=60,
                       teardown=True)[0]
    assert message is not None and "rank 1" in message, message
    assert "never started a backward" in message and "late" in message, message
    assert "timed out" in message.lower() and "reducer state" in message, message


def _hook_callback_raises_on_rank_1(how="ValueError", timeout_s=2.0):
    """A comm hook whose decompress callback raises (``how``: that exception class) or
    completes with a tensor of the wrong size (``"wrong size"``) on rank 1 in iteration 3
    (the fourth backward): that rank must say its own hook failed, in iteration 3, blaming
    no peer."""
    rank = dist.get_rank()
    model = build("mlp")
    calls = {"backward": 0}

    def hook(state, bucket):
        fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
        fail = rank == 1 and calls["backward"] == 3

        def after(f):
            if fail and how == "wrong size":
                return f.value()[0][:1].clone()
            if fail:
                raise {"ValueError": ValueError, "TypeError": TypeError}[how](
                    "decompression failed")
            return f.value()[0].div_(dist.get_world_size())
        return fut.then(after)
    try:
        with tribucket.fused_bucketing(model, bucket_cap_mb=0.001,
                                       timeout=datetime.timedelta(seconds=timeout_s)) as red:
            red.register_comm_hook(None, hook)
            for step in range(5):
                calls["backward"] = step
                loss_of(model(batch("mlp", rank, step))).backward()
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("how", ["ValueError", "TypeError", "wrong size"])
def test_a_hook_that_raised_on_this_rank_is_named_as_such(dist_run, how):
    # (a TypeError's name holds "peer", which once passed for a backend error)
    results = dist_run(_hook_callback_raises_on_rank_1, how, world_size=2, timeout=60,
                       teardown=True)
    cause = "with a tensor of 1 elements" if how == "wrong size" else "decompression failed"
    mine = results[1]
    assert mine is not None and cause in mine, mine
    assert "iteration 4" in mine and "iteration 0" not in mine, mine  # (passes count from 1)
    assert "on this rank" in mine and "behind it" not in mine, mine
    theirs = results[0]  # rank 0 times out, naming rank 1 and the cause it reported
    assert theirs is not None and "rank 1" in theirs, theirs
    assert cause in theirs, theirs  # its own report, left in the store


def _late_for_a_buffer_broadcast(timeout_s=2.0):
    """Rank 1 is late for its third forward (BatchNorm buffers: each forward broadcasts)."""
    rank = dist.get_rank()
    model = build("bn")
    try:
        with tribucket.fused_bucketing(model, timeout=datetime.timedelta(seconds=timeout_s)):
            for step in range(3):
                if rank == 1 and step == 2:
                    stall_until_the_others_return(timeout_s * 3)
                loss_of(model(batch("bn", rank, step))).backward()
    except RuntimeError as e:
        return str(e)
    return None


def test_buffer_broadcast_timeout_names_the_rank(dist_run):
    message = dist_run(_late_for_a_buffer_broadcast, world_size=2, timeout=60,
                       teardown=True)[0]
    assert message is not None and "buffer" in message and "rank 1" in message, message
    assert "timed out" in message.lower(), message


class _FailOnce(torch.nn.Module):
    """A BatchNorm model whose forward raises once when asked, after the reducer's buffer
    broadcast (a bad batch the user catches and skips)."""

    def __init__(self):
        super().__init__()
        self.model, self.fail = build("bn"), False

    def forward(self, x):
        if self.fail:
            self.fail = False
            raise ValueError("a bad batch")
        return self.model(x)


def _forward_retried_on_rank_1(timeout_s=2.0):
    """Rank 1's third forward raises after its buffer broadcast and is run again: rank 1
    broadcasts once more than rank 0, which is in its backward by then."""
    rank = dist.get_rank()
    model = _FailOnce()
    try:
        with tribucket.fused_bucketing(model, timeout=datetime.timedelta(seconds=timeout_s)):
            for step in range(3):
                x = batch("bn", rank, step)
                if rank == 1 and step == 2:
                    model.fail = True
                    try:
                        model(x)
                    except ValueError:
                        pass
                loss_of(model(x)).backward()
    except RuntimeError as e:
        return str(e)
    return None


def test_a_rank_past_the_collective_is_named_ahead(dist_run):
    messages = dist_run(_forward_retried_on_rank_1, world_size=2, timeout=60, teardown=True)
    assert "behind it: rank 1" in messages[0], messages[0]
    # rank 1 waits in a broadcast rank 0 never reaches: not "every rank reached this point"
    assert "ahead of it: rank 0" in messages[1], messages[1]
    assert "Every rank reached this point" not in messages[1], messages[1]


def _load_rank0_powersgd_then_train(path):
    """Rank 1's load_state_dict refuses rank 0's PowerSGD state; rank 0 loaded its own and
    goes on to its first backward, which must name rank 1's error."""
    rank = dist.get_rank()
    model = build("mlp")
    with tribucket.fused_bucketing(model, bucket_cap_mb=0.001,
                                   timeout=datetime.timedelta(seconds=2)) as reducer:
        state, hook = _hook_for("powersgd")
        reducer.register_comm_hook(state, hook)
        saved = torch.load(f"{path}.3.0", weights_only=False)
        try:
            reducer.load_state_dict(saved["reducer"])
            loss_of(model(batch("mlp", rank, 0))).backward()
        except (ValueError, RuntimeError) as e:
            return str(e)
        return None


def test_a_peer_that_refused_the_state_is_named_on_the_others(dist_run):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        dist_run(_train_resumable, "powersgd", 3, 0, path, 3, world_size=2)
        results = dist_run(_load_rank0_powersgd_then_train, path, world_size=2, timeout=60,
                           teardown=True)
    assert "saved by rank 0 of 2" in results[1], results[1]
    assert "rank 1" in results[0] and "saved by rank 0" in results[0], results[0]


# ------------------------------------------------------------ requires_grad changed mid-run
def _requires_grad_changes(change):
    """Two steps, then ``layers[0].weight`` is unfrozen (it was frozen on entering) or frozen
    (it was trained), then a step; then the fix the error gives (enter again) and a step."""
    rank = dist.get_rank()
    model = build("mlp")
    weight = model.layers[0].weight
    weight.requires_grad_(change == "freeze")
    with tribucket.fused_bucketing(model, bucket_cap_mb=0.001, timeout=TIMEOUT):
        for step in range(2):
            model.zero_grad()
            loss_of(model(batch("mlp", rank, step))).backward()
        weight.requires_grad_(change == "unfreeze")
        model.zero_grad()
        kind, message = _outcome(lambda: loss_of(model(batch("mlp", rank, 2))).backward())
        # on main, an unfrozen weight trained on this rank's gradient alone
        local = None if weight.grad is None else weight.grad.norm().item()
    model.zero_grad()
    with tribucket.fused_bucketing(model, bucket_cap_mb=0.001, timeout=TIMEOUT):
        loss_of(model(batch("mlp", rank, 3))).backward()
    ref = _reference_grads("mlp", 3)
    error = max((p.grad - g).abs().max().item() for p, g in zip(model.parameters(), ref)
                if p.requires_grad)
    return kind, message, local, error, weight.grad is None


@pytest.mark.parametrize("change", ["unfreeze", "freeze"])
def test_requires_grad_changed_after_entering_is_named(dist_run, change):
    """Unfreezing a parameter that was frozen on entering would train it on each rank's own
    gradient (DDP does, silently): the next training forward raises on every rank, naming
    it. Freezing an averaged one leaves it without a gradient: the backward's error says
    why. Either way, entering fused_bucketing again averages the new set."""
    results = dist_run(_requires_grad_changes, change)
    for kind, message, local, error, no_grad in results:
        assert kind == "error", f"{change}: no error (this rank's weight.grad norm: {local})"
        assert "layers.0.weight" in message, message
        if change == "unfreeze":
            assert "require grad when the reducer was built" in message, message
            assert "leave fused_bucketing and enter it again" in message, message
        else:
            assert "no longer require grad" in message, message
            assert "enter it again" in message, message
            assert no_grad
        assert error < 1e-6, f"{change}: after entering again, max |grad - reference| {error}"


# ------------------------------------------------------------ parameters set mid-run
def _model_changed_after_entering(change):
    """Two steps, then the model changed inside the block (a new head, a replaced weight, an
    adapter added, a weight re-tied to itself, a frozen layer added), then a step; then the
    fix the error gives (enter again) and a step. ``(outcome, message, largest gradient
    difference between the ranks after entering again)``."""
    rank = dist.get_rank()
    model = build("mlp")
    ignore = ("head.weight", "head.bias") if change == "ignored_head" else ()
    if change == "removed_unused":  # a layer the forward never uses
        model.spare = torch.nn.Linear(16, 16)
    with tribucket.fused_bucketing(model, bucket_cap_mb=0.001, find_unused_parameters=True,
                                   timeout=TIMEOUT, ignore_parameters=ignore):
        for step in range(2):
            model.zero_grad()
            loss_of(model(batch("mlp", rank, step))).backward()
        torch.manual_seed(7)  # the same new weights on every rank
        if change in ("head", "ignored_head"):
            model.head = torch.nn.Linear(16, 3)
        elif change == "weight":
            model.layers[0].weight = torch.nn.Parameter(torch.randn(16, 16) / 4)
        elif change == "adapter":
            model.layers[0].lora = torch.nn.Linear(16, 16, bias=False)
        elif change == "retied":
            model.layers[0].weight = model.layers[0].weight
        elif change == "swapped":  # the same set trains
            a, b = model.layers[0], model.layers[1]
            a.weight, b.weight = b.weight, a.weight
        elif change == "container_filled":  # set empty, then filled (as adapter libraries do)
            model.layers[0].adapters = torch.nn.ModuleDict()
            model.layers[0].adapters["a"] = torch.nn.Linear(16, 16)
        elif change == "frozen_then_unfrozen":  # added frozen (no change), a step, unfrozen
            model.layers[0].extra = torch.nn.Linear(16, 16).requires_grad_(False)
            loss_of(model(batch("mlp", rank, 2))).backward()
            model.layers[0].extra.requires_grad_(True)
        elif change == "inserted":  # written into _modules past torch's hooks
            model.layers.insert(1, torch.nn.Linear(16, 16))
        elif change == "frozen_taken_out":  # a frozen teacher added, used, taken out,
            model.teacher = torch.nn.Linear(16, 16).requires_grad_(False)  # trained elsewhere
            loss_of(model(batch("mlp", rank, 2))).backward()
            teacher, model.teacher = model.teacher, None
            teacher.requires_grad_(True)
        elif change == "removed_unused":  # (unused anyway: nothing waits for it)
            model.spare = None
        elif change == "converted":  # .to() under torch's overwrite flag: every parameter
            torch.__future__.set_overwrite_module_params_on_conversion(True)  # replaced in
            try:  # the modules' _parameters, past torch's registration hooks
                model.to(torch.float32)
            finally:
                torch.__future__.set_overwrite_module_params_on_conversion(False)
        elif change == "set_none":
            model.layers[0].drop = torch.nn.Dropout(0.0)
            model.layers[0].drop = None
        else:  # a frozen layer: nothing to average
            model.layers[0].extra = torch.nn.Linear(16, 16).requires_grad_(False)
        model.zero_grad()
        kind, message = _outcome(lambda: loss_of(model(batch("mlp", rank, 2))).backward())
    model.zero_grad()
    with tribucket.fused_bucketing(model, bucket_cap_mb=0.001, find_unused_parameters=True,
                                   timeout=TIMEOUT):
        loss_of(model(batch("mlp", rank, 3))).backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    every = [torch.empty_like(grads) for _ in range(dist.get_world_size())]
    dist.all_gather(every, grads)
    return kind, message, max((g - grads).abs().max().item() for g in every)


@pytest.mark.parametrize("change,named", [
    ("head", "replaced 'head.weight', 'head.bias'"),
    ("weight", "replaced 'layers.0.weight'"),
    ("adapter", "added 'layers.0.lora.weight'"),
    ("container_filled", "added 'layers.0.adapters.a.weight', 'layers.0.adapters.a.bias'"),
    ("frozen_then_unfrozen", "added 'layers.0.extra.weight', 'layers.0.extra.bias'"),
    ("inserted", "added 'layers.1.weight', 'layers.1.bias'"),
    ("converted", "replaced 'layers.0.weight', 'layers.0.bias'"),
    ("retied", None), ("swapped", None), ("set_none", None), ("frozen_layer", None),
    ("frozen_taken_out", None), ("removed_unused", None),
    ("ignored_head", None)])
def test_parameters_set_after_entering_are_named(dist_run, change, named):
    """A head replaced or an adapter added inside the block would train on each rank's own
    gradient (DDP's models drift apart, silently): the next training forward raises on every
    rank, naming it. Setting a parameter the reducer already averages, a frozen layer, or a
    module where ignore_parameters leaves the parameters out (each rank trains it alone, as
    DDP's test_ddp_ignore_params_arg does) is no change to what is averaged."""
    for kind, message, spread in dist_run(_model_changed_after_entering, change):
        if named is None:
            assert kind == "ok", message
        else:
            assert kind == "error", f"{change}: no error"
            assert named in message and "enter it again" in message, message
        assert spread < 1e-6, f"{change}: after entering again the ranks' gradients differ"


def _functional_call_steps(how, kind="computed"):
    """Three MAML-like steps: the outer forward runs through torch.func.functional_call with
    weights computed from the model's own (the tensors it swaps into the modules for the
    call are not parameters: their gradients flow back to the model's). ``kind="teacher"``:
    a plain step plus a forward through functional_call with a frozen copy's parameters
    (nn.Parameter objects of another model, as a teacher or an EMA). ``how``: "ddp" or
    "tribucket". The first layer's weight after the steps."""
    from torch.func import functional_call

    rank = dist.get_rank()
    model = build("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if how == "ddp":
        net, ctx = torch.nn.parallel.DistributedDataParallel(model), None
    else:
        net, ctx = model, tribucket.fused_bucketing(model, timeout=TIMEOUT)
        ctx.__enter__()
    try:
        teacher = {k: torch.nn.Parameter(v.detach() * 0.5, requires_grad=False)
                   for k, v in net.named_parameters()}
        for step in range(3):
            if kind == "teacher":
                out = net(batch("mlp", rank, step))
                with torch.no_grad():
                    target = functional_call(net, teacher, (batch("mlp", rank, step),))
                guide = functional_call(net, teacher, (batch("mlp", rank, step + 5),))
                ((out - target).square().mean() + guide.mean() * 0).backward()
                opt.step()
                opt.zero_grad()
                continue
            params = dict(net.named_parameters())
            inner = loss_of(functional_call(net, params, (batch("mlp", rank, step),)))
            grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
            fast = {k: v - 0.01 * g for (k, v), g in zip(params.items(), grads)}
            loss_of(functional_call(net, fast, (batch("mlp", rank, step + 5),))).backward()
            opt.step()
            opt.zero_grad()
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    return model.layers[0].weight.detach().clone()


@pytest.mark.parametrize("kind", ["computed", "teacher"])
def test_functional_call_with_computed_weights_trains_as_ddp(dist_run, kind):
    """torch.func.functional_call swaps tensors into the modules' _parameters for one call,
    past torch's registration hooks (MAML's fast weights, weight noise, a teacher's
    parameters): no change to what is averaged; the steps equal DDP's on every rank."""
    ddp = dist_run(_functional_call_steps, "ddp", kind)
    mine = dist_run(_functional_call_steps, "tribucket", kind)
    for d, m in zip(ddp, mine):
        assert (d - m).abs().max().item() < 1e-6, (d - m).abs().max().item()
    assert torch.equal(mine[0], mine[1])


def _shared_frozen_module_replaced():
    """Two models (a GAN's generator and discriminator) share a frozen feature layer, each
    with its reducer; the shared layer's weight is replaced by a trainable one: each
    model's next training forward."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    feat = torch.nn.Linear(16, 16).requires_grad_(False)
    gen = torch.nn.Sequential(feat, torch.nn.Linear(16, 16))
    disc = torch.nn.Sequential(feat, torch.nn.Linear(16, 3))
    x = batch("mlp", rank, 0)
    with tribucket.fused_bucketing(gen, timeout=TIMEOUT), \
            tribucket.fused_bucketing(disc, timeout=TIMEOUT):
        gen(x).sum().backward()
        disc(x).sum().backward()
        feat.weight = torch.nn.Parameter(feat.weight.detach().clone())
        return [_outcome(lambda m=m: m(x).sum().backward())[0] for m in (gen, disc)]


def test_a_module_two_watched_models_share_is_watched_for_both(dist_run):
    # before, the second reducer's watch took the shared module over: the generator's new
    # parameter trained on each rank's own gradient (0.54 from the average)
    for outcomes in dist_run(_shared_frozen_module_replaced):
        assert outcomes == ["error", "error"], outcomes


def _wrapper_module_replaced():
    """tribucket.DistributedDataParallel, then ``ddp.module = <another module>``."""
    model = build("mlp")
    ddp = tribucket.DistributedDataParallel(model)
    try:
        loss_of(ddp(batch("mlp", dist.get_rank(), 0))).backward()
        ddp.module = build("mlp", seed=1)
        return _outcome(lambda: loss_of(ddp(batch("mlp", dist.get_rank(), 1))).backward())
    finally:
        ddp.close()


def test_a_wrappers_module_replaced_is_named(dist_run):
    # before, the wrapper ran the new module, whose gradients no reducer averaged
    for kind, message in dist_run(_wrapper_module_replaced):
        assert kind == "error" and ".module was replaced" in message, (kind, message)


def _static_graph_loses_a_branch():
    """static_graph=True, the head used in the first iteration only: the second backward's
    error."""
    rank = dist.get_rank()
    model = build("mlp")
    with tribucket.fused_bucketing(model, static_graph=True, timeout=TIMEOUT):
        loss_of(model(batch("mlp", rank, 0))).backward()
        x = batch("mlp", rank, 1)
        for layer in model.layers:  # the head left out
            x = torch.tanh(layer(x))
        return _outcome(lambda: x.sum().backward())


def test_a_static_graph_that_changed_says_so(dist_run):
    # before, the error advised "static_graph=True if the unused set never changes", which
    # the user had passed
    for kind, message in dist_run(_static_graph_loses_a_branch):
        assert kind == "error" and "head.weight" in message, message
        assert "static_graph does not allow" in message, message
        assert "find_unused_parameters=True instead of static_graph" in message, message


def _frozen_between_blocks_with_a_local_grad(zeroed: bool = False):
    """A no_sync micro-batch in one block (``zeroed``: then zero_grad(set_to_none=False)),
    the first layer frozen, the synchronising micro-batch in a new block: what the reducer
    logged on entering."""
    rank = dist.get_rank()
    model = build("mlp")
    with tribucket_log() as logged:
        with tribucket.fused_bucketing(model, timeout=TIMEOUT) as reducer:
            with reducer.no_sync():
                loss_of(model(batch("mlp", rank, 0))).backward()
        if zeroed:
            model.zero_grad(set_to_none=False)
        model.layers[0].requires_grad_(False)
        with tribucket.fused_bucketing(model, timeout=TIMEOUT):
            loss_of(model(batch("mlp", rank, 1))).backward()
    return [m for m in logged if "do not require grad but hold a .grad" in m]


def test_entering_with_a_frozen_parameter_holding_a_grad_warns(dist_run):
    # before: nothing said that the frozen layer's local no_sync gradient stays unaveraged
    # (an optimizer then steps each rank's own; DDP is silent too)
    for warned in dist_run(_frozen_between_blocks_with_a_local_grad):
        assert len(warned) == 1 and "layers.0.weight" in warned[0], warned
    # zeros (zero_grad(set_to_none=False)) are the same on every rank: no warning
    for warned in dist_run(_frozen_between_blocks_with_a_local_grad, True):
        assert warned == [], warned


def _forward_raises_with_find_unused():
    """A training forward that raises inside fused_bucketing(find_unused_parameters=True):
    after leaving, whether the reducer is collected and what the aux-output collectors of
    the process still hold."""
    import gc
    import weakref

    from tribucket import _tags

    rank = dist.get_rank()
    model = build("mlp")
    try:
        with tribucket.fused_bucketing(model, find_unused_parameters=True,
                                       timeout=TIMEOUT) as reducer:
            loss_of(model(batch("mlp", rank, 0))).backward()
            gone = weakref.ref(reducer)
            model(torch.randn(2, 5))  # the wrong width: the first layer raises
    except RuntimeError:
        pass
    del reducer
    gc.collect()
    return gone() is None, len(_tags._AUX_COLLECTORS)


def test_a_forward_that_raised_leaves_nothing_behind(dist_run):
    # before, the forward's aux-output collection stayed registered for the process: the
    # closed reducer (and its buckets) was never freed, and every later MoE aux_loss was
    # appended to it
    for collected, collectors in dist_run(_forward_raises_with_find_unused):
        assert collected and collectors == 0, (collected, collectors)


def _a_sweep_of_reducers(options: dict):
    """Six reducers one after another in one process (a sweep), each a step: the process
    groups alive after the first and after the last, and the largest gradient difference
    from the dense reference."""
    groups = []
    worst = 0.0
    for trial in range(6):
        model = build("mlp")
        with tribucket.fused_bucketing(model, bucket_cap_mb=0.001, **options):
            loss_of(model(batch("mlp", dist.get_rank(), trial))).backward()
        worst = max(worst, _max_error(model, _reference_grads("mlp", trial)))
        groups.append(len(dist.distributed_c10d._world.pg_map))
    return groups[0], groups[-1], worst


def _a_sweep_after_a_failure_on_one_rank():
    """A reducer whose collective failed on rank 0 (rank 1 stalled before its hook's
    allreduce, then left the block cleanly, nothing in flight), then a sweep of reducers
    with the same timeout."""
    _hook_with_stalled_peer("allreduce")
    return _a_sweep_of_reducers(dict(timeout=datetime.timedelta(seconds=2.0)))


def test_a_sweep_after_a_failure_on_one_rank_agrees_on_its_groups(dist_run):
    # on the pool's first version, rank 0 dropped its groups (its collective failed) and
    # rank 1 gave them back: the next reducer reused them on rank 1 and created new ones on
    # rank 0, and new_group waited until its store timeout ('Wait timeout')
    for first, last, worst in dist_run(_a_sweep_after_a_failure_on_one_rank, timeout=90):
        assert last == first and worst < 1e-6, (first, last, worst)


@pytest.mark.parametrize("options", [dict(timeout=TIMEOUT), dict(debug=True)],
                         ids=["timeout", "debug"])
def test_a_sweep_of_reducers_reuses_their_groups(dist_run, options):
    # before, each reducer with timeout= created two gloo groups (debug=True one) and never
    # freed them: ~5 sockets and ~3 threads per group, until the process ran out
    for first, last, worst in dist_run(_a_sweep_of_reducers, options):
        assert last == first and worst < 1e-6, (first, last, worst)


# ------------------------------------------------------------ dtype or device changed mid-run
def _retyped_after_entering(change, native_hooks, device="cpu"):
    """Two steps, then the model converted in place (``model.double()``, or
    ``model.half().float()``, which leaves the dtype as it was; on a GPU, ``model.cpu()``),
    then a step; then the fix the error gives (enter again) and a step. ``(native path on,
    outcome, message, largest difference from the reference after entering again)``."""
    rank = dist.get_rank()
    model = build("mlp").to(device)
    with tribucket.fused_bucketing(model, bucket_cap_mb=0.001, timeout=TIMEOUT,
                                   native_hooks=native_hooks,
                                   find_unused_parameters=change == "layer_find_unused") as r:
        native = r._bw.native is not NO_NATIVE
        for step in range(2):
            model.zero_grad()
            loss_of(model(batch("mlp", rank, step).to(device))).backward()
        model.zero_grad()
        if change == "double":
            model.double()
        elif change == "half_float":
            model.half().float()
        elif change == "cpu":
            model.cpu()
        else:  # one layer, and a parameter the forward reaches may go without a gradient
            model.layers[2].half().float()
        p0 = next(model.parameters())
        kind, message = _outcome(
            lambda: loss_of(model(batch("mlp", rank, 2).to(p0.device, p0.dtype))).backward())
        if kind == "ok":  # averaged, then (the Python hooks stay on the parameters)
            error = _max_error(model, _reference_like(model, 2))
    model.zero_grad()
    model.to(device)
    with tribucket.fused_bucketing(model, bucket_cap_mb=0.001, timeout=TIMEOUT,
                                   native_hooks=native_hooks):
        loss_of(model(batch("mlp", rank, 3).to(device, p0.dtype))).backward()
    again = _max_error(model, _reference_like(model, 3))
    return native, kind, message if kind == "error" else error, again


def _reference_like(model, step):
    """:func:`_reference_grads` of a plain copy of ``model`` (its dtype, its values)."""
    ref = copy.deepcopy(model)
    ref.zero_grad()
    p0 = next(ref.parameters())
    loss_of(ref(batch("mlp", dist.get_rank(), step).to(p0.device, p0.dtype))).backward()
    grads = [p.grad.detach().clone() for p in ref.parameters()]
    for g in grads:
        dist.all_reduce(g)
        g.div_(dist.get_world_size())
    return grads


@pytest.mark.parametrize("native_hooks", [None, False], ids=["default", "python_hooks"])
@pytest.mark.parametrize("change", ["double", "half_float", "layer_find_unused"])
def test_dtype_changed_after_entering_is_named(dist_run, change, native_hooks):
    """``model.double()`` inside the context: the reducer's buckets hold float32, and torch
    drops each parameter's gradient accumulator (with the reducer's native hooks): DDP then
    leaves every gradient unaveraged, silently. The next training forward raises on every
    rank, naming the parameters, both dtypes and the fix. ``model.half().float()`` leaves the
    dtype, but not the accumulators: the native hooks' backward raises, naming them; the
    Python hooks (on the tensors) still average. So with find_unused_parameters, where a
    parameter the forward reached may go without a gradient. Entering again averages."""
    for native, kind, detail, again in dist_run(_retyped_after_entering, change,
                                                native_hooks):
        check_retyped(change, native, kind, detail, again)


def check_retyped(change, native, kind, detail, again):
    """The assertions on :func:`_retyped_after_entering`'s result (also on a GPU)."""
    if change in ("double", "cpu") or native:
        assert kind == "error", f"{change}: no error (native hooks: {native})"
        assert "layers.2.weight" in detail and "enter it again" in detail, detail
        if change == "double":
            assert "float32" in detail and "float64" in detail, detail
        if change == "cpu":
            assert "on cuda" in detail and "-> float32 on cpu" in detail, detail
    else:
        assert kind == "ok" and detail < 1e-6, (kind, detail)
    assert again < 1e-5, f"{change}: after entering again, max |grad - reference| {again}"


# ------------------------------------------------------------ leaving on an exception
def _leave_on_exception(kind, timeout_s=2.0):
    """Rank 1 leaves fused_bucketing on an exception while rank 0 trains on: with trace=,
    leaving must not start the trace's gather (rank 0 is in its next step's collective);
    each rank writes its own events instead. ``(what this rank raised, seconds it took,
    the trace files written, the ranks and steps of the backward spans in this rank's)``."""
    import time

    from tribucket import trace
    rank = dist.get_rank()
    model = build("mlp")
    start = time.monotonic()
    raised, files, spans = None, [], None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            with tribucket.fused_bucketing(model, bucket_cap_mb=0.001,
                                           timeout=datetime.timedelta(seconds=timeout_s),
                                           trace=os.path.join(tmp, "t.json")):
                for step in range(3):
                    if rank == 1 and step == 1:
                        raise ValueError("a bad batch")
                    loss_of(model(batch("mlp", rank, step))).backward()
        except (ValueError, RuntimeError) as e:
            raised = f"{type(e).__name__}: {e}"
        took = time.monotonic() - start
        files = sorted(os.listdir(tmp))  # (each rank's own directory)
        own = os.path.join(tmp, f"t.rank{rank}.json")
        if os.path.exists(own):
            doc = trace.load(own)
            spans = sorted({(e["pid"], e["args"]["step"]) for e in doc["traceEvents"]
                            if e.get("ph") == "X" and e["name"] == "backward"})
    return raised, took, files, spans


def test_leaving_on_an_exception_with_a_trace_starts_no_collective(dist_run):
    results = dist_run(_leave_on_exception, "trace", world_size=2, timeout=60, teardown=True)
    mine, took, _, _ = results[1]
    assert mine == "ValueError: a bad batch" and took < 10, results[1]
    theirs = results[0][0]  # rank 0: its next step's collective, bounded by timeout=
    assert theirs is not None and "rank 1" in theirs, theirs
    # before, no trace was written at all: each rank now writes its own events
    for rank, (_, _, written, backwards) in enumerate(results):
        assert written == [f"t.rank{rank}.json"], written
        assert backwards and {r for r, _ in backwards} == {rank}, (rank, backwards)


def _interrupted_apart():
    """Ctrl-C reaching the ranks at different points: rank 1 in the middle of its backward
    (some buckets launched), rank 0 in its forward. Both leave fused_bucketing with
    KeyboardInterrupt: leaving must not settle the unfinished pass with collectives the
    other rank will never issue. ``(raised, seconds)``."""
    import time
    rank = dist.get_rank()
    model = build("mlp")
    start = time.monotonic()

    def interrupt(grad):
        raise KeyboardInterrupt

    try:
        with tribucket.fused_bucketing(model, bucket_cap_mb=0.001):
            loss_of(model(batch("mlp", rank, 0))).backward()
            if rank == 1:
                model.layers[0].weight.register_hook(interrupt)  # (its last gradient)
                loss_of(model(batch("mlp", rank, 1))).backward()
            else:
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        return "KeyboardInterrupt", time.monotonic() - start
    return None, time.monotonic() - start


def test_leaving_on_an_interrupt_settles_nothing(dist_run):
    for raised, took in dist_run(_interrupted_apart, world_size=2, timeout=60, teardown=True):
        assert raised == "KeyboardInterrupt" and took < 10, (raised, took)
