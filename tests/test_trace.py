"""tribucket.trace: the Tracer driven as the reducer drives it, on 2 gloo ranks with real
async allreduces, then the file, the profiler ranges, the CLI's table and PNG, and the off
path (nothing recorded, nothing written)."""

from __future__ import annotations

import json
import os
import re
import runpy
import struct
import sys
import time
from collections import defaultdict

import pytest
import torch
import torch.distributed as dist

import _dist
from tribucket import trace
from tribucket.trace import Tracer, make_tracer
from tribucket.trace.__main__ import main as cli_main

SIZES = (1000, 30000, 200000)  # float32 elements per bucket
STEPS = 4


# ------------------------------------------------------------------ the synthetic reducer
def _backward_step(tr, step: int, grads: list, outs: list, delay_s: float = 0.02) -> None:
    """One step as the reducer runs it: buckets become ready in order during backward (a
    matmul stands for the compute), each is packed and launched at once; after backward
    (and a pause that stands for the rest of backward: the collectives finish meanwhile)
    each is waited for and unpacked. ``tr is None``: tracing off, one check per bucket."""
    a = torch.randn(64, 64)
    if tr is not None:
        tr.next_step(step)
        bw = tr.begin("backward")
    inflight = []
    for i, g in enumerate(grads):
        if tr is not None:
            tr.instant(f"bucket{i}.first_ready", args={"bucket": i})
        for _ in range(3):
            a = torch.tanh(a @ a)  # the bucket's gradients being computed
        if tr is not None:
            tr.instant(f"bucket{i}.last_ready", args={"bucket": i})
            nbytes = g.numel() * g.element_size()
            pk = tr.begin(f"bucket{i}.pack", args={"bucket": i, "bytes": nbytes})
        buf = g * 0.5  # the pack (scale by 1/world fused in)
        work = dist.all_reduce(buf, async_op=True)
        coll = None
        if tr is not None:
            tr.end(pk)
            coll = tr.collective(f"bucket{i}.allreduce", work, {"bucket": i, "bytes": nbytes})
        inflight.append((i, buf, work, coll))
    time.sleep(delay_s)
    if tr is not None:
        tr.end(bw)
    for i, buf, work, coll in inflight:
        if tr is not None:
            w = tr.begin(f"bucket{i}.wait", args={"bucket": i})
        work.wait()
        if tr is not None:
            tr.end(w, completes=coll)
            u = tr.begin(f"bucket{i}.unpack", args={"bucket": i})
        outs[i].copy_(buf)
        if tr is not None:
            tr.end(u)
    if tr is not None:
        with tr.span("epilogue"):
            torch.stack([o.norm() for o in outs]).norm()


class _Counting:
    """Counts every call of the Tracer's methods (the off path must make none)."""

    names = ("__init__", "begin", "end", "instant", "collective", "complete", "next_step",
             "span", "close")

    def __enter__(self):
        self.calls, self.saved = defaultdict(int), {}
        for n in self.names:
            orig = getattr(Tracer, n)
            self.saved[n] = orig

            def wrapped(*a, _n=n, _orig=orig, **k):
                self.calls[_n] += 1
                return _orig(*a, **k)

            setattr(Tracer, n, wrapped)
        return self

    def __exit__(self, *exc):
        for n, orig in self.saved.items():
            setattr(Tracer, n, orig)


def _run_ranks(on_dir: str, off_dir: str) -> dict:
    torch.manual_seed(dist.get_rank())
    grads = [torch.randn(n) for n in SIZES]
    outs = [torch.empty(n) for n in SIZES]
    out: dict = {"rank": dist.get_rank()}

    # on: TRIBUCKET_TRACE=DIR, as a user turns it on
    os.environ[trace.ENV] = on_dir
    try:
        tr = make_tracer(None)
    finally:
        del os.environ[trace.ENV]
    assert isinstance(tr, Tracer)
    for step in range(STEPS):
        _backward_step(tr, step, grads, outs)
    out["path"] = tr.close()

    # the same spans in a torch.profiler trace taken around a traced step
    tr = Tracer(None)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _backward_step(tr, 0, grads, outs)
    tr.close()
    out["profiled"] = sorted({e.name for e in prof.events()
                              if e.name.startswith(("bucket", "backward", "epilogue"))})

    # off: no TRIBUCKET_TRACE, no trace= -> no tracer; nothing called, nothing written
    os.environ.pop(trace.ENV, None)
    with _Counting() as c:
        tr = make_tracer(None)
        for step in range(2):
            _backward_step(tr, step, grads, outs, delay_s=0.0)
    out["off_tracer"] = tr
    out["off_calls"] = dict(c.calls)
    out["off_files"] = os.listdir(off_dir)
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    on_dir = tmp_path_factory.mktemp("trace_on")
    off_dir = tmp_path_factory.mktemp("trace_off")
    results = _dist.run(_run_ranks, str(on_dir), str(off_dir), world_size=2, timeout=120)
    return {"on_dir": on_dir, "off_dir": off_dir, "ranks": results}


