"""Which bucket layout the reducer uses: DDP's initial one, then one rebuild in the order
gradients became ready on rank 0 (broadcast), as DDP does."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .layout import NO_CAP, BucketLayout, compute_layout

__all__ = ["LayoutSupport"]

# DDP's buffers are unpadded: tribucket's layouts start that way (see Reducer._align_bytes)
_DDP_ALIGN_BYTES = 1


class LayoutSupport:
    """The layout choices of :class:`tribucket.Reducer` (it supplies the state used here)."""

    def _initial_layout(self) -> BucketLayout:
        cfg = self.config
        if (cfg.find_unused_parameters and not cfg.static_graph) or cfg.shard_optimizer:
            # DDP keeps its size-capped initial buckets when it will never rebuild
            caps = dict(bucket_cap_bytes=cfg.bucket_cap_bytes,
                        first_bucket_cap_bytes=min(cfg.first_bucket_cap_bytes,
                                                   cfg.bucket_cap_bytes))
        else:
            # DDP 2.x: one bucket per (dtype, device) until the rebuild, because the
            # reverse-parameter-order guess is often wrong
            caps = dict(bucket_cap_bytes=NO_CAP, first_bucket_cap_bytes=NO_CAP)
        return compute_layout(self._params, expect_sparse=self._expect_sparse,
                              align_bytes=_DDP_ALIGN_BYTES, **caps)

    def _should_rebuild(self) -> bool:
        cfg = self.config
        if self._rebuilt or (cfg.find_unused_parameters and not cfg.static_graph):
            return False
        if cfg.shard_optimizer:  # the optimizer's shards follow the first layout
            return False
        return bool(self._ready_order)

    def _rebuild(self, ready_order: list[int]) -> None:
        """Rebuild the buckets in rank 0's gradient-ready order (broadcast), once."""
        order = list(ready_order)
        if self.config.static_graph:
            order += [i for i in self._unused if i not in set(order)]
        self._ready_order = []
        if sorted(order) != list(range(len(self._params))):
            order = list(range(len(self._params)))  # incomplete (a joined rank): index order
        t = torch.tensor(order, dtype=torch.int64, device=self._device)
        if self.world_size > 1:
            self._guard.fingerprint("rebuild", self._passes, 0, t.numel(), t.dtype)
            work = dist.broadcast(t, dist.get_global_rank(self._guard.group, 0)
                                  if self._guard.group is not dist.group.WORLD else 0,
                                  group=self._guard.group_arg(), async_op=True)
            self._guard.wait(work, "the bucket-rebuild broadcast", self._passes)
        cfg = self.config
        self._layout = compute_layout(
            self._params, bucket_cap_bytes=cfg.bucket_cap_bytes,
            first_bucket_cap_bytes=cfg.first_bucket_cap_bytes,
            expect_sparse=self._expect_sparse, order=t.tolist(),
            align_bytes=self._layout.align_bytes)
        self._rebuilt = True
        self.stats.rebuilds += 1
        self._allocate()
