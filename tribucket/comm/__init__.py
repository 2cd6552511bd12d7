"""Thin wrappers over torch.distributed: futures, coalesced broadcast, all-to-all with autograd."""

from .alltoall import (all_to_all, all_to_all_beside, exchange_counts, finish_exchange,
                       group_rank_and_size, ranks_reporting, set_failure_handler, start_exchange)
from .broadcast import BROADCAST_BUCKET_BYTES, broadcast_coalesced

__all__: list[str] = ["BROADCAST_BUCKET_BYTES", "all_to_all", "all_to_all_beside",
                      "broadcast_coalesced",
                      "exchange_counts", "finish_exchange", "group_rank_and_size", "ranks_reporting",
                      "set_failure_handler", "start_exchange"]
