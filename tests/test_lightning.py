"""``Trainer(strategy="tribucket")`` and ``Fabric(strategy="tribucket")`` against
``strategy="ddp"`` on the same LightningModule, 2 gloo ranks.

The Trainers run on the suite's worker pool: the workers already hold an initialised
process group and ``LOCAL_RANK``/``RANK``/``WORLD_SIZE`` in their environment, which is how
Lightning recognises processes launched for it (as by torchrun), so it starts none and pays
no start-up per test. Each test trains the same module, from the same weights on the same
data, once with ``strategy="ddp"`` and once with ``strategy="tribucket"``, and compares the
parameters (and checkpoints) on every rank; the ranks must hold bit-identical parameters.

Tolerance: as in ``test_real_models.py``: on 2 ranks the averaged gradient is the same bits
under DDP and tribucket; clipping takes the norm in another summation order (a few fp32 ulps
of the clip factor), hence ``rtol=1e-5, atol=1e-6``; a habit that is not honoured (no
accumulation, no clipping, an unscaled gradient, a skipped step) moves parameters by about
the learning rate, 1e-2.

``sync_batchnorm=True`` is not here: torch's ``SyncBatchNorm`` runs only on GPUs (on the CPU
its forward raises under DDP and tribucket alike, and DDP refuses to wrap it).
"""

from __future__ import annotations

import hashlib
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import _torchvision

_torchvision.ensure_importable()  # lightning imports torchvision (through torchmetrics)

import lightning as L  # noqa: E402

import tribucket  # noqa: E402
import tribucket.lightning  # noqa: E402,F401  (registers strategy="tribucket")
from lightning.pytorch.callbacks import BaseFinetuning  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402
from tribucket.lightning import FusedBucketingStrategy  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-6)
LR = 1e-2
SAMPLES, BATCH = 22, 4  # 11 samples per rank: batches of 4, 4 and a last one of 3


def _data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, 8, generator=g)
    y = torch.randint(0, 4, (SAMPLES,), generator=g)
    return torch.utils.data.TensorDataset(x, y)


def _loader(seed: int = 0):
    """Each rank its half of the samples, in order, every epoch (Lightning keeps a
    DistributedSampler it is given; the one it would add shuffles)."""
    data = _data(seed)
    sampler = torch.utils.data.DistributedSampler(data, shuffle=False)
    return torch.utils.data.DataLoader(data, batch_size=BATCH, sampler=sampler)


