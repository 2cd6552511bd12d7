"""Facts about the running torch build, reported at start-up."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("tribucket")


def nccl_version() -> tuple[int, ...] | None:
    """The NCCL version ``torch.distributed`` loaded, or ``None`` on a build without NCCL.

    A CUDA torch wheel carries its own NCCL; the ``cuda`` extra (``nvidia-nccl-cu12``) only
    matters when torch is built to load the system's or that package's library.
    """
    if not torch.cuda.is_available():
        return None
    try:
        v = torch.cuda.nccl.version()
    except Exception:  # built without NCCL
        return None
    return tuple(v) if isinstance(v, tuple) else (v,)


def describe_backend() -> str:
    """A one-line description of the torch build and communication libraries."""
    nccl = nccl_version()
    parts = [f"torch {torch.__version__}"]
    parts.append(f"NCCL {'.'.join(map(str, nccl))}" if nccl else "NCCL not loaded (CPU build)")
    try:
        import triton  # noqa: F401

        parts.append(f"triton {triton.__version__}")
    except Exception:
        parts.append("triton not installed")
    return ", ".join(parts)
