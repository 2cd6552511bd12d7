"""The demo (``make demo``): its training function on gloo ranks against torch DDP, and its
command line.

``run_demo`` trains the MoE transformer with tribucket (``fused_bucketing`` for the dense
parameters, ``MoELayer`` experts spread over the ranks), then with torch DDP holding every
expert, and compares the final parameters; these tests run it on small models.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist

from tribucket import demo
from tribucket.demo import LOSS_TOLERANCE, PARAM_TOLERANCE, DemoConfig, parse_args, run_demo

# a model small enough for a few steps on a busy 2-core machine, big enough to learn
TINY = dict(d_model=32, heads=2, layers=2, experts_per_rank=2, ffn_hidden=48, expert_hidden=24,
            top_k=2, seq_len=32, batch_size=8, eval_batches=1, lr=1e-2, out_dir=None)


def _run(overrides: dict) -> dict:
    return run_demo(DemoConfig(**{**TINY, **overrides}))


def _run_cases(cases: list) -> list:
    """Several demo runs on every rank, in the same order (one pool call)."""
    return [_run(c) for c in cases]


def _assert_learns(result: dict, name: str, drop: float) -> None:
    losses = result[name]["losses"]
    assert len(losses) == result["config"]["steps"]
    first, last = losses[0], sum(losses[-3:]) / 3
    assert last < first - drop, f"{name}: loss did not fall: {losses}"


def _assert_same_on_every_rank(results: list) -> dict:
    r0 = results[0]
    for r, res in enumerate(results[1:], start=1):
        assert res["tribucket"]["losses"] == r0["tribucket"]["losses"], f"rank {r}"
        assert res["param_diff"]["max_abs_diff"] == r0["param_diff"]["max_abs_diff"], f"rank {r}"
    return r0


def test_demo_matches_ddp_and_learns(dist_run, tmp_path):
    results = dist_run(_run, {"steps": 14, "out_dir": str(tmp_path)}, world_size=2, timeout=180)
    res = _assert_same_on_every_rank(results)
    assert res["world_size"] == 2 and res["parameters"]["experts_per_rank"] > 0
    _assert_learns(res, "tribucket", drop=0.5)
    _assert_learns(res, "ddp", drop=0.5)
    # the same training, step by step, and the same parameters at the end
    for a, b in zip(res["tribucket"]["losses"], res["ddp"]["losses"]):
        assert math.isclose(a, b, abs_tol=1e-4), (res["tribucket"]["losses"], res["ddp"]["losses"])
    assert math.isclose(res["tribucket"]["val_loss"], res["ddp"]["val_loss"], abs_tol=1e-4)
    d = res["param_diff"]
    assert d["max_abs_diff"] <= PARAM_TOLERANCE, d
    assert res["routing_differs_from"] is None and res["loss_diff_same_routing"] <= LOSS_TOLERANCE
    assert res["agree"] is True and res["verdict"] == "agree"
    # tribucket allreduces the dense gradients only; DDP every expert's too
    assert 0 < res["tribucket"]["bytes_per_step"] < res["ddp"]["bytes_per_step"]
    assert all(t > 0 for t in res["tribucket"]["step_s"] + res["tribucket"]["comm_exposed_s"])
    # memory of the experts per rank: tribucket holds its own experts, DDP every expert
    D, H, L, world = TINY["d_model"], TINY["expert_hidden"], TINY["experts_per_rank"], 2
    moe_layers = TINY["layers"] // 2  # every second block's FFN is an MoE layer
    expert_bytes = 4 * 3 * D * H  # fp32 SwiGLU w1, w3, w2, no biases
    # tribucket stacks a layer's experts into 3 tensors; DDP's model has 3 per expert
    for name, experts, tensors in (("tribucket", L, 3), ("ddp", L * world, 3 * L * world)):
        params = moe_layers * experts * expert_bytes
        assert res[name]["expert_param_bytes"] == params, (name, res[name])
        # AdamW: two moments of each parameter's size, a 4-byte step per parameter tensor
        assert res[name]["expert_opt_bytes"] == 2 * params + 4 * tensors * moe_layers, name

    # rank 0 wrote the figures and their data; the other ranks wrote nothing
    assert [r["out_dir"] for r in results[1:]] == [None]
    out = tmp_path / res["out_dir"].rsplit("/", 1)[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]
    for png in ("loss.png", "step_time.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    loss = json.loads((out / "loss.json").read_text())
    assert loss["tribucket"] == res["tribucket"]["losses"] and loss["ddp"] == res["ddp"]["losses"]
    steps = json.loads((out / "step_time.json").read_text())
    assert steps["ddp"]["step_s"] == res["ddp"]["step_s"]
    table = (out / "table.txt").read_text()
    assert "max |param difference|" in table and "expert optimizer state per rank" in table


@pytest.mark.parametrize("world_size", [1, 3])
def test_demo_other_world_sizes(dist_run, world_size):
    res = _assert_same_on_every_rank(dist_run(_run, {"steps": 8}, world_size=world_size,
                                              timeout=180))
    assert res["world_size"] == world_size
    _assert_learns(res, "tribucket", drop=0.3)
    assert res["param_diff"]["max_abs_diff"] <= PARAM_TOLERANCE, res["param_diff"]
    assert res["verdict"] == "agree" and res["routing_differs_from"] is None


def test_demo_hooks_against_ddp(dist_run):
    """Every hook trains; lossy hooks measurably leave DDP's result (so the comparison can
    fail), and gossip on 2 ranks is exactly the mean ((a + b) * 0.5 = a * 0.5 + b * 0.5)."""
    hooks = ["fp16", "bf16", "powersgd", "gossip"]
    per_rank = dist_run(_run_cases, [{"steps": 6, "hook": h} for h in hooks], world_size=2,
                        timeout=180)
    for hook, res in zip(hooks, per_rank[0]):
        assert res["config"]["hook"] == hook
        _assert_learns(res, "tribucket", drop=0.3)
        diff = res["param_diff"]["max_abs_diff"]
        if hook == "gossip":
            assert diff <= PARAM_TOLERANCE, (hook, res["param_diff"])
        else:
            assert diff > PARAM_TOLERANCE and res["verdict"] == "hook", (hook, res["param_diff"])
    # fused compression halves the bytes on the wire
    assert per_rank[0][0]["tribucket"]["bytes_per_step"] * 2 == \
        per_rank[0][3]["tribucket"]["bytes_per_step"]


@pytest.mark.parametrize("hook, agree, routing_from, loss_diff, verdict", [
    ("none", True, None, 0.0, "agree"),
    ("none", True, 5, 1e-3, "agree"),          # parameters agree: nothing else matters
    ("fp16", False, None, 1e-3, "hook"),
    ("none", False, 81, 5e-7, "routing"),      # a near-tie flipped; same losses before it
    ("none", False, 3, 8e-3, "bug"),           # losses parted before the routing did
    ("none", False, None, 5e-7, "bug"),        # same routing throughout, other parameters
])
def test_verdict_tells_near_ties_from_bugs(hook, agree, routing_from, loss_diff, verdict):
    result = {"agree": agree, "routing_differs_from": routing_from,
              "loss_diff_same_routing": loss_diff}
    assert demo._verdict(DemoConfig(hook=hook), result) == verdict


def test_demo_pairwise_schedule_matches_ddp(dist_run):
    res = dist_run(_run, {"steps": 6, "schedule": "pairwise"}, world_size=2)[0]
    assert res["config"]["schedule"] == "pairwise"
    assert res["param_diff"]["max_abs_diff"] <= PARAM_TOLERANCE, res["param_diff"]


def test_run_demo_needs_a_process_group():
    if dist.is_initialized():  # pragma: no cover - the test process has no group
        pytest.skip("this process has a process group")
    with pytest.raises(RuntimeError, match="initialised process group"):
        run_demo(DemoConfig(**TINY))


@pytest.mark.parametrize("argv, words", [
    (["--steps", "0"], ["--steps", "positive", "0"]),
    (["--steps", "-5"], ["--steps", "-5"]),
    (["--steps", "ten"], ["--steps", "invalid int value", "ten"]),
    (["--hook", "topk"], ["--hook", "invalid choice", "topk", "powersgd"]),
    (["--schedule", "ring"], ["--schedule", "ring", "pairwise"]),
    (["--backend", "mpi"], ["--backend", "mpi", "nccl"]),
    (["--d-model", "30", "--heads", "4"], ["--d-model 30", "--heads 4", "divides"]),
    (["--nproc", "0"], ["--nproc", "positive", "0"]),
    (["--nproc", "1", "--top-k", "9"], ["--top-k 9", "--experts-per-rank"]),
    (["--score-func", "relu"], ["--score-func", "invalid choice", "sigmoid"]),
    (["--shared-experts", "-1"], ["--shared-experts", "-1"]),
    (["--bias-update-rate", "-0.1"], ["--bias-update-rate", "-0.1"]),
    (["--lr", "nan"], ["--lr", "nan"]),
    (["--lr", "0"], ["--lr", "positive"]),
    (["--batch-size", "0"], ["--batch-size", "0"]),
    (["--threads", "0"], ["--threads", "positive", "0"]),
    (["--text", "/no/such/file.txt"], ["--text", "/no/such/file.txt", "not a file"]),
    # one position: attention's query and key get only rounding noise as gradient, which
    # AdamW turns into steps of their own in each run: no comparison to make
    (["--seq-len", "1"], ["--seq-len", "at least 2", "1"]),
    # the demo's MoE is the second block's feed-forward
    (["--layers", "1"], ["--layers", "at least 2", "1"]),
])
def test_parser_rejects_bad_values(capsys, argv, words):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: tribucket-demo" in err
    for w in words:
        assert w in err, (w, err)


def test_parser_refuses_nccl_without_a_gpu_before_launching(capsys):
    if torch.cuda.is_available():  # pragma: no cover - a GPU machine runs nccl
        pytest.skip("a CUDA device is visible")
    with pytest.raises(SystemExit) as exc:
        parse_args(["--backend", "nccl"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: tribucket-demo" in err and "--backend nccl" in err and "gloo" in err, err


def test_parser_names_the_text_flag_for_a_file_that_is_not_utf8(capsys, tmp_path):
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("Ça ne va pas être décodé ".encode("latin-1") * 400)
    with pytest.raises(SystemExit) as exc:
        parse_args(["--text", str(latin)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--text" in err and str(latin) in err and "UTF-8" in err, err


def test_demo_without_the_routing_bias_matches_ddp(dist_run):
    """--bias-update-rate 0 with softmax scores (the docs' suggestion): the comparison with
    DDP runs and agrees."""
    res = dist_run(_run, {"steps": 3, "score_func": "softmax", "bias_update_rate": 0.0},
                   world_size=2)[0]
    assert res["param_diff"]["max_abs_diff"] <= PARAM_TOLERANCE, res["param_diff"]


@pytest.mark.parametrize("case", ["seq_len", "short_text"])
def test_parser_rejects_a_text_too_short_for_the_sequences(capsys, tmp_path, case):
    # checked before anything is launched (the text is read once more in each rank)
    if case == "seq_len":
        argv = ["--seq-len", "100000"]
    else:
        short = tmp_path / "short.txt"
        short.write_text("to be or not to be", encoding="utf-8")
        argv = ["--text", str(short)]
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: tribucket-demo" in err and "--seq-len" in err and "--text" in err, err


def test_parser_defaults_and_relaunch_command():
    assert parse_args([]) == DemoConfig()
    cfg = parse_args(["--steps", "7", "--hook", "fp16", "--nproc", "3", "--no-ddp",
                      "--out-dir", "", "--d-model", "48", "--heads", "3"])
    assert (cfg.steps, cfg.hook, cfg.nproc, cfg.compare, cfg.out_dir, cfg.d_model) == \
        (7, "fp16", 3, False, None, 48)
    cmd = demo.torchrun_command(cfg)
    i = cmd.index("--standalone")
    assert cmd[i:i + 5] == ["--standalone", "--nproc-per-node", "3", "-m", "tribucket.demo"]
    # the relaunched ranks parse the same config back (spelled in full, without --nproc,
    # which torchrun's own parser would take for an ambiguous --nproc-per-node)
    forwarded = cmd[i + 5:]
    assert "--nproc" not in forwarded
    assert parse_args(forwarded) == DemoConfig(**{**cfg.__dict__, "nproc": 2})
