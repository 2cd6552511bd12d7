"""What the demo shows at the end: the comparison table (:func:`format_table`) and, on rank 0,
``<out_dir>/<timestamp>/`` with the loss and step-time figures (PNG) and their data (JSON)."""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return str(n)


#: step times closer than this are reported as the same (medians move more between runs)
SAME_SPEED_WITHIN = 0.03


def format_table(result: dict) -> str:
    """The comparison table printed at the end of the demo."""
    cfg = result["config"]
    names = [n for n in ("tribucket", "ddp") if n in result]
    heads = {"tribucket": f"tribucket (hook: {cfg['hook']})", "ddp": "torch DDP"}
    tok = result["tokens_per_step"]

    def cell(name: str, row: str) -> str:
        r = result[name]
        if row == "step":
            return f"{r['median_step_s'] * 1e3:,.1f} ms"
        if row == "tok":
            return f"{tok / r['median_step_s']:,.0f}"
        if row == "comm":
            c = r["median_comm_exposed_s"]
            return "-" if c is None else f"{c * 1e3:,.2f} ms"
        if row in ("bytes", "params", "opt"):
            return _fmt_bytes(r[{"bytes": "bytes_per_step", "params": "expert_param_bytes",
                                 "opt": "expert_opt_bytes"}[row]])
        if row == "first":
            return f"{r['losses'][0]:.4f}"
        if row == "final":
            return f"{r['losses'][-1]:.4f}"
        return f"{r['val_loss']:.4f}"

    rows = [("step time (median)", "step"), ("tokens/s (all ranks)", "tok"),
            ("comm exposed after backward", "comm"), ("gradient bytes allreduced/step", "bytes"),
            ("expert parameters per rank", "params"), ("expert optimizer state per rank", "opt"),
            ("first loss", "first"), ("final loss", "final"), ("validation loss", "val")]
    table = [[""] + [heads[n] for n in names]] + [[label] + [cell(n, key) for n in names]
                                                   for label, key in rows]
    w = [max(len(r[c]) for r in table) for c in range(len(table[0]))]
    lines = []
    for k, r in enumerate(table):
        lines.append("  ".join([r[0].ljust(w[0])] + [r[c].rjust(w[c]) for c in range(1, len(r))]))
        if k == 0:
            lines.append("-" * len(lines[0]))
    if len(names) == 2:  # one line on who is faster, and why
        tb, ddp = (result[n]["median_step_s"] for n in names)
        if abs(tb / ddp - 1) < SAME_SPEED_WITHIN:
            lines.append(f"expert parallelism and DDP take the same time per step here (within "
                         f"{SAME_SPEED_WITHIN:.0%}, less than the run-to-run spread on a shared "
                         "machine): the token exchange costs about what the replicated experts' "
                         "allreduce and optimizer work does")
        elif tb <= ddp:
            lines.append(f"expert parallelism is {ddp / tb:.2f}x faster per step here: DDP "
                         "allreduces and updates every expert on every rank, tribucket only its own")
        elif result[names[0]].get("native_compiling"):
            lines.append(f"expert parallelism is {tb / ddp:.2f}x slower per step here, with "
                         "tribucket's native gradient hooks compiling in the background through "
                         "its run (the first run on this machine): run the demo again, or "
                         "`python -m tribucket.build` first, to compare")
        else:
            lines.append(f"expert parallelism is {tb / ddp:.2f}x slower per step here: at this "
                         "size the token exchange (5 all-to-alls per MoE layer) costs more than "
                         "the replicated experts' allreduce and optimizer work it saves")
    if "param_diff" in result:
        lines += _comparison_lines(result)
    return "\n".join(lines)


def _comparison_lines(result: dict) -> list[str]:
    """The parameter and routing comparison, and the verdict in one line."""
    cfg, d, verdict = result["config"], result["param_diff"], result["verdict"]
    n = result["routing_differs_from"]
    why = {"agree": "within", "hook": "beyond", "routing": "beyond", "bug": "beyond"}[verdict]
    lines = [f"max |param difference| tribucket vs DDP: {d['max_abs_diff']:.2e} (dense "
             f"{d['dense']:.2e}, experts {d['experts']:.2e}), {why} the fp32 tolerance "
             f"{result['tolerance']:.0e}" + (f", after the routing parted at step {n} (below)"
                                             if verdict == "routing" else "")]
    lines.append("MoE routing (every token's experts, every rank, layer and step): "
                 + ("identical" if n is None else
                    (f"identical for steps 1-{n - 1}" if n > 2 else "identical for step 1")
                    + f", differs from step {n} on" if n > 1 else f"differs from step {n} on"))
    margin = result.get("tie_margin")
    if verdict == "hook":
        lines.append(f"  (expected: the '{cfg['hook']}' hook changes the averaging; only "
                     "--hook none computes DDP's result)")
        lines.append("verdict: tribucket and DDP train alike up to the hook's compression "
                     "(a lossy hook: no exact comparison)")
    elif verdict == "routing":
        moved = result.get("tokens_routed_differently", 0)
        lines.append(
            f"  at step {n}, {moved} token(s) went to other experts in the two runs; each one's "
            f"k-th and (k+1)-th best experts were"
            + (f" at most {margin:.1e} apart in the selection score (measured in both runs; a "
               f"near-tie is within {result['tie_tolerance']:.0e})" if margin is not None
               else " tied up to rounding")
            + ",\n  so fp32 rounding, not a different computation, picked the expert; "
            f"before step {n} the losses agreed to {result['loss_diff_same_routing']:.1e} at "
            "every step,\n  after it the runs train on different routings and part "
            "legitimately")
        lines.append(f"verdict: tribucket and DDP agree (the same training up to a router "
                     f"near-tie at step {n}, explained above)")
    elif verdict == "bug":
        reason = (f"the losses differed by {result['loss_diff_same_routing']:.1e} while both "
                  "runs routed alike" if result["loss_diff_same_routing"] > result["loss_tolerance"]
                  else f"the tokens routed differently at step {n} were {margin:.1e} from a "
                  f"tie (more than {result['tie_tolerance']:.0e}: not rounding)"
                  if n is not None else "the parameters differ while the routing is identical")
        lines.append(f"verdict: MISMATCH: {reason}; a bug, please report it with this output")
    else:
        lines.append("verdict: tribucket and DDP agree (the same training: parameters within "
                     "fp32 tolerance, identical routing)")
    return lines


