"""Training with MoE layers across ranks: expert x data parallelism, the default expert
gradient scale, aux losses and clipping, against a dense single-process reference.

Shape legend: T tokens, D model dim, E experts (global), K top-k, L experts per rank.

Every rank builds the whole model (every expert) from one seed and can regenerate every
rank's tokens, so it trains the dense equivalent itself: one process, every rank's loss,
their mean (what DDP's averaging computes), ``torch.nn.utils.clip_grad_norm_`` and the same
optimizer; the distributed run must end with the same parameters.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import tribucket
from torch.distributed.device_mesh import init_device_mesh

from tribucket.moe import (MoELayer, aux_losses, expert_data_parallel_groups,
                           expert_data_parallel_groups_from_mesh)
from test_moe import D, _dense_moe, _error_of, _ffn

K = 2  # top-k of the training tests
AUX, Z = 0.1, 0.01  # aux and z loss coefficients (both reach the router's gradient)


class _Net(nn.Module):
    """in -> ReLU -> MoE -> head; ``moe`` is an MoELayer, or (reference) router + experts.
    ``side``: a layer before the head that runs only when the batch's first entry is
    positive, so the ranks leave different parameters unused."""

    def __init__(self, moe: nn.Module, seed: int, side: bool = False):
        super().__init__()
        torch.manual_seed(seed)
        self.inp, self.head = nn.Linear(D, D), nn.Linear(D, D)
        self.side = nn.Linear(D, D) if side else None
        self.moe = moe

    def forward(self, x):
        h = self.moe(torch.relu(self.inp(x)))
        if self.side is not None and x[0, 0] > 0:
            h = h + self.side(h)
        return self.head(h)


class _DenseMoE(nn.Module):
    """The reference: every expert on this process, the layer written out (test_moe)."""

    def __init__(self, router, experts):
        super().__init__()
        self.router, self.experts = router, nn.ModuleList(experts)

    def forward(self, h_TD):
        y_TD, _, _ = _dense_moe(h_TD, self.router, list(self.experts), K, None, True)
        logits = self.router(h_TD)
        probs = logits.softmax(-1)
        E = len(self.experts)
        f = torch.bincount(probs.topk(K, -1).indices.reshape(-1), minlength=E).float()
        f = f / (h_TD.shape[0] * K)
        self.aux = AUX * E * (f * probs.mean(0)).sum() \
            + Z * (torch.logsumexp(logits, -1) ** 2).mean()
        return y_TD


def _data(seed: int, rank: int, step: int, micro: int = 0):
    g = torch.Generator().manual_seed(seed * 1000 + rank * 10 + step + 100 * micro)
    T = 7 + 3 * rank  # uneven tokens per rank: each rank's loss is the mean over its own
    return torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)


def _models(ep_size: int, L: int, seed: int, ep, replicas, side: bool = False):
    """``(model, ref, first)``: this rank's distributed model (its experts from global index
    ``first``, every rank's copies a bit off so entering must broadcast) and the dense
    reference with every expert."""
    rank = dist.get_rank()
    E = ep_size * L
    torch.manual_seed(seed)
    router = nn.Linear(D, E, bias=False)
    experts = [_ffn(seed * 100 + e) for e in range(E)]
    ref = _Net(_DenseMoE(copy.deepcopy(router), copy.deepcopy(experts)), seed, side)
    first = dist.get_rank(ep) * L
    expert_src = dist.get_process_group_ranks(replicas)[0] if replicas is not None else rank
    local = [copy.deepcopy(experts[e]) for e in range(first, first + L)]
    layer = MoELayer(local, E, D, top_k=K, router=copy.deepcopy(router), group=ep,
                     replica_group=replicas, aux_loss_coef=AUX, z_loss_coef=Z)
    model = _Net(layer, seed, side)
    with torch.no_grad():  # off-by-a-bit copies on other ranks: entering must broadcast
        for p in model.parameters():
            expert = getattr(p, "_tribucket_expert_parallel", False)
            if (expert and rank != expert_src) or (not expert and rank > 0):
                p.add_(0.01 * (rank + 1))
    return model, ref, first


def _train_reference(ref, seed: int, steps, micros: int = 1, max_norm=None) -> list:
    """Train the dense reference on every rank's data (the mean of their losses); the
    gradient norms before clipping."""
    world = dist.get_world_size()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    ref_norms = []
    for step in steps:
        for micro in range(micros):
            total = 0.0
            for r in range(world):
                x, t = _data(seed, r, step, micro)
                total = total + nn.functional.mse_loss(ref(x), t) + ref.moe.aux
            (total / world).backward()
        if max_norm is not None:
            ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm))
        ref_opt.step()
        ref_opt.zero_grad()
    return ref_norms


def _wanted(ref, first: int, L: int) -> dict:
    """The reference's parameters under the distributed model's names (this rank's experts)."""
    want = {"inp.weight": ref.inp.weight, "inp.bias": ref.inp.bias, "head.weight": ref.head.weight,
            "head.bias": ref.head.bias, "moe.router.weight": ref.moe.router.weight}
    if ref.side is not None:
        want.update({"side.weight": ref.side.weight, "side.bias": ref.side.bias})
    for e in range(first, first + L):
        for n, p in ref.moe.experts[e].named_parameters():
            want[f"moe.experts.{e}.{n}"] = p
    return {n: p.detach().clone() for n, p in want.items()}


def _train_worker(case):
    """Train the distributed model and the dense reference; return what the test compares."""
    rank = dist.get_rank()
    ep_size, L, seed, steps, max_norm = (case["ep_size"], case["L"], case["seed"],
                                         case["steps"], case["max_norm"])
    micros = case.get("accumulate", 1)  # micro-batches per step, all but the last in no_sync
    if case.get("mesh"):  # the groups from a DeviceMesh whose EP groups are not consecutive
        mesh = init_device_mesh("cpu", (ep_size, dist.get_world_size() // ep_size),
                                mesh_dim_names=("ep", "dp"))
        ep, replicas = expert_data_parallel_groups_from_mesh(mesh)
    else:
        ep, replicas = expert_data_parallel_groups(ep_size)
    model, ref, first = _models(ep_size, L, seed, ep, replicas, case.get("side", False))
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    norms, side_used, skipped = [], [], []
    with tribucket.fused_bucketing(model, **case.get("options", {})) as reducer:
        n_expert_reducers = len(reducer.expert_reducers)
        if case.get("expert_hook"):  # torch's own hook, given the replica group, on the experts
            reducer.expert_reducers[0].register_comm_hook(replicas, default_hooks.allreduce_hook)
        for step in range(steps):
            for micro in range(micros):
                x, t = _data(seed, rank, step, micro)
                with reducer.no_sync() if micro < micros - 1 else contextlib.nullcontext():
                    (nn.functional.mse_loss(model(x), t) + aux_losses(model)).backward()
            side_used.append(bool(x[0, 0] > 0))
            skipped.append(reducer.stats.buckets_skipped)
            if max_norm is not None:
                norms.append(tribucket.clip_grad_norm_(model, max_norm))
            opt.step()
            opt.zero_grad()
    synced = [r.stats.iterations for r in [reducer, *reducer.expert_reducers]]
    ref_norms = _train_reference(ref, seed, range(steps), micros, max_norm)
    want = _wanted(ref, first, L)
    got = dict(model.named_parameters())
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    return {"got": {n: p.detach().clone() for n, p in got.items()}, "want": want,
            "norms": norms, "ref_norms": ref_norms, "expert_reducers": n_expert_reducers,
            "synced": synced, "side_used": side_used, "skipped": skipped}


def _check_training(results, case):
    for rank, out in enumerate(results):
        for n, p in out["got"].items():
            torch.testing.assert_close(p, out["want"][n], atol=2e-5, rtol=1e-4,
                                       msg=lambda m: f"rank {rank} {n} after training: {m}")
        assert out["expert_reducers"] == (1 if case["ep_size"] < len(results) else 0)
        # no_sync holds back every reducer, the experts' included: one sync per step
        assert out["synced"] == [case["steps"]] * (1 + out["expert_reducers"]), out["synced"]
        if case["max_norm"] is not None:
            torch.testing.assert_close(torch.stack(out["norms"]), torch.stack(out["ref_norms"]),
                                       atol=1e-5, rtol=1e-5)
            # the same total on every rank (so the same clip factor), to the bit
            assert all(torch.equal(a, b) for a, b in zip(out["norms"], results[0]["norms"]))
    if case["max_norm"] is not None:  # the case must actually clip
        assert max(float(n) for n in results[0]["ref_norms"]) > case["max_norm"]
    if case.get("side"):  # the case must leave the side layer unused on some ranks only,
        # and on every rank at some step: its bucket is sent then skipped, alike everywhere
        used = [[out["side_used"][step] for out in results] for step in range(case["steps"])]
        assert any(any(u) and not all(u) for u in used), used
        assert any(not any(u) for u in used), used
        for step, u in enumerate(used):
            counts = {out["skipped"][step] for out in results}
            assert counts == ({2} if not any(u) else {0}), (step, u, counts)  # weight, bias
    dense = [n for n in results[0]["got"] if ".experts." not in n]
    for out in results[1:]:  # data-parallel parameters bit-identical across ranks
        assert all(torch.equal(out["got"][n], results[0]["got"][n]) for n in dense)


CASES = {
    # 2 expert-parallel groups x 2 data-parallel replicas, clipping on
    "ep2xdp2_clip": dict(ep_size=2, L=2, seed=3, steps=3, max_norm=0.15),
    # pure expert parallelism over the world: the default scale alone makes the mean
    "ep4": dict(ep_size=4, L=1, seed=4, steps=2, max_norm=None),
    # gradient accumulation: 2 micro-batches per step, the first under reducer.no_sync();
    # the experts' buckets go through torch's allreduce_hook on the replica group
    "ep2xdp2_accumulate_hook": dict(ep_size=2, L=1, seed=5, steps=2, max_norm=None,
                                    accumulate=2, expert_hook=True),
    # the groups from init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "dp")): EP groups
    # {0, 2} and {1, 3}, replica groups {0, 1} and {2, 3}
    "ep2xdp2_mesh": dict(ep_size=2, L=2, seed=6, steps=2, max_norm=0.15, mesh=True),
    # a layer each rank runs only for some batches, and the buckets no rank used not sent:
    # the reducers of both groups (world, replicas) agree on what to skip
    "ep2xdp2_skip_unused": dict(ep_size=2, L=2, seed=10, steps=4, max_norm=None, side=True,
                                options=dict(find_unused_parameters=True,
                                             skip_all_reduce_unused_params=True,
                                             bucket_cap_mb=1e-5)),  # a bucket a tensor
}


@pytest.mark.dist
@pytest.mark.parametrize("name", list(CASES))
def test_training_matches_dense_reference(dist_run, name):
    case = CASES[name]
    _check_training(dist_run(_train_worker, case, world_size=4, timeout=180), case)


def _bad_groups_worker():
    ep, replicas = expert_data_parallel_groups(1)  # 2 ranks: EP groups {0}, {1}; replicas {0, 1}
    out = {}
    for key, kwargs in (("missing", dict(group=ep)),
                        ("overlap", dict(group=dist.group.WORLD, replica_group=replicas))):
        try:
            MoELayer([nn.Linear(D, D)], 1 if key == "missing" else 2, D, top_k=1, **kwargs)
        except ValueError as e:
            out[key] = str(e)
    return out


def _sharded_dense_worker(ep_size: int):
    """shard_optimizer=True on an MoE model: a ShardedOptimizer for the data-parallel
    parameters, a torch optimizer for the experts, tribucket.clip_grad_norm_ over both;
    against the dense reference."""
    rank = dist.get_rank()
    L, seed, steps, max_norm = 2, 3, 3, 0.15
    ep, replicas = expert_data_parallel_groups(ep_size)
    model, ref, first = _models(ep_size, L, seed, ep, replicas)
    dense = [p for n, p in model.named_parameters() if ".experts." not in n]
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    with tribucket.fused_bucketing(model, shard_optimizer=True) as reducer:
        opt = tribucket.ShardedOptimizer(reducer, torch.optim.SGD, dense, lr=0.2)
        expert_opt = torch.optim.SGD(experts, lr=0.2)
        with_grad, norms = [], []
        for step in range(steps):
            x, t = _data(seed, rank, step)
            (nn.functional.mse_loss(model(x), t) + aux_losses(model)).backward()
            with_grad.append(sum(p.grad is not None for p in experts))
            # the global norm: sharded dense gradients and the experts' .grad together
            norms.append(tribucket.clip_grad_norm_(model, max_norm))
            opt.step()
            expert_opt.step()
            opt.zero_grad()
            expert_opt.zero_grad()
    ref_norms = _train_reference(ref, seed, range(steps), max_norm=max_norm)
    return {"got": {n: p.detach().clone() for n, p in model.named_parameters()},
            "want": _wanted(ref, first, L), "with_grad": with_grad, "experts": len(experts),
            "norms": norms, "ref_norms": ref_norms, "max_norm": max_norm}


@pytest.mark.dist
@pytest.mark.parametrize("ep_size", [2, 4])
def test_sharded_dense_parameters_beside_expert_parallel_ones(dist_run, ep_size):
    """The experts' replicas (2 EP x 2 DP) are averaged into .grad, not sharded: a sharded
    expert reducer left them without a gradient, so the experts never trained."""
    for rank, out in enumerate(dist_run(_sharded_dense_worker, ep_size, world_size=4,
                                        timeout=120)):
        assert out["with_grad"] == [out["experts"]] * 3, out["with_grad"]
        torch.testing.assert_close(torch.stack(out["norms"]), torch.stack(out["ref_norms"]),
                                   atol=1e-5, rtol=1e-5)
        assert max(float(n) for n in out["ref_norms"]) > out["max_norm"]  # it clips
        for n, p in out["got"].items():
            torch.testing.assert_close(p, out["want"][n], atol=2e-5, rtol=1e-4,
                                       msg=lambda m: f"rank {rank} {n}: {m}")


@pytest.mark.dist
def test_replica_group_required_and_checked(dist_run):
    for out in dist_run(_bad_groups_worker, world_size=2):
        assert "pass replica_group=" in out["missing"] and "ep_size=1" in out["missing"], out
        assert "no other rank of its expert-parallel group [0, 1]" in out["overlap"], out


def test_aux_losses_sums_every_layer_and_rejects_misuse():
    torch.manual_seed(0)
    model = nn.Sequential(*[MoELayer([_ffn(e) for e in range(2)], 2, D, aux_loss_coef=0.5,
                                     z_loss_coef=0.1) for _ in range(2)])
    with pytest.raises(RuntimeError, match="no MoELayer of the model has run a forward"):
        aux_losses(model)
    model(torch.randn(5, D))
    torch.testing.assert_close(aux_losses(model), model[0].aux_loss + model[1].aux_loss)
    with pytest.raises(ValueError, match="has no MoELayer"):
        aux_losses(nn.Linear(2, 2))


def test_aux_losses_of_a_forward_without_autograd_are_refused_for_training():
    """A reentrant activation checkpoint runs the first forward under no_grad: the aux loss
    it leaves has no gradient, and adding it to the loss would silently not train the
    router. aux_losses() says so when asked for a loss to train with (grad mode on); an
    evaluation under no_grad still reads it."""
    from torch.utils.checkpoint import checkpoint
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), MoELayer([_ffn(e) for e in range(2)], 2, D))
    x = torch.randn(5, D, requires_grad=True)  # (the reentrant checkpoint needs one)
    checkpoint(model, x, use_reentrant=True).sum()
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        aux_losses(model)
    with torch.no_grad():
        aux_losses(model)  # logging it is fine
        model(x)
        aux_losses(model)
    checkpoint(model, x, use_reentrant=False)  # the aux loss has its gradient
    assert aux_losses(model).requires_grad
    model.eval()  # an evaluation forward without no_grad: still a gradient, nothing refused
    model(x)
    aux_losses(model)


