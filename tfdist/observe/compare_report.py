"""`tfdist-compare`'s outputs: the loss-curve plot and the Markdown report."""

from __future__ import annotations

import shlex

import numpy as np

from tfdist.observe.divergence import Divergence, agreement_table
from tfdist.strategies import REFERENCE


def plot(result: Divergence, names: tuple, path: str) -> None:
    """Loss curves overlaid (top); per-step gap and smoothed relative gap (bottom)."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for values, smooth, name, color in ((result.default, result.smooth_default, names[0], "C0"),
                                        (result.distributed, result.smooth_distributed,
                                         names[1], "C1")):
        top.plot(result.steps, values, color=color, alpha=0.35, linewidth=1)
        top.plot(result.smooth_steps, smooth, color=color, linewidth=2,
                 label=f"{name} (mean of {result.window} steps)")
    top.set_ylabel("training loss")
    top.set_title(f"{names[0]} vs {names[1]}: training loss")
    top.legend()
    top.grid(alpha=0.3)
    bottom.plot(result.steps, result.gap, color="C2", linewidth=1,
                label=f"per-step gap ({names[1]} - {names[0]})")
    bottom.axhline(0.0, color="grey", linewidth=0.5)
    bottom.set_ylabel("loss gap")
    bottom.set_xlabel("global step")
    right = bottom.twinx()
    finite = np.where(np.isfinite(result.relative_gap), result.relative_gap, np.nan)
    right.plot(result.smooth_steps, finite, color="C3", linewidth=2,
               label="smoothed relative gap")
    right.axhline(result.tolerance, color="C3", linestyle="--", linewidth=1,
                  label=f"tolerance {result.tolerance:g}")
    worst = result.worst
    if np.isfinite(result.relative_gap[worst]):
        right.plot([result.smooth_steps[worst]], [result.relative_gap[worst]], "o", color="C3")
    right.set_ylabel("relative gap")
    # Both axes symmetric about 0, so their zeros (and the tolerance line) read true.
    left_span = np.nanmax(np.abs(np.where(np.isfinite(result.gap), result.gap, np.nan)),
                          initial=0.0) * 1.1 or 1.0
    right_span = max(np.nanmax(finite, initial=0.0), result.tolerance) * 1.1
    bottom.set_ylim(-left_span, left_span)
    right.set_ylim(-right_span, right_span)
    handles = bottom.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    bottom.legend(handles[0] + more[0], handles[1] + more[1], loc="upper left")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _last(curve: dict) -> float:
    return curve[max(curve)]


def _number(value, fmt=".4f") -> str:
    return "n/a" if value is None else format(value, fmt)


def report(opts, argvs: dict, runs: dict, result: Divergence, seconds: dict) -> str:
    """The markdown report: commands, hardware, final metrics, divergence, agreement."""
    base, dist = REFERENCE, opts.strategy
    worst = result.worst
    step = int(result.smooth_steps[worst])
    at = int(np.searchsorted(result.steps, step))
    verdict = ("DIVERGED: beyond" if result.diverged else "PASS: within")
    lines = [f"# tfdist-compare: {base} vs {dist}", "",
             f"**{verdict} tolerance** (largest smoothed relative loss gap "
             f"{result.max_relative_gap:.4g} vs tolerance {opts.tolerance:g})", "",
             "## Runs", ""]
    for name, argv in argvs.items():
        lines += [f"{name} ({seconds[name]:.1f}s):", "```", shlex.join(argv), "```"]
    summary = runs[dist]["summary"]
    lines += ["", f"Hardware: {summary.get('hardware', runs[base]['summary'].get('hardware'))}",
              "", f"Steps: {base} {runs[base]['summary'].get('steps')}, {dist} "
              f"{summary.get('steps')} ({summary.get('replicas')} replicas, "
              f"{summary.get('workers')} worker(s), global batch "
              f"{summary.get('global_batch_size')}); compared at {len(result.steps)} steps, "
              f"moving average over {result.window} steps", "",
              "## Final metrics", "", f"| | {base} | {dist} |", "|---|---|---|"]
    rows = (("final training loss (last step)", lambda r: _last(r["scalars"]["loss"])),
            ("training accuracy (last loop)", lambda r: r["summary"].get("train_accuracy")),
            ("test loss", lambda r: r["summary"].get("test_loss")),
            ("test accuracy", lambda r: r["summary"].get("accuracy")))
    for label, get in rows:
        lines.append(f"| {label} | {_number(get(runs[base]))} | {_number(get(runs[dist]))} |")
    lines += ["", "## Largest divergence", "",
              f"At step {step} (mean of the {result.window} steps ending there): {base} "
              f"{result.smooth_default[worst]:.5g}, {dist} {result.smooth_distributed[worst]:.5g}, "
              f"gap {result.smooth_distributed[worst] - result.smooth_default[worst]:+.4g} "
              f"(relative {result.max_relative_gap:.4g}, tolerance {opts.tolerance:g}). "
              f"Unsmoothed at step {step}: {base} {result.default[at]:.5g}, {dist} "
              f"{result.distributed[at]:.5g}."]
    gaps = np.abs(np.nan_to_num(result.gap, nan=np.inf))
    raw = int(np.argmax(gaps))
    lines.append(f"Largest per-step gap: {result.gap[raw]:+.4g} at step {int(result.steps[raw])}.")
    lines += ["", *_agreement_lines(opts, runs[dist]["scalars"])]
    return "\n".join(lines) + "\n"


def _agreement_lines(opts, scalars: dict) -> list:
    if not opts.grad_agreement_every:
        return []
    table = agreement_table(scalars)
    lines = ["## Gradient agreement", ""]
    if not table:
        return lines + [f"No per-replica gradient agreement was logged (asked for every "
                        f"{opts.grad_agreement_every} steps)."]
    samples = max(n for _, _, n in table.values())
    lines += [f"Cosine similarity of each replica's local gradient with the cross-replica "
              f"mean, over {samples} sampled steps (every {opts.grad_agreement_every}):", "",
              "| replica | min | mean |", "|---|---|---|"]
    lines += [f"| {r} | {low:.4f} | {mean:.4f} |" for r, (low, mean, _) in table.items()]
    overall = min(low for low, _, _ in table.values())
    return lines + ["", f"Overall min: {overall:.4f}"]


