"""keras_vmoe.layers.experts: the expert MLP bank through the shared test base."""

import numpy as np
import pytest
import testing

from keras_vmoe import layers

BUFFERS = np.random.default_rng(0).normal(size=(2, 4, 3, 16)).astype("float32")  # (G, E, C, D)


# The loop compiles an `ops.scan` for each check: the heavy group runs it.
@pytest.mark.parametrize("implementation", [
    "batched", pytest.param("loop", marks=pytest.mark.heavy)])
def test_experts_through_the_shared_base(implementation):
    testing.run_layer_test(
        layers.Experts,
        dict(num_experts=4, mlp_dim=8, identical_init=False, implementation=implementation),
        BUFFERS, BUFFERS.shape, call_kwargs={"training": False},
    )
