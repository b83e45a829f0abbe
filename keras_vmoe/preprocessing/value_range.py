"""Checks that image values are in the range they are declared to be in.

Integer images are 8-bit [0, 255]; float images are in a declared
`float_range` (the models' own (-1, 1) unless said otherwise). Values
outside it would be silently mis-scaled (a [0, 255] float photo read as
[-1, 1] is classified as something else), so they are refused with the
range that was expected and how to declare another. NumPy only.
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


def check_pixel_values(images, float_range=(-1.0, 1.0)):
    """Raises a clear error for pixel values outside their declared range.

    Integer images must be in [0, 255]; float images in `float_range` and
    finite. Validated on the NumPy array, before any pipeline is built.
    """
    images = np.asarray(images)
    if images.size == 0:
        return
    kind = images.dtype.kind
    if kind == "b" or kind not in "iuf":
        raise ValueError(
            f"Images must be integers in [0, 255] or floats in float_range; received "
            f"dtype {images.dtype}.")
    if kind == "f":
        finite = np.isfinite(images)
        if not finite.all():
            bad = int(np.argwhere(~finite.reshape(len(images), -1).all(axis=1))[0][0]) \
                if images.ndim > 1 else 0
            raise ValueError(
                f"Images contain NaN or inf pixel values (first in image {bad}). "
                "Remove or repair those images.")
        low, high = float_range
        lo, hi = float(images.min()), float(images.max())
        slack = 1e-3 * (high - low)
        if lo < low - slack or hi > high + slack:
            hint = (" They look like [0, 255] values: pass float_range=(0, 255), or "
                    "uint8 images." if hi > 2 and lo >= 0 else "")
            raise ValueError(
                f"Float images must be in float_range={tuple(float_range)}; received "
                f"values in [{lo:g}, {hi:g}].{hint} Declare their range with "
                "float_range=(low, high).")
        return
    lo, hi = int(images.min()), int(images.max())
    if lo < 0 or hi > 255:
        raise ValueError(
            f"Integer images must be in [0, 255] (8-bit); received values in "
            f"[{lo}, {hi}] (dtype {images.dtype}). Scale them to uint8, or pass float "
            "images with float_range=(low, high).")