class Net(L.LightningModule):
    """Linear + BatchNorm (a buffer to broadcast) + two heads; ``unused_head``: the second
    head gets no gradient. ``forward(x, y)`` is the loss, so a plain loop, Fabric and the
    Trainer all run it through the module's forward (where DDP and tribucket hook in)."""

    def __init__(self, manual: bool = False, clip: float | None = None, unused_head: bool = False):
        super().__init__()
        self.automatic_optimization = not manual
        self.clip, self.unused_head = clip, unused_head
        # no bias before the BatchNorm: its gradient would be rounding noise, which AdamW
        # turns into whole steps of either sign
        self.body = nn.Sequential(nn.Linear(8, 32, bias=False), nn.BatchNorm1d(32), nn.ReLU())
        self.head = nn.Linear(32, 4)
        self.other = nn.Linear(32, 4)

    def forward(self, x, y):
        h = self.body(x)
        loss = F.cross_entropy(self.head(h), y)
        if not self.unused_head:
            loss = loss + 0.1 * self.other(h).square().mean()
        return loss

    def training_step(self, batch, batch_idx):
        loss = self(*batch)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        self.manual_backward(loss)
        if self.clip is not None:
            self.clip_gradients(opt, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
        opt.step()
        opt.zero_grad()

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self(*batch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR)


def _trainer(strategy, tmp: str, **kwargs) -> L.Trainer:
    args = dict(accelerator="cpu", devices=2, max_epochs=2, logger=False,
                enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, default_root_dir=tmp, num_sanity_val_steps=0)
    args.update(kwargs)
    return L.Trainer(strategy=strategy, **args)


def _digest(module: nn.Module) -> str:
    h = hashlib.sha256()
    for t in module.parameters():
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _assert_same(mine: nn.Module, theirs: nn.Module, what: str, buffers: bool = True) -> None:
    rank = dist.get_rank()
    state = (lambda m: m.state_dict()) if buffers else (lambda m: dict(m.named_parameters()))
    for (name, a), b in zip(state(mine).items(), state(theirs).values()):
        if a.is_floating_point():
            torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{what}, rank {rank}: {name}: {m}")
        else:
            assert torch.equal(a, b), f"{what}, rank {rank}: {name} differs"


def _moved(module: nn.Module, init: dict) -> float:
    return max((p.detach() - init[n]).abs().max().item() for n, p in module.named_parameters())


def _fit_both(module_kwargs: dict, trainer_kwargs: dict, tribucket_strategy="tribucket",
              ddp_strategy="ddp") -> dict:
    """Fit a fresh Net under each strategy; compare; return digests and how far it moved."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        models = {}
        for name, strategy in (("ddp", ddp_strategy), ("tribucket", tribucket_strategy)):
            L.seed_everything(dist.get_rank() + 1, verbose=False)  # different init per rank:
            model = Net(**module_kwargs)                             # both broadcast rank 0's
            kwargs = dict(trainer_kwargs)
            if kwargs.get("plugins") == "16-mixed":  # a fresh scaler for each run
                kwargs["plugins"] = [MixedPrecision("16-mixed", "cpu")]
            trainer = _trainer(strategy, os.path.join(tmp, name), **kwargs)
            trainer.fit(model, _loader())
            models[name] = model
            out[f"{name}_steps"] = trainer.global_step
            out[f"{name}_digest"] = _digest(model)
            plugin = trainer.precision_plugin
            out[f"{name}_plugin"] = (type(plugin).__module__,
                                     type(getattr(plugin, "scaler", None)).__module__)
        # under manual optimization Lightning switches DDP's buffer broadcast off (its
        # forward redirection clears require_backward_grad_sync before DDP's post-forward),
        # so DDP's ranks keep their own BatchNorm statistics; tribucket broadcasts rank 0's
        # before every training forward as in automatic optimization: the parameters
        # agree, and the buffers on rank 0 (the source)
        buffers = not module_kwargs.get("manual") or dist.get_rank() == 0
        _assert_same(models["tribucket"], models["ddp"], f"{module_kwargs} {trainer_kwargs}",
                     buffers=buffers)
        L.seed_everything(0 + 1, verbose=False)  # rank 0's initial weights: both start there
        out["moved"] = _moved(models["tribucket"], {n: p.detach() for n, p in
                                                    Net(**module_kwargs).named_parameters()})
        assert isinstance(trainer.strategy, FusedBucketingStrategy)
    return out


def _check(results: list[dict]) -> None:
    assert results[0]["tribucket_digest"] == results[1]["tribucket_digest"], "ranks differ"
    assert results[0]["ddp_digest"] == results[1]["ddp_digest"], "DDP's ranks differ"
    assert results[0]["tribucket_steps"] == results[0]["ddp_steps"] > 0
    assert all(r["moved"] > LR / 2 for r in results), "the weights did not move"


_HABITS = {
    "plain": ({}, {}),
    "accumulate_grad_batches": ({}, dict(accumulate_grad_batches=2)),
    "gradient_clip_val": ({}, dict(gradient_clip_val=0.05)),
    "bf16-mixed": ({}, dict(precision="bf16-mixed")),
    # Lightning turns precision="16-mixed" into bf16 on the CPU; the plugin itself runs
    "16-mixed": ({}, dict(plugins="16-mixed")),
    "manual_optimization": (dict(manual=True, clip=0.05), {}),
}


@pytest.mark.dist
@pytest.mark.parametrize("habit", list(_HABITS))
def test_trainer_habit_like_ddp(dist_run, habit):
    module_kwargs, trainer_kwargs = _HABITS[habit]
    results = dist_run(_fit_both, module_kwargs, trainer_kwargs, timeout=180)
    _check(results)
    plugin, scaler = results[0]["tribucket_plugin"]
    assert plugin == "tribucket.lightning", "the precision plugin with the fused clip is not in use"
    if habit == "16-mixed":
        assert scaler == "tribucket.amp", f"the scaler is {scaler}'s, not tribucket.amp's"


@pytest.mark.dist
@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_find_unused_parameters_like_ddp(dist_run, manual):
    # manual optimization: the backward runs inside the wrapper's forward, whose output
    # (None) reaches no parameter; the unused ones are those the loss does not reach
    _check(dist_run(_fit_both, dict(unused_head=True, manual=manual), {},
                    "tribucket_find_unused_parameters_true", "ddp_find_unused_parameters_true",
                    timeout=180))


# ------------------------------------------------------------------------ checkpoints
def _checkpoint_resume(tmp: str) -> dict:
    """Fit 1 epoch with ModelCheckpoint, resume from its last.ckpt for a second, under each
    strategy: the checkpoints hold the same module state (no wrapper prefix), tribucket's
    also the reducer's; the resumed runs end where a 2-epoch run ends."""
    rank = dist.get_rank()
    out, models, ckpts = {}, {}, {}
    for name, strategy in (("ddp", "ddp"), ("tribucket", "tribucket")):
        root = os.path.join(tmp, name)
        L.seed_everything(rank + 1, verbose=False)
        model = Net()
        cb = L.pytorch.callbacks.ModelCheckpoint(dirpath=root, save_last=True)
        _trainer(strategy, root, max_epochs=1, enable_checkpointing=True,
                 callbacks=[cb]).fit(model, _loader())
        dist.barrier()
        ckpts[name] = torch.load(os.path.join(root, "last.ckpt"), weights_only=False)
        L.seed_everything(rank + 100, verbose=False)
        resumed = Net()  # other weights: everything must come from the checkpoint
        trainer = _trainer(strategy, root, max_epochs=2)
        trainer.fit(resumed, _loader(), ckpt_path=os.path.join(root, "last.ckpt"))
        models[name] = resumed
        out[f"{name}_digest"] = _digest(resumed)
        out[f"{name}_steps"] = trainer.global_step
    a, b = ckpts["tribucket"]["state_dict"], ckpts["ddp"]["state_dict"]
    assert list(a) == list(b), f"checkpoint keys differ: {list(a)[:3]} vs {list(b)[:3]}"
    for k in a:
        torch.testing.assert_close(a[k], b[k], **TOL, msg=lambda m: f"checkpoint {k}: {m}")
    assert tribucket.lightning.CHECKPOINT_KEY in ckpts["tribucket"]
    assert ckpts["tribucket"][tribucket.lightning.CHECKPOINT_KEY]["iterations"] > 0
    _assert_same(models["tribucket"], models["ddp"], "resumed")
    # and resuming is exact: a 2-epoch run without the checkpoint ends the same
    L.seed_everything(rank + 1, verbose=False)
    straight = Net()
    _trainer("tribucket", os.path.join(tmp, "straight"), max_epochs=2).fit(straight, _loader())
    _assert_same(models["tribucket"], straight, "resumed against uninterrupted")
    L.seed_everything(0 + 1, verbose=False)  # rank 0's initial weights: what training started from
    out["moved"] = _moved(straight, {n: p.detach() for n, p in Net().named_parameters()})
    return out


@pytest.mark.dist
def test_checkpoint_and_resume_like_ddp(dist_run):
    with tempfile.TemporaryDirectory() as tmp:
        _check(dist_run(_checkpoint_resume, tmp, timeout=180))


def _powersgd_state():
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    return psgd.powerSGD_hook, psgd.PowerSGDState(None, matrix_approximation_rank=1,
                                                  start_powerSGD_iter=2, random_seed=0)


def _resume_with_rank_state(tmp: str) -> dict:
    """PowerSGD (each rank's own error feedback): fit 1 epoch with ModelCheckpoint, resume
    from its last.ckpt for a second; the resumed run ends where a 2-epoch run ends."""
    rank = dist.get_rank()
    root = os.path.join(tmp, "psgd")
    L.seed_everything(rank + 1, verbose=False)
    model = Net()
    cb = L.pytorch.callbacks.ModelCheckpoint(dirpath=root, save_last=True)
    _trainer(FusedBucketingStrategy(*_powersgd_state()), root, max_epochs=1,
             enable_checkpointing=True, callbacks=[cb]).fit(model, _loader())
    dist.barrier()
    L.seed_everything(rank + 100, verbose=False)
    resumed = Net()
    trainer = _trainer(FusedBucketingStrategy(*_powersgd_state()), root, max_epochs=2)
    trainer.fit(resumed, _loader(), ckpt_path=os.path.join(root, "last.ckpt"))
    L.seed_everything(rank + 1, verbose=False)
    straight = Net()
    _trainer(FusedBucketingStrategy(*_powersgd_state()), os.path.join(tmp, "straight"),
             max_epochs=2).fit(straight, _loader())
    _assert_same(resumed, straight, "resumed against uninterrupted")
    L.seed_everything(0 + 1, verbose=False)
    return {"digest": _digest(resumed), "steps": trainer.global_step,
            "moved": _moved(straight, {n: p.detach() for n, p in Net().named_parameters()})}


@pytest.mark.dist
def test_resume_restores_each_ranks_hook_state(dist_run):
    # Lightning writes rank 0's checkpoint only: the strategy gathers every rank's own
    # reducer entries (PowerSGD's error feedback) into it, and each rank loads its own
    with tempfile.TemporaryDirectory() as tmp:
        results = dist_run(_resume_with_rank_state, tmp, timeout=180)
    assert results[0]["digest"] == results[1]["digest"], "ranks differ"
    assert results[0]["steps"] > 0
    assert all(r["moved"] > LR / 2 for r in results), "the weights did not move"


# ------------------------------------------------------------------------ validate
def _validate_every_rank() -> dict:
    """trainer.validate on every rank after fitting, under each strategy: the same metric."""
    metrics = {}
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in ("ddp", "tribucket"):
            L.seed_everything(dist.get_rank() + 1, verbose=False)
            model = Net()
            trainer = _trainer(strategy, tmp, max_epochs=1)
            trainer.fit(model, _loader())
            metrics[strategy] = trainer.validate(model, _loader(seed=1), verbose=False)[0]["val_loss"]
    torch.testing.assert_close(torch.tensor(metrics["tribucket"]), torch.tensor(metrics["ddp"]),
                               **TOL)
    return metrics


@pytest.mark.dist
def test_validate_on_every_rank_like_ddp(dist_run):
    results = dist_run(_validate_every_rank, timeout=180)
    assert results[0] == results[1]  # sync_dist: every rank reports the same mean


class _ValLosses(L.Callback):
    def __init__(self):
        self.values = []

    def on_validation_epoch_end(self, trainer, pl_module):
        self.values.append(float(trainer.callback_metrics["val_loss"]))


def _validate_during_fit() -> dict:
    """val_check_interval=2 on the BatchNorm model: the val_loss of each validation run
    inside fit, under each strategy (each rank evaluates with the buffers it holds)."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in ("ddp", "tribucket"):
            L.seed_everything(dist.get_rank() + 1, verbose=False)
            record = _ValLosses()
            _trainer(strategy, tmp, val_check_interval=2, callbacks=[record]).fit(
                Net(), _loader(), _loader(seed=1))
            out[strategy] = record.values
    return out


@pytest.mark.dist
def test_validation_during_fit_like_ddp(dist_run):
    # Lightning validates on every rank: the strategy broadcasts rank 0's buffers before a
    # validation that follows training, as DDP does (BatchNorm statistics)
    for values in dist_run(_validate_during_fit, timeout=180):
        assert len(values["ddp"]) >= 2
        torch.testing.assert_close(torch.tensor(values["tribucket"]),
                                   torch.tensor(values["ddp"]), **TOL)


# ------------------------------------------------------------------------ options, MoE
class MoENet(L.LightningModule):
    """A tribucket.moe.MoELayer between two dense layers (2 experts per rank)."""

    def __init__(self):
        super().__init__()
        import tribucket.moe

        world = dist.get_world_size()
        experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.inp = nn.Linear(8, 16)
        self.moe = tribucket.moe.MoELayer(experts, num_experts=2 * world, d_model=16, top_k=2)
        self.out = nn.Linear(16, 4)

    def forward(self, x, y):
        loss = F.cross_entropy(self.out(self.moe(self.inp(x))), y)
        return loss + tribucket.moe.aux_losses(self)

    def training_step(self, batch, batch_idx):
        return self(*batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR)


def _moe_resume(tmp: str) -> dict:
    """An MoE module (each rank its own experts): fit 1 epoch with ModelCheckpoint, resume
    from its last.ckpt for a second; the resumed run ends where a 2-epoch run ends, every
    rank's experts and expert moments restored (Lightning writes rank 0's file only)."""
    root = os.path.join(tmp, "moe")
    L.seed_everything(1, verbose=False)
    cb = L.pytorch.callbacks.ModelCheckpoint(dirpath=root, save_last=True)
    _trainer("tribucket", root, max_epochs=1, enable_checkpointing=True,
             callbacks=[cb]).fit(MoENet(), _loader())
    dist.barrier()
    saved = torch.load(os.path.join(root, "last.ckpt"), weights_only=False)["state_dict"]
    L.seed_everything(100, verbose=False)
    resumed = MoENet()  # other weights: everything must come from the checkpoint
    _trainer("tribucket", root, max_epochs=2).fit(resumed, _loader(),
                                                  ckpt_path=os.path.join(root, "last.ckpt"))
    L.seed_everything(1, verbose=False)
    straight = MoENet()
    _trainer("tribucket", os.path.join(tmp, "straight"), max_epochs=2).fit(straight, _loader())
    _assert_same(resumed, straight, "resumed against uninterrupted")
    return sorted(k for k in saved if k.startswith("moe."))


@pytest.mark.dist
def test_moe_checkpoint_holds_every_ranks_experts(dist_run):
    with tempfile.TemporaryDirectory() as tmp:
        keys = dist_run(_moe_resume, tmp, timeout=180)
    assert keys[0] == keys[1] and len(keys) > 0, keys


def _hand_written(model: nn.Module, hook, steps: int, clip=None, **options) -> None:
    """The loop the strategy stands for: fused_bucketing, the same batches, AdamW."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = _loader()
    with tribucket.fused_bucketing(model, **options) as reducer:
        if hook is not None:
            reducer.register_comm_hook(None, hook)
        for _ in range(steps):
            for x, y in loader:
                model(x, y).backward()
                opt.step()
                opt.zero_grad()


