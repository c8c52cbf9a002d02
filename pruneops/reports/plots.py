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
    from pruneops.core.io import dump_json

    dump_json(history, plots_dir / "history.json")
    panels = [("loss", ["train_loss", "val_loss"]), ("accuracy", ["val_accuracy"])]
    plot_history(history, "epoch", panels, title, plots_dir / "history.png")


def plot_sensitivity(curves: dict[str, dict], allocation: dict[str, float], path: Path) -> None:
    """Accuracy drop (or a Fisher sweep's predicted loss increase) vs ratio per unit, allocated ratios marked."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    if not curves:
        ax.text(0.5, 0.5, "no sensitivity allocation (uniform ratios)", ha="center", va="center")
    measured = all("accuracy_drop" in c for c in curves.values())
    for name, curve in curves.items():
        cost = [100 * d for d in curve["accuracy_drop"]] if measured else curve["predicted_loss_increase"]
        line = ax.plot(curve["ratios"], cost, marker="o", ms=3, label=name)[0]
        if name in allocation and allocation[name] > 0:
            ax.axvline(allocation[name], color=line.get_color(), ls=":", lw=1)
    ax.set_xlabel("fraction of the group's channels/heads removed (alone)")
    ax.set_ylabel("validation accuracy drop (points)" if measured else "predicted loss increase (Fisher, nats)")
    ax.set_title("Sensitivity per unit" + (" (dotted: allocated ratio)" if allocation else ""))
    ax.grid(alpha=0.3)
    if curves:
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_frontier(points: list[dict], path: Path, latency_key: str) -> None:
    """Test accuracy vs latency, one labelled point per model."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    labels = []
    for p in points:
        ax.scatter(p[latency_key], 100 * p["test_accuracy"], s=40)
        labels.append(
            ax.annotate(
                p["name"],
                (p[latency_key], 100 * p["test_accuracy"]),
                textcoords="offset points",
                xytext=(5, 4),
                fontsize=8,
            )
        )
    ax.set_xscale("log")
    ax.set_xlabel(f"{latency_key.replace('_', ' ')} (ms, ONNX Runtime CPU, log scale)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("Accuracy vs latency")
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    spread_labels_(ax, labels)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def pareto_front(rows: list[dict]) -> list[dict]:
    """The rows no other row beats on both batch-1 latency and test accuracy, fastest first."""
    front, best = [], -1.0
    for r in sorted(rows, key=lambda r: (r["latency"]["1"]["p50_ms"], -r["test_accuracy"])):
        if r["test_accuracy"] > best:
            front.append(r)
            best = r["test_accuracy"]
    return front


def _pad_limits(ax, xs: list[float], ys: list[float]) -> None:
    """Limits that hold every point and its label: autoscaling a log axis clipped the slowest point."""
    ax.set_xlim(min(xs) / 1.15, max(xs) * 1.4)  # room on the right for the slowest point's label
    span = max(max(ys) - min(ys), 0.2)
    ax.set_ylim(min(ys) - 0.25 * span, max(ys) + 0.15 * span)


FAMILY_COLORS = {"dense": "black", "naive": "tab:red", "torch_pruning": "tab:orange", "ours": "tab:blue"}
FAMILY_NAMES = {
    "dense": "dense",
    "naive": "naive 90% unstructured",
    "torch_pruning": "Torch-Pruning",
    "ours": "PruneOps",
}


def plot_frontiers(rows: dict[str, list[dict]], path: Path) -> None:
    """Test accuracy vs batch-1 latency, one panel per workload; our recipe's Pareto front joined."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(rows), figsize=(8.5 * len(rows), 4.8), squeeze=False)
    marks = []
    for ax, (workload, items) in zip(axes[0], rows.items(), strict=True):
        marks.append((ax, draw_frontier_(ax, workload, items)))
    fig.tight_layout()
    for ax, texts in marks:  # once the layout has placed the axes: overlaps are in pixels
        spread_labels_(ax, texts)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def draw_frontier_(ax, workload: str, items: list[dict]) -> list:
    """Draws one workload's rows on `ax`: a marker per row, our Pareto front joined.

    Each marker carries its variant's number, named in a key below the axes.

    Returns:
        The number labels, to be spread apart (`spread_labels_`) once the figure's layout is final.
    """
    if not items:  # every variant failed: the report says why
        ax.set_title(workload)
        ax.text(0.5, 0.5, "no model finished (the report says why)", ha="center", transform=ax.transAxes)
        ax.set_axis_off()
        return []
    front = pareto_front([r for r in items if r["family"] == "ours"])
    ax.plot(
        [r["latency"]["1"]["p50_ms"] for r in front],
        [100 * r["test_accuracy"] for r in front],
        "-",
        color="tab:blue",
        alpha=0.5,
        label="PruneOps front",
    )
    for family, color in FAMILY_COLORS.items():
        for precision, marker in (("fp32", "o"), ("int8", "s")):
            # Deployed rows in fp32 (where no INT8 form was faster) are drawn as fp32.
            pts = [r for r in items if r["family"] == family and r["precision"] == precision]
            if pts:
                ax.scatter(
                    [r["latency"]["1"]["p50_ms"] for r in pts],
                    [100 * r["test_accuracy"] for r in pts],
                    color=color,
                    marker=marker,
                    s=45,
                    facecolors="none" if precision == "fp32" else color,
                    label=f"{FAMILY_NAMES[family]} {precision}",
                )
    xs = [r["latency"]["1"]["p50_ms"] for r in items]
    ax.set_xscale("log")
    _pad_limits(ax, xs, [100 * r["test_accuracy"] for r in items])
    # Each point carries its variant's number and a key below the axes names it: full labels at
    # points that share a latency (a variant's fp32 and INT8 forms, a latency-matched pair) wrote
    # over each other.
    numbers = {label: n for n, label in enumerate(dict.fromkeys(r["label"] for r in items), start=1)}
    marks = [
        ax.annotate(
            str(numbers[r["label"]]),
            (r["latency"]["1"]["p50_ms"], 100 * r["test_accuracy"]),
            textcoords="offset points",
            xytext=(4, 3),
            fontsize=7,
        )
        for r in items
    ]
    ax.annotate(
        "\n".join(f"{n}  {label}" for label, n in numbers.items()),
        xy=(0.0, 0.0),
        xycoords=("axes fraction", ax.xaxis.label),
        xytext=(0, -6),
        textcoords="offset points",
        va="top",
        fontsize=7,
    )
    ax.set_xlabel("batch-1 p50 latency (ms, ONNX Runtime CPU, log); hollow fp32, filled int8")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(workload)
    ax.grid(alpha=0.3, which="both")
    # Outside the axes: inside, it hid a point on a crowded workload.
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return marks


def spread_labels_(ax, texts: list) -> None:
    """Moves each label up until it overlaps none placed before it, lowest points first.

    Labels that moved more than a line away from their point get a thin line back to it.
    """
    renderer = ax.figure.canvas.get_renderer()
    placed = []
    for text in sorted(texts, key=lambda t: (t.xy[1], t.xy[0])):
        start = text.xyann
        for _ in range(len(texts)):
            box = text.get_window_extent(renderer)
            hit = next((b for b in placed if box.overlaps(b)), None)
            if hit is None:
                break
            x, y = text.xyann
            text.xyann = (x, y + (hit.y1 - box.y0 + 1) * 72 / ax.figure.dpi)
        placed.append(text.get_window_extent(renderer))
        if text.xyann[1] - start[1] > text.get_fontsize():
            ax.annotate(
                "",
                text.xy,
                xytext=text.get_position(),
                textcoords="offset points",
                arrowprops={"arrowstyle": "-", "lw": 0.4, "color": "0.5", "shrinkA": 0, "shrinkB": 3},
            )


def _grouped(items: list[dict]) -> dict[tuple[str, int], list[dict]]:
    groups: dict[tuple[str, int], list[dict]] = {}
    for p in items:
        groups.setdefault((p.get("form", "fp32"), p.get("batch", 1)), []).append(p)
    return groups


def plot_latency_predictions(predictions: dict[str, list[dict]], path: Path) -> None:
    """Predicted vs measured latency of the planned widths, every workload, with the ±15% band.

    Each point is at its target's batch size and in its latency form (fp32 or INT8); the marker says which.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 5))
    points = [p for items in predictions.values() for p in items]
    top = max(max(p["predicted_ms"], p["measured_ms"]) for p in points) * 1.15
    ax.plot([0, top], [0, top], color="black", lw=1, label="exact")
    ax.fill_between([0, top], [0, 0.85 * top], [0, 1.15 * top], color="grey", alpha=0.2, label="±15%")
    for workload, items in predictions.items():
        for (form, batch), group in _grouped(items).items():
            ax.scatter(
                [p["measured_ms"] for p in group],
                [p["predicted_ms"] for p in group],
                s=30,
                marker="o" if form == "fp32" else "s",
                label=f"{workload} ({form}, batch {batch})",
            )
    ax.set_xlabel("measured latency (ms)")
    ax.set_ylabel("predicted by the latency table (ms)")
    ax.set_title("Latency table: predicted vs measured")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_latency_staircases(forms: list[dict], reason: str, path: Path) -> None:
    """Predicted model latency with one unit narrowed, per unit: where the fast widths are, one panel per form.

    Each of `forms` is what `pruneops.task.classification.latency` gives for a form: per unit its size, the predicted
    whole-model ms at each grid width, its efficient widths (filled) and the one-unit exports
    timed (crosses). No forms: one panel saying `reason`.
    """
    plt = _pyplot()
    fig, axes = plt.subplots(max(1, len(forms)), 1, figsize=(7.5, 4.5 * max(1, len(forms))), squeeze=False)
    if not forms:
        axes[0, 0].text(0.5, 0.5, f"no latency table: {reason}", ha="center", va="center", wrap=True)
        axes[0, 0].set_axis_off()
    for ax, staircases in zip(axes[:, 0], forms, strict=False):
        _plot_staircase(ax, staircases)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_staircase(ax, staircases: dict) -> None:
    for name, unit in staircases["units"].items():
        size = unit["size"]
        widths, ms = zip(*unit["predicted"], strict=True)
        line = ax.plot([w / size for w in widths], ms, lw=1, drawstyle="steps-post", label=name)[0]
        fast = dict(unit["predicted"])
        ax.scatter(
            [w / size for w in unit["efficient"]], [fast[w] for w in unit["efficient"]], s=10, color=line.get_color()
        )
        if unit["measured"]:
            ax.scatter(
                [w / size for w, _ in unit["measured"]],
                [m for _, m in unit["measured"]],
                marker="x",
                s=25,
                color=line.get_color(),
            )
    if staircases.get("dense_ms"):
        ax.axhline(staircases["dense_ms"], color="black", lw=0.8, ls="--", label="dense (timed)")
    ax.set_xlabel("fraction of the unit's channels/heads kept (the rest of the model dense)")
    ax.set_ylabel(f"predicted model latency (ms, batch {staircases['batch']}, {staircases['form']})")
    ax.set_title(f"Latency table per unit, {staircases['form']} (dots: fast widths; crosses: timed exports)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
