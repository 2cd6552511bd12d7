"""``make demo``: train a small Mixture-of-Experts language model with tribucket, then with
torch DDP on the same data, and compare the two.

Run it with ``make demo``, ``python -m tribucket.demo`` or ``tribucket-demo``: started as a
plain process it launches itself under ``torchrun --standalone --nproc-per-node N``; started
by ``torchrun`` (one node or many) it is one rank of the job::

    make demo ARGS="--steps 300 --hook fp16 --nproc 3"
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint host:29500 \\
        -m tribucket.demo --backend nccl

The model is a character-level transformer whose feed-forward blocks alternate between a
dense MLP and a :class:`tribucket.moe.MoELayer` (experts spread over the ranks). tribucket
averages the dense gradients with :func:`tribucket.fused_bucketing` (and the chosen comm
hook); expert gradients stay expert-parallel, scaled by ``1 / world`` so they are means over
ranks as in DDP. The baseline, torch DDP, holds every expert on every rank and routes
identically, so with the default hook the two runs end with the same parameters up to fp32
rounding. :func:`run_demo` is the whole comparison inside an initialised process group
(the tests call it on a pool of gloo workers); :func:`main` is the command line.

Shape legend: B sequences per rank, S sequence length, D model dim, V vocabulary,
T tokens (B·S), E experts (global), K experts per token.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import fused_bucketing, hooks
from .moe import MoELayer
from .moe.layer import SCHEDULES

__all__ = ["DemoConfig", "HOOKS", "build_model", "main", "parse_args", "run_demo"]

#: comm hooks the demo can put on tribucket's reducer ("none": the default allreduce)
HOOKS = ("none", "fp16", "bf16", "powersgd", "gossip")
BACKENDS = ("auto", "gloo", "nccl")
#: largest |tribucket - DDP| parameter difference accepted with the default hook. Both runs
#: compute the same sums in different orders (an expert's weight gradient: one matmul over
#: every rank's rows vs per-rank matmuls summed by the allreduce), so they differ by fp32
#: rounding only: measured 2.4e-7 after the default 120 steps (2 and 3 ranks), about one ulp
#: of the largest parameters (embeddings near 4); 1e-5 leaves a margin for other sizes and seeds.
PARAM_TOLERANCE = 1e-5
#: largest |tribucket - DDP| difference of the per-step training loss (mean over ranks) accepted
#: while both runs route every token alike: measured 5e-7 (fp32 losses near 2 to 4)
LOSS_TOLERANCE = 1e-5
#: the built-in text (sonnets, public domain)
DEFAULT_TEXT = Path(__file__).with_name("data") / "sonnets.txt"


@dataclass(frozen=True)
class DemoConfig:
    """Options of the demo; every field is a command-line option (``--d-model`` ...)."""

    #: optimizer steps of each training run (tribucket, then DDP)
    steps: int = 120
    #: processes per node when the demo launches torchrun itself (torchrun's --nproc-per-node)
    nproc: int = 2
    #: process-group backend: "auto" is nccl when CUDA is available, else gloo
    backend: str = "auto"
    #: model width
    d_model: int = 64
    #: attention heads (must divide d_model)
    heads: int = 4
    #: transformer blocks; the feed-forward of every second block (1, 3, ...) is an MoE
    layers: int = 4
    #: experts each rank holds in each MoE layer (E = world_size · experts_per_rank)
    experts_per_rank: int = 2
    #: experts per token
    top_k: int = 2
    #: hidden width of the dense MLPs and of each expert
    ffn_hidden: int = 128
    #: characters per training sequence
    seq_len: int = 64
    #: sequences per rank per step
    batch_size: int = 16
    #: AdamW peak learning rate (linear warm-up over the first 5% of steps, cosine to 10%)
    lr: float = 3e-3
    #: comm hook on tribucket's reducer; the DDP baseline always uses its default allreduce
    hook: str = "none"
    #: MoE token exchange: "alltoall", or FasterMoE's pipelined "pairwise" schedule
    schedule: str = "alltoall"
    #: seed of the weights and of every rank's batches (the same in both runs)
    seed: int = 0
    #: weight of the MoE load-balancing loss
    aux_loss_coef: float = 0.01
    #: validation batches per rank evaluated after each run
    eval_batches: int = 4
    #: training text (UTF-8); None: the built-in sonnets
    text: str | None = None
    #: figures and JSON go to <out_dir>/<timestamp>/; None writes nothing
    out_dir: str | None = "runs"
    #: intra-op threads per process on CPU. 1 by default: with other work on the machine,
    #: OpenMP threads that spin-wait for a busy core made every step 20-40x slower here
    threads: int = 1
    #: run torch DDP after tribucket and compare (False: tribucket only)
    compare: bool = True

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")

        for name in ("steps", "nproc", "d_model", "heads", "layers", "experts_per_rank", "top_k",
                     "ffn_hidden", "seq_len", "batch_size", "eval_batches", "threads"):
            positive(name)
        if self.d_model % self.heads:
            raise ValueError(f"--d-model {self.d_model} is not divisible by --heads {self.heads}: "
                             f"pick a head count that divides it (e.g. --heads "
                             f"{math.gcd(self.d_model, self.heads)})")
        if self.hook not in HOOKS:
            raise ValueError(f"--hook {self.hook!r} is not one of {', '.join(HOOKS)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--schedule {self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend {self.backend!r} is not one of {', '.join(BACKENDS)}")
        for name in ("lr", "aux_loss_coef"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {v!r}")
        if self.lr == 0:
            raise ValueError("--lr must be positive, got 0")
        if self.text is not None and not os.path.isfile(self.text):
            raise ValueError(f"--text {self.text!r} is not a file: pass a UTF-8 text file, or "
                             "leave --text out for the built-in sonnets")

    def num_experts(self, world_size: int) -> int:
        return world_size * self.experts_per_rank


# ----------------------------------------------------------------------------- data
class CharData:
    """A text as character ids, split 90/10 into train/validation; batches by seed."""

    def __init__(self, text: str, seq_len: int):
        self.chars = sorted(set(text))
        stoi = {c: i for i, c in enumerate(self.chars)}
        ids = torch.tensor([stoi[c] for c in text], dtype=torch.long)
        split = int(0.9 * len(ids))
        self.train, self.val = ids[:split], ids[split:]
        self.seq_len = seq_len
        if len(self.val) < seq_len + 2:
            raise ValueError(f"the text has {len(text)} characters: its 10% validation split "
                             f"({len(self.val)}) is shorter than --seq-len {seq_len} + 2; use a "
                             "longer --text or a smaller --seq-len")

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def batch(self, split: str, seed: int, rank: int, step: int, batch_size: int,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x_BS, y_BS)``: the same sequences for the same (seed, rank, step) in every run."""
        data = self.train if split == "train" else self.val
        g = torch.Generator().manual_seed(
            (seed * 1_000_003 + rank * 7919 + step) * 2 + (split != "train"))
        starts = torch.randint(0, len(data) - self.seq_len - 1, (batch_size,), generator=g)
        x_BS = torch.stack([data[s:s + self.seq_len] for s in starts.tolist()])
        y_BS = torch.stack([data[s + 1:s + 1 + self.seq_len] for s in starts.tolist()])
        return x_BS.to(device), y_BS.to(device)


