"""``bucket_cap_mb="auto"`` / ``first_bucket_cap_mb="auto"``: measure a few caps after the
rebuild and keep the fastest, the same on every rank.

The schedule. The candidates are bucket caps of 4, 25 and 100 MiB and half the model's
gradient bytes when that is at most 100 MiB (two buckets: between the default's few and one;
caps at or above the model's gradient bytes give one bucket: only the smallest of them is
kept) and, for the
first bucket, no separate first cap (the bucket cap) and 1 MiB / 256 KiB (with both options
"auto", the small first buckets are tried under the default 25 MiB cap only: at most 6
candidates); the default layout (the caps a run without "auto" would use) comes
first, and candidates that give the same layout in the rebuild's order are tried once. The first candidate is the layout of
the rebuild itself. The candidates are visited in order, then in reverse order (A B C C B A:
a load that drifts during the search weighs on each alike; measured one after the other, the
first candidate took the blame for a machine that was busier at the start); each visit runs
:data:`WARMUP_STEPS` step, not measured (new buffers, cold caches), then
:data:`MEASURED_STEPS` measured steps (the visit at the turn, C C, keeps the layout and
skips its warm-up step): at most 6 steps and 4 measurements per candidate, 5 candidates
tuned in 30 steps counting the rebuild's.

What is measured: per synchronised backward, from its start to every ``.grad`` averaged
(``reducer.stats.backward_compute_s + comm_exposed_s``): the part of the step the layout
changes. A rank reports each candidate's median (of 4). On a CUDA device the same span is
taken on the device: a CUDA event recorded on the current stream as the backward begins and
one when its gradients are in place (after the collectives' waits), read back a step later
once the device has passed it (no host stall of its own per step; one at the decision, for
the last steps). The host's span is the device's only while the host waits for the device
in each backward (it does while the end-of-backward status is read back to the host: on an
H100 both measured 22 ms for a backward holding a 20 ms device-side wait); a GPU that runs
behind the host would make it the host's launch time.

The decision: one all-reduce (MAX) of the per-candidate medians and two noise figures, so
each candidate is judged by its slowest rank and every rank holds the same figures; the
smallest wins, ties to the earlier candidate, and the default layout (the caps a plain run
would use) is kept unless a candidate beats it by more than the noise margin: the spread of
the measurements ((max - min) / median), the larger of the default's own and the mean over
the candidates, the worst rank, and at least :data:`KEEP_DEFAULT_WITHIN` (:func:`pick`).
Timing noise must not move a run off the default for nothing: on a shared 2-core machine
one step's time swings by 5-10%, and with a margin of half the default's spread noise alone
left the default in about a third of the searches. Same figures, same rule: the same choice
on every rank.

Where the layout changes: at the end of a backward pass, after every gradient is averaged and
in ``.grad`` — the point where the one rebuild already happens — never during one. The
gradients of every step are the average over ranks whatever the layout (a layout groups the
same sums differently, it does not change them).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from ..config import AUTO, MiB, ReducerConfig

__all__ = ["AutoTuner", "tuner_for", "local_figures", "pick", "WARMUP_STEPS", "MEASURED_STEPS",
           "VISITS", "BUCKET_CAPS_MB", "FIRST_CAPS_MB", "HALF"]

#: steps run with a new candidate before measuring it (fresh buffers, cold caches)
WARMUP_STEPS = 1
#: measured steps per visit of a candidate
MEASURED_STEPS = 2
#: visits per candidate: in order, then in reverse order (A B C C B A), so that a load that
#: drifts during the search weighs on every candidate alike
VISITS = 2
#: bucket caps tried by ``bucket_cap_mb="auto"``: MiB, or HALF (half the gradient bytes,
#: when that is at most the largest cap given in MiB)
HALF = "half"
BUCKET_CAPS_MB = (4, 25, 100, HALF)
#: first-bucket caps tried by ``first_bucket_cap_mb="auto"`` (``None``: the bucket cap)
FIRST_CAPS_MB = (None, 1, 0.25)
#: the default layout is kept unless another is faster by more than this fraction
KEEP_DEFAULT_WITHIN = 0.02


class AutoTuner:
    """The schedule, the measurements and the choice of one reducer's caps.

    States: waiting for the rebuild -> measuring candidate ``current`` -> done (``choice``).
    """

    def __init__(self, config: ReducerConfig, policy: Any, default_caps: tuple[int, int]):
        self.policy = policy
        self.default_caps = default_caps            # what a plain run would use (bytes)
        total = sum(p.numel() * p.element_size() for p in policy.params)
        caps = [config.bucket_cap_bytes] if config.bucket_cap_mb != AUTO else \
            _bounded(_caps_bytes(BUCKET_CAPS_MB, total), total)
        if config.first_bucket_cap_mb == AUTO:
            firsts = [None if mb is None else int(mb * MiB) for mb in FIRST_CAPS_MB]
        elif config.bucket_cap_mb == AUTO and config.first_bucket_cap_mb is not None:
            firsts = [int(config.first_bucket_cap_mb * MiB)]
        else:
            firsts = [None]
        #: (bucket cap, first-bucket cap) in bytes, in the order they are tried
        self.candidates: list[tuple[int, int]] = []
        both = config.bucket_cap_mb == AUTO and config.first_bucket_cap_mb == AUTO
        for cap in caps:
            # both "auto": the small first buckets are tried with the default cap only (a
            # shorter schedule)
            for first in firsts if not both or cap == default_caps[0] else firsts[:1]:
                pair = (cap, cap if first is None else min(first, cap))
                if pair not in self.candidates:
                    self.candidates.append(pair)
        if both:
            for first in firsts[1:]:
                pair = (default_caps[0], min(first, default_caps[0]))
                if pair not in self.candidates:
                    self.candidates.append(pair)
        # the default is measured first (the rebuild's own layout); candidates with its
        # layout are merged into it by _dedupe
        if default_caps in self.candidates:
            self.candidates.remove(default_caps)
        self.candidates.insert(0, default_caps)
        policy.caps = self.candidates[0]
        self.samples: list[list[float]] = [[] for _ in self.candidates]
        self.medians: list[float] | None = None     # max over ranks, after the decision
        self.default_spread: float | None = None     # the default's (max-min)/median, worst rank
        self.noise_margin: float | None = None       # what a candidate must beat it by
        self.choice: tuple[int, int] | None = None  # the caps kept (done)
        self.current = -1                           # candidate measured now (-1: waiting)
        self.visit = 0                              # index into the visit order
        self.steps = 0                              # steps run in the current visit
        self.relayouts = 0                          # layouts changed after the rebuild
        self.kept = False                           # a loaded layout, kept untuned
        #: tests: ``noise()`` seconds added to each measurement (per-rank jitter)
        self.noise = None
        #: CUDA parameters: the span is measured with events on the device (module docstring)
        self.on_device = bool(policy.params) and policy.params[0].is_cuda
        self._device = policy.params[0].device if self.on_device else None
        self._event_factory = None                   # CUDA events (tests inject a fake)
        self._start = None                           # the event at this backward's start
        self._pending: list[tuple[int, Any, Any]] = []  # (candidate, start, end), unread

    @property
    def done(self) -> bool:
        return self.choice is not None or self.kept

    # ------------------------------------------------------------------ per step
    def backward_begins(self) -> None:
        """A backward pass begins: on a CUDA device, while tuning, mark it on the stream."""
        if self.on_device and not self.done:
            self._start = self._event()
            self._start.record(torch.cuda.current_stream(self._device))

    def after_step(self, bw: Any, seconds: float | None) -> None:
        """The end of a synchronised backward (``seconds``: its host measure; ``None``: a
        Join shadow pass, not measured). Every rank calls it at the same passes."""
        start, self._start = self._start, None
        if self.done or not bw.rebuilt:
            return
        if self.current < 0:
            # the pass just finished ran on the initial layout and rebuilt it: start
            self._dedupe(bw.layout.align_bytes)
            self.current, self.visit, self.steps = 0, 0, 0
            if len(self.candidates) == 1:  # one layout whatever the cap: nothing to measure
                self.choice = self.policy.caps = self.candidates[0]
            else:
                self._mark(bw, "autotune.candidate")
            return
        if seconds is not None and self.steps >= WARMUP_STEPS:
            if start is None:
                self._add(self.current, seconds)
            else:  # the device's span, read when the device has run it
                end = self._event()
                end.record(torch.cuda.current_stream(self._device))
                self._pending.append((self.current, start, end))
        self._read_device(wait=False)
        self.steps += 1
        if self.steps < WARMUP_STEPS + MEASURED_STEPS:
            return
        n = len(self.candidates)
        order = list(range(n)) + list(range(n - 1, -1, -1)) * (VISITS - 1)
        if self.visit + 1 < len(order):
            self.visit, self.steps = self.visit + 1, 0
            if order[self.visit] != self.current:
                self.current = order[self.visit]
                self._relayout(bw, self.candidates[self.current])
            else:  # the same layout again (the turn of A B C C B A): already warm
                self.steps = WARMUP_STEPS
            self._mark(bw, "autotune.candidate")
            return
        self._read_device(wait=True)  # the last steps' spans (one host stall)
        self.choice = self._decide(bw)
        if self.choice != self.candidates[self.current]:
            self._relayout(bw, self.choice)
        self.policy.caps = self.choice
        tr = bw.comm.tracer
        if tr is not None:
            tr.instant("autotune.choice", args={
                "caps_bytes": list(self.choice), "median_step_s": self.medians,
                "default_spread": self.default_spread,
                "candidates_bytes": [list(c) for c in self.candidates]})

    def _add(self, candidate: int, seconds: float) -> None:
        if self.noise is not None:
            seconds += self.noise()
        self.samples[candidate].append(seconds)

    def _event(self):
        if self._event_factory is None:
            self._event_factory = lambda: torch.cuda.Event(enable_timing=True)
        return self._event_factory()

    def _read_device(self, wait: bool) -> None:
        """The device spans whose end the device has passed (``wait``: all of them), in the
        order they were recorded."""
        while self._pending:
            candidate, start, end = self._pending[0]
            if wait:
                end.synchronize()
            elif not end.query():
                return
            self._pending.pop(0)
            self._add(candidate, start.elapsed_time(end) / 1e3)

    def _mark(self, bw: Any, name: str) -> None:
        """A trace instant: the candidate measured from this step on."""
        tr = bw.comm.tracer
        if tr is not None:
            tr.instant(name, args={"candidate": self.current,
                                   "caps_bytes": list(self.candidates[self.current])})

    def _dedupe(self, align_bytes: int) -> None:
        """Keep one candidate per distinct layout (in the rebuild's order)."""
        seen, keep = set(), []
        for caps in self.candidates:
            key = tuple(map(tuple, self.policy.relayout(caps, align_bytes).bucket_indices()))
            if key not in seen:
                seen.add(key)
                keep.append(caps)
        self.candidates, self.samples = keep, [[] for _ in keep]

    def _relayout(self, bw: Any, caps: tuple[int, int]) -> None:
        """Lay the buckets out again under ``caps``, between two steps (as the rebuild)."""
        self.policy.caps = caps
        bw.layout = self.policy.relayout(caps, bw.layout.align_bytes)
        bw.allocate()
        for bucket in bw.buckets:  # the averaged gradients, re-bucketed
            bw.epilogue.finished(bucket.index)
        self.relayouts += 1

    def _decide(self, bw: Any) -> tuple[int, int]:
        """Every rank's figures (:func:`local_figures`), max over ranks (one all-reduce), then
        the same rule (:func:`pick`)."""
        t = torch.tensor(local_figures(self.samples), dtype=torch.float64,
                         device=bw.guard.device)
        if bw.world_size > 1:
            guard = bw.guard
            guard.fingerprint("autotune", bw.passes, 0, t.numel(), t.dtype)
            work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=guard.group_arg(),
                                   async_op=True)
            guard.wait(work, "the bucket_cap_mb='auto' decision (all-reduce)", bw.passes)
        figures = t.tolist()
        self.medians, (self.default_spread, self.noise_margin) = _medians(figures), figures[-2:]
        return self.candidates[pick(figures)]

    def adopt(self, saved: dict) -> None:
        """A resumed run: take the saved choice (no tuning) or the saved schedule."""
        self.policy.order = saved.get("order")
        if saved.get("choice") is not None:
            self.choice = tuple(saved["choice"])
            self.candidates = [tuple(c) for c in saved["candidates"]]
            self.medians = saved.get("medians")
            self.policy.caps = self.choice

    def adopt_layout(self) -> None:
        """A resumed run from a checkpoint with a rebuilt layout and no tuning record: that
        layout is kept, not tuned (its order is not saved)."""
        self.kept = True

    # ------------------------------------------------------------------ reporting
    def state(self) -> dict | None:
        """Plain values for ``state_dict()``."""
        if self.policy.order is None:
            return None
        return dict(order=list(self.policy.order),
                    candidates=[list(c) for c in self.candidates],
                    medians=self.medians, choice=None if self.choice is None
                    else list(self.choice))

    def logging_data(self) -> dict[str, Any]:
        """``logging_data()``'s fields: the candidates, their figures, the choice."""
        mb = lambda b: round(b / MiB, 4)  # noqa: E731
        return dict(
            autotune_candidates_mb=", ".join(f"{mb(c)}/{mb(f)}" for c, f in self.candidates),
            autotune_median_step_ns=None if self.medians is None else ", ".join(
                str(round(m * 1e9)) if m != float("inf") else "-" for m in self.medians),
            autotune_done=int(self.done),
            autotune_default_spread=None if self.default_spread is None
            else round(self.default_spread, 4),
            autotune_noise_margin=None if self.noise_margin is None
            else round(max(KEEP_DEFAULT_WITHIN, self.noise_margin), 4),
            autotune_bucket_cap_mb=None if self.choice is None else mb(self.choice[0]),
            autotune_first_bucket_cap_mb=None if self.choice is None else mb(self.choice[1]),
        )