@pytest.fixture(scope="module")
def loaded(run):
    path = run["ranks"][0]["path"]
    return path, trace.load(path)


# ------------------------------------------------------------------ the file
def test_one_file_per_run_with_every_rank(run, loaded):
    path, tr = loaded
    assert run["ranks"][1]["path"] is None, "only rank 0 writes"
    assert os.listdir(run["on_dir"]) == [os.path.basename(path)], "one file per run"
    assert re.fullmatch(r"trace-\d{8}-\d{6}-\d+\.json", os.path.basename(path))
    xs = [e for e in tr["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in xs} == {0, 1}
    names = {(e["pid"], e["args"]["name"]) for e in tr["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1")}
    lanes = {e["args"]["name"] for e in tr["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    assert lanes == {"compute", "comm"}
    for e in xs:  # well-formed (trace.load validated; checked here again, explicitly)
        assert {"name", "ts", "dur", "pid", "tid"} <= e.keys(), e
        assert e["dur"] >= 0, e
    info = tr["otherData"]["tribucket"]
    assert info["world_size"] == 2 and info["unfinished"] == {"0": 0, "1": 0}


def test_spans_ordered_per_bucket(loaded):
    _, tr = loaded
    ev = defaultdict(dict)  # (pid, step, bucket) -> kind -> (start, end)
    for e in tr["traceEvents"]:
        m = re.fullmatch(r"bucket(\d+)\.(\w+)", e.get("name", ""))
        if m and e["ph"] in ("X", "i"):
            key = (e["pid"], e["args"]["step"], int(m.group(1)))
            ev[key][m.group(2)] = (e["ts"], e["ts"] + e.get("dur", 0.0))
            if m.group(2) in ("pack", "allreduce"):
                assert e["args"]["bytes"] == SIZES[int(m.group(1))] * 4
    assert {k[2] for k in ev} == set(range(len(SIZES))), "the trace's buckets are the layout's"
    assert len(ev) == 2 * STEPS * len(SIZES)
    done_before_wait = defaultdict(int)
    for key, k in ev.items():
        assert k.keys() == {"first_ready", "last_ready", "pack", "allreduce", "wait", "unpack"}
        order = [k["first_ready"][0], k["last_ready"][0], k["pack"][0], k["pack"][1],
                 k["allreduce"][0], k["allreduce"][1], k["wait"][1], k["unpack"][0]]
        assert order == sorted(order), (key, k)
        # the completion is the backend's, not the wait's: backward went on for 20 ms after
        # the last launch, so the collectives finished before the reducer waited
        if k["allreduce"][1] < k["wait"][0]:
            done_before_wait[key[0]] += 1
    assert done_before_wait[0] > 0 and done_before_wait[1] > 0, done_before_wait


def test_ranks_aligned(loaded):
    # both ranks leave each allreduce together: their ends are within a few ms of each other
    _, tr = loaded
    ends = defaultdict(list)
    for e in tr["traceEvents"]:
        if e.get("ph") == "X" and e["name"].endswith(".allreduce"):
            ends[(e["args"]["step"], e["name"])].append(e["ts"] + e["dur"])
    spread = sorted(max(v) - min(v) for v in ends.values() if len(v) == 2)
    assert spread and spread[len(spread) // 2] < 20_000, spread  # us


def test_profiler_shows_the_spans(run):
    for r in run["ranks"]:
        got = set(r["profiled"])
        for i in range(len(SIZES)):
            assert {f"bucket{i}.pack", f"bucket{i}.wait", f"bucket{i}.unpack",
                    f"bucket{i}.allreduce"} <= got, got
        assert {"backward", "epilogue"} <= got


def test_off_records_nothing_and_writes_nothing(run):
    for r in run["ranks"]:
        assert r["off_tracer"] is None
        assert r["off_calls"] == {}, r["off_calls"]
        assert r["off_files"] == []


# ------------------------------------------------------------------ the CLI
def test_cli_table_and_png(loaded, tmp_path, capsys):
    path, _ = loaded
    png = tmp_path / "timeline.png"
    assert cli_main([path, "--png", str(png)]) == 0
    text = capsys.readouterr().out
    rows = [ln.split() for ln in text.splitlines() if re.match(r"\s*\d+\s+\d", ln)]
    assert [int(r[0]) for r in rows] == list(range(len(SIZES))), text
    want = {0: "3.91 KiB", 1: "117.19 KiB", 2: "781.25 KiB"}
    assert {int(r[0]): f"{r[1]} {r[2]}" for r in rows} == want, text
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    w, h = struct.unpack(">II", data[16:24])
    assert w > 100 and h > 100


def test_cli_module_exits_0_and_writes_png_next_to_trace(loaded, tmp_path, monkeypatch,
                                                        capsys):
    """``python -m tribucket.trace PATH`` (its __main__, run as -m runs it; in this process:
    a fresh interpreter costs ~10 s of imports here)."""
    path, _ = loaded
    copy = tmp_path / "run.json"
    copy.write_text(open(path).read())
    monkeypatch.setattr(sys, "argv", ["tribucket.trace", str(copy), "--per-rank"])
    monkeypatch.delitem(sys.modules, "tribucket.trace.__main__", raising=False)
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("tribucket.trace", run_name="__main__", alter_sys=True)
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "ready->launch" in out and "exposed" in out
    rows = [ln for ln in out.splitlines() if re.match(r"\s*[01]\s+\d+\s+\d", ln)]
    assert len(rows) == 2 * len(SIZES), out
    png = tmp_path / "run.png"
    assert png.stat().st_size > 0 and png.read_bytes()[:4] == b"\x89PNG"


def test_cli_rejects_a_malformed_trace(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"traceEvents": [{"ph": "X", "name": "x", "ts": 0, "pid": 0}]}))
    assert cli_main([str(bad), "--no-png"]) == 2
    assert "missing ['dur', 'tid']" in capsys.readouterr().err


@pytest.mark.parametrize("events", [
    # a thread_name metadata event with neither args nor tid (validate asks neither of M)
    [{"ph": "M", "name": "thread_name", "pid": 0, "tid": 0},
     {"ph": "M", "name": "thread_name", "pid": 0, "args": {"name": "main"}}],
    # rank ids of both kinds (integers and strings are both valid ids)
    [{"ph": "X", "name": "backward", "pid": "rank 1", "tid": 0, "ts": 0.0, "dur": 2.0,
      "args": {"step": 1}}]])
def test_cli_reads_every_trace_its_check_accepts(tmp_path, capsys, events):
    path = tmp_path / "odd.json"
    path.write_text(json.dumps({"traceEvents": events + [
        {"ph": "X", "name": "backward", "pid": 0, "tid": 0, "ts": 0.0, "dur": 5.0,
         "args": {"step": 1}}]}))
    assert cli_main([str(path)]) == 0
    assert (tmp_path / "odd.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_says_when_a_trace_has_nothing_to_show(tmp_path, capsys):
    # a run closed before its first traced step: no table of zeros, no empty picture
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "rank 0"}}]}))
    assert cli_main([str(empty)]) == 1
    out, err = capsys.readouterr()
    assert "holds no spans" in err and "0.000 ms" not in out
    assert not (tmp_path / "empty.png").exists()
    # spans but no bucket (forwards only, as an evaluation run): the timeline, and why no table
    forward = tmp_path / "forward.json"
    forward.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "name": "moe0.dispatch", "ts": 0.0, "dur": 5.0, "pid": 0, "tid": 0,
         "args": {"step": 0}}]}))
    assert cli_main([str(forward)]) == 0
    out = capsys.readouterr().out
    assert "no bucket spans" in out and "0.000 ms" not in out, out
    assert (tmp_path / "forward.png").read_bytes()[:4] == b"\x89PNG"



