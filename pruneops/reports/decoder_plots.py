"""The decoder path's PNGs (what `dvc plots` would draw from a CDN, drawn here)."""

from __future__ import annotations

from pathlib import Path

from pruneops.reports.plots import _pyplot


def _save(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)


def plot_note(text: str, path: Path) -> None:
    """A panel that says why there is nothing to draw."""
    fig, ax = _pyplot().subplots(figsize=(5, 2.5))
    ax.text(0.5, 0.5, text, ha="center", va="center", wrap=True)
    ax.set_axis_off()
    _save(fig, path)


def plot_layer_sensitivity(rows: list[dict], path: Path) -> None:
    """Validation perplexity added by removing each layer alone, and its block influence."""
    fig, (top, bottom) = _pyplot().subplots(2, 1, figsize=(7.5, 5), sharex=True)
    layers = [r["layer"] for r in rows]
    top.bar(layers, [100 * r["perplexity_increase"] for r in rows])
    top.set_ylabel("perplexity added (%)")
    top.set_title("Each decoder layer removed alone")
    bottom.bar(layers, [r["block_influence"] for r in rows], color="tab:orange")
    bottom.set_ylabel("block influence")
    bottom.set_xlabel("layer")
    for ax in (top, bottom):
        ax.grid(alpha=0.3, axis="y")
    _save(fig, path)


def plot_cost_model(rows: list[dict], path: Path) -> None:
    """Measured against predicted time of the timed shapes: per output token, and to the first token."""
    panels = [("tpot_ms", "predicted_ms", "ms per token (batch 1)", "Decode cost model")]
    if all("ttft_ms" in r for r in rows):
        panels.append(("ttft_ms", "predicted_ttft_ms", "ms to first token (batch 1)", "Prefill cost model"))
    fig, axes = _pyplot().subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (measured_key, predicted_key, unit, title) in zip(axes[0], panels, strict=True):
        measured = [r[measured_key] for r in rows]
        predicted = [r[predicted_key] for r in rows]
        ax.scatter(measured, predicted)
        for r in rows:
            ax.annotate(r["shape"], (r[measured_key], r[predicted_key]), fontsize=6)
        low, high = min(measured + predicted) * 0.95, max(measured + predicted) * 1.05
        ax.plot([low, high], [low, high], color="grey", lw=1, ls=":")
        ax.set_xlabel(f"measured {unit}")
        ax.set_ylabel(f"predicted {unit}")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    _save(fig, path)


def plot_plans(rows: list[dict], chosen: str, path: Path, unit: str = "ms per token") -> None:
    """Each feasible plan's predicted time (in `unit`, batch 1) against its search perplexity, the kept one marked."""
    fig, ax = _pyplot().subplots(figsize=(6, 4))
    for r in rows:
        kept = r["shape"] == chosen
        ax.scatter(r["predicted_ms"], r["search_perplexity"], color="tab:red" if kept else "tab:blue")
        ax.annotate(r["shape"], (r["predicted_ms"], r["search_perplexity"]), fontsize=6)
    ax.set_xlabel(f"predicted {unit} (batch 1)")
    ax.set_ylabel("perplexity on the search blocks")
    ax.set_title("Feasible plans (red: kept)")
    ax.grid(alpha=0.3)
    _save(fig, path)


def plot_shape(dense: dict, kept: dict, path: Path) -> None:
    """The kept shape as a fraction of dense: layers, KV groups, queries per group, MLP width."""
    keys = ["layers", "kv_groups", "queries_per_group", "mlp_width"]
    fig, ax = _pyplot().subplots(figsize=(6, 3.5))
    ax.bar(keys, [kept[k] / dense[k] for k in keys])
    ax.axhline(1.0, color="grey", lw=1, ls=":")
    ax.set_ylabel("kept / dense")
    ax.set_title("Shape kept")
    _save(fig, path)


def plot_decoder_frontier(rows: list[dict], path: Path) -> None:
    """Test perplexity against time per output token at batch 1, one point per model."""
    fig, ax = _pyplot().subplots(figsize=(6, 4))
    for r in rows:
        ax.scatter(r["latency_b1_ms"], r["test_perplexity"])
        ax.annotate(r["name"], (r["latency_b1_ms"], r["test_perplexity"]), fontsize=7)
    ax.set_xlabel("ms per output token (batch 1)")
    ax.set_ylabel("test perplexity")
    ax.set_title("Decode time and perplexity")
    ax.grid(alpha=0.3)
    _save(fig, path)