def encode_state(record: dict | None) -> str:
    """The tuning record (:meth:`Tuner.state`) as ``state_dict()["autotune"]``: one JSON
    string, present from entering on (``"null"`` before the first rebuild), so that a
    ``torch.distributed.checkpoint`` load into a fresh reducer's ``state_dict()``, which
    fills only the keys the template has, brings it back whole."""
    return json.dumps(record)


def decode_state(saved: Any) -> dict | None:
    """The record of a reducer state's ``"autotune"`` entry (a dict: saved by an earlier
    release)."""
    return json.loads(saved) if isinstance(saved, str) else saved


def _spread(samples: list[float]) -> float:
    """(max - min) / median of one candidate's measurements (0 with fewer than two)."""
    return (max(samples) - min(samples)) / statistics.median(samples) if len(samples) > 1 else 0.0


def local_figures(samples: list[list[float]]) -> list[float]:
    """This rank's figures for the decision: each candidate's median step (0: none), then
    the default's spread (:func:`_spread`), then the noise margin: the larger of that and the
    mean spread over the candidates. Ranks combine them by MAX."""
    spreads = [_spread(s) for s in samples if s]  # (candidates never measured left out)
    default, mean = _spread(samples[0]), statistics.fmean(spreads) if spreads else 0.0
    return [statistics.median(s) if s else 0.0 for s in samples] + [default, max(default, mean)]