@pytest.mark.parametrize("change", [
    {"dur": None}, {"dur": "5"}, {"args": [1]}, {"name": 5}, {"pid": [0]},
    {"args": {"step": None}}, {"args": {"step": 0, "bytes": "x"}}])
def test_cli_names_a_field_of_the_wrong_type(tmp_path, capsys, change):
    # JSON that parses but holds a field of the wrong type: a clear error, exit 2
    ev = {"ph": "X", "name": "bucket0.allreduce", "ts": 0.0, "dur": 5.0, "pid": 0, "tid": 0,
          "args": {"step": 0, "bytes": 64}}
    path = tmp_path / "typed.json"
    path.write_text(json.dumps({"traceEvents": [{**ev, **change}]}))
    assert cli_main([str(path), "--no-png"]) == 2
    err = capsys.readouterr().err
    assert "malformed trace" in err and next(iter(change)) in err, err


def test_cli_reports_an_unwritable_png(tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "name": "moe0.dispatch", "ts": 0.0, "dur": 5.0, "pid": 0, "tid": 0,
         "args": {"step": 0}}]}))
    assert cli_main([str(path), "--png", str(tmp_path / "no" / "such" / "x.png")]) == 2
    assert "cannot write" in capsys.readouterr().err

# ------------------------------------------------------------------ one process
def test_make_tracer_choices(tmp_path, monkeypatch):
    monkeypatch.delenv(trace.ENV, raising=False)
    assert make_tracer(None) is None and make_tracer(False) is None
    monkeypatch.setenv(trace.ENV, str(tmp_path))
    assert make_tracer(False) is None
    t = make_tracer(None)
    assert isinstance(t, Tracer) and t.path == str(tmp_path)
    assert make_tracer(t) is t
    assert make_tracer(True).path == str(tmp_path)
    assert make_tracer(tmp_path / "x.json").path == str(tmp_path / "x.json")
    with pytest.raises(TypeError, match="trace=3"):
        make_tracer(3)


