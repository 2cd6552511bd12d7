"""Thin wrappers over torch.distributed: futures, coalesced broadcast, all-to-all with autograd."""

from .alltoall import all_to_all, exchange_counts, group_rank_and_size, ranks_reporting

__all__: list[str] = ["all_to_all", "exchange_counts", "group_rank_and_size", "ranks_reporting"]
