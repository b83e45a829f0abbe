"""Loading presets edited by their publisher: NaN weights, unknown arguments."""

import json
import shutil
import sys

import h5py
import numpy as np
import pytest

from keras_vmoe import cli
from keras_vmoe import presets
from keras_vmoe.presets import api
from keras_vmoe.presets import integrity


@pytest.fixture
def preset_copy(tiny_preset_dir, tmp_path):
    path = tmp_path / "preset"
    shutil.copytree(tiny_preset_dir, path)
    return path


def _republish(path, name, key):
    """Records the new SHA-256 of an edited file, as its publisher would."""
    meta_path = path / api.METADATA_FILE
    meta = json.loads(meta_path.read_text())
    meta[key] = integrity.sha256_file(path / name)
    meta_path.write_text(json.dumps(meta))


def test_nan_weights_are_refused_naming_the_weight(preset_copy):
    with h5py.File(preset_copy / presets.WEIGHTS_FILE, "r+") as f:
        datasets = []
        f.visititems(lambda name, node: datasets.append(name)
                     if isinstance(node, h5py.Dataset) and node.dtype.kind == "f"
                     and node.size > 1 else None)
        values = f[datasets[0]][...]
        values.flat[0] = np.nan
        f[datasets[0]][...] = values
    _republish(preset_copy, presets.WEIGHTS_FILE, integrity.WEIGHTS_HASH_KEY)
    with pytest.raises(integrity.PresetIntegrityError,
                       match=r"model.weights.h5: weight .* holds NaN or infinite"):
        presets.from_preset(preset_copy)


def test_an_unknown_backbone_argument_is_refused_naming_it(preset_copy):
    path = preset_copy / presets.CONFIG_FILE
    config = json.loads(path.read_text())
    config["config"]["backbone"]["config"]["sneaky_option"] = 3
    path.write_text(json.dumps(config))
    _republish(preset_copy, presets.CONFIG_FILE, integrity.CONFIG_HASH_KEY)
    with pytest.raises(integrity.PresetIntegrityError,
                       match=r"config.json: the backbone config holds unknown "
                       r"argument\(s\) \['sneaky_option'\]"):
        presets.from_preset(preset_copy, load_weights=False)


@pytest.mark.parametrize("payload, message", [
    ({"module": "os", "class_name": "system", "config": {}, "registered_name": None},
     "an object of module 'os'"),
    ({"class_name": "__lambda__", "config": {"code": "x"}}, "a Python lambda"),
    ({"module": "builtins", "class_name": "function", "config": "eval"},
     "module 'builtins'"),
])
def test_foreign_objects_in_the_config_name_the_field(preset_copy, payload, message):
    path = preset_copy / presets.CONFIG_FILE
    config = json.loads(path.read_text())
    config["config"]["backbone"]["config"]["moe"]["router"] = payload
    path.write_text(json.dumps(config))
    _republish(preset_copy, presets.CONFIG_FILE, integrity.CONFIG_HASH_KEY)
    with pytest.raises(integrity.PresetIntegrityError) as error:
        presets.from_preset(preset_copy, load_weights=False)
    assert "field $.config.backbone.config.moe.router holds" in str(error.value)
    assert message in str(error.value)


def _run_cli(argv, capsys):
    code = cli.main([str(a) for a in argv])
    return code, capsys.readouterr().err


def test_gs_preset_without_tensorflow_is_a_cli_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorflow", None)
    code, err = _run_cli(["demo", "--preset", "gs://bucket/preset"], capsys)
    assert code == 1 and "\nerror: " in "\n" + err and "gs://bucket/preset" in err