def test_single_process_writes_the_given_file(tmp_path):
    tr = Tracer(tmp_path / "sub" / "t.json", record_function=False)
    assert trace.current() is tr
    tr.instant("layout", args={"buckets": [8]})
    with tr.span("epilogue"):
        pass
    tr.begin("never.ended")  # unfinished: counted, not written
    assert tr.close() == str(tmp_path / "sub" / "t.json") and trace.current() is None
    t = trace.load(tmp_path / "sub" / "t.json")
    assert [e["name"] for e in t["traceEvents"] if e["ph"] in "Xi"] == ["layout", "epilogue"]
    assert t["otherData"]["tribucket"]["unfinished"] == {"0": 1}


def test_runs_closing_in_the_same_second_get_their_own_files(tmp_path):
    # before, the file name had a one-second stamp and the pid: three runs of one process
    # closing within a second wrote one file, each over the last
    paths = []
    for run in range(3):
        tr = Tracer(tmp_path, record_function=False)
        tr.instant("layout", args={"run": run})
        paths.append(tr.close())
    assert len(set(paths)) == 3 and sorted(os.listdir(tmp_path)) == sorted(
        os.path.basename(p) for p in paths), paths
    runs = [[e["args"]["run"] for e in trace.load(p)["traceEvents"] if e["name"] == "layout"]
            for p in paths]
    assert runs == [[0], [1], [2]], runs


def test_max_events_bounds_memory():
    tr = Tracer(None, max_events=3, record_function=False)
    for i in range(5):
        tr.end(tr.begin(f"s{i}"))
    assert len(tr.events) == 3 and tr.dropped == 2


def test_backward_range_spans_the_region_in_backward():
    tr = Tracer(None, record_function=False)
    x = torch.randn(8, 4, requires_grad=True)
    h = x * 2  # the region's input
    y = torch.tanh(h @ torch.randn(4, 4))  # the region (say, the experts)
    tr.backward_range("moe.experts.bwd", begin_at=y, end_at=h, args={"layer": "l0"})
    t_fwd = time.perf_counter_ns()
    y.sum().backward()
    (rec,) = tr.events
    assert rec[0] == "moe.experts.bwd" and rec[1] == trace.MOE
    assert t_fwd < rec[2] <= rec[3]


def test_device_spans_resolve_from_events():
    """The CUDA path with a stand-in event (no GPU here): times come from elapsed_time to an
    anchor recorded at close."""

    class FakeEvent:
        clock = [0.0]

        def record(self, stream=None):
            FakeEvent.clock[0] += 1.0  # each record 1 ms after the previous
            self.t = FakeEvent.clock[0]

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return other.t - self.t

    tr = Tracer(None, record_function=False)
    tr._event_factory = FakeEvent
    rec = tr.device_begin("bucket0.pack", args={"bucket": 0})
    tr.device_end(rec)  # 1 ms later on the device
    (name, lane, t0, t1, args, step), = tr.export()["events"]
    assert (name, lane, args) == ("bucket0.pack", trace.DEVICE, {"bucket": 0})
    assert t1 - t0 == 1_000_000


def test_validate_names_the_bad_event():
    with pytest.raises(ValueError, match=r"event 1 \('b'\): dur=-1 < 0"):
        trace.validate({"traceEvents": [
            {"ph": "M", "name": "process_name", "pid": 0},
            {"ph": "X", "name": "b", "ts": 0, "dur": -1, "pid": 0, "tid": 0}]})
    with pytest.raises(ValueError, match="traceEvents"):
        trace.validate([])


