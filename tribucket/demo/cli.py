"""The command line (:func:`main`): parse the options; started as a plain process, relaunch
under ``torchrun --standalone``; started by torchrun, set up this rank's device and process
group, run the demo and print the table on rank 0."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from ..moe.layer import SCHEDULES, SCORE_FUNCS
from .compare import run_demo
from .config import BACKENDS, HOOKS, DemoConfig, _check_world
from .model import check_text_length, load_text
from .report import format_table


def _parser() -> argparse.ArgumentParser:
    d = DemoConfig()
    p = argparse.ArgumentParser(
        prog="tribucket-demo",
        description="Train a small MoE character transformer with tribucket, then with torch "
                    "DDP on the same data, and compare. Started as a plain process it launches "
                    "itself with torchrun --standalone; started by torchrun it is one rank.")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps of each run (%(default)s)")
    p.add_argument("--nproc", type=int, default=d.nproc,
                   help="processes (ranks) on this machine (%(default)s)")
    p.add_argument("--backend", default=d.backend, choices=BACKENDS,
                   help="auto: nccl with CUDA, else gloo (%(default)s)")
    p.add_argument("--d-model", type=int, default=d.d_model, help="model width (%(default)s)")
    p.add_argument("--heads", type=int, default=d.heads, help="attention heads (%(default)s)")
    p.add_argument("--layers", type=int, default=d.layers,
                   help="transformer blocks; every second FFN is an MoE (%(default)s)")
    p.add_argument("--experts-per-rank", type=int, default=d.experts_per_rank,
                   help="experts per rank in each MoE layer (%(default)s)")
    p.add_argument("--top-k", type=int, default=d.top_k, help="experts per token (%(default)s)")
    p.add_argument("--ffn-hidden", type=int, default=d.ffn_hidden,
                   help="hidden width of the dense MLPs (%(default)s)")
    p.add_argument("--expert-hidden", type=int, default=d.expert_hidden,
                   help="hidden width of each SwiGLU expert (%(default)s)")
    p.add_argument("--shared-experts", type=int, default=d.shared_experts,
                   help="shared experts every token passes through (%(default)s)")
    p.add_argument("--score-func", default=d.score_func, choices=SCORE_FUNCS,
                   help="router scores (%(default)s)")
    p.add_argument("--bias-update-rate", type=float, default=d.bias_update_rate,
                   help="aux-loss-free balancing step, 0 for none (%(default)s)")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="characters per sequence (%(default)s)")
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help="sequences per rank per step (%(default)s)")
    p.add_argument("--lr", type=float, default=d.lr, help="AdamW peak learning rate (%(default)s)")
    p.add_argument("--hook", default=d.hook, choices=HOOKS,
                   help="comm hook on tribucket's reducer (%(default)s)")
    p.add_argument("--schedule", default=d.schedule, choices=SCHEDULES,
                   help="MoE token exchange (%(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="weights and batches (%(default)s)")
    p.add_argument("--aux-loss-coef", type=float, default=d.aux_loss_coef,
                   help="MoE load-balancing loss weight (%(default)s)")
    p.add_argument("--eval-batches", type=int, default=d.eval_batches,
                   help="validation batches per rank (%(default)s)")
    p.add_argument("--text", default=None, help="UTF-8 training text (default: built-in sonnets)")
    p.add_argument("--out-dir", default=d.out_dir,
                   help="figures go to OUT_DIR/<timestamp>/ (%(default)s); '' writes nothing")
    p.add_argument("--threads", type=int, default=d.threads,
                   help="intra-op threads per process on CPU (%(default)s; more pay only on an "
                        "idle machine with cores to spare)")
    p.add_argument("--no-ddp", dest="compare", action="store_false",
                   help="skip the DDP baseline and the comparison")
    return p


def parse_args(argv: Sequence[str] | None = None) -> DemoConfig:
    """Command line -> :class:`DemoConfig`; bad values exit with a usage message (code 2)."""
    p = _parser()
    ns = p.parse_args(argv)
    values = vars(ns)
    values["out_dir"] = values["out_dir"] or None
    try:
        cfg = DemoConfig(**{f.name: values[f.name] for f in fields(DemoConfig)})
        if not _under_torchrun():  # the demo launches --nproc ranks: the world size is known
            _check_world(cfg, cfg.nproc)
            if cfg.backend == "nccl" and not torch.cuda.is_available():
                raise ValueError("--backend nccl needs CUDA GPUs and none is visible: use "
                                 "--backend gloo (or auto) on CPU")
            # (the text decides the data: refused here, before torchrun starts the ranks)
            check_text_length(len(load_text(cfg.text)), cfg.seq_len)
    except ValueError as e:
        p.error(str(e))
        raise  # unreachable: p.error exits
    return cfg


def _under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


def config_argv(cfg: DemoConfig) -> list[str]:
    """``cfg`` as demo options in full spelling (``--nproc`` left out: torchrun takes it).

    The relaunched command passes these rather than the user's own words, so abbreviations
    never reach torchrun's parser (which would read ``--nproc`` as ambiguous with its own
    ``--nproc-per-node``).
    """
    args: list[str] = []
    for f in fields(DemoConfig):
        v = getattr(cfg, f.name)
        if f.name == "nproc" or v == f.default:
            continue
        if f.name == "compare":
            args.append("--no-ddp")
        else:
            args += [f"--{f.name.replace('_', '-')}", "" if v is None else str(v)]
    return args


def torchrun_command(cfg: DemoConfig) -> list[str]:
    """The command the demo re-runs itself with: torchrun next to this Python, standalone."""
    torchrun = Path(sys.executable).with_name("torchrun")
    launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    return launcher + ["--standalone", "--nproc-per-node", str(cfg.nproc),
                       "-m", "tribucket.demo", *config_argv(cfg)]


def _launch(cfg: DemoConfig) -> int:
    cmd = torchrun_command(cfg)
    shown = [os.path.relpath(cmd[0]) if cmd[0].startswith(os.getcwd() + os.sep) else cmd[0],
             *cmd[1:]]
    print("launching:", " ".join(shown), flush=True)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # the demo sets its threads itself (--threads)
    if hasattr(os, "execve"):
        os.execve(cmd[0], cmd, env)  # torchrun takes over this process (signals included)
    import subprocess  # pragma: no cover - platforms without exec

    return subprocess.call(cmd, env=env)


def _worker(cfg: DemoConfig) -> int:
    """One rank under torchrun: set up the device and group, run, report on rank 0."""
    local_rank = int(os.environ["LOCAL_RANK"])
    backend = cfg.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            print("error: --backend nccl needs CUDA GPUs and none is visible; use --backend gloo "
                  "on CPU", file=sys.stderr)
            return 2
        if local_rank >= torch.cuda.device_count():
            print(f"error: LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPU(s): "
                  "start at most one process per GPU (--nproc)", file=sys.stderr)
            return 2
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(cfg.threads)
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        if rank == 0:
            moe = ", ".join(str(i) for i in range(1, cfg.layers, 2)) or "none"
            print(f"tribucket demo: {world} rank(s), backend {backend} on {device.type}, "
                  f"{torch.get_num_threads()} thread(s) per rank; hook {cfg.hook}, schedule "
                  f"{cfg.schedule}\nmodel: {cfg.layers} blocks (MoE FFN in block(s) {moe}), "
                  f"d_model {cfg.d_model}, {cfg.num_experts(world)} SwiGLU experts of width "
                  f"{cfg.expert_hidden} ({cfg.experts_per_rank} per rank), top-{cfg.top_k} by "
                  f"{cfg.score_func}, {cfg.shared_experts} shared expert(s), routing bias "
                  f"{cfg.bias_update_rate or 'off'}; {cfg.steps} steps of "
                  f"{world * cfg.batch_size * cfg.seq_len:,} tokens", flush=True)
        try:
            result = run_demo(cfg, progress=True, device=device)
        except (NotImplementedError, ValueError) as e:  # alike on every rank, before any collective
            if rank == 0:
                print(f"error: {e}", file=sys.stderr)
            return 2
        if rank == 0:
            print()
            print(format_table(result))
            if result["out_dir"]:
                print(f"\nloss curves, step times (PNG + JSON): {result['out_dir']}/")
                if os.path.exists(os.path.join(result["out_dir"], "trace.json")):
                    print(f"tribucket's per-bucket timeline: {result['out_dir']}/timeline.png "
                          f"(python -m tribucket.trace {result['out_dir']}/trace.json)")
            print(f"{'both runs' if cfg.compare else 'training'}: {result['wall_s']:.1f} s")
        # rank 0 alone reports a mismatch that is a bug in its exit code: a rank that
        # exits non-zero makes torchrun stop the others, and rank 0 must print first
        failed = rank == 0 and cfg.compare and result["verdict"] == "bug"
        return 1 if failed else 0
    finally:
        dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> None:
    cfg = parse_args(argv)
    sys.exit(_worker(cfg) if _under_torchrun() else _launch(cfg))
