"""``GradBucket``: what a communication hook sees of one bucket, as torch's GradBucket."""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["GradBucket"]


class GradBucket:
    """One bucket of gradients handed to a comm hook, with torch's ``GradBucket`` methods.

    ``buffer()`` is the flat bucket (the bucket's own dtype for generic hooks, exactly as
    DDP gives it: the sum of this rank's gradients, not yet divided by the world size).
    ``gradients()`` are views into it shaped like the parameters, in the layout's order.

    For tribucket's fused compression hooks the buffer is already the wire buffer: gradients
    packed into fp16/bf16 with the ``1/world_size`` division fused in; ``is_prescaled()``
    says so, and the hook only has to allreduce it.
    """

    __slots__ = ("_index", "_buffer", "_params", "_shapes", "_offsets", "_is_last",
                 "_prescaled", "_views", "_group")

    def __init__(self, index: int, buffer: torch.Tensor, parameters: Sequence[torch.Tensor],
                 offsets: Sequence[int], is_last: bool, prescaled: bool = False,
                 process_group=None):
        self._index = index            # position of the bucket in reduction order
        self._buffer = buffer          # the flat tensor the hook reduces
        self._params = list(parameters)  # the bucket's parameters, in layout order
        self._shapes = [p.shape for p in self._params]
        self._offsets = list(offsets)  # element offset of each parameter in the buffer
        self._is_last = is_last        # the last bucket of this iteration
        self._prescaled = prescaled    # buffer already divided by world size (fused hooks)
        self._views = None             # cached gradients() views of the current buffer
        self._group = process_group    # the reducer's group (tribucket's hooks default to it)

    def index(self) -> int:
        """Index of the bucket: buckets are reduced in index order, identical on every rank."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat 1-D tensor holding the bucket's gradients."""
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        """Per-parameter views into :meth:`buffer`, in the bucket's order."""
        if self._views is None:
            flat = self._buffer
            self._views = [flat.narrow(0, off, shape.numel()).view(shape)
                           for off, shape in zip(self._offsets, self._shapes)]
        return self._views

    def parameters(self) -> list[torch.Tensor]:
        """The parameters whose gradients are in this bucket, in the bucket's order."""
        return self._params

    def is_last(self) -> bool:
        """Whether this is the last bucket to be reduced in the iteration."""
        return self._is_last

    def is_the_last_bucket_to_allreduce(self) -> bool:  # torch's older name
        return self._is_last

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace the bucket's flat tensor (as torch's ``GradBucket.set_buffer``)."""
        if not isinstance(buffer, torch.Tensor):
            raise TypeError(f"set_buffer expects a tensor, got {type(buffer).__name__}")
        self._buffer = buffer
        self._views = None

    def process_group(self):
        """The group the reducer communicates on (``None``: not set, use the default)."""
        return self._group

    def is_prescaled(self) -> bool:
        """True when the buffer is already divided by the world size (fused hooks)."""
        return self._prescaled

    def __repr__(self) -> str:
        return (f"GradBucket(index={self._index}, numel={self._buffer.numel()}, "
                f"dtype={self._buffer.dtype}, tensors={len(self._params)}, "
                f"is_last={self._is_last})")
