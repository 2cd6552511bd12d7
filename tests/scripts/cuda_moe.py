"""The MoE layer on a CUDA device, one NCCL rank, against the dense reference of
``tests/test_moe_modern.py`` (grouped and listed experts, shared experts, sigmoid scores, the
routing bias, group-limited routing). Run by ``tests/test_cuda_moe.py`` in its own process::

    python tests/scripts/cuda_moe.py OUT_DIR

Writes ``OUT_DIR/result.json``: ``{"cases": [...], "failures": [...], "host_syncs": n}``,
``n`` the host's stream synchronisations in one forward+backward of a bf16 layer of grouped
experts (torch.profiler's ``cudaStreamSynchronize`` calls).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from test_moe_modern import _parity_worker  # noqa: E402

#: one rank holds every expert (E = L): the exchange is NCCL's all-to-all with itself
CASES = [
    dict(kind="swiglu", grouped=True, L=6, k=2, shared=1, gate=True, score="sigmoid", bias=True,
         seed=11),
    dict(kind="gelu", grouped=True, L=4, k=2, bias=True, seed=13),
    dict(kind="sequential", L=3, k=1, shared=2, seed=12),
    # DeepSeek-V3's group-limited routing and route scale
    dict(kind="swiglu", grouped=True, L=6, k=2, score="sigmoid", bias=True, groups=3, limited=1,
         scale=2.5, seed=15),
]


def host_syncs_per_step() -> float:
    """``cudaStreamSynchronize`` calls per forward+backward (each stalls the host until the
    GPU has caught up), averaged over 3 profiled steps after 2 unprofiled ones."""
    from torch.profiler import ProfilerActivity, profile

    from tribucket.moe import GroupedExperts, MoELayer

    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    L, D, F, T = 8, 256, 128, 1024
    layer = MoELayer(GroupedExperts(L, D, F, device=dev, dtype=torch.bfloat16), L, D,
                     top_k=2).to(dev)
    x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)

    def step():
        xs = x.clone().requires_grad_()
        layer(xs).float().square().sum().backward()

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
    return sum(e.count for e in prof.key_averages() if e.key == "cudaStreamSynchronize") / 3


def main(out: pathlib.Path) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        cases = [dict(c, device="cuda") for c in CASES]
        failures = _parity_worker(cases)
        syncs = host_syncs_per_step()
    finally:
        dist.destroy_process_group()
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps({"cases": cases, "failures": failures,
                                                      "host_syncs": syncs}, indent=1))


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
