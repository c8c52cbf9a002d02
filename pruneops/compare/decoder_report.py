"""A causal-LM workload's bench report: perplexity against decode time, every row measured in one run."""

from __future__ import annotations

from pathlib import Path

from pruneops.compare.decoders import selection_budgets
from pruneops.core.io import read_json
from pruneops.core.quality import DenseShips, QualityBudget, QualityChange, beyond_corpus
from pruneops.reports.plots import _pyplot


def _change(row: dict, split: str) -> str:
    change = row.get(f"{split}_change")
    return QualityChange(**change).text().replace(" % ", " ") if change else "–"


def _table(rows: list[dict], batches: list[int]) -> list[str]:
    big = max(batches)
    general = any("general_perplexity" in r for r in rows)
    zero_shot = any(r.get("zero_shot_change") for r in rows)
    fastest = any(r.get("speedup_b1_vs_fastest_dense") for r in rows)
    head = ["model", "shape", "val ppl", "Δ val (%) [95% CI]", "test ppl", "Δ test (%) [95% CI]"]
    head += ["general ppl", "Δ general (%) [95% CI]"] if general else []
    head += ["zero-shot (%)", "Δ zero-shot (pts) [95% CI]"] if zero_shot else []
    head += ["TTFT b1 (ms)", "TPOT b1 (ms)", f"TPOT b{big} (ms)", "b1 decode speed-up", "vs dense as deployed"]
    head += ["vs fastest dense"] if fastest else []
    head += ["predicted TPOT b1 (ms)", "size (MiB)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        predicted = r.get("predicted_tpot_b1_ms")
        cells = [_name(r),
                 r["shape"], f"{r['val_perplexity']:.2f}", _change(r, "val"), f"{r['test_perplexity']:.2f}",
                 _change(r, "test")]  # fmt: skip
        if general:
            cells += [f"{r['general_perplexity']:.2f}" if "general_perplexity" in r else "–", _change(r, "general")]
        if zero_shot:
            accuracy = r.get("zero_shot_accuracy")
            cells += [f"{100 * accuracy:.1f}" if accuracy is not None else "–", _change(r, "zero_shot")]
        batch = r.get(f"tpot_b{big}_ms")  # llama.cpp times one sequence at a time
        cells += [f"{r['ttft_b1_ms']:.1f}", f"{r['tpot_b1_ms']:.2f}", f"{batch:.2f}" if batch else "–"]
        cells += [f"{r['speedup_b1']:.2f}×", f"{r['speedup_b1_vs_dense_deployed']:.2f}×"]
        cells += [f"{r['speedup_b1_vs_fastest_dense']:.2f}×" if r.get("speedup_b1_vs_fastest_dense") else "–"] * fastest
        cells += [f"{predicted:.2f} ({100 * (predicted / r['tpot_b1_ms'] - 1):+.1f} %)" if predicted else "–"]
        cells += [f"{r['size_bytes'] / 2**20:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _name(row: dict) -> str:
    """`ours 0.7 int8, deployed`; dense's fastest form within the budgets, and a back-off to dense, say so."""
    runtime = f" ({row['runtime']})" if row.get("runtime", "genai") != "genai" else ""
    name = f"{row['label']} {row['precision']}{runtime}" + (", deployed" if row["deployed"] else "")
    if row.get("fastest_dense"):
        name += ", the fastest dense within the budgets"
    dense_ships = DenseShips.of_row(row)
    return name + (f" (dense: {dense_ships.why})" if dense_ships else "")


WHERE = {
    "val_change": "validation perplexity",
    "general_val_change": "general text's gating half",
    "zero_shot_val_change": "the zero-shot check's gating half",
}


def _held(budgets: dict[str, QualityBudget]) -> str:
    """`validation perplexity +15 %, general text's gating half +15 % and …`: the budgets that are set."""
    parts = [f"{WHERE[k]} {b.text().replace(' perplexity', '')}" for k, b in budgets.items() if b.limit is not None]
    return ", ".join(parts[:-1]) + f" and {parts[-1]}" if len(parts) > 1 else parts[0]


def _selected(pick: dict | None, budgets: dict[str, QualityBudget], forms: list[dict]) -> list[str]:
    """The selected row's line (`selection_budgets`: what it held), and where test disagrees with validation."""
    if pick is None:
        return [f"**Selected**: none of ours holds {_held(budgets)} at its interval's far end."]
    test = QualityChange(**pick["test_change"])
    line = (
        f"**Selected** (the fastest of ours that holds {_held(budgets)}, each at the far end of its 95 % "
        f"interval): {_name(pick)} ({pick['shape']}): decode "
        f"{pick['speedup_b1']:.2f}× dense fp32 at batch 1 ({pick['speedup_b1_vs_dense_deployed']:.2f}× dense as "
        "deployed"
    )
    line += f"{_versus_q4_k_m(pick, forms)}); test perplexity {test.text()}, validation "
    line += QualityChange(**pick["val_change"]).text() + beyond_corpus(pick)
    lines = [line + "."]
    val = budgets["val_change"]
    if not val.holds(test):
        lines.append(
            f"- test disagrees: its test interval's far end ({test.text()}) is beyond the {val.text()} "
            "budget that validation held"
        )
    return lines


def _versus(rows: list[dict]) -> list[str]:
    by_name = {r["name"]: r for r in rows}
    lines = []
    for r in rows:
        for other, change in r.get("paired_against", {}).items():
            o, c = by_name[other], QualityChange(**change)
            beyond = "beyond its interval" if (c.high < 0 or c.low > 0) else "within its interval"
            lines.append(
                f"- {_name(r)} / {_name(o)}: test perplexity ratio "
                f"{1 + c.value:.3f} [{1 + c.low:.3f}, {1 + c.high:.3f}] ({beyond}); ours decodes "
                f"{o['tpot_b1_ms'] / r['tpot_b1_ms']:.2f}× its speed"
            )
    return lines


def _cost_and_plans(directory: Path | None) -> list[str]:
    if directory is None or not (directory / "decode_cost.json").is_file():
        return []
    cost = read_json(directory / "decode_cost.json")
    fit = cost["cost"]
    lines = [
        f"Decode cost model of `{directory.name}` (fitted on the shapes below, batch 1, fp32): "
        f"{fit['intercept_ms']:.2f} ms + {fit['slope_ms'] * 1e6:.3f} ms per million layer weights (RMS residual "
        f"{fit['residual_ms']:.2f} ms).",
        "",
        "| timed shape | TPOT b1 (ms) | fitted (ms) |",
        "|---|---|---|",
        *(f"| {t['shape']} | {t['tpot_ms']:.2f} | {t['predicted_ms']:.2f} |" for t in cost["table"]),
        "",
    ]
    if (directory / "plan.json").is_file():
        plan = read_json(directory / "plan.json")
        tried = "; ".join(f"{p['shape']} → {p['search_perplexity']:.2f}" for p in plan.get("plans", []))
        loop = " → ".join(f"{r['shape']} at {r['measured_ratio']:.3f}" for r in plan.get("loop", []))
        lines += [f"Plans tried (search perplexity): {tried}.", "", f"Closed loop (measured of dense): {loop}.", ""]
    return lines


def _runtimes(machine: dict) -> str:
    """`onnxruntime-genai 0.18.0 (ONNX Runtime 1.31.1)`, and llama-cpp-python's version where it timed rows."""
    ort = f"(ONNX Runtime {machine.get('onnxruntime', '?')})"
    genai = f"onnxruntime-genai {machine.get('onnxruntime_genai', '?')} {ort}"
    return genai + (f", llama-cpp-python {machine['llama_cpp_python']}" if "llama_cpp_python" in machine else "")


def dense_forms(workload, dirs: dict[str, Path]) -> list[dict]:
    """Every form of dense its quantize stage measured: what quantisation alone gives a user who never prunes.

    Each form's changes against dense fp32 (validation, and the gating halves of general text and the
    zero-shot check), its times from that stage (every form timed interleaved with the others, batch 1)
    and its speed-ups over dense fp32 there, whether it is within the budgets, and which one the stage
    ships for dense (`shipped`). Empty without a dense variant.
    """
    dense = next((v.name for v in workload.variants if v.kind == "dense" and v.name in dirs), None)
    quantize = read_json(dirs[dense] / "metrics.json").get("quantize", {}) if dense else {}
    candidates = quantize.get("candidates", {})
    if "fp32" not in candidates:
        return []
    fp32 = candidates["fp32"]
    keys = ("runtime", "precision", "val_change", "general_change", "zero_shot_change", "tpot_b1_ms", "ttft_b1_ms",
            "within_budget")  # fmt: skip
    return [
        {"name": name, **{k: c[k] for k in keys if k in c}, "speedup_b1": fp32["tpot_b1_ms"] / c["tpot_b1_ms"],
         "ttft_vs_fp32": c["ttft_b1_ms"] / fp32["ttft_b1_ms"], "shipped": name == quantize.get("fastest_dense")}
        for name, c in candidates.items()
    ]  # fmt: skip


def versus_form(pick: dict, forms: list[dict], precision: str = "q4_k_m") -> tuple[dict, float] | None:
    """The dense form in `precision` and the pick's decode speed-up over it (None where dense has no such form).

    Each speed-up is over dense fp32 in its own interleaved timing (the pick's in the bench's, the
    form's in dense's quantize stage), so the ratio compares two ratios measured on this machine in one run.
    """
    form = next((f for f in forms if f["precision"] == precision), None)
    return (form, pick["speedup_b1"] / form["speedup_b1"]) if form else None


def _dense_forms_lines(forms: list[dict]) -> list[str]:
    """The table of what quantisation alone gives (`dense_forms`)."""
    if not forms:
        return []
    lines = [
        "What quantisation alone gives: dense in every form its quantize stage measured, scored on validation "
        "and the gating halves of general text and the zero-shot check, timed interleaved with one another "
        "there (batch 1). A form ships only within every budget and at most 10 % slower to the first token "
        "than dense fp32 (`quantize.other_metric_tolerance`).",
        "",
        "| dense form | Δ val (%) [95% CI] | Δ general (%) [95% CI] | Δ zero-shot (pts) [95% CI] | TTFT b1 (ms) "
        "| TTFT vs fp32 | TPOT b1 (ms) | b1 decode speed-up | within the budgets |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for f in forms:
        runtime = {"genai": "onnxruntime-genai", "llamacpp": "llama.cpp"}.get(f["runtime"], f["runtime"])
        verdict = ("yes" if f.get("within_budget") else "no") + (", ships for dense" if f["shipped"] else "")
        cells = [f"{f['precision']} ({runtime})", _change(f, "val"), _change(f, "general"), _change(f, "zero_shot"),
                 f"{f['ttft_b1_ms']:.1f}", f"{f['ttft_vs_fp32']:.2f}×", f"{f['tpot_b1_ms']:.2f}",
                 f"{f['speedup_b1']:.2f}×", verdict]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def _in_domain_line(alone: dict | None, budgets: dict[str, QualityBudget], forms: list[dict]) -> list[str]:
    """Ours held to the in-domain budget alone, where that is another row than the pick: what the corpus allows."""
    if alone is None:
        return []
    line = (
        f"Within the in-domain budget alone ({budgets['val_change'].text().replace(' perplexity', '')} on "
        f"validation), the fastest of ours is {_name(alone)} ({alone['shape']}): "
        f"{alone['speedup_b1']:.2f}× dense fp32 ({alone['speedup_b1_vs_dense_deployed']:.2f}× dense as deployed"
    )
    line += f"{_versus_q4_k_m(alone, forms)}); test perplexity {QualityChange(**alone['test_change']).text()}"
    return [line + beyond_corpus(alone) + ".", ""]


def _versus_q4_k_m(row: dict, forms: list[dict]) -> str:
    """`, 1.45× dense Q4_K_M in llama.cpp` (`versus_form`), or nothing where dense has no Q4_K_M form."""
    versus = versus_form(row, forms)
    return f", {versus[1]:.2f}× dense Q4_K_M in llama.cpp" if versus else ""


def write_decoder_report(
    workload,
    rows: list[dict],
    selected: dict | None,
    failed: dict,
    machine: dict,
    timing,
    command: str,
    dirs,
    forms: list[dict],
    in_domain: dict | None,
) -> str:
    """The markdown report of one causal-LM workload.

    `forms`: what quantisation alone gives (`dense_forms`); `in_domain`: ours held to the in-domain
    budget alone, where that is another row than `selected` (None otherwise).
    """
    ours = next((dirs[v.name] for v in workload.variants if v.family == "ours" and v.name in dirs), None)
    recovery = read_json(ours / "metrics.json").get("finetune", {}) if ours else {}
    lines = [
        f"# {workload.name}: perplexity against decode time",
        "",
        f"Reproduce: `{command}`",
        "",
        f"Machine: {machine['cpu']} ({machine.get('cpu_features', '')}), {machine['cores']} cores; "
        f"{_runtimes(machine)}, {timing.threads} thread(s); {machine['date']}. "
        "Each variant ran as a DVC experiment of the workload's "
        "project; every exported decoder was then timed interleaved in one process, "
        f"{timing.rounds} rounds of a {timing.prompt_length}-token prompt and {timing.new_tokens} generated tokens, "
        "medians (TTFT: prefill and first token; TPOT: each further token with the KV cache).",
        "",
        "Perplexity from each exported model's own logits on the workload's blocks: validation chooses, test "
        "reports, general text (beyond the corpus's domain) beside them; Δ is paired against dense fp32 on the same "
        "blocks, with a 95 % bootstrap interval over blocks.",
    ]
    if recovery.get("tokens"):
        lines += [
            "",
            f"Recovery of ours: {recovery['tokens']:,} tokens in {recovery['wall_s'] / 60:.1f} min "
            f"({recovery['tokens_per_second']:.0f} tokens/s), validation perplexity "
            f"{recovery['val_perplexity_before']:.2f} → {recovery['val_perplexity']:.2f} "
            f"(dense {recovery['dense_val_perplexity']:.2f}).",
        ]
    lines += ["", "![frontier](frontier.png)", "", *_table(rows, [1, *timing.batch_sizes]), ""]
    lines += [f"- {name}: not measured — {why}" for name, why in failed.items()]
    budgets = selection_budgets(workload)
    lines += ["", *_dense_forms_lines(forms), *_selected(selected, budgets, forms), ""]
    lines += [*_in_domain_line(in_domain, budgets, forms), *_versus(rows), "", *_cost_and_plans(ours)]
    return "\n".join(lines).rstrip() + "\n"


def plot_decoder_bench(rows: list[dict], title: str, path: Path) -> None:
    """Perplexity against measured time per output token (batch 1), one marker per family.

    In-domain test perplexity on the left; general text's (beyond the corpus) on the right where
    the rows have it, on the same time axis, so what a cut costs beyond the corpus is seen beside it.
    """
    plt = _pyplot()
    panels = [("test_perplexity", "test perplexity (in-domain)")]
    if any("general_perplexity" in r for r in rows):
        panels.append(("general_perplexity", "general-text perplexity (beyond the corpus)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), 5), squeeze=False)
    for ax, (key, label) in zip(axes[0], panels, strict=True):
        _scatter_families([r for r in rows if key in r], key, ax)
        ax.set_xlabel("time per output token, batch 1 (ms)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{title}: perplexity against decode time")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _scatter_families(rows: list[dict], key: str, ax) -> None:
    """One marker per family; each point labelled with its variant and precision (log scale over a 10× range)."""
    markers = {"dense": "s", "ours": "o", "torch_pruning": "^", "shortgpt": "v", "naive": "x"}
    for family, marker in markers.items():
        mine = [r for r in rows if r["family"] == family]
        if not mine:
            continue
        ax.scatter([r["tpot_b1_ms"] for r in mine], [r[key] for r in mine], marker=marker, label=family)
        for r in mine:
            ax.annotate(f"{r['label']} {r['precision']}", (r["tpot_b1_ms"], r[key]), fontsize=7, xytext=(4, 3),
                        textcoords="offset points")  # fmt: skip
    if rows and max(r[key] for r in rows) / min(r[key] for r in rows) > 10:
        ax.set_yscale("log")