# ---------------------------------------------------------------- the reducer and MoE, traced
def _traced_training(path, moe, **options):
    """Three steps of the test MLP (or an MoE model) with the reducer traced to ``path``
    (None: tracing off); the gradients of each step and what was traced."""
    import tribucket
    from models import batch, build, loss_of
    from tribucket.moe import MoELayer

    rank = dist.get_rank()
    torch.manual_seed(0)
    if moe:
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), MoELayer(
            [torch.nn.Linear(16, 16) for _ in range(2)], 4, 16, top_k=2, name="moe0"))
    else:
        model = build("mlp")
    grads = []
    with tribucket.fused_bucketing(model, bucket_cap_mb=0.001, trace=path,
                                   **options) as reducer:
        made = reducer._comm.tracer is not None
        for step in range(3):
            x = (torch.randn(8, 16, generator=torch.Generator().manual_seed(rank + 10 * step))
                 if moe else batch("mlp", rank, step))
            out = model(x)
            (out.square().mean() if moe else loss_of(out)).backward()
            grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
            model.zero_grad()
        n_buckets = len(reducer._bw.buckets)
        sizes = [b.wire_bytes() for b in reducer._bw.buckets]
    return made, reducer.trace_path, n_buckets, sizes, grads


def _traced_join(path):
    """Rank 0 trains 6 steps, rank 1 runs out after 3 (``join()``): the trace's path."""
    import tribucket
    from models import batch, build, loss_of

    rank = dist.get_rank()
    model = build("mlp")
    with tribucket.fused_bucketing(model, bucket_cap_mb=0.001, trace=path) as reducer:
        with reducer.join():
            for step in range(6 if rank == 0 else 3):
                loss_of(model(batch("mlp", rank, step))).backward()
                model.zero_grad()
    return reducer.trace_path


@pytest.mark.dist
def test_join_shadow_passes_are_traced_as_steps_of_their_own(dist_run, tmp_path):
    # before: rank 1 stamped its shadow collectives for rank 0's steps 4-6 with its own last
    # step, whose buckets then counted four times: the table used 1 of 5 steps
    from tribucket.trace.report import summarize

    path = dist_run(_traced_join, str(tmp_path), world_size=2, timeout=60)[0]
    doc = trace.load(path)
    per_rank_steps = {pid: sorted({e["args"]["step"] for e in doc["traceEvents"]
                                   if e.get("ph") == "X" and e["pid"] == pid
                                   and e["name"].endswith(".allreduce")})
                      for pid in (0, 1)}
    assert per_rank_steps[0] == per_rank_steps[1], per_rank_steps  # one step per pass
    summary = summarize(doc)
    assert len(summary.used_steps) >= 5, (summary.used_steps, per_rank_steps)


@pytest.mark.dist
def test_reducer_trace_matches_its_layout_and_changes_nothing(dist_run, tmp_path):
    traced = dist_run(_traced_training, str(tmp_path), False, world_size=2)
    plain = dist_run(_traced_training, False, False, world_size=2)
    assert [r[1] is not None for r in traced] == [True, False]  # rank 0 writes the one file
    assert os.listdir(tmp_path) == [os.path.basename(traced[0][1])]
    for (_, _, _, _, g1), (made, path, _, _, g2) in zip(traced, plain):
        assert not made and path is None  # off: no tracer, no file
        assert all(torch.equal(a, b) for s1, s2 in zip(g1, g2) for a, b in zip(s1, s2))
    doc = trace.load(traced[0][1])
    trace.validate(doc)
    made, _, n_buckets, sizes, _ = traced[0]
    assert made
    events = [e for e in doc["traceEvents"] if e.get("ph") in ("X", "i")]
    last = max(e["args"]["step"] for e in events if e["name"] == "backward")
    for pid in (0, 1):
        mine = [e for e in events if e["pid"] == pid and e["args"].get("step") == last]
        coll = {e["args"]["bucket"]: e for e in mine if e["name"].endswith(".allreduce")}
        assert sorted(coll) == list(range(n_buckets))  # the trace's buckets: the layout's
        assert [coll[b]["args"]["bytes"] for b in range(n_buckets)] == sizes
        by = {e["name"]: e for e in mine}
        for b in range(n_buckets):
            ready = by[f"bucket{b}.last_ready"]["ts"]
            pack = by[f"bucket{b}.pack"]
            wait = by[f"bucket{b}.wait"]
            c = coll[b]
            assert ready <= pack["ts"] <= c["ts"] + 1  # (µs, rounded)
            assert c["ts"] <= c["ts"] + c["dur"] <= wait["ts"] + wait["dur"] + 1
            assert f"bucket{b}.unpack" in by


