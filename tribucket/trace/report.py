"""Reading a trace: the per-bucket table and the PNG timeline.

Per rank, step and bucket (names of the contract in :mod:`tribucket.trace`):

* **launch** = start of the bucket's first ``bucket{i}.allreduce`` span, **done** = end of
  its last one (chunks), **ready** = its ``bucket{i}.last_ready`` instant;
* **ready->launch** = launch - ready (the pack, and waiting for earlier buckets);
* **in flight** = done - launch;
* **exposed** = what the step waited for this bucket after backward ended and after every
  earlier bucket was done: ``max(0, done - max(backward end, done of buckets before))``;
  the buckets' exposed times add up to the step's exposed communication;
* **share** = exposed / step time, the step being the time from this step's first event to
  the next step's first event on that rank (the last step: to its last event).

Each figure is the median over steps (those with the run's final layout: the steps before a
rebuild have other buckets), then the max over ranks (or per rank).
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from dataclasses import dataclass, field

__all__ = ["BucketRow", "Summary", "format_table", "plot_timeline", "summarize"]

_BUCKET = re.compile(r"^bucket(\d+)\.(\w+)$")


@dataclass
class _StepBuckets:
    start: float = float("inf")       # first event of the step
    end: float = float("-inf")        # last event end
    backward_end: float | None = None
    backward: float = 0.0             # backward span's duration
    ready: dict = field(default_factory=dict)     # bucket -> last_ready ts
    launch: dict = field(default_factory=dict)    # bucket -> first allreduce start
    done: dict = field(default_factory=dict)      # bucket -> last allreduce end
    nbytes: dict = field(default_factory=lambda: defaultdict(int))  # bucket -> bytes


@dataclass
class BucketRow:
    """One bucket's figures (microseconds; ``rank`` None: max over ranks)."""

    bucket: int
    nbytes: int
    ready_to_launch: float | None
    in_flight: float
    exposed: float
    share: float
    rank: int | None = None


@dataclass
class Summary:
    ranks: list[int]
    steps: int              # steps in the trace
    used_steps: list[int]   # steps the medians are over (the final layout's)
    rows: list[BucketRow]
    step_time: float        # median step time (us), max over ranks
    backward: float         # median backward (us), max over ranks
    exposed: float          # median exposed communication (us), max over ranks


def _collect(trace: dict) -> dict[int, dict[int, _StepBuckets]]:
    """rank -> step -> what its events say."""
    per: dict[int, dict[int, _StepBuckets]] = defaultdict(lambda: defaultdict(_StepBuckets))
    for ev in trace["traceEvents"]:
        ph = ev.get("ph")
        if ph not in ("X", "i"):
            continue
        args = ev.get("args") or {}
        s = per[ev["pid"]][args.get("step", 0)]
        t0 = ev["ts"]
        t1 = t0 + ev.get("dur", 0.0)
        s.start, s.end = min(s.start, t0), max(s.end, t1)
        name = ev["name"]
        if name == "backward" and ph == "X":
            s.backward_end, s.backward = t1, t1 - t0
            continue
        m = _BUCKET.match(name)
        if not m:
            continue
        b, what = int(m.group(1)), m.group(2)
        if what == "last_ready":
            s.ready[b] = t0
        elif what == "allreduce" and ph == "X":
            s.launch[b] = min(s.launch.get(b, t0), t0)
            s.done[b] = max(s.done.get(b, t1), t1)
            s.nbytes[b] += int(args.get("bytes", 0))
    return per


def _id_order(x) -> tuple:
    """A sort key for Chrome trace ids, which may be integers or strings, mixed."""
    return (isinstance(x, str), x if not isinstance(x, str) else 0, str(x))


def _layout(s: _StepBuckets) -> tuple:
    return tuple(sorted(s.nbytes.items()))


