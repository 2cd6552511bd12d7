"""Models users bring, against torch DDP on 2 gloo ranks.

Hugging Face ``transformers`` models (GPT-2 with tied embeddings, BERT with an MLM head and an
unused pooler, BERT's two pre-training heads with a loss on one, T5 with encoder, decoder and
head sharing one embedding, Mixtral with stacked experts, Switch Transformers with one module
per expert), torchvision's resnet18 (BatchNorm buffers) and timm's ViT (stochastic depth), all
built from tiny configs with random weights (no downloads, dropout 0). Each trains a few steps
with DDP and with ``fused_bucketing``, from the same weights, with the options DDP needs and
the same ones for tribucket, on the same data (different on each rank), in these patterns:

* ``plain``: one backward per step, AdamW;
* ``no_sync``: two micro-batches per step, the first under ``no_sync()`` (accumulation);
* ``clip``: ``tribucket.clip_grad_norm_`` against ``torch.nn.utils.clip_grad_norm_``, with
  SGD (AdamW's step hardly changes when every gradient is scaled alike, so it would hide a
  wrong clip factor);
* ``fp16``: tribucket's fused fp16 hook against DDP + torch's ``fp16_compress_hook``; the two
  round differently (tribucket divides by the world size before the cast, torch after), so
  each is measured against DDP's fp32 run and tribucket's must not be the farther one (by more
  than 10%: where the model amplifies either rounding alike, the two drifts are the same size);
* ``torch.compile`` (``aot_eager``) of GPT-2 inside ``fused_bucketing`` against eager DDP.

Tolerance, ``rtol=1e-5, atol=1e-6`` on parameters: on 2 ranks the averaged
gradient is ``(a + b) / 2`` under both (one fp32 addition and an exact halving, the same
bits whatever the bucket boundaries), so ``plain`` and ``no_sync`` match DDP to the bit.
``clip``: tribucket forms the total norm as torch's clip does (one norm per gradient, stacked
in the parameters' order), so the norms it returns must equal torch's to the bit.
Anything structural (a gradient not averaged, averaged twice, not clipped) moves parameters
by about the learning rate. Floating buffers (BatchNorm statistics) are computed from those
parameters and compared with ``rtol=1e-4, atol=1e-5``: resnet18's last stage normalises a
batch of 4 at 1x1 pixels, which multiplies a last-digit difference of the parameters. Ranks
must hold bit-identical parameters in every pattern (buffers hold each rank's last batch,
under DDP too).

SyncBatchNorm is not here: torch's runs only on GPUs (on the CPU DDP refuses to wrap it and
its forward raises, with tribucket as without).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
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
# every model's gradient norm stays above 0.1: every step clips; a small SGD step, so that the
# trajectories (BatchNorm over 4 samples is ill-conditioned) do not amplify the last digits
CLIP, CLIP_LR = 0.1, 1e-2
FP16_MARGIN = 1.1
FP32_TOL = dict(rtol=1e-5, atol=1e-6)
BUFFER_TOL = dict(rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------ the models
def _gpt2(layers: int = 2):
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_layer=layers,
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

    # ViT-tiny's width and heads (192, 3) on 16x16 images in 4x4 patches, 2 of its 12 blocks
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16,
                             patch_size=4, depth=2, num_classes=10, drop_path_rate=0.2)


def _tokens(g, rows, cols, vocab=96):
    return torch.randint(1, vocab, (rows, cols), generator=g)


def _lm_batch(g, step):
    ids = _tokens(g, 2, 12)
    return dict(input_ids=ids, labels=ids)


def _mlm_batch(g, step):
    ids = _tokens(g, 2, 12)
    labels = torch.where(torch.rand(ids.shape, generator=g) < 0.3, ids, -100)
    labels[:, 0] = ids[:, 0]  # at least one masked position per row
    return dict(input_ids=ids, labels=labels)


def _seq2seq_batch(g, step):
    return dict(input_ids=_tokens(g, 2, 10), labels=_tokens(g, 2, 6))


def _switch_batch(g, step):
    """One token in and one out in the first step: each sparse layer routes it to one of
    its 4 experts, so most experts get their first gradient in a later step."""
    if step == 0:
        return dict(input_ids=_tokens(g, 1, 1), labels=_tokens(g, 1, 1))
    return _seq2seq_batch(g, step)


def _image_batch(g, step):
    return dict(x=torch.randn(4, 3, 16, 16, generator=g), y=torch.randint(0, 10, (4,), generator=g))


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
    "switch": Case(_switch, _switch_batch, _hf_loss, dict(find_unused_parameters=True)),
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
        # clipping is checked with SGD: AdamW's step does not change when every gradient
        # is scaled alike, so it would hide a wrong clip factor
        self.opt = (torch.optim.SGD(self.model.parameters(), lr=CLIP_LR) if pattern == "clip"
                    else torch.optim.AdamW(self.model.parameters(), lr=LR))
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
        self.norms: list[float] = []

    def step(self, rank: int, step: int, forward: Callable | None = None) -> None:
        micro = 2 if self.pattern == "no_sync" else 1
        for m in range(micro):
            g = torch.Generator().manual_seed(1000 * rank + 10 * step + m)
            batch = self.case.batch(g, step)
            torch.manual_seed(1000 * rank + 10 * step + m)  # drop-path, routing noise: the same
            local = m < micro - 1
            with self.wrapper.no_sync() if local else contextlib.nullcontext():
                loss = self.case.loss(forward if forward is not None else self.front, batch)
                (loss / micro).backward()
        if self.pattern == "clip":
            self.norms.append(self.clip(self.model.parameters(), max_norm=CLIP).item())
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def _assert_like_ddp(mine, theirs, what: str) -> None:
    for (pname, a), b in zip(mine.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, **FP32_TOL,
                                   msg=lambda m: f"{what}: {pname} differs from DDP: {m}")
    for (bname, a), b in zip(mine.named_buffers(), theirs.buffers()):
        if a.is_floating_point():  # BatchNorm statistics: computed from those parameters, a
            # batch of 4 at 1x1 pixels in resnet18's last stage multiplies their difference
            torch.testing.assert_close(a, b, **BUFFER_TOL,
                                       msg=lambda m: f"{what}: buffer {bname}: {m}")
        else:
            assert torch.equal(a, b), f"{what}: buffer {bname} differs from DDP's"


def _train_pair(name: str, pattern: str, steps: int = STEPS) -> dict:
    """Train ``name`` under DDP and under fused_bucketing with ``pattern``; compare on this
    rank; return what the ranks must agree on (and, for ``fp16``, the distances).

    ``fp16`` trains four: DDP and tribucket in fp32 (the ``plain`` comparison) and each with
    its fp16 hook, measured against DDP's fp32 run."""
    rank = dist.get_rank()
    case = MODELS[name]
    torch.manual_seed(0)
    init = case.build().train()
    out = {}
    with contextlib.ExitStack() as stack:
        fp32 = "plain" if pattern == "fp16" else pattern
        runs = {"ddp": _Run(case, init, True, fp32, case.options, stack),
                "tribucket": _Run(case, init, False, fp32, case.options, stack)}
        if pattern == "fp16":
            runs["ddp fp16"] = _Run(case, init, True, "fp16", case.options, stack)
            runs["tribucket fp16"] = _Run(case, init, False, "fp16", case.options, stack)
        for step in range(steps):
            for run in runs.values():
                run.step(rank, step)
        what = f"{name}, {fp32}, rank {rank}"
        _assert_like_ddp(runs["tribucket"].model, runs["ddp"].model, what)
        ref = _flat(runs["ddp"].model)
        if pattern == "fp16":
            moved = (ref - _flat(init)).norm().item()
            out["distance"] = {k: (_flat(runs[f"{k} fp16"].model) - ref).norm().item() / moved
                               for k in ("tribucket", "ddp")}
        if pattern == "clip":
            mine, theirs = runs["tribucket"].norms, runs["ddp"].norms
            assert all(n > CLIP for n in theirs), f"{what}: a step did not clip: norms {theirs}"
            assert mine == theirs, f"{what}: clip norms differ from torch's: {mine} vs {theirs}"
            out["norms"] = (mine, theirs)
        out["moved"] = (_flat(runs["tribucket"].model) - _flat(init)).abs().max().item()
        out["digest"] = {k: _digest(r.model) for k, r in runs.items()}
    return out


