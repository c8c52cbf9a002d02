"""The benchmark's frontier plot keeps every model on the canvas."""

import pytest

from pruneops.reports.plots import _pad_limits, _pyplot, draw_frontier_, spread_labels_


@pytest.mark.parametrize(
    ("xs", "ys"),
    [
        # The families run: the slowest point (dense fp32, 1.666 ms) fell outside a log axis.
        ([1.666, 0.552, 0.778, 0.313], [97.67, 97.61, 97.94, 97.86]),
        # Equal accuracies (a span of zero) still get a visible band.
        ([0.612, 0.302, 0.308, 0.232], [98.80, 98.78, 98.80, 98.80]),
    ],
)
def test_every_point_lies_inside_the_limits(xs: list[float], ys: list[float]) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots()
    try:
        ax.set_xscale("log")
        ax.scatter(xs, ys)
        _pad_limits(ax, xs, ys)
        (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
        assert x0 < min(xs) and max(xs) < x1
        assert y0 < min(ys) and max(ys) < y1
    finally:
        plt.close(fig)


def _row(label: str, ms: float, accuracy: float, family: str = "ours", precision: str = "int8") -> dict:
    return {
        "label": label,
        "family": family,
        "precision": precision,
        "test_accuracy": accuracy,
        "latency": {"1": {"p50_ms": ms}},
    }


def _draw(rows: list[dict]):
    """The frontier of `rows` drawn and laid out as the report draws it: figure, axes, number labels."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.5, 4.8))
    marks = draw_frontier_(ax, "w", rows)
    fig.tight_layout()
    spread_labels_(ax, marks)
    fig.canvas.draw()
    return fig, ax, marks


def test_every_label_stays_inside_the_axes_and_the_key_names_each_variant_once() -> None:
    # The text run: the slowest point's label (dense fp32, at the right edge) ran past the axes.
    rows = [
        _row("dense MiniLM fine-tuned, a long label", 12.15, 0.8299, "dense", "fp32"),
        _row("dense MiniLM fine-tuned, a long label", 5.16, 0.8271, "dense"),
        _row("ours (Fisher), latency ratio 0.25", 3.12, 0.8240, precision="fp32"),
        _row("ours (Fisher), latency ratio 0.25", 1.92, 0.8216),
    ]
    fig, ax, marks = _draw(rows)
    try:
        box = ax.get_window_extent()
        assert [m.get_text() for m in marks] == ["1", "1", "2", "2"]
        for mark in marks:
            extent = mark.get_window_extent()
            assert box.contains(extent.x0, extent.y0) and box.contains(extent.x1, extent.y1)
        (key,) = [t for t in ax.texts if "\n" in t.get_text()]
        assert key.get_text().splitlines() == [
            "1  dense MiniLM fine-tuned, a long label",
            "2  ours (Fisher), latency ratio 0.25",
        ]
        # Below the axes and their x label, not over the points.
        assert key.get_window_extent().y1 < ax.xaxis.label.get_window_extent().y0
    finally:
        _pyplot().close(fig)


def test_labels_of_points_at_one_latency_do_not_overlap() -> None:
    # docs/wide-latency: two latency targets gave the same model (one point, two labels) beside
    # a third 3 % away, and their full labels were written over each other.
    rows = [
        _row("dense", 1.787, 0.9914, "dense", "fp32"),
        _row("ours, latency target = the MAC-targeted row's measured ms", 0.0888, 0.9884),
        _row("ours, latency ratio 0.1", 0.0888, 0.9884),
        _row("ours, latency ratio 0.07", 0.0916, 0.9881),
        _row("ours @ TP MACs (MAC target)", 0.0852, 0.9871),
    ]
    fig, _, marks = _draw(rows)
    try:
        boxes = [m.get_window_extent() for m in marks]
        for i, a in enumerate(boxes):
            for b in boxes[i + 1 :]:
                assert not a.overlaps(b)
        # The labels moved off their point are joined to it by a line; those left in place are not.
        lines = [t for t in fig.axes[0].texts if t.get_text() == "" and t.arrow_patch is not None]
        assert 1 <= len(lines) < len(marks)
    finally:
        _pyplot().close(fig)


def test_latency_predictions_say_the_form_and_batch_each_was_timed_at(tmp_path) -> None:
    """A batch-64 INT8 prediction is not a batch-1 fp32 one: the report line and the legend say which."""
    from pruneops.compare.report import _prediction_lines
    from pruneops.reports.plots import plot_latency_predictions

    points = [
        {"label": "a", "predicted_ms": 0.30, "measured_ms": 0.33, "error": -0.09, "form": "fp32", "batch": 1},
        {"label": "b", "predicted_ms": 9.0, "measured_ms": 9.5, "error": -0.05, "form": "static", "batch": 64},
        {"label": "c", "predicted_ms": 0.10, "measured_ms": 0.10, "error": 0.0},  # a report from before the fields
    ]
    lines = _prediction_lines(points)
    assert lines[3:] == [
        "- a: predicted 0.3000 ms, measured 0.3300 ms (-9.0%; fp32, batch 1)",
        "- b: predicted 9.0000 ms, measured 9.5000 ms (-5.0%; static, batch 64)",
        "- c: predicted 0.1000 ms, measured 0.1000 ms (+0.0%; fp32, batch 1)",
    ]
    path = tmp_path / "latency_prediction.png"
    plot_latency_predictions({"w": points}, path)
    assert path.stat().st_size > 10_000
