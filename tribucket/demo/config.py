"""The demo's options: :class:`DemoConfig` (every field a command-line option) and the checks
on their values, including the one that needs the world size (``_check_world``)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ..moe.layer import SCHEDULES, SCORE_FUNCS

#: comm hooks the demo can put on tribucket's reducer ("none": the default allreduce)
HOOKS = ("none", "fp16", "bf16", "powersgd", "gossip")
BACKENDS = ("auto", "gloo", "nccl")


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
    #: experts each rank holds in each MoE layer (E = world_size · experts_per_rank); many
    #: small ("fine-grained") experts, as DeepSeek and Qwen use, run as one grouped matmul
    experts_per_rank: int = 8
    #: experts per token
    top_k: int = 4
    #: hidden width of the dense MLPs
    ffn_hidden: int = 128
    #: hidden width of each (SwiGLU) expert: top_k x expert_hidden = 2 x ffn_hidden, the
    #: active width of a top-2 layer of full-width experts
    expert_hidden: int = 64
    #: shared experts (of expert_hidden each) every token passes through, beside the routed
    #: ones; they run while the tokens travel to the experts
    shared_experts: int = 1
    #: router scores: "sigmoid" (DeepSeek-V3, renormalised over the top-k) or "softmax"
    score_func: str = "sigmoid"
    #: aux-loss-free balancing: the routing bias's step after each optimizer step (0: off)
    bias_update_rate: float = 1e-3
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
    #: weight of the MoE load-balancing loss (0: the routing bias balances alone)
    aux_loss_coef: float = 0.0
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
                     "ffn_hidden", "expert_hidden", "seq_len", "batch_size", "eval_batches",
                     "threads"):
            positive(name)
        if isinstance(self.shared_experts, bool) or not isinstance(self.shared_experts, int) \
                or self.shared_experts < 0:
            raise ValueError(f"--shared-experts must be an integer >= 0, got {self.shared_experts!r}")
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"--score-func {self.score_func!r} is not one of {', '.join(SCORE_FUNCS)}")
        if self.seq_len < 2:
            # one position: attention's query and key weights get only rounding noise as
            # gradient, which AdamW turns into steps: the two runs part for no reason of theirs
            raise ValueError(f"--seq-len must be at least 2 (attention needs two positions), "
                             f"got {self.seq_len}")
        if self.layers < 2:
            raise ValueError(f"--layers must be at least 2 (the MoE is every second block's "
                             f"feed-forward), got {self.layers}")
        if self.d_model % self.heads:
            raise ValueError(f"--d-model {self.d_model} is not divisible by --heads {self.heads}: "
                             f"pick a head count that divides it (e.g. --heads "
                             f"{_nearest_divisor(self.d_model, self.heads)})")
        if self.hook not in HOOKS:
            raise ValueError(f"--hook {self.hook!r} is not one of {', '.join(HOOKS)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--schedule {self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend {self.backend!r} is not one of {', '.join(BACKENDS)}")
        for name in ("lr", "aux_loss_coef", "bias_update_rate"):
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


def _nearest_divisor(n: int, near: int) -> int:
    """The divisor of ``n`` closest to ``near`` (the smaller of two as close)."""
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - near), d))


def _check_world(cfg: DemoConfig, world: int) -> None:
    if cfg.top_k > cfg.num_experts(world):
        raise ValueError(f"--top-k {cfg.top_k} exceeds the {cfg.num_experts(world)} experts of "
                         f"{world} rank(s) x --experts-per-rank {cfg.experts_per_rank}: lower "
                         "--top-k or raise --experts-per-rank")
