"""Fault tolerance across replica groups on torchft: ``fused_bucketing(model, manager=...)``.

Two kinds of tests:

* in the gloo pool (one rank, a stand-in manager): what goes to the manager (one
  allreduce per bucket, in the wire dtype, none under ``no_sync``), the fixed layout, the
  reducer state the manager carries, and the refusals at entry;
* ``@pytest.mark.ft``: a torchft Lighthouse and replica groups as subprocesses (each one
  process, its own store, ``REPLICA_GROUP_ID``), compared step by step with a dense
  single-process reference: a replica SIGKILLed in its backward, the survivor going on
  alone, the killed one restarted and recovering live, fp16 + clip, and torchft's own DDP
  on the same run as the baseline.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytest.importorskip("torchft", reason="torchft is not installed: pip install 'tribucket[ft]' "
                    "with torch pinned (make venv installs it)")

import _ft_worker as W  # noqa: E402
from _ft_harness import FTRun, Zygote, free_port, start_together  # noqa: E402

import tribucket  # noqa: E402


# ------------------------------------------------------------------ the dense reference
def reference(participants: dict[int, int], last: int, clip: float = 0.0,
              zeros_from_1: tuple = ()) -> dict[int, torch.Tensor]:
    """Parameters after each committed step of one process training on the average of the
    participating replica groups' batches: ``participants[step]`` is 2 (replicas 0 and 1),
    1 (replica 0 alone) or a tuple of the replica ids."""
    torch.manual_seed(0)
    model = W.build_model()
    opt = W.make_optimizer(model)
    out = {}
    for step in range(last):
        opt.zero_grad()
        p = participants[step]
        reps = list(p) if isinstance(p, tuple) else [0, 1][:p]
        for r in reps:
            if r == 1 and step in zeros_from_1:
                continue  # replica 1 sat this step out, sending zeros (healing, async quorum)
            x, y = W.batch(r, step)
            (nn.functional.mse_loss(model(x), y) / len(reps)).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        out[step + 1] = W.flat_params(model)
    return out


def _committed(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in records if r["committed"]}


def _check_against_reference(got: dict[int, torch.Tensor], participants: dict[int, int],
                             atol: float, clip: float = 0.0, what: str = "",
                             zeros_from_1: tuple = ()) -> None:
    ref = reference(participants, max(got), clip, zeros_from_1)
    for step in sorted(got):
        diff = (got[step] - ref[step]).abs().max().item()
        assert diff <= atol, (f"{what}: parameters after step {step - 1} differ from the dense "
                              f"reference by {diff:.3g} (participants {participants})")


# ------------------------------------------------------------------ multi-process runs
@pytest.fixture(scope="module")
def zygote():
    """The Lighthouses and replica groups of these runs are forked from one process that
    imported torch, torchft and tribucket once (each is still a process of its own, see
    ``_ft_harness``); the example's groups are new interpreters, since how they exit is
    what is tested."""
    with Zygote() as z:
        yield z


_CHILD = """
import os, signal, sys
how = sys.argv[1]
print(os.environ.get("CHECK"), "PATH" in os.environ, os.getsid(0) == os.getpid(), sys.argv[1:])
sys.stdout.flush()
if how == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if how == "raise":
    raise ValueError("from the child")
