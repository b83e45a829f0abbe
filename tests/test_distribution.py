"""Expert and data parallelism on 8 virtual CPU devices."""

import jax
import keras
import numpy as np
import pytest

from keras_vmoe import distribution
from keras_vmoe.layers import MoeLayer

pytestmark = pytest.mark.multi_device


def _model(num_experts=8):
    inputs = keras.Input((8, 16))
    h = MoeLayer(num_experts, 32, router={"name": "token_choice", "num_selected_experts": 2},
                 name="moe")(inputs)
    outputs = keras.layers.Dense(3, name="head")(keras.layers.GlobalAveragePooling1D()(h))
    return keras.Model(inputs, outputs)


@pytest.fixture
def reset_distribution():
    yield
    keras.distribution.set_distribution(None)


def _expert_parallel(model_fn, expert):
    """The model built under the `"expert"` layout over `expert` devices."""
    mesh = distribution.make_mesh(expert=expert)
    keras.distribution.set_distribution(distribution.make_distribution("expert", mesh))
    return model_fn()


@pytest.mark.heavy
def test_expert_weights_are_sharded_and_fit_runs(reset_distribution):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (virtual) devices")
    model = _expert_parallel(_model, expert=4)
    kernel = next(w for w in model.weights if w.path.endswith("experts/kernel_0"))
    shard_shapes = {s.data.shape for s in kernel.value.addressable_shards}
    assert shard_shapes == {(2, 16, 32)}  # 8 experts over 4 devices
    router = next(w for w in model.weights if w.path.endswith("router/kernel"))
    assert {s.data.shape for s in router.value.addressable_shards} == {(16, 8)}
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(0).normal(size=(8, 8, 16)).astype("float32")
    history = model.fit(x, np.arange(8) % 3, epochs=1, batch_size=8, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_expert_parallel_outputs_match_single_device(reset_distribution):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (virtual) devices")
    keras.utils.set_random_seed(1)
    reference = _model()
    x = np.random.default_rng(0).normal(size=(8, 8, 16)).astype("float32")
    expected = np.asarray(reference.predict(x, verbose=0))
    model = _expert_parallel(_model, expert=8)
    model.set_weights(reference.get_weights())
    np.testing.assert_allclose(model.predict(x, verbose=0), expected, atol=1e-5)


def test_clear_errors(reset_distribution):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (virtual) devices")
    with pytest.raises(ValueError, match="must divide the 8 devices"):
        distribution.make_mesh(expert=3)
    assert keras.distribution.distribution() is None
