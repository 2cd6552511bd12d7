"""Property-test bucket layouts: hypothesis strategies and ``check_layout``.

Needs the ``testing`` extra (``pip install 'tribucket[testing]'``) for the strategies;
``check_layout`` itself is plain Python.

Example (on your own model)::

    from hypothesis import given, strategies as st
    import tribucket
    from tribucket.testing import check_layout

    params = list(my_model.parameters())

    @given(cap=st.integers(1, 64 * 2**20), order=st.permutations(range(len(params))))
    def test_my_model_layouts(cap, order):
        layout = tribucket.compute_layout(params, bucket_cap_bytes=cap, order=order)
        check_layout(layout, params, bucket_cap_bytes=cap, order=order)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

try:
    from hypothesis import strategies as st
except ImportError as e:  # pragma: no cover - exercised by test_import_without_hypothesis
    raise ImportError(
        "tribucket.testing needs hypothesis: install it with "
        "`pip install 'tribucket[testing]'` (or `pip install hypothesis`)"
    ) from e

import torch

from .layout import BucketLayout, TensorSpec, _itemsize, compute_layout

__all__ = ["tensor_specs", "tensor_spec_lists", "layouts", "LayoutCase", "check_layout",
           "LayoutInvariantError"]

#: dtypes the strategies draw from by default
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
          torch.int32, torch.uint8, torch.bool, torch.complex64)
#: devices that exist on every machine
DEVICES = ("cpu", "meta")


class LayoutInvariantError(AssertionError):
    """A layout broke one of the invariants ``check_layout`` verifies."""


def tensor_specs(
    dtypes: Sequence[torch.dtype] = DTYPES,
    devices: Sequence[str] = DEVICES,
    max_numel: int = 5000,
    max_dims: int = 3,
) -> st.SearchStrategy[TensorSpec]:
    """Shapes of 0 to ``max_dims`` dimensions (0-element ones included), dtypes, devices."""

    @st.composite
    def _spec(draw):
        ndim = draw(st.integers(0, max_dims))
        shape, budget = [], max_numel
        for _ in range(ndim):
            s = draw(st.integers(0, max(0, budget)))
            shape.append(s)
            budget = budget // max(s, 1)
        return TensorSpec(tuple(shape), draw(st.sampled_from(dtypes)),
                          torch.device(draw(st.sampled_from(devices))))

    return _spec()


def tensor_spec_lists(min_size: int = 0, max_size: int = 40, **kw) -> st.SearchStrategy:
    """Lists of :func:`tensor_specs`."""
    return st.lists(tensor_specs(**kw), min_size=min_size, max_size=max_size)


@dataclass(frozen=True)
class LayoutCase:
    """A drawn input for compute_layout and the layout it produced."""

    tensors: tuple[TensorSpec, ...]
    kwargs: dict[str, Any]
    layout: BucketLayout


def layouts(
    tensors: st.SearchStrategy | None = None,
    max_cap_bytes: int = 64 * 1024,
) -> st.SearchStrategy[LayoutCase]:
    """Draw tensors, caps, sparse flags, an optional ready order and alignment; lay them out.

    Caps are drawn small (up to ``max_cap_bytes``) so tensors larger than a bucket, buckets
    of one tensor and many-tensor buckets all show up.
    """
    tensors = tensor_spec_lists() if tensors is None else tensors

    @st.composite
    def _case(draw):
        specs = tuple(draw(tensors))
        n = len(specs)
        cap = draw(st.integers(1, max_cap_bytes))
        first = draw(st.one_of(st.none(), st.integers(1, max_cap_bytes)))
        sparse = draw(st.one_of(st.none(), st.lists(st.booleans(), min_size=n, max_size=n)))
        order = draw(st.one_of(st.none(), st.permutations(range(n))))
        align = draw(st.sampled_from([1, 2, 4, 8, 16, 64, 128]))
        # sometimes one cap per bucket instead (DDP's bucket_cap_mb_list)
        caps = draw(st.one_of(st.none(), st.lists(st.integers(1, max_cap_bytes),
                                                  min_size=1, max_size=4)))
        kwargs = dict(bucket_cap_bytes=cap, first_bucket_cap_bytes=first,
                      expect_sparse=sparse, order=order, align_bytes=align,
                      bucket_cap_bytes_list=caps)
        return LayoutCase(specs, kwargs, compute_layout(specs, **kwargs))

    return _case()


def _fail(msg: str) -> None:
    raise LayoutInvariantError(msg)


def check_layout(
    layout: BucketLayout,
    tensors: Sequence["torch.Tensor | TensorSpec"],
    bucket_cap_bytes: int = 25 * 2**20,
    first_bucket_cap_bytes: int | None = 2**20,
    expect_sparse: Sequence[bool] | None = None,
    order: Sequence[int] | None = None,
    align_bytes: int = 16,
    bucket_cap_bytes_list: Sequence[int] | None = None,
) -> None:
    """Assert every invariant of ``layout`` for ``tensors`` and the caps it was computed with.

    Raises :class:`LayoutInvariantError` describing the first violation in words.
    """
    specs = [TensorSpec.of(t) for t in tensors]
    n = len(specs)
    first = bucket_cap_bytes if first_bucket_cap_bytes is None else first_bucket_cap_bytes
    sparse = [s.sparse for s in specs] if expect_sparse is None else list(expect_sparse)
    if layout.num_tensors != n:
        _fail(f"layout is for {layout.num_tensors} tensors, {n} were given")

    # every tensor in exactly one bucket
    count = [0] * n
    for b, bucket in enumerate(layout.buckets):
        for i in bucket.indices:
            if not 0 <= i < n:
                _fail(f"bucket {b} holds tensor index {i}, outside 0..{n - 1}")
            count[i] += 1
    for i, c in enumerate(count):
        if c != 1:
            _fail(f"tensor {i} is in {c} buckets (expected exactly 1)")

    caps = sorted(set(bucket_cap_bytes_list) if bucket_cap_bytes_list
                  else {first, bucket_cap_bytes})
    last_of_key: dict[tuple, int] = {}
    for b, bucket in enumerate(layout.buckets):
        if not bucket.indices:
            _fail(f"bucket {b} is empty")
        if not (len(bucket.indices) == len(bucket.offsets) == len(bucket.sizes)):
            _fail(f"bucket {b}: indices, offsets and sizes differ in length")
        # one dtype and device per bucket
        for i in bucket.indices:
            if (specs[i].dtype, specs[i].device) != (bucket.dtype, bucket.device):
                _fail(f"bucket {b} is {bucket.dtype}/{bucket.device} but holds tensor {i} "
                      f"of {specs[i].dtype}/{specs[i].device}")
        # offsets ascending, aligned, non-overlapping, inside numel
        align = max(1, align_bytes // _itemsize(bucket.dtype))
        end = 0
        for i, off, size in zip(bucket.indices, bucket.offsets, bucket.sizes):
            if size != specs[i].numel():
                _fail(f"bucket {b}: tensor {i} recorded with {size} elements, has "
                      f"{specs[i].numel()}")
            if off % align:
                _fail(f"bucket {b}: tensor {i} starts at element {off}, not a multiple of "
                      f"{align} ({align_bytes}-byte alignment)")
            if off < end:
                _fail(f"bucket {b}: tensor {i} at [{off}, {off + size}) overlaps the previous "
                      f"tensor ending at {end}")
            end = off + size
        if end > bucket.numel:
            _fail(f"bucket {b}: tensors end at element {end} but numel is {bucket.numel}")
        if bucket.sparse or any(sparse[i] for i in bucket.indices):
            if len(bucket.indices) != 1 or not sparse[bucket.indices[0]]:
                _fail(f"bucket {b} mixes a sparse-gradient tensor with others: "
                      f"{bucket.indices}")
            continue
        # no bucket over its cap unless it would already have closed one tensor earlier
        nbytes = bucket.payload_bytes
        if bucket.cap_bytes not in caps:
            _fail(f"bucket {b} has cap {bucket.cap_bytes}, not one of the given caps {caps}")
        without_last = nbytes - specs[bucket.indices[-1]].numel() * _itemsize(bucket.dtype)
        if len(bucket.indices) > 1 and without_last >= bucket.cap_bytes:
            _fail(f"bucket {b} holds {nbytes} bytes: it reached its cap of "
                  f"{bucket.cap_bytes} bytes before its last tensor and should have closed")
        last_of_key[(bucket.dtype, bucket.device)] = b

    # a bucket closes only at or over its cap, except the partly-filled last of each key
    partial = {}
    for b, bucket in enumerate(layout.buckets):
        if bucket.sparse:
            continue
        if bucket.payload_bytes < bucket.cap_bytes:
            key = (bucket.dtype, bucket.device)
            if key in partial:
                _fail(f"buckets {partial[key]} and {b} of {bucket.dtype}/{bucket.device} are "
                      f"both under their cap: only the last bucket of a key may be")
            partial[key] = b

    # encoding round-trips and layouts are deterministic
    again = compute_layout(specs, bucket_cap_bytes, first_bucket_cap_bytes, expect_sparse,
                           order, align_bytes, bucket_cap_bytes_list)
    if again.buckets != layout.buckets:
        _fail("compute_layout is not deterministic: the same input gave another layout")
    decoded = BucketLayout.from_tensor(layout.to_tensor(), specs)
    if decoded.buckets != layout.buckets:
        _fail("to_tensor()/from_tensor() does not round-trip the layout")
    for i in range(n):
        b, off = layout.locate(i)
        bucket = layout.buckets[b]
        if bucket.offsets[bucket.indices.index(i)] != off:
            _fail(f"locate({i}) gives offset {off}, the bucket says otherwise")


# ---------------------------------------------------------------------------------------
# MoE routings
# ---------------------------------------------------------------------------------------
#: the routing shapes ``moe_routings`` draws from
ROUTING_KINDS = ("uniform", "skewed", "one_expert", "zero_tokens")


@dataclass(frozen=True)
class MoERouting:
    """Expert choices of every rank: ``expert_ids[r]`` is rank ``r``'s int64 ``[T_r, K]``."""

    kind: str
    num_experts: int
    top_k: int
    expert_ids: tuple[torch.Tensor, ...]