def _strategy_vs_loop(which: str) -> dict:
    """An instance with options (fp16 hook, a small bucket cap) and a MoE module, each
    against the hand-written fused_bucketing loop with the same options: the same bits."""
    rank = dist.get_rank()
    make = Net if which == "fp16" else MoENet
    kwargs = dict(bucket_cap_mb=0.001) if which == "fp16" else {}
    hook = tribucket.hooks.fp16_compress_hook if which == "fp16" else None
    L.seed_everything(1, verbose=False)  # MoE experts differ per rank by design: same seed
    model = make()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    with tempfile.TemporaryDirectory() as tmp:
        strategy = FusedBucketingStrategy(hook="fp16" if hook else None, **kwargs)
        _trainer(strategy, tmp).fit(model, _loader())
    L.seed_everything(1, verbose=False)
    reference = make()
    _hand_written(reference, hook, 2, **kwargs)
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(a, b), f"{which}, rank {rank}: {name} differs from the loop's"
    dense = [n for n, _ in model.named_parameters() if "experts" not in n]
    return {"dense": _digest(nn.ParameterList([p for n, p in model.named_parameters()
                                               if n in dense])),
            "moved": _moved(model, init)}


@pytest.mark.dist
@pytest.mark.parametrize("which", ["fp16", "moe"])
def test_strategy_instance_like_the_loop(dist_run, which):
    results = dist_run(_strategy_vs_loop, which, timeout=180)
    assert results[0]["dense"] == results[1]["dense"], "the ranks' dense parameters differ"
    assert all(r["moved"] > LR / 2 for r in results)


