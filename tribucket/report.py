"""Human-readable bucket layouts: ``python -m tribucket.report`` prints one for a real model."""

from __future__ import annotations

import argparse
import math
from typing import Sequence

from torch import nn

from .layout import BucketLayout, compute_layout

__all__ = ["format_layout", "main"]


def _names_summary(names: Sequence[str], width: int) -> str:
    text = ", ".join(names)
    if len(text) <= width:
        return text
    head = f"{names[0]} ... {names[-1]}"
    return head if len(head) <= width else head[: width - 3] + "..."


def format_layout(layout: BucketLayout, names: Sequence[str], width: int = 100) -> str:
    """A table of ``layout``: bucket, dtype, tensors, bytes, padding, parameter names."""
    rows = [("bucket", "dtype", "tensors", "bytes", "padding", "parameters (in bucket order)")]
    total = pad_total = 0
    for b, bucket in enumerate(layout.buckets):
        pad = bucket.padding * bucket.nbytes // max(bucket.numel, 1)
        total += bucket.nbytes
        pad_total += pad
        rows.append((str(b), str(bucket.dtype).replace("torch.", ""), str(len(bucket.indices)),
                     f"{bucket.nbytes:,}", f"{pad:,}",
                     _names_summary([names[i] for i in bucket.indices], width)))
    widths = [max(len(r[c]) for r in rows) for c in range(5)]
    lines = []
    for k, r in enumerate(rows):
        cells = [r[c].rjust(widths[c]) if c in (0, 2, 3, 4) else r[c].ljust(widths[c])
                 for c in range(5)]
        lines.append("  ".join(cells) + "  " + r[5])
        if k == 0:
            lines.append("-" * (sum(widths) + 10 + len(r[5])))
    lines.append(f"{len(layout.buckets)} buckets, {total:,} bytes "
                 f"({pad_total:,} bytes of alignment padding)")
    return "\n".join(lines)


def _model(name: str) -> nn.Module:
    if name == "transformer":
        layer = nn.TransformerEncoderLayer(d_model=512, nhead=8, batch_first=True)
        return nn.TransformerEncoder(layer, num_layers=6, enable_nested_tensor=False)
    if name == "mlp":
        return nn.Sequential(*[nn.Linear(256, 256) for _ in range(64)])
    raise ValueError(f"--model must be 'transformer' or 'mlp', got {name!r}")


def _mib(text: str) -> float:
    """A cap in MiB: a positive, finite number."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of MiB") from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a cap is a positive, finite number of MiB")
    return v


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Print tribucket's bucket layout of a model.")
    p.add_argument("--model", default="transformer", choices=["transformer", "mlp"])
    p.add_argument("--bucket-cap-mb", type=_mib, default=25.0)
    p.add_argument("--first-bucket-cap-mb", type=_mib, default=1.0)
    args = p.parse_args(argv)
    model = _model(args.model)
    named = [(n, q) for n, q in model.named_parameters() if q.requires_grad]
    names = [n for n, _ in named]
    caps = dict(bucket_cap_bytes=int(args.bucket_cap_mb * 2**20),
                first_bucket_cap_bytes=int(args.first_bucket_cap_mb * 2**20))
    print(f"{args.model}: {len(named)} parameters, caps {args.first_bucket_cap_mb} MiB first / "
          f"{args.bucket_cap_mb} MiB"
          + (" (DDP's defaults)" if (args.bucket_cap_mb, args.first_bucket_cap_mb) == (25.0, 1.0)
             else "") + "; buckets listed in reduction order\n")
    print("Initial layout (parameters in model order, bucket list reversed):")
    print(format_layout(compute_layout([q for _, q in named], **caps), names))
    # A feed-forward model's gradients become ready roughly in reverse parameter order; the
    # reducer rebuilds with the order it actually observed on the first iteration.
    ready = list(reversed(range(len(named))))
    print("\nRebuilt layout for gradients ready in reverse parameter order:")
    print(format_layout(compute_layout([q for _, q in named], order=ready, **caps), names))


if __name__ == "__main__":
    main()
