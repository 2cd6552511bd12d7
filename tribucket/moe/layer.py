"""``MoELayer``: a top-k router, expert-parallel dispatch, local experts, weighted combine.

Shape legend (suffixes on tensor names):
    T  tokens on this rank                 K  experts per token (top-k)
    D  model dimension                     E  experts in the group (global), E = W * L
    W  ranks in the expert-parallel group  L  experts per rank (local experts)
    R  rows this rank's experts receive
"""

from __future__ import annotations

import itertools
import math
import zlib
from dataclasses import dataclass, is_dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from .._tags import mark_expert_parallel
from ..comm import group_rank_and_size
from .dispatcher import DispatchMeta, MoEDispatcher
from .schedule import pipelined_experts
from .shadow import ShadowCosts, resolve_shadow_policy

__all__ = ["MoELayer", "MoEStats", "SCHEDULES"]

#: the token-exchange schedules MoELayer knows: two all-to-alls, or FasterMoE's pipeline
SCHEDULES = ("alltoall", "pairwise")


@dataclass(frozen=True)
class MoEStats:
    """Routing figures of the last forward (host integers; no extra communication)."""

    #: [E] this rank's token-slots routed to each global expert, before capacity drops
    tokens_per_expert: tuple[int, ...]
    #: [L] rows each local expert computed: every rank's tokens for it, after drops
    tokens_received: tuple[int, ...]
    #: this rank's token-slots dropped by capacity (always 0 when dropless)
    dropped: int
    #: rows per expert accepted from one rank (None: dropless)
    capacity: int | None
    #: global ids of the experts shadowed in this forward (computed on every rank)
    shadowed: tuple[int, ...] = ()


