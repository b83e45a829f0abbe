"""Argument checks: each raises a `ValueError` naming the argument, the value
and what is valid, and returns the value normalised."""

import copy
import inspect
import math
import numbers

import numpy as np


def is_int(value):
    """True for Python and NumPy integers (not for bools)."""
    return isinstance(value, (int, np.integer)) and not isinstance(
        value, (bool, np.bool_)
    )


def check_int(value, name, minimum=1, maximum=None, allow_none=False):
    """`value` as a Python int in `[minimum, maximum]`.

    `minimum` or `maximum` None: no bound; `allow_none`: None is returned.

    Examples:

    >>> check_int(3, "num_experts")
    3
    >>> check_int(-2, "seed", minimum=None)
    -2
    """
    if value is None and allow_none:
        return None
    valid = (
        is_int(value)
        and (minimum is None or value >= minimum)
        and (maximum is None or value <= maximum)
    )
    if not valid:
        if minimum is None:
            bound = "" if maximum is None else f" <= {maximum}"
        elif maximum is None:
            bound = f" >= {minimum}"
        else:
            bound = f" between {minimum} and {maximum}"
        none = "None or " if allow_none else ""
        raise ValueError(
            f"`{name}` must be {none}an integer{bound}. Received: {name}={value!r}"
        )
    return int(value)


def check_pair(value, name):
    """`(value, value)` for an int, `(h, w)` for a pair of ints; else a `ValueError`."""
    if is_int(value):
        return (int(value), int(value))
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(map(is_int, value)):
        return (int(value[0]), int(value[1]))
    raise ValueError(
        f"`{name}` must be an int or a pair of ints (height, width). "
        f"Received: {name}={value!r}"
    )


def patch_grid(image_size, patch_size, require_multiple=False):
    """The patch grid `(H // P_h, W // P_w)` of an image size and a patch size.

    Sizes are ints or `(height, width)`. `require_multiple` refuses an image
    size that is not a multiple of the patch size (otherwise the border is
    dropped, as the patch convolution's VALID padding does).

    Examples:

    >>> patch_grid(224, 16)
    (14, 14)
    >>> patch_grid((384, 224), (32, 16))
    (12, 14)
    """
    image_hw = check_pair(image_size, "image_size")
    patch_hw = check_pair(patch_size, "patch_size")
    if min(patch_hw) < 1:
        raise ValueError(
            "`patch_size` must be an integer >= 1 or a pair of them. "
            f"Received: patch_size={patch_size!r}"
        )
    if require_multiple:
        for size, patch in zip(image_hw, patch_hw, strict=True):
            if size % patch:
                raise ValueError(
                    f"`image_size` must be a multiple of the patch size {patch_hw}. "
                    f"Received: image_size={image_size}. Valid sizes are e.g. "
                    f"{(size // patch) * patch} or {(size // patch + 1) * patch}."
                )
    return image_hw[0] // patch_hw[0], image_hw[1] // patch_hw[1]


def check_probability(value, name, include_one=True):
    """`value` as a float in `[0, 1]` (`[0, 1)` with `include_one=False`)."""
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    upper_ok = real and (value <= 1 if include_one else value < 1)
    if not (real and value >= 0 and upper_ok):
        interval = "[0, 1]" if include_one else "[0, 1)"
        raise ValueError(
            f"`{name}` must be a number in {interval}. Received: {name}={value!r}"
        )
    return float(value)


def check_number(value, name, minimum=0.0, inclusive=True):
    """`value` as a finite float `>= minimum` (`> minimum` if not `inclusive`)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    ok = math.isfinite(number) and (
        number >= minimum if inclusive else number > minimum)
    if isinstance(value, (bool, np.bool_)) or not ok:
        sign = ">=" if inclusive else ">"
        raise ValueError(
            f"`{name}` must be a finite number {sign} {minimum}. "
            f"Received: {name}={value!r}")
    return number


def check_bool(value, name):
    """`value` as a Python bool; only bools are taken (`"false"` is refused)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"`{name}` must be True or False. Received: {name}={value!r}")
    return bool(value)


def check_one_of(value, name, choices):
    """`value` if it is one of `choices`."""
    if value not in choices:
        raise ValueError(
            f"`{name}` must be one of {tuple(choices)}. Received: {name}={value!r}"
        )
    return value


# The routing indexes the token choices of a group (tokens x K) with int32.
MAX_GROUP_CHOICES = 2**31 - 1


def check_group(group_size=None, images_per_group=None, ensemble_size=1):
    """`(group_size, images_per_group)` checked: at most one set; `group_size`
    divisible by `ensemble_size`, or "all" (returned as None)."""
    if group_size is not None and images_per_group is not None:
        raise ValueError(
            "Set at most one of `group_size` (tokens) and `images_per_group`. "
            f"Received: group_size={group_size!r}, "
            f"images_per_group={images_per_group!r}"
        )
    if group_size == "all":
        group_size = None
    elif group_size is not None and (
        not is_int(group_size) or group_size < 1 or group_size % ensemble_size
    ):
        divisible = (
            f" divisible by ensemble_size={ensemble_size}" if ensemble_size > 1 else ""
        )
        raise ValueError(
            f"`group_size` must be 'all' or an integer >= 1{divisible}. "
            f"Received: group_size={group_size!r}"
        )
    images_per_group = check_int(images_per_group, "images_per_group", allow_none=True)
    return (None if group_size is None else int(group_size)), images_per_group


MODEL_KWARGS = ("name", "trainable")


def check_model_kwargs(cls, kwargs):
    """Raises a `TypeError` for `kwargs` (of `cls.__init__`) that a functional
    model would silently drop (all but `name` and `trainable`)."""
    unknown = sorted(set(kwargs) - set(MODEL_KWARGS))
    if unknown:
        parameters = inspect.signature(cls.__init__).parameters.values()
        named = [
            p.name for p in parameters
            if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        ]
        raise TypeError(
            f"{cls.__name__} got unexpected keyword arguments {unknown}. "
            f"Valid arguments: {named + list(MODEL_KWARGS)}."
        )


def python_scalar(value):
    """NumPy integers, floats and bools as Python numbers (others unchanged)."""
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    return value


def plain(value):
    """A plain-Python copy of a config value (`deepcopy` of Keras' tracking
    proxies would copy the whole model)."""
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(plain(item) for item in value)
    return copy.deepcopy(value)