sys.exit(int(how))
"""


@pytest.mark.ft
def test_forked_processes_report_like_popen(zygote, tmp_path):
    """What the runs below rely on: a forked child has exactly the environment it was given
    (none of the zygote's), a session of its own (the runs kill its process group), its
    argv, and its exit code as ``Popen`` reports one: the script's code, -9 for a SIGKILL,
    1 and the traceback for an exception."""
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    want = {"0": 0, "3": 3, "kill": -9, "raise": 1}
    procs = {how: zygote.spawn([sys.executable, str(script), how], {"CHECK": how},
                               str(tmp_path / f"{how}.out")) for how in want}
    for how, proc in procs.items():
        assert proc.wait(30) == want[how], (how, (tmp_path / f"{how}.out").read_text())
        out = (tmp_path / f"{how}.out").read_text()
        assert out.startswith(f"{how} False True ['{how}']\n"), out
    assert "ValueError: from the child" in (tmp_path / "raise.out").read_text()


@pytest.mark.ft
@pytest.mark.timeout(300)
def test_kill_survive_and_recover_live(tmp_path, zygote):
    """Replica 1 is SIGKILLed in the backward of step K: replica 0 drops that step (no
    half-applied update), commits the next ones alone within the heartbeat timeout + 2 s,
    and replica 1, restarted, recovers model, optimizer and reducer state from replica 0
    and then matches it bit for bit; every committed step equals the dense reference.

    Twice at once, on two Lighthouses: with ``use_async_quorum=False`` (the restarted
    replica heals before its forward, into a reducer that has not run a backward) and with
    torchft's default asynchronous quorum (it trains the step, sending zeros, and loads the
    state before the optimizer step, into a reducer that has)."""
    K, heartbeat_s = 4, 2.0
    modes = (0, 1)
    with contextlib.ExitStack() as stack:
        runs, survivors, restarted, t_restart = {}, {}, {}, {}
        for mode in modes:
            sub = tmp_path / f"async{mode}"
            sub.mkdir()
            run = runs[mode] = stack.enter_context(
                FTRun(str(sub), heartbeat_timeout_ms=int(heartbeat_s * 1000), zygote=zygote))
            run.lighthouse()
            # the survivor steps on (slowly) until the test writes the last step into `stop`
            survivors[mode] = run.replica(0, steps=10_000, sleep=0.1, go=str(sub / "go"),
                                          stop_file=str(sub / "stop"), async_quorum=mode)
            run.replica(1, steps=10_000, die_at=K, go=str(sub / "go"), async_quorum=mode)
        for mode in modes:
            start_together(runs[mode], ["r0", "r1"], str(tmp_path / f"async{mode}" / "go"))
        for mode in modes:  # the survivor commits 2 steps alone; the killed one comes back
            run = runs[mode]
            run.wait_for(lambda: sum(r["participants"] == 1
                                     for r in run.steps("r0", True)) >= 2,
                         60, "replica 0 to commit 2 steps alone after replica 1 was killed")
            t_restart[mode] = time.time()
            restarted[mode] = run.replica(1, tag="r1b", steps=10_000, async_quorum=mode,
                                          stop_file=str(tmp_path / f"async{mode}" / "stop"))
        for mode in modes:
            run = runs[mode]
            run.wait_for(lambda: len(run.steps("r1b", True)) >= 3, 120,
                         "the restarted replica 1 to commit 3 steps")
            stop = str(tmp_path / f"async{mode}" / "stop")
            with open(stop + ".tmp", "w") as f:
                f.write(str(max(r["step"] for r in run.steps("r0", True)) + 4))
            os.replace(stop + ".tmp", stop)
        for mode in modes:
            run = runs[mode]
            assert run.wait_exit(restarted[mode], 60, "r1b") == 0, run.tail("r1b")
            assert run.wait_exit(survivors[mode], 60, "r0") == 0, run.tail("r0")
            _check_kill_run(run, K, heartbeat_s, t_restart[mode], bool(mode))


def _check_kill_run(run: FTRun, K: int, heartbeat_s: float, t_restart: float,
                    async_quorum: bool) -> None:
    mode = "asynchronous quorum" if async_quorum else "synchronous quorum"
    r0 = run.steps("r0")
    kill = next(r for r in run.records("r1") if r["event"] == "kill")
    assert kill["step"] == K
    # before the kill: both replicas in every step, all committed
    assert [(r["step"], r["committed"], r["participants"]) for r in r0[:K]] == \
        [(s, True, 2) for s in range(K)], mode
    # the step in flight is dropped on the survivor, then redone alone
    at_k = [r for r in r0 if r["step"] == K]
    assert at_k[0]["committed"] is False, at_k
    assert at_k[-1]["committed"] and at_k[-1]["participants"] == 1, at_k
    drop_s = at_k[-1]["t"] - kill["t"]
    assert drop_s <= heartbeat_s + 2.0 + 3.0, f"survivor's next commit {drop_s:.1f} s after the kill"

    committed0 = _committed(r0)
    steps = max(committed0) + 1
    assert sorted(committed0) == list(range(steps))
    participants = {s: r["participants"] for s, r in committed0.items()}
    assert set(participants.values()) == {1, 2}
    p0 = run.params("r0")
    # with the asynchronous quorum replica 1 heals from replica 0 at step 0 (torchft's
    # init_sync) while it trains that step, sending zeros
    _check_against_reference(p0, participants, atol=2e-6, what=f"replica 0, {mode}",
                             zeros_from_1=(0,) if async_quorum else ())

    # the restarted replica: healed at its first step, then equal to replica 0 bit for bit
    r1b = run.steps("r1b")
    assert r1b[0]["healed"], r1b[0]
    first = min(_committed(r1b))
    p1b = run.params("r1b")
    assert min(p1b) == first + 1
    for step in p1b:
        assert torch.equal(p1b[step], p0[step]), f"{mode}, step {step - 1}: recovered replica differs"
    # the reducer state came with the model: the layout, and (loaded before the first
    # backward) the iteration count
    for r in _committed(r1b).values():
        assert r["layout"] == committed0[r["step"]]["layout"]
        if not async_quorum:
            assert r["iterations"] == committed0[r["step"]]["iterations"]
    recover_s = _committed(r1b)[first]["t"] - t_restart
    started = next(r for r in run.records("r1b") if r["event"] == "start")["t"]
    print(f"\n{mode}: first commit alone {drop_s:.2f} s after the kill (heartbeat timeout "
          f"{heartbeat_s:.0f} s); restarted replica's first commit {recover_s:.2f} s after "
          f"its launch, {_committed(r1b)[first]['t'] - started:.2f} s after its manager "
          f"was up (step {first})")


@pytest.mark.ft
@pytest.mark.timeout(180)
def test_three_replicas_two_failures(tmp_path, zygote):
    """Three replica groups; replica 1 is SIGKILLed in its backward at step K1, replica 2 in
    its optimizer step at step K2 (after ``should_commit()`` said yes, before its parameters
    changed). Replica 0 never stops: it drops only the step in flight at the first kill
    (the second one comes after every allreduce of the step arrived), commits every step,
    with 3, then 2, then 1 participants, each equal to the dense reference of the
    participating replicas' batches; replica 2, while it lived, equals it bit for bit."""
    K1, K2, steps, heartbeat_s = 2, 5, 8, 2.0
    with FTRun(str(tmp_path), heartbeat_timeout_ms=int(heartbeat_s * 1000),
               zygote=zygote) as run:
        run.lighthouse()
        go = str(tmp_path / "go")
        r0 = run.replica(0, steps=steps, go=go)
        run.replica(1, steps=steps, die_at=K1, go=go)
        run.replica(2, steps=steps, die_at=K2, die_in="step", go=go)
        start_together(run, ["r0", "r1", "r2"], go)
        assert run.wait_exit(r0, 120, "r0") == 0, run.tail("r0")
        kills = {t: next(r for r in run.records(t) if r["event"] == "kill")
                 for t in ("r1", "r2")}
        assert (kills["r1"]["step"], kills["r2"]["step"]) == (K1, K2), kills
        r0_steps = run.steps("r0")
        p0, p2 = run.params("r0"), run.params("r2")

    assert all(r["loss"] == r["loss"] and abs(r["loss"]) < 1e3 for r in r0_steps), r0_steps
    committed = _committed(r0_steps)
    assert sorted(committed) == list(range(steps)), [(r["step"], r["committed"])
                                                     for r in r0_steps]
    dropped = [r["step"] for r in r0_steps if not r["committed"]]
    assert set(dropped) <= {K1, K2 + 1} and K1 in dropped, dropped
    want = {s: 3 if s < K1 else 2 if s <= K2 else 1 for s in range(steps)}
    assert {s: r["participants"] for s, r in committed.items()} == want
    members = {s: (0, 1, 2)[:n] if n == 3 else (0, 2) if n == 2 else (0,)
               for s, n in want.items()}
    _check_against_reference(p0, members, atol=2e-6, what="replica 0")
    assert min(p2) == 1 and max(p2) == K2  # replica 2 died before committing step K2
    for step in p2:
        assert torch.equal(p2[step], p0[step]), f"step {step - 1}: replica 2 differs"
    print(f"\nthree replicas: replica 0 dropped steps {dropped}; committed with 1 "
          f"participant {committed[K2 + 1]['t'] - kills['r2']['t']:.2f} s after the second "
          f"kill (heartbeat timeout {heartbeat_s:.0f} s)")


