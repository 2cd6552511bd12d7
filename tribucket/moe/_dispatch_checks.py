"""The local checks of :class:`~tribucket.moe.dispatcher.MoEDispatcher`'s inputs and of the
experts' outputs (no communication): each names the tensor, the rank and the shape expected."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .dispatcher import DispatchMeta


class DispatchChecks:
    """A part of :class:`~tribucket.moe.dispatcher.MoEDispatcher` (its ``rank``,
    ``world_size``, ``num_experts`` and ``num_local_experts``)."""

    def _check_inputs(self, x_TD, expert_ids_TK, weights_TK) -> torch.Tensor:
        if not isinstance(x_TD, torch.Tensor) or x_TD.dim() != 2:
            raise ValueError(f"x_TD must be a 2-D [tokens, d_model] tensor, got "
                             f"{tuple(x_TD.shape) if isinstance(x_TD, torch.Tensor) else type(x_TD)}")
        if x_TD.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"x_TD must be float32, float16 or bfloat16, got {x_TD.dtype}")
        T = x_TD.shape[0]
        if (expert_ids_TK.dim() != 2 or expert_ids_TK.shape[0] != T or expert_ids_TK.shape[1] < 1
                or expert_ids_TK.dtype not in (torch.int64, torch.int32)):
            raise ValueError(f"expert_ids_TK must be an int64 [T={T}, K>=1] tensor, got "
                             f"{expert_ids_TK.dtype} {tuple(expert_ids_TK.shape)}")
        if weights_TK.shape != expert_ids_TK.shape or not weights_TK.is_floating_point():
            raise ValueError(f"weights_TK must be a float tensor of expert_ids_TK's shape "
                             f"{tuple(expert_ids_TK.shape)}, got {weights_TK.dtype} "
                             f"{tuple(weights_TK.shape)}")
        if not (x_TD.device == expert_ids_TK.device == weights_TK.device):
            raise ValueError(f"x_TD, expert_ids_TK and weights_TK must be on one device, got "
                             f"{x_TD.device}, {expert_ids_TK.device}, {weights_TK.device}")
        return expert_ids_TK.to(torch.int64)

    def _range_error(self, expert_ids_TK) -> ValueError:
        """The error of ids outside ``0..E-1`` (read once the flag says there are some)."""
        lo, hi = torch.stack(torch.aminmax(expert_ids_TK)).tolist()
        return ValueError(f"expert_ids_TK holds expert {lo if lo < 0 else hi}, outside "
                          f"0..{self.num_experts - 1}")

    def _check_by_source(self, expert_output, meta: DispatchMeta):
        """:meth:`_check_expert_output` of one output per source rank (``by_source``)."""
        outs, D = list(expert_output), meta.d_model
        if len(outs) != self.world_size:
            return (f"expert_output (by_source) has {len(outs)} tensors on rank {self.rank}; "
                    f"expected one per source rank ({self.world_size})"), None
        for w, (out, n) in enumerate(zip(outs, meta.recv_splits)):
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != (n, D):
                got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                return (f"the experts of rank {self.rank} returned {got} for the [{n}, {D}] rows "
                        f"from rank {w}; experts must map [n, D] -> [n, D]"), None
        return None, outs

    def _check_expert_output(self, expert_output, meta: DispatchMeta):
        """``(problem or None, rows_RD)``: a local check, no communication."""
        D, tpe = meta.d_model, meta.tokens_per_expert
        if isinstance(expert_output, torch.Tensor):
            want = (meta.num_recv, D)
            if tuple(expert_output.shape) != want:
                return (f"expert_output has shape {tuple(expert_output.shape)} on rank {self.rank}; "
                        f"expected {list(want)} (the [R, D] rows dispatch gave this rank's experts: "
                        f"experts must map [n, D] -> [n, D])"), None
            return None, expert_output
        outs = list(expert_output)
        if len(outs) != len(tpe):
            return (f"expert_output has {len(outs)} tensors on rank {self.rank}; expected one per "
                    f"local expert ({len(tpe)})"), None
        for l, (out, n) in enumerate(zip(outs, tpe)):
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != (n, D):
                got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                e = self.rank * self.num_local_experts + l
                return (f"expert {e} (local expert {l} on rank {self.rank}) returned {got} for "
                        f"an input of shape [{n}, {D}]; experts must map [n, D] -> [n, D]"), None
        return None, outs  # exchange_back concatenates them (with the regroup, in one copy)
