"""Checks that image values are in their declared range (NumPy only).

Values outside it would be silently mis-scaled, so they are refused with
the expected range and how to declare another.
"""

import math

import numpy as np


def check_float_range(float_range):
    """`float_range` as a (low, high) pair of floats, checked."""
    try:
        low, high = (float(v) for v in float_range)
    except (TypeError, ValueError):
        low = high = math.nan
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise ValueError(
            "`float_range` must be two finite numbers (low, high) with low < high, "
            "the range of float images (e.g. (-1, 1) or (0, 1) or (0, 255)). "
            f"Received: float_range={float_range!r}")
    return low, high


def _scaling(low, high):
    """A NumPy expression of `images` that maps [0, 255] onto [low, high]."""
    return {(-1.0, 1.0): "images / 127.5 - 1", (0.0, 1.0): "images / 255"}.get(
        (low, high), f"images / 255 * {high - low!r} + {low!r}")


def _declare(declare, low, high):
    """How the caller declares the range `(low, high)`, or `None`."""
    return None if declare is None else declare.format(low=low, high=high)


def check_pixel_values(images, float_range=(-1.0, 1.0), declare=None):
    """Refuses integer images outside [0, 255] and floats outside `float_range`.

    `declare`: format string (of `low`, `high`) of the caller's argument that
    declares another range, e.g. `"float_range=({low}, {high})"`, or `None`.
    """
    images = np.asarray(images)
    if images.size == 0:
        return
    low, high = (float(v) for v in float_range)
    kind = images.dtype.kind
    if kind not in "iuf":
        raise ValueError(
            f"Images must be integers in [0, 255] or floats in {(low, high)}; received "
            f"dtype {images.dtype}.")
    if kind != "f":
        lo, hi = int(images.min()), int(images.max())
        if lo < 0 or hi > 255:
            other = _declare(declare, "low", "high")
            raise ValueError(
                f"Integer images must be in [0, 255] (8-bit); received values in "
                f"[{lo}, {hi}] (dtype {images.dtype}). Scale them to uint8, or pass "
                f"float images in {(low, high)}"
                + (f" or in the range declared with {other}." if other else "."))
        return
    finite = np.isfinite(images)
    if not finite.all():
        bad = int(np.argwhere(~finite.reshape(len(images), -1).all(axis=1))[0][0]) \
            if images.ndim > 1 else 0
        raise ValueError(
            f"Images contain NaN or inf pixel values (first in image {bad}). "
            "Remove or repair those images.")
    lo, hi = float(images.min()), float(images.max())
    slack = 1e-3 * (high - low)
    if lo >= low - slack and hi <= high + slack:
        return
    message = (f"Float images must be in float_range={(low, high)}; received "
               f"values in [{lo:g}, {hi:g}].")
    if lo >= 0 and 2 < hi <= 255 * (1 + 1e-3):
        declared = _declare(declare, 0, 255)
        message += (
            " They look like [0, 255] values: pass them as uint8 "
            f"(`images.astype('uint8')`) or scaled to {(low, high)} "
            f"(`{_scaling(low, high)}`)"
            + (f", or pass `{declared}`." if declared else
               ", or give the model an image converter that reads [0, 255] floats "
               "(its `image_converter` argument: an `ImageConverter` with "
               "float_range=(0, 255))."))
    else:
        declared = _declare(declare, "low", "high")
        message += (
            f" Scale them to {(low, high)}, or "
            + (f"declare their range with {declared}." if declared else
               "give the model an image converter of their range (its "
               "`image_converter` argument, an `ImageConverter` with that "
               "float_range)."))
    raise ValueError(message)
