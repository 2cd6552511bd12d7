"""Train through lost and restarted replica groups: tribucket's reducer on a torchft Manager.

Each replica group is one process here (gloo on CPU); start a Lighthouse, then one group per
terminal (kill one with Ctrl-C or `kill -9` and start it again: it rejoins and recovers the
model, optimizer and reducer state from a live group, and the others never stop)::

    torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 2000 \\
        --bind 127.0.0.1:29510
    REPLICA_GROUP_ID=0 TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 \\
        torchrun --nproc-per-node 1 --master-port 29600 examples/torchft_train.py
    REPLICA_GROUP_ID=1 TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 \\
        torchrun --nproc-per-node 1 --master-port 29601 examples/torchft_train.py

Options: ``--steps N`` (default 200), ``--fp16`` (fused fp16 compression on the wire).
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist
import torchft
from torch import nn

import tribucket


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--fp16", action="store_true")
    args = ap.parse_args()

    dist.init_process_group("gloo")  # this replica group's own group (here: 1 process)
    replica = int(os.environ.get("REPLICA_GROUP_ID", 0))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    # what a recovering replica group receives from a live one: model and optimizer here;
    # the reducer's own state is registered with the manager by fused_bucketing
    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=datetime.timedelta(seconds=10)),
        min_replica_size=1,
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]),
                                    opt.load_state_dict(sd["opt"])),
        state_dict=lambda: {"model": model.state_dict(), "opt": opt.state_dict()},
        replica_id=f"replica_{replica}",
        timeout=datetime.timedelta(seconds=10))
    optim = torchft.Optimizer(manager, opt)  # zero_grad: quorum; step: only if should_commit()

    with tribucket.fused_bucketing(model, manager=manager) as reducer:
        if args.fp16:
            reducer.register_comm_hook(None, tribucket.hooks.fp16_compress_hook)
        while manager.current_step() < args.steps:
            optim.zero_grad()
            step = manager.current_step()
            g = torch.Generator().manual_seed(1000 * replica + step)  # this group's batch
            x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()              # every bucket averaged over the quorum's groups
            norm = tribucket.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()                 # dropped on every group if a peer failed
            if manager.current_step() % 20 == 0:
                print(f"replica group {replica}: step {manager.current_step()} loss "
                      f"{loss.item():.3f} grad norm {norm.item():.3f} with "
                      f"{manager.num_participants()} group(s)", flush=True)
    manager.shutdown(wait=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
