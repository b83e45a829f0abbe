"""The evaluation figures read well: class names and
integer ticks, labelled colour bars, patch grids, plain log ticks, a fixed
accuracy scale, and a reliability diagram whose series do not overlap."""

import numpy as np
import pytest

from keras_vmoe.evaluation import plots


@pytest.fixture
def figures(monkeypatch):
    drawn = []

    def keep(figure, path):
        figure.canvas.draw()  # tick labels are only set when drawn
        drawn.append(figure)
        return path

    monkeypatch.setattr(plots, "save_figure", keep)
    return drawn


def _stats(num_classes=3, experts=4, grid=(4, 4)):
    rng = np.random.default_rng(0)
    tokens = grid[0] * grid[1] + 1
    layer = {
        "expert_load": np.full(experts, 1 / experts),
        "tokens_dropped_fraction": 0.0,
        "expert_position_counts": rng.uniform(0, 10, (experts, tokens)),
        "expert_class_counts": rng.uniform(0, 10, (experts, num_classes)),
        "class_token_counts": np.full(num_classes, 40.0),
    }
    return {"num_images": 10, "ensemble_size": 1, "grid_size": list(grid),
            "has_class_token": True, "layers": {"encoderblock_1": layer}}


def test_routing_heatmaps_name_classes_and_label_colour_bars(figures):
    plots.plot_routing_heatmaps(_stats(), "unused.png", class_names=["cat", "dog", "fox"])
    figure = figures[0]
    load_ax, position_ax, class_ax = figure.axes[:3]
    assert [t.get_text() for t in class_ax.get_xticklabels()] == ["cat", "dog", "fox"]
    assert list(class_ax.get_yticks()) == [0, 1, 2, 3]  # integer expert ticks
    assert list(load_ax.get_xticks()) == [0, 1, 2, 3]
    colour_bars = [ax for ax in figure.axes if ax.get_ylabel() in (
        "share of images routed here", "share of the class's tokens")]
    assert len(colour_bars) == 2
    # Expert x position is drawn as one 4x4 patch grid per expert.
    image = position_ax.get_images()[0].get_array()
    assert image.shape == (4, 4 * 4 + 3)  # 4 tiles side by side, 1-cell gaps
    assert "expert 3" in [t.get_text() for t in position_ax.texts]


def test_routing_heatmaps_fall_back_to_class_ids(figures):
    plots.plot_routing_heatmaps(_stats(), "unused.png")
    labels = [t.get_text() for t in figures[0].axes[2].get_xticklabels()]
    assert labels == ["0", "1", "2"]


def test_capacity_curve_plain_ticks_and_fixed_scale(figures):
    factors = [0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0]
    rows = [{"capacity_factor": c, "batch_priority": bpr, "accuracy": 0.956 + 0.001 * c,
             "tokens_dropped_fraction": max(0.0, 1 - c)}
            for c in factors for bpr in (False, True)]
    plots.plot_capacity_curve({"rows": rows}, "unused.png")
    accuracy_ax = figures[0].axes[0]
    assert accuracy_ax.get_ylim() == (0.0, 1.0)
    labels = [t.get_text() for t in accuracy_ax.get_xticklabels() if t.get_text()]
    assert labels == ["0.05", "0.1", "0.2", "0.3", "0.5", "0.75", "1", "1.5", "2"]
    assert not [t for t in accuracy_ax.xaxis.get_minorticklabels() if t.get_text()]


def test_reliability_diagram_series_do_not_overlap(figures):
    edges = np.linspace(0, 1, 16)
    calibration = {"bin_edges": edges, "bin_accuracy": np.linspace(0.1, 0.9, 15),
                   "bin_confidence": (edges[:-1] + edges[1:]) / 2,
                   "bin_count": np.ones(15), "ece": 0.05}
    plots.plot_reliability_diagram(calibration, "unused.png")
    ax = figures[0].axes[0]
    bars = [p for p in ax.patches]
    assert len(bars) == 15  # one bar series only: accuracy
    assert all(p.get_alpha() in (None, 1.0) for p in bars)
    labels = ax.get_legend_handles_labels()[1]
    assert labels == ["mean confidence in the bin", "calibrated", "accuracy in the bin"]
