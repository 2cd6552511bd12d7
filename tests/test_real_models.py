"""Models users bring, against torch DDP on 2 gloo ranks.

Hugging Face ``transformers`` models (GPT-2 with tied embeddings, BERT with an MLM head and an
unused pooler, T5 with encoder/decoder/head sharing one embedding, Mixtral with stacked
experts, Switch Transformers with one module per expert), torchvision's resnet18 (BatchNorm
buffers; also with SyncBatchNorm) and timm's ViT (stochastic depth), all built from tiny
configs with random weights (no downloads, dropout 0). Each trains a few AdamW steps with
DDP and with ``fused_bucketing``, from the same weights, the same options and the same data
(different on each rank), in four patterns:

* ``plain``: one backward per step;
* ``no_sync``: two micro-batches per step, the first under ``no_sync()`` (accumulation);
* ``clip``: ``tribucket.clip_grad_norm_`` against ``torch.nn.utils.clip_grad_norm_``;
* ``fp16``: tribucket's fused fp16 hook against DDP + torch's ``fp16_compress_hook``; the two
  round differently (tribucket divides by the world size before the cast, torch after), so
  each is measured against the fp32 run of the same model and tribucket's must not be the
  farther one.

Tolerance of the fp32 patterns: on 2 ranks the averaged gradient is ``(a + b) / 2`` in both
(one fp32 addition, an exact halving: the same bits whatever the bucket boundaries), so
``plain`` and ``no_sync`` match DDP to the bit; ``clip`` takes the norm in another summation
order (per bucket, then across buckets) than torch's ``_foreach_norm``, which moves the clip
factor by a few fp32 ulps, and AdamW carries that into the weights at about the same relative
size. ``rtol=1e-5, atol=1e-6`` is that rounding with a margin (AdamW's step is ``lr * m /
sqrt(v)``: a relative change of the gradient of 1e-7 changes it by about as much, far below
1e-5 after a few steps); anything structural (a gradient not averaged, averaged twice, a
missing clip) moves parameters by ``lr = 1e-2`` or more. Ranks must hold bit-identical
parameters in every pattern.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import math
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import _torchvision
import tribucket

_torchvision.ensure_importable()  # before transformers, timm or torchvision is imported

STEPS = 3
LR = 1e-2
FP32_TOL = dict(rtol=1e-5, atol=1e-6)
PATTERNS = ("plain", "no_sync", "clip", "fp16")


# ------------------------------------------------------------------------ the models
def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_layer=2,
                                      n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=0, eos_token_id=0))


def _bert_config():
    from transformers import BertConfig

    return BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=64, max_position_embeddings=16,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _bert_mlm():
    """BERT with an MLM head whose encoder keeps the pooler ``BertModel`` builds by default:
    the pooler runs in every forward and feeds nothing the loss reads."""
    from transformers import BertForMaskedLM
    from transformers.models.bert.modeling_bert import BertPooler

    model = BertForMaskedLM(_bert_config())
    model.bert.pooler = BertPooler(model.config)
    return model


def _bert_pretraining():
    """BERT's two pre-training heads (MLM and next sentence), trained on the MLM loss only:
    the forward returns both heads' logits, the loss uses one."""
    from transformers import BertForPreTraining

    return BertForPreTraining(_bert_config())


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(
        vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=2,
        relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0))


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=16, output_router_logits=True,
        attention_dropout=0.0, bos_token_id=0, eos_token_id=0))


def _switch():
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    return SwitchTransformersForConditionalGeneration(SwitchTransformersConfig(
        vocab_size=96, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
        num_heads=2, num_experts=4, expert_capacity=6, encoder_sparse_step=1,
        decoder_sparse_step=1, relative_attention_num_buckets=8, dropout_rate=0.0,
        router_jitter_noise=0.0, decoder_start_token_id=0, output_router_logits=True))


def _resnet18():
    import torchvision

    return torchvision.models.resnet18(num_classes=10)


def _vit():
    import timm

    # ViT-tiny's width and heads (192, 3) on 32x32 images in 8x8 patches, 2 of its 12 blocks
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32,
                             patch_size=8, depth=2, num_classes=10, drop_path_rate=0.2)


def _tokens(g, rows, cols, vocab=96):
    return torch.randint(1, vocab, (rows, cols), generator=g)


def _lm_batch(g):
    ids = _tokens(g, 2, 12)
    return dict(input_ids=ids, labels=ids)


def _mlm_batch(g):
    ids = _tokens(g, 2, 12)
    labels = torch.where(torch.rand(ids.shape, generator=g) < 0.3, ids, -100)
    labels[:, 0] = ids[:, 0]  # at least one masked position per row
    return dict(input_ids=ids, labels=labels)