def test_default_expert_grad_scale_single_process_is_one():
    layer = MoELayer([_ffn(e) for e in range(2)], 2, D)
    assert layer.expert_grad_scale == 1.0


def _clip_worker(norm_types):
    """One backward (pure EP, 2 ranks), then each norm type on copies of the gradients."""
    rank, world = dist.get_rank(), dist.get_world_size()
    L, seed = 2, 11
    E = world * L
    torch.manual_seed(seed)
    router = nn.Linear(D, E, bias=False)
    experts = [_ffn(seed * 100 + e) for e in range(E)]
    ref = _Net(_DenseMoE(copy.deepcopy(router), copy.deepcopy(experts)), seed)
    layer = MoELayer([copy.deepcopy(experts[e]) for e in range(rank * L, rank * L + L)], E, D,
                     top_k=K, router=copy.deepcopy(router), aux_loss_coef=AUX, z_loss_coef=Z)
    model = _Net(layer, seed)
    with tribucket.fused_bucketing(model):
        x, t = _data(seed, rank, 0)
        (nn.functional.mse_loss(model(x), t) + aux_losses(model)).backward()
    total = 0.0
    for r in range(world):
        x, t = _data(seed, r, 0)
        total = total + nn.functional.mse_loss(ref(x), t) + ref.moe.aux
    (total / world).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    out = {}
    for norm_type in norm_types:
        for n, p in model.named_parameters():
            p.grad = grads[n].clone()
        for n, p in ref.named_parameters():
            p.grad = ref_grads[n].clone()
        got = tribucket.clip_grad_norm_(model, 0.05, norm_type=norm_type)
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type=norm_type)
        ref_named = dict(ref.named_parameters())  # the same names: experts by global index
        clipped = {n: (p.grad.clone(), ref_named[n].grad.clone())
                   for n, p in model.named_parameters()}
        out[norm_type] = (got, want, clipped)
    # a non-finite gradient on one rank's expert: every rank raises
    model.moe.experts[str(rank * L)][0].weight.grad[0, 0] = float("inf") if rank == 1 else 0.0
    try:
        tribucket.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
        out["nonfinite"] = None
    except RuntimeError as e:
        out["nonfinite"] = str(e)
    return out


