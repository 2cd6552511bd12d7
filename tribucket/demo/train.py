"""One training run of the demo on this rank (:func:`_train`: tribucket's reducer or torch
DDP), its validation loss, and the progress bar rank 0 shows while it trains."""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import fused_bucketing, hooks
from ..ddp import native
from .config import DemoConfig
from .model import CharData, CharTransformer, build_model


@dataclass
class RunResult:
    """One training run, as seen from this rank (``_gather`` turns it into global figures)."""

    name: str
    losses: list = None            # per step: training loss (task + aux), this rank
    step_s: list = None            # per step: forward + backward + optimizer seconds
    comm_exposed_s: list = None    # per step: reducer.stats.comm_exposed_s (tribucket only)
    bytes_per_step: int = 0        # gradient bytes handed to allreduce per step (one rank)
    expert_param_bytes: int = 0    # bytes of the expert parameters this rank holds
    expert_opt_bytes: int = 0      # bytes of the optimizer state of those parameters
    val_loss: float = float("nan")
    state: dict = None             # final parameters (name -> tensor, on CPU)
    routing: list = None           # per step: CharTransformer.routing() (token counts)
    choices: list = None           # per step: CharTransformer.routing_choices() (ids, margins)
    native_compiling: bool = False  # the native gradient hooks were not built when it began:
                                    # their background build ran beside this run


