"""The decoder workload's report: one markdown page and a perplexity–decode-time frontier plot."""

from __future__ import annotations

import math
from pathlib import Path


def _interval(low_high: list[float] | None, scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    if not low_high:
        return ""
    return f" [{fmt.format(low_high[0] * scale)}, {fmt.format(low_high[1] * scale)}]"


def _pct_interval(row: dict, prefix: str) -> str:
    ratio, ci = row.get(f"{prefix}_ratio"), row.get(f"{prefix}_ratio_ci")
    if ratio is None:
        return "–"
    return f"{100 * (ratio - 1):+.1f} [{100 * (ci[0] - 1):+.1f}, {100 * (ci[1] - 1):+.1f}]"


def _table(results: dict) -> list[str]:
    batches = results["config"]["batches"]
    head = [
        "model",
        "shape",
        "val ppl",
        "test ppl [95% CI]",
        "Δ test ppl (%) [paired 95% CI]",
        "out-of-domain ppl",
        "Δ ood (%)",
        "zero-shot acc (%)",
        "TTFT b1 (ms)",
    ]
    head += [f"TPOT b{b} (ms)" for b in batches]
    head += ["b1 decode speed-up", "vs dense, same precision", "predicted TPOT b1 (ms)", "size (MiB)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results["rows"]:
        zero = r.get("zero_shot")
        cells = [
            r["name"],
            r["shape_text"],
            f"{r['val_ppl']:.2f}",
            f"{r['test_ppl']:.2f}{_interval(r['test_ppl_ci'])}",
            _pct_interval(r, "test"),
            f"{r['ood_ppl']:.2f}" if "ood_ppl" in r else "–",
            _pct_interval(r, "ood"),
            f"{100 * zero[0]:.1f} [{100 * zero[1]:.1f}, {100 * zero[2]:.1f}]" if zero else "–",
            f"{r['ttft_b1_ms']:.1f}",
            *(f"{r[f'tpot_b{b}_ms']:.2f}" for b in batches),
            f"{r['speedup_b1']:.2f}×",
            f"{r['speedup_b1_same_precision']:.2f}×",
            f"{r['predicted_tpot_b1_ms']:.2f} ({100 * r['prediction_error']:+.1f} %)"
            if "prediction_error" in r
            else "–",
            f"{r['size_mb']:.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _verdicts(results: dict) -> list[str]:
    config = results["config"]
    budget = config["perplexity_budget"]
    lines = []
    for target, name in results["deployed"].items():
        row = next(r for r in results["rows"] if r["name"] == name)
        fp32 = next(
            r
            for r in results["rows"]
            if r["kind"] == "ours" and str(r["target"]) == target and r["precision"] == "fp32"
        )
        lines.append(
            f"- target {float(target):g} of dense decode time: deployed **{name}** ({row['shape_text']}): "
            f"test perplexity {_pct_interval(row, 'test')} % against dense fp32 (budget +{100 * budget:.0f} % on "
            f"validation: {'within' if row['val_ratio'] <= 1 + budget else '**outside**'}, val "
            f"{100 * (row['val_ratio'] - 1):+.1f} %); decode {row['speedup_b1']:.2f}× dense fp32 at batch 1; "
            f"pruned fp32 {fp32['speedup_b1_same_precision']:.2f}× dense fp32"
        )
    for h in results["head_to_head"]:
        verdict = "lower, beyond its interval" if h["lower_beyond_interval"] else "**not** lower beyond its interval"
        lines.append(
            f"- at target {h['target']:g}: {h['ours']} / {h['baseline']}: "
            f"test perplexity ratio {h['test_ppl_ratio']:.3f}"
            f"{_interval(h['ci'], 1, '{:.3f}')} ({verdict}); ours decodes {h['ours_faster_by']:.2f}× its speed"
        )
    return lines


def _search_text(results: dict) -> str:
    searched = results.get("plan_search_s") or {}
    if not searched:
        return ""
    parts = [f"target {float(t):g}: {s / 60:.1f} min" for t, s in searched.items()]
    head = "Pruning (every feasible plan cut, reconstructed and scored, the best timed against dense): "
    return head + "; ".join(parts) + ". "


def _loop_text(results: dict) -> str:
    loops = results.get("loop") or {}
    if not loops:
        return ""
    parts = [
        f"target {float(t):g}: " + " → ".join(f"{r['shape']} at {r['measured_ratio']:.3f}" for r in rounds)
        for t, rounds in loops.items()
    ]
    return (
        "Closed loop (the best plan timed against dense fp32 before recovery; while it measured slower than the "
        "target, a narrower plan was chosen by quality and timed; the last is kept): " + "; ".join(parts) + ". "
    )


def _recovery_text(results: dict) -> str:
    spent = results.get("recovery") or {}
    if not spent:
        return "**No recovery training** ran (0 tokens): every figure is of the cut alone."
    parts = [
        f"target {float(t):g}: {r['tokens']:,} tokens in {r['wall_s'] / 60:.1f} min "
        f"({r['tokens'] / r['wall_s']:.0f} tokens/s, {r.get('compute_dtype', 'fp32')} compute, lr {r['lr']:g}; "
        f"distillation loss {r['first_loss']:.3f} → "
        f"{r['last_loss']:.3f})"
        for t, r in spent.items()
    ]
    return (
        "Recovery of ours by distillation from dense fp32 on training blocks (the baselines get none; "
        "the `cut only` rows are ours before it): " + "; ".join(parts) + "."
    )


def write_decoder_report(results: dict) -> str:
    """The markdown report of one decoder workload."""
    config, machine, cost = results["config"], results["machine"], results["cost_model"]
    selected = results["decoder_selected"]
    lines = [
        f"# {results['workload']}: perplexity against decode time",
        "",
        f"Reproduce: `{results['command']}`",
        "",
        f"Machine: {machine['cpu']} ({machine.get('cpu_features', '')}), {machine['cores']} cores; ONNX Runtime "
        f"{machine['onnxruntime']} through onnxruntime-genai, {machine['threads']} thread(s); {machine['date']}; "
        f"wall time {results['wall_s'] / 60:.0f} min. Every model exported by onnxruntime-genai's builder and timed "
        f"interleaved in one process: {config['rounds']} rounds of a {config['prompt_length']}-token prompt and "
        f"{config['new_tokens']} generated tokens (end-of-sequence suppressed), medians. TTFT: prefill and first "
        "token; TPOT: each further token with the KV cache.",
        "",
        f"Perplexity from each exported model's own logits on {config['block_length']}-token blocks: validation "
        f"({config['val_blocks']} blocks) chooses, test ({config['test_blocks']} blocks, documents never seen by "
        "calibration or plan search) reports, with a bootstrap interval over blocks; Δ is paired against dense "
        f"fp32 on the same blocks. Out-of-domain: `{Path(config['out_of_domain'] or '-').name}`. Calibration: "
        f"{config['calibration_blocks']} training blocks. {_search_text(results)}{_loop_text(results)}"
        f"{_recovery_text(results)}",
        "",
        "![frontier](frontier.png)",
        "",
        *_table(results),
        "",
        *_verdicts(results),
        "",
        f"**Selected** (deployed, validation perplexity within +{100 * config['perplexity_budget']:.0f} %): "
        + (
            f"{selected['name']}"
            if selected
            else (
                "none: no target's deployed model is within the budget"
                + (" after its recovery" if config.get("recovery_tokens") else " (no recovery was run)")
            )
        ),
        "",
        "Decode cost model (fitted on the shapes below, batch 1, fp32): "
        f"{cost['intercept_ms']:.2f} ms + {cost['slope_ms'] * 1e6:.3f} ms per million layer weights "
        f"(RMS residual {cost['residual_ms']:.2f} ms). The intercept (output projection over the vocabulary, "
        f"embedding, runtime overhead) is **{100 * cost['untouchable_share']:.0f} %** of dense decode time, which no "
        f"layer cut removes; the tied output projection alone is {100 * cost['output_weight_share']:.0f} % of the "
        "weights a token reads.",
        "",
        "| timed shape | layer weights | TPOT b1 (ms) | fitted (ms) |",
        "|---|---|---|---|",
        *(
            f"| {t['shape']} | {t['layer_weights']:,} | {t['tpot_ms']:.2f} | {t['predicted_ms']:.2f} |"
            for t in results["latency_table"]
        ),
        "",
        "Plans tried per target (search perplexity on validation blocks kept apart from the reported ones):",
        "",
        *(
            f"- {float(t):g}: " + "; ".join(f"{p['shape']} → {math.exp(p['search_nll']):.2f}" for p in tried)
            for t, tried in results["plans"].items()
        ),
        "",
    ]
    return "\n".join(lines)


def plot_decoder_frontier(results: dict, path: Path) -> None:
    """Test perplexity against measured time per output token (batch 1), one marker per model kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    markers = {"dense": "s", "ours": "o", "ours, cut only": "D", "uniform width": "^", "depth": "v"}
    for kind, marker in markers.items():
        rows = [r for r in results["rows"] if r["kind"] == kind]
        if not rows:
            continue
        ax.scatter([r["tpot_b1_ms"] for r in rows], [r["test_ppl"] for r in rows], marker=marker, label=kind, s=50)
        for r in rows:
            ax.annotate(
                r["name"], (r["tpot_b1_ms"], r["test_ppl"]), fontsize=7, xytext=(4, 3), textcoords="offset points"
            )
    ax.set_xlabel("time per output token, batch 1 (ms)")
    ax.set_ylabel("test perplexity (in-domain)")
    ax.set_yscale("log")
    ax.set_title(f"{results['workload']}: perplexity against decode time")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
