"""Bucket layouts: which tensor goes in which bucket, at which element offset.

Pure data and pure Python: no communication, no kernels. The grouping follows torch DDP's
``compute_bucket_assignment_by_size`` (``torch/csrc/distributed/c10d/reducer.cpp``) so a
model bucketed by tribucket has DDP's buckets, in DDP's order, with DDP's tensors inside:

* tensors are grouped by ``(dtype, device)``;
* tensors are walked in the given order; a bucket closes as soon as its (unpadded) byte
  size reaches the current cap: ``first_bucket_cap_bytes`` for the first bucket of each
  key, ``bucket_cap_bytes`` afterwards (or, given ``bucket_cap_bytes_list``, the k-th cap
  for the k-th bucket of each key, the last cap repeating);
* a tensor expecting a sparse gradient gets a bucket of its own;
* without ``order``: buckets are sorted by their smallest tensor index and the list is
  reversed (the gradients of the last layers are ready first);
* with ``order`` (the rebuild, walking tensors in the order their gradients became ready):
  buckets stay in the order they closed; the partly-filled bucket of each key is appended
  in the iteration order of the C++ ``std::unordered_map`` that holds them (emulated
  exactly, see ``_unordered_map_order``), so mixed-dtype models rebuild as DDP does.

Example::

    >>> import torch, tribucket
    >>> ts = [torch.empty(3), torch.empty(5)]
    >>> layout = tribucket.compute_layout(ts, bucket_cap_bytes=1 << 20, align_bytes=16)
    >>> layout.buckets[0].indices, layout.buckets[0].offsets, layout.buckets[0].numel
    ((0, 1), (0, 4), 9)

A bucket's flat buffer holds tensor ``i`` at ``[offset_i, offset_i + numel_i)``; offsets are
padded so each tensor starts on an ``align_bytes`` boundary (the padding is not counted
against the caps, so the grouping stays DDP's).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

__all__ = ["TensorSpec", "Bucket", "BucketLayout", "compute_layout", "NO_CAP"]

#: A cap that never closes a bucket (DDP passes ``sys.maxsize`` for "one bucket per key").
NO_CAP = sys.maxsize

# Version of the int64 encoding produced by BucketLayout.to_tensor().
_ENCODING_VERSION = 1


@dataclass(frozen=True)
class TensorSpec:
    """Shape, dtype and device of a tensor, standing in for the tensor itself."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    #: whether the tensor's gradient is expected to be sparse (overridden by expect_sparse)
    sparse: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "device", torch.device(self.device))
        if any(s < 0 for s in self.shape):
            raise ValueError(f"TensorSpec.shape must be non-negative, got {self.shape}")

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return _itemsize(self.dtype)

    @classmethod
    def of(cls, t: "torch.Tensor | TensorSpec") -> "TensorSpec":
        if isinstance(t, TensorSpec):
            return t
        return cls(tuple(t.shape), t.dtype, t.device)


