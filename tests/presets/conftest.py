"""Shared fixtures of the preset tests: tiny models and an isolated cache."""

import shutil
import sys

import numpy as np
import pytest
from tiny_configs import PRESET_OVERRIDES as TINY


@pytest.fixture(scope="session")
def tiny_overrides():
    return dict(TINY)


@pytest.fixture(scope="session")
def images():
    return np.random.RandomState(0).uniform(-1, 1, (4, 32, 32, 3)).astype("float32")


@pytest.fixture(scope="session")
def tiny_classifier():
    """A tiny V-MoE classifier (5 classes) with non-trivial weights."""
    import keras

    from keras_vmoe import presets

    keras.utils.set_random_seed(1)
    model = presets.from_preset("vmoe_s32", load_weights=False, num_classes=5, **TINY)
    # Make the head and position embedding non-zero so that copies and
    # resizes are observable.
    rng = np.random.RandomState(2)
    for variable in model.weights:
        if variable.path.startswith("head/") or "position_embedding" in variable.path:
            variable.assign(rng.normal(0, 0.5, variable.shape).astype("float32"))
    return model


@pytest.fixture(scope="session")
def tiny_preset_dir(tiny_classifier, tmp_path_factory):
    from keras_vmoe import presets

    path = tmp_path_factory.mktemp("presets") / "tiny_vmoe"
    presets.save_to_preset(tiny_classifier, path)
    return path


@pytest.fixture
def isolated_cache(monkeypatch, tmp_path):
    """Keras home in a temporary directory, no checkpoint mirror, no TensorFlow."""
    home = tmp_path / "keras_home"
    home.mkdir()
    monkeypatch.setenv("KERAS_HOME", str(home))
    monkeypatch.delenv("KERAS_VMOE_CHECKPOINT_ROOT", raising=False)
    monkeypatch.setitem(sys.modules, "tensorflow", None)
    return home


@pytest.fixture
def preset_copy(tiny_preset_dir, tmp_path):
    """A writable copy of the tiny preset."""
    path = tmp_path / "preset"
    shutil.copytree(tiny_preset_dir, path)
    return path