def _lr_at(cfg: DemoConfig, step: int) -> float:
    warmup = max(1, cfg.steps // 20)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    t = (step - warmup) / max(1, cfg.steps - warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def _register_hook(reducer, cfg: DemoConfig) -> None:
    if cfg.hook == "fp16":
        reducer.register_comm_hook(None, hooks.fp16_compress_hook)
    elif cfg.hook == "bf16":
        reducer.register_comm_hook(None, hooks.bf16_compress_hook)
    elif cfg.hook == "gossip":
        reducer.register_comm_hook(hooks.GossipState(), hooks.gossip_hook)
    elif cfg.hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        # PowerSGD needs two plain iterations first (bucket rebuild, error feedback start)
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                   start_powerSGD_iter=max(2, min(10, cfg.steps // 4)))
        reducer.register_comm_hook(state, psgd.powerSGD_hook)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def trace_file() -> str:
    """The tribucket run's trace, in ``out_dir`` until the report moves it (one name per
    launch: the rendezvous port)."""
    return f".trace-{os.environ.get('MASTER_PORT', 'local')}.json"


def _train(cfg: DemoConfig, impl: str, data: CharData, device: torch.device,
           progress: bool) -> RunResult:
    """Train one model from scratch; ``impl`` is "tribucket" or "ddp"."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(cfg, data.vocab_size, expert_parallel=impl == "tribucket", device=device)
    # eps=1e-6 rather than 1e-8: a gradient element that is ~0 up to rounding (differently
    # rounded in the two runs) then moves its weight by ~g/eps·lr, not by a full ±lr step
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-6,
                            weight_decay=0.01)
    model.watch_routers()
    res = RunResult(impl, [], [], [], routing=[], choices=[])
    tokens = world * cfg.batch_size * cfg.seq_len
    bar = _progress_bar(cfg.steps, f"{impl:>9}", enabled=progress and rank == 0)

    with contextlib.ExitStack() as stack:
        stack.callback(bar.close)
        reducer = None
        if impl == "tribucket":
            pending = not native.ready()  # not built yet (the first run on a machine)
            # the per-bucket timeline of this run (rank 0 writes it when the reducer closes;
            # the report moves it into runs/<timestamp>/ with its picture)
            trace = os.path.join(cfg.out_dir, trace_file()) if cfg.out_dir else False
            reducer = stack.enter_context(fused_bucketing(model, trace=trace))
            _register_hook(reducer, cfg)
            forward: Callable = model
        else:
            forward = nn.parallel.DistributedDataParallel(
                model, device_ids=[device] if device.type == "cuda" else None)
        for step in range(cfg.steps):
            x_BS, y_BS = data.batch("train", cfg.seed, rank, step, cfg.batch_size, device)
            for group in opt.param_groups:
                group["lr"] = _lr_at(cfg, step)
            _sync(device)
            t0 = time.perf_counter()
            logits_BSV = forward(x_BS)
            loss = F.cross_entropy(logits_BSV.reshape(-1, data.vocab_size), y_BS.reshape(-1))
            loss = loss + model.aux_loss()
            loss.backward()
            opt.step()
            model.update_routing_biases()  # aux-loss-free balancing (no-op without the bias)
            opt.zero_grad(set_to_none=True)
            _sync(device)
            dt = time.perf_counter() - t0
            res.losses.append(loss.item())
            res.step_s.append(dt)
            comm = reducer.stats.comm_exposed_s if reducer is not None else float("nan")
            res.comm_exposed_s.append(comm)
            res.routing.append(model.routing())
            res.choices.append(model.routing_choices())
            post = {"loss": f"{res.losses[-1]:.3f}", "tok/s": f"{tokens / dt:,.0f}"}
            if reducer is not None:
                post["comm exposed"] = f"{comm * 1e3:.1f}ms"
            bar.set_postfix(post, refresh=False)
            bar.update()
        if reducer is not None:
            # the background build ran beside this run: it was wanted, pending, and did not fail
            res.native_compiling = (pending and reducer.config.native_hooks is not False
                                    and native.unavailable_reason() is None)
            res.bytes_per_step = reducer.stats.bytes_communicated
        else:  # DDP allreduces every parameter's gradient, in the parameters' dtype
            res.bytes_per_step = sum(p.numel() * p.element_size() for p in model.parameters())
        res.val_loss = _evaluate(cfg, forward, model, data, device)
    res.expert_param_bytes, res.expert_opt_bytes = _expert_memory(model, opt)
    res.state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return res


def _expert_memory(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[int, int]:
    """Bytes of this rank's expert parameters and of their optimizer state (AdamW: both
    moments and the step count), as held after training."""
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    params = sum(p.numel() * p.element_size() for p in experts)
    state = sum(t.numel() * t.element_size() for p in experts
                for t in opt.state.get(p, {}).values() if isinstance(t, torch.Tensor))
    return params, state


@torch.no_grad()
def _evaluate(cfg: DemoConfig, forward: Callable, model: CharTransformer, data: CharData,
              device: torch.device) -> float:
    """Mean validation loss over every rank's ``eval_batches`` batches (a collective)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.zeros(1, dtype=torch.float64, device=device)
    for k in range(cfg.eval_batches):
        x_BS, y_BS = data.batch("val", cfg.seed, rank, k, cfg.batch_size, device)
        logits_BSV = forward(x_BS)
        total += F.cross_entropy(logits_BSV.reshape(-1, data.vocab_size), y_BS.reshape(-1)).double()
    dist.all_reduce(total)
    return total.item() / (world * cfg.eval_batches)


# ----------------------------------------------------------------------------- progress
class _NoBar:
    def set_postfix(self, *a, **k) -> None: ...
    def update(self, n: int = 1) -> None: ...
    def close(self) -> None: ...


class _LineBar(_NoBar):
    """Fallback when tqdm is missing: a line every 10% of the steps."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.n, self.post = total, desc, 0, {}

    def set_postfix(self, post, refresh=False) -> None:
        self.post = post

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n == self.total or self.n % max(1, self.total // 10) == 0:
            extra = ", ".join(f"{k}={v}" for k, v in self.post.items())
            print(f"{self.desc}: {self.n}/{self.total} {extra}", flush=True)


def _progress_bar(total: int, desc: str, enabled: bool):
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _LineBar(total, desc)
    try:  # a terminal that reports 0 columns (some ptys) would make tqdm print nothing
        sized = os.get_terminal_size(sys.stderr.fileno()).columns > 0
    except (OSError, ValueError, AttributeError):
        sized = False
    return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=sized,
                ncols=None if sized else 110, mininterval=0.25)
