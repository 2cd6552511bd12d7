"""What the step benchmarks share: spawn gloo ranks on this host, time variants round-robin."""

from __future__ import annotations

import json
import pathlib
import socket
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_rank(rank: int, world: int, port: int) -> None:
    """One intra-op thread, a gloo group over TCP on this host."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)


def spawn(worker: Callable, args: tuple, world: int, out: pathlib.Path) -> dict:
    """Run ``worker(rank, world, port, *args, str(out))`` on ``world`` ranks; rank 0 writes
    its figures to ``out`` as JSON, returned here."""
    mp.spawn(worker, args=(world, free_port(), *args, str(out)), nprocs=world)
    data = json.loads(out.read_text())
    out.unlink()
    return data


def round_robin(run: Callable[[str], None], names: list[str], rounds: int,
                warmup: int) -> dict[str, list[float]]:
    """Seconds per step of each variant: one step of each per round (so drift in machine
    load hits all alike), every step starting together on every rank."""
    times: dict[str, list[float]] = {k: [] for k in names}
    for it in range(warmup + rounds):
        for name in names:
            dist.barrier()
            t0 = time.perf_counter()
            run(name)
            dt = time.perf_counter() - t0
            if it >= warmup:
                times[name].append(dt)
    return times