@dataclass(frozen=True)
class Bucket:
    """One bucket: the tensors it holds and where each sits in its flat buffer."""

    #: positions in the tensor list given to compute_layout, in the bucket's order
    indices: tuple[int, ...]
    #: element offset of each tensor (same order as ``indices``) inside the flat buffer
    offsets: tuple[int, ...]
    #: number of elements of each tensor (same order as ``indices``)
    sizes: tuple[int, ...]
    #: elements in the flat buffer, alignment padding included
    numel: int
    dtype: torch.dtype
    device: torch.device
    #: the byte cap this bucket was filled against (NO_CAP for sparse buckets)
    cap_bytes: int
    #: whether this bucket holds a single sparse-gradient tensor
    sparse: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes of the flat buffer, padding included."""
        return self.numel * _itemsize(self.dtype)

    @property
    def payload_bytes(self) -> int:
        """Bytes of the tensors themselves (what DDP's cap is compared with)."""
        return sum(self.sizes) * _itemsize(self.dtype)

    @property
    def padding(self) -> int:
        """Elements of alignment padding in the flat buffer."""
        return self.numel - sum(self.sizes)


@dataclass(frozen=True)
class BucketLayout:
    """All buckets of a tensor list, in the order they will be reduced."""

    buckets: tuple[Bucket, ...]
    num_tensors: int
    align_bytes: int = 16
    _where: dict = field(default=None, repr=False, compare=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        where = {}
        for b, bucket in enumerate(self.buckets):
            for i, off in zip(bucket.indices, bucket.offsets):
                where[i] = (b, off)
        object.__setattr__(self, "_where", where)

    def __len__(self) -> int:
        return len(self.buckets)

    def __iter__(self):
        return iter(self.buckets)

    def locate(self, i: int) -> tuple[int, int]:
        """Return ``(bucket_index, element_offset)`` of tensor ``i``."""
        try:
            return self._where[i]
        except KeyError:
            raise ValueError(
                f"tensor index {i} is not in this layout (it has {self.num_tensors} tensors)"
            ) from None

    def bucket_indices(self) -> list[list[int]]:
        """The grouping as ``torch.distributed._compute_bucket_assignment_by_size`` returns it."""
        return [list(b.indices) for b in self.buckets]

    # -- encoding, so rank 0's layout can be broadcast ------------------------------------
    def to_tensor(self) -> torch.Tensor:
        """Encode the grouping as a 1-D int64 tensor (offsets are recomputed on decode).

        ``[version, num_tensors, align_bytes, num_buckets, (cap, sparse, k, i_1..i_k)*]``
        """
        data = [_ENCODING_VERSION, self.num_tensors, self.align_bytes, len(self.buckets)]
        for b in self.buckets:
            data += [min(b.cap_bytes, 2**63 - 1), int(b.sparse), len(b.indices), *b.indices]
        return torch.tensor(data, dtype=torch.int64)

    @classmethod
    def from_tensor(
        cls, encoded: torch.Tensor, tensors: Sequence["torch.Tensor | TensorSpec"]
    ) -> "BucketLayout":
        """Decode :meth:`to_tensor`'s output for the same ``tensors``."""
        data = [int(v) for v in encoded.detach().cpu().reshape(-1).tolist()]
        if len(data) < 4 or data[0] != _ENCODING_VERSION:
            raise ValueError(f"encoded layout has an unknown version/header: {data[:4]}")
        _, n, align, nb = data[:4]
        specs = _as_specs(tensors)
        if n != len(specs):
            raise ValueError(
                f"encoded layout is for {n} tensors but {len(specs)} tensors were given"
            )
        pos, groups = 4, []
        for _ in range(nb):
            cap, sparse, k = data[pos : pos + 3]
            groups.append((tuple(data[pos + 3 : pos + 3 + k]), cap, bool(sparse)))
            pos += 3 + k
        if pos != len(data):
            raise ValueError(f"encoded layout has {len(data) - pos} trailing values")
        seen = sorted(i for g, _, _ in groups for i in g)
        if seen != list(range(n)):
            raise ValueError("encoded layout does not hold every tensor exactly once")
        return _assemble(groups, specs, align)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def _as_specs(tensors: Iterable) -> list[TensorSpec]:
    specs = []
    for i, t in enumerate(tensors):
        if isinstance(t, TensorSpec):
            specs.append(t)
        elif isinstance(t, torch.Tensor):
            specs.append(TensorSpec(tuple(t.shape), t.dtype, t.device))
        else:
            raise ValueError(
                f"tensors[{i}] is a {type(t).__name__}, expected a torch.Tensor, "
                "nn.Parameter or tribucket.TensorSpec"
            )
    return specs


def _align_elems(dtype: torch.dtype, align_bytes: int) -> int:
    return max(1, align_bytes // _itemsize(dtype))


def _assemble(
    groups: Sequence[tuple[tuple[int, ...], int, bool]], specs: Sequence[TensorSpec], align: int
) -> BucketLayout:
    buckets = []
    for indices, cap, sparse in groups:
        dtype, device = specs[indices[0]].dtype, specs[indices[0]].device
        a = _align_elems(dtype, align)
        offsets, sizes, pos = [], [], 0
        for i in indices:
            pos = -(-pos // a) * a  # round up to the alignment
            offsets.append(pos)
            sizes.append(specs[i].numel())
            pos += specs[i].numel()
        buckets.append(
            Bucket(tuple(indices), tuple(offsets), tuple(sizes), pos, dtype, device, cap, sparse)
        )
    return BucketLayout(tuple(buckets), len(specs), align)


# -- the C++ unordered_map emulation --------------------------------------------------------
# DDP keeps its partly-filled buckets in std::unordered_map<BucketKey, ...> and appends them
# in the map's iteration order. That order is an artifact of libstdc++'s hash table: the hash
# is c10::get_hash(scalar_type, device) and a node inserted into an empty slot goes to the
# front of the table's list. We reproduce it so a rebuilt mixed-dtype layout equals DDP's.

_MASK64 = (1 << 64) - 1
_SCALAR_TYPE_CODE = {  # c10::ScalarType enum values
    torch.uint8: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.int64: 4,
    torch.float16: 5, torch.float32: 6, torch.float64: 7, torch.complex32: 8,
    torch.complex64: 9, torch.complex128: 10, torch.bool: 11, torch.bfloat16: 15,
    torch.float8_e5m2: 23, torch.float8_e4m3fn: 24, torch.float8_e5m2fnuz: 25,
    torch.float8_e4m3fnuz: 26, torch.uint16: 27, torch.uint32: 28, torch.uint64: 29,
}  # fmt: skip
_DEVICE_TYPE_CODE = {"cpu": 0, "cuda": 1, "hip": 6, "xla": 9, "xpu": 12, "mps": 13, "meta": 14}
# libstdc++ _Prime_rehash_policy::_M_next_bkt's table for small counts
_FAST_BUCKETS = (2, 2, 2, 3, 5, 5, 7, 7, 11, 11, 11, 11, 13, 13)


def _bucket_key_hash(dtype: torch.dtype, device: torch.device) -> int | None:
    st, dt = _SCALAR_TYPE_CODE.get(dtype), _DEVICE_TYPE_CODE.get(device.type)
    if st is None or dt is None:
        return None
    index = -1 if device.index is None else device.index
    hd = (dt << 16) | (index & 0xFF)  # std::hash<c10::Device>
    # c10::hash_combine(seed=hash(device), value=hash(scalar_type))
    return (hd ^ ((st + 0x9E3779B9 + ((hd << 6) & _MASK64) + (hd >> 2)) & _MASK64)) & _MASK64


def _next_prime(n: int) -> int:
    if n < len(_FAST_BUCKETS):
        return _FAST_BUCKETS[n]
    while any(n % p == 0 for p in range(2, math.isqrt(n) + 1)):
        n += 1
    return n


def _unordered_map_order(keys: Sequence[tuple]) -> list[tuple]:
    """Iteration order of a libstdc++ unordered_map after inserting ``keys`` (unique) in order."""
    hashes = {k: _bucket_key_hash(*k) for k in keys}
    if any(h is None for h in hashes.values()):
        return list(reversed(keys))  # unknown dtype/device code: the collision-free order
    nbkt, next_resize, nodes = 1, 0, []

    def insert(node: tuple, into: list) -> None:
        slot = hashes[node] % nbkt
        for j, other in enumerate(into):
            if hashes[other] % nbkt == slot:
                into.insert(j, node)  # to the front of its slot's run
                return
        into.insert(0, node)  # an empty slot: to the front of the whole list

    for key in keys:
        if len(nodes) + 1 > next_resize:  # _M_need_rehash
            min_bkts = max(len(nodes) + 1, 0 if next_resize else 11)
            if min_bkts >= nbkt:
                nbkt = _next_prime(max(min_bkts + 1, nbkt * 2))
                old, nodes = nodes, []
                for node in old:
                    insert(node, nodes)
            next_resize = nbkt
        insert(key, nodes)
    return nodes


# -- the layout itself ---------------------------------------------------------------------


def compute_layout(
    tensors: Sequence["torch.Tensor | TensorSpec"],
    bucket_cap_bytes: int = 25 * 2**20,
    first_bucket_cap_bytes: int | None = 2**20,
    expect_sparse: Sequence[bool] | None = None,
    order: Sequence[int] | None = None,
    align_bytes: int = 16,
    bucket_cap_bytes_list: Sequence[int] | None = None,
) -> BucketLayout:
    """Assign ``tensors`` to buckets exactly as torch DDP's ``compute_bucket_assignment_by_size``.

    Args:
        tensors: tensors, parameters or :class:`TensorSpec` (shape, dtype, device).
        bucket_cap_bytes: byte cap of every bucket after the first of each (dtype, device).
        first_bucket_cap_bytes: byte cap of the first bucket of each (dtype, device); ``None``
            means ``bucket_cap_bytes``. DDP uses 1 MiB when its ``bucket_cap_mb`` is left at
            the default and ``bucket_cap_bytes`` otherwise.
        expect_sparse: one bool per tensor; ``True`` gives the tensor a bucket of its own.
            ``None`` takes :attr:`TensorSpec.sparse` (``False`` for tensors).
        order: a permutation of ``range(len(tensors))``: the order gradients became ready.
            Tensors are walked in this order and buckets are kept in the order they closed.
        align_bytes: each tensor's start offset is padded to a multiple of this many bytes
            (a power of two; padding does not count against the caps).
        bucket_cap_bytes_list: one byte cap per bucket of each (dtype, device), in the
            order the buckets fill, the last one repeating (DDP's ``bucket_cap_mb_list``);
            given, it replaces ``bucket_cap_bytes`` and ``first_bucket_cap_bytes``.
    """
    specs = _as_specs(tensors)
    n = len(specs)
    if bucket_cap_bytes_list is not None:
        limits = list(bucket_cap_bytes_list)  # torch's bucket_size_limits: the last repeats
        if not limits:
            raise ValueError("bucket_cap_bytes_list must hold at least one cap (bytes), got "
                             "an empty list")
        named = [(f"bucket_cap_bytes_list[{k}]", cap) for k, cap in enumerate(limits)]
    else:
        first = bucket_cap_bytes if first_bucket_cap_bytes is None else first_bucket_cap_bytes
        limits = [first, bucket_cap_bytes]
        named = [("bucket_cap_bytes", bucket_cap_bytes), ("first_bucket_cap_bytes", first)]
    for name, cap in named:
        if isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0:
            raise ValueError(f"{name} must be a positive int (bytes), got {cap!r}")
    if isinstance(align_bytes, bool) or not isinstance(align_bytes, int) or align_bytes <= 0 \
            or align_bytes & (align_bytes - 1):
        raise ValueError(f"align_bytes must be a positive power of two, got {align_bytes!r}")
    if expect_sparse is None:
        sparse = [s.sparse for s in specs]
    else:
        sparse = [bool(x) for x in expect_sparse]
        if len(sparse) != n:
            raise ValueError(
                f"expect_sparse has {len(sparse)} entries but there are {n} tensors"
            )
    if order is not None:
        order = [int(i) for i in order]
        if sorted(order) != list(range(n)):
            raise ValueError(
                f"order must be a permutation of range({n}) (every tensor index once), "
                f"got {order[:20]}{'...' if len(order) > 20 else ''}"
            )
    walk = order if order is not None else list(range(n))

    result: list[tuple[tuple[int, ...], int, bool]] = []
    open_buckets: dict[tuple, list] = {}  # key -> [indices, bytes]; insertion order = map order
    limit_pos: dict[tuple, int] = {}
    for i in walk:
        spec = specs[i]
        if sparse[i]:
            result.append(((i,), NO_CAP, True))
            continue
        key = (spec.dtype, spec.device)
        acc = open_buckets.setdefault(key, [[], 0])
        acc[0].append(i)
        acc[1] += spec.numel() * spec.element_size()
        pos = limit_pos.setdefault(key, 0)
        if acc[1] >= limits[pos]:
            result.append((tuple(acc[0]), limits[pos], False))
            open_buckets[key] = [[], 0]
            limit_pos[key] = min(pos + 1, len(limits) - 1)
    keys = list(open_buckets) if order is None else _unordered_map_order(list(open_buckets))
    for key in keys:
        indices, _ = open_buckets[key]
        if indices:
            result.append((tuple(indices), limits[limit_pos[key]], False))
    if order is None:
        result.sort(key=lambda g: min(g[0]))
        result.reverse()
    return _assemble(result, specs, align_bytes)