@pytest.mark.ft
@pytest.mark.timeout(120)
@pytest.mark.parametrize("async_quorum", [0, 1], ids=["sync", "async"])
def test_a_caught_backward_error_drops_the_step_on_every_group(tmp_path, zygote, async_quorum):
    """Replica 1's backward raises in step K; it catches the error, calls
    ``reducer.backward_failed()`` and goes on (docs/reliability.md's loop). The buckets it
    owed go out with zeros, and its status says so: replica 0 drops step K too, instead of
    committing an average with replica 1's missing gradients as zeros. Both redo step K,
    and every committed step of both, each with 2 participants, equals the dense reference;
    the replicas equal each other bit for bit. With the synchronous quorum and torchft's
    default asynchronous one."""
    K, steps = 3, 7
    with FTRun(str(tmp_path), zygote=zygote) as run:
        run.lighthouse()
        go = str(tmp_path / "go")
        procs = [run.replica(0, steps=steps, go=go, async_quorum=async_quorum),
                 run.replica(1, steps=steps, die_at=K, die_in="caught", go=go,
                             async_quorum=async_quorum)]
        start_together(run, ["r0", "r1"], go)
        for r, proc in enumerate(procs):
            assert run.wait_exit(proc, 90, f"r{r}") == 0, run.tail(f"r{r}")
        caught = [r for r in run.records("r1") if r["event"] == "caught"]
        r0, r1 = run.steps("r0"), run.steps("r1")
        p0, p1 = run.params("r0"), run.params("r1")
    assert [c["step"] for c in caught] == [K], caught
    at_k = [r["committed"] for r in r0 if r["step"] == K]
    assert at_k == [False, True], f"replica 0 at step {K}: {at_k}"
    for recs in (r0, r1):
        committed = _committed(recs)
        assert sorted(committed) == list(range(steps))
        assert all(r["participants"] == 2 for r in committed.values()), committed
    # (with the asynchronous quorum replica 1 heals at step 0 while it trains it, sending
    # zeros: torchft's init_sync)
    _check_against_reference(p0, {s: 2 for s in range(steps)}, atol=2e-6, what="replica 0",
                             zeros_from_1=(0,) if async_quorum else ())
    for step in p0:
        assert torch.equal(p0[step], p1[step]), f"step {step - 1}: the replicas differ"