class _FinetuneNet(L.LightningModule):
    """A backbone frozen before training and unfrozen at epoch 1 (``_Unfreeze``), a head."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.head = nn.Linear(16, 4)

    def forward(self, x, y):
        h = self.backbone(x)
        return F.cross_entropy(self.head(h.to(self.head.weight.dtype)).float(), y)

    def training_step(self, batch, batch_idx):
        return self(*batch)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=LR)


class _Unfreeze(BaseFinetuning):
    def freeze_before_training(self, pl_module):
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module, epoch, optimizer):
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, lr=LR,
                                              initial_denom_lr=1.0)


def _unfreezing_loop(blocks, powersgd=None) -> nn.Module:
    """The loop a user writes for ``_Unfreeze``: a ``fused_bucketing`` block per entry of
    ``blocks`` (the epochs it runs), the backbone unfrozen and given a param group when
    epoch 1 starts a block; ``powersgd``: a PowerSGD state, its per-bucket memories started
    again there."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    L.seed_everything(1, verbose=False)
    reference = _FinetuneNet()
    reference.backbone.requires_grad_(False)
    opt = torch.optim.AdamW(reference.head.parameters(), lr=LR)
    for epochs in blocks:
        if epochs[0] == 1:
            reference.backbone.requires_grad_(True)
            opt.add_param_group({"params": list(reference.backbone.parameters()), "lr": LR})
            if powersgd is not None:
                for memory in (powersgd.error_dict, powersgd.p_memory_dict,
                               powersgd.q_memory_dict):
                    memory.clear()
        with tribucket.fused_bucketing(reference) as reducer:
            if powersgd is not None:
                reducer.register_comm_hook(powersgd, psgd.powerSGD_hook)
            for _ in epochs:
                for x, y in _loader():
                    reference(x, y).backward()
                    opt.step()
                    opt.zero_grad()
    return reference


