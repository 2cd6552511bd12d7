"""Helpers the step benchmarks share: run a worker on 2 gloo ranks, plot medians as bars."""

from __future__ import annotations

import json
import pathlib
import socket

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_measure(worker, tmp: pathlib.Path, model_name: str, rounds: int, warmup: int,
                  world: int = 2, *extra) -> dict:
    """Run ``worker(rank, world, port, model_name, rounds, warmup, out_path, *extra)`` on
    ``world`` processes; rank 0 writes its JSON result to ``tmp``, returned here."""
    mp.spawn(worker, args=(world, free_port(), model_name, rounds, warmup, str(tmp), *extra),
             nprocs=world)
    data = json.loads(tmp.read_text())
    tmp.unlink()
    return data


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
