import copy, torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
import tribucket

class WN(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.utils.parametrizations.weight_norm(nn.Linear(8, 8))
        self.b = nn.Linear(8, 4)
        self.c = nn.Linear(8, 4)
    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h), self.c(h)

def _run(kind, variant):
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = WN()
    if variant == "hook":
        model.b.weight.register_hook(lambda g: g * 3)
    ctx = tribucket.fused_bucketing(model) if kind == "tb" else None
    m = model if kind == "tb" else DDP(model)
    if ctx: ctx.__enter__()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        g = torch.Generator().manual_seed(rank * 10 + step)
        x = torch.randn(5, 8, generator=g)
        o1, o2 = m(x)
        if variant == "multi":
            torch.autograd.backward([o1.square().mean(), o2.abs().mean()])
        else:
            (o1.square().mean() + o2.abs().mean()).backward()
        opt.step(); opt.zero_grad()
    if ctx: ctx.__exit__(None, None, None)
    return {n: p.detach().clone() for n, p in model.named_parameters()}

def _probe(variant):
    a, b = _run("tb", variant), _run("ddp", variant)
    return [n for n in a if not torch.allclose(a[n], b[n], atol=1e-6)]

def test_probe(dist_run):
    for v in ["plain", "multi", "hook"]:
        print(v, dist_run(_probe, v, world_size=2, timeout=60))
