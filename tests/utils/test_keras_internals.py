"""The Keras internals that `keras_vmoe.utils.keras_internals` wraps still exist,
and the JAX state guard is still needed and still works.

If `test_keras_still_leaves_a_failing_predict_detached` fails, Keras fixed
the bug: delete `keras_vmoe/models/state_guard.py`'s `restore_on_error`.
"""

import keras
import numpy as np
import pytest

from keras_vmoe.models import state_guard
from keras_vmoe.utils import keras_internals

jax_only = pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="JAX trainer internals"
)


class _Picky(keras.Model):
    """Raises inside the traced step, after Keras detached the variables, for
    a batch that is not a multiple of 4 (as an MoE layer whose `group_size`
    does not divide a partial last batch)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(2, name="dense")

    def call(self, x):
        if x.shape[0] is not None and x.shape[0] % 4:
            raise ValueError(f"batch {x.shape[0]} is not a multiple of 4")
        return self.dense(x)


class _GuardedPicky(_Picky):
    """`_Picky` with the guard the keras_vmoe bases put on their loops."""

    fit = state_guard.restore_on_error(_Picky.fit)
    evaluate = state_guard.restore_on_error(_Picky.evaluate)
    predict = state_guard.restore_on_error(_Picky.predict)


def _compiled(cls):
    model = cls()
    model.compile("sgd", "mse")
    model.predict(np.ones((4, 3), "float32"), verbose=0)
    return model


_ODD_X = np.ones((10, 3), "float32")  # batches of 4, 4, then 2: the last raises
_ODD_Y = np.zeros((10, 2), "float32")


@jax_only
def test_the_jax_trainer_still_has_the_attributes_we_use():
    from keras.src.backend.jax.trainer import JAXTrainer

    for name in keras_internals.JAX_TRAINER_METHODS:
        assert callable(getattr(JAXTrainer, name, None)), name
    model = _compiled(_Picky)
    for name in keras_internals.JAX_TRAINER_STATE:
        assert hasattr(model, name), name
    variable = model.dense.kernel
    assert keras_internals.variable_value(variable) is not None
    assert hasattr(variable, "_layout")


def test_the_other_internals_still_exist():
    model = _compiled(_Picky)
    assert model.dense in keras_internals.flatten_layers(model)
    keras_internals.symbolic_build(model, (np.ones((4, 3), "float32"),
                                           np.zeros((4, 2), "float32")))
    assert keras_internals.stateless_scope() is None
    with keras.StatelessScope():
        assert keras_internals.stateless_scope() is not None
    with keras_internals.keep_uninitialized_variables():
        pass
    assert keras_internals.saving_lib() is not None


def test_no_autocast_and_forgetting_sublayer_losses():
    layer = keras.layers.Dense(2, dtype="mixed_bfloat16")
    layer.build((None, 3))
    from keras.src.backend.common.variables import AutocastScope

    with AutocastScope("bfloat16"):
        assert layer.kernel.value.dtype == "bfloat16"
        with keras_internals.no_autocast():
            assert layer.kernel.value.dtype == "float32"
    outer = keras.Sequential([keras.layers.ActivityRegularization(l1=1.0)])
    with keras.StatelessScope(collect_losses=True) as scope:
        outer(np.ones((1, 2), "float32"))
        assert len(scope.losses) == 1 and len(outer.losses) == 1
        keras_internals.forget_sublayer_losses(outer)
        assert outer.losses == [] and scope.losses == []


@jax_only
def test_the_layer_and_distribution_internals_still_exist():
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    with keras_internals.tracking_unlocked(layer):
        layer.add_weight(name="extra", shape=(1,))
    assert "extra" in [w.name for w in layer.weights]
    with pytest.raises(ValueError):  # locked again: no weight after build
        layer.add_weight(name="late", shape=(1,))
    with pytest.raises(ValueError):
        keras_internals.check_quantize_args(layer, "no_such_mode", "float32")
    devices = keras.distribution.list_devices()[:1]
    mesh = keras.distribution.DeviceMesh((1,), ["model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    parallel = keras.distribution.ModelParallel(layout_map=layout_map)
    assert keras_internals.distribution_layout_map(parallel) is layout_map
    assert keras_internals.distribution_layout_map(None) is None


def test_keras_still_leaves_a_failing_predict_detached():
    # Keras 3.15.1: no try/finally around the predict/evaluate loops.
    for fail in (
        lambda m: m.predict(_ODD_X, batch_size=4, verbose=0),
        lambda m: m.evaluate(_ODD_X, _ODD_Y, batch_size=4, verbose=0),
    ):
        model = _compiled(_Picky)
        with pytest.raises(ValueError, match="multiple of 4"):
            fail(model)
        assert keras_internals.variable_value(model.dense.kernel) is None, (
            "Keras now restores the variables itself: delete the state guard."
        )


def test_the_guard_restores_the_model_after_a_failing_call():
    model = _compiled(_GuardedPicky)
    x = np.ones((4, 3), "float32")
    expected = model.predict(x, verbose=0)
    for fail in (
        lambda: model.predict(_ODD_X, batch_size=4, verbose=0),
        lambda: model.evaluate(_ODD_X, _ODD_Y, batch_size=4, verbose=0),
    ):
        with pytest.raises(ValueError, match="multiple of 4"):
            fail()
        assert all(
            keras_internals.variable_value(v) is not None for v in model.variables
        )
        # The values from before the call (predict/evaluate change nothing).
        np.testing.assert_allclose(model.predict(x, verbose=0), expected, rtol=1e-6)
    with pytest.raises(ValueError, match="multiple of 4"):
        model.fit(_ODD_X, _ODD_Y, batch_size=4, verbose=0)
    # fit keeps the values of its last successful batch, and the model runs.
    assert np.all(np.isfinite(model.predict(x, verbose=0)))


def test_keras_still_collects_garbage_per_deleted_variable(monkeypatch):
    # When this fails, Keras stopped calling `gc.collect()` in
    # `Layer.__delattr__`: delete `keras_internals.collect_garbage_once`.
    import gc

    calls = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(1) or 0)
    layer = keras.layers.Dense(2, name="dense")
    layer.build((None, 3))
    del layer._kernel
    assert calls


@pytest.mark.heavy
def test_quantizing_a_model_collects_garbage_once_per_pass(monkeypatch):
    import gc

    from tiny_configs import composition_model

    model = composition_model("sparse")
    calls = []
    real = gc.collect
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(1) or real())
    model.quantize("int8")
    # Keras' pass over the dense layers, then the expert banks.
    assert len(calls) == 2
    assert gc.collect is not real and callable(gc.collect)
    assert {str(v.dtype) for v in model.weights} >= {"int8"}


def test_a_functional_graph_runs_with_an_operation_replaced():
    inputs = keras.Input((3,))
    first = keras.layers.Dense(3, name="first")
    dropout = keras.layers.Dropout(0.5, name="dropout")
    outputs = keras.layers.Dense(2, name="last")(dropout(first(inputs)))
    model = keras.Model(inputs, outputs)
    x = np.ones((4, 3), "float32")
    seen = []

    def replacement(x, training):
        seen.append(training)
        return x * 0.0

    same = keras_internals.run_functional_graph(model, x, False, {})
    np.testing.assert_allclose(same, model(x), atol=1e-6)
    replaced = keras_internals.run_functional_graph(model, x, True,
                                                    {id(first): replacement})
    np.testing.assert_allclose(replaced, model.get_layer("last")(np.zeros((4, 3))),
                               atol=1e-6)
    assert seen == [True]


def test_the_variable_class_still_has_the_methods_skip_initializers_wraps():
    for name in keras_internals.VARIABLE_METHODS:
        assert callable(getattr(keras.Variable, name, None)), name


def test_set_random_seed_seeds_as_keras_without_importing_tensorflow(monkeypatch):
    import random

    from keras.src.utils import rng_utils

    def draws():
        return (random.random(), np.random.rand(),
                float(keras.ops.convert_to_numpy(keras.random.uniform(()))))

    keras.utils.set_random_seed(3)
    expected = draws()
    imported = []
    monkeypatch.setattr(rng_utils, "tf", type("Lazy", (), {"available": property(
        lambda self: imported.append(True) or False)})())
    monkeypatch.delitem(__import__("sys").modules, "tensorflow", raising=False)
    keras_internals.set_random_seed(3)
    assert draws() == expected and not imported  # TensorFlow's seed not even asked for
    assert rng_utils.get_random_seed() == 3


def test_keras_still_has_the_samplers_and_file_loaders_initialization_wraps():
    from keras.src.saving import saving_lib

    samplers = keras_internals.initializer_random_module()
    for name in keras_internals.BACKEND_SAMPLERS:
        assert callable(getattr(samplers, name, None)), name
    for name in (*keras_internals.KERAS_FILE_LOADERS, keras_internals.KERAS_ZIP_READER):
        assert callable(getattr(saving_lib, name, None)), name

