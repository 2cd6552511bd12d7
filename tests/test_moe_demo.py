"""The demo's routing comparison: which tokens the two runs routed differently, and whether a
near-tie of the router explains it (``tribucket.demo``: model.routing_choices, compare._tie_at,
the verdict and its lines in the table)."""

from __future__ import annotations

import math

import pytest
import torch

from tribucket import demo
from tribucket.demo import TIE_TOLERANCE, DemoConfig
from tribucket.demo.compare import _tie_at
from tribucket.demo.report import format_table
from tribucket.demo.train import RunResult

TINY = dict(d_model=32, heads=2, layers=2, experts_per_rank=2, ffn_hidden=48, expert_hidden=24,
            top_k=2, seq_len=16, batch_size=4, eval_batches=1, out_dir=None)


def _choices_match_the_layer(overrides: dict):
    import torch.distributed as dist

    from tribucket.demo.model import CharData, build_model, load_text
    from tribucket.moe import MoELayer

    cfg = DemoConfig(**{**TINY, **overrides})
    data = CharData(load_text(None), cfg.seq_len)
    out = []
    for expert_parallel in (True, False):
        model = build_model(cfg, data.vocab_size, expert_parallel=expert_parallel,
                            device=torch.device("cpu"))
        model.watch_routers()
        x_BS, _ = data.batch("train", 0, dist.get_rank(), 0, cfg.batch_size, torch.device("cpu"))
        model(x_BS)
        counts = model.routing()
        choices = model.routing_choices()
        assert len(choices) == len(counts) == 1
        ids_TK, margin_T = choices[0]
        E = cfg.num_experts(dist.get_world_size())
        assert ids_TK.shape == (cfg.batch_size * cfg.seq_len, cfg.top_k)
        # the chosen experts are the layer's: their histogram is its tokens per expert
        assert torch.bincount(ids_TK.long().reshape(-1), minlength=E).tolist() == list(counts[0])
        assert bool((margin_T >= 0).all())
        layer = next(b.ffn for b in model.blocks if hasattr(b.ffn, "aux_loss"))
        assert isinstance(layer, MoELayer) == expert_parallel
        out.append((ids_TK, margin_T))
    # the same weights and tokens: the same choices and margins in both models
    assert torch.equal(out[0][0], out[1][0])
    torch.testing.assert_close(out[0][1], out[1][1], atol=1e-6, rtol=0)
    return True


@pytest.mark.parametrize("overrides", [{}, {"score_func": "softmax", "bias_update_rate": 0.0}])
def test_routing_choices_are_the_layers_choices(dist_run, overrides):
    assert all(dist_run(_choices_match_the_layer, overrides, world_size=2, timeout=120))


def _result(ids_a, margin_a, ids_b, margin_b) -> tuple[RunResult, RunResult]:
    a = RunResult("tribucket", routing=[((1, 1),)], choices=[((ids_a, margin_a),)])
    b = RunResult("ddp", routing=[((1, 1),)], choices=[((ids_b, margin_b),)])
    return a, b


def _tie_cases():
    import torch.distributed as dist

    ids = torch.tensor([[0, 1], [1, 2], [0, 2]], dtype=torch.int16)
    moved = ids.clone()
    moved[1] = torch.tensor([1, 3], dtype=torch.int16)  # token 1: expert 2 or 3, a near-tie
    margins = torch.tensor([0.2, 3e-8, 0.05])
    near = _tie_at(*_result(ids, margins, moved, margins * 0.5), 1, torch.device("cpu"))
    # rank 1 moves token 0 too, whose margin is large: not a tie
    far_ids = moved.clone()
    if dist.get_rank() == 1:
        far_ids[0] = torch.tensor([0, 3], dtype=torch.int16)
    far = _tie_at(*_result(ids, margins, far_ids, margins), 1, torch.device("cpu"))
    return near, far


def test_tie_at_measures_the_tokens_routed_differently(dist_run):
    for near, far in dist_run(_tie_cases, world_size=2, timeout=60):
        assert near == (pytest.approx(3e-8), 2)           # token 1 on both ranks
        assert far == (pytest.approx(0.2), 3)             # and token 0 on rank 1


@pytest.mark.parametrize("margin, verdict", [(3e-8, "routing"), (TIE_TOLERANCE, "routing"),
                                             (2e-3, "bug"), (math.inf, "bug")])
def test_verdict_needs_the_moved_tokens_to_be_near_ties(margin, verdict):
    result = {"agree": False, "routing_differs_from": 105, "loss_diff_same_routing": 2.4e-7,
              "tie_margin": margin}
    assert demo._verdict(DemoConfig(), result) == verdict


def _table_result(verdict: str, margin: float | None) -> dict:
    run = {"median_step_s": 0.2, "median_comm_exposed_s": 0.01, "bytes_per_step": 1 << 20,
           "expert_param_bytes": 1 << 20, "expert_opt_bytes": 2 << 20, "losses": [4.2, 2.3],
           "val_loss": 2.4}
    return {"config": {"hook": "none"}, "tokens_per_step": 2048, "tribucket": dict(run),
            "ddp": dict(run, median_step_s=0.25, median_comm_exposed_s=None),
            "param_diff": {"max_abs_diff": 7.1e-5, "dense": 3.1e-5, "experts": 7.1e-5},
            "tolerance": 1e-5, "agree": False, "routing_differs_from": 105,
            "loss_diff_same_routing": 2.4e-7, "tie_margin": margin, "tie_tolerance": 1e-5,
            "loss_tolerance": 1e-5, "tokens_routed_differently": 1, "verdict": verdict}


def test_table_says_the_runs_agree_up_to_an_explained_tie():
    text = format_table(_table_result("routing", 3e-8))
    assert "verdict: tribucket and DDP agree" in text and "near-tie at step 105" in text
    assert "3.0e-08 apart" in text and "identical for steps 1-104" in text
    assert "DIFFER" not in text and "MISMATCH" not in text
    bad = format_table(_table_result("bug", 2e-3))
    assert "verdict: MISMATCH" in bad and "2.0e-03 from a tie" in bad


@pytest.mark.parametrize("ddp_s, says", [(0.25, "expert parallelism is 1.25x faster"),
                                         (0.16, "expert parallelism is 1.25x slower"),
                                         (0.2005, "take the same time per step here")])
def test_table_says_which_run_was_faster_or_that_they_tie(ddp_s, says):
    result = _table_result("routing", 3e-8)
    result["ddp"]["median_step_s"] = ddp_s  # tribucket's: 0.2 s
    assert says in format_table(result)
    # slower while the native hooks compiled beside the run: that is named, not the exchange
    result["tribucket"]["native_compiling"] = True
    text = format_table(result)
    assert ("compiling in the background" in text) == (ddp_s == 0.16), text
    assert ("the token exchange (5 all-to-alls" in text) is False
