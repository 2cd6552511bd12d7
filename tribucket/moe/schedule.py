"""FasterMoE's smart schedule: a pipelined pairwise exchange around the local experts.

Shape legend (suffixes on tensor names):
    W  ranks in the expert-parallel group   L  experts per rank (local experts)
    D  model dimension                      E  experts (global), E = W * L
    N  rows this rank sends (``send_ND``, rank-major, then local expert, then token)
    B  rows this rank's experts receive in the pipeline (step-major buffer)

It replaces the middle of an MoE layer — token all-to-all, expert compute, output
all-to-all — by a pipeline of fine-grained steps (FasterMoE, PPoPP 2022). The ranks are cut
into groups of ``group_size`` consecutive ranks (the last group takes the remainder when
``group_size`` does not divide ``W``); with ``n`` groups and this rank in group ``g``, step
``s = 0 .. n-1`` is

    S_s  send my rows for the experts of group ``(g + s) % n``, receive the rows group
         ``(g - s) % n`` has for my experts (``dist.batch_isend_irecv``);
    C_s  my local experts compute on what arrived in ``S_s`` (one call per local expert);
    R_s  send those outputs back to group ``(g - s) % n``, receive mine from ``(g + s) % n``.

Each step is a permutation of the groups, so every send meets its receive, whatever the
group sizes. Issue order on every rank::

    S_0, S_1 | shadows | C_0, R_0 (async), S_2 | C_1, R_1, S_3 | ... | C_{n-1}, R_{n-1} | wait all

so ``S_{s+1}`` is in flight while ``C_s`` computes and ``R_s`` while ``C_{s+1}`` does. On
CPU gloo's asynchronous works give the overlap (its transport threads move the bytes while
this thread multiplies); on CUDA the sends and receives are issued on a side stream that
waits on an event recorded after the rows were produced, and the compute stream waits on the
works before using what arrived (that path is written but untested: this project's CI has no
GPU). Backward runs the same schedule on the gradients: ``S'`` sends the output gradients
to the experts, ``C'`` is the experts' backward (input and parameter gradients), ``R'``
brings the input gradients home.

Shadowed experts (see :mod:`tribucket.moe.shadow`) take no part in the exchange: their
owner broadcasts its parameters (async, before the pipeline), every rank computes its own
rows for them while ``S_0`` is in flight, and in backward the copies' parameter gradients
are reduced to the owner (async, overlapping the pipeline) and added to its gradients.

Errors never strand a peer: an expert that raises, or returns the wrong shape, has its rows
replaced by zeros so the message pattern completes, and one all-reduce after the last
receive makes every rank raise (the failing rank its own error, the others a RuntimeError
naming it). Steps with no rows to move or compute post nothing (both sides know the counts).

Experts must be row-wise (a token's output depends only on that token's row), since the
pipeline calls them on smaller batches than the all-to-all schedule; shadowing also needs
every expert to have the same parameter names, shapes and one dtype.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from ..comm import ranks_reporting
from ..comm.alltoall import own_graph
from ..kernels.moe import first_order_only, freed_graph_error
from .dispatcher import DispatchMeta

__all__ = ["exchange_groups", "pairwise_steps", "pipelined_experts"]


def exchange_groups(world_size: int, group_size: int) -> list[tuple[int, ...]]:
    """Consecutive groups of ``min(group_size, world_size)`` ranks; the last one may be shorter.

    Example: ``exchange_groups(6, 4) -> [(0, 1, 2, 3), (4, 5)]``.
    """
    gs = min(group_size, world_size)
    return [tuple(range(start, min(start + gs, world_size))) for start in range(0, world_size, gs)]


def pairwise_steps(rank: int, world_size: int, group_size: int
                   ) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``[(send_to, receive_from)]`` per step for ``rank``: groups ``(g + s) % n`` and ``(g - s) % n``.

    Example: 4 ranks, ``group_size=2``: rank 1 (group 0) -> ``[((0, 1), (0, 1)), ((2, 3), (2, 3))]``.
    """
    groups = exchange_groups(world_size, group_size)
    n, g = len(groups), rank // min(group_size, world_size)
    return [(groups[(g + s) % n], groups[(g - s) % n]) for s in range(n)]


