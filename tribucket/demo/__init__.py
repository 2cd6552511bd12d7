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

The package, by responsibility: ``config`` (:class:`DemoConfig`, the option checks),
``model`` (the text as batches, the transformer), ``train`` (one training run),
``compare`` (:func:`run_demo`: both runs and their comparison), ``report`` (the table,
figures and JSON), ``cli`` (:func:`main`: options, torchrun relaunch, one rank's set-up);
``__main__`` makes ``python -m tribucket.demo`` run :func:`main`.
"""

from __future__ import annotations

# The names tribucket.demo had as one module (tests, users and the console script import
# them from here); __all__ stays what it was.
from .cli import config_argv, main, parse_args, torchrun_command  # noqa: F401
from .compare import LOSS_TOLERANCE, PARAM_TOLERANCE, TIE_TOLERANCE, _verdict, run_demo  # noqa: F401
from .config import BACKENDS, HOOKS, DemoConfig  # noqa: F401
from .model import (  # noqa: F401
    DEFAULT_TEXT,
    FFN,
    AllExpertsMoE,
    Block,
    CausalSelfAttention,
    CharData,
    CharTransformer,
    build_model,
    load_text,
)
from .report import format_table  # noqa: F401
from .train import RunResult  # noqa: F401

__all__ = ["DemoConfig", "HOOKS", "build_model", "main", "parse_args", "run_demo"]
