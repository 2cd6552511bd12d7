"""Elastic restarts with torchrun alone: a checkpoint every k steps, resume after a crash.

No torchft here: when a rank dies the whole job stops, ``torchrun --max-restarts N`` starts
every rank again, and each one resumes from the last complete checkpoint. A crash costs the
steps since that checkpoint plus the restart, and nothing else: the data of step s depends
only on (rank, s), so the resumed run sees the same batches in the same order, and its final
model equals an uninterrupted run's bit for bit (gloo on CPU)::

    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1   # a fresh rendezvous store per attempt
    torchrun --standalone --nproc-per-node 2 --max-restarts 1 examples/elastic_train.py \\
        --ckpt-dir /tmp/elastic --steps 40 --ckpt-every 10

    # to see a crash: rank 1 SIGKILLs itself in the backward of step 25, once (the marker
    # file keeps the restarted attempt from doing it again); the job resumes from step 20
    torchrun --standalone --nproc-per-node 2 --max-restarts 1 examples/elastic_train.py \\
        --ckpt-dir /tmp/elastic2 --steps 40 --ckpt-every 10 --kill-at 25

What is saved, with ``torch.distributed.checkpoint`` (DCP) into ``<ckpt-dir>/step_<n>``:
the model, the optimizer (momentum) and the reducer's ``state_dict()`` (its bucket layout,
iteration count and comm-hook state: a stateful hook such as PowerSGD needs its error
feedback back to resume exactly; at 3 or more ranks the default hook's averages depend on
the bucket layout too, and loading it keeps the resumed reducer's layout and counters the
run's). DCP writes
``.metadata`` last, once every rank has written its part, so a directory without it is a
checkpoint the crash interrupted and is skipped.

With ``--async-save`` each checkpoint is written in the background
(``torch.distributed.checkpoint.async_save``): the step waits only while the state is copied
aside, then trains on while a thread writes it, coordinating the ranks over a gloo group of
its own (the training collectives keep the default group to themselves). The next checkpoint
first waits for the last write to finish, and so does the end of the run. A crash during a
write leaves that directory without ``.metadata``: the restart resumes from the one before,
so it may lose up to twice ``--ckpt-every`` steps instead of once.

Options: ``--steps``, ``--ckpt-every``, ``--async-save``, ``--kill-at K`` (rank
``--kill-rank``, default 1), ``--final FILE`` (rank 0 writes the final parameters),
``--events FILE`` (one JSON line per event and rank, for tests/test_elastic.py and
perf/bench_ft.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import tribucket

IN, HID, OUT, BATCH = 32, 64, 8, 16


def build_model() -> nn.Module:
    torch.manual_seed(0)  # the same initial model on every rank and every attempt
    return nn.Sequential(nn.Linear(IN, HID), nn.Tanh(), nn.Linear(HID, HID), nn.Tanh(),
                         nn.Linear(HID, OUT))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of step ``step``: a function of (rank, step) only, so a resumed run
    sees the data an uninterrupted one would (with a DataLoader: a sampler that can start
    at a given step)."""
    g = torch.Generator().manual_seed(100_003 * rank + step)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def last_checkpoint(ckpt_dir: str) -> int:
    """The step of the newest complete checkpoint in ``ckpt_dir``, 0 if none."""
    done = [int(d[len("step_"):]) for d in os.listdir(ckpt_dir)
            if d.startswith("step_") and os.path.exists(os.path.join(ckpt_dir, d, ".metadata"))]
    return max(done, default=0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--async-save", action="store_true")
    ap.add_argument("--kill-at", type=int, default=-1)
    ap.add_argument("--kill-rank", type=int, default=1)
    ap.add_argument("--final", default="")
    ap.add_argument("--events", default="")
    args = ap.parse_args()

    torch.set_num_threads(1)
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) and \
            os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's c10d rendezvous shares its store with the workers and keeps it across
        # restarts, keys of the failed attempt included: a restarted rank may then read its
        # peer's address of the attempt before and fail to connect (seen here 2 times in 3)
        raise RuntimeError("run torchrun --max-restarts with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
                           "in its environment, so that each attempt gets a fresh store")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # background writes coordinate over a group of their own (every rank creates it)
    ckpt_group = dist.new_group(backend="gloo") if args.async_save else None
    writing = None  # the background write in flight
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    log = open(args.events, "a", buffering=1) if args.events else None

    def emit(**rec) -> None:
        if log is not None:
            log.write(json.dumps(dict(t=time.time(), rank=rank, attempt=attempt, **rec)) + "\n")

    emit(event="start")
    os.makedirs(args.ckpt_dir, exist_ok=True)
    model = build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.MSELoss()

    with tribucket.fused_bucketing(model) as reducer:
        start = last_checkpoint(args.ckpt_dir)
        dist.barrier()  # every rank saw the same newest checkpoint before any writes another
        if start:
            # DCP loads in place into state dicts of the right shape: the model's, the
            # optimizer's (get_state_dict creates its momentum buffers) and a fresh reducer's
            model_sd, opt_sd = get_state_dict(model, opt)
            state = {"model": model_sd, "opt": opt_sd, "reducer": reducer.state_dict()}
            dcp.load(state, checkpoint_id=os.path.join(args.ckpt_dir, f"step_{start}"))
            set_state_dict(model, opt, model_state_dict=state["model"],
                           optim_state_dict=state["opt"])
            reducer.load_state_dict(state["reducer"])  # before the first backward
        emit(event="resumed", step=start)

        for step in range(start, args.steps):
            x, y = batch(rank, step)
            loss = loss_fn(model(x), y)
            if step == args.kill_at and rank == args.kill_rank:
                marker = os.path.join(args.ckpt_dir, f"killed_{step}")
                if not os.path.exists(marker):  # once: not in the restarted attempt
                    open(marker, "w").close()

                    def die(grad):  # in backward, after the first bucket may have left
                        emit(event="kill", step=step)
                        os.kill(os.getpid(), signal.SIGKILL)
                    list(model.parameters())[0].register_hook(die)
            loss.backward()
            opt.step()
            opt.zero_grad()
            emit(event="step", step=step)
            if (step + 1) % args.ckpt_every == 0:
                t0 = time.perf_counter()
                model_sd, opt_sd = get_state_dict(model, opt)
                state = {"model": model_sd, "opt": opt_sd, "reducer": reducer.state_dict()}
                path = os.path.join(args.ckpt_dir, f"step_{step + 1}")
                if args.async_save:
                    if writing is not None:
                        writing.result()  # one write at a time
                    # returns once the state is copied aside; a thread writes it
                    writing = dcp.async_save(state, checkpoint_id=path, process_group=ckpt_group)
                else:
                    dcp.save(state, checkpoint_id=path)
                emit(event="checkpoint", step=step + 1, seconds=time.perf_counter() - t0)
        if writing is not None:
            writing.result()  # the last checkpoint is complete before the run ends

    if args.final and rank == 0:
        torch.save([p.detach().clone() for p in model.parameters()], args.final)
    emit(event="done", step=args.steps)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