def _write_outputs(result: dict) -> str:
    """Rank 0: ``<out_dir>/<timestamp>/`` with loss and step-time figures (PNG + JSON)."""
    base = Path(result["config"]["out_dir"])
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = base / stamp
    k = 1
    while out.exists():
        k += 1
        out = base / f"{stamp}-{k}"
    out.mkdir(parents=True)
    names = [n for n in ("tribucket", "ddp") if n in result]
    loss = {"steps": list(range(1, result["config"]["steps"] + 1)),
            **{n: result[n]["losses"] for n in names},
            "validation": {n: result[n]["val_loss"] for n in names}}
    steps = {"tokens_per_step": result["tokens_per_step"],
             **{n: {"step_s": result[n]["step_s"], "median_step_s": result[n]["median_step_s"],
                    "comm_exposed_s": result[n]["comm_exposed_s"]} for n in names}}
    (out / "loss.json").write_text(json.dumps(loss, indent=1))
    (out / "step_time.json").write_text(json.dumps(steps, indent=1))
    summary = {k: v for k, v in result.items() if k not in names}
    summary.update({n: {k: v for k, v in result[n].items() if k not in ("losses", "step_s",
                                                                        "comm_exposed_s")}
                    for n in names})
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "table.txt").write_text(format_table(result) + "\n")
    _move_trace(base, out)
    try:
        _plot(result, names, out)
    except ImportError:
        print("matplotlib is not installed: wrote the JSON figures only "
              "(pip install 'tribucket[perf]' for the PNGs)", file=sys.stderr)
    return str(out)


def _move_trace(base: Path, out: Path) -> None:
    """The tribucket run's per-bucket trace into ``out/trace.json``, with its table
    (``trace_table.txt``) and its picture (``timeline.png``: the last three steps)."""
    from .train import trace_file

    src = base / trace_file()
    if not src.exists():
        return
    src.replace(out / "trace.json")
    from ..trace import load
    from ..trace.report import format_table as trace_table
    from ..trace.report import plot_timeline, summarize

    doc = load(out / "trace.json")
    (out / "trace_table.txt").write_text(trace_table(summarize(doc)) + "\n")
    try:
        plot_timeline(doc, str(out / "timeline.png"), steps=3)
    except ImportError:
        pass


def _plot(result: dict, names: list, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = result["config"]
    labels = {"tribucket": f"tribucket (hook {cfg['hook']})", "ddp": "torch DDP"}
    styles = {"tribucket": dict(color="C0", lw=2.2), "ddp": dict(color="C3", lw=1.0, ls="--")}
    title = (f"{result['world_size']} ranks ({result['backend']}), {result['parameters']['total']:,} "
             f"parameters, E={cfg['experts_per_rank'] * result['world_size']} k={cfg['top_k']}")

    fig, ax = plt.subplots(figsize=(7, 4))
    for n in names:
        ax.plot(range(1, len(result[n]["losses"]) + 1), result[n]["losses"], label=labels[n],
                **styles[n])
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over ranks)")
    subtitle = ""
    if "param_diff" in result:
        subtitle = (f"\nmax |param difference| tribucket vs DDP after {cfg['steps']} steps: "
                    f"{result['param_diff']['max_abs_diff']:.1e}")
    ax.set_title(f"Character MoE transformer: {title}{subtitle}", fontsize=9)
    if result.get("routing_differs_from"):
        ax.axvline(result["routing_differs_from"], color="gray", lw=0.8, ls=":")
        ax.text(result["routing_differs_from"], ax.get_ylim()[0], " routing differs from here",
                fontsize=7, va="bottom", color="gray")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=120)
    plt.close(fig)

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [3, 1]})
    for n in names:
        a1.plot(range(1, len(result[n]["step_s"]) + 1), [s * 1e3 for s in result[n]["step_s"]],
                label=labels[n], **{**styles[n], "lw": 1.0})
    a1.set_xlabel("step")
    a1.set_ylabel("step time, slowest rank (ms)")
    a1.set_title(title, fontsize=9)
    a1.grid(alpha=0.3)
    a1.legend()
    med = [result[n]["median_step_s"] * 1e3 for n in names]
    a2.bar([labels[n].split(" (")[0] for n in names], med,
           color=[styles[n]["color"] for n in names])
    for i, m in enumerate(med):
        a2.text(i, m, f"{m:.1f}", ha="center", va="bottom")
    a2.set_ylabel("median step time (ms)")
    fig.tight_layout()
    fig.savefig(out / "step_time.png", dpi=120)
    plt.close(fig)
