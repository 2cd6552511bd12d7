"""Thin wrappers over torch.distributed: futures, coalesced broadcast, all-to-all with autograd."""

from .alltoall import (all_to_all, exchange_counts, finish_exchange, group_rank_and_size,
                       ranks_reporting, set_failure_handler, start_exchange)
from .broadcast import BROADCAST_BUCKET_BYTES, broadcast_coalesced

__all__: list[str] = ["BROADCAST_BUCKET_BYTES", "all_to_all", "broadcast_coalesced",
                      "exchange_counts", "finish_exchange", "group_rank_and_size", "ranks_reporting",
                      "set_failure_handler", "start_exchange"]
