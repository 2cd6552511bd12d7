"""Expert-parallel token dispatch and combine.

Shape legend (suffixes on tensor names):
    T  tokens on this rank                 K  experts per token (top-k)
    D  model dimension                     E  experts in the group (global), E = W * L
    W  ranks in the expert-parallel group  L  experts per rank (local experts)
    N  rows this rank sends (its kept token-slots, N <= T * K)
    R  rows this rank receives (the input of its local experts)

Expert ``e`` lives on rank ``e // L`` as local expert ``e % L``. ``dispatch`` is::

    plan       expert_ids_TK -> counts_E (kernel), dest_TK and its inverse slot_N (stable
               sort by expert: token order inside an expert, so capacity drops the latest
               tokens), then the counts all-to-all: send_counts_WL -> recv_counts_WL, the
               splits (one host read of every count at once)
    permute    x_TD -> send_ND, expert-ordered = rank-major (kernel, one launch; on CPU one
               gather by slot_N)
    exchange   send_ND -> all-to-all (uneven) -> rows by (source rank, local expert)
               -> regroup to (local expert, source rank) when L > 1 and W > 1: one cat of
               the W·L contiguous pieces -> expert_input_RD (``exchange_by_source``: no
               regroup, one block per source rank)

and ``combine`` runs the same steps backwards (ungroup: one cat of the experts' outputs in
(source rank, local expert) order, reverse all-to-all, weighted unpermute in fp32). Every
step is differentiable; the all-to-alls' backward is the reverse exchange, so ``x_TD``,
``weights_TK`` and the experts all get gradients.

With ``dedup`` (:class:`UniqueRows`) the exchange moves one row per (token, destination
rank) instead of one per slot: ``pack`` replaces ``permute``, the receiver copies each row to
its chosen local experts (in the order above) and ``combine`` sums the weighted outputs of a
row on the experts' rank before the return exchange (:mod:`tribucket.moe.dedup`).

The token movement in the middle (``exchange`` -> experts -> ``exchange_back``) is the part
a pipelined schedule (FasterMoE's pairwise exchange) replaces: it needs ``send_ND`` (rank
``w``'s rows are the contiguous slice ``send_splits[w]``), ``recv_counts_WL`` (what arrives
from whom, for which local expert) and must hand back ``back_ND`` in ``send_ND``'s order.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, NoReturn, Sequence

import torch
import torch.distributed as dist

from ..comm import all_to_all, all_to_all_beside, exchange_counts, group_rank_and_size
from ..kernels.moe import (_use_triton, first_order_only, moe_counts, permute_tokens,
                           unpermute_tokens)
from . import dedup as _dedup
from ._dispatch_checks import DispatchChecks
from ._slots import _kept_slots, _route
from .dedup import UniqueRows

__all__ = ["DispatchMeta", "MoEDispatcher", "expert_capacity"]


def expert_capacity(capacity_factor: float | None, num_tokens: int, top_k: int,
                    num_experts: int) -> int | None:
    """GShard capacity: ``ceil(capacity_factor · T · K / E)`` rows per expert from one rank.

    ``None`` (dropless) when ``capacity_factor`` is None. The factor is taken as the decimal
    it prints as (``1.1`` is 11/10 exactly), so the ceiling never rounds up a float error.
    """
    if capacity_factor is None:
        return None
    exact = Fraction(repr(float(capacity_factor))) * num_tokens * top_k / num_experts
    return math.ceil(exact)


@dataclass(frozen=True)
class DispatchMeta:
    """Everything ``combine`` needs to undo ``dispatch`` (all integers exact, int64)."""

    #: T: tokens this rank dispatched
    num_tokens: int
    #: K: experts per token
    top_k: int
    #: D: row length
    d_model: int
    #: rows per expert accepted from this rank (None: dropless)
    capacity: int | None
    #: [T, K] int64: row of ``send_ND`` each token-slot went to, -1 where capacity dropped it
    dest_TK: torch.Tensor
    #: [T, K] gate weights used by combine (they carry the router's gradient)
    weights_TK: torch.Tensor
    #: [E] int64: this rank's token-slots per global expert, before capacity drops
    counts_E: torch.Tensor
    #: [W, L] int64: rows this rank sends to rank w's local expert l (after drops)
    send_counts_WL: torch.Tensor
    #: [W, L] int64: rows this rank receives from rank w for its local expert l
    recv_counts_WL: torch.Tensor
    #: rows sent to each rank (``send_ND`` is rank-major: rank w's rows are contiguous)
    send_splits: tuple[int, ...]
    #: rows received from each rank
    recv_splits: tuple[int, ...]
    #: rows of ``expert_input`` per local expert, in local-expert order
    tokens_per_expert: tuple[int, ...]
    #: [N] int64: the token-slot ``t * K + k`` filling each row of ``send_ND`` (the inverse
    #: of ``dest_TK``; the PyTorch path gathers and combines by it)
    slot_N: torch.Tensor
    #: the received rows are regrouped from (source rank, local expert) to (local expert,
    #: source rank) order (L > 1 and W > 1)
    regroup: bool
    #: token-slots this rank dropped (capacity mode)
    num_dropped: int
    #: ``send_counts_WL`` as host integers (``[w][l]``), for schedules that loop over peers
    send_counts_host: tuple[tuple[int, ...], ...] = ()
    #: ``recv_counts_WL`` as host integers (``[w][l]``)
    recv_counts_host: tuple[tuple[int, ...], ...] = ()
    #: ``counts_E`` as host integers
    counts_host: tuple[int, ...] = ()
    #: ``[w][e]``: rows rank ``w`` sends to global expert ``e`` (after drops), every rank's
    #: routing; only when ``plan(..., gather_counts=True)`` (None otherwise)
    global_counts_host: tuple[tuple[int, ...], ...] | None = None
    #: dtype of the dispatched rows (what ``combine`` sends back in)
    row_dtype: torch.dtype = torch.float32
    #: one row per (token, destination rank) on the wire instead of one per token-slot
    #: (None: per token-slot; see :class:`UniqueRows`)
    unique: UniqueRows | None = None

    @property
    def num_send(self) -> int:
        """N: rows this rank sends."""
        return sum(self.send_splits)

    @property
    def num_recv(self) -> int:
        """R: rows this rank's experts receive."""
        return sum(self.recv_splits)


