"""Small models the distributed tests train under tribucket and under torch DDP."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class MLP(nn.Module):
    """Many small layers: many buckets at small caps."""

    def __init__(self, width=16, depth=8):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


class Tied(nn.Module):
    """Embedding and output projection share one weight."""

    def __init__(self, vocab=20, dim=12):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mid = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x):
        return self.out(torch.relu(self.mid(self.emb(x))))


class BNConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
                                 nn.Conv2d(6, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))

    def forward(self, x):
        return self.net(x)


class Branchy(nn.Module):
    """``branch`` is used only when the batch's first element is positive."""

    def __init__(self, dim=10, always=None):
        super().__init__()
        self.always = always  # None: data-dependent; True/False: fixed graph
        self.trunk = nn.Linear(dim, dim)
        self.branch = nn.Linear(dim, dim)
        self.never = nn.Linear(dim, dim)  # never used at all
        self.head = nn.Linear(dim, 2)

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        if (x[0, 0] > 0) if self.always is None else self.always:
            h = h + self.branch(h)
        return self.head(h)


class Mixed(nn.Module):
    """fp32 and bf16 parameters (and one fp64) in one model."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8).to(torch.bfloat16)
        self.c = nn.Linear(8, 8)
        self.d = nn.Linear(8, 4).to(torch.float64)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h.to(torch.bfloat16))).float()
        h = torch.tanh(self.c(h))
        return self.d(h.double()).float()


class Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(6, 6).requires_grad_(False)
        self.body = nn.Linear(6, 6)
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        return self.head(torch.relu(self.body(self.frozen(x))))


class One(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(5))

    def forward(self, x):
        return x * self.w


class Gated(nn.Module):
    """``branch`` is used only when the batch's first element is positive; every other
    parameter always is, so a batch that skips it misses exactly its two gradients."""

    def __init__(self, dim=6):
        super().__init__()
        self.trunk, self.branch, self.head = (nn.Linear(dim, dim), nn.Linear(dim, dim),
                                              nn.Linear(dim, 2))

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        if x[0, 0] > 0:
            h = h + self.branch(h)
        return self.head(h)


class Checkpointed(nn.Module):
    def __init__(self, reentrant=False, dim=8):
        super().__init__()
        self.reentrant = reentrant
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(dim, 2)

    def forward(self, x):
        for blk in self.blocks:
            x = checkpoint(blk, x, use_reentrant=self.reentrant)
        return self.head(x)


class SparseEmb(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 6, sparse=True)
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        return self.head(self.emb(x).mean(1))


def small_transformer():
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.0,
                                       batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)


BUILDERS = {
    "mlp": (MLP, lambda g: torch.randn(4, 16, generator=g)),
    "mlp_wide": (lambda: MLP(width=256, depth=8), lambda g: torch.randn(4, 256, generator=g)),
    "transformer": (small_transformer, lambda g: torch.randn(2, 5, 16, generator=g)),
    "tied": (Tied, lambda g: torch.randint(0, 20, (4, 3), generator=g)),
    "bn": (BNConv, lambda g: torch.randn(4, 3, 6, 6, generator=g)),
    "bn_channels_last": (lambda: BNConv().to(memory_format=torch.channels_last),
                         lambda g: torch.randn(4, 3, 6, 6, generator=g).to(
                             memory_format=torch.channels_last)),
    "branchy": (Branchy, lambda g: torch.randn(4, 10, generator=g)),
    "branchy_static": (lambda: Branchy(always=True), lambda g: torch.randn(4, 10, generator=g)),
    "gated": (Gated, lambda g: torch.randn(4, 6, generator=g)),
    "mixed": (Mixed, lambda g: torch.randn(4, 8, generator=g)),
    "frozen": (Frozen, lambda g: torch.randn(4, 6, generator=g)),
    "one": (One, lambda g: torch.randn(3, 5, generator=g)),
    "ckpt": (Checkpointed, lambda g: torch.randn(4, 8, generator=g)),
    "ckpt_reentrant": (lambda: Checkpointed(reentrant=True),
                       lambda g: torch.randn(4, 8, generator=g).requires_grad_()),
    "sparse": (SparseEmb, lambda g: torch.randint(0, 30, (4, 5), generator=g)),
}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return BUILDERS[name][0]()


def batch(name: str, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return BUILDERS[name][1](g)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


class RandomNet(nn.Module):
    """A model built from a spec drawn by hypothesis (``tribucket.testing``-style).

    spec: dict(widths=[...], dtypes=[...], frozen=[...], bn=[...], unused=[...], tie=bool,
    branch=bool, sometimes=bool). Block i maps widths[i] -> widths[i+1] in dtypes[i];
    ``unused[i]`` adds a side layer that never runs; ``branch`` runs the last block twice
    when the input's first entry is positive (data-dependent); ``sometimes`` adds a layer
    before the head that runs only when the input's last entry is positive (so ranks given
    different data leave different parameters unused); ``tie`` ties the last block's weight
    to a square block's if one exists.
    """

    def __init__(self, spec):
        super().__init__()
        self.spec = spec
        w, dts = spec["widths"], spec["dtypes"]
        self.blocks = nn.ModuleList()
        self.norms = nn.ModuleList()
        self.side = nn.ModuleList()
        for i in range(len(w) - 1):
            lin = nn.Linear(w[i], w[i + 1]).to(dts[i])
            lin.requires_grad_(not spec["frozen"][i])
            self.blocks.append(lin)
            self.norms.append(nn.BatchNorm1d(w[i + 1]).to(dts[i]) if spec["bn"][i]
                              else nn.Identity())
            self.side.append(nn.Linear(w[i + 1], w[i + 1]).to(dts[i]) if spec["unused"][i]
                             else nn.Identity())
        squares = [i for i in range(len(w) - 1) if w[i] == w[i + 1]]
        if spec["tie"] and len(squares) >= 2:
            a, b = squares[0], squares[-1]
            if (w[a] == w[b] and dts[a] == dts[b] and not spec["frozen"][a]
                    and not spec["frozen"][b]):  # (square blocks of one width and dtype)
                self.blocks[b].weight = self.blocks[a].weight
        self.sometimes = nn.Linear(w[-1], w[-1]) if spec.get("sometimes") else None
        self.head = nn.Linear(w[-1], 2)

    def forward(self, x):
        gate = x[0, -1] > 0
        for i, (lin, norm) in enumerate(zip(self.blocks, self.norms)):
            x = torch.tanh(norm(lin(x.to(lin.weight.dtype))))
            if self.spec["branch"] and i == len(self.blocks) - 1 and x.shape[-1] == \
                    lin.out_features and lin.in_features == lin.out_features and x[0, 0] > 0:
                x = torch.tanh(lin(x))
        x = x.float()
        if self.sometimes is not None and gate:
            x = torch.tanh(self.sometimes(x))
        return self.head(x)
