"""Atomic writes of the evaluation outputs (JSON, PNG figures)."""

import json

from keras_vmoe.utils.safe_files import write_atomically


def write_json(data, path):
    """Writes `data` as indented JSON to `path` (temp file + rename)."""

    def write(temp):
        with open(temp, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")

    return write_atomically(path, write)


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
