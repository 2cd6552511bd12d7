"""Expert-parallel Mixture-of-Experts: routing, dispatch and combine, FasterMoE's schedule."""

from .dispatcher import DispatchMeta, MoEDispatcher, expert_capacity
from .layer import MoELayer, MoEStats
from .parallel import (aux_losses, expert_data_parallel_groups,
                       expert_data_parallel_groups_from_mesh, gathered_experts)
from .schedule import exchange_groups, pairwise_steps
from .shadow import FixedShadowPolicy, GreedyShadowPolicy, ShadowCosts

__all__: list[str] = ["DispatchMeta", "aux_losses", "expert_data_parallel_groups",
                      "expert_data_parallel_groups_from_mesh",
                      "gathered_experts", "FixedShadowPolicy", "GreedyShadowPolicy", "MoEDispatcher",
                      "MoELayer", "MoEStats", "ShadowCosts", "exchange_groups", "expert_capacity",
                      "pairwise_steps"]