def load_text(path: str | None) -> str:
    return Path(path or DEFAULT_TEXT).read_text(encoding="utf-8")


# ----------------------------------------------------------------------------- model
class FFN(nn.Module):
    """``[..., D] -> [..., D]``: Linear, GELU, Linear (a dense block or one expert)."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(d_model, hidden)
        self.fc2 = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.heads = heads
        # no bias: a key bias gets a gradient that is exactly zero in exact arithmetic (softmax
        # ignores a shift shared by every key), i.e. pure rounding noise, which AdamW would
        # turn into full-size steps that differ between any two summation orders
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, D = x_BSD.shape
        q, k, v = (t.view(B, S, self.heads, D // self.heads).transpose(1, 2)
                   for t in self.qkv(x_BSD).split(D, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(B, S, D))


class Block(nn.Module):
    """Pre-norm transformer block; ``ffn`` is a dense :class:`FFN` or an MoE layer."""

    def __init__(self, d_model: int, heads: int, ffn: nn.Module):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.ffn = ffn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class AllExpertsMoE(nn.Module):
    """The DDP baseline's MoE: every expert on this rank, gate math identical to MoELayer.

    Same parameter names as :class:`MoELayer` (``router.weight``, ``experts.<global
    index>.*``), so the two models' ``state_dict`` keys line up. Each expert runs on the
    tokens routed to it (possibly none: it still joins the graph, so DDP sees a zero
    gradient, as tribucket's experts get one).
    """

    def __init__(self, experts: Sequence[nn.Module], router: nn.Linear, top_k: int,
                 aux_loss_coef: float):
        super().__init__()
        self.router = router
        self.experts = nn.ModuleDict({str(e): m for e, m in enumerate(experts)})
        self.num_experts = len(experts)
        self.top_k = top_k
        self.aux_loss_coef = aux_loss_coef
        self.aux_loss: torch.Tensor | None = None
        #: [E] this rank's token-slots per expert in the last forward (MoELayer's
        #: ``stats.tokens_per_expert``), kept as a tensor until it is read
        self.counts_E: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        D = x.shape[-1]
        x_TD = x.reshape(-1, D)
        probs_TE = torch.softmax(self.router(x_TD).float(), dim=-1)
        weights_TK, ids_TK = torch.topk(probs_TE, self.top_k, dim=-1)
        if self.top_k > 1:  # MoELayer's default; k = 1 is Switch-style y = p · expert(x)
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        y_TD = torch.zeros_like(x_TD)
        for e, expert in enumerate(self.experts.values()):
            t_idx, k_idx = torch.nonzero(ids_TK == e, as_tuple=True)
            out = expert(x_TD[t_idx])
            y_TD = y_TD.index_add(0, t_idx, (weights_TK[t_idx, k_idx, None] * out).to(x.dtype))
        T = x_TD.shape[0]
        self.counts_E = torch.bincount(ids_TK.reshape(-1), minlength=self.num_experts)
        f_E = self.counts_E.float() / (T * self.top_k)
        self.aux_loss = self.aux_loss_coef * self.num_experts * torch.dot(f_E, probs_TE.mean(dim=0))
        return y_TD.view(x.shape)


class CharTransformer(nn.Module):
    """Character LM: embeddings, blocks whose FFNs alternate dense / MoE, a linear head."""

    def __init__(self, vocab_size: int, seq_len: int, d_model: int, blocks: Sequence[Block]):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(blocks)
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, idx_BS: torch.Tensor) -> torch.Tensor:
        pos_S = torch.arange(idx_BS.shape[1], device=idx_BS.device)
        x = self.tok(idx_BS) + self.pos(pos_S)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def aux_loss(self) -> torch.Tensor | float:
        """Sum of the MoE layers' load-balancing losses from the last forward."""
        return sum(b.ffn.aux_loss for b in self.blocks if hasattr(b.ffn, "aux_loss"))

    def routing(self) -> tuple:
        """Per MoE layer, this rank's token-slots per expert in the last forward."""
        return tuple(tuple(b.ffn.stats.tokens_per_expert) if isinstance(b.ffn, MoELayer)
                     else tuple(b.ffn.counts_E.tolist())
                     for b in self.blocks if hasattr(b.ffn, "aux_loss"))


def _seeded(seed: int, *path: int) -> None:
    """Seed the RNG for one module, so its weights do not depend on what was built before."""
    s = seed
    for p in path:
        s = s * 1_000_003 + p + 1
    torch.manual_seed(s % (2**63))


def build_model(cfg: DemoConfig, vocab_size: int, *, expert_parallel: bool,
                device: torch.device) -> CharTransformer:
    """The demo's model; ``expert_parallel`` picks MoELayer (this rank's experts) or
    :class:`AllExpertsMoE` (every expert). Both get the same weights from ``cfg.seed``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    E, L = cfg.num_experts(world), cfg.experts_per_rank
    blocks = []
    for i in range(cfg.layers):
        _seeded(cfg.seed, i, 0)
        attn_block = Block(cfg.d_model, cfg.heads, nn.Identity())
        if i % 2 == 0:
            _seeded(cfg.seed, i, 1)
            ffn: nn.Module = FFN(cfg.d_model, cfg.ffn_hidden)
        else:
            _seeded(cfg.seed, i, 2)
            router = nn.Linear(cfg.d_model, E, bias=False).to(device)
            owned = range(rank * L, rank * L + L) if expert_parallel else range(E)
            experts = []
            for e in owned:
                _seeded(cfg.seed, i, 3, e)
                experts.append(FFN(cfg.d_model, cfg.ffn_hidden).to(device))
            if expert_parallel:
                ffn = MoELayer(experts, E, cfg.d_model, top_k=cfg.top_k, router=router,
                               expert_grad_scale=1.0 / world, aux_loss_coef=cfg.aux_loss_coef,
                               schedule=cfg.schedule)
            else:
                ffn = AllExpertsMoE(experts, router, cfg.top_k, cfg.aux_loss_coef)
        attn_block.ffn = ffn
        blocks.append(attn_block)
    _seeded(cfg.seed, cfg.layers, 0)
    return CharTransformer(vocab_size, cfg.seq_len, cfg.d_model, blocks).to(device)


# ----------------------------------------------------------------------------- training
@dataclass
class RunResult:
    """One training run, as seen from this rank (``_gather`` turns it into global figures)."""

    name: str
    losses: list = None            # per step: training loss (task + aux), this rank
    step_s: list = None            # per step: forward + backward + optimizer seconds
    comm_exposed_s: list = None    # per step: reducer.stats.comm_exposed_s (tribucket only)
    bytes_per_step: int = 0        # gradient bytes handed to allreduce per step (one rank)
    val_loss: float = float("nan")
    state: dict = None             # final parameters (name -> tensor, on CPU)
    routing: list = None           # per step: CharTransformer.routing() (token counts)


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


def _train(cfg: DemoConfig, impl: str, data: CharData, device: torch.device,
           progress: bool) -> RunResult:
    """Train one model from scratch; ``impl`` is "tribucket" or "ddp"."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(cfg, data.vocab_size, expert_parallel=impl == "tribucket", device=device)
    # eps=1e-6 rather than 1e-8: a gradient element that is ~0 up to rounding (differently
    # rounded in the two runs) then moves its weight by ~g/eps·lr, not by a full ±lr step
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-6,
                            weight_decay=0.01)
    res = RunResult(impl, [], [], [], routing=[])
    tokens = world * cfg.batch_size * cfg.seq_len
    bar = _progress_bar(cfg.steps, f"{impl:>9}", enabled=progress and rank == 0)

    with contextlib.ExitStack() as stack:
        stack.callback(bar.close)
        reducer = None
        if impl == "tribucket":
            reducer = stack.enter_context(fused_bucketing(model))
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
            opt.zero_grad(set_to_none=True)
            _sync(device)
            dt = time.perf_counter() - t0
            res.losses.append(loss.item())
            res.step_s.append(dt)
            comm = reducer.stats.comm_exposed_s if reducer is not None else float("nan")
            res.comm_exposed_s.append(comm)
            res.routing.append(model.routing())
            post = {"loss": f"{res.losses[-1]:.3f}", "tok/s": f"{tokens / dt:,.0f}"}
            if reducer is not None:
                post["comm exposed"] = f"{comm * 1e3:.1f}ms"
            bar.set_postfix(post, refresh=False)
            bar.update()
        if reducer is not None:
            res.bytes_per_step = reducer.stats.bytes_communicated
        else:  # DDP allreduces every parameter's gradient, in the parameters' dtype
            res.bytes_per_step = sum(p.numel() * p.element_size() for p in model.parameters())
        res.val_loss = _evaluate(cfg, forward, model, data, device)
    res.state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return res


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
        "val_loss": res.val_loss,
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
        n = _first_routing_difference(runs["tribucket"].routing, runs["ddp"].routing, device)
        result["routing_differs_from"] = n
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
    if (result["routing_differs_from"] is not None
            and result["loss_diff_same_routing"] <= LOSS_TOLERANCE):
        return "routing"
    return "bug"


