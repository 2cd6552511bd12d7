"""Experts as stacked weights run in one grouped matmul, and the per-expert modules they match.

Shape legend (suffixes on tensor names):
    R  rows this rank's experts receive (grouped by local expert)
    D  model dimension                   F  an expert's hidden width
    L  experts on this rank (local experts)

:class:`GroupedExperts` holds ``L`` MLP experts as ``w1_LDF``, ``w3_LDF`` (SwiGLU only) and
``w2_LFD`` and runs all of them over the rows of every local expert with three (SwiGLU) or
two (GELU) grouped matmuls (:func:`tribucket.kernels.moe.grouped_matmul`), instead of one
small matmul per expert. Its ``state_dict`` names each expert as a module of
:class:`SwiGLUExpert` / :class:`GELUExpert` would, by global expert index
(``5.w1.weight`` is ``Linear`` layout ``[F, D]``), so a checkpoint written by a layer with a
list of such modules loads into a grouped layer and back.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import torch
import torch.nn.functional as F_
from torch import nn

from ..kernels.moe import (GROUPED_IMPLS, grouped_matmul, grouped_mm_aligned, host_ints,
                           pick_grouped_impl)

__all__ = ["ACTIVATIONS", "GELUExpert", "GroupedExperts", "SwiGLUExpert"]

#: the expert MLPs GroupedExperts runs
ACTIVATIONS = ("swiglu", "gelu")


class SwiGLUExpert(nn.Module):
    """One SwiGLU expert: ``w2(silu(w1(x)) * w3(x))``, no biases (DeepSeek, Qwen, Mixtral)."""

    def __init__(self, d_model: int, d_ff: int, *, device=None, dtype=None):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False, device=device, dtype=dtype)
        self.w3 = nn.Linear(d_model, d_ff, bias=False, device=device, dtype=dtype)
        self.w2 = nn.Linear(d_ff, d_model, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F_.silu(self.w1(x)) * self.w3(x))


class GELUExpert(nn.Module):
    """One GELU expert: ``w2(gelu(w1(x)))`` (biases optional, as ``nn.Linear``'s)."""

    def __init__(self, d_model: int, d_ff: int, *, bias: bool = True, device=None, dtype=None):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=bias, device=device, dtype=dtype)
        self.w2 = nn.Linear(d_ff, d_model, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F_.gelu(self.w1(x)))