@pytest.mark.ft
@pytest.mark.timeout(120)
def test_without_a_manager_the_survivor_raises(tmp_path, zygote):
    """The control case: the same kill against plain ``fused_bucketing`` (one gloo group of
    two processes, ``timeout=``) ends the survivor with an error naming the dead rank, in
    the step of the kill; it commits nothing after it. Surviving is the manager's doing."""
    K = 3
    with FTRun(str(tmp_path), zygote=zygote) as run:
        env = {"MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
        go = str(tmp_path / "go")
        r0 = run.replica(0, impl="plain", steps=10, timeout=5, go=go, env_over=env)
        run.replica(1, impl="plain", steps=10, timeout=5, die_at=K, go=go, env_over=env)
        start_together(run, ["r0", "r1"], go)
        assert run.wait_exit(r0, 60, "r0") != 0, "the survivor finished without its peer"
        error = next(r for r in run.records("r0") if r["event"] == "error")
        kill = next(r for r in run.records("r1") if r["event"] == "kill")
        assert [r["step"] for r in run.steps("r0")] == list(range(K))
    assert error["step"] == K and error["type"] == "RuntimeError", error
    assert "rank 1" in error["message"], error["message"]
    assert error["t"] - kill["t"] <= 5 + 5, "the survivor raised after its timeout"
    print(f"\nwithout a manager: the survivor raised {error['t'] - kill['t']:.2f} s after "
          f"the kill: {error['message'][:300]}")


@pytest.mark.ft
@pytest.mark.timeout(240)
def test_fp16_clip_and_torchft_ddp_baseline(tmp_path, zygote):
    """fp16 fused compression + tribucket's clip through the manager, and torchft's own
    DistributedDataParallel on the same data, both against the dense reference."""
    steps, clip = 8, 0.5
    cases = (("tribucket", "fp16", 2e-3), ("torchft", "none", 2e-6))
    with contextlib.ExitStack() as stack:  # both runs at once: their start-ups overlap
        runs, procs = {}, {}
        for impl, hook, _ in cases:
            sub = tmp_path / impl
            sub.mkdir()
            run = runs[impl] = stack.enter_context(FTRun(str(sub), zygote=zygote))
            run.lighthouse()
            procs[impl] = [run.replica(r, steps=steps, impl=impl, hook=hook, clip=clip,
                                       go=str(sub / "go")) for r in (0, 1)]
        for impl, _, _ in cases:
            start_together(runs[impl], ["r0", "r1"], str(tmp_path / impl / "go"))
        for impl, hook, atol in cases:
            run = runs[impl]
            for r, proc in enumerate(procs[impl]):
                assert run.wait_exit(proc, 120, f"r{r}") == 0, run.tail(f"r{r}")
            recs = [run.steps(f"r{r}") for r in (0, 1)]
            assert all(rec["committed"] and rec["participants"] == 2
                       for rs in recs for rec in rs), recs
            p0, p1 = run.params("r0"), run.params("r1")
            for step in p0:
                assert torch.equal(p0[step], p1[step]), f"{impl}: replicas differ at {step}"
            _check_against_reference(p0, {s: 2 for s in range(steps)}, atol=atol, clip=clip,
                                     what=impl)
            if impl == "tribucket":
                assert all(rec["found_inf"] == 0.0 for rec in recs[0])
                assert any(rec["norm"] > clip for rec in recs[0]), "the clip never acted"


def _example_reference(steps: int, healing: set) -> dict[int, tuple[list[float], float]]:
    """What ``examples/torchft_train.py`` prints after each step, computed in one process
    from the average of both groups' gradients: per committed step, each group's loss and
    the gradient norm before clipping. A group in ``healing`` sends zeros in the first step
    (torchft's asynchronous quorum: it loads a peer's state during that step)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = {}
    for step in range(steps):
        opt.zero_grad()
        losses = []
        for replica in (0, 1):
            g = torch.Generator().manual_seed(1000 * replica + step)
            x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
            loss = nn.functional.cross_entropy(model(x), y)
            if not (step == 0 and replica in healing):
                (loss / 2).backward()
            losses.append(loss.item())
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        out[step + 1] = (losses, norm.item())
    return out


@pytest.mark.ft
@pytest.mark.timeout(180)
def test_the_example_trains_two_groups_and_exits_cleanly(tmp_path, zygote):
    """``examples/torchft_train.py``, as docs/reliability.md runs it, on two replica groups
    (the Lighthouse waits for both before the first step): both exit 0 with no
    ``gc.collect()`` in the script (tribucket's exit handler settles the groups), and what
    each prints, its own loss and the norm of the averaged gradient, equals the dense
    reference."""
    steps = 40
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "examples", "torchft_train.py")
    with open(script) as f:
        assert "gc.collect" not in f.read(), "the example must not need gc.collect()"
    with FTRun(str(tmp_path), min_replicas=2, zygote=zygote) as run:
        run.lighthouse()  # forked; the groups below are new interpreters
        procs = [run.start(r, f"ex{r}", [sys.executable, script, "--steps", str(steps)])
                 for r in (0, 1)]
        for r, proc in enumerate(procs):
            assert run.wait_exit(proc, 150, f"ex{r}") == 0, run.tail(f"ex{r}")
        outs = [run.tail(f"ex{r}", n=1 << 20) for r in (0, 1)]
    # which group loaded the other's state at the start (its first gradient is zeros)
    healing = {r for r, out in enumerate(outs)
               if re.search(rf"replica_{r}\] healing is required step=0", out)}
    assert len(healing) <= 1 and not any(
        re.search(r"healing is required step=[1-9]", out) for out in outs), outs
    ref = _example_reference(steps, healing)
    for r, out in enumerate(outs):
        assert "terminate called" not in out and "Traceback" not in out, out[-3000:]
        got = {int(m[1]): (float(m[2]), float(m[3])) for m in re.finditer(
            rf"replica group {r}: step (\d+) loss (\S+) grad norm (\S+) with 2 group", out)}
        assert sorted(got) == list(range(20, steps + 1, 20)), out[-3000:]
        for step, (loss, norm) in got.items():  # printed to 3 decimals
            want_loss, want_norm = ref[step][0][r], ref[step][1]
            assert abs(loss - want_loss) <= 1e-3 and abs(norm - want_norm) <= 1e-3, (
                r, step, (loss, norm), (want_loss, want_norm))


# ------------------------------------------------------------------ in-process (one rank)
class _FakeWork:
    def __init__(self, t):
        self.t = t

    def wait(self, timeout=None):
        return True


class FakeManager:
    """A stand-in for torchft.Manager: two replica groups whose peer sends what we send."""

    def __init__(self, participants: int = 2):
        self.n = participants
        self.calls: list[tuple] = []
        self.fns: dict = {}
        self.errors: list[str] = []

    def allreduce(self, tensor, should_quantize=False, reduce_op=dist.ReduceOp.AVG):
        self.calls.append((tensor.dtype, tensor.numel(), str(reduce_op)))
        if str(reduce_op) == str(dist.ReduceOp.SUM):
            tensor.mul_(self.n)  # n replicas with this same tensor
        return _FakeWork(tensor)

    def num_participants(self):
        return self.n

    def is_participating(self):
        return True

    def report_error(self, e):  # as torchft's: should_commit() is then False
        self.errors.append(str(e))

    def errored(self):
        return self.errors[-1] if self.errors else None

    def should_commit(self):
        return not self.errors

    def register_state_dict_fn(self, key, load, save):
        assert key not in self.fns
        self.fns[key] = (load, save)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def _check_wire_and_layout():
    x = torch.randn(6, 8)
    ref_model = _mlp()
    ref_model(x).square().mean().backward()
    want = _grads(ref_model)
    out = {}
    for hook, dtype, tol in ((None, torch.float32, 0), ("fp16", torch.float16, 2e-3),
                             ("bf16", torch.bfloat16, 2e-2)):
        m, model = FakeManager(), _mlp()
        with tribucket.fused_bucketing(model, manager=m, bucket_cap_mb=0.0002) as red:
            if hook:
                red.register_comm_hook(None, getattr(tribucket.hooks, f"{hook}_compress_hook"))
            fixed = red.fixed_layout().to_tensor().tolist()
            for _ in range(3):
                model.zero_grad()
                model(x).square().mean().backward()
                for g, w in zip(_grads(model), want):
                    assert torch.allclose(g, w, atol=tol, rtol=tol), (hook, (g - w).abs().max())
            assert red.layout.to_tensor().tolist() == fixed, "the layout changed"
            n_buckets = len(red.layout.buckets)
            assert n_buckets > 1
            assert len(m.calls) == 3 * n_buckets, m.calls
            assert {c[0] for c in m.calls} == {dtype}
            # no_sync: nothing sent; the next synced backward sends the accumulated sum
            model.zero_grad()
            with red.no_sync():
                model(x).square().mean().backward()
            assert len(m.calls) == 3 * n_buckets
            model(x).square().mean().backward()
            assert len(m.calls) == 4 * n_buckets
            for g, w in zip(_grads(model), want):
                assert torch.allclose(g, 2 * w, atol=2 * tol, rtol=tol)
        out[hook] = m.calls[0][2]
    return out


def test_buckets_go_through_the_manager_in_the_wire_dtype(dist_run):
    ops = dist_run(_check_wire_and_layout, world_size=1)[0]
    # divided by num_participants() in the pack: the manager only sums
    assert ops[None] == ops["fp16"] == ops["bf16"] == str(dist.ReduceOp.SUM)


class _RecordingManager(FakeManager):
    """A FakeManager that keeps what each allreduce was handed, before the sum."""

    def __init__(self, participants: int):
        super().__init__(participants)
        self.sent: list[torch.Tensor] = []

    def allreduce(self, tensor, should_quantize=False, reduce_op=dist.ReduceOp.AVG):
        self.sent.append(tensor.detach().clone())
        return super().allreduce(tensor, should_quantize, reduce_op)


def _check_average_fused_in_pack():
    """The buffer handed to the manager already holds gradient / num_participants() of this
    step (the division happens in the pack, one pass, no pass of its own), and the manager
    only sums: the count follows the quorum from step to step."""
    x = torch.randn(6, 8)
    ref_model = _mlp()
    ref_model(x).square().mean().backward()
    want = _grads(ref_model)
    out = {}
    for hook, dtype in ((None, torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)):
        m, model = _RecordingManager(3), _mlp()
        with tribucket.fused_bucketing(model, manager=m) as red:
            if hook:
                red.register_comm_hook(None, getattr(tribucket.hooks, f"{hook}_compress_hook"))
            (bucket,) = red.layout.buckets
            for n in (3, 1, 2):  # replica groups leave and join between steps
                m.n = n
                model.zero_grad()
                model(x).square().mean().backward()
                sent = m.sent[-1]
                assert sent.dtype == dtype and m.calls[-1][2] == str(dist.ReduceOp.SUM), \
                    (hook, m.calls[-1])
                out[(hook, n)] = max(
                    (sent[off:off + want[i].numel()].float()
                     - want[i].reshape(-1).mul(1.0 / n).to(dtype).float()).abs().max().item()
                    for i, off in zip(bucket.indices, bucket.offsets))
                for g, w in zip(_grads(model), want):
                    assert torch.allclose(g, w, atol=2e-2 if hook else 1e-6, rtol=2e-2), \
                        (hook, n, (g - w).abs().max())
    return out


def test_the_average_over_participants_is_fused_into_the_pack(dist_run):
    errs = dist_run(_check_average_fused_in_pack, world_size=1)[0]
    for (hook, n), err in errs.items():
        assert err <= (0 if hook is None else 1e-3), (hook, n, err)


def _check_layout_walks_reverse_parameter_order():
    """The fixed layout is filled in reverse parameter order, the order backward produces
    gradients in: every bucket but the last reaches the cap, and the last one (sent when
    backward is over, overlapping nothing) holds the remainder."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(10)])  # 4224 B a layer
    cap_mb = 3 * 4224 / 2**20  # three layers' worth: buckets of 3, 3, 3 and 1 layers
    with tribucket.fused_bucketing(model, manager=FakeManager(), bucket_cap_mb=cap_mb,
                                   first_bucket_cap_mb=cap_mb) as red:
        buckets = red.fixed_layout().buckets
        sizes = [b.numel * 4 for b in buckets]
        walk = [i for b in buckets for i in b.indices]
        assert red.layout.to_tensor().tolist() == red.fixed_layout().to_tensor().tolist()
    # one cap per bucket (DDP's bucket_cap_mb_list): one layer, then two, then two...
    with tribucket.fused_bucketing(model, manager=FakeManager(),
                                   bucket_cap_mb_list=[4224 / 2**20, 2 * 4224 / 2**20]) as red:
        listed = [b.numel * 4 for b in red.layout.buckets]
    return sizes, walk, listed


def test_fixed_layout_walks_reverse_parameter_order(dist_run):
    sizes, walk, listed = dist_run(_check_layout_walks_reverse_parameter_order, world_size=1)[0]
    assert walk == list(range(19, -1, -1)), walk
    assert sizes == [3 * 4224] * 3 + [4224], sizes
    assert listed == [4224] + [2 * 4224] * 4 + [4224], listed


def _check_state_travels():
    x = torch.randn(6, 8)
    m_live, live = FakeManager(), _mlp()
    red = tribucket.fused_bucketing(live, manager=m_live, bucket_cap_mb=0.0005)
    red.register_comm_hook(None, tribucket.hooks.fp16_compress_hook)
    for _ in range(3):
        live(x).square().mean().backward()
    load_live, save_live = m_live.fns[tribucket.ft.STATE_KEY]
    state = save_live()
    # a fresh replica group loads it before its first backward
    m_new, fresh = FakeManager(), _mlp()
    red2 = tribucket.fused_bucketing(fresh, manager=m_new, bucket_cap_mb=0.0005)
    red2.register_comm_hook(None, tribucket.hooks.fp16_compress_hook)
    m_new.fns[tribucket.ft.STATE_KEY][0](state)
    assert red2.state_dict() == state
    # a live one (after backward) checks it and keeps going
    load_live(state)
    live(x).square().mean().backward()
    # another hook is refused, naming the field
    m_other, other = FakeManager(), _mlp()
    red3 = tribucket.fused_bucketing(other, manager=m_other, bucket_cap_mb=0.0005)
    try:
        m_other.fns[tribucket.ft.STATE_KEY][0](state)
        raise AssertionError("loading an fp16-hook state into a default-hook reducer passed")
    except ValueError as e:
        assert "fp16_compress_hook" in str(e)
    for r in (red, red2, red3):
        r.close()
    # a second reducer on the same manager takes over the registered functions
    red4 = tribucket.fused_bucketing(live, manager=m_live, bucket_cap_mb=0.0005)
    assert m_live.fns[tribucket.ft.STATE_KEY][1]()["iterations"] == 0
    red4.close()
    return True


def test_reducer_state_travels_with_the_manager(dist_run):
    assert dist_run(_check_state_travels, world_size=1) == [True]


def _refusals():
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
    from tribucket._tags import mark_expert_parallel

    msgs = {}

    def refused(key, fn, exc=ValueError):
        try:
            fn()
        except exc as e:
            msgs[key] = str(e)
            return
        raise AssertionError(f"{key} was not refused")

    m = FakeManager()
    refused("shard", lambda: tribucket.fused_bucketing(_mlp(), manager=m, shard_optimizer=True))
    refused("chunk", lambda: tribucket.fused_bucketing(_mlp(), manager=m, comm_chunk_mb=1))
    refused("auto", lambda: tribucket.fused_bucketing(_mlp(), manager=m, bucket_cap_mb="auto"))
    refused("auto config", lambda: tribucket.fused_bucketing(  # the same, given as config=
        _mlp(), manager=m, config=tribucket.ReducerConfig(bucket_cap_mb="auto")))
    refused("skip", lambda: tribucket.fused_bucketing(
        _mlp(), manager=m, find_unused_parameters=True, skip_all_reduce_unused_params=True))
    refused("not a manager", lambda: tribucket.fused_bucketing(_mlp(), manager=object()),
            TypeError)
    emb = nn.Sequential(nn.Embedding(10, 4, sparse=True))
    refused("sparse", lambda: tribucket.fused_bucketing(emb, manager=m))
    ep = _mlp()
    mark_expert_parallel(ep[0].weight)
    refused("moe", lambda: tribucket.fused_bucketing(ep, manager=m))
    with tribucket.fused_bucketing(_mlp(), manager=m) as red:
        state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=1)
        refused("powersgd", lambda: red.register_comm_hook(state, ps.powerSGD_hook))
        # torch's fp16 hook is accepted and runs as tribucket's fused one
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as d
        red.register_comm_hook(None, d.fp16_compress_hook)
        assert red._comm.traits.wire_dtype == torch.float16
    return msgs


def test_refused_at_entry_with_the_reason(dist_run):
    msgs = dist_run(_refusals, world_size=1)[0]
    assert "shard_optimizer" in msgs["shard"]
    assert "comm_chunk_mb" in msgs["chunk"]
    assert "bucket_cap_mb='auto'" in msgs["auto"] and "bucket_cap_mb='auto'" in msgs["auto config"]
    assert "skip_all_reduce_unused_params" in msgs["skip"]
    assert "torchft.Manager" in msgs["not a manager"]
    assert "sparse" in msgs["sparse"]
    assert "expert-parallel" in msgs["moe"]
    assert "PowerSGD" in msgs["powersgd"] and "bypass" in msgs["powersgd"]


def _two_ranks_refused():
    try:
        tribucket.fused_bucketing(_mlp(), manager=FakeManager())
    except ValueError as e:
        return "one process per replica group" in str(e)
    return False


def test_replica_group_of_two_ranks_refused(dist_run):
    assert dist_run(_two_ranks_refused, world_size=2) == [True, True]


def _settled_at_exit():
    """A reducer on a manager left attached, settled as the exit handler settles it."""
    model = _mlp()
    red = tribucket.fused_bucketing(model, manager=FakeManager())
    model(torch.randn(4, 8)).square().mean().backward()
    error = None
    try:
        red._settle_at_exit()  # what tribucket._exit.settle() calls (and whose errors it hides)
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    hooks = len(model._forward_pre_hooks) + len(model._forward_hooks)
    return error, red._bw.closed, hooks


def test_the_exit_handler_detaches_a_reducer_on_a_manager(dist_run):
    # before, ManagedReducer._close did not take at_exit=: the handler's call raised a
    # TypeError it swallows, and the reducer stayed attached through the interpreter's exit
    error, closed, hooks = dist_run(_settled_at_exit, world_size=1)[0]
    assert error is None and closed and hooks == 0, (error, closed, hooks)


class _PairManager(FakeManager):
    """Each rank of a two-rank gloo pool as a replica group of its own: ``allreduce`` sums
    across the pool (as the manager's reconfigured group does), ``report_error`` /
    ``should_commit`` as torchft's (an error reported in the step makes this group's
    ``should_commit()`` False)."""

    def __init__(self, participating: bool = True):
        super().__init__(dist.get_world_size())
        self.participating = participating

    def is_participating(self):  # noqa: D102 - (overrides FakeManager's)
        return self.participating

    def allreduce(self, tensor, should_quantize=False, reduce_op=dist.ReduceOp.AVG):
        self.calls.append((tensor.dtype, tensor.numel(), str(reduce_op)))
        if not self.participating:  # a group that heals in this step sends zeros (torchft)
            tensor.zero_()
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True)