@pytest.mark.dist
@pytest.mark.parametrize("options", [{}, dict(native_hooks=False),
                                     dict(find_unused_parameters=True)],
                         ids=["native", "python", "unused"])
def test_each_buckets_first_gradient_is_traced(dist_run, tmp_path, options):
    # counted in C++ (the default), by the Python hooks, and through the used-map path; the
    # instant was documented, and before never recorded
    path = dist_run(_traced_training, str(tmp_path), False, **options, world_size=2)[0][1]
    events = [e for e in trace.load(path)["traceEvents"] if e.get("ph") in ("X", "i")]
    last = max(e["args"]["step"] for e in events if e["name"] == "backward")
    for pid in (0, 1):
        mine = {e["name"]: e for e in events if e["pid"] == pid and e["args"].get("step") == last}
        buckets = sorted(e["args"]["bucket"] for e in mine.values()
                         if e["name"].endswith(".last_ready"))
        assert len(buckets) > 1, mine.keys()
        start = mine["backward"]["ts"]
        for b in buckets:
            first, ready = mine[f"bucket{b}.first_ready"], mine[f"bucket{b}.last_ready"]
            assert first["args"]["bucket"] == b
            assert start - 1 <= first["ts"] <= ready["ts"] + 1, (pid, b, start, first, ready)


@pytest.mark.dist
def test_moe_phases_are_traced(dist_run, tmp_path):
    # the experts and the three phases of the layer's backward: documented, and before
    # not recorded (the dispatch span ran on through the experts' compute)
    path = dist_run(_traced_training, str(tmp_path), True, world_size=2)[0][1]
    events = [e for e in trace.load(path)["traceEvents"] if e.get("ph") == "X"]
    names = {e["name"] for e in events}
    assert {"moe.counts", "moe.dispatch", "moe.experts", "moe.combine", "moe.combine.bwd",
            "moe.experts.bwd", "moe.dispatch.bwd", "backward"} <= names, names
    for pid in (0, 1):  # each step's phases in order, forward then backward
        mine = [e for e in events if e["pid"] == pid and e["args"].get("step") == 2]
        at = {e["name"]: e["ts"] for e in mine}
        order = ["moe.counts", "moe.dispatch", "moe.experts", "moe.combine", "moe.combine.bwd",
                 "moe.experts.bwd", "moe.dispatch.bwd"]
        assert [at[n] for n in order] == sorted(at[n] for n in order), (pid, at)


def test_a_training_steps_forward_and_backward_share_its_step(dist_run, tmp_path):
    """Three steps of an MoE model: each step's forward spans (the layer's phases) carry the
    step number of the backward that follows them, so the table counts 3 steps, not 4."""
    path = dist_run(_traced_training, str(tmp_path), True, world_size=2)[0][1]
    loaded = trace.load(path)
    for pid in (0, 1):
        steps: dict = {}
        for e in loaded["traceEvents"]:
            if e.get("ph") in ("X", "i") and e["pid"] == pid:
                steps.setdefault(e["args"]["step"], set()).add(e["name"])
        assert sorted(steps) == [1, 2, 3], (pid, sorted(steps))
        for step, names in steps.items():
            assert {"moe.dispatch", "moe.dispatch.bwd", "backward"} <= names, (step, names)
    from tribucket.trace.report import summarize

    assert summarize(loaded).steps == 3


def _traced_accumulation(path):
    """An MoE model, 3 optimizer steps of 3 micro-batches (the first two under no_sync),
    each followed by an evaluation forward in eval mode with gradients on (no backward)."""
    import contextlib

    import tribucket
    from tribucket.moe import MoELayer

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), MoELayer(
        [torch.nn.Linear(16, 16) for _ in range(2)], 4, 16, top_k=2, name="moe0"))
    with tribucket.fused_bucketing(model, trace=path) as reducer:
        for step in range(3):
            for micro in range(3):
                x = torch.randn(8, 16, generator=torch.Generator().manual_seed(
                    rank + 10 * step + 100 * micro))
                with reducer.no_sync() if micro < 2 else contextlib.nullcontext():
                    model(x).square().mean().backward()
            model.eval()
            model(torch.randn(8, 16))  # gradients on, no backward
            model.train()
            model.zero_grad()
    return reducer.trace_path