class MoELayer(nn.Module):
    r"""Mixture-of-Experts layer with experts spread over the ranks of ``group``.

    ``experts`` are this rank's ``L = num_experts / W`` experts (each maps ``[n, D] -> [n,
    D]``); global expert ``e`` lives on rank ``e // L``. ``y = layer(x)`` maps ``[..., D]``
    to the same shape.

    Gate math, per token ``t`` (all in fp32)::

        logits = router(x)                                    # [T, E]; default Linear(D, E, bias=False)
        probs = softmax(logits)
        weights, expert_ids = topk(probs, k)                  # torch.topk's order on ties
        weights = weights / weights.sum()   if normalize_weights (default: top_k > 1)
        y[t] = sum_k weights[t, k] * expert_{expert_ids[t, k]}(x[t])

    With ``top_k=1`` and ``normalize_weights=True`` the gate is always exactly 1, so ``y``
    gives the router no gradient (it then learns from ``aux_loss`` only); that is why the
    default normalises only for ``top_k > 1`` (Switch-style: ``y = p · expert(x)``).

    Capacity (``capacity_factor`` a float): each expert accepts at most ``capacity =
    ceil(capacity_factor · T · k / E)`` token-slots from each rank (``T`` = this rank's
    tokens); later tokens (in token order) are dropped and their term is zero. ``None``:
    dropless, every slot is computed.

    ``aux_loss`` (a scalar with gradient to the router, from this rank's tokens) is
    ``aux_loss_coef · balance + z_loss_coef · z`` with

    * ``balance = E · sum_e f_e · P_e`` — the Switch Transformer load-balancing loss, with
      ``f_e`` = fraction of this rank's ``T·k`` token-slots routed to ``e`` (before drops;
      no gradient) and ``P_e`` = mean over tokens of ``probs[:, e]``; 1.0 when balanced;
    * ``z = mean_t(logsumexp(logits[t])²)`` — the ST-MoE router z-loss.

    Add it to your loss yourself (``loss = task_loss + layer.aux_loss``).

    Parameters and gradients: the router is replicated (broadcast from the group's rank 0
    when the layer is built) and its gradient is left local — the data-parallel reducer
    averages it. Expert parameters are tagged expert-parallel (``fused_bucketing`` skips
    them); an expert's gradient is the sum over every rank's tokens routed to it, times
    ``expert_grad_scale`` (``1 / W`` gives a data-parallel mean). ``state_dict()`` names
    experts by global index (``experts.5.weight`` on the rank owning expert 5), and
    ``load_state_dict`` accepts a file holding other ranks' experts too (it takes its own).

    ``stats`` (:class:`MoEStats`) describes the last forward's routing. ``backend`` picks the
    token kernels (``"auto"``: Triton on CUDA, PyTorch on CPU). Every rank of ``group`` must
    call forward and backward in the same order; an expert that raises or returns a wrong
    shape makes every rank raise (see :class:`MoEDispatcher`). Experts are called on every
    forward, with zero rows when no token reached them (``schedule="alltoall"``; the pairwise
    schedule skips empty calls).

    **Schedules.** ``schedule="alltoall"`` moves tokens with two uneven all-to-alls around
    one call per local expert. ``schedule="pairwise"`` is FasterMoE's smart schedule
    (:mod:`tribucket.moe.schedule`): ranks are cut into groups of ``group_size`` consecutive
    ranks (capped at the world size; when it does not divide the world size the last group
    is smaller), and step ``s`` exchanges with groups ``(g + s) % n`` / ``(g - s) % n`` by
    ``dist.batch_isend_irecv``, pipelined so that the sends of step ``s + 1`` and the returns
    of step ``s - 1`` are in flight while the experts compute step ``s`` — in forward and in
    backward. Results equal the all-to-all schedule's (up to fp summation order). Experts are
    then called once per step on the rows of that step, so they must be row-wise (no
    batch statistics). Expert gradients are computed inside the pipeline and handed to
    autograd as ordinary gradients (``expert_grad_scale`` hooks fire once); double backward
    through the pipeline is not supported.

    **Shadow experts** (``shadow_policy``): per forward a policy picks experts whose owner
    broadcasts their parameters; every rank computes its own tokens for them locally, and in
    backward the copies' gradients are reduced to the owner and added to its gradients
    (scaled by ``expert_grad_scale`` like the rest). ``"greedy"`` (or a
    :class:`~tribucket.moe.GreedyShadowPolicy` with your bandwidth and FLOP rate) is
    FasterMoE's rule on the all-gathered expert loads; a set of expert ids shadows those
    always. Shadowing needs experts with identical parameter names/shapes and one dtype on
    every rank (checked when the layer is built). With ``schedule="alltoall"`` a forward that
    shadows runs the pipeline engine as one step (every peer at once) instead of the
    all-to-alls. ``stats.shadowed`` names the experts shadowed last.

    Every rank must build the layer with the same arguments (checked: one small all-gather
    when the layer is built) and agree on ``x.requires_grad`` and on which expert parameters
    require grad.

    Example::

        experts = nn.ModuleList(FFN(512, 1024) for _ in range(2))    # this rank's 2 experts
        layer = tribucket.moe.MoELayer(experts, num_experts=2 * world, d_model=512, top_k=2)
        y = layer(x)                                                 # x: [batch, seq, 512]
        (task_loss(y) + layer.aux_loss).backward()
    """

    def __init__(
        self,
        experts: nn.ModuleList | Sequence[nn.Module],
        num_experts: int,
        d_model: int,
        *,
        top_k: int = 2,
        router: nn.Module | None = None,
        capacity_factor: float | None = None,
        normalize_weights: bool | None = None,
        group: dist.ProcessGroup | None = None,
        schedule: str = "alltoall",
        group_size: int = 4,
        shadow_policy=None,
        expert_grad_scale: float = 1.0,
        aux_loss_coef: float = 0.01,
        z_loss_coef: float = 0.0,
        backend: str = "auto",
    ):
        super().__init__()
        # every check comes before the router broadcast, the first collective
        experts = list(experts)
        if not experts or not all(isinstance(e, nn.Module) for e in experts):
            raise TypeError("experts must be a non-empty nn.ModuleList (or sequence) of this "
                            f"rank's expert modules, got {experts!r}")
        rank, world = group_rank_and_size(group)
        self.dispatcher = MoEDispatcher(num_experts, group=group, capacity_factor=capacity_factor,
                                        backend=backend)
        if num_experts != world * len(experts):
            raise ValueError(
                f"num_experts={num_experts} but {len(experts)} local experts x world size {world} "
                f"= {world * len(experts)}: pass num_experts = world_size * len(experts)")
        if isinstance(d_model, bool) or not isinstance(d_model, int) or d_model < 1:
            raise ValueError(f"d_model must be a positive int, got {d_model!r}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k!r} must be an int in 1..num_experts ({num_experts})")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r} is not one of {SCHEDULES}")
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be a positive int (ranks per pairwise exchange "
                             f"group, capped at the world size), got {group_size!r}")
        policy = resolve_shadow_policy(shadow_policy, num_experts)
        signature = _expert_signature(experts[0])
        if policy is not None:
            for l, e in enumerate(experts):
                if _expert_signature(e) != signature:
                    raise ValueError(
                        f"shadow_policy needs identical experts: local expert {l} has parameters "
                        f"{_expert_signature(e)} but local expert 0 has {signature}")
            if len({str(d) for _, _, d in signature}) > 1:
                raise ValueError(f"shadow_policy needs expert parameters of one dtype, got "
                                 f"{sorted({d for _, _, d in signature})}")
            if not signature:
                raise ValueError("shadow_policy needs experts with parameters (there is nothing to "
                                 "broadcast); pass shadow_policy=None")
        for name, v in (("expert_grad_scale", expert_grad_scale), ("aux_loss_coef", aux_loss_coef),
                        ("z_loss_coef", z_loss_coef)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        if aux_loss_coef < 0 or z_loss_coef < 0:
            raise ValueError(f"aux_loss_coef and z_loss_coef must be >= 0, got "
                             f"{aux_loss_coef!r} and {z_loss_coef!r}")
        if normalize_weights is None:
            normalize_weights = top_k > 1

        self.num_experts = num_experts
        self.num_local_experts = len(experts)
        self.d_model = d_model
        self.top_k = top_k
        self.normalize_weights = bool(normalize_weights)
        self.schedule = schedule
        self.group_size = group_size
        #: the shadow policy object (None: no shadowing)
        self.shadow_policy = policy
        #: elements of one expert's parameters (the size a shadow broadcast moves)
        self.expert_numel = sum(q.numel() for q in experts[0].parameters())
        self.expert_grad_scale = float(expert_grad_scale)
        self.aux_loss_coef = float(aux_loss_coef)
        self.z_loss_coef = float(z_loss_coef)
        #: global index of this rank's first expert
        self.expert_offset = rank * len(experts)

        if router is None:
            param = next(itertools.chain.from_iterable(e.parameters() for e in experts), None)
            router = nn.Linear(d_model, num_experts, bias=False,
                               device=param.device if param is not None else None)
        self.router = router
        # keyed by global index, so state_dict() says experts.5.… on the owner of expert 5
        self.experts = nn.ModuleDict({str(self.expert_offset + l): e for l, e in enumerate(experts)})
        for p in self.experts.parameters():
            mark_expert_parallel(p)
            if self.expert_grad_scale != 1.0:
                p.register_hook(lambda g, s=self.expert_grad_scale: g * s)
        self.register_load_state_dict_pre_hook(_drop_other_ranks_experts)
        _broadcast_from_first_rank(self.router, group)
        _check_ranks_agree(self, signature, group)

        #: load-balancing (+ z) loss of the last forward (None before the first)
        self.aux_loss: torch.Tensor | None = None
        #: routing figures of the last forward (None before the first)
        self.stats: MoEStats | None = None

    @property
    def local_experts(self) -> list[nn.Module]:
        """This rank's experts in local order (global index ``expert_offset + l``)."""
        return list(self.experts.values())

    def extra_repr(self) -> str:
        cap = self.dispatcher.capacity_factor
        return (f"num_experts={self.num_experts}, local={self.num_local_experts}, "
                f"d_model={self.d_model}, top_k={self.top_k}, "
                f"capacity_factor={'dropless' if cap is None else cap}, schedule={self.schedule}"
                + (f", group_size={self.group_size}" if self.schedule == "pairwise" else "")
                + (f", shadow_policy={self.shadow_policy!r}" if self.shadow_policy is not None else ""))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 1 or x.shape[-1] != self.d_model:
            raise ValueError(f"x has shape {tuple(x.shape)}: its last dimension must be "
                             f"d_model={self.d_model} (pass [..., {self.d_model}] inputs)")
        x_TD = x.reshape(-1, self.d_model)
        logits_TE = self._router_logits(x_TD)
        probs_TE = torch.softmax(logits_TE, dim=-1)
        weights_TK, expert_ids_TK = torch.topk(probs_TE, self.top_k, dim=-1)
        if self.normalize_weights and self.top_k == 1:
            # p / p is 1 up to rounding: use exactly 1, so y gives the router no gradient
            weights_TK = torch.ones_like(weights_TK)
        elif self.normalize_weights:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)

        disp = self.dispatcher
        policy = self.shadow_policy
        meta = disp.plan(x_TD, expert_ids_TK, weights_TK,
                         gather_counts=policy is not None and policy.needs_counts
                         and disp.world_size > 1)
        shadowed = self._decide_shadows(meta, x_TD.dtype)
        if self.schedule == "alltoall" and not shadowed:
            expert_input_RD = disp.exchange(disp.permute(x_TD, meta), meta)
            try:
                outputs = self._run_experts(expert_input_RD, meta)
            except Exception as error:  # every rank must hear of it before the return exchange
                disp.fail_combine(error, meta)
            y_TD = disp.combine(outputs, meta)
        else:  # the pipeline (a single step, every peer at once, for "alltoall" + shadows)
            group_size = self.group_size if self.schedule == "pairwise" else disp.world_size
            back_ND = pipelined_experts(
                disp.permute(x_TD, meta), meta, self.local_experts, rank=disp.rank,
                world_size=disp.world_size, group=disp.group, group_size=group_size,
                shadowed=shadowed, check_output=disp.check_expert_output,
                expert_numel=self.expert_numel)
            y_TD = disp.unpermute(back_ND, meta)

        self.aux_loss = self._aux_loss(logits_TE, probs_TE, meta.counts_E)
        self.stats = MoEStats(tokens_per_expert=meta.counts_host,
                              tokens_received=meta.tokens_per_expert,
                              dropped=meta.num_dropped, capacity=meta.capacity,
                              shadowed=tuple(sorted(shadowed)))
        return y_TD.view(*x.shape[:-1], self.d_model)

    # -------------------------------------------------------------------------------------
    def _router_logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        """fp32 ``[T, E]`` logits; the router runs in its own parameter dtype (fp32 by default)."""
        p = next(self.router.parameters(), None)
        logits_TE = self.router(x_TD.to(p.dtype) if p is not None else x_TD).float()
        if logits_TE.shape != (x_TD.shape[0], self.num_experts):
            raise ValueError(f"router returned {tuple(logits_TE.shape)} for {x_TD.shape[0]} tokens; "
                             f"it must map [T, {self.d_model}] -> [T, num_experts={self.num_experts}]")
        return logits_TE

    def _decide_shadows(self, meta: DispatchMeta, token_dtype: torch.dtype) -> frozenset[int]:
        """The policy's choice for this forward (the same on every rank: same integers)."""
        policy = self.shadow_policy
        if policy is None or self.dispatcher.world_size == 1:
            return frozenset()
        ref = next(self.local_experts[0].parameters())
        costs = ShadowCosts(num_local_experts=self.num_local_experts, d_model=self.d_model,
                            expert_numel=self.expert_numel,
                            token_bytes=torch.empty((), dtype=token_dtype).element_size(),
                            param_bytes=ref.element_size())
        chosen = frozenset(int(e) for e in policy.decide(meta.global_counts_host, costs))
        bad = sorted(e for e in chosen if not 0 <= e < self.num_experts)
        if bad:
            raise RuntimeError(f"shadow policy {policy!r} chose expert(s) {bad}, outside "
                               f"0..{self.num_experts - 1}")
        return chosen

    def _run_experts(self, expert_input_RD: torch.Tensor, meta: DispatchMeta) -> list[torch.Tensor]:
        """Each local expert on its contiguous rows (zero rows included)."""
        chunks = expert_input_RD.split(list(meta.tokens_per_expert))
        return [expert(chunk) for expert, chunk in zip(self.experts.values(), chunks)]

    def _aux_loss(self, logits_TE: torch.Tensor, probs_TE: torch.Tensor,
                  counts_E: torch.Tensor) -> torch.Tensor:
        T = logits_TE.shape[0]
        if T == 0:  # no tokens on this rank: a zero that still reaches the router
            return logits_TE.sum() * 0.0
        f_E = counts_E.to(torch.float32) / (T * self.top_k)
        balance = self.num_experts * torch.dot(f_E, probs_TE.mean(dim=0))
        loss = self.aux_loss_coef * balance
        if self.z_loss_coef:
            z = torch.logsumexp(logits_TE, dim=-1).square().mean()
            loss = loss + self.z_loss_coef * z
        return loss


