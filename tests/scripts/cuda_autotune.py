"""``bucket_cap_mb="auto"`` on a CUDA device, one NCCL rank: the tuner's figures hold the
device's whole backward.

Each backward also runs a device-side wait of about 20 ms (``torch.cuda._sleep``), which the
host only enqueues. Run by ``tests/test_cuda_autotune.py`` in its own process::

    python tests/scripts/cuda_autotune.py OUT_DIR

Writes ``OUT_DIR/result.json``: the wait's device time (``sleep_s``), the tuner's samples
and medians (seconds), the host's figure of each tuning step, the steps and the choice.
"""

from __future__ import annotations

import json
import pathlib
import sys

import torch
import torch.distributed as dist

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "perf")]
from bench_host_wait import sleep_cycles, sleep_ms  # noqa: E402
from models import batch, build, loss_of  # noqa: E402

import tribucket  # noqa: E402
from tribucket.ddp import autotune  # noqa: E402

#: caps scaled to the test MLP (a few KiB of gradients): several layouts to try
CAPS_MB = (0.001, 0.004, 0.1)
SLEEP_MS = 20.0


def main(out_dir: str) -> None:
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("nccl", init_method=f"file://{out / 'store'}", rank=0,
                            world_size=1, device_id=torch.device("cuda", 0))
    torch.cuda.set_device(0)
    cycles = sleep_cycles(SLEEP_MS)
    sleep_s = sleep_ms(cycles) / 1e3

    autotune.BUCKET_CAPS_MB = CAPS_MB
    model = build("mlp").cuda()
    # the device waits in each backward; the host only enqueues the wait
    next(model.parameters()).register_hook(lambda g: torch.cuda._sleep(cycles))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    host = []
    with tribucket.fused_bucketing(model, bucket_cap_mb="auto") as reducer:
        tuner = reducer._bw.tuner
        step = 0
        while not tuner.done and step < 60:
            loss_of(model(batch("mlp", 0, step).cuda())).backward()
            st = reducer.stats
            host.append(st.backward_compute_s + st.comm_exposed_s)
            opt.step()
            opt.zero_grad()
            step += 1
        torch.cuda.synchronize()
        result = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__,
                      sleep_s=sleep_s, samples=tuner.samples, medians=tuner.medians,
                      host_s=host, steps=step, done=tuner.done,
                      candidates=[list(c) for c in tuner.candidates],
                      choice=None if tuner.choice is None else list(tuner.choice))
    dist.destroy_process_group()
    (out / "result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
