"""TEMPORARY CPU-only stand-in for the pack/unpack kernels (replaced by the kernels branch)."""

from __future__ import annotations

import torch


class BucketPlan:
    def __init__(self, sizes, offsets, numel, device=None):
        self.sizes, self.offsets, self.numel = list(sizes), list(offsets), numel
        self._views_key, self._views = None, None

    def _views_of(self, out):
        key = (out.data_ptr(), out.dtype, out.numel())
        if key != self._views_key:
            self._views = [out.narrow(0, o, s) for o, s in zip(self.offsets, self.sizes)]
            self._views_key = key
        return self._views

    def forget(self, buf):
        if self._views_key is not None and self._views_key[0] == buf.data_ptr():
            self._views_key, self._views = None, None

    def pack(self, tensors, out, *, scale=1.0, found_inf=None):
        views = self._views_of(out)
        for v, t in zip(views, tensors):
            if t is None:
                v.zero_()
            elif scale != 1.0:
                torch.mul(t.reshape(-1), scale, out=v)
            else:
                v.copy_(t.reshape(-1))
        if found_inf is not None and not bool(torch.isfinite(out).all()):
            found_inf.fill_(1.0)
        return out

    def unpack(self, buffer, tensors, *, scale=1.0, accumulate=False):
        views = self._views_of(buffer)
        for v, t in zip(views, tensors):
            if t is None:
                continue
            src = v.view(t.shape)
            if scale != 1.0:
                src = src * scale
            if accumulate:
                t.add_(src)
            else:
                t.copy_(src)


def pack(tensors, out, offsets, *, scale=1.0, found_inf=None):
    return BucketPlan([t.numel() for t in tensors], offsets, out.numel()).pack(
        tensors, out, scale=scale, found_inf=found_inf)


def unpack(buffer, tensors, offsets, *, scale=1.0, accumulate=False):
    BucketPlan([t.numel() for t in tensors], offsets, buffer.numel()).unpack(
        buffer, tensors, scale=scale, accumulate=accumulate)
