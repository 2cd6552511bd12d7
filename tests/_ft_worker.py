"""One replica group (one process) of a torchft run, for tests/test_ft.py and perf/bench_ft.py.

Launched by :mod:`_ft_harness` with the environment of a replica group (``MASTER_ADDR``,
``MASTER_PORT``, ``REPLICA_GROUP_ID``, ``TORCHFT_LIGHTHOUSE``); trains a small MLP with
SGD + momentum on batches that depend only on (replica group, step), through tribucket's
reducer with a ``torchft.Manager`` (``--impl tribucket``) or ``torchft.DistributedDataParallel``
(``--impl torchft``), and writes one JSON line per step to ``--log`` and, after every
committed step, the flat parameters of every committed step so far to ``--params``.

``--die-at K``: SIGKILL itself in step K: in its backward (``--die-in backward``, the
default: after the first bucket's gradient hook, so a collective of the step may be in
flight) or in its optimizer step (``--die-in step``: after ``should_commit()`` said yes,
before the parameters change). ``--die-in caught``: the backward of step K raises instead,
once, and the loop catches it, calls ``reducer.backward_failed()`` and goes on without an
optimizer step (docs/reliability.md's loop).

``--impl plain``: no torchft at all, the control case: ``fused_bucketing(model, timeout=...)``
on one gloo group of ``WORLD_SIZE`` processes (``RANK`` = the replica id), so a killed peer
makes the others raise (the error goes to the log as an ``error`` record).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

IN, HID, OUT, BATCH = 32, 64, 8, 16


def build_model(width: int = HID, depth: int = 2) -> nn.Module:
    torch.manual_seed(0)
    layers, d = [], IN
    for _ in range(depth):
        layers += [nn.Linear(d, width), nn.Tanh()]
        d = width
    layers.append(nn.Linear(d, OUT))
    return nn.Sequential(*layers)


def batch(replica: int, step: int, width_in: int = IN) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100_003 * replica + step)
    return torch.randn(BATCH, width_in, generator=g), torch.randn(BATCH, OUT, generator=g)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=["tribucket", "torchft", "plain"], default="tribucket")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--hook", choices=["none", "fp16", "bf16"], default="none")
    ap.add_argument("--clip", type=float, default=0.0)
    ap.add_argument("--die-at", type=int, default=-1)
    ap.add_argument("--die-in", choices=["backward", "step", "caught"], default="backward")
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds between steps")
    ap.add_argument("--width", type=int, default=HID)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--log", required=True)
    ap.add_argument("--params", default="")
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--go", default="", help="wait for this file before the first step")
    ap.add_argument("--async-quorum", type=int, default=0,
                    help="1: torchft's default asynchronous quorum (heal before the step)")
    ap.add_argument("--stop-file", default="",
                    help="once this file exists, stop at the step number written in it")
    args = ap.parse_args()

    torch.set_num_threads(1)
    import tribucket

    replica = int(os.environ["REPLICA_GROUP_ID"])
    log = open(args.log, "a", buffering=1)

    def emit(**rec) -> None:
        log.write(json.dumps(dict(t=time.time(), replica=replica, **rec)) + "\n")

    if args.impl == "plain":
        return plain_main(args, replica, emit)
    import torchft

    dist.init_process_group("gloo", rank=0, world_size=1)
    model = build_model(args.width, args.depth)
    opt = make_optimizer(model)

    def load_state(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])

    def save_state() -> dict:
        return {"model": model.state_dict(), "opt": opt.state_dict()}

    timeout = datetime.timedelta(seconds=args.timeout)
    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=timeout), min_replica_size=1,
        load_state_dict=load_state, state_dict=save_state, replica_id=f"replica_{replica}",
        use_async_quorum=bool(args.async_quorum), timeout=timeout, quorum_timeout=timeout,
        connect_timeout=timeout)
    if args.impl == "tribucket":
        reducer = tribucket.fused_bucketing(model, manager=manager)
        if args.hook != "none":
            reducer.register_comm_hook(None, getattr(tribucket.hooks,
                                                     f"{args.hook}_compress_hook"))
        net = model
    else:
        reducer = None
        net = torchft.DistributedDataParallel(manager, model)
    optim = torchft.Optimizer(manager, opt)
    emit(event="start", pid=os.getpid())
    if args.go:  # start together: the first quorum then holds every replica group
        while not os.path.exists(args.go):
            time.sleep(0.02)
    committed: dict[int, torch.Tensor] = {}
    loss_fn = nn.MSELoss()
    target, armed = args.steps, False
    while manager.current_step() < target:
        t0 = time.perf_counter()
        before = manager.current_step()
        optim.zero_grad()  # start_quorum: a recovering replica group heals here
        if args.async_quorum:
            manager.wait_quorum()  # (for the log: the step count a recovery brings)
        step = manager.current_step()
        healed = step != before  # the step count came with the peer's state
        x, y = batch(replica, step, IN)
        loss = loss_fn(net(x), y)
        if step == args.die_at and not armed:  # (once: a dropped step is redone)
            armed = True
            arm_kill(model, opt, args.die_in, step, emit)
        try:
            loss.backward()
        except RuntimeError as e:
            if args.die_in != "caught":
                raise
            emit(event="caught", step=step, message=str(e))
            reducer.backward_failed()
            continue
        norm = None
        if args.clip:
            clip = tribucket.clip_grad_norm_ if reducer is not None else \
                torch.nn.utils.clip_grad_norm_
            norm = float(clip(model.parameters(), args.clip))
        optim.step()  # steps only if manager.should_commit()
        ok = manager.current_step() == step + 1
        if ok:
            committed[step + 1] = flat_params(model)
            if args.params:
                torch.save(committed, args.params + ".tmp")
                os.replace(args.params + ".tmp", args.params)
        emit(event="step", step=step, committed=ok, participants=manager.num_participants(),
             loss=float(loss), norm=norm, healed=healed, seconds=time.perf_counter() - t0,
             found_inf=float(reducer.found_inf) if reducer is not None else None,
             iterations=reducer.stats.iterations if reducer is not None else None,
             layout=reducer.layout.to_tensor().tolist() if reducer is not None else None)
        if args.sleep:
            time.sleep(args.sleep)
        if args.stop_file and os.path.exists(args.stop_file):
            with open(args.stop_file) as f:
                text = f.read().strip()
            if text:
                target = min(target, int(text))
    emit(event="done", step=manager.current_step())
    if reducer is not None:
        reducer.close()
    manager.shutdown(wait=False)
    log.close()
    os._exit(0)  # skip interpreter shutdown: torchft's threads and gloo works die with us


def arm_kill(model: nn.Module, opt: torch.optim.Optimizer, where: str, step: int,
             emit) -> None:
    """SIGKILL this process in the backward (the last gradient) or in the optimizer step of
    this step; or raise in the backward, once (``caught``)."""
    def die(*_):
        emit(event="kill", step=step, where=where)
        os.kill(os.getpid(), signal.SIGKILL)

    def fail(*_):
        handle.remove()
        emit(event="kill", step=step, where=where)
        raise RuntimeError("injected error in backward")
    if where == "caught":
        handle = list(model.parameters())[0].register_hook(fail)
    elif where == "backward":
        list(model.parameters())[0].register_hook(die)  # the last gradient of backward
    else:
        opt.register_step_pre_hook(die)


def plain_main(args, rank: int, emit) -> None:
    """The control case: one gloo group of WORLD_SIZE processes, no manager."""
    import tribucket

    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    model = build_model(args.width, args.depth)
    opt = make_optimizer(model)
    reducer = tribucket.fused_bucketing(model, timeout=datetime.timedelta(seconds=args.timeout))
    emit(event="start", pid=os.getpid())
    while args.go and not os.path.exists(args.go):
        time.sleep(0.02)
    loss_fn = nn.MSELoss()
    for step in range(args.steps):
        try:
            opt.zero_grad()
            x, y = batch(rank, step, IN)
            loss = loss_fn(model(x), y)
            if step == args.die_at:
                arm_kill(model, opt, args.die_in, step, emit)
            loss.backward()
            opt.step()
        except Exception as e:  # noqa: BLE001 - the point of the control case
            emit(event="error", step=step, type=type(e).__name__, message=str(e))
            raise
        emit(event="step", step=step, committed=True, participants=dist.get_world_size(),
             loss=float(loss))
        if args.sleep:
            time.sleep(args.sleep)
    reducer.close()
    emit(event="done", step=args.steps)
    os._exit(0)  # the log is line-buffered: every record is written


if __name__ == "__main__":
    sys.exit(main())
