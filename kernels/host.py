"""Host-to-device copies that do not make the host wait for the GPU.

A copy from pageable host memory synchronises the stream: the host waits until the device has
run everything queued before it. Inside a backward hook that wait turns the host's lead over
the device into idle device time. These helpers send small host tables through pinned memory
with a non-blocking copy instead (the caching host allocator keeps the pinned block alive until
the copy has run). On the CPU they are plain ``.to(device)``.
"""

from __future__ import annotations

from typing import Sequence

import torch


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host.to(device)``; on a GPU through pinned memory, without a host stall."""
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def host_ints(values: Sequence[int], device: torch.device | str,
              dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` without a host stall on a GPU."""
    return to_device(torch.tensor(values, dtype=dtype), device)
