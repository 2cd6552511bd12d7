"""Triton kernels and their PyTorch references, imported as ``tribucket.kernels``."""

__all__: list[str] = []
