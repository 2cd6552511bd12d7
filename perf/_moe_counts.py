"""What one MoE layer step costs besides FLOPs: collectives, host syncs and tensor ops.

``count_step(step)`` runs ``step()`` (a forward + backward) once and returns

* ``collectives``: calls into ``torch.distributed`` by name (all-to-alls, all-reduces, ...;
  ``barrier`` excluded), counted by wrapping the functions the layers call, plus functional
  collectives (``_c10d_functional`` ops);
* ``host_syncs``: device-to-host reads (``.item()``, ``int()``/``bool()`` of a tensor, i.e.
  ``aten::_local_scalar_dense``, and ``.tolist()``); free on CPU tensors apart from the
  Python call, a stall of the whole stream on a GPU;
* ``aten_ops``: ATen operator calls, forward and backward (what the fixed per-layer cost
  is made of on the CPU path: each costs a few microseconds of dispatch however small).
"""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["count_step"]

_COLLECTIVES = ("all_to_all_single", "all_to_all", "all_reduce", "all_gather", "broadcast",
                "all_gather_into_tensor", "reduce_scatter_tensor", "batch_isend_irecv",
                "send", "recv", "isend", "irecv")


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def count_step(step) -> dict:
    """Run ``step()`` once, counting collectives, host syncs and ATen ops (see the module doc)."""
    calls = collections.Counter()
    saved = {}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return counted

    for name in _COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is not None:
            saved[name] = fn
            setattr(dist, name, wrap(name, fn))
    tolist = torch.Tensor.tolist
    tolists = [0]

    def counted_tolist(self):
        tolists[0] += 1
        return tolist(self)

    torch.Tensor.tolist = counted_tolist
    mode = _Ops()
    try:
        with mode:
            step()
    finally:
        torch.Tensor.tolist = tolist
        for name, fn in saved.items():
            setattr(dist, name, fn)
    # c10d ops of the dist.* calls show up in the dispatch mode too: count them once, as
    # collectives; functional collectives (torch.distributed._functional_collectives, what
    # torchtitan calls) only show up there
    for k, v in mode.ops.items():
        name = k.split(".", 1)[1] if k.startswith("_c10d_functional.") else ""
        if name.startswith(("all_", "reduce_", "broadcast")):  # not wait_tensor, wrappers
            calls[name] += v
    ops = {k: v for k, v in mode.ops.items() if "c10d" not in k}
    return dict(collectives=dict(calls), collectives_total=sum(calls.values()),
                host_syncs=ops.get("aten._local_scalar_dense", 0) + tolists[0],
                aten_ops=sum(ops.values()), top_ops=dict(collections.Counter(ops).most_common(12)))
