"""Atomic writes of the evaluation outputs (JSON, PNG figures)."""

import json
import os
import tempfile


def _atomic_target(path):
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    handle, temp = tempfile.mkstemp(
        dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp"
    )
    os.close(handle)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(temp, 0o666 & ~umask)  # mkstemp creates 0600 files
    return path, temp


def _write_atomically(path, write):
    """Calls `write(temp_path)`, then renames the temp file to `path`."""
    path, temp = _atomic_target(path)
    try:
        write(temp)
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.remove(temp)
        raise
    return path


def write_json(data, path):
    """Writes `data` as indented JSON to `path` (temp file + rename)."""

    def write(temp):
        with open(temp, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")

    return _write_atomically(path, write)


def new_figure(**kwargs):
    """A matplotlib figure on the Agg backend (no display needed).

    Uses `matplotlib.figure.Figure` directly (not pyplot), so the global
    backend and pyplot's figure registry are left untouched.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as error:  # pragma: no cover - matplotlib is a core dep
        raise ImportError(
            "Plots need matplotlib: `pip install matplotlib`."
        ) from error
    return Figure(**kwargs)


def save_figure(figure, path, dpi=100):
    """Saves a figure as PNG to `path` (temp file + rename)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure)
    return _write_atomically(
        path, lambda temp: figure.savefig(temp, format="png", dpi=dpi,
                                          bbox_inches="tight"))