def _one_group_fails_and_catches():
    """Rank 1's backward raises (a hook on the last gradient) and it catches the error,
    calls ``reducer.backward_failed()`` and skips the step, as docs/reliability.md's loop
    does: ``(should_commit() on this rank, the reported errors)``."""
    rank = dist.get_rank()
    model, manager = _mlp(), _PairManager()
    with tribucket.fused_bucketing(model, manager=manager, process_group=_groups()) as red:
        model(torch.randn(6, 8)).square().mean().backward()  # a step both complete
        assert manager.should_commit()
        model.zero_grad()
        if rank == 1:
            model[0].weight.register_hook(lambda g: 1 / 0)
        try:
            model(torch.randn(6, 8)).square().mean().backward()
        except ZeroDivisionError:
            red.backward_failed()
    return manager.should_commit(), manager.errors


def test_a_group_that_catches_a_failed_backward_drops_the_step_everywhere(dist_run):
    # before, the survivor committed the step with the failed group's missing gradients
    # counted as zeros: the status of a pass stayed inside a replica group
    (commit0, errors0), (commit1, errors1) = dist_run(_one_group_fails_and_catches,
                                                      world_size=2, timeout=60)
    assert not commit0 and "another replica group" in errors0[0], errors0
    assert not commit1 and "raised on this replica group" in errors1[0], errors1