def _check_ranks(results: list[dict], name: str, pattern: str) -> None:
    for key in results[0]["digest"]:
        digests = [r["digest"][key] for r in results]
        assert len(set(digests)) == 1, f"{name}, {pattern}: the ranks' {key} models differ"
    # the steps changed the weights: a run that trained nothing would compare equal too
    # (clip: SGD at lr 1e-2 on gradients clipped to a total norm of 0.1 moves no weight far)
    least = 1e-6 if pattern == "clip" else 1e-4
    moved = [r["moved"] for r in results]
    assert all(m > least for m in moved), f"{name}, {pattern}: weights did not move: {moved}"


_FP32_CASES = [(m, p) for m in MODELS if m != "bert-pretraining" for p in ("no_sync", "clip")]
@pytest.mark.dist
@pytest.mark.parametrize("name,pattern", [pytest.param(m, p, id=f"{m}-{p}")
                                           for m, p in _FP32_CASES])
def test_trains_like_ddp(dist_run, name, pattern):
    results = dist_run(_train_pair, name, pattern, timeout=180)
    _check_ranks(results, name, pattern)


@pytest.mark.dist
@pytest.mark.parametrize("name", [m for m in MODELS if m != "bert-pretraining"])
def test_plain_and_fp16_hook(dist_run, name):
    """fp32: tribucket's parameters are DDP's. fp16 hooks: both runs drift from DDP's fp32
    one (AdamW turns the rounding of small gradients into whole steps); tribucket's drift,
    relative to how far the fp32 run moved, must not exceed DDP + torch's fp16 hook's by more
    than 10% (where the drift is mostly the model amplifying either rounding, as resnet18's
    BatchNorm over 4 samples does, the two are the same size and either may be ahead)."""
    results = dist_run(_train_pair, name, "fp16", timeout=180)
    _check_ranks(results, name, "fp16")
    d = results[0]["distance"]
    print(f"{name}: fp16 distance from fp32, tribucket {d['tribucket']:.4g}, DDP {d['ddp']:.4g}")
    assert d["tribucket"] <= FP16_MARGIN * d["ddp"], (
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
    """GPT-2 (one block: tracing time grows with the blocks) under ``torch.compile`` inside
    fused_bucketing against eager DDP. The ``aot_eager`` backend traces forward and backward
    as inductor does but runs the traced ops eagerly (no C++ code generation: seconds
    instead of a minute on this CPU)."""
    rank = dist.get_rank()
    case = dataclasses.replace(MODELS["gpt2"], build=lambda: _gpt2(layers=1))
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
    # teardown: the workers that ran torch.compile are not reused. Twice (two of this
    # suite's clean-clone runs) rank 0 died of SIGSEGV inside torch's DDP constructor, in
    # the first collective of the next test on the same workers
    results = dist_run(_compiled_vs_ddp, timeout=240, teardown=True)
    _check_ranks(results, "gpt2 compiled", "plain")
    assert [r["iterations"] for r in results] == [STEPS, STEPS]