def _first_routing_difference(a: list, b: list, device: torch.device) -> int | None:
    """First step (1-based) at which some rank's tokens per expert differ between the two
    runs, or None when every routing decision led to the same counts."""
    steps = len(a)
    mine = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), steps)
    t = torch.tensor([mine], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    first = int(t.item())
    return None if first == steps else first + 1


def _count_parameters(state: dict, world: int) -> dict:
    dense = sum(v.numel() for k, v in state.items() if ".experts." not in k)
    local = sum(v.numel() for k, v in state.items() if ".experts." in k)
    return {"dense": dense, "experts_per_rank": local, "total": dense + local * world}


# ----------------------------------------------------------------------------- output
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


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return str(n)


def format_table(result: dict) -> str:
    """The comparison table printed at the end of the demo."""
    cfg = result["config"]
    names = [n for n in ("tribucket", "ddp") if n in result]
    heads = {"tribucket": f"tribucket (hook: {cfg['hook']})", "ddp": "torch DDP"}
    tok = result["tokens_per_step"]

    def cell(name: str, row: str) -> str:
        r = result[name]
        if row == "step":
            return f"{r['median_step_s'] * 1e3:,.1f} ms"
        if row == "tok":
            return f"{tok / r['median_step_s']:,.0f}"
        if row == "comm":
            c = r["median_comm_exposed_s"]
            return "-" if c is None else f"{c * 1e3:,.2f} ms"
        if row == "bytes":
            return _fmt_bytes(r["bytes_per_step"])
        if row == "first":
            return f"{r['losses'][0]:.4f}"
        if row == "final":
            return f"{r['losses'][-1]:.4f}"
        return f"{r['val_loss']:.4f}"

    rows = [("step time (median)", "step"), ("tokens/s (all ranks)", "tok"),
            ("comm exposed after backward", "comm"), ("gradient bytes allreduced/step", "bytes"),
            ("first loss", "first"), ("final loss", "final"), ("validation loss", "val")]
    table = [[""] + [heads[n] for n in names]] + [[label] + [cell(n, key) for n in names]
                                                   for label, key in rows]
    w = [max(len(r[c]) for r in table) for c in range(len(table[0]))]
    lines = []
    for k, r in enumerate(table):
        lines.append("  ".join([r[0].ljust(w[0])] + [r[c].rjust(w[c]) for c in range(1, len(r))]))
        if k == 0:
            lines.append("-" * len(lines[0]))
    if "param_diff" in result:
        d = result["param_diff"]
        verdict = ("agree to fp32 tolerance" if result["agree"] else "DIFFER")
        lines.append(f"max |param difference| tribucket vs DDP: {d['max_abs_diff']:.2e} (dense "
                     f"{d['dense']:.2e}, experts {d['experts']:.2e}; tolerance "
                     f"{result['tolerance']:.0e}): {verdict}")
        n = result["routing_differs_from"]
        lines.append(f"MoE routing (tokens per expert, every rank, layer and step): "
                     f"{'identical' if n is None else f'differs from step {n} on'}")
        verdict = result["verdict"]
        if verdict == "hook":
            lines.append(f"  (expected: the '{cfg['hook']}' hook changes the averaging; only "
                         "--hook none computes DDP's result)")
        elif verdict == "routing":
            lines.append(f"  (expected: at step {n} a token's router probabilities for two "
                         "experts were within fp32 rounding of each other\n   and the two runs "
                         "broke the tie differently, so they trained on different routings "
                         "from there;\n   before it their losses agreed to "
                         f"{result['loss_diff_same_routing']:.1e} at every step)")
        elif verdict == "bug":
            lines.append(f"  (the losses differed by {result['loss_diff_same_routing']:.1e} while "
                         "both runs routed alike: a bug; please report it with this output)")
    return "\n".join(lines)


def _write_outputs(result: dict) -> str:
    """Rank 0: ``<out_dir>/<timestamp>/`` with loss and step-time figures (PNG + JSON)."""
    base = Path(result["config"]["out_dir"])
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = base / stamp
    k = 1
    while out.exists():
        k += 1
        out = base / f"{stamp}-{k}"
    out.mkdir(parents=True)
    names = [n for n in ("tribucket", "ddp") if n in result]
    loss = {"steps": list(range(1, result["config"]["steps"] + 1)),
            **{n: result[n]["losses"] for n in names},
            "validation": {n: result[n]["val_loss"] for n in names}}
    steps = {"tokens_per_step": result["tokens_per_step"],
             **{n: {"step_s": result[n]["step_s"], "median_step_s": result[n]["median_step_s"],
                    "comm_exposed_s": result[n]["comm_exposed_s"]} for n in names}}
    (out / "loss.json").write_text(json.dumps(loss, indent=1))
    (out / "step_time.json").write_text(json.dumps(steps, indent=1))
    summary = {k: v for k, v in result.items() if k not in names}
    summary.update({n: {k: v for k, v in result[n].items() if k not in ("losses", "step_s",
                                                                        "comm_exposed_s")}
                    for n in names})
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "table.txt").write_text(format_table(result) + "\n")
    try:
        _plot(result, names, out)
    except ImportError:
        print("matplotlib is not installed: wrote the JSON figures only "
              "(pip install 'tribucket[perf]' for the PNGs)", file=sys.stderr)
    return str(out)


