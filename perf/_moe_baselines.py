"""The MoE layers users pick today, built on the same experts, router and tokens as MoELayer.

Shape legend: T tokens per rank, D model dim, F expert hidden dim, E experts, K top-k,
L experts per rank, W ranks.

Every system gets the same weights: a bias-free router ``Linear(D, E)`` and, per global
expert ``e``, a SwiGLU FFN ``y = (silu(x W1ᵀ) · x W3ᵀ) W2ᵀ`` with ``W1, W3: [F, D]`` and
``W2: [D, F]`` (torchtitan's expert; DeepSpeed and tribucket take it as a module). Gate math
is top-k of the softmax, renormalised over the k chosen (torchtitan ``route_norm=True``,
DeepSpeed's top-2 gate, tribucket's default for k > 1).

* :func:`tribucket_layer` — ``tribucket.moe.MoELayer``;
* :func:`deepspeed_layer` — ``deepspeed.moe.layer.MoE`` (``DS_ACCELERATOR=cpu``, gloo),
  ``drop_tokens=False`` for dropless, ``use_rts=False`` and ``top2_2nd_expert_sampling=False``
  so routing is deterministic; k must be 1 or 2 (DeepSpeed has no top-k beyond 2);
* :func:`torchtitan_layer` — torchtitan's ``MoE`` (router, ``AllToAllTokenDispatcher``,
  ``GroupedExperts`` on ``torch._grouped_mm``) with the ``partial_dtensor`` backend (plain
  tensors and autograd-aware functional all-to-alls, which take uneven splits). Its grouped
  experts cast to bf16 upstream; here they compute in fp32 like the other two (the same
  ``_grouped_mm`` calls without the casts), or the outputs could not be checked equal.
  torchtitan has no capacity factor: it is dropless only.

Each builder returns a module mapping ``x_TD -> y_TD`` or raises :class:`Unavailable` with
the reason (package not installed, unsupported option).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F_
from torch import nn

__all__ = ["SwiGLU", "Unavailable", "tribucket_layer", "deepspeed_layer", "torchtitan_layer",
           "make_weights", "external_worker", "external_table", "external_plot", "SIZES", "FLOOR",
           "FLOOR_ALL", "SHARED", "EXCHANGE"]


class Unavailable(Exception):
    """A baseline cannot run here (the message says why and how to get it)."""


class SwiGLU(nn.Module):
    """One expert: ``(silu(x W1ᵀ) · x W3ᵀ) W2ᵀ``, no biases."""

    def __init__(self, w1_FD: torch.Tensor, w2_DF: torch.Tensor, w3_FD: torch.Tensor):
        super().__init__()
        self.w1 = nn.Linear(w1_FD.shape[1], w1_FD.shape[0], bias=False)
        self.w2 = nn.Linear(w2_DF.shape[1], w2_DF.shape[0], bias=False)
        self.w3 = nn.Linear(w3_FD.shape[1], w3_FD.shape[0], bias=False)
        with torch.no_grad():
            self.w1.weight.copy_(w1_FD)
            self.w2.weight.copy_(w2_DF)
            self.w3.weight.copy_(w3_FD)

    def forward(self, x):
        return self.w2(F_.silu(self.w1(x)) * self.w3(x))


def make_weights(d_model: int, hidden: int, num_experts: int, seed: int = 0,
                 shared_hidden: int = 0) -> dict:
    """Router ``[E, D]`` and every expert's ``w1 [E, F, D]``, ``w2 [E, D, F]``, ``w3``; with
    ``shared_hidden``, one shared SwiGLU expert's ``shared_w1 [Fs, D]``, ``shared_w2``, ...
    (no shared expert: the weights stay None)."""
    g = torch.Generator().manual_seed(seed)
    s_in, s_hid = d_model ** -0.5, hidden ** -0.5
    out = dict(router_ED=torch.randn(num_experts, d_model, generator=g) * s_in,
               w1_EFD=torch.randn(num_experts, hidden, d_model, generator=g) * s_in,
               w2_EDF=torch.randn(num_experts, d_model, hidden, generator=g) * s_hid,
               w3_EFD=torch.randn(num_experts, hidden, d_model, generator=g) * s_in,
               shared=None)
    if shared_hidden:
        out["shared"] = (torch.randn(shared_hidden, d_model, generator=g) * s_in,
                         torch.randn(d_model, shared_hidden, generator=g) * shared_hidden ** -0.5,
                         torch.randn(shared_hidden, d_model, generator=g) * s_in)
    return out


def _local(weights: dict, rank: int, L: int) -> list[SwiGLU]:
    sl = slice(rank * L, (rank + 1) * L)
    return [SwiGLU(a, b, c) for a, b, c in zip(weights["w1_EFD"][sl], weights["w2_EDF"][sl],
                                               weights["w3_EFD"][sl])]


def _router(weights: dict) -> nn.Linear:
    E, D = weights["router_ED"].shape
    r = nn.Linear(D, E, bias=False)
    with torch.no_grad():
        r.weight.copy_(weights["router_ED"])
    return r


def tribucket_layer(weights: dict, *, top_k: int, capacity_factor: float | None,
                    score_func: str = "softmax", balance: float | None = None,
                    groups: tuple | None = None, route_scale: float = 1.0,
                    shared: bool = True, **kw) -> nn.Module:
    """MoELayer with its grouped experts (the local experts' weights stacked), the shared
    expert when ``weights`` has one (and ``shared``), the routing bias when ``balance``,
    group-limited routing when ``groups = (expert groups, groups kept)``."""
    from tribucket.moe import GroupedExperts, MoELayer

    E, D = weights["router_ED"].shape
    rank, world = dist.get_rank(), dist.get_world_size()
    experts = GroupedExperts.from_experts(_swiglu_experts(_local(weights, rank, E // world)))
    shared_expert = SwiGLU(*weights["shared"]) if shared and weights["shared"] is not None else None
    return MoELayer(experts, E, D, top_k=top_k, router=_router(weights),
                    capacity_factor=capacity_factor, shared_experts=shared_expert,
                    score_func=score_func, bias_update_rate=balance,
                    num_expert_groups=groups[0] if groups else None,
                    num_limited_groups=groups[1] if groups else None, route_scale=route_scale,
                    **kw)


def _swiglu_experts(modules: list[SwiGLU]) -> list[nn.Module]:
    """The same weights in tribucket's SwiGLUExpert (what GroupedExperts stacks)."""
    from tribucket.moe import SwiGLUExpert

    out = []
    for m in modules:
        e = SwiGLUExpert(m.w1.in_features, m.w1.out_features)
        e.load_state_dict(m.state_dict())
        out.append(e)
    return out


def tribucket_dedup(weights: dict, **kw) -> nn.Module:
    """The same layer with ``dedup="auto"``: each token sent once per rank in the steps
    where that at most halves the rows."""
    return tribucket_layer(weights, dedup="auto", **kw)


def tribucket_no_shared(weights: dict, **kw) -> nn.Module:
    """The same layer without its shared expert (what the shared expert costs on top)."""
    if weights["shared"] is None:
        raise Unavailable("this size has no shared expert")
    return tribucket_layer(weights, shared=False, **kw)


class _DeepSpeedWrap(nn.Module):
    def __init__(self, moe):
        super().__init__()
        self.moe = moe

    def forward(self, x_TD):
        return self.moe(x_TD)[0]  # (output, l_aux, exp_counts)


def deepspeed_layer(weights: dict, *, top_k: int, capacity_factor: float | None,
                    score_func: str = "softmax", balance: float | None = None,
                    groups: tuple | None = None, route_scale: float = 1.0) -> nn.Module:
    if groups or route_scale != 1.0:
        raise Unavailable("DeepSpeed's gate has no group-limited routing or route scale")
    if top_k > 2:
        raise Unavailable(f"DeepSpeed's gate supports top_k 1 or 2, not {top_k}")
    if weights["shared"] is not None:
        raise Unavailable("DeepSpeed's MoE has no shared expert (its use_residual mixes a dense "
                          "MLP with a learned coefficient: another function)")
    if score_func != "softmax" or balance is not None:
        raise Unavailable("DeepSpeed's gate is softmax only, with no routing bias")
    if os.environ.get("DS_ACCELERATOR") != "cpu":
        raise Unavailable("set DS_ACCELERATOR=cpu before deepspeed is imported")
    try:
        import deepspeed
        from deepspeed.moe.layer import MoE
    except ImportError as e:
        raise Unavailable(f"deepspeed is not installed ({e}); pip install 'tribucket[bench]'")
    deepspeed.init_distributed(dist_backend="gloo")
    E, D = weights["router_ED"].shape
    rank, world = dist.get_rank(), dist.get_world_size()
    L = E // world
    experts = _local(weights, rank, L)
    moe = MoE(D, experts[0], num_experts=E, ep_size=world, k=top_k,
              capacity_factor=capacity_factor or 1.0, eval_capacity_factor=capacity_factor or 1.0,
              min_capacity=0, drop_tokens=capacity_factor is not None, use_rts=False,
              top2_2nd_expert_sampling=False)
    moe.set_deepspeed_parallelism()
    with torch.no_grad():
        moe.deepspeed_moe.gate.wg.weight.copy_(weights["router_ED"])
        for mine, src in zip(moe.deepspeed_moe.experts.deepspeed_experts, experts):
            mine.load_state_dict(src.state_dict())
    return _DeepSpeedWrap(moe)


def torchtitan_layer(weights: dict, *, top_k: int, capacity_factor: float | None,
                     score_func: str = "softmax", balance: float | None = None,
                     groups: tuple | None = None, route_scale: float = 1.0) -> nn.Module:
    """torchtitan's MoE as its config builds it: router (``score_func``, ``route_norm``),
    all-to-all dispatcher, grouped experts, ``load_balance_coeff=balance`` and, when
    ``weights`` has one, its ``FeedForward`` shared expert."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torchtitan.distributed.utils import set_spmd_backend
        from torchtitan.models.common.feed_forward import FeedForward
        from torchtitan.models.common.linear import Linear
        from torchtitan.models.common.moe import MoE, GroupedExperts, RoutedExperts, TokenChoiceTopKRouter
        from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher
    except ImportError as e:
        raise Unavailable(f"torchtitan is not installed ({e}); pip install 'tribucket[bench]'")
    if capacity_factor is not None:
        raise Unavailable("torchtitan's MoE is dropless only (no capacity factor)")

    class FP32GroupedExperts(GroupedExperts):
        """torchtitan's grouped experts without the bf16 casts (same _grouped_mm calls)."""

        def forward(self, x_RD, num_tokens_per_expert_E):
            offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
            h = F_.silu(torch._grouped_mm(x_RD, self.w1_EFD.transpose(-2, -1), offs=offs))
            h = h * torch._grouped_mm(x_RD, self.w3_EFD.transpose(-2, -1), offs=offs)
            return torch._grouped_mm(h, self.w2_EDF.transpose(-2, -1), offs=offs)

    class FP32GroupedExpertsConfig(GroupedExperts.Config):
        def build(self, **kwargs):
            return FP32GroupedExperts(self)

    set_spmd_backend("partial_dtensor")
    E, D = weights["router_ED"].shape
    Fh = weights["w1_EFD"].shape[1]
    rank, world = dist.get_rank(), dist.get_world_size()
    L = E // world
    shared_cfg = None
    if weights["shared"] is not None:
        Fs = weights["shared"][0].shape[0]
        shared_cfg = FeedForward.Config(w1=Linear.Config(in_features=D, out_features=Fs),
                                        w2=Linear.Config(in_features=Fs, out_features=D),
                                        w3=Linear.Config(in_features=D, out_features=Fs))
    cfg = MoE.Config(
        num_experts=E, load_balance_coeff=balance, shared_experts=shared_cfg,
        routed_experts=RoutedExperts.Config(
            inner_experts=FP32GroupedExpertsConfig(dim=D, hidden_dim=Fh, num_experts=L),
            token_dispatcher=AllToAllTokenDispatcher.Config(num_experts=E, top_k=top_k)),
        router=TokenChoiceTopKRouter.Config(
            num_experts=E, gate=Linear.Config(in_features=D, out_features=E), top_k=top_k,
            score_func=score_func, route_norm=top_k > 1, route_scale=route_scale,
            num_expert_groups=groups[0] if groups else None,
            num_limited_groups=groups[1] if groups else None))
    moe = cfg.build()  # (expert_bias_E: zeros of [E], registered by the constructor)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    moe.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh)
    sl = slice(rank * L, (rank + 1) * L)
    inner = moe.routed_experts.inner_experts
    with torch.no_grad():
        moe.router.gate.weight.copy_(weights["router_ED"])
        inner.w1_EFD.copy_(weights["w1_EFD"][sl])
        inner.w2_EDF.copy_(weights["w2_EDF"][sl])
        inner.w3_EFD.copy_(weights["w3_EFD"][sl])
        if weights["shared"] is not None:
            for lin, w in zip((moe.shared_experts.w1, moe.shared_experts.w2,
                               moe.shared_experts.w3), weights["shared"]):
                lin.weight.copy_(w)
    return _TorchtitanWrap(moe)


class _TorchtitanWrap(nn.Module):
    def __init__(self, moe):
        super().__init__()
        self.moe = moe

    def forward(self, x_TD):
        return self.moe(x_TD.unsqueeze(0)).squeeze(0)  # it takes [B, L, D]


# -- the comparison run (perf/bench_moe.py --part external) ------------------------------
#: the sizes: the demo's layer, a wide one, and a DeepSeek-like one (fine-grained experts,
#: top-4 of a sigmoid router inside 2 of 4 expert groups, DeepSeek-V3's route scale, the
#: aux-loss-free routing bias, one shared expert); capacity
#: factors run besides dropless where the size lists them
SIZES = {"demo (D 64, F 128, 2 experts/rank, 2048 tokens/rank)":
         dict(D=64, F=128, L=2, T=2048, factors=(None, 1.25)),
         "wide (D 256, F 1024, 4 experts/rank, 4096 tokens/rank)":
         dict(D=256, F=1024, L=4, T=4096, factors=(None, 1.25)),
         "deepseek (D 256, F 128, 16 experts/rank, top-4 of 32 by sigmoid inside 2 of 4 "
         "expert groups, route scale 2.5, routing bias, 1 shared expert of F 256, "
         "4096 tokens/rank)":
         dict(D=256, F=128, L=16, T=4096, K=4, score_func="sigmoid", balance=1e-3, shared=256,
              groups=(4, 2), route_scale=2.5, factors=(None,))}
TOP_K = 2
BUILDERS = {"tribucket MoELayer": tribucket_layer, "DeepSpeed MoE": deepspeed_layer,
            "torchtitan MoE": torchtitan_layer,
            "tribucket MoELayer, dedup='auto'": tribucket_dedup,
            "tribucket MoELayer, no shared expert": tribucket_no_shared}
#: one process computing what the slowest rank's experts compute, nothing else
FLOOR = "compute floor"
#: the same floor computed by every rank at once (each rank the busiest rank's rows): what
#: the floor costs when the two processes share the machine, as the layer's ranks do
FLOOR_ALL = "compute floor, every rank at once"
#: one process running the shared expert alone, forward+backward on a rank's tokens
SHARED = "shared expert alone"
#: both ranks exchanging the layer's token rows (the dispatch all-to-all and its reverse, as
#: forward and backward run them), nothing else: what the shared expert can hide behind
EXCHANGE = "token exchange alone"


def _kept_slots_deepspeed(layer: nn.Module) -> list:
    """A forward hook's box: token-slots DeepSpeed's gate kept (the gate's output is
    ``(l_aux, C, E, indices, locations, gates, exp_counts)``; a dropped slot's gate is 0)."""
    box = []
    layer.moe.deepspeed_moe.gate.register_forward_hook(
        lambda _m, _i, out: box.append(sum(int(torch.count_nonzero(g)) for g in out[5])))
    return box


def external_worker(rank: int, world: int, init_file: str, args, queue) -> None:
    """One (size, capacity) configuration on ``world`` gloo ranks: check, then time interleaved."""
    import statistics
    import time

    try:
        from _bench import turn_order
        from _moe_counts import count_step
    except ImportError:  # pragma: no cover - imported as perf._moe_baselines
        from perf._bench import turn_order
        from perf._moe_counts import count_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    size, cf, steps, warmup = args.ext_size, args.ext_capacity, args.ext_steps, args.ext_warmup
    s = SIZES[size]
    E, K = s["L"] * world, s.get("K", TOP_K)
    weights = make_weights(s["D"], s["F"], E, shared_hidden=s.get("shared", 0))
    systems, skipped = {}, {}
    for name, build in BUILDERS.items():
        try:
            systems[name] = build(weights, top_k=K, capacity_factor=cf,
                                  score_func=s.get("score_func", "softmax"),
                                  balance=s.get("balance"), groups=s.get("groups"),
                                  route_scale=s.get("route_scale", 1.0))
        except Unavailable as why:
            if name != "tribucket MoELayer, no shared expert":
                skipped[name] = str(why)
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(s["T"], s["D"], generator=g)
    gy = torch.randn(s["T"], s["D"], generator=g)
    ref = "tribucket MoELayer"
    ds_kept = _kept_slots_deepspeed(systems["DeepSpeed MoE"]) if "DeepSpeed MoE" in systems else None

    def run(m):
        xs = x.clone().requires_grad_()
        m.zero_grad(set_to_none=True)
        y = m(xs)
        (y * gy).sum().backward()
        return y.detach(), xs.grad

    # the check: the same y and dL/dx; with a capacity, the same number of kept slots, and
    # the same y only where no slot was dropped (DeepSpeed drops second choices first,
    # tribucket the latest tokens: different slots go once some must)
    check = {}
    outs = {name: run(m) for name, m in systems.items()}
    dropped = systems[ref].stats.dropped
    for name, (y, gx) in outs.items():
        if name == ref or name == "tribucket MoELayer, no shared expert":
            continue
        if cf is not None and ds_kept is not None:  # (without DeepSpeed: the y check alone)
            kept = K * s["T"] - dropped
            assert ds_kept[-1] == kept, f"DeepSpeed kept {ds_kept[-1]} token-slots, tribucket {kept}"
            check[name] = f"same token-slots kept ({kept} of {K * s['T']} on rank {rank})"
            if dropped:
                check[name] += "; not the same ones (DeepSpeed drops second choices first)"
                continue
        err = max(float((y - outs[ref][0]).abs().max()), float((gx - outs[ref][1]).abs().max()))
        assert err < 1e-4, f"{name} computes another function than {ref}: max error {err:.3g}"
        check[name] = ((check[name] + "; ") if name in check else "") + (
            f"y and dL/dx equal to tribucket's (max abs diff {err:.1e})")
    counts = {name: count_step(lambda m=m: run(m)) for name, m in systems.items()}
    floor = _compute_floor(systems[ref], weights, s, rank, world)
    # measured beside the systems: FLOOR and SHARED on rank 0 alone, FLOOR_ALL and EXCHANGE
    # on every rank
    extra = {FLOOR: floor, FLOOR_ALL: floor} if world > 1 else {FLOOR: floor}
    if weights["shared"] is not None:
        extra[SHARED] = _shared_alone(weights, s)
        extra[EXCHANGE] = _exchange_alone(systems[ref], s, rank, world, x)
    names = list(systems) + list(extra)

    wall = {name: [] for name in names}
    cpu = {name: [] for name in names}
    for step in range(warmup + steps):
        for name in turn_order(names, step):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            if name in systems:
                run(systems[name])
            elif name in (EXCHANGE, FLOOR_ALL):  # every rank
                extra[name]()
            elif rank == 0:  # one process; the other rank waits at the barrier
                extra[name]()
            c = torch.tensor([time.process_time() - c0], dtype=torch.float64)
            dist.barrier()
            t = time.perf_counter() - t0
            dist.all_reduce(c)  # CPU seconds of every rank's process (gloo's threads included)
            if step >= warmup:
                wall[name].append(t)
                cpu[name].append(float(c))
    if rank == 0:
        rows = []
        for name in names:
            what = ("reference" if name == ref else
                    floor.what.replace("one process", "every rank at once (each the same rows)")
                    if name == FLOOR_ALL else
                    "another function (no shared expert): what the shared expert costs"
                    if name == "tribucket MoELayer, no shared expert" else
                    extra[name].what if name in extra else "not checked")
            rows.append(dict(system=name, step_ms=1e3 * statistics.median(wall[name]),
                             cpu_ms=1e3 * statistics.median(cpu[name]),
                             steps_ms=[1e3 * t for t in wall[name]],
                             cpu_steps_ms=[1e3 * t for t in cpu[name]],
                             tokens_per_s=world * s["T"] / statistics.median(wall[name]),
                             check=check.get(name, what),
                             **{k: counts[name][k] if name in counts else None
                                for k in ("collectives", "collectives_total", "host_syncs",
                                          "aten_ops")}))
        for r in rows:  # tribucket's step over each system's, paired step by step
            r["tribucket_speedup"] = statistics.median(
                b / a for a, b in zip(wall[ref], wall[r["system"]]))
            r["tribucket_cpu_speedup"] = statistics.median(
                b / a for a, b in zip(cpu[ref], cpu[r["system"]]))
        queue.put((rank, dict(rows=rows, skipped=skipped)))
    else:
        queue.put((rank, None))
    dist.destroy_process_group()


def _compute_floor(layer, weights: dict, s: dict, rank: int, world: int):
    """The least a step of ``layer`` can cost: the experts' matmuls of the busiest rank (the
    rows its experts received in the last forward, the same grouped matmuls), the shared
    expert on its tokens, forward and backward, in one process, with no routing, no
    permutation and no exchange. Returns the step function (``.what`` describes it)."""
    from tribucket.moe import GroupedExperts

    every = [torch.empty(layer.num_local_experts, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(every, torch.tensor(layer.stats.tokens_received))
    busiest = max(range(world), key=lambda r: int(every[r].sum()))
    counts = every[busiest].tolist()
    L = layer.num_local_experts
    experts = GroupedExperts.from_experts(_swiglu_experts(_local(weights, busiest, L)))
    shared = SwiGLU(*weights["shared"]) if weights["shared"] is not None else None
    g = torch.Generator().manual_seed(7)
    rows = torch.randn(sum(counts), s["D"], generator=g)
    tokens = torch.randn(s["T"], s["D"], generator=g)

    def step():
        r = rows.clone().requires_grad_()
        y = experts(r, counts)
        loss = y.sum()
        if shared is not None:
            t = tokens.clone().requires_grad_()
            loss = loss + shared(t).sum()
        experts.zero_grad(set_to_none=True)
        loss.backward()

    step.what = (f"rank {busiest}'s {sum(counts)} expert rows ({L} grouped experts)"
                 + (f" + the shared expert on {s['T']} tokens" if shared is not None else "")
                 + ", forward+backward, one process, no routing or exchange")
    return step


def _shared_alone(weights: dict, s: dict):
    """The shared expert's forward+backward on a rank's ``T`` tokens, one process (what the
    layer's shared expert costs where nothing hides it)."""
    shared = SwiGLU(*weights["shared"])
    tokens = torch.randn(s["T"], s["D"], generator=torch.Generator().manual_seed(8))

    def step():
        t = tokens.clone().requires_grad_()
        shared.zero_grad(set_to_none=True)
        shared(t).sum().backward()

    step.what = f"the shared expert on {s['T']} tokens, forward+backward, one process"
    return step


def _exchange_alone(layer, s: dict, rank: int, world: int, x: torch.Tensor):
    """The layer's token all-to-all (the rows a forward of ``x`` sends, the same splits and
    width: one row per token-slot, or per (token, rank) with its extra columns when the
    dispatch is deduplicated) and the reverse exchange its backward runs, on every rank: the
    time the shared expert's forward and backward run beside."""
    from tribucket.comm import all_to_all

    disp, metas = layer.dispatcher, []
    plan = disp.plan
    disp.plan = lambda *a, **kw: metas.append(plan(*a, **kw)) or metas[-1]
    try:
        with torch.no_grad():
            layer(x)
    finally:
        del disp.plan  # the class's method again
    meta = metas[-1]
    u = meta.unique
    send, recv = (list(u.send_splits), list(u.recv_splits)) if u else (
        list(meta.send_splits), list(meta.recv_splits))
    width = s["D"] + (u.meta_cols if u else 0)
    rows = torch.randn(sum(send), width, generator=torch.Generator().manual_seed(9))

    def step():
        back = all_to_all(rows, send, recv)
        all_to_all(back, recv, send)

    kind = "(token, rank) rows, deduplicated" if u else "token rows"
    step.what = (f"rank {rank}'s {sum(send)} {kind}, to the experts' ranks and back (two "
                 "all-to-alls, the layer's splits), every rank, nothing else")
    return step


def _collectives(row: dict) -> int:
    """Collectives of one step from the counts by name (functional-collective wrappers such as
    ``_wrap_tensor_autograd`` are not communication)."""
    return sum(n for name, n in row["collectives"].items()
               if name.startswith(("all_", "reduce", "broadcast", "batch_isend", "send", "recv",
                                   "isend", "irecv")))


def external_table(result) -> str:
    c, m = result["config"], result["machine"]
    lines = [
        f"MoE layer forward+backward against DeepSpeed's and torchtitan's MoE, "
        f"{c['world_size']} gloo ranks x 1 thread ({m['cores']}-core CPU shared with other jobs, "
        f"torch {m['torch']}), top-{c['top_k']} of a softmax router (deepseek: top-4 of a sigmoid "
        f"router inside 2 of 4 expert groups, weights times 2.5, with the routing bias, and a "
        f"shared expert), SwiGLU experts (tribucket's "
        f"grouped), fp32; same router, expert and shared-expert weights, same tokens. Systems interleaved step by step, every other step in reverse order; step = wall "
        f"time between barriers (the slowest rank), median over the measured steps; CPU = CPU "
        f"seconds of both ranks' processes in the step (steadier than wall time on a loaded "
        f"machine). Speed-up: the median over steps of (their step / tribucket's step), paired "
        f"in the same round. Collectives, host reads and ATen ops: one forward+backward, one rank.",
        "",
        "| size | capacity | system | step (ms) | tokens/s | tribucket speed-up (wall) | "
        "CPU (ms) | tribucket speed-up (CPU) | collectives | host reads | ATen ops | load avg |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for run in result["runs"]:
        cap = "dropless" if run["capacity_factor"] is None else f"factor {run['capacity_factor']}"
        load = f"{run['load_avg_1min']['before']:.1f}-{run['load_avg_1min']['after']:.1f}"
        for r in run["rows"]:
            lines.append(
                f"| {run['size'].split(' (')[0]} | {cap} | {r['system']} | {r['step_ms']:.1f} | "
                f"{r['tokens_per_s']:,.0f} | {r['tribucket_speedup']:.2f}x | {r['cpu_ms']:.1f} | "
                f"{r['tribucket_cpu_speedup']:.2f}x | "
                + (f"{_collectives(r)} | {r['host_syncs']} | {r['aten_ops']}"
                   if r["collectives"] is not None else "- | - | -") + f" | {load} |")
        for name, why in run["skipped"].items():
            lines.append(f"| {run['size'].split(' (')[0]} | {cap} | {name} | skipped: {why} "
                         f"| | | | | | | | |")
    steps = {run["size"]: (run["steps"], run["warmup"]) for run in result["runs"]}
    lines += ["", "Sizes: " + "; ".join(
        f"{k.split(' (')[0]} = {k.split(' (')[1][:-1]}"
        + (f" ({steps[k][0]} measured steps after {steps[k][1]} warm-up)" if k in steps else "")
        for k in SIZES) + "."]
    lines += ["", "Checked before timing, against tribucket's layer (or what the row is):"]
    for run in result["runs"]:
        cap = "dropless" if run["capacity_factor"] is None else f"factor {run['capacity_factor']}"
        for r in run["rows"][1:]:
            lines.append(f"- {run['size'].split(' (')[0]}, {cap}, {r['system']}: {r['check']}")
    t = result["targets"]
    lines += ["", "Targets (dropless; speed-ups at least, the others at most): " + "; ".join(
        f"{k}: {v['value']:.2f}x {'>=' if v.get('kind', 'speed-up') == 'speed-up' else '<='} "
        f"{v['threshold']}x ({'met' if v['met'] else 'NOT met'}"
        + (f"; {v['note']}" if v.get("note") else "") + ")" for k, v in t.items()) + "."]
    return "\n".join(lines) + "\n"


def external_plot(result, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    fig, axes = plt.subplots(1, len(runs), figsize=(3.4 * len(runs), 3.2))
    for ax, run in zip(axes if len(runs) > 1 else [axes], runs):
        names = [r["system"].replace(" ", "\n", 1) for r in run["rows"]]
        vals = [r["tokens_per_s"] for r in run["rows"]]
        palette = {"tribucket MoELayer": "#27a", "DeepSpeed MoE": "#999", "torchtitan MoE": "#4a7",
                   "tribucket MoELayer, no shared expert": "#8bd",
                   "tribucket MoELayer, dedup='auto'": "#59b", FLOOR: "#ddd",
                   FLOOR_ALL: "#ddd", SHARED: "#eee", EXCHANGE: "#eee"}
        ax.bar(range(len(vals)), vals, color=[palette.get(r["system"], "#999") for r in run["rows"]])
        ax.set_xticks(range(len(vals)), names, fontsize=7)
        cap = "dropless" if run["capacity_factor"] is None else f"capacity {run['capacity_factor']}"
        ax.set_title(f"{run['size'].split(' (')[0]}, {cap}", fontsize=9)
        ax.tick_params(axis="y", labelsize=7)
    (axes[0] if len(runs) > 1 else axes).set_ylabel("tokens/s, forward+backward")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
