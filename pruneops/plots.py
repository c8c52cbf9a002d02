"""Static PNG plots (DVC's HTML plots need a CDN; these do not)."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_history(rows: list[dict], x: str, panels: list[tuple[str, list[str]]], title: str, path: Path) -> None:
    """One panel per (ylabel, keys) of `rows` against `x`."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    xs = [r[x] for r in rows]
    for ax, (ylabel, keys) in zip(axes[0], panels, strict=True):
        for key in keys:
            ax.plot(xs, [r[key] for r in rows], marker="o", ms=3, label=key)
        ax.set_xlabel(x)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save_fit_history(history: list[dict], plots_dir: Path, title: str) -> None:
    """Writes a training history as `history.json` (for `dvc plots`) and `history.png`."""
    from pruneops.io import dump_json

    dump_json(history, plots_dir / "history.json")
    panels = [("loss", ["train_loss", "val_loss"]), ("accuracy", ["val_accuracy"])]
    plot_history(history, "epoch", panels, title, plots_dir / "history.png")


def plot_sensitivity(curves: dict[str, dict], allocation: dict[str, float], path: Path) -> None:
    """Accuracy drop vs ratio per group, with each group's allocated ratio marked."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for name, curve in curves.items():
        line = ax.plot(curve["ratios"], [100 * d for d in curve["accuracy_drop"]], marker="o", ms=3, label=name)[0]
        if name in allocation and allocation[name] > 0:
            ax.axvline(allocation[name], color=line.get_color(), ls=":", lw=1)
    ax.set_xlabel("fraction of the group's channels/heads removed (alone)")
    ax.set_ylabel("validation accuracy drop (points)")
    ax.set_title("Layer sensitivity (dotted: allocated ratio)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_frontier(points: list[dict], path: Path, latency_key: str) -> None:
    """Test accuracy vs latency, one labelled point per model."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for p in points:
        ax.scatter(p[latency_key], 100 * p["test_accuracy"], s=40)
        ax.annotate(
            p["name"], (p[latency_key], 100 * p["test_accuracy"]), textcoords="offset points", xytext=(5, 4), fontsize=8
        )
    ax.set_xscale("log")
    ax.set_xlabel(f"{latency_key.replace('_', ' ')} (ms, ONNX Runtime CPU, log scale)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("Accuracy vs latency")
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