def summarize(trace: dict, per_rank: bool = False) -> Summary:
    per = _collect(trace)
    ranks = sorted(per, key=_id_order)
    steps = sorted({st for r in per.values() for st in r})
    # the final layout: that of the last step of rank 0 that has buckets
    final = None
    for st in reversed(steps):
        s = per[ranks[0]].get(st) if ranks else None
        if s is not None and s.nbytes:
            final = _layout(s)
            break
    used = [st for st in steps if final is not None
            and all(st in per[r] and _layout(per[r][st]) == final for r in ranks)]
    figures: dict[int, dict[int, dict[str, list]]] = {}  # rank -> bucket -> figure -> values
    step_figs: dict[int, dict[str, list]] = {}
    for r in ranks:
        by_step = per[r]
        order = sorted(by_step)
        fig_r: dict[int, dict[str, list]] = defaultdict(lambda: defaultdict(list))
        sf: dict[str, list] = defaultdict(list)
        for k, st in enumerate(order):
            if st not in used:
                continue
            s = by_step[st]
            nxt = by_step[order[k + 1]].start if k + 1 < len(order) else s.end
            step_time = max(nxt - s.start, 1e-9)
            bw_end = (s.backward_end if s.backward_end is not None
                      else min(s.launch.values(), default=s.start))
            prev_done = bw_end
            total_exposed = 0.0
            for b in sorted(s.done):
                exposed = max(0.0, s.done[b] - prev_done)
                prev_done = max(prev_done, s.done[b])
                total_exposed += exposed
                f = fig_r[b]
                f["bytes"].append(s.nbytes[b])
                if b in s.ready:
                    f["ready_to_launch"].append(s.launch[b] - s.ready[b])
                f["in_flight"].append(s.done[b] - s.launch[b])
                f["exposed"].append(exposed)
                f["share"].append(exposed / step_time)
            sf["step"].append(step_time)
            sf["backward"].append(s.backward)
            sf["exposed"].append(total_exposed)
        figures[r], step_figs[r] = fig_r, sf

    def med(vals):
        return statistics.median(vals) if vals else None

    rows: list[BucketRow] = []
    buckets = sorted({b for f in figures.values() for b in f})
    for b in buckets:
        per_r = []
        for r in ranks:
            f = figures[r].get(b)
            if not f:
                continue
            per_r.append(BucketRow(b, int(med(f["bytes"])), med(f["ready_to_launch"]),
                                   med(f["in_flight"]), med(f["exposed"]), med(f["share"]),
                                   rank=r))
        if per_rank:
            rows.extend(per_r)
        elif per_r:
            rtl = [x.ready_to_launch for x in per_r if x.ready_to_launch is not None]
            rows.append(BucketRow(b, max(x.nbytes for x in per_r), max(rtl) if rtl else None,
                                  max(x.in_flight for x in per_r),
                                  max(x.exposed for x in per_r), max(x.share for x in per_r)))

    def across(key):
        vals = [med(step_figs[r][key]) for r in ranks if step_figs[r][key]]
        return max(vals) if vals else 0.0

    return Summary(ranks, len(steps), used, rows, across("step"), across("backward"),
                   across("exposed"))


def _bytes(n: int) -> str:
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            return f"{n / k:.2f} {unit}"
    return f"{n} B"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _ms(us: float | None) -> str:
    return "-" if us is None else f"{us / 1e3:.3f} ms"


