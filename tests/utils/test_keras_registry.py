"""keras_vmoe.utils.keras_registry: Keras finds keras_vmoe's classes after
`import keras_vmoe` alone, in either order with `import keras`; a name of
the package that it does not define is named in the error."""

import importlib
import json
import pathlib
import subprocess
import sys
import zipfile

import keras
import numpy as np
import pytest
import tiny_configs

from keras_vmoe.utils import keras_registry

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_keras_registry_is_the_lazy_one_in_this_process():
    from keras.src.saving import object_registration

    assert isinstance(object_registration.GLOBAL_CUSTOM_OBJECTS, keras_registry._Registry)


def test_the_registry_imports_the_modules_on_the_first_unknown_name(tmp_path, monkeypatch):
    from keras.src.saving import object_registration

    (tmp_path / "lazy_registered_pkg.py").write_text(
        "import keras\n\n"
        "@keras.saving.register_keras_serializable(package='lazy_pkg')\n"
        "class Thing(keras.layers.Layer):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lazy_registered_pkg", raising=False)
    registry = keras_registry._Registry(
        object_registration.GLOBAL_CUSTOM_OBJECTS, "lazy_pkg",
        lambda: importlib.import_module("lazy_registered_pkg"))
    monkeypatch.setattr(object_registration, "GLOBAL_CUSTOM_OBJECTS", registry)
    assert keras.saving.get_registered_object("other_pkg>Thing") is None
    assert "lazy_registered_pkg" not in sys.modules and not registry.loaded
    assert keras.saving.get_registered_object("lazy_pkg>Thing").__name__ == "Thing"
    assert registry.loaded and "lazy_registered_pkg" in sys.modules
    with pytest.raises(keras_registry.UnknownClassError, match=r"'lazy_pkg>Thng'.*"
                       r"did you mean 'lazy_pkg>Thing'"):
        keras.saving.get_registered_object("lazy_pkg>Thng")


def test_an_unknown_class_of_the_package_is_named_with_its_nearest_names():
    with pytest.raises(ValueError, match=r"'keras_vmoe>ImageClassifer'.*did you mean "
                       r"'keras_vmoe>ImageClassifier'") as caught:
        keras.saving.get_registered_object("keras_vmoe>ImageClassifer")
    assert len(str(caught.value)) < 500
    with pytest.raises(ValueError, match=r"'keras_vmoe>Nothing'.*keras_vmoe>ImageClassifier"):
        keras.saving.get_registered_object("keras_vmoe>Nothing")
    assert keras.saving.get_registered_object("another_package>Nothing") is None


def test_an_edited_registered_name_in_a_keras_file_names_the_class(tmp_path):
    from keras_vmoe.layers.layer_norm import LayerNorm

    model = keras.Sequential([keras.Input((4,)), LayerNorm(name="norm")])
    path = tmp_path / "model.keras"
    model.save(path)
    edited = tmp_path / "edited.keras"
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(edited, "w") as target:
        for item in source.infolist():
            data = source.read(item.filename)
            if item.filename == "config.json":
                data = data.replace(b'"keras_vmoe>LayerNorm"', b'"keras_vmoe>LayerNrm"')
                assert b"keras_vmoe>LayerNrm" in data
            target.writestr(item, data)
    with pytest.raises(keras_registry.UnknownClassError) as caught:
        keras.saving.load_model(edited)
    message = str(caught.value)
    assert "'keras_vmoe>LayerNrm'" in message and "'keras_vmoe>LayerNorm'" in message
    assert "Full object config" not in message and len(message) < 500


def test_the_listed_modules_register_every_class_of_the_package():
    code = (
        "import keras_vmoe, keras, sys\n"
        "assert 'keras_vmoe.models' not in sys.modules\n"
        "assert keras.saving.get_registered_object('keras_vmoe>MoeLayer') is not None\n"
        "print(sorted(m for m in sys.modules if m.startswith('keras_vmoe')))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=ROOT, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    imported = set(json.loads(result.stdout.strip().replace("'", '"')))
    registering = {
        ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for path in (ROOT / "keras_vmoe").rglob("*.py")
        if "register_keras_serializable(" in path.read_text()}
    assert registering and registering <= imported, registering - imported


def _saved_model(tmp_path):

    from keras_vmoe import models

    model = models.ImageClassifier(
        models.VisionTransformerBackbone(**tiny_configs.vmoe_8px_micro()), num_classes=3)
    path = tmp_path / "model.keras"
    model.save(path)
    images = np.random.default_rng(0).uniform(-1, 1, (2, 8, 8, 3)).astype("float32")
    np.save(tmp_path / "images.npy", images)
    np.save(tmp_path / "logits.npy", model.predict_on_batch(images))
    return path


@pytest.mark.heavy
@pytest.mark.parametrize("imports", ["import keras, keras_vmoe", "import keras_vmoe, keras"])
def test_a_keras_file_loads_in_a_fresh_process_after_importing_the_package(
        tmp_path, imports):
    _saved_model(tmp_path)
    code = (
        f"{imports}\nimport sys, numpy as np\n"
        "assert 'keras_vmoe.models' not in sys.modules\n"
        "model = keras.saving.load_model('model.keras')\n"
        "logits = model.predict_on_batch(np.load('images.npy'))\n"
        "print(type(model).__name__, np.array_equal(logits, np.load('logits.npy')))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=tmp_path, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["ImageClassifier", "True"]