def _broadcast_from_first_rank(module: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Overwrite ``module``'s parameters and buffers with the group's rank 0 values."""
    _, world = group_rank_and_size(group)
    if world == 1:
        return
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for t in itertools.chain(module.parameters(), module.buffers()):
            dist.broadcast(t.data, src=src, group=group)


def _expert_signature(expert: nn.Module) -> tuple[tuple[str, tuple[int, ...], str], ...]:
    return tuple((n, tuple(q.shape), str(q.dtype)) for n, q in expert.named_parameters())


def _crc(obj) -> int:
    return zlib.crc32(repr(obj).encode())


def _check_ranks_agree(layer: MoELayer, signature, group: dist.ProcessGroup | None) -> None:
    """One all-gather: every rank built the layer alike (and, to shadow, with alike experts).

    A rank with another schedule, group size, shadow policy, top_k or capacity would issue
    different collectives in forward and hang the group; this catches it when the layer is
    built, naming the ranks.
    """
    _, world = group_rank_and_size(group)
    if world == 1:
        return
    policy = layer.shadow_policy
    policy_key = repr(policy) if policy is None or is_dataclass(policy) else type(policy).__qualname__
    config = (layer.schedule, layer.group_size, policy_key, layer.num_experts, layer.top_k,
              layer.d_model, layer.dispatcher.capacity_factor, layer.normalize_weights)
    device = next(itertools.chain(layer.router.parameters(), layer.experts.parameters())).device
    mine = torch.tensor([_crc(config), _crc(signature) if policy is not None else 0],
                        dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    rows = [tuple(t.tolist()) for t in every]
    for column, what in ((0, "schedule, group_size, shadow_policy, num_experts, top_k, d_model, "
                             "capacity_factor or normalize_weights"),
                         (1, "expert parameters (names, shapes, dtypes), needed to shadow")):
        values = [r[column] for r in rows]
        if len(set(values)) > 1:
            ref = values[0]
            bad = [r for r, v in enumerate(values) if v != ref]
            raise ValueError(f"the ranks of the expert-parallel group built MoELayer with different "
                             f"{what}: rank(s) {bad} differ from rank 0; pass the same arguments "
                             f"on every rank")


def _drop_other_ranks_experts(module: MoELayer, state_dict, prefix, *_unused) -> None:
    """load_state_dict pre-hook: ignore experts this rank does not own (merged files)."""
    head = prefix + "experts."
    mine = set(module.experts.keys())
    for key in [k for k in state_dict if k.startswith(head)]:
        index = key[len(head):].split(".", 1)[0]
        if index.isdigit() and index not in mine and int(index) < module.num_experts:
            del state_dict[key]
