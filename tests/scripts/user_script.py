"""A user's training script as people write them, for the exit check (tests/test_exit.py).

    python tests/scripts/user_script.py KIND HOOK NATIVE     (RANK, WORLD_SIZE, MASTER_* set)

KIND: ``ddp`` (fused_bucketing + AdamW), ``zero`` (shard_optimizer + ShardedOptimizer),
``moe`` (an expert-parallel MoE layer in a model whose dense part fused_bucketing
averages); HOOK: ``none`` or ``fp16``; NATIVE: ``1`` native gradient hooks, ``0`` Python.
The model, the optimizer and the reducer stay module globals until the interpreter exits;
the script ends with a collective of its own and ``destroy_process_group()`` and no
``gc.collect()``: exit status 0 is what must come out.
"""

import faulthandler
import sys

import torch
import torch.distributed as dist
from torch import nn

import tribucket
from tribucket.moe import MoELayer

kind, hook, native = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
faulthandler.enable(all_threads=True)  # an abort at exit prints the Python threads' stacks
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
D = 32
if kind == "moe":
    experts = [nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
               for _ in range(2)]
    model = nn.Sequential(nn.Linear(D, D), MoELayer(experts, 2 * world, D, top_k=2),
                          nn.Linear(D, D))
else:
    model = nn.Sequential(*[nn.Linear(D, D) for _ in range(6)])

with tribucket.fused_bucketing(model, bucket_cap_mb=0.002, native_hooks=native,
                               shard_optimizer=kind == "zero") as reducer:
    if hook == "fp16":
        reducer.register_comm_hook(None, tribucket.hooks.fp16_compress_hook)
    if kind == "zero":
        opt = tribucket.ShardedOptimizer(reducer, torch.optim.AdamW, lr=1e-3)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(6):
        x = torch.randn(16, D, generator=torch.Generator().manual_seed(rank * 100 + step))
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

# the end of a typical script: a last collective of the user's, then tear down
out = [torch.zeros(1) for _ in range(world)]
dist.all_gather(out, torch.full((1,), float(loss.item())))
if rank == 0:
    print("losses", [round(t.item(), 6) for t in out], flush=True)
dist.destroy_process_group()
