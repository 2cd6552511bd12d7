"""Thin wrappers over torch.distributed: futures, coalesced broadcast, all-to-all with autograd."""

from .broadcast import BROADCAST_BUCKET_BYTES, broadcast_coalesced

__all__ = ["BROADCAST_BUCKET_BYTES", "broadcast_coalesced"]
