"""`keras_vmoe.utils.initialization.skip_initializers`: no draw, nothing
compiled, every weight assigned, random builds unchanged."""

import mmap

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


def test_weights_files_load_without_a_copy_and_keras_read_is_restored(tmp_path):
    """Under the scope on JAX, a large weight of a `.weights.h5` file is read
    into a memory map that JAX aliases; small ones and reads outside the
    scope are Keras' own."""
    from keras.src.saving import saving_lib

    def build():
        return keras.Sequential([keras.Input((512,)), keras.layers.Dense(1024, name="big"),
                                 keras.layers.Dense(3, name="small")])

    source = build()
    source.save_weights(tmp_path / "m.weights.h5")
    keras_read = saving_lib.safe_get_h5_dataset
    with initialization.skip_initializers() as skipped:
        target = build()
        target.load_weights(tmp_path / "m.weights.h5")
    skipped.check_assigned(target)
    assert saving_lib.safe_get_h5_dataset is keras_read
    for s, t in zip(source.weights, target.weights, strict=True):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(s.value),
                                      keras.ops.convert_to_numpy(t.value))
    if keras.backend.backend() == "jax":
        big = target.get_layer("big").kernel.value  # 2 MiB
        assert big.unsafe_buffer_pointer() % mmap.PAGESIZE == 0


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


# -- batched_initializers: random builds in one program -----------------------


def _bits(model):
    """Every weight of `model` as raw bytes (bitwise comparisons, NaN-safe)."""
    return {v.path: (str(v.dtype), tuple(v.shape),
                     keras.ops.convert_to_numpy(v.value).tobytes()) for v in model.weights}


def _seeded(build, seed=3, eager=False):
    keras.utils.set_random_seed(seed)
    if eager:
        with initialization.eager_initializers():
            return build()
    return build()


def _classifier(config, **kwargs):
    backbone = models.VisionTransformerBackbone(**config)
    if config.get("ensemble_size", 1) > 1:
        return models.EnsembleImageClassifier(backbone, num_classes=5, **kwargs)
    return models.ImageClassifier(backbone, num_classes=5, **kwargs)


@jax_only
@pytest.mark.parametrize("family", ["vit", "vmoe", "vmoe_independent_experts",
                                    "soft_moe", "e3"])
def test_model_builds_draw_bit_identical_weights_in_one_program(family):
    from tiny_configs import e3
    from tiny_configs import moe
    from tiny_configs import soft_moe
    from tiny_configs import vit
    from tiny_configs import vmoe

    config = {"vit": lambda: vit(representation_size=8),
              "vmoe": lambda: vmoe(dropout_rate=0.1),
              "vmoe_independent_experts": lambda: vmoe(moe=moe(identical_init=False)),
              "soft_moe": soft_moe, "e3": e3}[family]()

    def build():
        return _classifier(config, head_bias_init=-1.5)

    eager = _bits(_seeded(build, eager=True))
    with Programs() as programs:
        batched = _bits(_seeded(build))
    assert batched == eager
    # The draws, and the seed generators' states (one conversion).
    assert programs.count <= 2


class _EveryInitializer(keras.layers.Layer):
    """One weight per kind of initializer a random build may use."""

    INITIALIZERS = {
        "normal": keras.initializers.RandomNormal(mean=0.3, stddev=0.02, seed=1),
        "normal_default": keras.initializers.RandomNormal(seed=2),
        "truncated": keras.initializers.TruncatedNormal(mean=-1.0, stddev=3.0, seed=3),
        "uniform": keras.initializers.RandomUniform(-0.7, 0.2, seed=4),
        "glorot_normal": keras.initializers.GlorotNormal(seed=5),
        "he_uniform": keras.initializers.HeUniform(seed=6),
        "lecun_normal": keras.initializers.LecunNormal(seed=7),
        "fan_avg": keras.initializers.VarianceScaling(
            2.0, "fan_avg", "untruncated_normal", seed=8),
        "unseeded": keras.initializers.GlorotUniform(),
        "orthogonal": keras.initializers.Orthogonal(seed=9),  # drawn as usual
        "constant": keras.initializers.Constant(0.1),
        "ones": "ones",
        "zeros": "zeros",
    }

    def build(self, input_shape):
        from keras_vmoe.layers.experts import ExpertsInitializer
        from keras_vmoe.models.vit_layers import DenseGeneralInitializer

        for name, init in self.INITIALIZERS.items():
            for shape in ((3, 7), (7, 3), (2, 5, 6), (11,)) if name != "orthogonal" else ((4, 6),):
                self.add_weight(shape, init, name=f"{name}_{'x'.join(map(str, shape))}")
        self.add_weight((4, 6, 5), ExpertsInitializer("he_normal", identical=False),
                        name="experts_independent")
        self.add_weight((4, 6, 5), ExpertsInitializer(
            keras.initializers.RandomNormal(stddev=1e-6), identical=True), name="experts")
        self.add_weight((6, 2, 3), DenseGeneralInitializer("glorot_uniform", 1),
                        name="dense_general")
        self.add_weight((2, 3), "glorot_uniform", dtype="bfloat16", name="bf16")


