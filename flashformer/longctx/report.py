"""The long-context report: position interpolation's claim as PASS / FAIL, a markdown table, a plot.

    claim = extension_claim(rows, original_len=256, target_len=1024)
    print(markdown_report(report))
"""

from __future__ import annotations

import math

REPORT_FILE = "long_context_report.json"
MARKDOWN_FILE = "long_context_report.md"
PLOT_FILE = "perplexity_vs_length.png"
# The models every report compares: RoPE as trained, rescaled but not fine-tuned, rescaled + fine-tuned.
MODELS = ("original", "scaled", "finetuned")
# "Far worse" in the claim: the original model read at the target, against itself at its own context.
CLAIM_DEGRADATION = 2.0


def extension_claim(rows: list[dict], original_len: int, target_len: int) -> dict | None:
    """Position interpolation's claim on the report's rows, or None when L or the target was not evaluated.

    Returns:
        The perplexities it compares, ``finetuned_no_worse`` (fine-tuned at the target <=
        original at L), ``original_degrades`` (original at the target > CLAIM_DEGRADATION x original
        at L) and ``passed`` (both). Also, outside ``passed``, ``finetuned_uses_context``: fine-tuned at the
        target <= fine-tuned at L. Fine-tuning also trains on more tokens, which alone can lower the
        perplexity at every length; this one compares the fine-tuned model with itself.
    """
    by_length = {row["length"]: row for row in rows}
    if original_len not in by_length or target_len not in by_length:
        return None
    reference = by_length[original_len]["ppl_original"]
    finetuned, unextended = by_length[target_len]["ppl_finetuned"], by_length[target_len]["ppl_original"]
    finetuned_short = by_length[original_len]["ppl_finetuned"]
    claim = {"ppl_original_at_original": reference, "ppl_finetuned_at_target": finetuned,
             "ppl_original_at_target": unextended, "ppl_finetuned_at_original": finetuned_short,
             "finetuned_no_worse": finetuned <= reference,
             "original_degrades": unextended > CLAIM_DEGRADATION * reference,
             "finetuned_uses_context": finetuned <= finetuned_short}
    return {**claim, "passed": claim["finetuned_no_worse"] and claim["original_degrades"]}


def _model_labels(scaling: str) -> dict[str, str]:
    return {"original": "original", "scaled": f"{scaling} (no fine-tune)", "finetuned": f"{scaling} + fine-tune"}


def markdown_report(report: dict) -> str:
    """Perplexity and passkey accuracy of every model at every length as a markdown table, then the
    claim's PASS / FAIL line."""

    def accuracy(value):
        return "n/a" if value is None else f"{value:.0%}"

    labels = _model_labels(report["scaling"]).values()
    header = [*(f"ppl {label}" for label in labels), *(f"passkey {label}" for label in labels)]
    lines = [f"| length | {' | '.join(header)} |", "|---:" * (len(header) + 1) + "|"]
    for row in report["lengths"]:
        cells = [*(f"{row[f'ppl_{m}']:.3f}" for m in MODELS), *(accuracy(row[f"passkey_{m}"]) for m in MODELS)]
        lines.append(f"| {row['length']} | {' | '.join(cells)} |")
    original_len, target_len, claim = report["original_length"], report["target_length"], report["claim"]
    if claim is None:
        verdict = (f"claim not checked: the evaluated lengths must include the original context {original_len} "
                   f"and the target {target_len}")
    else:
        ratio = claim["ppl_original_at_target"] / claim["ppl_original_at_original"]
        verdict = (f"{'PASS' if claim['passed'] else 'FAIL'}: {_model_labels(report['scaling'])['finetuned']} @ "
                   f"{target_len}: ppl {claim['ppl_finetuned_at_target']:.3f} "
                   f"{'<=' if claim['finetuned_no_worse'] else '>'} original @ {original_len}: ppl "
                   f"{claim['ppl_original_at_original']:.3f} (needs <=); original @ {target_len}: ppl "
                   f"{claim['ppl_original_at_target']:.3f} = {ratio:.1f}x original @ {original_len} "
                   f"(needs > {CLAIM_DEGRADATION:g}x). Beside the claim, the fine-tuned model @ {target_len} against "
                   f"itself @ {original_len}: ppl {claim['ppl_finetuned_at_target']:.3f} "
                   f"{'<=' if claim['finetuned_uses_context'] else '>'} {claim['ppl_finetuned_at_original']:.3f}")
    return "\n".join(lines) + "\n\n" + verdict


def plot_perplexity(report: dict, path: str) -> str | None:
    """Perplexity (left) and passkey accuracy (right) against evaluated length, one line per model;
    None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("matplotlib is not installed: no perplexity plot (pip install matplotlib)")
        return None
    rows, original_len = report["lengths"], report["original_length"]
    lengths = [row["length"] for row in rows]
    labels = _model_labels(report["scaling"])
    labels["original"] = "original (RoPE as trained)"
    fig, (ppl_ax, passkey_ax) = plt.subplots(1, 2, figsize=(12, 4))
    for model, style in zip(MODELS, ("-", "--", "-")):
        ppl_ax.plot(lengths, [row[f"ppl_{model}"] for row in rows], style, marker="o", label=labels[model])
        passkey_ax.plot(lengths, [math.nan if row[f"passkey_{model}"] is None else row[f"passkey_{model}"]
                                  for row in rows], style, marker="o", label=labels[model])
    if report["claim"] is not None:  # the bar the fine-tuned model must stay under at the target
        ppl_ax.axhline(report["claim"]["ppl_original_at_original"], color="gray", linestyle="--", linewidth=0.8,
                       label=f"original @ {original_len}")
    for ax in (ppl_ax, passkey_ax):
        ax.axvline(original_len, color="gray", linestyle=":", label="original context")
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.set_xlabel("evaluated context length (tokens)")
        ax.grid(alpha=0.3)
    ppl_ax.set_yscale("log")  # an unextended model's perplexity beyond its context can be orders larger
    ppl_ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    low, high = ppl_ax.get_ylim()
    # Label the minor ticks only when the axis spans less than a decade; over several they pile up.
    ppl_ax.yaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter() if high / low < 10
                                     else matplotlib.ticker.NullFormatter())
    ppl_ax.set_ylabel("held-out perplexity")
    ppl_ax.legend()
    passkey_ax.set_ylim(-0.05, 1.05)
    passkey_ax.set_ylabel("passkey accuracy")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
