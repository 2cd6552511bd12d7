"""The data-parallel reducer; it lives in :mod:`tribucket.ddp` (kept importable here)."""

from .ddp import Reducer, ReducerStats, fused_bucketing

__all__ = ["Reducer", "ReducerStats", "fused_bucketing"]
