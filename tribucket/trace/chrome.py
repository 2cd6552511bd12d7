"""Chrome trace-event JSON: one file per run, every rank's events, written by rank 0.

The format (https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU)::

    {"traceEvents": [
       {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "rank 1"}},
       {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "comm"}},
       {"ph": "X", "name": "bucket0.allreduce", "cat": "comm", "pid": 1, "tid": 1,
        "ts": 1520.3, "dur": 2103.9, "args": {"bucket": 0, "bytes": 4096, "step": 3}},
       {"ph": "i", "s": "t", "name": "bucket0.last_ready", "pid": 1, "tid": 0, "ts": 1490.1,
        "args": {"bucket": 0, "step": 3}},
       ...],
     "displayTimeUnit": "ms",
     "otherData": {"tribucket": {...}}}

``pid`` is the global rank, ``tid`` the lane; ``ts``/``dur`` are microseconds from the
first event of the run. Ranks are aligned through ``time.time_ns``: each rank maps its
``perf_counter_ns`` to wall time with paired reads taken at close; on one host that is the
same clock on every rank (exact to about a microsecond), across hosts it is as good as
their clock synchronisation (NTP: ~1 ms, PTP: ~1 us).
"""

from __future__ import annotations

import json
import os
import time
import warnings
from typing import Any

import torch.distributed as dist

from .tracer import LANES

__all__ = ["load", "to_chrome", "validate", "write_run"]


def _lane_ids(payloads: list[dict]) -> dict[str, int]:
    ids = {lane: i for i, lane in enumerate(LANES)}
    for p in payloads:
        for ev in p["events"]:
            if ev[1] not in ids:
                ids[ev[1]] = len(ids)
    return ids


def to_chrome(payloads: list[dict], meta: dict | None = None) -> dict:
    """The trace of a run from every rank's :meth:`Tracer.export`."""
    lanes = _lane_ids(payloads)
    starts = [ev[2] + p["offset_ns"] for p in payloads for ev in p["events"]]
    base = min(starts) if starts else 0
    out: list[dict] = []
    for p in sorted(payloads, key=lambda p: p["rank"]):
        pid, off = p["rank"], p["offset_ns"] - base
        out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                    "args": {"name": f"rank {pid}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                    "args": {"sort_index": pid}})
        used = sorted({ev[1] for ev in p["events"]}, key=lanes.__getitem__)
        for lane in used:
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": lanes[lane],
                        "args": {"name": lane}})
            out.append({"ph": "M", "name": "thread_sort_index", "pid": pid,
                        "tid": lanes[lane], "args": {"sort_index": lanes[lane]}})
        for name, lane, t0, t1, args, step in p["events"]:
            a = dict(args) if args else {}
            a["step"] = step
            ts = (t0 + off) / 1e3
            if t1 == -1:
                out.append({"ph": "i", "s": "t", "name": name, "cat": lane, "pid": pid,
                            "tid": lanes[lane], "ts": ts, "args": a})
            else:
                out.append({"ph": "X", "name": name, "cat": lane, "pid": pid,
                            "tid": lanes[lane], "ts": ts, "dur": max(0, t1 - t0) / 1e3,
                            "args": a})
    info = {"format": 1, "ranks": sorted(p["rank"] for p in payloads),
            "base_time_ns": base,
            "unfinished": {p["rank"]: p.get("unfinished", 0) for p in payloads},
            "dropped": {p["rank"]: p.get("dropped", 0) for p in payloads}}
    info.update(meta or {})
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {"tribucket": info}}


def write_problem(path: str | os.PathLike) -> str | None:
    """Why the trace file for ``path`` could not be written here (None: it can), found
    without creating anything: the nearest existing directory on the way must be one, and
    writable."""
    target = os.path.abspath(os.fspath(path))
    where = (os.path.dirname(target) if target.endswith(".json") and not os.path.isdir(target)
             else target)
    while not os.path.exists(where):
        where = os.path.dirname(where)
    if not os.path.isdir(where):
        return f"{where} is a file, not a directory"
    if not os.access(where, os.W_OK | os.X_OK):
        return f"the directory {where} is not writable"
    return None