def _seq2seq_batch(g):
    return dict(input_ids=_tokens(g, 2, 10), labels=_tokens(g, 2, 6))


def _image_batch(g):
    return dict(x=torch.randn(4, 3, 32, 32, generator=g), y=torch.randint(0, 10, (4,), generator=g))


def _hf_loss(model, batch):
    return model(**batch).loss


def _mlm_head_loss(model, batch):
    """The loss on the MLM head's logits only (the next-sentence logits are returned too)."""
    logits = model(input_ids=batch["input_ids"]).prediction_logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))


def _image_loss(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"])


@dataclasses.dataclass(frozen=True)
class Case:
    build: Callable
    batch: Callable
    loss: Callable
    #: what DDP needs for this model; tribucket gets exactly the same
    options: dict = dataclasses.field(default_factory=dict)


MODELS = {
    "gpt2": Case(_gpt2, _lm_batch, _hf_loss),
    "bert-mlm": Case(_bert_mlm, _mlm_batch, _hf_loss, dict(find_unused_parameters=True)),
    "t5": Case(_t5, _seq2seq_batch, _hf_loss),
    "mixtral": Case(_mixtral, _lm_batch, _hf_loss),
    # an expert that no token of a batch picks gets no gradient in that backward
    "switch": Case(_switch, _seq2seq_batch, _hf_loss, dict(find_unused_parameters=True)),
    "resnet18": Case(_resnet18, _image_batch, _image_loss),
    "vit": Case(_vit, _image_batch, _image_loss),
    "bert-pretraining": Case(_bert_pretraining, _mlm_batch, _mlm_head_loss,
                             dict(find_unused_parameters=True)),
}


# ------------------------------------------------------------------------ training
def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _digest(model) -> str:
    """The bytes of every parameter: equal digests are bit-identical parameters (buffers such
    as BatchNorm's running statistics hold each rank's last batch, under DDP as here)."""
    h = hashlib.sha256()
    for t in model.parameters():
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class _Run:
    """One model in training: DDP (``ddp=True``) or fused_bucketing, with a pattern's hook."""

    def __init__(self, case, init, ddp, pattern, options, stack):
        self.case, self.pattern = case, pattern
        self.model = copy.deepcopy(init)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)
        if ddp:
            self.front = self.wrapper = DDP(self.model, **options)
            if pattern == "fp16":
                self.wrapper.register_comm_hook(None, default_hooks.fp16_compress_hook)
            self.clip = torch.nn.utils.clip_grad_norm_
        else:
            self.wrapper = stack.enter_context(tribucket.fused_bucketing(self.model, **options))
            self.front = self.model
            if pattern == "fp16":
                self.wrapper.register_comm_hook(None, tribucket.hooks.fp16_compress_hook)
            self.clip = tribucket.clip_grad_norm_

    def step(self, rank: int, step: int, forward: Callable | None = None) -> None:
        micro = 2 if self.pattern == "no_sync" else 1
        for m in range(micro):
            g = torch.Generator().manual_seed(1000 * rank + 10 * step + m)
            batch = self.case.batch(g)
            torch.manual_seed(1000 * rank + 10 * step + m)  # drop-path, routing noise: the same
            local = m < micro - 1
            with self.wrapper.no_sync() if local else contextlib.nullcontext():
                loss = self.case.loss(forward or self.front, batch)
                (loss / micro).backward()
        if self.pattern == "clip":
            self.clip(self.model.parameters(), max_norm=0.05)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def _train_pair(name: str, pattern: str, steps: int = STEPS) -> dict:
    """Train ``name`` under DDP and under fused_bucketing with ``pattern``; compare on this
    rank; return what the ranks must agree on and the fp16 distances."""
    rank = dist.get_rank()
    case = MODELS[name]
    torch.manual_seed(0)
    init = case.build().train()
    out = {}
    with contextlib.ExitStack() as stack:
        runs = {"ddp": _Run(case, init, True, pattern, case.options, stack),
                "tribucket": _Run(case, init, False, pattern, case.options, stack)}
        if pattern == "fp16":  # the fp32 run both are measured against
            runs["fp32"] = _Run(case, init, True, "plain", case.options, stack)
        for step in range(steps):
            for run in runs.values():
                run.step(rank, step)
        mine, theirs = _flat(runs["tribucket"].model), _flat(runs["ddp"].model)
        if pattern == "fp16":
            ref = _flat(runs["fp32"].model)
            moved = (ref - _flat(init)).norm().item()
            out["distance"] = {k: (_flat(runs[k].model) - ref).norm().item() / moved
                               for k in ("tribucket", "ddp")}
        else:
            for (pname, a), b in zip(runs["tribucket"].model.named_parameters(),
                                     runs["ddp"].model.parameters()):
                torch.testing.assert_close(
                    a, b, **FP32_TOL,
                    msg=lambda m: f"{name}, {pattern}, rank {rank}: {pname} differs from DDP: {m}")
            for (bname, a), b in zip(runs["tribucket"].model.named_buffers(),
                                     runs["ddp"].model.buffers()):
                assert torch.equal(a, b), f"{name}, {pattern}, rank {rank}: buffer {bname} differs"
            out["max_abs_diff"] = (mine - theirs).abs().max().item()
        out["moved"] = (mine - _flat(init)).abs().max().item()
        out["digest"] = {k: _digest(r.model) for k, r in runs.items()}
    return out


