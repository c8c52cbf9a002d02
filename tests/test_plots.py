"""The benchmark's frontier plot keeps every model on the canvas."""

import pytest

from pruneops.plots import _pad_limits, _pyplot


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