def _plot(result: dict, names: list, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = result["config"]
    labels = {"tribucket": f"tribucket (hook {cfg['hook']})", "ddp": "torch DDP"}
    styles = {"tribucket": dict(color="C0", lw=2.2), "ddp": dict(color="C3", lw=1.0, ls="--")}
    title = (f"{result['world_size']} ranks ({result['backend']}), {result['parameters']['total']:,} "
             f"parameters, E={cfg['experts_per_rank'] * result['world_size']} k={cfg['top_k']}")

    fig, ax = plt.subplots(figsize=(7, 4))
    for n in names:
        ax.plot(range(1, len(result[n]["losses"]) + 1), result[n]["losses"], label=labels[n],
                **styles[n])
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over ranks)")
    subtitle = ""
    if "param_diff" in result:
        subtitle = (f"\nmax |param difference| tribucket vs DDP after {cfg['steps']} steps: "
                    f"{result['param_diff']['max_abs_diff']:.1e}")
    ax.set_title(f"Character MoE transformer: {title}{subtitle}", fontsize=9)
    if result.get("routing_differs_from"):
        ax.axvline(result["routing_differs_from"], color="gray", lw=0.8, ls=":")
        ax.text(result["routing_differs_from"], ax.get_ylim()[0], " routing differs from here",
                fontsize=7, va="bottom", color="gray")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=120)
    plt.close(fig)

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [3, 1]})
    for n in names:
        a1.plot(range(1, len(result[n]["step_s"]) + 1), [s * 1e3 for s in result[n]["step_s"]],
                label=labels[n], **{**styles[n], "lw": 1.0})
    a1.set_xlabel("step")
    a1.set_ylabel("step time, slowest rank (ms)")
    a1.set_title(title, fontsize=9)
    a1.grid(alpha=0.3)
    a1.legend()
    med = [result[n]["median_step_s"] * 1e3 for n in names]
    a2.bar([labels[n].split(" (")[0] for n in names], med,
           color=[styles[n]["color"] for n in names])
    for i, m in enumerate(med):
        a2.text(i, m, f"{m:.1f}", ha="center", va="bottom")
    a2.set_ylabel("median step time (ms)")
    fig.tight_layout()
    fig.savefig(out / "step_time.png", dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- CLI
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
                   help="hidden width of MLPs and experts (%(default)s)")
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
    except ValueError as e:
        p.error(str(e))
        raise  # unreachable: p.error exits
    return cfg


def _check_world(cfg: DemoConfig, world: int) -> None:
    if cfg.top_k > cfg.num_experts(world):
        raise ValueError(f"--top-k {cfg.top_k} exceeds the {cfg.num_experts(world)} experts of "
                         f"{world} rank(s) x --experts-per-rank {cfg.experts_per_rank}: lower "
                         "--top-k or raise --experts-per-rank")


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
                  f"d_model {cfg.d_model}, {cfg.num_experts(world)} experts "
                  f"({cfg.experts_per_rank} per rank), top-{cfg.top_k}; {cfg.steps} steps of "
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


if __name__ == "__main__":
    main()
