"""Shared tiny configurations for the model tests."""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from tiny_configs import VIT as TINY  # noqa: E402


@pytest.fixture(scope="session")
def tiny():
    return dict(TINY)


@pytest.fixture(scope="session")
def images():
    rng = np.random.default_rng(0)
    return rng.uniform(-1.0, 1.0, size=(4, 32, 32, 3)).astype("float32")


@pytest.fixture(scope="session")
def labels():
    return np.array([0, 1, 2, 1], dtype="int32")


def _jit_call(layer, *args, **kwargs):
    """Calls a built layer/model under `jax.jit` (much faster than eager
    op-by-op execution of the many small routing ops)."""
    import jax
    import keras

    variables = list(layer.variables)

    def run(values, *inputs):
        with keras.StatelessScope(
            state_mapping=list(zip(variables, values, strict=True))
        ):
            return layer(*inputs, **kwargs)

    return jax.jit(run)([v.value for v in variables], *args)


@pytest.fixture(scope="session")
def jit_call():
    return _jit_call


@pytest.fixture(scope="module")
def routed_model():
    """A tiny V-MoE classifier (`tiny_configs.vmoe()`, 5 classes) with a random
    head, so that routing changes move its logits; one per test module."""
    import tiny_configs

    from keras_vmoe.models import ImageClassifier
    from keras_vmoe.models import VisionTransformerBackbone

    model = ImageClassifier(VisionTransformerBackbone(**tiny_configs.vmoe()), num_classes=5)
    head = model.get_layer("head")
    head.kernel.assign(np.random.default_rng(0).normal(size=head.kernel.shape))
    return model
