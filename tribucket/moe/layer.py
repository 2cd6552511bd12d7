"""``MoELayer``: a top-k router, expert-parallel dispatch, local experts, weighted combine.

Shape legend (suffixes on tensor names):
    T  tokens on this rank                 K  experts per token (top-k)
    D  model dimension                     E  experts in the group (global), E = W * L
    W  ranks in the expert-parallel group  L  experts per rank (local experts)
    R  rows this rank's experts receive
"""

from __future__ import annotations

import copy
import datetime
import itertools
import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from .. import _exit
from .._tags import note_aux_output
from ..comm import group_rank_and_size
from ..kernels.moe import moe_counts, permute_tokens, unpermute_tokens
from ..trace import current as _trace_current
from ._checks import (broadcast_from_first_rank, check_ranks_agree, check_replica_group,
                      check_replicas_agree, crc, expert_signature, named_on_every_rank)
from ._copies import deepcopy_layer, drop_other_ranks_experts, retag_after_load, tag_experts
from ._guard import MoEGuard, _is_comm_failure, trace_backward
from .dispatcher import DispatchMeta, MoEDispatcher, _route, expert_capacity
from .experts import GroupedExperts
from .routing import SCORE_FUNCS, TrainedLoad, aux_loss, check_group_limits, route
from .schedule import pipelined_experts
from .shared import shared_forward, shared_list, shared_parameters
from .shadow import ShadowCosts, resolve_shadow_policy

