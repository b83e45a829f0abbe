"""PNG figures of the evaluation (matplotlib, Agg, imported lazily)."""

import numpy as np

from keras_vmoe.evaluation._io import new_figure
from keras_vmoe.evaluation._io import save_figure


def plot_routing_heatmaps(stats, path):
    """Writes the routing heatmaps of `routing_statistics` as one PNG.

    One row per MoE layer: expert load (bars), expert × patch position
    (mean assignments per image; the class token, if any, is dropped and
    the positions follow the patch grid row by row) and, when the
    statistics have labels, expert × class (fraction of each class's
    tokens that the expert processed).

    Args:
        stats: the dict returned by `routing_statistics`.
        path: output PNG path (written atomically).

    Returns:
        The path written.
    """
    layers = stats.get("layers") if isinstance(stats, dict) else None
    if not layers:
        raise ValueError(
            "`stats` must be the dict returned by `routing_statistics` (with "
            "at least one layer in stats['layers'])."
        )
    has_classes = any("expert_class_counts" in v for v in layers.values())
    columns = 3 if has_classes else 2
    figure = new_figure(figsize=(5 * columns, 3.2 * len(layers)))
    axes = figure.subplots(len(layers), columns, squeeze=False)
    images = max(stats["num_images"] * stats.get("ensemble_size", 1), 1)
    for row, (name, layer) in enumerate(layers.items()):
        load = np.asarray(layer["expert_load"])
        ax = axes[row][0]
        ax.bar(np.arange(load.size), load, color="tab:blue")
        ax.axhline(1.0 / load.size, color="gray", linestyle="--", linewidth=1)
        ax.set_title(
            f"{name}: expert load (dropped tokens "
            f"{100 * layer['tokens_dropped_fraction']:.1f}%)", fontsize=9)
        ax.set_xlabel("expert")
        ax.set_ylabel("fraction of assignments")

        positions = np.asarray(layer["expert_position_counts"]) / images  # (E, T)
        if stats.get("has_class_token"):
            positions = positions[:, 1:]
        ax = axes[row][1]
        image = ax.imshow(positions, aspect="auto", cmap="viridis", interpolation="nearest")
        figure.colorbar(image, ax=ax)
        ax.set_title(f"{name}: expert × patch position", fontsize=9)
        ax.set_xlabel(f"patch (row-major, grid {stats['grid_size'][0]}×{stats['grid_size'][1]})")
        ax.set_ylabel("expert")

        if has_classes:
            ax = axes[row][2]
            if "expert_class_counts" in layer:
                counts = np.asarray(layer["expert_class_counts"])  # (E, C)
                tokens = np.maximum(np.asarray(layer["class_token_counts"]), 1.0)
                image = ax.imshow(counts / tokens, aspect="auto", cmap="magma",
                                  interpolation="nearest")
                figure.colorbar(image, ax=ax)
            ax.set_title(f"{name}: expert × class", fontsize=9)
            ax.set_xlabel("class")
            ax.set_ylabel("expert")
    figure.tight_layout()
    return save_figure(figure, path)


def plot_reliability_diagram(calibration, path, title="Reliability diagram"):
    """Writes a reliability diagram PNG from `calibration_bins` output.

    Args:
        calibration: dict with `bin_edges`, `bin_accuracy`,
            `bin_confidence`, `bin_count` and `ece` (see
            `keras_vmoe.evaluation.calibration_bins`).
        path: output PNG path (written atomically).
        title: figure title.
    """
    edges = np.asarray(calibration["bin_edges"])
    accuracy = np.asarray(calibration["bin_accuracy"], dtype="float64")
    confidence = np.asarray(calibration["bin_confidence"], dtype="float64")
    count = np.asarray(calibration["bin_count"])
    centers = (edges[:-1] + edges[1:]) / 2
    width = edges[1:] - edges[:-1]
    filled = count > 0
    figure = new_figure(figsize=(4.5, 4.5))
    ax = figure.subplots()
    ax.bar(centers[filled], accuracy[filled], width=width[filled], edgecolor="black",
           color="tab:blue", label="accuracy")
    ax.bar(centers[filled], (confidence - accuracy)[filled], bottom=accuracy[filled],
           width=width[filled], color="tab:red", alpha=0.3, label="gap to confidence")
    ax.plot([0, 1], [0, 1], "--", color="gray")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("confidence")
    ax.set_ylabel("accuracy")
    ax.set_title(f"{title} (ECE {100 * calibration['ece']:.2f}%)", fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    return save_figure(figure, path)


def plot_capacity_curve(sweep, path):
    """Writes accuracy (and dropped tokens) vs capacity factor as a PNG.

    Args:
        sweep: the dict returned by `capacity_sweep`.
        path: output PNG path (written atomically).
    """
    rows = sweep.get("rows") if isinstance(sweep, dict) else None
    if not rows:
        raise ValueError("`sweep` must be the dict returned by `capacity_sweep`.")
    figure = new_figure(figsize=(9, 3.6))
    acc_ax, drop_ax = figure.subplots(1, 2)
    for priority, style in ((False, "o-"), (True, "s--")):
        selected = sorted(
            (r for r in rows if r["batch_priority"] == priority),
            key=lambda r: r["capacity_factor"],
        )
        if not selected:
            continue
        label = "BPR" if priority else "vanilla"
        factors = [r["capacity_factor"] for r in selected]
        if all(r.get("accuracy") is not None for r in selected):
            acc_ax.plot(factors, [r["accuracy"] for r in selected], style, label=label)
        drop_ax.plot(factors, [r["tokens_dropped_fraction"] for r in selected], style,
                     label=label)
    acc_ax.set_xscale("log")
    acc_ax.set_xlabel("inference capacity factor")
    acc_ax.set_ylabel("top-1 accuracy")
    acc_ax.set_title("accuracy vs capacity factor", fontsize=10)
    drop_ax.set_xscale("log")
    drop_ax.set_xlabel("inference capacity factor")
    drop_ax.set_ylabel("dropped tokens (mean over MoE layers)")
    drop_ax.set_title("dropped tokens vs capacity factor", fontsize=10)
    for ax in (acc_ax, drop_ax):
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    figure.tight_layout()
    return save_figure(figure, path)
