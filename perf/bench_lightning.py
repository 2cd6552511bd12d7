"""A Lightning epoch of a small Hugging Face model: ``strategy="ddp"`` against
``strategy="tribucket"``, 2 gloo ranks, in one run.

Each rank trains GPT-2 built from a small config (random weights, dropout 0) as a
LightningModule with AdamW, for one epoch per fit, alternating the two strategies fit by fit
(``--rounds`` fits of each), so drift in machine load hits both alike. The figure is rank 0's
training-step time (from ``on_train_batch_start`` to ``on_train_batch_end``: forward,
backward with the gradient averaging, optimizer step), the median over the steps of every
round after the first ``--skip`` steps of each fit; the ratio is the median of the per-round
ratios of those medians.

    python perf/bench_lightning.py              # writes perf/results/lightning.{json,md,png}
    python perf/bench_lightning.py --rounds 3   # quicker
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from _bench import free_port  # noqa: E402
from _results import save  # noqa: E402

RESULTS = HERE / "results"
STRATEGIES = ["ddp", "tribucket"]
CONFIG = dict(vocab_size=2048, n_positions=64, n_embd=192, n_layer=4, n_head=4)
SEQ, BATCH, BATCHES = 64, 8, 24  # per rank and epoch


def _worker(rank: int, world: int, port: int, rounds: int, skip: int, out: str) -> None:
    # what torchrun would set: Lightning then starts no processes of its own
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0")
    torch.set_num_threads(1)
    import _torchvision

    _torchvision.ensure_importable()  # lightning imports torchvision (through torchmetrics)
    import lightning as L
    from transformers import GPT2Config, GPT2LMHeadModel

    import tribucket.lightning  # noqa: F401  (registers strategy="tribucket")

    class LM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = GPT2LMHeadModel(GPT2Config(**CONFIG, resid_pdrop=0.0, embd_pdrop=0.0,
                                                    attn_pdrop=0.0, bos_token_id=0,
                                                    eos_token_id=0))

        def forward(self, ids):
            return self.model(input_ids=ids, labels=ids).loss

        def training_step(self, batch, batch_idx):
            return self(batch[0])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class StepTimer(L.Callback):
        def __init__(self):
            self.times: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.times.append(time.perf_counter() - self.t0)

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randint(0, CONFIG["vocab_size"], (world * BATCH * BATCHES, SEQ), generator=g))
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, sampler=sampler)
    per_round: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    steps: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(rounds):
            for strategy in STRATEGIES:
                L.seed_everything(0, verbose=False)
                timer = StepTimer()
                trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=world,
                                    max_epochs=1, logger=False, enable_checkpointing=False,
                                    enable_progress_bar=False, enable_model_summary=False,
                                    default_root_dir=tmp, callbacks=[timer])
                trainer.fit(LM(), loader)
                kept = timer.times[skip:]
                per_round[strategy].append(statistics.median(kept))
                steps[strategy] += kept
    if rank == 0:
        params = sum(p.numel() for p in LM().parameters())
        import json

        pathlib.Path(out).write_text(json.dumps({
            "params": params, "per_round_median_s": per_round, "steps_s": steps,
            "lightning": L.__version__}))
    dist.barrier()


def markdown(res: dict) -> str:
    r = res["results"]
    med = r["median_s"]
    m = res["meta"]
    lines = ["| strategy | step time (median) | ratio to `ddp` |", "| --- | ---: | ---: |"]
    for s in STRATEGIES:
        ratio = "1.00x" if s == "ddp" else f"{r['ratio']:.2f}x"
        lines.append(f"| `strategy=\"{s}\"` | {med[s] * 1e3:.1f} ms | {ratio} |")
    return "\n".join(lines) + (
        f"\n\nOne Lightning epoch of GPT-2 ({r['params'] / 1e6:.1f} M parameters, "
        f"{r['batches']} batches of {r['batch']} x {r['seq']} tokens per rank), AdamW, "
        f"{m['world']} gloo ranks x 1 thread, {m['rounds']} fits of each strategy alternating; "
        f"median step time of rank 0 after the first {m['skip']} steps of each fit; the ratio is "
        f"the median of the per-fit ratios. Lightning {r['lightning']}, torch {m['torch']}, "
        f"{m['cpus']}-CPU {m['machine']}; 1-min load average {m['loadavg'][0]:.1f} at the start "
        "(a machine shared with other jobs).\n")


def plot(res: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = res["results"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, s in enumerate(STRATEGIES):
        ys = [t * 1e3 for t in r["per_round_median_s"][s]]
        ax.plot(range(1, len(ys) + 1), ys, "o-", label=f'strategy="{s}"', color=f"C{i}")
    ax.set_xlabel("fit (alternating)")
    ax.set_ylabel("median step time, ms")
    ax.set_title(f"Lightning epoch, GPT-2 {r['params'] / 1e6:.1f} M, 2 gloo ranks")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5, help="fits of each strategy")
    p.add_argument("--skip", type=int, default=3, help="warm-up steps dropped from each fit")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    loadavg = list(os.getloadavg())
    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "rank0.json"
        import json

        import torch.multiprocessing as mp

        mp.spawn(_worker, args=(world, free_port(), args.rounds, args.skip, str(path)),
                 nprocs=world)
        raw = json.loads(path.read_text())
    per = raw["per_round_median_s"]
    results = {
        "model": "gpt2", "params": raw["params"], "lightning": raw["lightning"],
        "seq": SEQ, "batch": BATCH, "batches": BATCHES,
        "median_s": {s: statistics.median(raw["steps_s"][s]) for s in STRATEGIES},
        "per_round_median_s": per, "all_s": raw["steps_s"],
        "ratio": statistics.median(t / d for t, d in zip(per["tribucket"], per["ddp"])),
    }
    meta = {"torch": torch.__version__, "machine": platform.machine(), "cpus": os.cpu_count(),
            "loadavg": loadavg, "world": world, "rounds": args.rounds, "skip": args.skip}
    save(args.out, "lightning", {"meta": meta, "results": results}, markdown, plot)


if __name__ == "__main__":
    main()
