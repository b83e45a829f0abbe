"""Sizes that may be symbolic: the batch size inside a TensorFlow graph.

On JAX (traced with static shapes) and PyTorch (eager) every size of a
tensor is a Python int. Inside a `tf.function` (`fit`, `evaluate` and
`predict` on the TensorFlow backend) the batch size is usually unknown
(`None` in the static shape), and `ops.shape` returns a scalar tensor for
it. Group counts, group sizes and capacities derived from it are then
tensors too: these helpers compute them with `keras.ops` (the same IEEE
operations as the Python integer and float64 arithmetic, so the capacity is
the same number) and Python control flow is only used on static sizes.

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
    if is_static(a, b):
        return min(a, b)
    return ops.minimum(a, b)


def ceil_div(a, b):
    """`ceil(a / b)` of positive integer sizes."""
    return (a + b - 1) // b