def _branch_used_by_one_group(find_unused: bool):
    """``find_unused_parameters``: a branch only rank 1's forward uses. Each rank's gradients
    of every parameter (None where it has none) and torch DDP's on the same pool."""
    rank = dist.get_rank()
    ours, ref = _Branchy(), _Branchy()
    ddp = nn.parallel.DistributedDataParallel(ref, find_unused_parameters=find_unused)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(rank))
    with tribucket.fused_bucketing(ours, manager=_PairManager(), process_group=_groups(),
                                   find_unused_parameters=find_unused):
        ours(x, rank == 1).square().mean().backward()
    ddp(x, rank == 1).square().mean().backward()
    return ([None if p.grad is None else p.grad for p in ours.parameters()],
            [None if p.grad is None else p.grad for p in ref.parameters()])


def test_unused_parameters_are_agreed_across_replica_groups(dist_run):
    # before, each group kept its own used set: rank 0 left the branch's gradients None
    # while rank 1 set them, so the groups' optimizers diverged
    for ours, ddp in dist_run(_branch_used_by_one_group, True, world_size=2, timeout=60):
        for g, w in zip(ours, ddp):
            assert (g is None) == (w is None) and (g is None or torch.allclose(g, w)), (g, w)


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x, use_b=True):
        return self.a(x) + (self.b(x) if use_b else 0)


