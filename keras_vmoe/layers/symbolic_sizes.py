"""Sizes that may be symbolic: the batch size inside a TensorFlow graph.

Symbolic sizes are computed with `keras.ops`, static ones in Python.

Examples:

>>> is_static(3, 4)
True
>>> minimum(3, 8)
3
"""

import numbers

from keras import ops


def is_static(*sizes):
    """True when every size is a Python integer (not a symbolic tensor)."""
    return all(isinstance(size, numbers.Integral) for size in sizes)


def minimum(a, b):
    """`min(a, b)` for static sizes, `ops.minimum` otherwise."""
    return min(a, b) if is_static(a, b) else ops.minimum(a, b)


def ceil_div(a, b):
    """`ceil(a / b)` of positive integer sizes."""
    return (a + b - 1) // b