def test_micro_batches_and_evaluation_forwards_belong_to_their_step(dist_run, tmp_path):
    """Under no_sync every micro-batch's forward belongs to the optimizer step whose
    synchronised backward follows (one step per synchronised pass, as the trace's contract
    says), and an evaluation forward makes no step of its own."""
    from tribucket.trace.report import summarize

    path = dist_run(_traced_accumulation, str(tmp_path), world_size=2)[0]
    loaded = trace.load(path)
    for pid in (0, 1):
        dispatches: dict = {}
        buckets = set()
        for e in loaded["traceEvents"]:
            if e.get("ph") == "X" and e["pid"] == pid:
                if e["name"] == "moe.dispatch":
                    dispatches[e["args"]["step"]] = dispatches.get(e["args"]["step"], 0) + 1
                elif e["name"].startswith("bucket"):
                    buckets.add(e["args"]["step"])
        assert sorted(buckets) == [1, 2, 3], (pid, sorted(buckets))
        # three micro-batches per step, and each step's evaluation forward after it
        assert dispatches == {1: 4, 2: 4, 3: 4}, (pid, dispatches)
    assert summarize(loaded).steps == 3


def _traced_epilogue(path):
    """One traced step of the MLP with each user of the epilogue's figures."""
    import tribucket
    from models import batch, build, loss_of

    model = build("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = tribucket.amp.GradScaler("cpu", init_scale=1.0)
    with tribucket.fused_bucketing(model, bucket_cap_mb=0.001, trace=path) as reducer:
        scaler.scale(loss_of(model(batch("mlp", dist.get_rank(), 0)))).backward()
        reducer.grad_norm()
        reducer.found_inf
        tribucket.clip_grad_norm_(model.parameters(), 1.0)
        scaler.unscale_(opt)
    return reducer.trace_path


@pytest.mark.dist
def test_the_epilogue_is_traced(dist_run, tmp_path):
    # documented as a span after backward; before, not recorded
    path = dist_run(_traced_epilogue, str(tmp_path), world_size=2)[0]
    events = trace.load(path)["traceEvents"]
    for pid in (0, 1):
        ops = [e["args"]["op"] for e in events if e.get("pid") == pid and e["name"] == "epilogue"]
        assert ops == ["grad_norm", "found_inf", "clip_grad_norm_", "unscale_"], (pid, ops)


class _TickEvent:
    """A stand-in CUDA event on a CPU machine: each record() reads a global counter (one
    tick = 1 ms), so events order as they were recorded, whichever thread records them."""

    _ticks = __import__("itertools").count(1)

    def record(self, stream=None):
        self.t = float(next(_TickEvent._ticks))

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return other.t - self.t


def _device_traced(path):
    """The test MLP traced with device spans forced on (stand-in events): the spans the
    reducer records for a CUDA model, on gloo."""
    import tribucket
    from models import batch, build, loss_of

    tr = Tracer(path)
    tr.device_spans, tr._event_factory = True, _TickEvent
    model = build("mlp")
    with tribucket.fused_bucketing(model, bucket_cap_mb=0.001, trace=tr) as reducer:
        for step in range(2):
            loss_of(model(batch("mlp", dist.get_rank(), step))).backward()
            model.zero_grad()
        n_buckets = len(reducer._bw.buckets)
    return reducer.trace_path, n_buckets


@pytest.mark.dist
def test_reducer_records_device_spans_per_bucket(dist_run, tmp_path):
    """Where the buckets live on a GPU the reducer adds, per bucket, the pack and unpack on
    the device lane and the collective on the device comm lane (launch event -> event
    recorded when its future completes), in the order the stream runs them."""
    (path, n_buckets), _ = dist_run(_device_traced, str(tmp_path), world_size=2)
    doc = trace.load(path)
    trace.validate(doc)
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"]
             if e.get("ph") == "M" and e["name"] == "thread_name"}
    last = max(e["args"]["step"] for e in doc["traceEvents"] if e.get("name") == "backward")
    for pid in (0, 1):  # the last step: after the rebuild, every bucket of the layout
        dev = {(lanes[(pid, e["tid"])], e["name"]): e for e in doc["traceEvents"]
               if e.get("ph") == "X" and e["pid"] == pid and e["args"].get("step") == last
               and lanes[(pid, e["tid"])] in (trace.DEVICE, trace.DEVICE_COMM)}
        assert len(dev) == 3 * n_buckets, sorted(dev)
        for b in range(n_buckets):
            pack = dev[(trace.DEVICE, f"bucket{b}.pack")]
            coll = dev[(trace.DEVICE_COMM, f"bucket{b}.allreduce")]
            unpack = dev[(trace.DEVICE, f"bucket{b}.unpack")]
            assert pack["ts"] + pack["dur"] <= coll["ts"] < coll["ts"] + coll["dur"]
            assert coll["ts"] + coll["dur"] <= unpack["ts"]  # the callback ran before the wait
            assert coll["args"]["bytes"] == pack["args"]["bytes"] > 0