def _groups():
    """Each rank's own process group (each rank is a replica group)."""
    return (dist.new_group([0]), dist.new_group([1]))[dist.get_rank()]


def _healing_group_uses_a_branch():
    """``find_unused_parameters``: rank 1 heals in this step (it sends zeros, torchft's
    asynchronous quorum) and its forward alone uses branch ``b``. Each rank's gradients."""
    rank = dist.get_rank()
    model = _Branchy()
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(rank))
    with tribucket.fused_bucketing(model, manager=_PairManager(participating=rank == 0),
                                   process_group=_groups(), find_unused_parameters=True):
        model(x, use_b=rank == 1).square().mean().backward()
    return [None if p.grad is None else p.grad for p in model.parameters()]


def test_a_healing_group_ends_its_step_with_the_live_groups_gradients(dist_run):
    # before, the healer's used map was zeroed with its buffer, so b counted as unused
    # everywhere, and the healer kept its own local gradient of b (the live group: None);
    # after loading the live group's state it stepped with it, and the groups diverged
    ours, healer = dist_run(_healing_group_uses_a_branch, world_size=2, timeout=60)
    for g, h in zip(ours, healer):
        assert (g is None) == (h is None) and (g is None or torch.equal(g, h)), (g, h)
    assert ours[2] is None and ours[0] is not None


def _own_misuse_raises():
    """Rank 1's forward leaves a parameter without a gradient (no find_unused_parameters):
    its backward raises; ``(raised, should_commit())`` on each rank."""
    rank = dist.get_rank()
    model, manager = _Branchy(), _PairManager()
    raised = None
    with tribucket.fused_bucketing(model, manager=manager, process_group=_groups()):
        try:
            model(torch.randn(6, 8), use_b=rank == 0).square().mean().backward()
        except RuntimeError as e:
            raised = str(e)
    return raised, manager.should_commit()


