"""The demo's data and model: the training text as character batches (:class:`CharData`),
and the MoE character transformer (:func:`build_model`), either expert-parallel with
:class:`tribucket.moe.MoELayer` (the tribucket run) or with every expert on every rank
(:class:`AllExpertsMoE`, the DDP baseline), both with the same weights.

Shape legend: B sequences per rank, S sequence length, D model dim, V vocabulary,
T tokens (B·S), E experts (global), K experts per token.
"""

from __future__ import annotations

import math

from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..moe import GroupedExperts, MoELayer, SwiGLUExpert, update_routing_biases
from .config import DemoConfig

#: the built-in text (sonnets, public domain), shipped in tribucket/data/
DEFAULT_TEXT = Path(__file__).parents[1] / "data" / "sonnets.txt"


# ----------------------------------------------------------------------------- data
def check_text_length(chars: int, seq_len: int) -> None:
    """Raise unless a text of ``chars`` characters holds validation sequences of
    ``seq_len`` (its last 10%, as :class:`CharData` splits it)."""
    val = chars - int(0.9 * chars)
    if val < seq_len + 2:
        raise ValueError(f"the text has {chars} characters: its 10% validation split ({val}) "
                         f"is shorter than --seq-len {seq_len} + 2; use a longer --text or a "
                         "smaller --seq-len")


