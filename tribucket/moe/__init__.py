"""Expert-parallel Mixture-of-Experts: routing, dispatch and combine, FasterMoE's schedule,
grouped experts, shared experts and aux-loss-free balancing."""

from .dispatcher import DispatchMeta, MoEDispatcher, expert_capacity
from .experts import GELUExpert, GroupedExperts, SwiGLUExpert
from .layer import MoELayer, MoEStats
from .parallel import (aux_losses, balance_after_step, expert_data_parallel_groups,
                       expert_data_parallel_groups_from_mesh, gathered_experts,
                       update_routing_biases)
from .schedule import exchange_groups, pairwise_steps
from .shadow import FixedShadowPolicy, GreedyShadowPolicy, ShadowCosts

__all__: list[str] = ["DispatchMeta", "GELUExpert", "GroupedExperts", "SwiGLUExpert", "aux_losses",
                      "balance_after_step", "expert_data_parallel_groups",
                      "expert_data_parallel_groups_from_mesh",
                      "gathered_experts", "FixedShadowPolicy", "GreedyShadowPolicy", "MoEDispatcher",
                      "MoELayer", "MoEStats", "ShadowCosts", "exchange_groups", "expert_capacity",
                      "pairwise_steps", "update_routing_biases"]