def _traced_skip(path):
    """``skip_all_reduce_unused_params`` traced: ``_Switch``'s ``b`` used in the last step only
    on rank 1, ``c`` never; the agreement's wait and the buckets' spans of the last step."""
    import tribucket
    from test_parallel import _Switch

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = _Switch()
    with tribucket.fused_bucketing(model, find_unused_parameters=True, trace=path,
                                   skip_all_reduce_unused_params=True,
                                   bucket_cap_mb=4096 / 2**20) as reducer:
        for step in range(3):
            x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank + 10 * step))
            model(x, use_b=step == 2 and rank == 1).square().mean().backward()
        where = {name: reducer._bw.layout.locate(i)[0]
                 for i, (name, _) in enumerate(model.named_parameters())}
    return reducer.trace_path, where


@pytest.mark.dist
def test_skip_agreement_is_traced(dist_run, tmp_path):
    (path, where), _ = dist_run(_traced_skip, str(tmp_path), world_size=2)
    doc = trace.load(path)
    trace.validate(doc)
    events = [e for e in doc["traceEvents"] if e.get("ph") in ("X", "i")]
    last = max(e["args"]["step"] for e in events if e["name"] == "backward")
    for pid in (0, 1):
        mine = [e for e in events if e["pid"] == pid and e["args"].get("step") == last]
        waits = [e for e in mine if e["name"] == "skip_agreement.wait"]
        bwd = next(e for e in mine if e["name"] == "backward")
        assert len(waits) == 1, waits  # once a step, inside its backward
        assert bwd["ts"] <= waits[0]["ts"] + 1 and \
            waits[0]["ts"] + waits[0]["dur"] <= bwd["ts"] + bwd["dur"] + 1
        sent = {e["args"]["bucket"] for e in mine if e["name"].endswith(".allreduce")}
        # a and b (rank 1 used it) are averaged on both ranks; c, unused everywhere, is not
        assert sent == {where["a.weight"], where["b.weight"]}, (sent, where)


def _trace_to(path, spoil_on_rank0=None):
    """Enter fused_bucketing with ``trace=path`` and train a step; ``spoil_on_rank0``: a
    path rank 0 makes a file before leaving (the trace directory, made at close). The error each rank got at entry or
    at leaving, the warnings, the file written, and whether a plain step runs after."""
    import warnings

    import tribucket
    from models import batch, build, loss_of

    out = dict(error=None, warnings=[], written=None)
    model = build("mlp")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            with tribucket.fused_bucketing(model, trace=path) as reducer:
                loss_of(model(batch("mlp", dist.get_rank(), 0))).backward()
                if spoil_on_rank0 and dist.get_rank() == 0:
                    open(spoil_on_rank0, "w").close()
            out["written"] = reducer.trace_path
        except Exception as e:  # noqa: BLE001
            out["error"] = (type(e).__name__, str(e))
    out["warnings"] = [str(w.message) for w in seen if "trace" in str(w.message)]
    with tribucket.fused_bucketing(build("mlp")) as reducer:  # the group is still in step
        loss_of(reducer.module(batch("mlp", dist.get_rank(), 1))).backward()
    return out


@pytest.mark.dist
def test_a_trace_path_that_cannot_be_written_is_refused_on_entry(dist_run, tmp_path):
    # before, rank 0 raised FileExistsError at the end of the run, after training, when it
    # wrote the file (the code after the with block never ran there); the others did not
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    target = str(blocker / "traces" / "run.json")
    zero, one = dist_run(_trace_to, target, world_size=2)
    assert zero["error"][0] == "ValueError", zero
    assert f"trace={target!r}" in zero["error"][1] and "is a file" in zero["error"][1], zero
    assert one["error"][0] == "RuntimeError" and "rank 0" in one["error"][1], one
    assert target in one["error"][1], one


@pytest.mark.dist
def test_a_trace_that_cannot_be_written_at_the_end_warns(dist_run, tmp_path):
    # the directory's path became a file during the run: rank 0 warns, naming it, and the run ends
    # normally on every rank (the trace is lost, the training is not)
    where = str(tmp_path / "traces")
    zero, one = dist_run(_trace_to, where, where, world_size=2)
    assert zero["error"] is None and one["error"] is None, (zero, one)
    assert zero["written"] is None and len(zero["warnings"]) == 1, zero
    assert where in zero["warnings"][0] and "could not write the trace" in zero["warnings"][0]
    assert one["warnings"] == [], one
