"""keras_vmoe.utils.arrays: bytes of arrays and variables of any dtype."""

import keras
import numpy as np
import pytest

from keras_vmoe.utils import arrays


@pytest.mark.parametrize("dtype, size", [
    ("float32", 4), ("bfloat16", 2), ("float8_e4m3fn", 1), ("int4", 1), ("bool", 1),
    ("complex64", 8), (np.dtype("float16"), 2), (np.dtype("int64"), 8),
])
def test_dtype_bytes(dtype, size):
    assert arrays.dtype_bytes(dtype) == size


def test_nbytes_of_arrays_and_variables():
    assert arrays.nbytes(np.zeros((3, 4), "float32")) == 48
    assert arrays.nbytes(np.zeros((), "int8")) == 1
    assert arrays.nbytes(keras.ops.zeros((2, 5), "bfloat16")) == 20
    variable = keras.Variable(np.zeros((2, 3), "float32"), dtype="bfloat16")
    assert arrays.nbytes(variable) == 12
    assert arrays.nbytes(keras.Variable(np.zeros((4,), "int8"), dtype="int8")) == 4