@jax_only
def test_every_initializer_draws_the_same_bits_batched_and_alone():
    def build():
        layer = _EveryInitializer(name="every")
        layer.build((None, 3))
        return layer

    eager = _bits(_seeded(build, eager=True))
    batched = _bits(_seeded(build))
    assert list(batched) == list(eager)
    for path in eager:
        assert batched[path] == eager[path], path
    assert any(np.any(keras.ops.convert_to_numpy(v.value)) for v in build().weights)


@jax_only
def test_an_assignment_inside_the_scope_is_kept():
    with initialization.batched_initializers():
        layer = keras.layers.Dense(3, name="dense")
        layer.build((None, 4))
        layer.kernel.assign(np.full((4, 3), 2.0, "float32"))
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(layer.kernel.value), 2.0)
    assert np.any(keras.ops.convert_to_numpy(layer.bias.value) == 0)


@jax_only
def test_eager_and_skip_scopes_win_over_a_batched_build():
    def build():
        return models.VisionTransformerBackbone(**vit_fresh_shapes())

    with initialization.batched_initializers(), initialization.skip_initializers() as skip:
        skipped = build()
    assert skip.num_skipped == len(skipped.weights)
    assert all(not np.any(keras.ops.convert_to_numpy(v.value)) for v in skipped.weights)
    with Programs() as programs:
        _seeded(build, eager=True)
    assert programs.count > 2  # one program per initializer and shape, as Keras


# -- `.keras` files -------------------------------------------------------------


def test_a_keras_file_of_a_keras_vmoe_model_loads_without_drawing(tmp_path, monkeypatch):
    from tiny_configs import vmoe

    keras.utils.set_random_seed(1)
    model = _classifier(vmoe(dropout_rate=0.1), head_bias_init=-1.0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    drawn = []
    for cls in (keras.initializers.VarianceScaling, keras.initializers.RandomNormal,
                keras.initializers.Zeros, keras.initializers.Ones):
        original = cls.__call__

        def record(self, shape, dtype=None, original=original):
            drawn.append(shape)
            return original(self, shape, dtype=dtype)

        monkeypatch.setattr(cls, "__call__", record)
    loaded = keras.saving.load_model(path)
    assert drawn == []
    assert _bits(loaded) == _bits(model)
    images = np.random.RandomState(0).uniform(-1, 1, (2, 32, 32, 3)).astype("float32")
    np.testing.assert_array_equal(loaded.predict(images, verbose=0),
                                  model.predict(images, verbose=0))
    # Saved before any training step: the optimizer loads unbuilt, as saved.
    assert not loaded.optimizer.built
    assert not [v for v in loaded.optimizer.variables if v.shape != ()]


def test_other_keras_files_load_as_before(tmp_path, monkeypatch):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="dense")])
    path = str(tmp_path / "plain.keras")
    model.save(path)
    monkeypatch.setattr(initialization, "skip_initializers",
                        lambda: pytest.fail("a plain Keras file skipped its initializers"))
    loaded = keras.saving.load_model(path)
    assert list(_bits(loaded).values()) == list(_bits(model).values())


_DEFAULT_LEVEL_BUILDS = r"""
import json, sys
import keras
sys.path.insert(0, {tests!r})
from tiny_configs import moe, vmoe
from keras_vmoe import models
from keras_vmoe.utils import initialization

def build():
    keras.utils.set_random_seed(4)
    config = vmoe(dropout_rate=0.1, moe=moe(identical_init=False))
    return models.ImageClassifier(models.VisionTransformerBackbone(**config), num_classes=5)

with initialization.eager_initializers():
    eager = build()
batched = build()
print(json.dumps([v.path for a, v in zip(eager.weights, batched.weights, strict=True)
                  if keras.ops.convert_to_numpy(a.value).tobytes()
                  != keras.ops.convert_to_numpy(v.value).tobytes()]))
"""


@jax_only
@pytest.mark.heavy  # a process that compiles at XLA's default optimization level
def test_batched_builds_are_bit_identical_at_the_default_optimization_level():
    # The suite compiles with LLVM's optimization turned down; users do not,
    # and the level changes some drawn values (for both builds alike).
    import json
    import os
    import pathlib
    import subprocess
    import sys

    tests = str(pathlib.Path(__file__).resolve().parents[1])
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_backend_optimization_level")]
    env = {**os.environ, "XLA_FLAGS": " ".join(flags), "KERAS_BACKEND": "jax",
           "PYTHONPATH": os.pathsep.join([str(pathlib.Path(tests).parent),
                                          os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _DEFAULT_LEVEL_BUILDS.format(tests=tests)],
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == []
