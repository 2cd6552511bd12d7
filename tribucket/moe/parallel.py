"""Expert x data parallelism (the process groups) and the model-wide MoE losses.

With ``world = ep_size * dp_size`` ranks, rank ``r`` sits in expert-parallel (EP) group
``r // ep_size`` (consecutive ranks, which share the experts between them) at position
``r % ep_size``, and in the expert-data-parallel (EDP, replica) group of every rank at the
same position (ranks ``r % ep_size``, ``+ ep_size``, ...), which hold the same experts.
Example, 4 ranks, ``ep_size=2``: EP groups ``{0, 1}``, ``{2, 3}``; replica groups
``{0, 2}``, ``{1, 3}``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["aux_losses", "balance_after_step", "expert_data_parallel_groups",
           "expert_data_parallel_groups_from_mesh", "gathered_experts", "update_routing_biases"]


def expert_data_parallel_groups(ep_size: int):
    """``(ep_group, replica_group)`` of this rank, for ``MoELayer(group=, replica_group=)``.

    One all-gather first checks that every rank passed the same ``ep_size`` (a ValueError on
    every rank otherwise: the group creation that follows must match across ranks).

    Every rank must call it, in the same place (it creates every group, in one order, as
    ``dist.new_group`` requires). ``replica_group`` is None when ``ep_size`` is the world
    size (no expert has replicas).

    Example (4 ranks, 2 experts per rank, 4 experts in all, each on 2 ranks)::

        ep, replicas = tribucket.moe.expert_data_parallel_groups(ep_size=2)
        layer = MoELayer(my_two_experts, num_experts=4, d_model=D, group=ep, replica_group=replicas)
        with tribucket.fused_bucketing(model):   # dense over the world, experts over `replicas`
            ...
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("expert_data_parallel_groups needs torch.distributed: call "
                           "dist.init_process_group(...) first")
    world, rank = dist.get_world_size(), dist.get_rank()
    every: list = [None] * world
    dist.all_gather_object(every, ep_size)  # the new_group calls must match: agree first
    if len(set(map(repr, every))) > 1:
        raise ValueError("expert_data_parallel_groups needs the same ep_size on every rank, got "
                         "ep_size: " + ", ".join(f"{v!r} on rank {r}" for r, v in enumerate(every)))
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1 \
            or world % ep_size:
        raise ValueError(f"ep_size={ep_size!r} must be a positive int dividing the world size "
                         f"{world} (the ranks that share one set of experts)")
    ep_group = replica_group = None
    for start in range(0, world, ep_size):  # every rank creates every group, in this order
        g = dist.new_group(list(range(start, start + ep_size)))
        if start <= rank < start + ep_size:
            ep_group = g
    if ep_size < world:
        for pos in range(ep_size):
            g = dist.new_group(list(range(pos, world, ep_size)))
            if rank % ep_size == pos:
                replica_group = g
    return ep_group, replica_group


def expert_data_parallel_groups_from_mesh(mesh, *, dp_dim: str = "dp", ep_dim: str = "ep"):
    """``(ep_group, replica_group)`` of this rank from a 2-D ``DeviceMesh`` with dimensions
    ``dp_dim`` and ``ep_dim`` (either order), for ``MoELayer(group=, replica_group=)``.

    The experts are spread over the ``ep_dim`` group of this rank; the ranks along
    ``dp_dim`` hold the same experts and average them (``replica_group``, None when that
    dimension has size 1). The mesh made the groups; one all-gather of a few values checks
    that every rank passed the same mesh (shape, rank layout, dimension names and
    ``dp_dim``/``ep_dim``), so a rank that named its dimensions the other way round is
    named on every rank instead of pairing its exchanges with the wrong ranks.

    Example (4 ranks: ``[[0, 1], [2, 3]]``, EP groups ``{0, 1}``, ``{2, 3}``, replica groups
    ``{0, 2}``, ``{1, 3}``, as ``expert_data_parallel_groups(ep_size=2)``)::

        mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("dp", "ep"))
        ep, replicas = tribucket.moe.expert_data_parallel_groups_from_mesh(mesh)
        layer = MoELayer(my_experts, num_experts=2 * len(my_experts), d_model=D,
                         group=ep, replica_group=replicas)
    """
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh (from "
                        f"init_device_mesh), got {type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names or ())
    if dist.is_initialized() and dist.get_world_size() > 1:
        mine = (tuple(mesh.mesh.shape), mesh.mesh.flatten().tolist(), names, dp_dim, ep_dim)
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        if any(e != every[0] for e in every):
            seen = "; ".join(f"rank {r}: shape {e[0]}, mesh_dim_names={e[2]}, dp_dim={e[3]!r}, "
                             f"ep_dim={e[4]!r}" for r, e in enumerate(every) if e != every[0])
            raise ValueError(
                "expert_data_parallel_groups_from_mesh: the ranks passed different meshes "
                f"(rank 0: shape {every[0][0]}, mesh_dim_names={every[0][2]}, "
                f"dp_dim={every[0][3]!r}, ep_dim={every[0][4]!r}; {seen}). Build the mesh with "
                "the same init_device_mesh(...) call, names in the same order, on every rank.")
    if mesh.ndim != 2 or sorted(names) != sorted((dp_dim, ep_dim)):
        raise ValueError(
            f"expert_data_parallel_groups_from_mesh needs a 2-D mesh with dimensions named "
            f"{dp_dim!r} and {ep_dim!r}, got {mesh.ndim}-D mesh_dim_names={names or None}: build "
            f"it with init_device_mesh(device, (dp_size, ep_size), mesh_dim_names=({dp_dim!r}, "
            f"{ep_dim!r})), or pass dp_dim= and ep_dim= naming yours")
    replica_group = mesh.get_group(dp_dim) if mesh.size(names.index(dp_dim)) > 1 else None
    return mesh.get_group(ep_dim), replica_group


def aux_losses(model: nn.Module) -> torch.Tensor:
    """The sum of every :class:`MoELayer`'s ``aux_loss`` (balance + z loss) in ``model``
    from its last forward; add it to your loss: ``loss = task_loss + aux_losses(model)``.

    Layers that have not run a forward yet are skipped; a model without any MoELayer, or
    none of whose layers has run, is an error (the loss would silently be zero). So is, in
    grad mode, a training layer whose last forward ran without autograd (a reentrant
    activation checkpoint's first pass): its loss would not train the router.
    """
    from .layer import MoELayer

    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, MoELayer)]
    if not layers:
        raise ValueError(f"aux_losses: {type(model).__name__} has no MoELayer")
    losses = [m.aux_loss for _, m in layers if m.aux_loss is not None]
    if not losses:
        raise RuntimeError(f"aux_losses: no MoELayer of the model has run a forward yet "
                           f"({', '.join(repr(n) for n, _ in layers[:3])}): call the model first")
    if torch.is_grad_enabled():  # asked for a loss to train with
        for name, m in layers:
            if m.training and _aux_loss_lost_its_gradient(m):
                raise RuntimeError(
                    f"aux_losses: MoE layer {name!r} ran its last forward without autograd "
                    "(under torch.no_grad, or in the first pass of "
                    "torch.utils.checkpoint(..., use_reentrant=True)), so its aux_loss has "
                    "no gradient and would not train the router. Checkpoint with "
                    "use_reentrant=False; to only read the value, call aux_losses under "
                    "torch.no_grad()")
    return torch.stack([loss.float() for loss in losses]).sum()


def _aux_loss_lost_its_gradient(layer: nn.Module) -> bool:
    """A balancing loss that should reach the router and cannot."""
    loss = layer.aux_loss
    return (loss is not None and loss.grad_fn is None
            and (layer.aux_loss_coef > 0 or layer.z_loss_coef > 0)
            and any(p.requires_grad for p in layer.router.parameters()))


def update_routing_biases(model: nn.Module) -> None:
    """Aux-loss-free balancing for every :class:`MoELayer` of ``model`` built with
    ``bias_update_rate``: each layer's ``expert_bias += rate · sign(mean_load - load)`` from the
    token-slots its group routed since the last call (:meth:`MoELayer.update_bias`). Call it
    after each optimizer step, on every rank. No collective, except with expert x data
    parallelism: then one all-reduce over the replica group carries every layer's counts.

    Example::

        opt.step()
        tribucket.moe.update_routing_biases(model)
    """
    from .layer import MoELayer

    layers = [m for m in model.modules()
              if isinstance(m, MoELayer) and m.bias_update_rate is not None]
    replicated = [m for m in layers
                  if m.replica_group is not None and dist.get_world_size(m.replica_group) > 1]
    for m in layers:
        if m not in replicated:
            m.update_bias()
    # layers sharing a replica group: one all-reduce of all their counts
    by_group: dict[int, list] = {}
    for m in replicated:
        by_group.setdefault(id(m.replica_group), []).append(m)
    for group_layers in by_group.values():
        loads = torch.tensor([c for m in group_layers for c in m._load.counts],
                             dtype=torch.float64, device=group_layers[0].expert_bias.device)
        dist.all_reduce(loads, group=group_layers[0].replica_group)
        for m, load_E in zip(group_layers, loads.split([m.num_experts for m in group_layers])):
            m._apply_bias_update(load_E)


def balance_after_step(optimizer: torch.optim.Optimizer, model: nn.Module):
    """Run :func:`update_routing_biases` ``(model)`` after every ``optimizer.step()``
    (an optimizer step post-hook); returns its handle (``.remove()`` stops it).

    Example::

        tribucket.moe.balance_after_step(opt, model)   # once, before training
    """
    return optimizer.register_step_post_hook(lambda *_: update_routing_biases(model))


@contextlib.contextmanager
def gathered_experts(model: nn.Module) -> Iterator[nn.Module]:
    """Give every rank all experts of every :class:`MoELayer` in ``model``, so a forward
    inside runs on one rank alone, with no collective (evaluation on rank 0 only).

    Entering is a collective (every rank of each layer's group, the same model): one
    all-gather per expert tensor. Inside, each layer computes every token's experts locally
    (the same routing, capacity and gate weights; the other ranks' experts are detached
    copies, so this is for evaluation, not training: a backward through a forward run inside
    raises); leaving restores expert parallelism.
    It needs the memory of every expert on each rank.

    Example::

        with tribucket.moe.gathered_experts(model):   # on every rank
            if rank == 0:
                evaluate(model)
    """
    from .layer import MoELayer

    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    if not layers:
        raise ValueError(f"gathered_experts: {type(model).__name__} has no MoELayer")
    everything = [layer.gather_experts() for layer in layers]
    handles = []
    try:
        for layer, experts in zip(layers, everything):
            layer._gathered = experts
            handles.append(layer.register_forward_hook(_refuse_backward_hook))
        yield model
    finally:
        for h in handles:
            h.remove()
        for layer in layers:
            layer._gathered = None


class _RefuseBackward(torch.autograd.Function):
    """Identity forward; a backward raises: the layer ran inside ``gathered_experts``."""

    @staticmethod
    def forward(ctx, y, name):
        ctx.name = name
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(
            f"MoE layer {ctx.name!r}: a backward through a forward run inside "
            "tribucket.moe.gathered_experts(). Inside it each rank holds detached copies of "
            "the other ranks' experts and its own experts see only its own tokens, so a "
            "training step there would update the experts differently on every rank. "
            "gathered_experts is for evaluation: run the forward under torch.no_grad() (or "
            "leave the context before training).")


def _refuse_backward_hook(layer: nn.Module, args, output):
    """Forward hook inside ``gathered_experts``: outputs that need a gradient get a backward
    that refuses (a forward with grad enabled is allowed; training through it is not)."""
    name = getattr(layer, "name", None) or type(layer).__name__

    def wrap(t):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            return _RefuseBackward.apply(t, name)
        return t
    return torch.utils._pytree.tree_map(wrap, output)
