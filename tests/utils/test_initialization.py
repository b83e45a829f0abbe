"""`keras_vmoe.utils.initialization.skip_initializers`: no draw, nothing
compiled, every weight assigned, random builds unchanged."""

import keras
import numpy as np
import pytest
from testing import Programs
from tiny_configs import vit_fresh_shapes

from keras_vmoe import models
from keras_vmoe.utils import initialization

jax_only = pytest.mark.skipif(keras.backend.backend() != "jax", reason="XLA programs")


def _backbone(**overrides):
    return models.VisionTransformerBackbone(**vit_fresh_shapes(**overrides))


@jax_only
def test_a_build_under_the_scope_compiles_nothing_and_holds_zeros():
    with Programs() as programs, initialization.skip_initializers() as skipped:
        backbone = _backbone()
    assert programs.count == 0
    assert skipped.num_skipped == len(backbone.weights)
    assert all(not np.any(keras.ops.convert_to_numpy(v.value)) for v in backbone.weights)


def test_an_unassigned_weight_raises_naming_it():
    source = _backbone()
    with initialization.skip_initializers() as skipped:
        target = _backbone()
        for s, t in zip(source.weights, target.weights, strict=True):
            if t.path != "encoder_norm/gamma":
                t.assign(s.value)
    with pytest.raises(initialization.UnassignedWeightsError, match="encoder_norm/gamma"):
        skipped.check_assigned(target, source="a test")


def test_a_fully_assigned_model_passes_and_equals_its_source():
    source = _backbone()
    with initialization.skip_initializers() as skipped:
        target = _backbone()
        target.set_weights(source.get_weights())
    skipped.check_assigned(target)
    images = np.random.RandomState(0).uniform(-1, 1, (2, 32, 32, 3)).astype("float32")
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(source(images)), keras.ops.convert_to_numpy(target(images)))


def _seeded_weights(seed):
    keras.utils.set_random_seed(seed)
    return [keras.ops.convert_to_numpy(v.value).copy()
            for v in _backbone(dropout_rate=0.1).weights]


def test_random_builds_outside_the_scope_draw_the_same_values():
    before = _seeded_weights(3)
    with initialization.skip_initializers():
        pass
    after = _seeded_weights(3)
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)
    assert any(np.any(a) for a in after)


def test_seed_generator_states_keep_their_seed():
    keras.utils.set_random_seed(5)
    expected = keras.random.SeedGenerator(7).state.value
    keras.utils.set_random_seed(5)
    with initialization.skip_initializers() as skipped:
        generator = keras.random.SeedGenerator(7)
    assert skipped.num_skipped == 0
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(generator.state.value),
                                  keras.ops.convert_to_numpy(expected))


def test_the_variable_class_is_restored_after_the_scope():
    before = dict(vars(keras.Variable))
    with initialization.skip_initializers(), initialization.skip_initializers():
        pass
    assert dict(vars(keras.Variable)) == before


def test_a_nested_scope_records_assignments_of_the_outer_scopes_variables():
    source = _backbone()
    with initialization.skip_initializers() as outer:
        target = _backbone()
        with initialization.skip_initializers() as inner:
            target.set_weights(source.get_weights())
    assert inner.num_skipped == 0
    outer.check_assigned(target)
