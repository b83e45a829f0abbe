"""argparse `type=` functions shared by the commands (no heavy imports)."""

import argparse
import math
import os


def positive_int(text):
    """An integer >= 1, or an argparse error naming the text."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def positive_float(text):
    """A finite number > 0, or an argparse error naming the text."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def int_between(low, high):
    """An argparse `type=`: an integer in `[low, high]`."""

    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"expected an integer between {low} and {high}, got {text!r}")
        return value

    parse.__name__ = f"integer in [{low}, {high}]"
    return parse


def capacity_factor_list(text, allow_none=False):
    """`"1.05,0.5"` -> `[1.05, 0.5]` (`"none"` -> `None` with `allow_none`)."""
    if allow_none and text.strip().lower() == "none":
        return None
    expected = "comma-separated numbers" + (" or 'none'" if allow_none else "")
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise argparse.ArgumentTypeError(
            f"capacity factors must be finite numbers > 0, got {text!r}")
    return values


def dataset_spec(text):
    """--data: 'digits', 'tfds:NAME' or an existing folder."""
    if text == "digits" or text.startswith("tfds:") and len(text) > 5:
        return text
    if os.path.isdir(text):
        return text
    raise argparse.ArgumentTypeError(
        f"unknown dataset {text!r}: expected 'digits', 'tfds:NAME' (e.g. "
        "tfds:cifar10) or an existing folder with one sub-folder of images per class")