class CharData:
    """A text as character ids, split 90/10 into train/validation; batches by seed."""

    def __init__(self, text: str, seq_len: int):
        self.chars = sorted(set(text))
        stoi = {c: i for i, c in enumerate(self.chars)}
        ids = torch.tensor([stoi[c] for c in text], dtype=torch.long)
        split = int(0.9 * len(ids))
        self.train, self.val = ids[:split], ids[split:]
        self.seq_len = seq_len
        check_text_length(len(text), seq_len)

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
    try:
        return Path(path or DEFAULT_TEXT).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"--text {path!r} is not UTF-8 text ({e.reason} at byte {e.start}): "
                         "convert it (e.g. iconv -f latin1 -t utf-8), or leave --text out "
                         "for the built-in sonnets") from None


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

    Same parameter and buffer names as :class:`MoELayer` (``router.weight``,
    ``experts.<global index>.*``, ``shared_experts.<i>.*``, ``expert_bias``), so the two
    models' ``state_dict`` keys line up. Each expert runs on the tokens routed to it
    (possibly none: it still joins the graph, so DDP sees a zero gradient, as tribucket's
    experts get one). The routing bias is updated as a replicated-experts user would: the
    token counts all-reduced over the ranks after each step (:meth:`update_bias`).
    """

    def __init__(self, experts: Sequence[nn.Module], router: nn.Linear, top_k: int,
                 aux_loss_coef: float, *, shared: Sequence[nn.Module] = (),
                 score_func: str = "softmax", bias_update_rate: float = 0.0):
        super().__init__()
        self.router = router
        self.experts = nn.ModuleDict({str(e): m for e, m in enumerate(experts)})
        self.shared_experts = nn.ModuleList(shared) if shared else None
        self.num_experts = len(experts)
        self.top_k = top_k
        self.aux_loss_coef = aux_loss_coef
        self.score_func = score_func
        self.bias_update_rate = bias_update_rate
        # (zeros without balancing, as MoELayer's: the state_dict keys line up)
        self.register_buffer("expert_bias", torch.zeros(len(experts), device=router.weight.device))
        if bias_update_rate:
            self._load_E = torch.zeros(len(experts), dtype=torch.float64, device=router.weight.device)
        self.aux_loss: torch.Tensor | None = None
        #: [E] this rank's token-slots per expert in the last forward (MoELayer's
        #: ``stats.tokens_per_expert``), kept as a tensor until it is read
        self.counts_E: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        D = x.shape[-1]
        x_TD = x.reshape(-1, D)
        logits_TE = self.router(x_TD).float()
        if self.score_func == "softmax":
            scores_TE = probs_TE = torch.softmax(logits_TE, dim=-1)
        else:
            scores_TE = torch.sigmoid(logits_TE)
            probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        if self.bias_update_rate:  # the bias picks the experts, the scores weigh them
            ids_TK = torch.topk(scores_TE.detach() + self.expert_bias, self.top_k, dim=-1).indices
            weights_TK = scores_TE.gather(1, ids_TK)
        else:
            weights_TK, ids_TK = torch.topk(scores_TE, self.top_k, dim=-1)
        if self.top_k > 1:  # MoELayer's default; k = 1 is Switch-style y = p · expert(x)
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        y_TD = torch.zeros_like(x_TD)
        for e, expert in enumerate(self.experts.values()):
            t_idx, k_idx = torch.nonzero(ids_TK == e, as_tuple=True)
            out = expert(x_TD[t_idx])
            y_TD = y_TD.index_add(0, t_idx, (weights_TK[t_idx, k_idx, None] * out).to(x.dtype))
        if self.shared_experts is not None:
            y_TD = y_TD + sum(m(x_TD) for m in self.shared_experts)
        T = x_TD.shape[0]
        self.counts_E = torch.bincount(ids_TK.reshape(-1), minlength=self.num_experts)
        if self.bias_update_rate and self.training:
            self._load_E += self.counts_E
        f_E = self.counts_E.float() / (T * self.top_k)
        self.aux_loss = self.aux_loss_coef * self.num_experts * torch.dot(f_E, probs_TE.mean(dim=0))
        return y_TD.view(x.shape)

    @torch.no_grad()
    def update_bias(self) -> None:
        """``expert_bias += rate · sign(mean_load - load)`` over every rank's tokens since
        the last call (one all-reduce of the counts)."""
        if not self.bias_update_rate:
            return
        load_E = self._load_E.clone()
        dist.all_reduce(load_E)
        self._load_E.zero_()
        if load_E.sum():
            self.expert_bias += self.bias_update_rate * torch.sign(load_E.mean() - load_E).float()


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

    def update_routing_biases(self) -> None:
        """Aux-loss-free balancing after an optimizer step, for whichever MoE the blocks hold."""
        update_routing_biases(self)  # the MoELayers (no collective)
        for b in self.blocks:
            if isinstance(b.ffn, AllExpertsMoE):
                b.ffn.update_bias()

    def routing(self) -> tuple:
        """Per MoE layer, this rank's token-slots per expert in the last forward."""
        return tuple(tuple(b.ffn.stats.tokens_per_expert) if isinstance(b.ffn, MoELayer)
                     else tuple(b.ffn.counts_E.tolist())
                     for b in self.blocks if hasattr(b.ffn, "aux_loss"))

    def watch_routers(self) -> None:
        """Keep each MoE layer's router logits (and routing bias) of the last forward, for
        :meth:`routing_choices` (a forward hook per router; the logits are not copied)."""
        self._taps: dict[int, tuple] = {}
        for i, b in enumerate(self.blocks):
            if hasattr(b.ffn, "aux_loss"):
                b.ffn.router.register_forward_hook(
                    lambda _m, _inp, out, i=i, ffn=b.ffn: self._taps.__setitem__(
                        i, (out.detach(), ffn.expert_bias.clone()
                            if ffn.bias_update_rate else None)))

    @torch.no_grad()
    def routing_choices(self) -> tuple:
        """Per MoE layer, from the last forward (:meth:`watch_routers`): each token's chosen
        experts (``[T, K]`` int16, ascending) and its top-k margin (``[T]`` fp32: the k-th
        best selection score minus the (k+1)-th, the scores the layer's top-k compares: the
        router's softmax or sigmoid scores, plus the routing bias when it balances). A
        margin within rounding of 0 is a near-tie: the slightest difference in the weights
        may swap the two experts."""
        out = []
        for i in sorted(self._taps):
            logits_TE, bias_E = self._taps[i]
            ffn = self.blocks[i].ffn
            logits_TE = logits_TE.float()
            scores_TE = (torch.softmax(logits_TE, dim=-1) if ffn.score_func == "softmax"
                         else torch.sigmoid(logits_TE))
            if bias_E is not None:
                scores_TE = scores_TE + bias_E
            k, E = ffn.top_k, scores_TE.shape[1]
            top = torch.topk(scores_TE, min(k + 1, E), dim=-1)
            ids_TK = top.indices[:, :k].sort(dim=-1).values.to(torch.int16)
            margin_T = (top.values[:, k - 1] - top.values[:, k] if k < E
                        else torch.full_like(top.values[:, 0], math.inf))
            out.append((ids_TK.cpu(), margin_T.cpu()))
        return tuple(out)


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
                experts.append(SwiGLUExpert(cfg.d_model, cfg.expert_hidden).to(device))
            shared = []
            for j in range(cfg.shared_experts):
                _seeded(cfg.seed, i, 4, j)
                shared.append(SwiGLUExpert(cfg.d_model, cfg.expert_hidden).to(device))
            rate = cfg.bias_update_rate or None
            if expert_parallel:
                # stacked and run as one grouped matmul (the pipelined schedule takes modules)
                local = (GroupedExperts.from_experts(experts) if cfg.schedule == "alltoall"
                         else experts)
                ffn = MoELayer(local, E, cfg.d_model, top_k=cfg.top_k, router=router,
                               expert_grad_scale=1.0 / world, aux_loss_coef=cfg.aux_loss_coef,
                               schedule=cfg.schedule, shared_experts=shared or None,
                               score_func=cfg.score_func, bias_update_rate=rate)
            else:
                ffn = AllExpertsMoE(experts, router, cfg.top_k, cfg.aux_loss_coef, shared=shared,
                                    score_func=cfg.score_func, bias_update_rate=rate or 0.0)
        attn_block.ffn = ffn
        blocks.append(attn_block)
    _seeded(cfg.seed, cfg.layers, 0)
    return CharTransformer(vocab_size, cfg.seq_len, cfg.d_model, blocks).to(device)