@pytest.mark.dist
def test_clip_grad_norm_equals_torch_on_dense_equivalent(dist_run):
    norm_types = (2.0, 1.0, 3.0, float("inf"))
    results = dist_run(_clip_worker, norm_types, world_size=2)
    for rank, out in enumerate(results):
        for norm_type in norm_types:
            got, want, clipped = out[norm_type]
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
            assert float(want) > 0.05, "the case must clip"
            assert torch.equal(got, results[0][norm_type][0]), (rank, norm_type)
            for n, (g, w) in clipped.items():
                torch.testing.assert_close(g, w, atol=1e-7, rtol=1e-5,
                                           msg=lambda m: f"rank {rank} {n} p={norm_type}: {m}")
        assert "non-finite" in out["nonfinite"] and "error_if_nonfinite=False" in out["nonfinite"]
    for n in results[0][2.0][2]:
        if ".experts." not in n:  # dense gradients, clipped: the same bits on every rank
            assert torch.equal(results[1][2.0][2][n][0], results[0][2.0][2][n][0]), n


def _progress_marks_on_replica_groups():
    """Two reducers' guards on the two replica groups {0, 2} and {1, 3}; rank 3 is behind."""
    import datetime

    from tribucket.ddp.watchdog import CommGuard

    _, replicas = expert_data_parallel_groups(2)
    guard = CommGuard(replicas, dist.get_rank(replicas), 2, torch.device("cpu"),
                      datetime.timedelta(seconds=30), False)
    if dist.get_rank() != 3:
        guard.mark_progress(5)
    dist.barrier()
    return guard._who_is_behind(5)