# ---------------------------------------------------------------------------------------
# the plan of one forward: where every row goes (host integers only)
# ---------------------------------------------------------------------------------------
class _Plan:
    """Row ranges of one forward's pipeline, from the dispatch metadata and the shadow set.

    ``send_ND`` (and ``back_ND``, and their gradients) hold rank ``w``'s rows for its local
    expert ``l`` at ``send_start[w][l]``, ``send_counts[w][l]`` rows. The receive buffer
    (``B`` rows) is step-major, then local expert, then source rank, so each ``C_s`` call of
    an expert reads one contiguous chunk ``(l, start, rows)``.
    """

    def __init__(self, meta: DispatchMeta, rank: int, num_local: int,
                 steps: Sequence[tuple[tuple[int, ...], tuple[int, ...]]], shadowed: frozenset[int]):
        L = num_local
        self.rank, self.L, self.steps = rank, L, list(steps)
        self.send_counts = [list(r) for r in meta.send_counts_host]
        # rows of a shadowed expert are computed where they are: nobody sends or receives them
        self.recv_counts = [[0 if rank * L + l in shadowed else c for l, c in enumerate(row)]
                            for row in meta.recv_counts_host]
        self.sent = [[0 if w * L + l in shadowed else c for l, c in enumerate(row)]
                     for w, row in enumerate(self.send_counts)]
        self.send_start, pos = [], 0
        for row in self.send_counts:
            self.send_start.append([])
            for c in row:
                self.send_start[-1].append(pos)
                pos += c
        self.recv_start: dict[tuple[int, int], int] = {}
        self.chunks: list[list[tuple[int, int, int]]] = []
        pos = 0
        for _, src in self.steps:
            step_chunks = []
            for l in range(L):
                start = pos
                for q in src:
                    self.recv_start[q, l] = pos
                    pos += self.recv_counts[q][l]
                step_chunks.append((l, start, pos - start))
            self.chunks.append(step_chunks)
        self.recv_rows = pos
        #: (global expert, owner, local index there) of every shadowed expert, in id order
        self.shadows = [(e, e // L, e % L) for e in sorted(shadowed)]

    def segment(self, t_ND: torch.Tensor, w: int, l: int) -> torch.Tensor:
        return t_ND.narrow(0, self.send_start[w][l], self.send_counts[w][l])


class _Overlap:
    """Where S/R run: gloo's async works on CPU; a side stream with events on CUDA."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:  # pragma: no cover - no GPU in this project's CI
            self.main = torch.cuda.current_stream(device)
            self.side = torch.cuda.Stream(device)

    def start(self, ops: list) -> list:
        if not ops:
            return []
        if not self.cuda:
            return dist.batch_isend_irecv(ops)
        # CUDA: the side stream starts once the compute stream has produced the rows to send
        ready = torch.cuda.Event()
        ready.record(self.main)
        self.side.wait_event(ready)
        with torch.cuda.stream(self.side):
            works = dist.batch_isend_irecv(ops)
        for op in ops:  # the buffers are used on the side stream too
            op.tensor.record_stream(self.side)
        return works

    def finish(self, works: list) -> None:
        for work in works:  # CPU: blocks until done; CUDA: the current stream waits on it
            work.wait()
        if self.cuda and works:  # pragma: no cover
            self.main.wait_stream(self.side)


# ---------------------------------------------------------------------------------------
# the engine: one forward and its backward
# ---------------------------------------------------------------------------------------
class _Pipeline:
    """Runs the S/C/R pipeline of one forward, keeps what its backward needs, runs that.

    Message tags: ``l`` for S (rows for local expert ``l``), ``L + l`` for R, so messages
    between two ranks that are in flight together never match the wrong receive (gloo
    matches by source and tag). Both sides post in the same order, which NCCL (no tags)
    needs: a pair exchanges its S messages in step ``s`` and its R messages in step ``t``
    with ``s + t = 0 (mod n)``, and each side posts them at the same points of its loop.
    """

    def __init__(self, experts: Sequence[nn.Module], plan: _Plan, group, world: int,
                 check_output: bool, expert_numel: int, failure: BaseException | None = None):
        self.experts = list(experts)
        #: an error met before the pipeline (pipelined_experts' ``failure``)
        self.prior = None if failure is None else (str(failure), failure)
        self.plan, self.group, self.world = plan, group, world
        self.check_output = check_output
        self.expert_numel = expert_numel
        self._global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self.params = [list(e.parameters()) for e in self.experts]
        self.names = [[n for n, _ in e.named_parameters()] for e in self.experts]

    # -- point-to-point ops of one step ---------------------------------------------------
    def _s_ops(self, s: int, rows_ND: torch.Tensor, buf_BD: torch.Tensor) -> list:
        """Send my rows for group (g+s)'s experts; receive group (g-s)'s rows for mine."""
        p, me, L = self.plan, self.plan.rank, self.plan.L
        dst, src = p.steps[s]
        ops = []
        for w in dst:
            for l in range(L):
                if w != me and p.sent[w][l]:
                    ops.append(dist.P2POp(dist.isend, p.segment(rows_ND, w, l),
                                          self._global(w), self.group, tag=l))
        for q in src:
            for l in range(L):
                n = p.recv_counts[q][l]
                if not n:
                    continue
                dest = buf_BD.narrow(0, p.recv_start[q, l], n)
                if q == me:  # my own rows for my own experts: a local copy
                    dest.copy_(p.segment(rows_ND, me, l))
                else:
                    ops.append(dist.P2POp(dist.irecv, dest, self._global(q), self.group, tag=l))
        return ops

    def _r_ops(self, s: int, out_by_l: dict[int, torch.Tensor], back_ND: torch.Tensor) -> list:
        """Send the outputs of step s to their sources; receive mine from group (g+s)."""
        p, me, L = self.plan, self.plan.rank, self.plan.L
        dst, src = p.steps[s]
        ops = []
        for l, start, _ in p.chunks[s]:
            for q in src:
                n = p.recv_counts[q][l]
                if not n:
                    continue
                rows = out_by_l[l].narrow(0, p.recv_start[q, l] - start, n)
                if q == me:
                    p.segment(back_ND, me, l).copy_(rows)
                else:
                    ops.append(dist.P2POp(dist.isend, rows, self._global(q), self.group, tag=L + l))
        for w in dst:
            for l in range(L):
                if w != me and p.sent[w][l]:
                    ops.append(dist.P2POp(dist.irecv, p.segment(back_ND, w, l),
                                          self._global(w), self.group, tag=L + l))
        return ops

    # -- the pipeline driver, shared by forward and backward --------------------------------
    def _drive(self, ov: _Overlap, rows_ND: torch.Tensor, buf_BD: torch.Tensor,
               dest_ND: torch.Tensor | None, before, compute) -> None:
        """``S_0, S_1 | before() | per step s: S_{s+1}, wait S_s, compute(s), R_s | wait R``.

        ``compute(s)`` returns the rows to send back per local expert (``{l: [rows, D]}``);
        with ``dest_ND`` None nothing is sent back (backward when ``x`` needs no gradient).
        Every work is waited on exactly once (gloo's point-to-point works hang on a second wait).
        """
        n_steps = len(self.plan.steps)
        s_works = [ov.start(self._s_ops(s, rows_ND, buf_BD)) for s in range(min(2, n_steps))]
        before()
        r_works = []
        for s in range(n_steps):
            if s + 1 < n_steps and len(s_works) == s + 1:
                s_works.append(ov.start(self._s_ops(s + 1, rows_ND, buf_BD)))
            ov.finish(s_works[s])
            back_by_l = compute(s)
            if dest_ND is not None:
                r_works.append(ov.start(self._r_ops(s, back_by_l, dest_ND)))
        for works in r_works:
            ov.finish(works)

    # -- forward ---------------------------------------------------------------------------
    def forward(self, send_ND: torch.Tensor, build_graph: bool, need_x: bool) -> torch.Tensor:
        p, me = self.plan, self.plan.rank
        D = send_ND.shape[1]
        self.need_x = need_x
        ov = _Overlap(send_ND.device)
        buf_BD = send_ND.new_empty(p.recv_rows, D)
        back_ND = send_ND.new_empty(send_ND.shape)
        self.failure: tuple[str, BaseException | None] | None = self.prior
        # parameter aliases: the inner graphs' leaves (gradients are returned, not accumulated,
        # so hooks on the real parameters fire once, in the outer backward)
        self.aliases = [{n: q.detach().requires_grad_(q.requires_grad) if build_graph else q
                         for n, q in zip(names, params)}
                        for names, params in zip(self.names, self.params)]
        #: (step, local expert) -> (input leaf, output) of the inner graph, for backward
        self.saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor] | None] = {}
        #: shadowed expert -> (input leaf, flat parameter leaf, output)
        self.shadow_saved: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

        flats, bcast = self._broadcast_shadows(send_ND)

        def shadows():  # this rank's own rows for the shadowed experts, while S_0, S_1 fly
            for work in bcast:
                work.wait()
            self._shadow_forward(send_ND, back_ND, flats, build_graph)

        def compute(s: int) -> dict[int, torch.Tensor]:
            outs = {}
            for l, start, rows in p.chunks[s]:
                if rows:  # zero-row chunks are skipped (both sides know the counts)
                    outs[l], self.saved[s, l] = self._compute(
                        self.experts[l], self.aliases[l], buf_BD.narrow(0, start, rows),
                        build_graph, f"expert {me * p.L + l} (local expert {l} on rank {me})")
            return outs

        self._drive(ov, send_ND, buf_BD, back_ND, shadows, compute)
        self._agree(send_ND.device)
        return back_ND

    def _compute(self, module: nn.Module, params: dict, rows_RD: torch.Tensor, build_graph: bool,
                 who: str) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """One expert call: ``(output rows, (input leaf, output) for backward or None)``.

        On failure (the expert raised or returned the wrong shape) the output is zeros of
        the right shape, so the message pattern completes; the error is raised after it.
        """
        n, D = rows_RD.shape
        if self.failure is not None:
            return rows_RD.new_zeros(n, D), None
        try:
            if build_graph:
                leaf = rows_RD.detach().requires_grad_(self.need_x)
                with torch.enable_grad():
                    out = functional_call(module, params, (leaf,))
            else:
                leaf, out = rows_RD, functional_call(module, params, (rows_RD,))
        except Exception as error:  # noqa: BLE001 - re-raised after the exchange completes
            self.failure = (str(error), error)
            return rows_RD.new_zeros(n, D), None
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (n, D):
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            self.failure = (f"{who} returned {got} for an input of shape [{n}, {D}]; experts "
                            f"must map [n, D] -> [n, D]", None)
            return rows_RD.new_zeros(n, D), None
        saved = (leaf, out) if build_graph and out.requires_grad else None
        return out.detach().to(rows_RD.dtype).contiguous(), saved

    def _agree(self, device) -> None:
        problem = self.failure
        if self.check_output:
            bad = ranks_reporting(problem is not None, self.group, device)
        else:
            bad = [self.plan.rank] if problem is not None else []
        if problem is not None:
            message, error = problem
            if error is not None:
                raise error
            raise ValueError(message)
        if bad:
            raise RuntimeError(
                f"rank(s) {bad} of the expert-parallel group could not produce their expert "
                f"output (a routed or a shared expert failed: see the error raised there); "
                f"rank {self.plan.rank} stops too, after completing the pairwise exchange so "
                f"that no rank is left waiting")

    # -- shadowed experts ----------------------------------------------------------------
    def _broadcast_shadows(self, send_ND: torch.Tensor):
        """Start the owners' broadcasts of the shadowed experts' flat parameters."""
        flats, works = {}, []
        for e, owner, l in self.plan.shadows:
            if owner == self.plan.rank:
                flat = torch.cat([q.detach().reshape(-1) for q in self.params[l]])
            else:
                ref = self.params[0][0]
                flat = torch.empty(self.expert_numel, dtype=ref.dtype, device=ref.device)
            flats[e] = flat
            if self.world > 1:
                works.append(dist.broadcast(flat, self._global(owner), group=self.group, async_op=True))
        return flats, works

    def _shadow_views(self, owner: int, l: int, flat: torch.Tensor):
        # the owner runs its own module; the others take their first expert as the template
        # (same parameter names and shapes: checked when the layer was built)
        mine = owner == self.plan.rank
        template = self.experts[l if mine else 0]
        params = self.params[l if mine else 0]
        names = self.names[l if mine else 0]
        views, off = {}, 0
        for n, q in zip(names, params):
            views[n] = flat.narrow(0, off, q.numel()).view(q.shape)
            off += q.numel()
        return template, views

    def _shadow_forward(self, send_ND, back_ND, flats, build_graph: bool) -> None:
        p = self.plan
        for e, owner, l in p.shadows:
            rows = p.segment(send_ND, owner, l)
            if not rows.shape[0]:
                continue
            flat = flats[e].requires_grad_(True) if build_graph else flats[e]
            with torch.set_grad_enabled(build_graph):  # the views must carry grads to flat
                template, views = self._shadow_views(owner, l, flat)
            out, saved = self._compute(template, views, rows, build_graph,
                                       f"expert {e} (shadowed on rank {p.rank})")
            p.segment(back_ND, owner, l).copy_(out)
            if saved is not None:
                self.shadow_saved[e] = (saved[0], flat, saved[1])

    # -- backward --------------------------------------------------------------------------
    def backward(self, grad_back_ND: torch.Tensor, need_params: Sequence[bool]):
        """``(grad_send_ND or None, [grad per parameter, local expert order])``."""
        p, me = self.plan, self.plan.rank
        D = grad_back_ND.shape[1]
        need_x = self.need_x
        grad_back_ND = grad_back_ND.contiguous()
        ov = _Overlap(grad_back_ND.device)
        gbuf_BD = grad_back_ND.new_empty(p.recv_rows, D)
        grad_send_ND = grad_back_ND.new_empty(grad_back_ND.shape) if need_x else None
        self.grads: list[list[torch.Tensor | None]] = [[None] * len(ps) for ps in self.params]
        self.error: BaseException | None = None  # raised once every message has been sent
        reduces = []

        def shadows():  # their gradients travel to the owners while the pipeline runs
            for e, owner, l in p.shadows:
                gflat = self._shadow_backward(e, owner, l, grad_back_ND, grad_send_ND)
                work = (dist.reduce(gflat, self._global(owner), group=self.group, async_op=True)
                        if self.world > 1 else None)
                reduces.append((owner, l, gflat, work))

        def compute(s: int) -> dict[int, torch.Tensor]:
            g_in = {}
            for l, start, rows in p.chunks[s]:
                if rows:
                    g_in[l] = self._grad_chunk(s, l, gbuf_BD.narrow(0, start, rows))
            return g_in

        self._drive(ov, grad_back_ND, gbuf_BD, grad_send_ND, shadows, compute)
        for owner, l, gflat, work in reduces:
            if work is not None:
                work.wait()
            if owner == me:  # every rank's gradient for my shadowed expert, summed
                off = 0
                for j, q in enumerate(self.params[l]):
                    self._add_grad(l, j, gflat.narrow(0, off, q.numel()).view(q.shape))
                    off += q.numel()
        if self.error is not None:
            raise self.error
        out = [torch.zeros_like(q) if g is None else g.to(q.dtype)  # no rows: a zero gradient
               for ps, gs in zip(self.params, self.grads) for q, g in zip(ps, gs)]
        return grad_send_ND, [g if need else None for g, need in zip(out, need_params)]

    def _add_grad(self, l: int, j: int, g: torch.Tensor | None) -> None:
        if g is not None:
            self.grads[l][j] = g if self.grads[l][j] is None else self.grads[l][j] + g

    def _grad_chunk(self, s: int, l: int, g_out_RD: torch.Tensor) -> torch.Tensor | None:
        """C' of one chunk: parameter gradients accumulated, input-row gradients returned."""
        need_x = self.need_x
        rows, D = g_out_RD.shape
        saved = self.saved.get((s, l))
        wanted = [(j, a) for j, a in enumerate(self.aliases[l].values()) if a.requires_grad]
        got = None
        if saved is not None and self.error is None:
            leaf, out = saved
            try:
                got = torch.autograd.grad(out, ([leaf] if need_x else []) + [a for _, a in wanted],
                                          g_out_RD.to(out.dtype), allow_unused=True)
            except Exception as err:  # noqa: BLE001 - finish the exchange, then raise
                self.error = err
        if got is None:  # nothing requires grad here (or an error): zeros keep the pattern
            got = ([g_out_RD.new_zeros(rows, D)] if need_x else []) + [None] * len(wanted)
        for (j, _), g in zip(wanted, got[1 if need_x else 0:]):
            self._add_grad(l, j, g)
        return got[0].to(g_out_RD.dtype).contiguous() if need_x else None

    def _shadow_backward(self, e: int, owner: int, l: int, grad_back_ND: torch.Tensor,
                         grad_send_ND: torch.Tensor | None) -> torch.Tensor:
        """This rank's rows of a shadowed expert: input-row gradients written, flat param grad returned."""
        p = self.plan
        saved = self.shadow_saved.get(e)
        if saved is not None and self.error is None:
            leaf, flat, out = saved
            g_rows = p.segment(grad_back_ND, owner, l).to(out.dtype)
            try:
                got = torch.autograd.grad(out, ([leaf] if grad_send_ND is not None else []) + [flat],
                                          g_rows, allow_unused=True)
            except Exception as err:  # noqa: BLE001 - finish the exchange, then raise
                self.error = err
            else:
                if grad_send_ND is not None:
                    p.segment(grad_send_ND, owner, l).copy_(got[0])
                return got[-1] if got[-1] is not None else self._zeros_flat()
        if grad_send_ND is not None:  # no rows here (or an error): zeros keep the pattern
            p.segment(grad_send_ND, owner, l).zero_()
        return self._zeros_flat()

    def _zeros_flat(self) -> torch.Tensor:
        ref = self.params[0][0]
        return torch.zeros(self.expert_numel, dtype=ref.dtype, device=ref.device)


class _PipelinedExperts(torch.autograd.Function):
    """``send_ND -> back_ND`` through the pipeline; backward is the pipeline on gradients."""

    @staticmethod
    def forward(ctx, engine: _Pipeline, send_ND, *params):
        ctx.engine = engine
        with own_graph():  # (differentiated in backward by autograd.grad, chunk by chunk)
            return engine.forward(send_ND, build_graph=True, need_x=ctx.needs_input_grad[1])

    @staticmethod
    def backward(ctx, grad_back_ND):
        first_order_only()
        engine = ctx.engine
        if engine is None:
            raise freed_graph_error()
        ctx.engine = None  # the saved graphs go with it
        grad_send, grads = engine.backward(grad_back_ND, ctx.needs_input_grad[2:])
        return (None, grad_send, *grads)


def pipelined_experts(send_ND: torch.Tensor, meta: DispatchMeta, experts: Sequence[nn.Module], *,
                      rank: int, world_size: int, group=None, group_size: int,
                      shadowed: frozenset[int] = frozenset(), check_output: bool = True,
                      expert_numel: int = 0,
                      failure: BaseException | None = None) -> torch.Tensor:
    """``back_ND``: every row of ``send_ND`` through its expert, in ``send_ND``'s row order.

    The pairwise S/C/R pipeline of this module (``group_size`` ranks per exchange group) with
    the experts in ``shadowed`` computed locally from their owners' broadcast parameters.
    Differentiable (input rows and the experts' parameters); a collective on ``group``.
    ``failure``: an error this rank already met in the layer (its shared experts): the
    pipeline runs with zero rows from this rank's experts and raises it, as an expert's own.
    """
    steps = pairwise_steps(rank, world_size, group_size)
    plan = _Plan(meta, rank, len(experts), steps, shadowed)
    engine = _Pipeline(experts, plan, group, world_size, check_output, expert_numel, failure)
    params = [q for ps in engine.params for q in ps]
    if torch.is_grad_enabled() and (send_ND.requires_grad or any(q.requires_grad for q in params)):
        return _PipelinedExperts.apply(engine, send_ND, *params)
    return engine.forward(send_ND, build_graph=False, need_x=False)
