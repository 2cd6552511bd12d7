"""Thin wrappers over torch.distributed: futures, coalesced broadcast, all-to-all with autograd."""

__all__: list[str] = []