@pytest.mark.dist
def test_progress_marks_of_replica_groups_do_not_collide(dist_run):
    results = dist_run(_progress_marks_on_replica_groups, world_size=4, timeout=60)
    assert "rank 3 (never started a backward)" in results[1], results[1]
    assert "Every rank reached this point" in results[0], results[0]


def _mesh_groups_worker():
    ranks = dist.get_process_group_ranks
    out = {}
    for names in (("dp", "ep"), ("ep", "dp")):
        ep, replicas = expert_data_parallel_groups_from_mesh(
            init_device_mesh("cpu", (2, 2), mesh_dim_names=names))
        out[names] = (ranks(ep), ranks(replicas))
    ep, replicas = expert_data_parallel_groups_from_mesh(
        init_device_mesh("cpu", (1, 4), mesh_dim_names=("dp", "ep")))
    out["dp1"] = (ranks(ep), replicas)
    for name, make in (("1-D", lambda: init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))),
                       ("names", lambda: init_device_mesh("cpu", (2, 2),
                                                          mesh_dim_names=("data", "expert")))):
        out[name] = _error_of(lambda make=make: expert_data_parallel_groups_from_mesh(make()))
    return out


@pytest.mark.dist
def test_groups_from_device_mesh(dist_run):
    for rank, out in enumerate(dist_run(_mesh_groups_worker, world_size=4)):
        # (dp, ep): the same groups as expert_data_parallel_groups(ep_size=2)
        assert out[("dp", "ep")] == ([rank // 2 * 2, rank // 2 * 2 + 1], [rank % 2, rank % 2 + 2])
        assert out[("ep", "dp")] == ([rank % 2, rank % 2 + 2], [rank // 2 * 2, rank // 2 * 2 + 1])
        assert out["dp1"] == ([0, 1, 2, 3], None), out["dp1"]
        for name in ("1-D", "names"):
            assert out[name][0] == "ValueError", out[name]
            assert "mesh_dim_names=('dp', 'ep')" in out[name][1], out[name]


def _ep_size_differs():
    try:
        expert_data_parallel_groups(1 if dist.get_rank() == 0 else 2)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.dist
def test_ep_size_must_agree_across_ranks(dist_run):
    for message in dist_run(_ep_size_differs, world_size=2, timeout=30, teardown=True):
        assert message is not None and "ep_size: 1 on rank 0, 2 on rank 1" in message, message


# ---------------------------------------------------------------------------------------
# resume and Join with expert reducers
# ---------------------------------------------------------------------------------------
def _powersgd(replicas):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    return psgd.PowerSGDState(process_group=replicas, matrix_approximation_rank=1,
                              start_powerSGD_iter=2, random_seed=0), psgd.powerSGD_hook


def _resume_worker(case):
    """2 EP x 2 DP: train ``steps`` in one go, and again with a checkpoint (model, optimizer,
    reducer state) after ``cut`` steps loaded into a fresh model, reducer and hook state."""
    import io

    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank()
    seed, L, steps, cut = case["seed"], case["L"], case["steps"], case["cut"]
    ep, replicas = expert_data_parallel_groups(2)

    def train(model, opt, span, load=None):
        with tribucket.fused_bucketing(model) as reducer:
            if case["powersgd"]:  # error feedback and warm start: state a resume must restore
                reducer.expert_reducers[0].register_comm_hook(*_powersgd(replicas))
            if load is not None and case["dcp"]:  # into the fresh reducer's own state_dict()
                target = {"reducer": reducer.state_dict()}
                dcp.load(target, checkpoint_id=load)
                reducer.load_state_dict(target["reducer"])
            elif load is not None:
                reducer.load_state_dict(torch.load(io.BytesIO(load), weights_only=False))
            for step in span:
                x, t = _data(seed, rank, step)
                (nn.functional.mse_loss(model(x), t) + aux_losses(model)).backward()
                opt.step()
                opt.zero_grad()
            if case["dcp"]:
                dcp.save({"reducer": reducer.state_dict()}, checkpoint_id=f"{case['path']}.{span[-1]}")
                return reducer, f"{case['path']}.{span[-1]}"
            buf = io.BytesIO()
            torch.save(reducer.state_dict(), buf)
        return reducer, buf.getvalue()

    model, ref, first = _models(2, L, seed, ep, replicas)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    train(model, opt, range(steps))
    whole = {n: p.detach().clone() for n, p in model.named_parameters()}

    model, _, _ = _models(2, L, seed, ep, replicas)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    _, saved = train(model, opt, range(cut))
    states = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    model, _, _ = _models(2, L, seed, ep, replicas)  # a fresh run, from the checkpoint
    model.load_state_dict(states[0])
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    opt.load_state_dict(states[1])
    reducer, _ = train(model, opt, range(cut, steps), load=saved)
    out = {"whole": whole, "resumed": {n: p.detach().clone() for n, p in model.named_parameters()},
           "iterations": [r.stats.iterations for r in [reducer, *reducer.expert_reducers]],
           "rebuilt": [r._bw.rebuilt for r in reducer.expert_reducers]}
    if not case["powersgd"]:  # (PowerSGD is lossy: no dense reference)
        _train_reference(ref, seed, range(steps))
        out["want"] = _wanted(ref, first, L)
    return out


@pytest.mark.dist
@pytest.mark.parametrize("powersgd,via", [(False, "torch.save"), (True, "dcp")])
def test_resume_restores_the_expert_reducers(dist_run, tmp_path, powersgd, via):
    # before: reducer.state_dict() held the dense reducer's state only, so a resumed run's
    # expert reducer started over (iteration 0, layout not rebuilt, PowerSGD's error feedback
    # and warm start lost) and drifted from the run it continues
    case = dict(seed=8, L=2, steps=5, cut=3, powersgd=powersgd, dcp=via == "dcp",
                path=str(tmp_path / "reducer"))
    for rank, out in enumerate(dist_run(_resume_worker, case, world_size=4, timeout=240)):
        assert out["iterations"] == [case["steps"], case["steps"]], (rank, out["iterations"])
        assert out["rebuilt"] == [True], (rank, out["rebuilt"])
        for n, p in out["resumed"].items():
            assert torch.equal(p, out["whole"][n]), f"rank {rank} {n}: resumed != uninterrupted"
            if "want" in out:
                torch.testing.assert_close(p, out["want"][n], atol=2e-5, rtol=1e-4,
                                           msg=lambda m: f"rank {rank} {n}: {m}")


def _checkpoint_mismatch_worker():
    """A state without expert reducers, and another rank's, loaded into an EP x DP reducer."""
    ep, replicas = expert_data_parallel_groups(2)
    model, _, _ = _models(2, 1, 9, ep, replicas)
    out = {}
    with tribucket.fused_bucketing(model) as reducer:
        state = reducer.state_dict()
        mine = f"expert_reducers.rank{dist.get_rank()}"
        other = dict(state)
        other[f"expert_reducers.rank{(dist.get_rank() + 1) % 4}"] = other.pop(mine)
        bare = {k: v for k, v in state.items() if k != mine}
        for name, bad in (("other rank", other), ("none", bare)):
            out[name] = _error_of(lambda bad=bad: reducer.load_state_dict(bad))
        out["join"] = _error_of(reducer.join)
    return out


@pytest.mark.dist
def test_expert_reducer_state_mismatch_and_join_raise_clear_errors(dist_run):
    # Join on an expert-parallel model used to leave the ranks still training blocked in the
    # MoE layers' all-to-alls; now entering it raises on every rank, before any collective
    for rank, out in enumerate(dist_run(_checkpoint_mismatch_worker, world_size=4, timeout=120)):
        assert out["other rank"][0] == "ValueError" and f"not of rank {rank}" in out["other rank"][1]
        assert out["none"][0] == "ValueError" and "holds no expert reducer state" in out["none"][1]
        assert out["join"][0] == "ValueError", out["join"]
        assert "Join (uneven inputs) is not supported" in out["join"][1], out["join"]
        assert "same number of batches" in out["join"][1], out["join"]


def _mesh_names_swapped_on_one_rank():
    names = ("ep", "dp") if dist.get_rank() == 3 else ("dp", "ep")
    return _error_of(lambda: expert_data_parallel_groups_from_mesh(
        init_device_mesh("cpu", (2, 2), mesh_dim_names=names)))


@pytest.mark.dist
def test_mesh_that_differs_on_one_rank_raises_on_every_rank(dist_run):
    # before: each rank took its groups by its own names, rank 3's EP group was another
    # rank's replica group, and the first exchange ended in a gloo abort
    for rank, out in enumerate(dist_run(_mesh_names_swapped_on_one_rank, world_size=4,
                                        timeout=60)):
        assert out[0] == "ValueError", (rank, out)
        assert "rank 3" in out[1] and "('ep', 'dp')" in out[1], (rank, out)


def _overflow_in_one_rank_s_expert(api: str):
    """An inf in the gradient of an expert that only rank 1 holds, at step 1, under
    tribucket.amp.GradScaler and tribucket.clip_grad_norm_ (the README's recipe). Only the
    expert's owner computes its gradient, so only rank 1's scan sees the overflow: every
    rank must still skip that step and back off alike, as a loss scaler does over DDP."""
    rank, W = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    layer = MoELayer([_ffn(10 * rank + e) for e in range(2)], 2 * W, D, top_k=2)
    model = _Net(layer, seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = tribucket.amp.GradScaler("cpu", init_scale=1024.0)
    step = [0]
    if rank == 1:
        w = layer.experts["2"][0].weight if "2" in layer.experts else None
        w = w if w is not None else next(iter(layer.experts.parameters()))
        w.register_hook(lambda g: g * float("inf") if step[0] == 1 else g)
    scales, moved = [], []
    with tribucket.fused_bucketing(model):
        for s in range(3):
            step[0] = s
            before = [p.detach().clone() for p in model.parameters()]
            x = torch.randn(6, D, generator=torch.Generator().manual_seed(10 * s + rank))
            scaler.scale(model(x).square().mean()).backward()
            if api == "unscale":
                scaler.unscale_(opt)
                tribucket.clip_grad_norm_(model, 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            scales.append(scaler.get_scale())
            moved.append(any(not torch.equal(a, p) for a, p in zip(before, model.parameters())))
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return scales, moved, finite


@pytest.mark.dist
@pytest.mark.parametrize("api", ["unscale", "step"])
def test_an_overflow_in_one_rank_s_expert_skips_the_step_on_every_rank(dist_run, api):
    # before: rank 1 skipped the step, rank 0 took it (with NaN gradients from the clip),
    # and the next backward found the ranks at different steps
    results = dist_run(_overflow_in_one_rank_s_expert, api, world_size=2, timeout=60)
    for rank, (scales, moved, finite) in enumerate(results):
        assert scales == [1024.0, 512.0, 512.0], (rank, scales)
        assert moved == [True, False, True], (rank, moved)
        assert finite, rank
