"""Helpers the step benchmarks share: spawn gloo ranks on this host, time variants
round-robin, plot medians as bars."""

from __future__ import annotations

import json
import pathlib
import socket
import time
from typing import Callable

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(worker: Callable, args: tuple, world: int, out: pathlib.Path,
          extra: tuple = ()) -> dict:
    """Run ``worker(rank, world, port, *args, str(out), *extra)`` on ``world`` ranks; rank 0
    writes its figures to ``out`` as JSON, returned here."""
    mp.spawn(worker, args=(world, free_port(), *args, str(out), *extra), nprocs=world)
    data = json.loads(out.read_text())
    out.unlink()
    return data


def spawn_measure(worker, tmp: pathlib.Path, model_name: str, rounds: int, warmup: int,
                  world: int = 2, *extra) -> dict:
    """:func:`spawn` for the step benchmarks' workers
    (``worker(rank, world, port, model_name, rounds, warmup, out_path, *extra)``)."""
    return spawn(worker, (model_name, rounds, warmup), world, tmp, extra)


def bar_plot(results: list[dict], variants: list[str], colors: list[str], title: str,
             path: pathlib.Path) -> None:
    """One panel per model: the median step time of each variant (``title`` formats with
    ``model``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4))
    if len(results) == 1:
        axes = [axes]
    for ax, res in zip(axes, results):
        ax.bar(range(len(variants)), [res["median_s"][v] * 1e3 for v in variants],
               color=colors)
        ax.set_xticks(range(len(variants)), variants, rotation=30, ha="right")
        ax.set_ylabel("step time, ms (median)")
        ax.set_title(title.format(model=res["model"]))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def close_worker(reducers) -> None:
    """End of a worker: detach the reducers, then leave the process group together."""
    import torch.distributed as dist

    for reducer in reducers:
        if reducer is not None:
            reducer.close()
    dist.barrier()
    dist.destroy_process_group()


def init_worker(rank: int, world: int, port: int, backend: str = "gloo"):
    """Start of a worker: one intra-op thread, join the ``backend`` group on ``port``;
    returns the rank's device (``cuda:<rank>`` with nccl, else the CPU)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    return device


def turn_order(names: list, round_index: int) -> list:
    """The order of the variants in round ``round_index``: every other round reversed, so
    each has the same mean position in a round (a step's time depends on what ran just
    before it: in a fixed order the first variant measured 1-3% slower than the same code
    later in the round)."""
    return names[::-1] if round_index % 2 else names


def round_robin(run: Callable[[str], None], names: list[str], rounds: int,
                warmup: int) -> dict[str, list[float]]:
    """Seconds per step of each variant: one step of each per round (so drift in machine
    load hits all alike), every step starting together on every rank, every other round in
    reverse order, so that each variant's mean position in a round is the same (a step's
    time can depend on which variant ran before it)."""
    times: dict[str, list[float]] = {k: [] for k in names}
    for it in range(warmup + rounds):
        for name in turn_order(names, it):
            dist.barrier()
            t0 = time.perf_counter()
            run(name)
            dt = time.perf_counter() - t0
            if it >= warmup:
                times[name].append(dt)
    return times
