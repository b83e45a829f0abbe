"""Sizes that are tensors (a TensorFlow graph's unknown batch size).

The symbolic capacity must be the number `compute_capacity` gives for the
same Python ints; the TensorFlow runs themselves are in tests/backends.
"""

import numpy as np
import pytest
from keras import ops

from keras_vmoe.layers import symbolic_sizes
from keras_vmoe.layers.capacity import compute_capacity
from keras_vmoe.utils.backend import JaxOnlyError
from keras_vmoe.utils.backend import backend
from keras_vmoe.utils.backend import require_jax

# (num_tokens, experts, capacity factor, ceil or round, multiple of, max).
CAPACITY_CASES = [
    (800, 8, 1.05, "ceil", 4, None),
    (34, 4, 1.0, "round", 1, None),
    (130, 4, 1.25, "ceil", 4, 65),
    (7, 2, 8.0, "ceil", 4, 7),
    (1576, 32, 1.5, "round", 4, 1576),
]


@pytest.mark.parametrize("case", CAPACITY_CASES)
def test_symbolic_capacity_equals_the_python_capacity(case):
    # JAX computes it in float32 (no x64) here; the float64 path that the
    # TensorFlow graphs take is checked over many sizes in tests/backends.
    num_tokens, experts, factor, ceil_or_round, multiple_of, cap = case
    expected = compute_capacity(num_tokens, experts, factor, ceil_or_round,
                                multiple_of, cap)
    actual = compute_capacity(
        ops.convert_to_tensor(num_tokens, "int32"), experts, factor, ceil_or_round,
        multiple_of, None if cap is None else ops.convert_to_tensor(cap, "int32"))
    assert not isinstance(actual, int)
    assert int(np.asarray(actual)) == expected


def test_sizes_helpers():
    assert symbolic_sizes.is_static(3, np.int64(4))
    assert not symbolic_sizes.is_static(3, ops.convert_to_tensor(4))
    assert symbolic_sizes.minimum(3, 8) == 3 and isinstance(symbolic_sizes.minimum(3, 8), int)
    assert int(np.asarray(symbolic_sizes.minimum(ops.convert_to_tensor(9), 8))) == 8
    assert [symbolic_sizes.ceil_div(n, 4) for n in (1, 4, 5, 8, 9)] == [1, 1, 2, 2, 3]


def test_require_jax_passes_on_jax_and_names_the_backend_otherwise(monkeypatch):
    assert backend() == "jax"
    require_jax("feature", "alternative")  # no error on JAX
    import keras

    monkeypatch.setattr(keras.config, "backend", lambda: "torch")
    with pytest.raises(JaxOnlyError, match=r"feature needs the JAX backend, but Keras "
                       r"runs on 'torch' \(KERAS_BACKEND=torch\)\. Use this\."):
        require_jax("feature", "Use this.")
