"""The reducer on a GPU (one NCCL rank, in its own process): gradients bit-identical to torch
DDP's with the fp32 wire, the fp16 hook and gradients as bucket views; the host not waiting
for the device at the end of backward, and a missing gradient raised one backward later; a
traced run whose device spans (CUDA events) are ordered per bucket as the stream runs them.
Skipped without a CUDA device; ``make gpu-check`` runs it."""

from __future__ import annotations

import pytest

from _cuda import MARKS, run_script
from tribucket import trace

pytestmark = MARKS


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return run_script("cuda_reducer.py", tmp_path_factory.mktemp("cuda_reducer"))


@pytest.mark.parametrize("model", ["mlp", "transformer"])
@pytest.mark.parametrize("variant", ["fp32", "fp16 hook", "bucket view"])
def test_gradients_equal_ddp_on_the_gpu(result, model, variant):
    r = result[f"{model} {variant}"]
    assert r["bit_identical"], f"{model} {variant}: max |diff| {r['max_abs_diff']}"


def test_the_host_runs_ahead_of_the_device_after_backward(result):
    """With 100 ms of device work in each backward, the device is still busy when backward
    returns, as with DDP: the status is read one backward later (``deferred_status``, the
    default on a GPU). Read at once, the host waits for the device there. Only the first
    backward waits: it rebuilds the layout, which reads the status at once. The second, the
    first with the rebuilt layout, copies its pack tables to the device through pinned
    memory, so it does not wait either (this runs after the variants above: in a fresh
    process the first launch of a kernel can still wait, as CUDA loads kernels lazily)."""
    r = result["host_runs_ahead"]
    assert r["DDP"][1:] == [True] * 4, r
    assert r["tribucket"][1:] == [True] * 4, r
    assert r["tribucket immediate"] == [False] * 5, r


def test_a_missing_gradient_raises_one_backward_later_on_the_gpu(result):
    r = result["missing_at_step_1"]
    assert r["done"] == [0, 1], r
    assert "in backward iteration 2, reported at backward iteration 3" in r["message"], r
    assert "received no gradient" in r["message"] and "branch.weight" in r["message"], r


def test_device_spans_ordered_per_bucket(result):
    doc = trace.load(result["trace"])
    trace.validate(doc)
    lanes = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"]
             if e.get("ph") == "M" and e["name"] == "thread_name"}
    spans = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    last = max(e["args"]["step"] for e in spans if e["name"] == "backward")
    dev = {(lanes[e["tid"]], e["name"]): e for e in spans if e["args"].get("step") == last
           and lanes[e["tid"]] in (trace.DEVICE, trace.DEVICE_COMM)}
    for b in range(result["buckets"]):
        pack = dev[(trace.DEVICE, f"bucket{b}.pack")]
        coll = dev[(trace.DEVICE_COMM, f"bucket{b}.allreduce")]
        unpack = dev[(trace.DEVICE, f"bucket{b}.unpack")]
        end = lambda e: e["ts"] + e["dur"]  # noqa: E731
        # the stream runs pack, then the collective waits for it; unpack waits for the
        # collective (µs, rounded to 1 in the file; CUDA events resolve ~0.5 µs)
        assert pack["ts"] <= end(pack) <= coll["ts"] + 1, (b, pack, coll)
        assert coll["ts"] <= end(coll) <= unpack["ts"] + 2, (b, coll, unpack)
        assert pack["dur"] > 0 and unpack["dur"] > 0