def test_a_group_that_raises_its_own_misuse_commits_nothing(dist_run):
    # before, the group that raised left its manager's should_commit() True: a loop that
    # caught the error and stepped committed its own local gradients
    (raised0, commit0), (raised1, commit1) = dist_run(_own_misuse_raises, world_size=2,
                                                      timeout=60)
    assert raised0 is None and not commit0
    assert "b.weight" in raised1 and not commit1, raised1


def _fails_in_an_accumulation_window(find_unused: bool):
    """Two micro-batches a step, the first under no_sync: rank 1's first raises, caught,
    ``backward_failed()``, and rank 1 gives up the step (docs' loop). Rank 0 runs both.
    ``(should_commit(), the reported errors)``."""
    rank = dist.get_rank()
    model, manager = _mlp(), _PairManager()
    with tribucket.fused_bucketing(model, manager=manager, process_group=_groups(),
                                   find_unused_parameters=find_unused) as red:
        if rank == 1:
            model[0].weight.register_hook(lambda g: 1 / 0)
        for micro in range(2):
            try:
                with red.no_sync() if micro == 0 else contextlib.nullcontext():
                    model(torch.randn(6, 8)).square().mean().backward()
            except ZeroDivisionError:
                red.backward_failed()
                break
    return manager.should_commit(), manager.errors


@pytest.mark.parametrize("find_unused", [False, True], ids=["all_used", "find_unused"])
def test_a_failure_in_an_accumulation_window_drops_the_step_everywhere(dist_run, find_unused):
    # before, backward_failed() in a no_sync pass sent nothing: rank 0's synchronised pass
    # waited for rank 1 (the test's timeout), and with torchft the failed group's next
    # quorum timed out. (With find_unused_parameters the pass it then sent reported no
    # problem, as its status left before the failure was counted: rank 0 committed.)
    (commit0, errors0), (commit1, errors1) = dist_run(_fails_in_an_accumulation_window,
                                                      find_unused, world_size=2, timeout=60)
    assert not commit0 and "another replica group" in errors0[0], errors0
    assert not commit1 and errors1, errors1


def _refused_options():
    msgs = {}
    for key, make in (("static", lambda: tribucket.fused_bucketing(
                          _mlp(), manager=FakeManager(), static_graph=True)),
                      ("complex", lambda: tribucket.fused_bucketing(
                          nn.Linear(4, 4, dtype=torch.complex64), manager=FakeManager()))):
        try:
            make().close()
        except ValueError as e:
            msgs[key] = str(e)
    return msgs


def test_static_graph_and_complex_parameters_are_refused_with_a_manager(dist_run):
    # before, static_graph froze a used set learned from a pass a healing group zeroed, and a
    # complex parameter crashed the first backward (the pack cannot scale complex values)
    msgs = dist_run(_refused_options, world_size=1)[0]
    assert "static_graph" in msgs.get("static", "") and "find_unused_parameters" in msgs["static"]
    assert "complex" in msgs.get("complex", ""), msgs


def _misuse_found_after_the_status_left():
    """``find_unused_parameters``: rank 0's loss adds a term built before the forward from
    ``b``, which the forward leaves unused; its gradient arrives after the bucket (and the
    status in its tail) left. ``(raised, should_commit())`` on each rank."""
    rank = dist.get_rank()
    model, manager = _Branchy(), _PairManager()
    raised = None
    with tribucket.fused_bucketing(model, manager=manager, process_group=_groups(),
                                   find_unused_parameters=True):
        reg = model.b.weight.square().sum() if rank == 0 else 0
        try:
            (model(torch.randn(6, 8), use_b=False).square().mean() + reg).backward()
        except RuntimeError as e:
            raised = str(e)
    return raised, manager.should_commit()


def test_misuse_found_after_the_status_left_commits_nothing_on_that_group(dist_run):
    # before, the error raised on that group only, without reporting it to its manager: a
    # loop that caught it and stepped committed its local gradients
    (raised0, commit0), _ = dist_run(_misuse_found_after_the_status_left, world_size=2,
                                     timeout=60)
    assert raised0 and "b.weight" in raised0 and not commit0, (raised0, commit0)


def _scaler_through_a_dropped_step():
    """tribucket.amp.GradScaler with a manager (growth every step): step 0 commits on both
    ranks; in step 1 rank 1's backward raises and it gives the step up (no scaler.step, no
    update, as the docs' loop), rank 0 runs scaler.step (the optimizer steps only if
    should_commit(), as torchft.Optimizer) and update(). Each rank's (scale, growth)."""
    rank = dist.get_rank()
    model, manager = _mlp(), _PairManager()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step_if_committed = opt.step
    opt.step = lambda *a, **k: step_if_committed(*a, **k) if manager.should_commit() else None
    scaler = tribucket.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
    with tribucket.fused_bucketing(model, manager=manager, process_group=_groups()) as red:
        for step in range(2):
            if step == 1 and rank == 1:
                model[0].weight.register_hook(lambda g: 1 / 0)
            try:
                scaler.scale(model(torch.randn(6, 8)).square().mean()).backward()
            except ZeroDivisionError:
                red.backward_failed()
                continue
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    return scaler.get_scale(), scaler._get_growth_tracker()


def test_a_dropped_step_leaves_the_loss_scale_alike_on_every_group(dist_run):
    # before, the group that ran the dropped step grew its scale (2**10) while the one that
    # gave the step up kept 2**9: their losses were then scaled differently and summed
    (scale0, growth0), (scale1, growth1) = dist_run(_scaler_through_a_dropped_step,
                                                    world_size=2, timeout=60)
    assert (scale0, growth0) == (scale1, growth1) == (2.0**9, 0), (scale0, scale1)
