"""Sizes of arrays and variables, for any backend, without importing one."""

import math
import re


def dtype_bytes(dtype):
    """Bytes of one element of `dtype` (any backend's dtype, or a name).

    Examples:

    >>> dtype_bytes("bfloat16")
    2
    >>> dtype_bytes("bool")
    1
    """
    for attribute in ("itemsize", "size"):
        size = getattr(dtype, attribute, None)
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            return size
    name = getattr(dtype, "name", None)
    bits = re.search(r"\d+", name if isinstance(name, str) else str(dtype))
    return -(-int(bits.group()) // 8) if bits else 1


def nbytes(value):
    """Bytes of an array or a variable (anything with `shape` and `dtype`).

    Examples:

    >>> import numpy as np
    >>> nbytes(np.zeros((3, 4), "float32"))
    48
    """
    return math.prod(int(dim) for dim in value.shape) * dtype_bytes(value.dtype)
