"""``python -m tribucket.trace PATH``: the per-bucket table of a trace, and its PNG timeline.

    python -m tribucket.trace runs/trace-20260101-120000-4242.json
    python -m tribucket.trace trace.json --png timeline.png --steps 5 --per-rank
    python -m tribucket.trace trace.json --no-png
"""

from __future__ import annotations

import argparse
import os
import sys

from .chrome import load
from .report import format_table, summarize


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tribucket.trace",
                                 description="Per-bucket table and PNG timeline of a "
                                             "tribucket trace (Chrome trace-event JSON).")
    ap.add_argument("path", help="the trace file (.json)")
    ap.add_argument("--png", help="where to write the timeline (default: next to the trace, "
                                  "same name with .png)")
    ap.add_argument("--no-png", action="store_true", help="print the table only")
    ap.add_argument("--steps", type=int, default=3,
                    help="how many of the last steps the timeline shows (default 3)")
    ap.add_argument("--per-rank", action="store_true",
                    help="one row per rank and bucket (default: the max over ranks)")
    a = ap.parse_args(argv)
    try:
        trace = load(a.path)
    except (OSError, ValueError) as e:
        print(f"tribucket.trace: cannot read {a.path}: {e}", file=sys.stderr)
        return 2
    if not any(ev.get("ph") in ("X", "i") for ev in trace["traceEvents"]):
        print(f"tribucket.trace: {a.path} holds no spans: no backward ran through the "
              f"reducer (and no MoE layer ran a forward) while it traced", file=sys.stderr)
        return 1
    print(f"tribucket trace {a.path}")
    summary = summarize(trace, per_rank=a.per_rank)
    if summary.rows:
        print(format_table(summary, per_rank=a.per_rank))
    else:
        print(f"no bucket spans in {len(summary.ranks)} rank(s), {summary.steps} step(s): no "
              f"backward ran through a reducer (forwards only); the timeline shows the rest")
    if a.no_png:
        return 0
    out = a.png or os.path.splitext(a.path)[0] + ".png"
    try:
        from .report import plot_timeline

        plot_timeline(trace, out, steps=a.steps)
    except ImportError as e:
        print(f"tribucket.trace: no PNG ({e}); pip install 'tribucket[trace]' (matplotlib)",
              file=sys.stderr)
        return 1
    except OSError as e:
        print(f"tribucket.trace: cannot write the timeline {out}: {e}; pass --png with a "
              "path in a folder you can write, or --no-png", file=sys.stderr)
        return 2
    print(f"timeline: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