def _medians(figures: list[float]) -> list[float]:
    """The candidates' medians from :func:`local_figures`' figures (inf: never measured)."""
    return [v if v > 0 else float("inf") for v in figures[:-2]]


def pick(figures: list[float]) -> int:
    """The candidate kept, from the figures of :func:`local_figures` (max over ranks): the
    fastest median, unless the default (candidate 0) is within the noise margin of it (at
    least :data:`KEEP_DEFAULT_WITHIN`): then the default.

    The margin is the full spread of a candidate's measurements, not half of it: with
    :data:`MEASURED_STEPS` x :data:`VISITS` = 4 measurements, the range is about 2 standard
    deviations of one step and the difference of two medians of 4 about 0.8: a smaller
    margin lets noise alone move the run off the default in about a third of the searches
    over five equal candidates, this one in about 3% (``tests/test_autotune.py``)."""
    medians, margin = _medians(figures), figures[-1]
    best = min(range(len(medians)), key=lambda i: (medians[i], i))
    if medians[0] <= medians[best] * (1 + max(KEEP_DEFAULT_WITHIN, margin)):
        return 0  # the default
    return best


def tuner_for(config: ReducerConfig, policy: Any) -> AutoTuner | None:
    """The tuner of a reducer whose config asks for one, else ``None``."""
    if not config.autotune:
        return None
    plain = replace(config, bucket_cap_mb=None if config.bucket_cap_mb == AUTO
                    else config.bucket_cap_mb,
                    first_bucket_cap_mb=None if config.first_bucket_cap_mb == AUTO
                    else config.first_bucket_cap_mb)
    default = type(policy)(plain, policy.params, policy.expect_sparse)
    cap = plain.bucket_cap_bytes
    return AutoTuner(config, policy, (cap, min(default.first_cap_bytes(), cap)))


def _caps_bytes(caps_mb, total: int) -> list[int]:
    """``BUCKET_CAPS_MB`` in bytes, ascending; HALF is ``ceil(total / 2)`` when that is at
    most the largest cap in MiB (else left out: two buckets of a large model overlap little)."""
    fixed = [int(mb * MiB) for mb in caps_mb if mb != HALF]
    half = -(-total // 2)
    extra = [half] if HALF in caps_mb and fixed and half <= max(fixed) else []
    return sorted(set(fixed + extra))


def _bounded(caps: list[int], total: int) -> list[int]:
    """``caps`` below ``total`` bytes, and the smallest at or above it (one bucket)."""
    below = [c for c in caps if c < total]
    above = [c for c in caps if c >= total]
    return below + above[:1]
