"""PNG figures of the evaluation (matplotlib, Agg, imported lazily)."""

import numpy as np

from keras_vmoe.utils.safe_files import write_atomically


def new_figure(**kwargs):
    """A matplotlib `Figure` without pyplot (global backend left untouched)."""
    from matplotlib.figure import Figure

    return Figure(**kwargs)


def save_figure(figure, path, dpi=100):
    """Saves a figure as PNG to `path` (temp file + rename)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure)
    return write_atomically(path, lambda temp: figure.savefig(
        temp, format="png", dpi=dpi, bbox_inches="tight"))


def _position_mosaic(positions, grid, columns):
    """`(E, H·W)` per-position values -> one image of E `H×W` tiles (NaN gaps)."""
    num_experts = positions.shape[0]
    rows = -(-num_experts // columns)
    height, width = grid
    mosaic = np.full((rows * (height + 1) - 1, columns * (width + 1) - 1), np.nan)
    origins = []
    for expert in range(num_experts):
        top = (expert // columns) * (height + 1)
        left = (expert % columns) * (width + 1)
        mosaic[top:top + height, left:left + width] = positions[expert].reshape(grid)
        origins.append((top, left))
    return mosaic, origins


def plot_routing_heatmaps(stats, path, class_names=None):
    """Writes the routing heatmaps of `routing_statistics` as one PNG.

    One row per MoE layer: expert load, expert × patch position (one patch
    grid per expert) and, with labels, expert × class.

    Args:
        stats: the dict returned by `routing_statistics`.
        path: output PNG path (written atomically).
        class_names: optional class names (default: `stats["class_names"]`
            if present, else ids).

    Returns:
        The path written.
    """
    layers = stats.get("layers") if isinstance(stats, dict) else None
    if not layers:
        raise ValueError(
            "`stats` must be the dict returned by `routing_statistics` (with "
            "at least one layer in stats['layers'])."
        )
    if class_names is None:
        class_names = stats.get("class_names")
    has_classes = any("expert_class_counts" in v for v in layers.values())
    columns = 3 if has_classes else 2
    figure = new_figure(figsize=(4.6 * columns, 3.5 * len(layers)))
    axes = figure.subplots(len(layers), columns, squeeze=False)
    images = max(stats["num_images"] * stats.get("ensemble_size", 1), 1)
    grid = tuple(int(g) for g in stats["grid_size"])
    for row, (name, layer) in enumerate(layers.items()):
        load = np.asarray(layer["expert_load"])
        experts = np.arange(load.size)
        ax = axes[row][0]
        ax.bar(experts, load, color="tab:blue")
        ax.axhline(1.0 / load.size, color="gray", linestyle="--", linewidth=1,
                   label="uniform")
        ax.set(xticks=experts, xlabel="expert", ylabel="fraction of assignments")
        ax.set_title(
            f"{name}: expert load\n(dropped tokens "
            f"{100 * layer['tokens_dropped_fraction']:.1f}%)", fontsize=10)
        ax.legend(fontsize=7, loc="lower right")

        positions = np.asarray(layer["expert_position_counts"]) / images  # (E, T)
        if stats.get("has_class_token"):
            positions = positions[:, 1:]
        ax = axes[row][1]
        if positions.shape[1] == grid[0] * grid[1]:
            tiles = min(4, load.size)
            mosaic, origins = _position_mosaic(positions, grid, tiles)
            image = ax.imshow(np.ma.masked_invalid(mosaic), cmap="viridis",
                              interpolation="nearest", vmin=0.0)
            for expert, (top, left) in enumerate(origins):
                ax.text(left, top - 0.7, f"expert {expert}", fontsize=8, va="bottom")
            ax.set(xticks=[], yticks=[], frame_on=False)
            ax.set_title(f"{name}: where each expert works\n"
                         f"({grid[0]}×{grid[1]} patch grid per expert)", fontsize=10,
                         pad=14)
        else:  # not a square patch grid (e.g. pooled tokens): one row per expert
            image = ax.imshow(positions, aspect="auto", cmap="viridis",
                              interpolation="nearest", vmin=0.0)
            ax.set(yticks=experts, xlabel="token position", ylabel="expert")
            ax.set_title(f"{name}: expert × token position", fontsize=10)
        figure.colorbar(image, ax=ax, shrink=0.9).set_label(
            "share of images routed here", fontsize=9)

        if has_classes:
            ax = axes[row][2]
            if "expert_class_counts" in layer:
                counts = np.asarray(layer["expert_class_counts"])  # (E, C)
                tokens = np.maximum(np.asarray(layer["class_token_counts"]), 1.0)
                image = ax.imshow(counts / tokens, aspect="auto", cmap="magma",
                                  interpolation="nearest", vmin=0.0)
                figure.colorbar(image, ax=ax).set_label("share of the class's tokens",
                                                        fontsize=9)
                labels = [str(c) for c in ([] if class_names is None else class_names)]
                if len(labels) != counts.shape[1]:
                    labels = [str(c) for c in range(counts.shape[1])]
                ax.set_xticks(np.arange(counts.shape[1]))
                long_names = max(len(label) for label in labels) > 3
                ax.set_xticklabels(labels, rotation=45 if long_names else 0,
                                   ha="right" if long_names else "center", fontsize=9)
                ax.set_yticks(np.arange(counts.shape[0]))
            ax.set_title(f"{name}: expert × class", fontsize=10)
            ax.set(xlabel="class", ylabel="expert")
    figure.tight_layout()
    return save_figure(figure, path)


def plot_reliability_diagram(calibration, path, title="Reliability diagram"):
    """Writes a reliability diagram PNG from `calibration_bins` output.

    Args:
        calibration: the dict returned by `calibration_bins`.
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
    # Accuracy as bars, mean confidence as markers joined to the bar top.
    ax.bar(centers[filled], accuracy[filled], width=width[filled] * 0.9,
           color="tab:blue", label="accuracy in the bin")
    ax.vlines(centers[filled], accuracy[filled], confidence[filled], color="tab:red",
              linewidth=1.5)
    ax.plot(centers[filled], confidence[filled], "_", color="tab:red", markersize=12,
            markeredgewidth=2, label="mean confidence in the bin")
    ax.plot([0, 1], [0, 1], "--", color="gray", linewidth=1, label="calibrated")
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="confidence", ylabel="accuracy")
    ax.set_title(f"{title} (ECE {100 * calibration['ece']:.2f}%)", fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    return save_figure(figure, path)


def plot_capacity_curve(sweep, path):
    """Writes accuracy and dropped tokens vs capacity factor as a PNG.

    Args:
        sweep: the dict returned by `capacity_sweep`.
        path: output PNG path (written atomically).
    """
    from matplotlib.ticker import FixedLocator
    from matplotlib.ticker import FuncFormatter

    rows = sweep.get("rows") if isinstance(sweep, dict) else None
    if not rows:
        raise ValueError("`sweep` must be the dict returned by `capacity_sweep`.")
    figure = new_figure(figsize=(9, 3.6))
    acc_ax, drop_ax = figure.subplots(1, 2)
    all_factors = sorted({r["capacity_factor"] for r in rows})
    for priority, style in ((False, "o-"), (True, "s--")):
        selected = sorted((r for r in rows if r["batch_priority"] == priority),
                          key=lambda r: r["capacity_factor"])
        if not selected:
            continue
        label = "BPR" if priority else "vanilla"
        factors = [r["capacity_factor"] for r in selected]
        if all(r.get("accuracy") is not None for r in selected):
            acc_ax.plot(factors, [r["accuracy"] for r in selected], style, label=label)
        drop_ax.plot(factors, [r["tokens_dropped_fraction"] for r in selected], style,
                     label=label)
    for ax in (acc_ax, drop_ax):
        # A fixed 0-1 scale: a change of a few tenths of a percent is no cliff.
        ax.set(xscale="log", ylim=(0.0, 1.0),
               xlabel="inference capacity factor (log scale)")
        # Ticks at the measured factors only, as plain numbers.
        ax.xaxis.set_major_locator(FixedLocator(_spaced_ticks(all_factors)))
        ax.xaxis.set_minor_locator(FixedLocator([]))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    acc_ax.set_ylabel("top-1 accuracy")
    acc_ax.set_title("accuracy vs capacity factor", fontsize=10)
    drop_ax.set_ylabel("dropped tokens (mean over MoE layers)")
    drop_ax.set_title("dropped tokens vs capacity factor", fontsize=10)
    figure.tight_layout()
    return save_figure(figure, path)


def _spaced_ticks(values, min_decades=0.12):
    """Sorted positive `values`, at least `min_decades` apart on a log axis."""
    kept = []
    for value in sorted(v for v in values if v > 0):
        if not kept or np.log10(value) - np.log10(kept[-1]) >= min_decades:
            kept.append(value)
    return kept
