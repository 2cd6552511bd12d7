"""The comparison: :func:`run_demo` trains with tribucket, then with DDP, and turns the two
runs into global figures (every rank alike) and a verdict on whether they agree."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist

from .config import DemoConfig, _check_world
from .model import CharData, load_text
from .report import _write_outputs
from .train import RunResult, _train

#: largest |tribucket - DDP| parameter difference accepted with the default hook. Both runs
#: compute the same sums in different orders (an expert's weight gradient: one matmul over
#: every rank's rows vs per-rank matmuls summed by the allreduce), so they differ by fp32
#: rounding only: measured 2.4e-7 after the default 120 steps (2 and 3 ranks), about one ulp
#: of the largest parameters (embeddings near 4); 1e-5 leaves a margin for other sizes and seeds.
PARAM_TOLERANCE = 1e-5
#: largest |tribucket - DDP| difference of the per-step training loss (mean over ranks) accepted
#: while both runs route every token alike: measured 5e-7 (fp32 losses near 2 to 4)
LOSS_TOLERANCE = 1e-5
#: largest top-k margin (the k-th best selection score minus the (k+1)-th) of a token that the
#: two runs routed differently, for that to count as a near-tie broken by rounding: while the
#: runs agree their parameters differ by ~1e-7, which moves a sigmoid or softmax score by
#: ~1e-7 to 1e-6; a token routed differently for any other reason has a margin of ~1e-3 or
#: more (the smallest margin of a thousand tokens of 16 experts is ~1e-5 to 1e-4)
TIE_TOLERANCE = 1e-5


def _gather(res: RunResult, device: torch.device) -> dict:
    """Global figures of a run: loss = mean over ranks, step time = slowest rank."""
    world = dist.get_world_size()
    losses = torch.tensor(res.losses, dtype=torch.float64, device=device)
    dist.all_reduce(losses)
    times = torch.tensor([res.step_s, res.comm_exposed_s], dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    step_s, comm_s = times.cpu().tolist()
    settled = step_s[3:] if len(step_s) > 6 else step_s  # first steps: allocation, rebuild
    settled_comm = comm_s[3:] if len(comm_s) > 6 else comm_s
    median = statistics.median(settled)
    return {
        "losses": (losses / world).cpu().tolist(),
        "step_s": step_s,
        "comm_exposed_s": None if math.isnan(comm_s[0]) else comm_s,
        "median_step_s": median,
        "median_comm_exposed_s": None if math.isnan(comm_s[0]) else statistics.median(settled_comm),
        "bytes_per_step": res.bytes_per_step,
        "expert_param_bytes": res.expert_param_bytes,
        "expert_opt_bytes": res.expert_opt_bytes,
        "val_loss": res.val_loss,
        "native_compiling": res.native_compiling,
    }


def _param_difference(tb: dict, ddp: dict, device: torch.device) -> dict:
    """Largest |tribucket - DDP| over every parameter, across ranks (experts: each rank
    compares the experts it owns with the same global experts of its DDP model)."""
    dense = experts = 0.0
    worst = ("", 0.0)
    for name, p in tb.items():
        if name not in ddp:
            raise RuntimeError(f"tribucket parameter {name} has no DDP counterpart")
        q = ddp[name]
        d = (p.double() - q.double()).abs().max().item() if p.numel() else 0.0
        if ".experts." in name:
            experts = max(experts, d)
        else:
            dense = max(dense, d)
        if d > worst[1]:
            worst = (name, d)
    t = torch.tensor([dense, experts], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {"max_abs_diff": max(t.tolist()), "dense": t[0].item(), "experts": t[1].item(),
            "worst_on_rank0": worst[0] if dist.get_rank() == 0 else None}


def run_demo(cfg: DemoConfig, *, progress: bool = False, device: torch.device | None = None) -> dict:
    """Train with tribucket, then with DDP, compare; call on every rank of the default group.

    Returns the same dict on every rank (figures and the comparison); rank 0 also writes
    ``<out_dir>/<timestamp>/`` when ``cfg.out_dir`` is set (its path is ``result["out_dir"]``).
    """
    if not dist.is_initialized():
        raise RuntimeError("run_demo needs an initialised process group (torchrun, or "
                           "dist.init_process_group); use `python -m tribucket.demo` to launch one")
    rank, world = dist.get_rank(), dist.get_world_size()
    _check_world(cfg, world)  # on every rank alike, before any collective
    if device is None:
        device = torch.device("cpu")
    data = CharData(load_text(cfg.text), cfg.seq_len)
    t0 = time.perf_counter()
    runs = {"tribucket": _train(cfg, "tribucket", data, device, progress)}
    if cfg.compare:
        runs["ddp"] = _train(cfg, "ddp", data, device, progress)
    result: dict[str, Any] = {
        "config": asdict(cfg), "world_size": world, "backend": dist.get_backend(),
        "device": str(device), "vocab_size": data.vocab_size,
        "tokens_per_step": world * cfg.batch_size * cfg.seq_len,
        "parameters": _count_parameters(runs["tribucket"].state, world),
    }
    for name, r in runs.items():
        result[name] = _gather(r, device)
    if cfg.compare:
        diff = _param_difference(runs["tribucket"].state, runs["ddp"].state, device)
        result["param_diff"] = diff
        result["tolerance"] = PARAM_TOLERANCE
        result["agree"] = diff["max_abs_diff"] <= PARAM_TOLERANCE
        n = _first_routing_difference(runs["tribucket"], runs["ddp"], device)
        result["routing_differs_from"] = n
        result["tie_margin"], result["tokens_routed_differently"] = (
            (None, 0) if n is None else _tie_at(runs["tribucket"], runs["ddp"], n, device))
        result["tie_tolerance"] = TIE_TOLERANCE
        result["loss_tolerance"] = LOSS_TOLERANCE
        same = slice(0, cfg.steps if n is None else n - 1)  # steps with the same routing
        result["loss_diff_same_routing"] = max(
            (abs(a - b) for a, b in zip(result["tribucket"]["losses"][same],
                                        result["ddp"]["losses"][same])), default=0.0)
        result["verdict"] = _verdict(cfg, result)
    result["wall_s"] = time.perf_counter() - t0
    result["out_dir"] = _write_outputs(result) if cfg.out_dir and rank == 0 else None
    return result


def _verdict(cfg: DemoConfig, result: dict) -> str:
    """"agree"; "hook" (a lossy hook: a difference is expected); "routing" (the runs agreed
    until a router near-tie fell differently, then legitimately parted); or "bug"."""
    if result["agree"]:
        return "agree"
    if cfg.hook != "none":
        return "hook"
    margin = result.get("tie_margin")  # (None: not measured, as in results of older runs)
    if (result["routing_differs_from"] is not None
            and result["loss_diff_same_routing"] <= LOSS_TOLERANCE
            and (margin is None or margin <= TIE_TOLERANCE)):
        return "routing"
    return "bug"


def _first_routing_difference(a: RunResult, b: RunResult, device: torch.device) -> int | None:
    """First step (1-based) at which some rank routed some token to other experts in the
    two runs (or its tokens per expert differ), or None when every token was routed alike
    at every step."""
    steps = len(a.routing)

    def differs(i: int) -> bool:
        if a.routing[i] != b.routing[i]:
            return True
        return any(not torch.equal(x[0], y[0]) for x, y in zip(a.choices[i], b.choices[i]))

    mine = next((i for i in range(steps) if differs(i)), steps)
    t = torch.tensor([mine], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    first = int(t.item())
    return None if first == steps else first + 1


def _tie_at(a: RunResult, b: RunResult, step: int, device: torch.device) -> tuple[float, int]:
    """``(margin, tokens)`` at ``step`` (1-based), over every rank and MoE layer: the largest
    top-k margin, in either run, of a token the two runs routed to other experts, and how
    many such tokens there were. A margin within rounding of zero says the token's k-th and
    (k+1)-th experts were tied up to fp32 rounding (``inf``: the routing differed in the
    counts only, which no token explains)."""
    worst, tokens = 0.0, 0
    for (ids_a, margin_a), (ids_b, margin_b) in zip(a.choices[step - 1], b.choices[step - 1]):
        moved_T = (ids_a != ids_b).any(dim=1)
        if bool(moved_T.any()):
            tokens += int(moved_T.sum())
            worst = max(worst, float(torch.maximum(margin_a, margin_b)[moved_T].max()))
    if a.routing[step - 1] != b.routing[step - 1] and not tokens:
        worst = math.inf
    t = torch.tensor([worst, tokens], dtype=torch.float64, device=device)
    worst_t = t[:1].clone()
    dist.all_reduce(worst_t, op=dist.ReduceOp.MAX)
    dist.all_reduce(t)
    return float(worst_t.item()), int(t[1].item())


def _count_parameters(state: dict, world: int) -> dict:
    dense = sum(v.numel() for k, v in state.items() if ".experts." not in k)
    local = sum(v.numel() for k, v in state.items() if ".experts." in k)
    return {"dense": dense, "experts_per_rank": local, "total": dense + local * world}