def _check_ranks(results: list[dict], name: str, pattern: str) -> None:
    for key in results[0]["digest"]:
        digests = [r["digest"][key] for r in results]
        assert len(set(digests)) == 1, f"{name}, {pattern}: the ranks' {key} models differ"
    # the steps changed the weights: a run that trained nothing would compare equal too
    assert all(r["moved"] > LR / 2 for r in results), f"{name}, {pattern}: weights did not move"


_FP32_CASES = [(m, p) for m in MODELS if m != "bert-pretraining" for p in PATTERNS if p != "fp16"]


@pytest.mark.dist
@pytest.mark.parametrize("name,pattern", _FP32_CASES, ids=[f"{m}-{p}" for m, p in _FP32_CASES])
def test_trains_like_ddp(dist_run, name, pattern):
    results = dist_run(_train_pair, name, pattern, timeout=180)
    _check_ranks(results, name, pattern)


@pytest.mark.dist
@pytest.mark.parametrize("name", [m for m in MODELS if m != "bert-pretraining"])
def test_fp16_hook_no_farther_from_fp32_than_ddp(dist_run, name):
    """Both fp16 runs drift from the fp32 one (AdamW turns rounding of small gradients into
    whole steps); tribucket's drift, relative to how far the fp32 run moved, must not
    exceed DDP + torch's fp16 hook's."""
    results = dist_run(_train_pair, name, "fp16", timeout=180)
    _check_ranks(results, name, "fp16")
    d = results[0]["distance"]
    assert d["tribucket"] <= d["ddp"], (
        f"{name}: tribucket's fp16 run is {d['tribucket']:.3g} from the fp32 run, DDP + torch's "
        f"fp16 hook's {d['ddp']:.3g}")


@pytest.mark.dist
def test_outputs_the_loss_does_not_use(dist_run):
    """BERT's pre-training heads with the loss on the MLM head only, find_unused_parameters:
    DDP trains and leaves the next-sentence head and the pooler alone; so must tribucket."""
    results = dist_run(_train_pair, "bert-pretraining", "plain", timeout=180)
    _check_ranks(results, "bert-pretraining", "plain")


# ------------------------------------------------------------------------ torch.compile
def _compiled_vs_ddp(steps: int = STEPS) -> dict:
    """GPT-2 under ``torch.compile`` inside fused_bucketing against eager DDP. The
    ``aot_eager`` backend traces forward and backward as inductor does but runs the traced
    ops eagerly (no C++ code generation: seconds instead of a minute on this CPU)."""
    rank = dist.get_rank()
    case = MODELS["gpt2"]
    torch.manual_seed(0)
    init = case.build().train()
    torch._dynamo.reset()
    with contextlib.ExitStack() as stack:
        ddp = _Run(case, init, True, "plain", {}, stack)
        mine = _Run(case, init, False, "plain", {}, stack)
        compiled = torch.compile(mine.model, backend="aot_eager")
        for step in range(steps):
            ddp.step(rank, step)
            mine.step(rank, step, forward=compiled)
        for (pname, a), b in zip(mine.model.named_parameters(), ddp.model.parameters()):
            torch.testing.assert_close(a, b, **FP32_TOL,
                                       msg=lambda m: f"compiled gpt2, rank {rank}: {pname}: {m}")
        return {"digest": {"tribucket": _digest(mine.model), "ddp": _digest(ddp.model)},
                "moved": (_flat(mine.model) - _flat(init)).abs().max().item(),
                "iterations": mine.wrapper.stats.iterations}


@pytest.mark.dist
def test_torch_compile_gpt2_like_eager_ddp(dist_run):
    results = dist_run(_compiled_vs_ddp, timeout=240)
    _check_ranks(results, "gpt2 compiled", "plain")
    assert [r["iterations"] for r in results] == [STEPS, STEPS]


def test_every_model_is_in_a_test():
    """A model added to MODELS runs in the fp32 patterns and the fp16 comparison."""
    covered = {m for m, _ in _FP32_CASES}
    assert covered | {"bert-pretraining"} == set(MODELS)
    assert math.isfinite(FP32_TOL["rtol"])