def _fit_like_the_loop(strategy, blocks, powersgd=None) -> dict:
    """Three epochs with BaseFinetuning (``_Unfreeze``) under ``strategy``, then the same
    bits as :func:`_unfreezing_loop` with ``blocks`` (its entries of fused_bucketing) and
    ``powersgd``'s state; the model's digest."""
    rank = dist.get_rank()
    L.seed_everything(1, verbose=False)
    model = _FinetuneNet()
    with tempfile.TemporaryDirectory() as tmp:
        _trainer(strategy, tmp, max_epochs=3, callbacks=[_Unfreeze()]).fit(model, _loader())
    reference = _unfreezing_loop(blocks, powersgd)
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(a, b), f"rank {rank}: {name} differs from the loop's"
    return {"digest": _digest(model)}


def _progressive_unfreezing() -> dict:
    """Lightning's BaseFinetuning unfreezing the backbone at epoch 1 under the strategy,
    against the loop a user writes for it (leave fused_bucketing, unfreeze, add the param
    group, enter again): the same bits."""
    return _fit_like_the_loop("tribucket", ([0], [1], [2]))


@pytest.mark.dist
def test_progressive_unfreezing_with_base_finetuning(dist_run):
    # before, the strategy's reducer raised at the first forward after the unfreeze, telling
    # a Lightning user to leave fused_bucketing and enter it again ("ddp" drifts silently)
    results = dist_run(_progressive_unfreezing, timeout=180)
    assert results[0]["digest"] == results[1]["digest"], "the ranks' parameters differ"


