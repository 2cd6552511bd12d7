"""Everything that needs a GPU, in one command: ``make gpu-check``.

On a machine with a CUDA GPU (a CUDA build of torch, and triton) it runs, each step's output
to ``perf/results/gpu/<step>.log`` and a summary to ``perf/results/gpu/summary.json``:

1. ``tests``: the CUDA tests (``pytest -m "cuda or compile"``: the Triton kernels on the
   device against the references, the compile tests);
2. ``pack``: ``perf/bench_pack.py`` with the Triton kernels timed by
   ``triton.testing.do_bench`` against ``torch.cat``, ``_foreach_copy_`` and DDP's
   per-parameter copy (``mul(out=)`` loop), same run;
3. ``step``: ``perf/bench_step.py --backend nccl``, tribucket against DDP (one rank a GPU,
   at most two);
4. ``kernels``: ``perf/kernel_report.py`` (the machine code of the kernels as compiled on
   this machine's triton);
5. ``moe``: ``perf/bench_moe.py --part grouped --device cuda``: the MoE experts' grouped
   matmul against the padded ``bmm`` and the loop of matmuls, per dtype, at the CPU's shapes
   and at DeepSeek-V3's, Mixtral's and Qwen3-MoE's (what ``impl="auto"`` should pick);
6. ``moe_layer``: ``perf/bench_moe.py --part layer --device cuda``: the whole MoE layer on
   one GPU against its compute floor (what routing, permutation and combine add).

Every step runs even if an earlier one failed; the exit status is 0 only if all passed.
Without a GPU it stops before running anything, with the reason.

    python perf/gpu_check.py                    # everything, to perf/results/gpu/
    python perf/gpu_check.py --only tests pack  # some steps
    python perf/gpu_check.py --dry-run          # print the commands
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "perf" / "results" / "gpu"
STEPS = ("tests", "pack", "step", "kernels", "moe", "moe_layer")


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()


def why_not(torch_module=None, import_module=None) -> str | None:
    """Why this machine cannot run the GPU check, or None when it can."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return "torch is not installed"
    torch = torch_module or torch
    if torch.version.cuda is None:
        return (f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None): "
                f"install a CUDA build of torch on a machine with an NVIDIA GPU, then re-run "
                f"`make gpu-check`")
    if not torch.cuda.is_available():
        return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU "
                f"(torch.cuda.is_available() is False): check the driver with nvidia-smi and "
                f"CUDA_VISIBLE_DEVICES")
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton does not import ({e}): pip install 'tribucket[triton]'"
    import importlib

    try:  # kernels/ is installed as tribucket.kernels: a bare checkout does not have it
        (import_module or importlib.import_module)("tribucket.kernels")
    except ImportError as e:
        return (f"tribucket.kernels does not import ({e}): install the checkout first "
                f"(pip install --no-deps -e . , or make venv)")
    return None


def plan(out: pathlib.Path, gpus: int, python: str = sys.executable) -> list[Step]:
    """The commands, in order (``gpus``: devices visible; the step benchmark uses <= 2)."""
    no_interpret = (("TRITON_INTERPRET", "0"),)  # the kernels must compile for the device
    return [
        Step("tests", (python, "-m", "pytest", "-p", "no:cacheprovider", "-m", "cuda or compile",
                       "-q", f"--junitxml={out / 'tests.xml'}"), no_interpret),
        Step("pack", (python, "perf/bench_pack.py", "--rounds", "9", "--threads", "1",
                      "--out", str(out)), no_interpret),
        Step("step", (python, "perf/bench_step.py", "--backend", "nccl", "--world",
                      str(max(1, min(2, gpus))), "--out", str(out)), no_interpret),
        Step("kernels", (python, "perf/kernel_report.py", "--out", str(out)), no_interpret),
        Step("moe", (python, "perf/bench_moe.py", "--part", "grouped", "--device", "cuda",
                     "--grouped-rounds", "5", "--results", str(out)), no_interpret),
        Step("moe_layer", (python, "perf/bench_moe.py", "--part", "layer", "--device", "cuda",
                           "--grouped-rounds", "7", "--results", str(out)), no_interpret),
    ]


def run(steps: list[Step], out: pathlib.Path) -> dict:
    """Run every step (logs to ``out/<name>.log``); the summary is also written to
    ``out/summary.json``."""
    out.mkdir(parents=True, exist_ok=True)
    summary = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "loadavg_before": os.getloadavg(), "steps": {}}
    for step in steps:
        t0 = time.time()
        with open(out / f"{step.name}.log", "w") as log:
            rc = subprocess.run(step.argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **dict(step.env)}).returncode
        summary["steps"][step.name] = {"returncode": rc, "seconds": round(time.time() - t0, 1),
                                       "command": " ".join(step.argv)}
        print(f"{step.name}: {'ok' if rc == 0 else f'FAILED (exit {rc})'} "
              f"-> {out / (step.name + '.log')}", flush=True)
    summary["loadavg_after"] = os.getloadavg()
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--only", nargs="+", choices=STEPS, help="run only these steps")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out)
    reason = why_not()
    gpus = 0 if reason else __import__("torch").cuda.device_count()
    steps = [s for s in plan(out, gpus) if not args.only or s.name in args.only]
    if args.dry_run:
        for s in steps:
            print(" ".join(f"{k}={v}" for k, v in s.env), " ".join(s.argv))
        return 0
    if reason:
        print(f"gpu-check: cannot run here: {reason}", file=sys.stderr)
        return 2
    summary = run(steps, out)
    return 0 if all(s["returncode"] == 0 for s in summary["steps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