class MoEDispatcher(DispatchChecks):
    """Send token rows to the ranks holding their experts and combine the outputs back.

    ``num_experts`` experts are spread over the ``group`` (default: the world), ``L =
    num_experts / W`` per rank; expert ``e`` is local expert ``e % L`` of rank ``e // L``.
    ``capacity_factor=None`` is dropless; a float caps the rows each expert accepts from a
    rank at :func:`expert_capacity` and drops the rest in token order (their term is zero).
    ``backend`` picks the token kernels (``"auto"``: Triton on CUDA, PyTorch on CPU;
    ``"triton"``; ``"reference"``). With ``check_expert_output`` (default) each rank's
    blocks in ``combine``'s return all-to-all end with one flag row (``W`` rows of ``D`` more
    per rank, no collective of its own), so that a rank whose expert output has the wrong
    shape (or whose expert raised, in :class:`MoELayer`) still completes the exchange and
    makes every rank raise, instead of leaving the others blocked in it; set it False only
    when every expert is known to be shape-preserving, and on every rank alike. ``dedup``
    (every rank alike): ``True`` sends each token once per destination rank, ``"auto"`` in
    the steps where that at most halves the rows, ``False`` (default) one row per slot
    (:class:`UniqueRows`; same collectives).

    Example (your own router)::

        disp = MoEDispatcher(num_experts=8, capacity_factor=None)
        weights_TK, expert_ids_TK = torch.topk(router(x_TD).softmax(-1), k=2)
        expert_input, meta = disp.dispatch(x_TD, expert_ids_TK, weights_TK)
        chunks = expert_input.split(meta.tokens_per_expert)
        expert_output = torch.cat([expert(c) for expert, c in zip(my_local_experts, chunks)])
        y_TD = disp.combine(expert_output, meta)

    Bad input to ``dispatch`` on one rank (ids out of range, mismatched shapes) makes that
    rank raise ValueError/TypeError and the others RuntimeError naming it: the flag rides on
    the counts exchange, before any token moves.

    Collectives: ``dispatch`` issues two all-to-alls (counts, tokens), ``combine`` one
    (tokens back, with the check), backward two; every rank of the group must call them in
    the same order and agree on ``x.requires_grad``.
    """

    def __init__(self, num_experts: int, *, group: dist.ProcessGroup | None = None,
                 capacity_factor: float | None = None, backend: str = "auto",
                 check_expert_output: bool = True, dedup: bool | str = False):
        rank, world = group_rank_and_size(group)
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
        if num_experts % world:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by the expert-parallel world size "
                f"{world}: every rank must hold the same number of experts (use a multiple of {world})")
        if capacity_factor is not None and not (isinstance(capacity_factor, (int, float))
                                                and math.isfinite(capacity_factor)
                                                and capacity_factor > 0):
            raise ValueError(f"capacity_factor must be None (dropless) or a positive float, "
                             f"got {capacity_factor!r}")
        if backend not in ("auto", "triton", "reference"):
            raise ValueError(f"backend={backend!r} is not one of 'auto', 'triton', 'reference'")
        if dedup not in (True, False, "auto"):
            raise ValueError(f"dedup={dedup!r} is not one of True, False, 'auto'")
        self.num_experts = num_experts
        self.group = group
        self.rank = rank
        self.world_size = world
        self.num_local_experts = num_experts // world
        self.capacity_factor = capacity_factor
        self.backend = backend
        self.check_expert_output = check_expert_output
        self.dedup = dedup

    def _wants_dedup(self, dedup: bool | str | None) -> bool:
        """Whether the counts exchange carries the columns of a deduplicated dispatch (a
        setting every rank shares: the call's ``dedup``, else the dispatcher's)."""
        setting = self.dedup if dedup is None else dedup
        return setting is not False and self.world_size > 1

    def _dedup_pays(self, dedup: bool | str | None, top_k: int, figures) -> bool:
        """Whether this step deduplicates: ``figures`` holds every rank's ``(K, unique rows,
        per-slot rows)``, so every rank decides alike. Never when the ranks' K differ;
        always with ``dedup=True``; with ``"auto"``, when the unique rows are at most half the
        per-slot rows over the group (below that the extra gathers and sums cost more than
        the bytes saved: 7-10% more time at 0.75 of the rows on 2 gloo ranks)."""
        if any(k != top_k for k, _, _ in figures):
            return False
        setting = self.dedup if dedup is None else dedup
        if setting is True:
            return True
        return top_k > 1 and 2 * sum(u for _, u, _ in figures) <= sum(n for _, _, n in figures)

    # -- the two calls users make ------------------------------------------------------
    def dispatch(self, x_TD: torch.Tensor, expert_ids_TK: torch.Tensor,
                 weights_TK: torch.Tensor) -> tuple[torch.Tensor, DispatchMeta]:
        """Route ``x_TD``'s rows to their experts' ranks.

        Returns ``(expert_input_RD, meta)``: the rows this rank's local experts must process,
        grouped by local expert (``meta.tokens_per_expert`` rows each, source rank and token
        order inside a group).
        """
        meta = self.plan(x_TD, expert_ids_TK, weights_TK)
        return self.exchange(self.pack(x_TD, meta), meta), meta

    def combine(self, expert_output: torch.Tensor | Sequence[torch.Tensor],
                meta: DispatchMeta, *, by_source: bool = False) -> torch.Tensor:
        """Bring the expert outputs home: ``y_TD[t] = sum_k weights_TK[t, k] · out(t, k)``.

        ``expert_output`` is ``[R, D]`` in ``expert_input``'s row order, or a sequence of
        one ``[meta.tokens_per_expert[l], D]`` tensor per local expert (taken in the
        dispatched rows' dtype); with ``by_source``, one tensor per source rank in
        :meth:`exchange_by_source`'s blocks. A dropped slot adds nothing; a token with every
        slot dropped gets a zero row.
        """
        return self._combine(expert_output, meta, None, by_source)[0]

    def combine_beside(self, expert_output: torch.Tensor | Sequence[torch.Tensor],
                       meta: DispatchMeta, side: Callable[[torch.Tensor], torch.Tensor],
                       side_x: torch.Tensor, side_params: Sequence[torch.Tensor], *,
                       by_source: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`combine` with ``side(side_x)`` computed while the rows travel home:
        ``(y_TD, side output)``; in backward, the side's gradients are computed while the
        outputs' gradients travel back to the experts. As
        :meth:`exchange_to_experts_beside`'s side, it must not depend on the exchange."""
        return self._combine(expert_output, meta, (side, side_x, side_params), by_source)

    def _combine(self, expert_output, meta: DispatchMeta, beside,
                 by_source: bool = False) -> tuple[torch.Tensor, object]:
        if by_source:
            problem, rows = self._check_by_source(expert_output, meta)
        else:
            problem, rows = self._check_expert_output(expert_output, meta)
        if meta.unique is not None:
            return self._combine_unique(problem, rows, meta, beside)
        if not self.check_expert_output or self.world_size == 1:
            if problem is not None:
                raise ValueError(problem)
            back_ND, side_out = self._exchange_back(rows, meta, beside, by_source)
            return self.unpermute(back_ND, meta), side_out
        back_BD, side_out = self._exchange_back_flagged(
            None if problem is not None else rows, meta, beside, by_source)
        if problem is not None:
            raise ValueError(problem)
        return self._unpermute_flagged(back_BD, meta), side_out

    def _combine_unique(self, problem, rows, meta: DispatchMeta, beside):
        """:meth:`combine` of a deduplicated dispatch (:mod:`tribucket.moe.dedup`): each
        received row's weighted sum over its local experts goes back as one row; the sender
        adds a token's rows up."""
        u, flags = meta.unique, self.check_expert_output
        if problem is not None and not flags:
            raise ValueError(problem)
        part_BD = None
        if problem is None:
            out_RD = rows if isinstance(rows, torch.Tensor) else (
                rows[0] if len(rows) == 1 else torch.cat(rows))
            part_BD = _dedup.combine_rows(out_RD.to(meta.row_dtype), u, flags=flags,
                                          backend=self.backend)
        if flags:
            back, side_out = self._send_flagged(part_BD, u.recv_splits, u.send_splits, meta,
                                                beside)
            if problem is not None:
                raise ValueError(problem)
        else:
            back, side_out = self._all_to_all_beside(part_BD, u.recv_splits, u.send_splits,
                                                     beside)
        return _dedup.sum_returned(back, u, meta.num_tokens, flags=flags,
                                   backend=self.backend), side_out

    def fail_combine(self, error: BaseException, meta: DispatchMeta) -> NoReturn:
        """Re-raise ``error`` (raised while computing this rank's experts) on every rank.

        Call it instead of :meth:`combine` when the expert computation itself failed: this
        rank still joins the return all-to-all, with its flag set and no rows worth reading,
        and the peers raise a RuntimeError naming it.
        """
        if self.check_expert_output and self.world_size > 1:
            if meta.unique is not None:
                self._send_flagged(None, meta.unique.recv_splits, meta.unique.send_splits, meta)
            else:
                self._exchange_back_flagged(None, meta)
        raise error

    def fail_plan(self, error: BaseException, device: torch.device | str = "cpu", *,
                  gather_counts: bool = False, dedup: bool | str | None = None) -> NoReturn:
        """Re-raise ``error`` (this rank's input is bad) on every rank: join the counts
        exchange with the bad-input flag set, as :meth:`plan` does, then raise it here; the
        peers raise a RuntimeError naming this rank. ``gather_counts`` and ``dedup`` as the
        peers pass them."""
        W, L, E = self.world_size, self.num_local_experts, self.num_experts
        cols = L + 1 + (4 if self._wants_dedup(dedup) else 0) + (E if gather_counts else 0)
        flagged = torch.zeros(W, cols, dtype=torch.int64, device=device)
        flagged[:, L] = 1  # column L: the bad-input flag
        exchange_counts(flagged, self.group)
        raise error

    # -- the steps (a pipelined schedule reuses plan/permute/unpermute) -----------------
    def plan(self, x_TD: torch.Tensor, expert_ids_TK: torch.Tensor,
             weights_TK: torch.Tensor, *, gather_counts: bool = False,
             dedup: bool | str | None = None) -> DispatchMeta:
        """Validate, route locally and exchange the counts (the one host sync).

        A rank whose input is bad still joins the counts exchange, with a flag in an extra
        column, then raises its ValueError/TypeError; the others raise a RuntimeError naming
        it. No token moves, and no rank is left waiting.

        ``gather_counts=True`` (every rank alike) also gives every rank the whole routing,
        ``meta.global_counts_host`` (what a shadow policy decides from): each rank appends its
        ``E`` sent counts to every row of the counts all-to-all, so it costs no extra
        collective, just ``W·E`` more integers on the wire.

        ``dedup`` (every rank alike; None: the dispatcher's setting) plans one row per token
        and destination rank (``meta.unique``, :class:`UniqueRows`) where it pays; the
        per-slot fields are planned as well (a pipelined schedule uses them).
        """
        W, L, E = self.world_size, self.num_local_experts, self.num_experts
        wants_dedup = self._wants_dedup(dedup)
        extra = 4 if wants_dedup else 0
        # columns of the counts exchange: L counts, the bad-input flag, (dedup) the unique
        # rows sent to the rank, K, and the sender's unique and per-slot rows in all, then
        # (gather) E counts
        cols = L + 1 + extra + (E if gather_counts else 0)
        try:
            expert_ids_TK = self._check_inputs(x_TD, expert_ids_TK, weights_TK)
        except (ValueError, TypeError) as error:
            self.fail_plan(error, x_TD.device if isinstance(x_TD, torch.Tensor) else "cpu",
                           gather_counts=gather_counts, dedup=dedup)
        T, K = expert_ids_TK.shape
        # ids outside 0..E-1: flagged on the device and read with the counts (no host read of
        # its own); routed clamped meanwhile, and no token moves before the flag is read
        out_of_range = ((expert_ids_TK < 0) | (expert_ids_TK >= E)).any()
        ids_TK = expert_ids_TK.clamp(0, E - 1)
        capacity = expert_capacity(self.capacity_factor, T, K, self.num_experts)
        counts_E = moe_counts(ids_TK, self.num_experts, backend=self.backend)
        dest_TK, sent_E, order_S = _route(ids_TK, counts_E, capacity)
        send_counts_WL = sent_E.view(W, L)
        # column L carries each rank's bad-input flag
        parts = [send_counts_WL, out_of_range.to(sent_E.dtype).expand(W, 1)]
        if wants_dedup:  # which ranks each token reaches: the rows sent to each rank, and K
            rank_TK, hit_TW, unique_W = _dedup.count_unique(ids_TK, dest_TK, L, W)
            totals = torch.stack([unique_W.new_tensor(K), unique_W.sum(), sent_E.sum()])
            parts += [unique_W.view(W, 1), totals.view(1, 3).expand(W, 3)]
        if gather_counts:
            parts.append(sent_E.view(1, E).expand(W, E))
        recv_WC = exchange_counts(torch.cat(parts, 1), self.group)
        recv_counts_WL = recv_WC[:, :L].contiguous()
        host = torch.cat([send_counts_WL.reshape(-1), recv_WC.reshape(-1), counts_E]
                         + ([unique_W] if wants_dedup else [])).tolist()
        send_WL = [host[w * L:(w + 1) * L] for w in range(W)]
        recv_WC_host = [host[W * L + w * cols:W * L + (w + 1) * cols] for w in range(W)]
        recv_WL1_host = [row[:L + 1] for row in recv_WC_host]
        bad = [w for w in range(W) if recv_WL1_host[w][L]]
        if self.rank in bad:  # this rank's ids were out of range: its own error
            raise self._range_error(expert_ids_TK)
        if bad:
            raise RuntimeError(f"rank(s) {bad} of the expert-parallel group passed bad input to "
                               f"dispatch (see the error raised there); rank {self.rank} stops "
                               f"before any token moves")
        recv_WL = [row[:L] for row in recv_WL1_host]
        tokens_per_expert = tuple(sum(recv_WL[w][l] for w in range(W)) for l in range(L))
        num_send = sum(host[:W * L])
        counts_host = host[W * L + W * cols:W * L + W * cols + E]
        unique = None
        if wants_dedup and self._dedup_pays(  # every rank sees every rank's figures: all agree
                dedup, K, [row[L + 2:L + 5] for row in recv_WC_host]):
            unique = _dedup.plan_unique(ids_TK, dest_TK, sent_E, hit_TW, rank_TK, L,
                                  send_splits=tuple(host[W * L + W * cols + E:]),
                                  recv_splits=tuple(row[L + 1] for row in recv_WC_host),
                                  row_dtype=x_TD.dtype)
        return DispatchMeta(
            num_tokens=T, top_k=K, d_model=x_TD.shape[1], capacity=capacity,
            dest_TK=dest_TK, weights_TK=weights_TK, counts_E=counts_E,
            send_counts_WL=send_counts_WL, recv_counts_WL=recv_counts_WL,
            send_splits=tuple(sum(r) for r in send_WL), recv_splits=tuple(sum(r) for r in recv_WL),
            tokens_per_expert=tokens_per_expert,
            slot_N=order_S if capacity is None else _kept_slots(dest_TK, num_send),
            regroup=L > 1 and W > 1, num_dropped=sum(counts_host) - num_send,
            send_counts_host=tuple(map(tuple, send_WL)), recv_counts_host=tuple(map(tuple, recv_WL)),
            counts_host=tuple(counts_host),
            global_counts_host=(tuple(tuple(row[L + 1 + extra:]) for row in recv_WC_host)
                                if gather_counts else None),
            row_dtype=x_TD.dtype, unique=unique)

    def permute(self, x_TD: torch.Tensor, meta: DispatchMeta) -> torch.Tensor:
        """``send_ND``: each token's row once per kept choice, in global-expert order (what
        a pipelined schedule exchanges itself)."""
        return permute_tokens(x_TD, meta.dest_TK, meta.num_send, backend=self.backend,
                              slot_N=meta.slot_N)

    def pack(self, x_TD: torch.Tensor, meta: DispatchMeta) -> torch.Tensor:
        """The rows :meth:`exchange` sends: :meth:`permute`'s, or with ``meta.unique`` each
        token once per destination rank, with its weights and places (:class:`UniqueRows`)."""
        if meta.unique is not None:
            return _dedup.pack_rows(x_TD, meta.weights_TK, meta.unique, self.backend)
        return self.permute(x_TD, meta)

    def exchange(self, send_ND: torch.Tensor, meta: DispatchMeta) -> torch.Tensor:
        """All-to-all ``send_ND`` to the experts' ranks; regroup by local expert."""
        if meta.unique is not None:
            u = meta.unique
            return self._expand(all_to_all(send_ND, u.send_splits, u.recv_splits, self.group),
                                meta)
        recv_RD = all_to_all(send_ND, meta.send_splits, meta.recv_splits, self.group)
        return self._regroup(recv_RD, meta)

    def _expand(self, recv_VC: torch.Tensor, meta: DispatchMeta) -> torch.Tensor:
        """The received unique rows -> ``expert_input_RD`` (:func:`tribucket.moe.dedup.expand`)."""
        return _dedup.expand(recv_VC, meta.unique, d_model=meta.d_model, top_k=meta.top_k,
                             recv_counts_host=meta.recv_counts_host,
                             flags=self.check_expert_output, backend=self.backend)

    def exchange_by_source(self, send_ND: torch.Tensor, meta: DispatchMeta) -> list[torch.Tensor]:
        """:meth:`exchange` without the regroup: one block per source rank, as received
        (rank ``w``'s rows for local expert 0, 1, ...: ``meta.recv_counts_host[w]``). Run the
        experts on each block and hand the outputs back in the same blocks to
        ``combine(..., by_source=True)``: no regroup copy, nor its copy back in backward
        (:class:`MoELayer` does so with grouped GEMMs on the CPU). Not for ``meta.unique``."""
        if meta.unique is not None:
            raise ValueError("exchange_by_source does not apply to a deduplicated dispatch "
                             "(meta.unique): use exchange(), whose rows arrive by local expert")
        recv_RD = all_to_all(send_ND, meta.send_splits, meta.recv_splits, self.group)
        return list(recv_RD.split(list(meta.recv_splits)))

    def _regroup(self, recv_RD: torch.Tensor, meta: DispatchMeta) -> torch.Tensor:
        if not meta.regroup:
            return recv_RD
        W, L = self.world_size, self.num_local_experts
        pieces = recv_RD.split([c for row in meta.recv_counts_host for c in row])  # (w, l)
        return torch.cat([pieces[w * L + l] for l in range(L) for w in range(W)])

    def exchange_to_experts_beside(
            self, send_ND: torch.Tensor, meta: DispatchMeta,
            side: Callable[[torch.Tensor], torch.Tensor], side_x: torch.Tensor,
            side_params: Sequence[torch.Tensor], *, as_list: bool = True,
            by_source: bool = False,
    ) -> tuple[torch.Tensor | list[torch.Tensor], torch.Tensor]:
        """:meth:`exchange_to_experts` (``as_list``), :meth:`exchange` or, with
        ``by_source``, :meth:`exchange_by_source`, with ``side(side_x)`` computed while the
        rows travel: ``(expert inputs, side output)``.

        The side computation (the shared experts) must not depend on the exchange; in
        backward its gradients (to ``side_x`` and ``side_params``, handed to autograd as
        ordinary gradients) are computed while the reverse exchange carries the experts'
        input gradients home. Same collectives as :meth:`exchange`, in the same order.
        """
        if meta.unique is not None:
            if by_source:
                raise ValueError("by_source does not apply to a deduplicated dispatch")
            u = meta.unique
            recv_VC, side_out = self._all_to_all_beside(send_ND, u.send_splits, u.recv_splits,
                                                        (side, side_x, side_params))
            rows_RD = self._expand(recv_VC, meta)
            return (list(rows_RD.split(list(meta.tokens_per_expert))) if as_list else rows_RD,
                    side_out)
        recv_RD, side_out = self._all_to_all_beside(send_ND, meta.send_splits,
                                                    meta.recv_splits, (side, side_x, side_params))
        if by_source:
            return list(recv_RD.split(list(meta.recv_splits))), side_out
        if not as_list:
            return self._regroup(recv_RD, meta), side_out
        if not meta.regroup:
            return list(recv_RD.split(list(meta.tokens_per_expert))), side_out
        return list(_Regroup.apply(recv_RD, meta.recv_counts_host)), side_out

    def _all_to_all_beside(self, x: torch.Tensor, send_splits: Sequence[int],
                           recv_splits: Sequence[int], beside) -> tuple[torch.Tensor, object]:
        """:func:`tribucket.comm.all_to_all_beside` on this group."""
        return all_to_all_beside(x, send_splits, recv_splits, beside, self.group)

    def exchange_to_experts(self, send_ND: torch.Tensor, meta: DispatchMeta) -> list[torch.Tensor]:
        """:meth:`exchange`, handed out as one contiguous ``[tokens_per_expert[l], D]`` tensor
        per local expert. The same rows; in backward the experts' input gradients go
        straight back into the all-to-all's (source rank, local expert) order, one copy
        (splitting :meth:`exchange`'s result makes two: one concatenation per split)."""
        if meta.unique is not None:
            return list(self.exchange(send_ND, meta).split(list(meta.tokens_per_expert)))
        recv_RD = all_to_all(send_ND, meta.send_splits, meta.recv_splits, self.group)
        if not meta.regroup:
            return list(recv_RD.split(list(meta.tokens_per_expert)))
        return list(_Regroup.apply(recv_RD, meta.recv_counts_host))

    def exchange_back(self, expert_output: torch.Tensor | Sequence[torch.Tensor],
                      meta: DispatchMeta) -> torch.Tensor:
        """Undo :meth:`exchange`: ``back_ND`` in ``send_ND``'s row order.

        ``expert_output``: ``[R, D]`` in ``expert_input``'s order, or one tensor per local
        expert (then the regroup and the concatenation are one copy).
        """
        return self._exchange_back(expert_output, meta, None)[0]

    def _exchange_back(self, expert_output, meta: DispatchMeta, beside,
                       by_source: bool = False) -> tuple[torch.Tensor, object]:
        outs = [expert_output] if isinstance(expert_output, torch.Tensor) else list(expert_output)
        if by_source:  # already in the return exchange's (source rank, local expert) order
            rows_RD = outs[0] if len(outs) == 1 else torch.cat(outs)
        elif meta.regroup:
            by_rank = self._ungroup(outs, meta)
            rows_RD = torch.cat([p for row in by_rank for p in row])
        else:
            rows_RD = outs[0] if len(outs) == 1 else torch.cat(outs)
        return self._all_to_all_beside(rows_RD, meta.recv_splits, meta.send_splits, beside)

    def _ungroup(self, outs: list[torch.Tensor], meta: DispatchMeta) -> list[list[torch.Tensor]]:
        """The experts' output rows as ``[w][l]`` pieces (views, no copy): what local expert
        ``l`` computed for rank ``w``. ``outs``: one ``[R, D]`` tensor in (local expert,
        source rank) order, or one tensor per local expert (or any split of the ``R`` rows
        along expert boundaries, concatenated first)."""
        W, L = self.world_size, self.num_local_experts
        counts = meta.recv_counts_host
        if len(outs) == 1:  # split once by (l, w): the caller's one concatenation is the copy
            pieces = outs[0].split([counts[w][l] for l in range(L) for w in range(W)])
            return [[pieces[l * W + w] for l in range(L)] for w in range(W)]
        if len(outs) != L:
            outs = list(torch.cat(outs).split(list(meta.tokens_per_expert)))
        by_expert = [o.split([counts[w][l] for w in range(W)]) for l, o in enumerate(outs)]
        return [[by_expert[l][w] for l in range(L)] for w in range(W)]

    def _exchange_back_flagged(self, outs: list[torch.Tensor] | None, meta: DispatchMeta,
                               beside=None, by_source: bool = False) -> tuple[torch.Tensor, object]:
        """:meth:`exchange_back` with each rank's expert-output check riding along.

        Every block sent to a peer ends with one flag row (column 0: 1.0 when this rank could
        not produce its expert output, ``outs`` None; the rows are then zeros), so the block
        from rank ``w`` arrives as its ``send_splits[w]`` rows and a flag row: ``back_BD``
        has ``B = N + W`` rows. No collective of its own; the flag rows join the rows to send
        in the copy the regroup makes anyway (with one local expert, it is a copy more).
        Raises a RuntimeError naming the ranks whose flag is set (after the exchange: no rank
        is left waiting in it). ``beside``: as :meth:`_all_to_all_beside`'s; ``by_source``:
        ``outs`` holds one tensor per source rank (:meth:`exchange_by_source`); returns
        ``(back_BD, side output or None)``.
        """
        send_BD = None
        if outs is not None:
            W, dtype = self.world_size, meta.row_dtype
            flag_1D = torch.zeros(1, meta.d_model, dtype=dtype, device=meta.dest_TK.device)
            outs = [o.to(dtype) for o in (outs if isinstance(outs, list) else [outs])]
            by_rank = [[o] for o in outs] if by_source else self._ungroup(outs, meta)
            send_BD = torch.cat([piece for w in range(W) for piece in by_rank[w] + [flag_1D]])
        return self._send_flagged(send_BD, meta.recv_splits, meta.send_splits, meta, beside)

    def _send_flagged(self, send_BD: torch.Tensor | None, out_splits: Sequence[int],
                      in_splits: Sequence[int], meta: DispatchMeta,
                      beside=None) -> tuple[torch.Tensor, object]:
        """The return all-to-all of ``send_BD`` (``out_splits[w]`` rows for rank ``w``, each
        block followed by its flag row, zero) or, when this rank failed (None), of zeros of
        those sizes with every flag set; ``in_splits[w]`` rows (and a flag row) come back
        from rank ``w``. Raises naming the ranks whose flag is set."""
        W, D = self.world_size, meta.d_model
        device, dtype = meta.dest_TK.device, meta.row_dtype
        failed = send_BD is None
        if failed:  # this rank failed: zeros of the agreed sizes, every flag set
            send_BD = torch.zeros(sum(out_splits) + W, D, dtype=dtype, device=device)
            ends = torch.tensor(list(out_splits), device=device).cumsum(0)
            send_BD[ends + torch.arange(W, device=device), 0] = 1
        # a failed rank computes no side: it raises once the flags are exchanged
        back_BD, side_out = self._all_to_all_beside(
            send_BD, [n + 1 for n in out_splits], [n + 1 for n in in_splits],
            beside if not failed else None)
        flag_rows = list(itertools.accumulate(n + 1 for n in in_splits))
        flags = back_BD.detach()[[i - 1 for i in flag_rows], 0].tolist()  # one host read
        bad = [w for w, f in enumerate(flags) if f != 0]
        if bad and not failed:
            raise RuntimeError(
                f"rank(s) {bad} of the expert-parallel group could not produce their expert "
                f"output (a routed or a shared expert failed: see the error raised there); "
                f"rank {self.rank} drops the rows they returned")
        return back_BD, side_out

    def _unpermute_flagged(self, back_BD: torch.Tensor, meta: DispatchMeta) -> torch.Tensor:
        """:meth:`unpermute` of ``back_BD`` (:meth:`_exchange_back_flagged`): the flag rows
        are dead rows that no token-slot points at."""
        W, T, K = self.world_size, meta.num_tokens, meta.top_k
        if _use_triton(self.backend, back_BD):  # shift each row past the flag rows before it
            starts = torch.tensor(meta.send_splits, device=back_BD.device).cumsum(0)
            shift_TK = torch.bucketize(meta.dest_TK, starts, right=True)
            dest_TK = torch.where(meta.dest_TK >= 0, meta.dest_TK + shift_TK, meta.dest_TK)
            return unpermute_tokens(back_BD, dest_TK, meta.weights_TK, backend=self.backend,
                                    dead_rows=True)
        dead = meta.slot_N.new_full((1,), T * K)  # the slot of a flag row
        pieces = meta.slot_N.split(list(meta.send_splits))
        slot_B = torch.cat([p for w in range(W) for p in (pieces[w], dead)])
        return unpermute_tokens(back_BD, meta.dest_TK, meta.weights_TK, backend=self.backend,
                                slot_N=slot_B, dead_rows=True)

    def unpermute(self, back_ND: torch.Tensor, meta: DispatchMeta) -> torch.Tensor:
        """``y_TD``: the gate-weighted sum of each token's rows (fp32 accumulation)."""
        return unpermute_tokens(back_ND, meta.dest_TK, meta.weights_TK, backend=self.backend,
                                slot_N=meta.slot_N)


class _Regroup(torch.autograd.Function):
    """Rows by (source rank, local expert) -> one tensor per local expert, sources in order.

    Example: W = 2, L = 2, counts ``[[1, 2], [1, 0]]`` (rank 0 sent 1 row to expert 0 and 2
    to expert 1, rank 1 one row to expert 0): rows ``[a, b0, b1, c]`` -> ``[a, c]``,
    ``[b0, b1]``. Backward: the L gradients back into ``[a b0 b1 c]`` order, one cat.
    """

    @staticmethod
    def forward(ctx, recv_RD, counts_WL):
        W, L = len(counts_WL), len(counts_WL[0])
        ctx.counts_WL = counts_WL
        pieces = recv_RD.split([c for row in counts_WL for c in row])  # (w, l) order
        return tuple(torch.cat([pieces[w * L + l] for w in range(W)]) for l in range(L))

    @staticmethod
    def backward(ctx, *grads_L):
        first_order_only()
        counts_WL = ctx.counts_WL
        W, L = len(counts_WL), len(counts_WL[0])
        by_expert = [g.split([counts_WL[w][l] for w in range(W)]) for l, g in enumerate(grads_L)]
        return torch.cat([by_expert[l][w] for w in range(W) for l in range(L)]), None