__all__ = ["MoELayer", "MoEStats", "SCHEDULES", "SCORE_FUNCS"]

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
    #: token rows this rank sent to the experts' ranks (itself included): one per kept
    #: token-slot, or one per (token, rank) when the dispatch was deduplicated (how the rows
    #: travelled, not the routing: left out of ``==``)
    rows_sent: int = field(default=0, compare=False)
    #: whether this forward's dispatch sent each token once per rank (``dedup``)
    deduplicated: bool = field(default=False, compare=False)


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

    DeepSeek-V3's routing options (docs/moe.md shows them together): ``score_func="sigmoid"``
    (a sigmoid per expert in place of the softmax); ``bias_update_rate`` (a per-expert bias
    added to the scores for the top-k choice only, nudged after each optimizer step toward
    balance); ``num_expert_groups`` / ``num_limited_groups`` (group-limited routing: experts
    in equal groups of consecutive ids, a group scored by the sum of its two best choice
    scores, each token choosing its experts inside its ``num_limited_groups`` best groups;
    with a group per rank or node, a token's rows go to at most that many of them); and
    ``route_scale`` (the weights multiplied by it after normalisation; 2.5 in DeepSeek-V3).

    ``shared_experts`` run on every token and add their sum to ``y`` (times
    ``sigmoid(gate(x))`` with ``shared_gate=True``); with more than one rank and the
    all-to-all schedule, half the tokens go through them beside each token exchange, so they
    must be row-wise (no batch statistics).

    ``dedup`` (the one-step all-to-all schedule without shadowing): send each token to a
    rank once, whatever number of that rank's experts it chose, and sum its weighted expert
    outputs there, so one row per (token, rank) travels each way instead of one per
    token-slot (as DeepEP does); ``True`` always, ``"auto"`` in the steps where that is at
    most half the rows over the group (top-4 and up on two ranks, or group-limited
    routing), ``False`` (default) never. The result is the same up to fp32 summation order;
    ``stats.rows_sent`` and ``stats.deduplicated`` report the step's.

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

    Add it to your loss yourself: ``loss = task_loss + tribucket.moe.aux_losses(model)``
    sums every layer's (``layer.aux_loss`` is this layer's).

    Parameters and gradients: the router is replicated (broadcast from the group's rank 0
    when the layer is built) and its gradient is left local — the data-parallel reducer
    averages it. Expert parameters are tagged expert-parallel (``fused_bucketing``'s
    data-parallel buckets skip them); an expert's gradient is the sum over every rank's
    tokens routed to it, times ``expert_grad_scale``, whose default ``1 / W`` makes it the
    mean over the group's ranks, as DDP's average of a dense parameter (each rank's loss
    being a mean over its own tokens). ``state_dict()`` names
    experts by global index (``experts.5.weight`` on the rank owning expert 5), and
    ``load_state_dict`` accepts a file holding other ranks' experts too (it takes its own).

    ``stats`` (:class:`MoEStats`) describes the last forward's routing. ``backend`` picks the
    token kernels (``"auto"``: Triton on CUDA, PyTorch on CPU). Every rank of ``group`` must
    call forward and backward in the same order (to evaluate on some ranks only, use
    :func:`~tribucket.moe.gathered_experts`); bad input on one rank (``x``'s last dimension,
    the router's output, expert ids) or an expert that raises or returns a wrong shape
    makes every rank raise (the flag rides on the counts exchange or, for an expert's
    failure, on the return exchange; see :class:`MoEDispatcher`). ``timeout`` (a ``datetime.timedelta``) runs the layer's
    collectives on a group with that timeout, and a stalled or dead peer then raises a
    ``RuntimeError`` naming the layer (``name``, default ``#k`` for the k-th layer built),
    the phase (counts, dispatch, combine, backward) and the ranks behind, instead of
    blocking for the process group's timeout. Experts are called on every
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

    **Expert x data parallelism.** With ``group`` smaller than the world (``W`` ranks out of
    ``W * R``), each expert lives on one rank of each of ``R`` groups; ``replica_group`` (this
    rank's ranks that hold the same experts; both groups come from
    :func:`~tribucket.moe.expert_data_parallel_groups`) is required then, and
    ``fused_bucketing`` averages the experts' gradients over it (a second set of buckets, with
    the reducer's overlap and options), so the default ``1 / W`` times that average is again
    the mean over all ``W * R`` ranks.

    Every rank must build the layer with the same arguments (checked: one small all-gather
    when the layer is built) and agree on ``x.requires_grad`` and on which expert parameters
    require grad.

    Example::

        experts = nn.ModuleList(FFN(512, 1024) for _ in range(2))    # this rank's 2 experts
        layer = tribucket.moe.MoELayer(experts, num_experts=2 * world, d_model=512, top_k=2)
        y = layer(x)                                                 # x: [batch, seq, 512]
        (task_loss(y) + layer.aux_loss).backward()
    """

    __deepcopy__ = deepcopy_layer  # (the expert parameters' tags and scale come along)

    @named_on_every_rank  # (an argument one rank refuses is named on the others)
    def __init__(
        self,
        experts: nn.ModuleList | Sequence[nn.Module] | GroupedExperts,
        num_experts: int,
        d_model: int,
        *,
        top_k: int = 2,
        router: nn.Module | None = None,
        capacity_factor: float | None = None,
        normalize_weights: bool | None = None,
        group: dist.ProcessGroup | None = None,
        replica_group: dist.ProcessGroup | None = None,
        schedule: str = "alltoall",
        group_size: int = 4,
        shadow_policy=None,
        expert_grad_scale: float | None = None,
        aux_loss_coef: float = 0.01,
        z_loss_coef: float = 0.0,
        backend: str = "auto",
        timeout: datetime.timedelta | None = None,
        name: str | None = None,
        shared_experts: nn.Module | Sequence[nn.Module] | None = None,
        shared_gate: bool = False,
        score_func: str = "softmax",
        bias_update_rate: float | None = None,
        num_expert_groups: int | None = None,
        num_limited_groups: int | None = None,
        route_scale: float = 1.0,
        dedup: bool | str = False,
    ):
        super().__init__()
        # every check comes before the router broadcast, the first collective
        grouped = experts if isinstance(experts, GroupedExperts) else None
        experts = [grouped] * grouped.num_experts if grouped is not None else list(experts)
        if not experts or not all(isinstance(e, nn.Module) for e in experts):
            raise TypeError("experts must be a non-empty nn.ModuleList (or sequence) of this "
                            f"rank's expert modules, or a GroupedExperts, got {experts!r}")
        shared = shared_list(shared_experts)
        if shared_gate and not shared:
            raise ValueError("shared_gate=True gates the shared experts' output, but "
                             "shared_experts is None: pass shared_experts= too")
        if score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func={score_func!r} is not one of {SCORE_FUNCS}")
        if bias_update_rate is not None and (
                not isinstance(bias_update_rate, (int, float)) or isinstance(bias_update_rate, bool)
                or not math.isfinite(bias_update_rate) or bias_update_rate <= 0):
            raise ValueError(f"bias_update_rate must be None (no routing bias) or a positive "
                             f"number (DeepSeek-V3 uses 1e-3), got {bias_update_rate!r}")
        if (not isinstance(route_scale, (int, float)) or isinstance(route_scale, bool)
                or not math.isfinite(route_scale) or route_scale <= 0):
            raise ValueError(f"route_scale must be a positive number (the routed experts' "
                             f"weights are multiplied by it; DeepSeek-V3 uses 2.5), got "
                             f"{route_scale!r}")
        rank, world = group_rank_and_size(group)
        check_replica_group(group, replica_group, world)
        if expert_grad_scale is None:  # the mean over the group's ranks (see the docstring)
            expert_grad_scale = 1.0 / world
        self.dispatcher = MoEDispatcher(num_experts, group=group, capacity_factor=capacity_factor,
                                        backend=backend, dedup=dedup)
        # raised after the agreement across ranks (below), so that a rank with another number
        # of local experts is named on every rank instead of leaving its peers waiting
        count_error = (None if num_experts == world * len(experts) else ValueError(
            f"num_experts={num_experts} but {len(experts)} local experts x world size {world} "
            f"= {world * len(experts)}: pass num_experts = world_size * len(experts)"))
        if isinstance(d_model, bool) or not isinstance(d_model, int) or d_model < 1:
            raise ValueError(f"d_model must be a positive int, got {d_model!r}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k!r} must be an int in 1..num_experts ({num_experts})")
        check_group_limits(num_expert_groups, num_limited_groups, num_experts, top_k)
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r} is not one of {SCHEDULES}")
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be a positive int (ranks per pairwise exchange "
                             f"group, capped at the world size), got {group_size!r}")
        policy = resolve_shadow_policy(shadow_policy, num_experts)
        if dedup is not False and (policy is not None or schedule != "alltoall"):
            raise ValueError(
                f"dedup={dedup!r} sends each token once per rank in the one-step all-to-all; "
                f"with schedule={schedule!r} and shadow_policy={shadow_policy!r} rows travel "
                f"per token-slot: pass dedup=False, or schedule='alltoall' without shadowing")
        if grouped is not None and (policy is not None or schedule != "alltoall"):
            raise ValueError(
                f"GroupedExperts run with schedule='alltoall' and no shadow_policy (got "
                f"schedule={schedule!r}, shadow_policy={shadow_policy!r}); for the pipelined "
                f"schedule or shadowing pass a list of modules: experts.to_experts()")
        signature = expert_signature(experts[0])
        if policy is not None:
            for l, e in enumerate(experts):
                if expert_signature(e) != signature:
                    raise ValueError(
                        f"shadow_policy needs identical experts: local expert {l} has parameters "
                        f"{expert_signature(e)} but local expert 0 has {signature}")
            if len({str(d) for _, _, d in signature}) > 1:
                raise ValueError(f"shadow_policy needs expert parameters of one dtype, got "
                                 f"{sorted({d for _, _, d in signature})}")
            if not signature:
                raise ValueError("shadow_policy needs experts with parameters (there is nothing to "
                                 "broadcast); pass shadow_policy=None")
        for arg, v in (("expert_grad_scale", expert_grad_scale), ("aux_loss_coef", aux_loss_coef),
                        ("z_loss_coef", z_loss_coef)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise ValueError(f"{arg} must be a finite number, got {v!r}")
        if timeout is not None and (not isinstance(timeout, datetime.timedelta)
                                    or timeout.total_seconds() <= 0):
            raise ValueError(f"timeout must be a positive datetime.timedelta (or None: the "
                             f"process group's own), got {timeout!r}")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a str (how errors call the layer), got {name!r}")
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
        # one row per (token, rank) on the wire (the one-step all-to-all only: checked above)
        self._dedup = dedup
        #: elements of one expert's parameters (the size a shadow broadcast moves)
        self.expert_numel = sum(q.numel() for q in experts[0].parameters()) // (
            grouped.num_experts if grouped is not None else 1)
        self.expert_grad_scale = float(expert_grad_scale)
        self.aux_loss_coef = float(aux_loss_coef)
        self.z_loss_coef = float(z_loss_coef)
        #: collectives that take longer fail with a diagnosis (None: the group's timeout)
        self.timeout = timeout
        #: global index of this rank's first expert
        self.expert_offset = rank * len(experts)

        if router is None:
            param = next(itertools.chain.from_iterable(e.parameters() for e in experts), None)
            router = nn.Linear(d_model, num_experts, bias=False,
                               device=param.device if param is not None else None)
        self.router = router
        # keyed by global index, so state_dict() says experts.5.… on the owner of expert 5
        # (GroupedExperts name them so too: its state_dict hook writes one entry per expert)
        if grouped is not None:
            grouped.first_index = self.expert_offset
            self.experts = grouped
        else:
            self.experts = nn.ModuleDict({str(self.expert_offset + l): e
                                          for l, e in enumerate(experts)})
        #: the experts every token passes through (data-parallel parameters; None: none)
        self.shared_experts = nn.ModuleList(shared) if shared else None
        #: Qwen's gate of the shared experts' output, sigmoid(x @ w) (None: ungated)
        self.shared_gate = (nn.Linear(d_model, 1, bias=False, device=self.router.weight.device
                                      if isinstance(self.router, nn.Linear) else None)
                            if shared_gate else None)
        self.score_func = score_func
        #: experts in this many equal groups of consecutive ids, each token choosing among the
        #: best ``num_limited_groups`` of them (None: no group limit)
        self.num_expert_groups = num_expert_groups
        self.num_limited_groups = num_limited_groups
        #: the routed experts' weights are multiplied by this (after normalisation)
        self.route_scale = float(route_scale)
        #: step of the aux-loss-free balancing (None: no routing bias)
        self.bias_update_rate = None if bias_update_rate is None else float(bias_update_rate)
        #: [E] fp32 bias added to the scores for the top-k choice only (zeros without balancing)
        self.register_buffer("expert_bias", torch.zeros(
            num_experts, dtype=torch.float32, device=next(self.router.parameters()).device
            if next(self.router.parameters(), None) is not None else None))
        # [E] token-slots routed to each expert over the group since the last bias update
        self._load = TrainedLoad(num_experts)
        tag_experts(self, scale_only=True)
        self.register_load_state_dict_pre_hook(drop_other_ranks_experts)
        self.register_load_state_dict_post_hook(retag_after_load)  # (assign=True)
        check_ranks_agree(self, signature, group)  # first: the broadcast needs equal shapes
        if count_error is not None:  # the same on every rank (their counts agreed)
            raise count_error
        # the group the layer's collectives run on (timed when timeout is given), its
        # progress marks and failure reports
        self._guard = MoEGuard(group, rank, world, timeout, name)
        self.dispatcher.group = group = self._guard.group
        #: the group across which this rank's experts are replicated (None: no replicas)
        self.replica_group = replica_group
        tag_experts(self)  # (on the timed group: clip_grad_norm_'s too)
        broadcast_from_first_rank(self.router, group)
        for module in (self.shared_experts, self.shared_gate):
            if module is not None:
                broadcast_from_first_rank(module, group)
        check_replicas_agree(self, replica_group)

        #: load-balancing (+ z) loss of the last forward (None before the first)
        self.aux_loss: torch.Tensor | None = None
        #: routing figures of the last forward (None before the first)
        self.stats: MoEStats | None = None
        #: every expert of the group, inside ``gathered_experts`` (None: expert-parallel)
        self._gathered: list[nn.Module] | None = None
        _exit.register(self)  # its groups and works dropped before interpreter shutdown

    def _apply(self, fn, recurse=True):
        """A cast to fp16/bf16 (``.to(torch.bfloat16)``, ``.half()``) leaves ``expert_bias`` in
        fp32, exactly as it was, as Megatron keeps it: its small steps would vanish in a 16-bit
        bias. Moves between devices apply to it as to everything else."""
        bias = self._buffers.get("expert_bias")
        out = super()._apply(fn, recurse)
        moved = self._buffers.get("expert_bias")
        if bias is not None and moved is not None and moved.dtype in (torch.float16,
                                                                      torch.bfloat16):
            self._buffers["expert_bias"] = bias.to(device=moved.device, dtype=torch.float32)
        return out

    @property
    def local_experts(self) -> list[nn.Module]:
        """This rank's experts in local order (global index ``expert_offset + l``); with
        :class:`GroupedExperts`, detached copies as per-expert modules."""
        if isinstance(self.experts, GroupedExperts):
            return self.experts.to_experts()
        return list(self.experts.values())

    @torch.no_grad()
    def update_bias(self) -> None:
        """Aux-loss-free balancing (DeepSeek-V3): ``expert_bias += rate · sign(mean_load -
        load)`` from the token-slots routed to each expert over the whole group since the last
        call, then the count restarts. Call it after each optimizer step (or use
        :func:`~tribucket.moe.update_routing_biases` / :func:`~tribucket.moe.balance_after_step`
        for every layer of a model). No collective: every rank of the group holds the same
        counts, so every rank computes the same bias; with ``replica_group`` the counts are
        first summed over it (one all-reduce of ``E`` integers) so every expert-parallel group
        moves its bias alike. A no-op when ``bias_update_rate`` is None."""
        if self.bias_update_rate is None:
            return
        load_E = torch.tensor(self._load.counts, dtype=torch.float64,
                              device=self.expert_bias.device)
        if self.replica_group is not None and dist.get_world_size(self.replica_group) > 1:
            dist.all_reduce(load_E, group=self.replica_group)
        self._apply_bias_update(load_E)

    def _apply_bias_update(self, load_E: torch.Tensor) -> None:
        self._load.take()
        if not bool(load_E.sum()):  # no token routed since the last update: nothing to learn
            return
        step_E = torch.sign(load_E.mean() - load_E).to(torch.float32)
        self.expert_bias.add_(step_E, alpha=self.bias_update_rate)

    def extra_repr(self) -> str:
        cap = self.dispatcher.capacity_factor
        return (f"num_experts={self.num_experts}, local={self.num_local_experts}, "
                f"d_model={self.d_model}, top_k={self.top_k}, "
                f"capacity_factor={'dropless' if cap is None else cap}, schedule={self.schedule}"
                + (f", group_size={self.group_size}" if self.schedule == "pairwise" else "")
                + (f", shadow_policy={self.shadow_policy!r}" if self.shadow_policy is not None else "")
                + (f", score_func={self.score_func}" if self.score_func != "softmax" else "")
                + (f", bias_update_rate={self.bias_update_rate}"
                   if self.bias_update_rate is not None else "")
                + (f", groups={self.num_limited_groups} of {self.num_expert_groups}"
                   if self.num_expert_groups is not None else "")
                + (f", route_scale={self.route_scale}" if self.route_scale != 1.0 else "")
                + (f", shared={len(self.shared_experts)}{' gated' if self.shared_gate else ''}"
                   if self.shared_experts is not None else ""))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        guard = self._guard
        guard.forwards += 1
        try:
            y = self._forward(x)
        except Exception as e:  # a failed collective: name the layer, phase and missing rank
            failure = guard.failure_of(e)
            if failure is None:
                raise
            raise failure from e
        finally:
            guard.end_phase()  # (tracing: the last phase's span)
        note_aux_output(self.aux_loss)  # (find_unused_parameters: an output of the forward)
        if y.requires_grad and self.dispatcher.world_size > 1 and self._gathered is None:
            y.register_hook(guard.backward_mark)
        return y

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        disp = self.dispatcher
        policy = self.shadow_policy
        balance = self.bias_update_rate is not None and self.training
        gather = (policy is not None and policy.needs_counts and disp.world_size > 1) or balance
        try:  # a rank whose input is bad still joins the first collective, so all raise
            if x.dim() < 1 or x.shape[-1] != self.d_model:
                raise ValueError(f"x has shape {tuple(x.shape)}: its last dimension must be "
                                 f"d_model={self.d_model} (pass [..., {self.d_model}] inputs)")
            x_TD = x.reshape(-1, self.d_model)
            logits_TE = self._router_logits(x_TD)
        except Exception as error:  # (no collective ran yet: nothing here is a comm failure)
            if self._gathered is not None:
                raise
            self._guard.mark("counts")
            disp.fail_plan(error, x.device, gather_counts=gather, dedup=self._dedup)
        probs_TE, weights_TK, expert_ids_TK = self._gate(logits_TE)
        if self._gathered is not None:  # every expert here: no collective
            return self._forward_gathered(x, x_TD, logits_TE, probs_TE, weights_TK, expert_ids_TK)

        self._guard.mark("counts")
        meta = disp.plan(x_TD, expert_ids_TK, weights_TK, gather_counts=gather,
                         dedup=self._dedup)
        shadowed = self._decide_shadows(meta, x_TD.dtype)
        if balance:  # the group's routing, every rank alike (it rode on the counts exchange)
            self._load.add([sum(col) for col in zip(*meta.global_counts_host)])
        self._guard.mark("dispatch")
        shared_TD = None
        if self.schedule == "alltoall" and not shadowed:
            send_ND = disp.pack(x_TD, meta)
            grouped = isinstance(self.experts, GroupedExperts)
            # the shared experts run while tokens travel: the first half of the tokens while
            # they go to the experts, the second half while the experts' rows come back (and,
            # in backward, each half while the matching exchange carries gradients back);
            # so they must be row-wise (docs/moe.md)
            beside = self.shared_experts is not None and disp.world_size > 1
            if beside:
                half = x_TD.shape[0] // 2
                x1_TD, x2_TD = x_TD.split([half, x_TD.shape[0] - half])
                shared_params = shared_parameters(self.shared_experts, self.shared_gate)
            # CPU grouped GEMMs run on each source rank's block as it came (no regroup copy
            # there and back); a GPU's, or experts one after another, on the regrouped rows
            by_source = (grouped and meta.regroup and meta.unique is None
                         and x_TD.device.type == "cpu"
                         and self.experts.impl_for(meta.num_recv) == "grouped_mm")
            try:
                if beside:
                    inputs, shared1_TD = disp.exchange_to_experts_beside(
                        send_ND, meta, self._shared_forward, x1_TD, shared_params,
                        as_list=not grouped, by_source=by_source)
                elif by_source:
                    inputs = disp.exchange_by_source(send_ND, meta)
                else:
                    inputs = (disp.exchange(send_ND, meta) if grouped
                              else disp.exchange_to_experts(send_ND, meta))
                self._guard.trace_phase("experts")
                if by_source:
                    outputs = [self.experts(rows, counts)
                               for rows, counts in zip(inputs, meta.recv_counts_host)]
                elif grouped:
                    outputs = self.experts(inputs, meta.tokens_per_expert)
                else:
                    outputs = [expert(rows) for expert, rows in zip(self.experts.values(), inputs)]
            except Exception as error:  # every rank must hear of it before the return exchange
                if _is_comm_failure(error):  # the exchange itself failed: forward() explains
                    raise
                self._guard.mark("combine")
                disp.fail_combine(error, meta)
            self._guard.mark("combine")
            if beside:
                y_TD, shared2_TD = disp.combine_beside(outputs, meta, self._shared_forward,
                                                       x2_TD, shared_params, by_source=by_source)
                shared_TD = torch.cat([shared1_TD, shared2_TD])
            else:
                y_TD = disp.combine(outputs, meta, by_source=by_source)
            tr = _trace_current()
            if tr is not None:  # the backward's phases: combine, experts, dispatch
                trace_backward(tr, self._guard.name, y_TD, outputs, inputs, x_TD)
        else:  # the pipeline (a single step, every peer at once, for "alltoall" + shadows)
            group_size = self.group_size if self.schedule == "pairwise" else disp.world_size
            failure = None
            if self.shared_experts is not None:  # first, so its failure rides on the pipeline's
                try:
                    shared_TD = self._shared_forward(x_TD)
                except Exception as error:  # noqa: BLE001 - raised once the pipeline completes
                    failure = error
            back_ND = pipelined_experts(
                disp.permute(x_TD, meta), meta, self.local_experts, rank=disp.rank,
                world_size=disp.world_size, group=disp.group, group_size=group_size,
                shadowed=shadowed, check_output=disp.check_expert_output,
                expert_numel=self.expert_numel, failure=failure)
            y_TD = disp.unpermute(back_ND, meta)
        if self.shared_experts is not None:
            if shared_TD is None:  # one rank (nothing in flight)
                shared_TD = self._shared_forward(x_TD)
            y_TD = y_TD + shared_TD.to(y_TD.dtype)

        self.aux_loss = self._aux_loss(logits_TE, probs_TE, meta.counts_E)
        self.stats = MoEStats(tokens_per_expert=meta.counts_host,
                              tokens_received=meta.tokens_per_expert,
                              dropped=meta.num_dropped, capacity=meta.capacity,
                              shadowed=tuple(sorted(shadowed)),
                              rows_sent=(meta.num_send if meta.unique is None
                                         else sum(meta.unique.send_splits)),
                              deduplicated=meta.unique is not None)
        return y_TD.view(*x.shape[:-1], self.d_model)

    # -------------------------------------------------------------------------------------
    def _forward_gathered(self, x, x_TD, logits_TE, probs_TE, weights_TK, expert_ids_TK):
        """The layer with every expert on this rank (inside ``gathered_experts``): the same
        routing, capacity and combine as the expert-parallel path, no collective."""
        E, backend = self.num_experts, self.dispatcher.backend
        T, K = expert_ids_TK.shape
        capacity = expert_capacity(self.dispatcher.capacity_factor, T, K, E)
        counts_E = moe_counts(expert_ids_TK, E, backend=backend)
        dest_TK, sent_E, _ = _route(expert_ids_TK, counts_E, capacity)
        sent = sent_E.tolist()
        rows_ND = permute_tokens(x_TD, dest_TK, sum(sent), backend=backend)
        outs = [expert(chunk) for expert, chunk in zip(self._gathered, rows_ND.split(sent))]
        y_TD = unpermute_tokens(torch.cat(outs) if outs else rows_ND, dest_TK, weights_TK,
                                backend=backend)
        if self.shared_experts is not None:
            y_TD = y_TD + self._shared_forward(x_TD).to(y_TD.dtype)
        self.aux_loss = self._aux_loss(logits_TE, probs_TE, counts_E)
        first = self.expert_offset
        self.stats = MoEStats(tokens_per_expert=tuple(counts_E.tolist()),
                              tokens_received=tuple(sent[first:first + self.num_local_experts]),
                              dropped=T * K - sum(sent), capacity=capacity)
        return y_TD.view(*x.shape[:-1], self.d_model)

    def gather_experts(self) -> list[nn.Module]:
        """Every expert of the group, in global order: this rank's own modules and copies of
        the others' (a collective: every rank of the group calls it; no gradient flows to
        the copies). Experts at the same local index must be alike on every rank."""
        W, L = self.dispatcher.world_size, self.num_local_experts
        local = self.local_experts
        if W == 1:
            return local
        self._guard.mark("gather")  # progress mark: a peer waiting for this rank names it
        try:
            return self._gather_experts(local, W, L)
        except Exception as e:  # a failed collective: name the layer, the phase, the rank
            failure = self._guard.failure_of(e)
            if failure is None:
                raise
            raise failure from e
        finally:
            self._guard.end_phase()

    def _gather_experts(self, local: list[nn.Module], W: int, L: int) -> list[nn.Module]:
        group = self._guard.group
        device = next(itertools.chain(self.router.parameters(), self.experts.parameters())).device
        states = [e.state_dict() for e in local]
        sig = [crc([(k, tuple(t.shape), str(t.dtype)) for k, t in st.items()]) for st in states]
        mine = torch.tensor(sig, dtype=torch.int64, device=device)
        every = [torch.empty_like(mine) for _ in range(W)]
        dist.all_gather(every, mine, group=group)
        bad = [w for w in range(W) if not torch.equal(every[w], every[0])]
        if bad:
            raise ValueError(f"gathered_experts needs the experts at each local index alike on "
                             f"every rank (names, shapes, dtypes): rank(s) {bad} differ from rank 0")
        full: list[dict] = [{} for _ in range(W * L)]
        for l, st in enumerate(states):
            for k, t in st.items():
                parts = [torch.empty_like(t) for _ in range(W)]
                dist.all_gather(parts, t.contiguous(), group=group)
                for w in range(W):
                    full[w * L + l][k] = parts[w]
        experts = []
        for e in range(W * L):
            if self.expert_offset <= e < self.expert_offset + L:
                experts.append(local[e - self.expert_offset])
                continue
            copy_ = copy.deepcopy(local[e % L]).requires_grad_(False)
            copy_.load_state_dict(full[e])
            experts.append(copy_)
        return experts

    def _gate(self, logits_TE: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(probs_TE, weights_TK, expert_ids_TK)`` from the fp32 logits
        (:func:`~tribucket.moe.routing.route`, with this layer's options)."""
        return route(logits_TE, self.top_k, score_func=self.score_func,
                     normalize_weights=self.normalize_weights,
                     bias_E=self.expert_bias if self.bias_update_rate is not None else None,
                     groups=(None if self.num_expert_groups is None
                             else (self.num_expert_groups, self.num_limited_groups)),
                     route_scale=self.route_scale)

    def _shared_forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        """The shared experts' output (:func:`~tribucket.moe.shared.shared_forward`)."""
        return shared_forward(self.shared_experts, self.shared_gate, x_TD, self.dispatcher.rank)

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

    def _aux_loss(self, logits_TE: torch.Tensor, probs_TE: torch.Tensor,
                  counts_E: torch.Tensor) -> torch.Tensor:
        return aux_loss(logits_TE, probs_TE, counts_E, self.top_k, self.aux_loss_coef,
                        self.z_loss_coef)
