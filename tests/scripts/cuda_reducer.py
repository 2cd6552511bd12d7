"""The reducer on a CUDA device, one NCCL rank: tribucket against torch DDP, then a traced run.

Run by ``tests/test_cuda_reducer.py`` in its own process (a NCCL process group per process)::

    python tests/scripts/cuda_reducer.py OUT_DIR

Writes ``OUT_DIR/result.json``: per variant, whether every gradient of every step equals
DDP's bit for bit (the fp32 wire, the fp16 hook, gradients as bucket views); per step whether
the device was still busy when backward returned (the status read late, at once, and DDP);
a missing gradient's error, one backward later; and the trace file of the traced run.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from models import batch, build, loss_of  # noqa: E402

import tribucket  # noqa: E402
from tribucket import hooks  # noqa: E402

STEPS = 3
SLEEP_CYCLES = 200_000_000  # torch.cuda._sleep: 100 ms at 2 GHz, more on slower clocks


def _busy_after_backward(wrap):
    """Per step, whether the device is still busy when ``loss.backward()`` returns, with
    SLEEP_CYCLES of device work queued in each backward (the first parameter's gradient)."""
    model = build("mlp").cuda()
    next(model.parameters()).register_hook(lambda g: torch.cuda._sleep(SLEEP_CYCLES))
    busy = []
    with wrap(model) as m:
        for step in range(5):
            loss_of(m(batch("mlp", 0, step).cuda())).backward()
            busy.append(not torch.cuda.current_stream().query())
            torch.cuda.synchronize()
            model.zero_grad()
    return busy


def _missing_at_step_1():
    """Steps done and the error when step 1's batch leaves ``branch`` without a gradient."""
    model = build("gated").cuda()
    done = []
    try:
        with tribucket.fused_bucketing(model, bucket_cap_mb=0.001):
            for step in range(4):
                x = torch.ones(4, 6, device="cuda")
                x[0, 0] = -1.0 if step == 1 else 1.0
                loss_of(model(x)).backward()
                model.zero_grad()
                done.append(step)
    except RuntimeError as e:
        return {"done": done, "message": str(e)}
    return {"done": done, "message": None}


def _grads(model, name, wrap):
    """Gradients of each step of ``model`` (on the GPU) trained under ``wrap``."""
    out = []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with wrap(model) as m:
        for step in range(STEPS):
            loss_of(m(batch(name, 0, step).cuda())).backward()
            out.append([p.grad.detach().clone().cpu() for p in model.parameters()])
            opt.step()
            opt.zero_grad()
    return out


class _Wrap:
    """``with wrap(model) as net:``: the model trained under DDP or tribucket, with a hook."""

    def __init__(self, hook=None, **kw):
        self.hook, self.kw = hook, kw

    def __call__(self, model):
        self.model = model
        return self


class _DDP(_Wrap):
    def __enter__(self):
        ddp = DDP(self.model, device_ids=[0], **self.kw)
        if self.hook is not None:
            ddp.register_comm_hook(None, self.hook)
        return ddp

    def __exit__(self, *exc):
        return False


class _Ours(_Wrap):
    def __enter__(self):
        self.cm = tribucket.fused_bucketing(self.model, **self.kw)
        reducer = self.cm.__enter__()
        if self.hook is not None:
            reducer.register_comm_hook(None, self.hook)
        return self.model

    def __exit__(self, *exc):
        return self.cm.__exit__(*exc)


def main(out_dir: str) -> None:
    out = pathlib.Path(out_dir)
    dist.init_process_group("nccl", init_method=f"file://{out / 'store'}", rank=0,
                            world_size=1, device_id=torch.device("cuda", 0))
    torch.cuda.set_device(0)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    for name in ("mlp", "transformer"):
        variants = {
            "fp32": (_Ours(bucket_cap_mb=0.01), _DDP(bucket_cap_mb=0.01)),
            "fp16 hook": (_Ours(hooks.fp16_compress_hook, bucket_cap_mb=0.01),
                          _DDP(default_hooks.fp16_compress_hook, bucket_cap_mb=0.01)),
            "bucket view": (_Ours(bucket_cap_mb=0.01, gradient_as_bucket_view=True),
                            _DDP(bucket_cap_mb=0.01, gradient_as_bucket_view=True)),
        }
        for label, (ours, ddp) in variants.items():
            a = _grads(build(name).cuda(), name, ours)
            b = _grads(build(name).cuda(), name, ddp)
            diff = max((x - y).abs().max().item() for sa, sb in zip(a, b)
                       for x, y in zip(sa, sb))
            same = all(torch.equal(x, y) for sa, sb in zip(a, b) for x, y in zip(sa, sb))
            result[f"{name} {label}"] = {"bit_identical": same, "max_abs_diff": diff}

    # the end-of-backward status is read one backward later: the host runs ahead
    ahead = {}
    for label, env in (("tribucket", None), ("tribucket immediate", "0")):
        os.environ.pop("TRIBUCKET_DEFERRED_STATUS", None)
        if env is not None:
            os.environ["TRIBUCKET_DEFERRED_STATUS"] = env
        ahead[label] = _busy_after_backward(_Ours())
    os.environ.pop("TRIBUCKET_DEFERRED_STATUS", None)
    ahead["DDP"] = _busy_after_backward(_DDP())
    result["host_runs_ahead"] = ahead
    result["missing_at_step_1"] = _missing_at_step_1()

    # traced: device spans from CUDA events next to the host spans
    from tribucket.trace import Tracer

    model = build("mlp").cuda()
    tracer = Tracer(str(out))
    tracer.device_spans = True  # (TRIBUCKET_TRACE_DEVICE=1 does the same)
    with tribucket.fused_bucketing(model, bucket_cap_mb=0.001, trace=tracer) as reducer:
        for step in range(STEPS):
            loss_of(model(batch("mlp", 0, step).cuda())).backward()
            model.zero_grad()
        result["buckets"] = len(reducer._bw.buckets)
    result["trace"] = reducer.trace_path
    torch.cuda.synchronize()
    dist.destroy_process_group()
    (out / "result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