def _file_for(path: str, rank: int | None = None) -> str:
    """``path`` itself if it names a ``.json`` file, else a new file in that directory;
    ``rank``: one rank's own file (``<name>.rank<r>.json``)."""
    own = "" if rank is None else f".rank{rank}"
    if path.endswith(".json") and not os.path.isdir(path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        return path if rank is None else f"{path[:-5]}{own}.json"
    os.makedirs(path, exist_ok=True)
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    name, n = os.path.join(path, f"trace-{stamp}{own}.json"), 1
    while os.path.exists(name):  # another run of this process closed in the same second
        n += 1
        name = os.path.join(path, f"trace-{stamp}-{n}{own}.json")
    return name


def write_run(payload: dict, path: str | None, group=None, local: bool = False) -> str | None:
    """Gather ``payload`` (this rank's export) on the group's rank 0 and write the file
    there; every rank of ``group`` calls this. Returns the file on rank 0, else None.
    ``local``: no gather (a run that left on an exception, whose peers may be in other
    collectives or gone): each rank writes its own events to a file of its own."""
    payloads = [payload]
    if not local and dist.is_available() and dist.is_initialized():
        world = dist.get_world_size(group)
        if world > 1:
            me = dist.get_rank(group)
            dst = dist.get_global_rank(group, 0) if group is not None else 0
            gathered = [None] * world if me == 0 else None
            dist.gather_object(payload, gathered, dst=dst, group=group)
            if me != 0:
                return None
            payloads = gathered
    if path is None:
        return None
    trace = to_chrome(payloads, {"world_size": len(payloads)} if not local else
                      {"rank_only": payload["rank"]})
    try:
        target = _file_for(path, payload["rank"] if local else None)
        tmp = f"{target}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(trace, f, separators=(",", ":"))
        os.replace(tmp, target)
    except OSError as e:  # the trace is lost, not the run (the entry checked the path)
        warnings.warn(f"tribucket: could not write the trace to {os.fspath(path)}: {e}",
                      RuntimeWarning, stacklevel=2)
        return None
    return target


def load(path: str | os.PathLike) -> dict:
    """Read a trace file and check it (:func:`validate`)."""
    with open(path) as f:
        trace = json.load(f)
    validate(trace)
    return trace


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _wrong_field(ev: dict, ph: str) -> str | None:
    """What is of the wrong type in a well-formed event's fields, or None."""
    args = ev.get("args", {})
    if not isinstance(ev["name"], str):
        return f"name={ev['name']!r} is not a string"
    if ph == "X" and not _number(ev["dur"]):
        return f"dur={ev['dur']!r} is not a number"
    if ph == "X" and not ev["dur"] >= 0:
        return f"dur={ev['dur']} < 0"
    if ph != "M" and not _number(ev["ts"]):
        return f"ts={ev['ts']!r} is not a number"
    for f in ("pid", "tid"):
        if f in ev and (not isinstance(ev[f], (int, str)) or isinstance(ev[f], bool)):
            return f"{f}={ev[f]!r} is not an integer or a string"
    if not isinstance(args, dict):
        return f"args={args!r} is not an object"
    if "step" in args and (not isinstance(args["step"], int) or isinstance(args["step"], bool)):
        return f"args.step={args['step']!r} is not an integer"
    if "bytes" in args and not _number(args["bytes"]):
        return f"args.bytes={args['bytes']!r} is not a number"
    return None


def validate(trace: Any) -> None:
    """Raise ``ValueError`` naming the first few malformed events, if any: an ``X`` event
    needs ``name``, ``ts``, ``dur >= 0``, ``pid``, ``tid``; an ``i`` event ``name``,
    ``ts``, ``pid``, ``tid``; an ``M`` event ``name`` and ``pid``."""
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError("not a Chrome trace: expected an object with a 'traceEvents' list")
    need = {"X": ("name", "ts", "dur", "pid", "tid"), "i": ("name", "ts", "pid", "tid"),
            "M": ("name", "pid")}
    bad = []
    for k, ev in enumerate(trace["traceEvents"]):
        ph = ev.get("ph") if isinstance(ev, dict) else None
        if ph not in need:
            bad.append(f"event {k}: phase {ph!r} (expected one of X, i, M)")
            continue
        missing = [f for f in need[ph] if f not in ev]
        if missing:
            bad.append(f"event {k} ({ph} {ev.get('name')!r}): missing {missing}")
            continue
        wrong = _wrong_field(ev, ph)
        if wrong is not None:
            bad.append(f"event {k} ({ev['name']!r}): {wrong}")
    if bad:
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        raise ValueError("malformed trace: " + "; ".join(bad[:5]) + more)
