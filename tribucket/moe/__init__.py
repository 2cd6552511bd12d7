"""Expert-parallel Mixture-of-Experts: routing, dispatch and combine."""

from .dispatcher import DispatchMeta, MoEDispatcher, expert_capacity
from .layer import MoELayer, MoEStats

__all__: list[str] = ["DispatchMeta", "MoEDispatcher", "MoELayer", "MoEStats", "expert_capacity"]
