"""The shared test base (tests/testing.py) fails where it must."""

import keras
import numpy as np
import pytest
import testing

TOKENS = np.random.default_rng(0).normal(size=(2, 8, 16)).astype("float32")


def test_the_base_catches_a_broken_round_trip():
    @keras.saving.register_keras_serializable(package="keras_vmoe_tests")
    class Forgetful(keras.layers.Dense):
        """Forgets its activation in `get_config`."""

        def get_config(self):
            return {**super().get_config(), "activation": "linear"}

    with pytest.raises(AssertionError):
        testing.run_layer_test(Forgetful, {"units": 3, "activation": "relu"}, TOKENS,
                               (2, 8, 3), run_mixed_precision=False)