class GroupedExperts(nn.Module):
    r"""``num_experts`` MLP experts with stacked weights, run in one grouped matmul.

    ``forward(x_RD, tokens_per_expert)``: ``x_RD`` holds expert 0's rows, then expert 1's,
    ... (``tokens_per_expert[l]`` rows each, as the dispatcher hands them out); returns the
    experts' outputs in the same order. Equal to calling :class:`SwiGLUExpert` (or
    :class:`GELUExpert`) ``l`` on its rows, up to fp summation order.

    ``impl`` picks how the matmuls run: ``"grouped_mm"`` (torch's grouped GEMM, one call
    per projection), ``"bmm"`` (padded), ``"loop"`` (each expert's whole MLP in turn), or
    ``"auto"`` (:func:`~tribucket.kernels.moe.pick_grouped_impl`: the grouped GEMM on a GPU;
    on the CPU the grouped GEMM for many small groups in fp32, else the loop). ``first_index`` is the
    global index of the first expert (what ``state_dict`` names it; :class:`MoELayer` sets
    it to the rank's ``expert_offset``).

    Example (pass it to MoELayer in place of a list of experts)::

        experts = GroupedExperts(num_experts=16, d_model=512, d_ff=256, activation="swiglu")
        layer = tribucket.moe.MoELayer(experts, num_experts=16 * world, d_model=512, top_k=4)

        old = [SwiGLUExpert(512, 256) for _ in range(16)]         # or from modules
        experts = GroupedExperts.from_experts(old)                 # the same weights, stacked
    """

    def __init__(self, num_experts: int, d_model: int, d_ff: int, *, activation: str = "swiglu",
                 bias: bool = False, impl: str = "auto", first_index: int = 0,
                 device=None, dtype=None):
        super().__init__()
        for name, v in (("num_experts", num_experts), ("d_model", d_model), ("d_ff", d_ff)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is not one of {ACTIVATIONS}")
        if bias and activation == "swiglu":
            raise ValueError("bias=True is for activation='gelu' (SwiGLU experts have no biases "
                             "in the models that use them); pass bias=False")
        if impl not in GROUPED_IMPLS:
            raise ValueError(f"impl={impl!r} is not one of {GROUPED_IMPLS}")
        self.num_experts, self.d_model, self.d_ff = num_experts, d_model, d_ff
        self.activation, self.impl, self.first_index = activation, impl, first_index
        L, D, F = num_experts, d_model, d_ff
        kw = dict(device=device, dtype=dtype)
        # nn.Linear's default init (kaiming-uniform of a [F, D] weight: bound 1/sqrt(fan_in))
        self.w1 = nn.Parameter(_uniform((L, D, F), D, **kw))
        self.w2 = nn.Parameter(_uniform((L, F, D), F, **kw))
        self.w3 = nn.Parameter(_uniform((L, D, F), D, **kw)) if activation == "swiglu" else None
        self.b1 = nn.Parameter(_uniform((L, F), D, **kw)) if bias else None
        self.b2 = nn.Parameter(_uniform((L, D), F, **kw)) if bias else None
        self._register_state_dict_hook(_per_expert_state)
        self._register_load_state_dict_pre_hook(_stacked_state, with_module=True)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, d_model={self.d_model}, d_ff={self.d_ff}, "
                f"activation={self.activation}, bias={self.b1 is not None}, impl={self.impl}")

    def forward(self, x_RD: torch.Tensor, tokens_per_expert: Sequence[int]) -> torch.Tensor:
        counts = [int(c) for c in tokens_per_expert]
        if x_RD.dim() != 2 or x_RD.shape[1] != self.d_model:
            raise ValueError(f"x_RD has shape {tuple(x_RD.shape)}; expected [R, d_model="
                             f"{self.d_model}]")
        if len(counts) != self.num_experts or sum(counts) != x_RD.shape[0]:
            raise ValueError(f"tokens_per_expert {counts} must have one count per expert "
                             f"({self.num_experts}) adding up to x_RD's {x_RD.shape[0]} rows")
        x_RD = x_RD.to(self.w1.dtype)
        impl = self.impl_for(len(x_RD))
        if impl == "loop":
            return self._expert_by_expert(x_RD, counts)
        # the groups' offsets go to the device once per forward, without a host stall (a
        # pageable copy per projection synchronised the host three times)
        offs = (host_ints(list(itertools.accumulate(counts)), x_RD.device)
                if x_RD.is_cuda else None)
        h_RF = grouped_matmul(x_RD, self.w1, counts, impl=impl, offs=offs)
        if self.b1 is not None:
            h_RF = h_RF + self._per_row(self.b1, counts)
        if self.w3 is not None:
            h_RF = F_.silu(h_RF) * grouped_matmul(x_RD, self.w3, counts, impl=impl, offs=offs)
        else:
            h_RF = F_.gelu(h_RF)
        y_RD = grouped_matmul(h_RF, self.w2, counts, impl=impl, offs=offs)
        if self.b2 is not None:
            y_RD = y_RD + self._per_row(self.b2, counts)
        return y_RD

    def impl_for(self, num_rows: int) -> str:
        """The ``impl`` a forward of ``num_rows`` rows runs (``"auto"`` resolved: one choice
        for the three projections, their shapes share D and F)."""
        if self.impl != "auto":
            return self.impl
        if not grouped_mm_aligned(self.w1):
            return "loop"
        return pick_grouped_impl(self.w1.device, self.w1.dtype, num_rows / self.num_experts)

    def _expert_by_expert(self, x_RD: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``impl="loop"``: each expert's whole MLP on its rows, one expert after the other,
        and one concatenation at the end (a loop per projection would concatenate three
        times; on the CPU this is 6-14% faster than that). ``unbind`` hands each stacked
        weight's gradient back in one piece."""
        w1, w2 = self.w1.unbind(0), self.w2.unbind(0)
        w3 = self.w3.unbind(0) if self.w3 is not None else None
        b1 = self.b1.unbind(0) if self.b1 is not None else None
        b2 = self.b2.unbind(0) if self.b2 is not None else None
        outs = []
        for l, rows in enumerate(x_RD.split(counts)):
            h = rows @ w1[l] if b1 is None else torch.addmm(b1[l], rows, w1[l])
            h = F_.silu(h) * (rows @ w3[l]) if w3 is not None else F_.gelu(h)
            outs.append(h @ w2[l] if b2 is None else torch.addmm(b2[l], h, w2[l]))
        return torch.cat(outs)

    @staticmethod
    def _per_row(b_LX: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return b_LX.repeat_interleave(host_ints(counts, b_LX.device, torch.int64), dim=0,
                                      output_size=sum(counts))

    # -- to and from a list of modules (checkpoints, gathered_experts) ------------------
    def expert_state(self, l: int) -> dict[str, torch.Tensor]:
        """Local expert ``l``'s weights in :class:`SwiGLUExpert` / :class:`GELUExpert`
        layout (``Linear``: ``[out, in]``), as views of the stacked parameters."""
        if self.w3 is not None:  # SwiGLUExpert's order
            return {"w1.weight": self.w1[l].t(), "w3.weight": self.w3[l].t(),
                    "w2.weight": self.w2[l].t()}
        if self.b1 is None:
            return {"w1.weight": self.w1[l].t(), "w2.weight": self.w2[l].t()}
        return {"w1.weight": self.w1[l].t(), "w1.bias": self.b1[l],
                "w2.weight": self.w2[l].t(), "w2.bias": self.b2[l]}

    def to_experts(self) -> list[nn.Module]:
        """One :class:`SwiGLUExpert` / :class:`GELUExpert` per local expert, holding copies
        of its weights (no gradient flows back to the stacked parameters)."""
        out = []
        for l in range(self.num_experts):
            e = _module_for(self.activation, self.d_model, self.d_ff, self.b1 is not None,
                            self.w1.device, self.w1.dtype)
            with torch.no_grad():
                e.load_state_dict({k: v.detach().clone() for k, v in self.expert_state(l).items()})
            out.append(e)
        return out

    @classmethod
    def from_experts(cls, experts: Sequence[nn.Module], *, impl: str = "auto",
                     first_index: int = 0) -> "GroupedExperts":
        """Stack the weights of ``experts``: :class:`SwiGLUExpert` s, :class:`GELUExpert` s
        or ``nn.Sequential(Linear(D, F), GELU(), Linear(F, D))`` modules, all alike."""
        experts = list(experts)
        if not experts:
            raise ValueError("from_experts needs at least one expert module")
        states, activation = [], None
        for i, e in enumerate(experts):
            kind, state = _expert_layout(e)
            if kind is None:
                raise TypeError(
                    f"expert {i} ({type(e).__name__}) is not a SwiGLUExpert, GELUExpert or "
                    f"Sequential(Linear, GELU, Linear): GroupedExperts cannot stack it")
            if activation not in (None, kind):
                raise ValueError(f"expert {i} is a {kind} expert but expert 0 is {activation}: "
                                 f"stack experts of one kind")
            activation = kind
            states.append(state)
        F, D = states[0]["w1.weight"].shape
        ref = states[0]["w1.weight"]
        grouped = cls(len(experts), D, F, activation=activation, bias="w1.bias" in states[0],
                      impl=impl, first_index=first_index, device=ref.device, dtype=ref.dtype)
        for i, s in enumerate(states):
            if {k: tuple(v.shape) for k, v in s.items()} != \
                    {k: tuple(v.shape) for k, v in states[0].items()}:
                raise ValueError(f"expert {i}'s weights differ in shape from expert 0's: "
                                 f"stack experts of one size")
        with torch.no_grad():
            for l, s in enumerate(states):
                for k, v in grouped.expert_state(l).items():
                    v.copy_(s[k])
        return grouped


def _uniform(shape, fan_in: int, device=None, dtype=None) -> torch.Tensor:
    bound = 1.0 / fan_in ** 0.5
    return torch.empty(shape, device=device, dtype=dtype).uniform_(-bound, bound)


def _module_for(activation: str, D: int, F: int, bias: bool, device, dtype) -> nn.Module:
    if activation == "swiglu":
        return SwiGLUExpert(D, F, device=device, dtype=dtype)
    return GELUExpert(D, F, bias=bias, device=device, dtype=dtype)


def _expert_layout(e: nn.Module) -> tuple[str | None, dict[str, torch.Tensor]]:
    """``(activation, state in SwiGLUExpert/GELUExpert names)`` of a module, or (None, {})."""
    if isinstance(e, SwiGLUExpert):
        return "swiglu", dict(e.state_dict())
    if isinstance(e, GELUExpert):
        return "gelu", dict(e.state_dict())
    if (isinstance(e, nn.Sequential) and len(e) == 3 and isinstance(e[0], nn.Linear)
            and isinstance(e[1], nn.GELU) and e[1].approximate == "none"
            and isinstance(e[2], nn.Linear)):
        state = {"w1.weight": e[0].weight, "w2.weight": e[2].weight}
        if e[0].bias is not None and e[2].bias is not None:
            state["w1.bias"], state["w2.bias"] = e[0].bias, e[2].bias
        elif e[0].bias is not None or e[2].bias is not None:
            return None, {}
        return "gelu", {k: v.detach() for k, v in state.items()}
    return None, {}


def _per_expert_state(module: GroupedExperts, state_dict, prefix, _local_metadata) -> None:
    """state_dict hook: the stacked tensors out, one entry per expert and weight in."""
    for name in ("w1", "w2", "w3", "b1", "b2"):
        state_dict.pop(prefix + name, None)
    for l in range(module.num_experts):
        for k, v in module.expert_state(l).items():
            state_dict[f"{prefix}{module.first_index + l}.{k}"] = v.detach()


def _stacked_state(module: GroupedExperts, state_dict, prefix, *_unused) -> None:
    """load_state_dict pre-hook: per-expert entries (``5.w1.weight``) -> the stacked tensors."""
    names = list(module.expert_state(0))
    for stacked, key, transpose in (("w1", "w1.weight", True), ("w2", "w2.weight", True),
                                    ("w3", "w3.weight", True), ("b1", "w1.bias", False),
                                    ("b2", "w2.bias", False)):
        if key not in names or prefix + stacked in state_dict:
            continue
        keys = [f"{prefix}{module.first_index + l}.{key}" for l in range(module.num_experts)]
        if not all(k in state_dict for k in keys):
            continue  # load_state_dict then reports the stacked tensor as missing
        parts = [state_dict.pop(k) for k in keys]
        state_dict[prefix + stacked] = torch.stack([p.t() if transpose else p for p in parts])
