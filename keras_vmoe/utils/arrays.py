"""Sizes of arrays and variables, for any backend, without importing one."""

import math
import re


def dtype_bytes(dtype):
    """Bytes of one element of `dtype`.

    Takes NumPy/JAX dtypes, `torch.dtype`, `tf.DType` and Keras dtype names
    (`"float32"`, `"bfloat16"`, `"float8_e4m3fn"`): the dtype's `itemsize`
    (or `size`) where it has one, else the bit width its name starts with,
    rounded up to whole bytes; a name without a width (`"bool"`) is 1 byte.

    Args:
        dtype: a dtype object or name.

    Returns:
        int, bytes per element.

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
    """Bytes of an array or a variable: elements x bytes per element.

    Args:
        value: anything with a static `shape` and a `dtype` (a Keras
            variable, a NumPy/JAX/TensorFlow/torch array).

    Returns:
        int.

    Examples:

    >>> import numpy as np
    >>> nbytes(np.zeros((3, 4), "float32"))
    48
    """
    return math.prod(int(dim) for dim in value.shape) * dtype_bytes(value.dtype)
