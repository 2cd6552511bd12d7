"""The reducer on a GPU (one NCCL rank, in its own process): gradients bit-identical to torch
DDP's with the fp32 wire, the fp16 hook and gradients as bucket views; a traced run whose
device spans (CUDA events) are ordered per bucket as the stream runs them. Skipped without a
CUDA device; ``make gpu-check`` runs it."""

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