class _FreezeMidWindow(L.Callback):
    """Freezes the (used) head at batch 1, inside an accumulation window of 2."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.current_epoch == 0 and batch_idx == 1:
            pl_module.head.requires_grad_(False)


def _frozen_inside_a_window(dtype: torch.dtype) -> dict:
    """A layer (of ``dtype``) frozen between two micro-batches of a window: under the
    strategy (which builds a new reducer there) against DDP with find_unused_parameters
    (whose reducer averages the window's gradient of the frozen layer)."""
    from _dist import tribucket_log

    out = {}
    with tribucket_log() as logged:
        for name in ("tribucket", "ddp_find_unused_parameters_true"):
            L.seed_everything(1, verbose=False)
            model = _FinetuneNet()
            model.head.to(dtype)
            with tempfile.TemporaryDirectory() as tmp:
                _trainer(name, tmp, accumulate_grad_batches=2,
                         callbacks=[_FreezeMidWindow()]).fit(model, _loader())
            out[name] = model
    for (name, a), b in zip(out["tribucket"].named_parameters(),
                            out["ddp_find_unused_parameters_true"].parameters()):
        assert torch.equal(a, b), f"{name} differs from DDP's: {(a - b).abs().max().item()}"
    # the strategy averaged the window's gradient itself: no warning about a stale one
    assert not [m for m in logged if "hold a .grad" in m], logged
    return {"digest": _digest(out["tribucket"])}


@pytest.mark.dist
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_a_layer_frozen_inside_an_accumulation_window(dist_run, dtype):
    # before, the rebuilt reducer left the frozen layer's no_sync gradient unaveraged and
    # each rank stepped its own (the ranks 0.02 apart); the first averaging went through
    # float32 (4.9e-10 off DDP's in float64, the imaginary part of a complex one dropped)
    results = dist_run(_frozen_inside_a_window, dtype, timeout=180)
    assert results[0]["digest"] == results[1]["digest"], "the ranks' parameters differ"


class _FreezeOnRankZero(L.Callback):
    """Freezes the head on rank 0 only, at batch 1 (a rank-local decision)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.current_epoch == 0 and batch_idx == 1 and trainer.global_rank == 0:
            pl_module.head.requires_grad_(False)


def _frozen_on_one_rank() -> str | None:
    """The strategy when one rank freezes a layer: the error each rank raised."""
    L.seed_everything(1, verbose=False)
    model = _FinetuneNet()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            _trainer("tribucket_find_unused_parameters_true", tmp,
                     callbacks=[_FreezeOnRankZero()]).fit(model, _loader())
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.dist
def test_a_layer_frozen_on_one_rank_is_named_on_every_rank(dist_run):
    # before, only rank 0 rebuilt its reducer: its collectives met rank 1's forward and
    # backward ones, and gloo aborted the process ('collective mismatch') or both waited out
    # the group's timeout
    for message in dist_run(_frozen_on_one_rank, timeout=120):
        assert message is not None and "differs across ranks" in message, message
        assert "head.weight" in message and "requires_grad" in message, message


def _unfreezing_powersgd_state():
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    return psgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                              start_powerSGD_iter=2, min_compression_rate=0.1)


def _unfreezing_with_powersgd() -> dict:
    """BaseFinetuning with the PowerSGD hook under the strategy, against the loop that
    re-enters with the same state, its per-bucket memories started again."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    strategy = FusedBucketingStrategy(hook=psgd.powerSGD_hook,
                                      hook_state=_unfreezing_powersgd_state())
    # one block before the unfreezing, one after (as the strategy's one rebuild)
    return _fit_like_the_loop(strategy, ([0], [1, 2]), _unfreezing_powersgd_state())


