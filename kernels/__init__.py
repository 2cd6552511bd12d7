"""Triton kernels and their PyTorch references, imported as ``tribucket.kernels``."""

from .pack import BucketPlan, pack, unpack

__all__ = ["BucketPlan", "pack", "unpack"]
