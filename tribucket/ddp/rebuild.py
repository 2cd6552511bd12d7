"""Which bucket layout the reducer uses: DDP's initial one, then one rebuild in the order
gradients became ready on rank 0 (broadcast), as DDP does."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..config import ReducerConfig
from ..layout import NO_CAP, BucketLayout, compute_layout
from .watchdog import CommGuard

__all__ = ["DDP_ALIGN_BYTES", "LayoutPolicy"]

# DDP's buffers are unpadded: tribucket's layouts start that way (see allocate.align_bytes)
DDP_ALIGN_BYTES = 1


class LayoutPolicy:
    """The layout choices for one model: initial layout, whether and how to rebuild."""

    def __init__(self, config: ReducerConfig, params: list[torch.Tensor],
                 expect_sparse: list[bool]):
        self.config, self.params, self.expect_sparse = config, params, expect_sparse
        #: (bucket cap, first-bucket cap) in bytes replacing the config's (``autotune.py``)
        self.caps: tuple[int, int] | None = None
        #: the order of the rebuild (rank 0's, broadcast): later layouts keep it
        self.order: list[int] | None = None

    def initial(self) -> BucketLayout:
        cfg = self.config
        if cfg.bucket_cap_bytes_list is not None:
            # DDP lays the initial buckets out by the list too (and rebuilds by it)
            caps = dict(bucket_cap_bytes_list=cfg.bucket_cap_bytes_list)
        elif cfg.dynamic_unused or cfg.shard_optimizer:
            # DDP keeps its size-capped initial buckets when it will never rebuild (and the
            # sharded optimizer's state lives on the first layout)
            caps = dict(bucket_cap_bytes=cfg.bucket_cap_bytes,
                        first_bucket_cap_bytes=min(self.first_cap_bytes(),
                                                   cfg.bucket_cap_bytes))
        else:
            # DDP 2.x: one bucket per (dtype, device) until the rebuild, because the
            # reverse-parameter-order guess is often wrong
            caps = dict(bucket_cap_bytes=NO_CAP, first_bucket_cap_bytes=NO_CAP)
        return compute_layout(self.params, expect_sparse=self.expect_sparse,
                              align_bytes=DDP_ALIGN_BYTES, **caps)

    def first_cap_bytes(self) -> int:
        """The first bucket's cap after the rebuild. Left at its default on a model whose
        gradients are all on the CPU, it is the bucket cap: DDP's small first bucket starts an
        allreduce early so that it overlaps the rest of backward, but gloo reduces on the
        same cores the backward pass computes on, so the early allreduce competes with it
        instead (and adds one collective per step). ``shard_optimizer`` keeps its own caps."""
        cfg = self.config
        if (cfg.first_bucket_cap_mb is None and cfg.bucket_cap_mb is None
                and not cfg.shard_optimizer
                and all(p.device.type == "cpu" for p in self.params)):
            return cfg.bucket_cap_bytes
        return cfg.first_bucket_cap_bytes

    def may_rebuild(self, rebuilt: bool) -> bool:
        """Whether a rebuild can still happen (and gradient-ready order is worth recording)."""
        return not rebuilt and not self.config.dynamic_unused and not self.config.shard_optimizer

    def rebuilt(self, order: list[int], unused: list[int], align_bytes: int,
                guard: CommGuard, world_size: int, iteration: int) -> BucketLayout:
        """The layout in rank 0's gradient-ready ``order`` (broadcast), once. Under
        ``static_graph`` the ``unused`` parameters go last."""
        order = list(order)
        if self.config.static_graph:
            seen = set(order)
            order += [i for i in unused if i not in seen]
        n = len(self.params)
        if sorted(order) != list(range(n)):
            order = list(range(n))  # incomplete (a joined rank): index order
        t = torch.tensor(order, dtype=torch.int64, device=guard.device)
        if world_size > 1:
            guard.fingerprint("rebuild", iteration, 0, t.numel(), t.dtype)
            work = dist.broadcast(t, dist.get_global_rank(guard.group, 0)
                                  if guard.group is not dist.group.WORLD else 0,
                                  group=guard.group_arg(), async_op=True)
            guard.wait(work, "the bucket-rebuild broadcast", iteration)
        self.order = t.tolist()
        return self.relayout(self.caps, align_bytes)

    def cap_kwargs(self, caps: tuple[int, int] | None = None) -> dict:
        """:func:`compute_layout`'s cap arguments after the rebuild: ``caps`` (bucket cap,
        first cap) in bytes, else the config's (its ``bucket_cap_mb_list``, or its caps)."""
        cfg = self.config
        if caps is None and cfg.bucket_cap_bytes_list is not None:
            return dict(bucket_cap_bytes_list=cfg.bucket_cap_bytes_list)
        cap, first = caps or (cfg.bucket_cap_bytes, self.first_cap_bytes())
        return dict(bucket_cap_bytes=cap, first_bucket_cap_bytes=first)

    def relayout(self, caps: tuple[int, int] | None, align_bytes: int) -> BucketLayout:
        """The layout of the rebuild's order under ``caps`` (:meth:`cap_kwargs`)."""
        assert self.order is not None, "relayout before the rebuild"
        return compute_layout(self.params, expect_sparse=self.expect_sparse, order=self.order,
                              align_bytes=align_bytes, **self.cap_kwargs(caps))