@pytest.mark.dist
def test_progressive_unfreezing_with_powersgd(dist_run):
    # before, the rebuilt reducer met PowerSGD's error feedback sized for the old buckets:
    # 'The size of tensor a (232) must match the size of tensor b (88)'
    results = dist_run(_unfreezing_with_powersgd, timeout=180)
    assert results[0]["digest"] == results[1]["digest"], "the ranks' parameters differ"


def _resume_after_unfreezing(tmp: str) -> dict:
    """Two epochs with BaseFinetuning (the reducer rebuilt at epoch 1) and a checkpoint,
    then fit(ckpt_path=...) for a third."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    L.seed_everything(1, verbose=False)
    model = _FinetuneNet()
    ckpt = ModelCheckpoint(dirpath=os.path.join(tmp, "ck"), save_last=True)
    _trainer("tribucket", tmp, callbacks=[_Unfreeze(), ckpt],
             enable_checkpointing=True).fit(model, _loader())
    L.seed_everything(1, verbose=False)
    resumed = _FinetuneNet()
    _trainer("tribucket", tmp, max_epochs=3, callbacks=[_Unfreeze()]).fit(
        resumed, _loader(), ckpt_path=os.path.join(tmp, "ck", "last.ckpt"))
    return {"digest": _digest(resumed), "moved": _moved(resumed, {
        n: p.detach() for n, p in model.named_parameters()})}


@pytest.mark.dist
def test_resume_after_a_rebuild(dist_run, tmp_path):
    # before, the checkpoint's reducer state (saved for the unfrozen set) was refused by the
    # reducer built on resume, with the backbone frozen again: 'the saved reducer state is
    # for other parameters: 6 saved, 4 here'
    results = dist_run(_resume_after_unfreezing, str(tmp_path), timeout=240)
    assert results[0]["digest"] == results[1]["digest"], "the ranks' parameters differ"
    assert all(r["moved"] > 0 for r in results)


# ------------------------------------------------------------------------ Fabric
def _fabric_run(strategy: str, accumulate: int, clip: float | None, precision: str) -> nn.Module:
    fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=2, precision=precision)
    fabric.launch()  # processes already launched: returns at once
    L.seed_everything(fabric.global_rank + 1, verbose=False)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    model, opt = fabric.setup(net, opt)
    loader = fabric.setup_dataloaders(_loader())
    for _ in range(2):
        for i, batch in enumerate(loader):
            last = (i + 1) % accumulate == 0 or i == len(loader) - 1
            with fabric.no_backward_sync(model, enabled=not last):
                fabric.backward(model(*batch) / accumulate, model=model)
            if last:
                if clip is not None:
                    fabric.clip_gradients(model, opt, max_norm=clip)
                opt.step()
                opt.zero_grad()
    return net


def _fabric_moe_resume(path: str) -> bool:
    """An MoE module under Fabric: 2 steps, fabric.save, 2 more; a fresh module and
    optimizer fabric.load-ed from the file then take the same 2 steps: whether they end
    equal (each rank's experts and their moments restored from rank 0's file)."""
    fabric = L.Fabric(strategy="tribucket", accelerator="cpu", devices=2)
    fabric.launch()
    batches = list(_loader())[:4]

    def steps(model, opt, part):
        for batch in part:
            fabric.backward(model(*batch))
            opt.step()
            opt.zero_grad()

    L.seed_everything(1, verbose=False)
    net = MoENet()
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=LR))
    steps(model, opt, batches[:2])
    fabric.save(path, {"model": model, "opt": opt})
    steps(model, opt, batches[2:])
    L.seed_everything(100, verbose=False)
    fresh = MoENet()
    model2, opt2 = fabric.setup(fresh, torch.optim.AdamW(fresh.parameters(), lr=LR))
    fabric.load(path, {"model": model2, "opt": opt2})
    steps(model2, opt2, batches[2:])
    return all(torch.equal(a, b) for a, b in zip(net.parameters(), fresh.parameters()))


@pytest.mark.dist
def test_fabric_moe_checkpoint_resumes(dist_run, tmp_path):
    assert dist_run(_fabric_moe_resume, str(tmp_path / "moe.ckpt"), timeout=180) == [True] * 2


def _fabric_both(accumulate: int, clip: float | None, precision: str) -> dict:
    ddp = _fabric_run("ddp", accumulate, clip, precision)
    mine = _fabric_run("tribucket", accumulate, clip, precision)
    _assert_same(mine, ddp, f"fabric accumulate={accumulate} clip={clip} {precision}")
    L.seed_everything(0 + 1, verbose=False)  # rank 0's initial weights: what both started from
    init = {n: p.detach() for n, p in Net().named_parameters()}
    return {"tribucket_digest": _digest(mine), "ddp_digest": _digest(ddp),
            "moved": _moved(mine, init), "tribucket_steps": 1, "ddp_steps": 1}


@pytest.mark.dist
@pytest.mark.parametrize("accumulate,clip,precision", [(1, None, "32-true"), (2, 0.05, "32-true"),
                                                       (1, 0.05, "bf16-mixed")])
def test_fabric_like_ddp(dist_run, accumulate, clip, precision):
    _check(dist_run(_fabric_both, accumulate, clip, precision, timeout=180))


# ------------------------------------------------------------------------ bad input
def test_bad_options_are_named():
    with pytest.raises(ValueError, match="hook='fp8'"):
        FusedBucketingStrategy(hook="fp8")
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        FusedBucketingStrategy(bucket_cap_mb=-1)
    # Lightning builds a plain optimizer in configure_optimizers: the shards would go unused
    with pytest.raises(ValueError, match="shard_optimizer=True.*configure_optimizers"):
        FusedBucketingStrategy(shard_optimizer=True)