def format_table(s: Summary, per_rank: bool = False) -> str:
    how = "per rank" if per_rank else "max over ranks"
    lines = [f"{len(s.ranks)} rank(s), {s.steps} step(s); medians over the {len(s.used_steps)} "
             f"step(s) with the final layout "
             f"({_count(len({r.bucket for r in s.rows}), 'bucket')}), "
             f"{how}"]
    head = (["rank"] if per_rank else []) + ["bucket", "bytes", "ready->launch", "in flight",
                                             "exposed", "share of step"]
    body = []
    for r in s.rows:
        body.append(([str(r.rank)] if per_rank else []) +
                    [str(r.bucket), _bytes(r.nbytes), _ms(r.ready_to_launch),
                     _ms(r.in_flight), _ms(r.exposed), f"{100 * r.share:.1f}%"])
    widths = [max(len(h), *(len(row[i]) for row in body)) if body else len(h)
              for i, h in enumerate(head)]
    lines.append("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in body]
    share = s.exposed / s.step_time if s.step_time else 0.0
    lines.append(f"step {_ms(s.step_time)}, backward {_ms(s.backward)}, exposed communication "
                 f"{_ms(s.exposed)} ({100 * share:.1f}% of the step)")
    return "\n".join(lines)


# ------------------------------------------------------------------ the picture
_KIND_ALPHA = {"pack": 1.0, "allreduce": 0.85, "wait": 0.35, "unpack": 0.6}


def plot_timeline(trace: dict, out: str, steps: int = 3) -> str:
    """Draw the last ``steps`` steps: one lane per rank and stream, a bucket in the same
    colour on every rank (pack solid, wait faint, unpack light; in the comm lane one thin
    row per bucket, as several are in flight at once), ``last_ready`` as a tick; backward
    and other spans grey. Returns ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    evs = [e for e in trace["traceEvents"] if e.get("ph") in ("X", "i")]
    all_steps = sorted({(e.get("args") or {}).get("step", 0) for e in evs})
    keep = set(all_steps[-steps:]) if steps > 0 else set(all_steps)
    evs = [e for e in evs if (e.get("args") or {}).get("step", 0) in keep]
    lane_names = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            name = (e.get("args") or {}).get("name")  # (validate asks no args of M)
            if name is not None and "tid" in e:
                lane_names[(e["pid"], e["tid"])] = str(name)
    rows = sorted({(e["pid"], e["tid"]) for e in evs},
                  key=lambda row: (_id_order(row[0]), _id_order(row[1])))
    y_of = {row: len(rows) - 1 - k for k, row in enumerate(rows)}
    t0 = min((e["ts"] for e in evs), default=0.0)
    n_buckets = 1 + max((int(m.group(1)) for e in evs if (m := _BUCKET.match(e["name"]))),
                        default=0)
    cmap = plt.get_cmap("tab20")
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.55 * max(len(rows), 1)))
    buckets = set()
    for e in evs:
        y = y_of[(e["pid"], e["tid"])]
        x = (e["ts"] - t0) / 1e3
        m = _BUCKET.match(e["name"])
        if e["ph"] == "i":
            if m:
                b = int(m.group(1))
                ax.vlines(x, y - 0.4, y + 0.4, color=cmap(b % 20), linewidth=1.2)
            continue
        w = e["dur"] / 1e3
        if m:
            b, kind = int(m.group(1)), m.group(2)
            buckets.add(b)
            if kind == "allreduce":  # in flight together: one thin row per bucket
                h = 0.8 / n_buckets
                ax.barh(y - 0.4 + (b % n_buckets + 0.5) * h, w, left=x, height=h,
                        color=cmap(b % 20), alpha=_KIND_ALPHA[kind], edgecolor="black",
                        linewidth=0.3)
            else:
                ax.barh(y, w, left=x, height=0.7, color=cmap(b % 20),
                        alpha=_KIND_ALPHA.get(kind, 0.8), edgecolor="black", linewidth=0.3)
        elif e["name"] == "backward":
            ax.barh(y, w, left=x, height=0.9, color="0.88", zorder=0)
        else:
            ax.barh(y, w, left=x, height=0.5, color="0.55", edgecolor="black", linewidth=0.3)
            if w > 0:
                ax.text(x, y + 0.3, e["name"], fontsize=6, va="bottom")
    ax.set_yticks([y_of[r] for r in rows])
    ax.set_yticklabels([f"rank {pid} {lane_names.get((pid, tid), tid)}" for pid, tid in rows])
    ax.set_xlabel("ms")
    shown = sorted(keep)
    ax.set_title(f"tribucket timeline: steps {shown[0]}-{shown[-1]}" if shown else
                 "tribucket timeline (empty)")
    handles = [Patch(color=cmap(b % 20), label=f"bucket {b}") for b in sorted(buckets)[:20]]
    handles.append(Patch(color="0.88", label="backward"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