def _route_tokens(kind: str, T: int, E: int, K: int, hot: int, seed: int) -> torch.Tensor:
    """``[T, K]`` distinct experts per token (as ``torch.topk`` gives), drawn for ``kind``."""
    g = torch.Generator().manual_seed(seed)
    if kind == "one_expert":  # every token picks hot, hot+1, ... (K = 1: one expert gets all)
        return ((hot + torch.arange(K)) % E).repeat(T, 1)
    # Gumbel top-k: distinct experts per token, with a preference that sets the skew
    gumbel_TE = -torch.log(-torch.log(torch.rand(T, E, generator=g).clamp_min(1e-12)))
    if kind == "skewed":  # expert hot+j is e^(-1.5 j) as likely as hot
        gumbel_TE = gumbel_TE - 1.5 * ((torch.arange(E) - hot) % E).float()
    return torch.topk(gumbel_TE, K, dim=-1).indices


def moe_routings(world_size: int, num_experts: int, top_k: int, max_tokens: int = 24,
                 kinds: Sequence[str] = ROUTING_KINDS) -> st.SearchStrategy[MoERouting]:
    """Routings of ``world_size`` ranks' tokens to ``num_experts`` experts, ``top_k`` each.

    ``uniform``: random distinct experts per token; ``skewed``: one hot expert takes most
    slots; ``one_expert``: every token of every rank picks the same experts (with K = 1, one
    expert gets everything); ``zero_tokens``: one rank has no tokens. Token counts per rank
    are drawn from 0 to ``max_tokens``, so ranks and experts that receive nothing are common.
    """
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in 1..num_experts ({num_experts})")

    @st.composite
    def _routing(draw):
        kind = draw(st.sampled_from(list(kinds)))
        tokens = [draw(st.integers(0, max_tokens)) for _ in range(world_size)]
        if kind == "zero_tokens":
            tokens[draw(st.integers(0, world_size - 1))] = 0
        hot = draw(st.integers(0, num_experts - 1))
        seed = draw(st.integers(0, 2**31 - 1))
        ids = tuple(_route_tokens(kind, t, num_experts, top_k, hot, seed + r)
                    for r, t in enumerate(tokens))
        return MoERouting(kind, num_experts, top_k, ids)

    return _routing()


__all__ += ["MoERouting", "moe_routings", "ROUTING_KINDS"]
