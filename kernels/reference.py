"""Plain-PyTorch references of the pack/unpack contracts, one tensor at a time.

These are the specification the Triton kernels and the fast CPU path are tested against:
slow (a Python loop over tensors), obviously correct, and with no caching.

The value contract, shared by every backend
-------------------------------------------
* **Copy**: ``scale == 1`` and equal dtypes -> the bits are copied unchanged (any dtype:
  int64, fp64, bool, complex, ...).
* **Scale and cast** (floating dtypes only): ``y = (x.to(C) * C(scale)).to(dst_dtype)``
  where the compute dtype ``C`` is float64 if either side is float64 and float32 otherwise.
  Every cast rounds to nearest-even (what ``Tensor.to`` does). For float32 this is what
  DDP's ``at::mul_out(bucket_view, grad, 1 / world_size)`` computes, bit for bit.
* **Accumulate** (unpack only, floating dtypes): ``t = (t.to(C) + (x.to(C) * C(scale))).to(t.dtype)``
  with the product rounded to ``C`` before the add (two roundings, no fused multiply-add).
* **found_inf**: a one-element float32 tensor set to 1.0 when a packed value (after scale
  and cast) is inf or NaN; never cleared.
* **stats** (unpack only, the epilogue): a two-element float32 tensor; ``stats[0]`` gains the
  sum of squares of the values written (in the destination dtype, squared and summed in
  float32 or wider; summation order is unspecified), ``stats[1]`` is set to 1.0 when a
  written value is inf or NaN. The 2-norm of the tensors is ``stats[0].sqrt()``.

Example::

    >>> import torch
    >>> a, b = torch.tensor([1., 2., 3.]), torch.arange(5.)
    >>> out = torch.zeros(9)
    >>> pack_reference([a, b], out, [0, 4], scale=0.5)
    tensor([0.5000, 1.0000, 1.5000, 0.0000, 0.0000, 0.5000, 1.0000, 1.5000, 2.0000])
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["FLOATING", "compute_dtype", "pack_reference", "unpack_reference"]

#: dtypes that may be scaled and cast into one another
FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype the scale/cast arithmetic runs in: float64 if any side is, else float32."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def is_copy(src: torch.dtype, dst: torch.dtype, scale: float) -> bool:
    """Whether (src -> dst, scale) is a bit-exact copy rather than arithmetic."""
    return src == dst and scale == 1.0


def check_value_pair(src: torch.dtype, dst: torch.dtype, scale: float, what: str) -> None:
    """Raise TypeError unless ``src -> dst`` with ``scale`` is a copy or a floating cast."""
    if is_copy(src, dst, scale):
        return
    if src not in FLOATING or dst not in FLOATING:
        raise TypeError(
            f"{what}: cannot scale or cast {src} -> {dst} (scale={scale}); only floating "
            f"dtypes {', '.join(str(d) for d in FLOATING)} are scaled/cast, other dtypes "
            f"are copied bit-exactly with scale=1 into a buffer of the same dtype")


def _transform(x: torch.Tensor, dst: torch.dtype, scale: float) -> torch.Tensor:
    if is_copy(x.dtype, dst, scale):
        return x.reshape(-1)
    c = compute_dtype(x.dtype, dst)
    # torch multiplies a float32 tensor by a Python scalar in float32 (the scalar rounded
    # to float32): exactly x * float32(scale), as DDP does.
    return (x.reshape(-1).to(c) * scale).to(dst)


def pack_reference(
    tensors: Sequence[torch.Tensor | None],
    out: torch.Tensor,
    offsets: Sequence[int],
    *,
    scale: float = 1.0,
    found_inf: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write ``tensors[i]`` (scaled, cast to ``out.dtype``) at ``out[offsets[i]:]``.

    A ``None`` tensor zero-fills nothing (it has no size here; the plan API knows sizes).
    Elements of ``out`` not covered by a tensor are left untouched.
    """
    scale = float(scale)
    for i, (t, off) in enumerate(zip(tensors, offsets)):
        if t is None:
            continue
        check_value_pair(t.dtype, out.dtype, scale, f"tensors[{i}]")
        y = _transform(t, out.dtype, scale)
        out[off:off + y.numel()].copy_(y)
        if found_inf is not None and y.is_floating_point() and not bool(torch.isfinite(y).all()):
            found_inf.fill_(1.0)
    return out


def unpack_reference(
    buffer: torch.Tensor,
    tensors: Sequence[torch.Tensor | None],
    offsets: Sequence[int],
    *,
    scale: float = 1.0,
    accumulate: bool = False,
    stats: torch.Tensor | None = None,
) -> None:
    """Write ``buffer[offsets[i]:]`` (scaled, cast to ``tensors[i].dtype``) into ``tensors[i]``.

    ``None`` tensors are skipped. With ``accumulate`` the scaled value is added to what the
    tensor holds (see the module docstring for the rounding and for ``stats``).
    """
    scale = float(scale)
    for i, (t, off) in enumerate(zip(tensors, offsets)):
        if t is None:
            continue
        x = buffer[off:off + t.numel()]
        if accumulate:
            if buffer.dtype not in FLOATING or t.dtype not in FLOATING:
                raise TypeError(f"tensors[{i}]: accumulate needs floating dtypes, got "
                                f"buffer {buffer.dtype} -> tensor {t.dtype}")
            c = compute_dtype(buffer.dtype, t.dtype)
            y = (t.reshape(-1).to(c) + x.to(c) * scale).to(t.dtype)
        else:
            check_value_pair(buffer.dtype, t.dtype, scale, f"tensors[{i}]")
            y = _transform(x, t.dtype, scale)
        t.view(-1).copy_(y)
        if stats is not None and y.is_floating_point():  # (a gradient norm's figures)
            yd = y.double()  # float64: the reference sum has no rounding to speak of
            stats[0] += yd.square().sum().float()
            if not bool(torch.isfinite(yd).all()):
                stats[1] = 1.0
