"""upload_preset and `keras-vmoe upload`, with the hub clients replaced.

The network call itself is not made here: fake `huggingface_hub` and
`kagglehub` modules record the calls.
"""

import json
import shutil
import sys
import types

import pytest

from keras_vmoe import cli
from keras_vmoe import presets


@pytest.fixture
def clients(monkeypatch):
    calls = []
    hub = types.ModuleType("huggingface_hub")
    hub.create_repo = lambda repo_id, **kw: calls.append(("create_repo", repo_id, kw))
    hub.upload_folder = lambda **kw: calls.append(("upload_folder", kw))
    kaggle = types.ModuleType("kagglehub")
    kaggle.model_upload = lambda handle, path: calls.append(("model_upload", handle, path))
    monkeypatch.setitem(sys.modules, "huggingface_hub", hub)
    monkeypatch.setitem(sys.modules, "kagglehub", kaggle)
    return calls


@pytest.fixture
def preset(tiny_preset_dir, tmp_path):
    path = tmp_path / "preset"
    shutil.copytree(tiny_preset_dir, path)
    return path


def test_upload_to_hugging_face_and_kaggle(clients, preset):
    assert presets.upload_preset("hf://me/vmoe-tiny/v1", preset) == "hf://me/vmoe-tiny/v1"
    assert clients[0] == ("create_repo", "me/vmoe-tiny",
                          {"repo_type": "model", "exist_ok": True})
    assert clients[1][1]["repo_id"] == "me/vmoe-tiny"
    assert clients[1][1]["folder_path"] == str(preset)
    assert clients[1][1]["path_in_repo"] == "v1"
    presets.upload_preset("kaggle://me/vmoe/keras/tiny", str(preset))
    assert clients[2] == ("model_upload", "me/vmoe/keras/tiny", str(preset))


def test_altered_or_incomplete_presets_are_not_uploaded(clients, preset):
    weights = preset / "model.weights.h5"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(presets.PresetIntegrityError, match="SHA-256"):
        presets.upload_preset("hf://me/repo", preset)
    config = preset / "config.json"
    config.write_text(config.read_text() + " ")
    with pytest.raises(presets.PresetIntegrityError, match="changed after"):
        presets.upload_preset("hf://me/repo", preset)
    metadata = json.loads((preset / "metadata.json").read_text())
    del metadata["config_sha256"]
    (preset / "metadata.json").write_text(json.dumps(metadata))
    with pytest.raises(presets.PresetIntegrityError, match="records no config_sha256"):
        presets.upload_preset("hf://me/repo", preset)
    weights.unlink()
    with pytest.raises(ValueError, match="model.weights.h5 missing"):
        presets.upload_preset("hf://me/repo", preset)
    with pytest.raises(ValueError, match="not a directory"):
        presets.upload_preset("hf://me/repo", preset / "nothing")
    assert clients == []


def test_bad_uris_and_missing_clients(preset, monkeypatch):
    for uri in ("s3://me/repo", "hf://me", "kaggle://me/vmoe/keras/tiny/3",
                "kaggle://me/vmoe/jax/tiny"):
        with pytest.raises(ValueError, match="uri="):
            presets.upload_preset(uri, preset)
    monkeypatch.setitem(sys.modules, "kagglehub", None)
    with pytest.raises(ImportError, match=r"keras-vmoe\[hub\]"):
        presets.upload_preset("kaggle://me/vmoe/keras/tiny", preset)


def test_upload_command(clients, preset, capsys, monkeypatch):
    fake = sys.modules["huggingface_hub"]
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    assert cli.main(["upload", "hf://me/repo", str(preset)]) == 1
    assert "pip install 'keras-vmoe[hub]'" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "huggingface_hub", fake)
    assert cli.main(["upload", "hf://me/repo", str(preset)]) == 0
    assert f"Uploaded {preset} to hf://me/repo" in capsys.readouterr().out
    assert clients[-1][1]["repo_id"] == "me/repo"
    (preset / "config.json").write_text("{}")
    assert cli.main(["upload", "hf://me/repo", str(preset)]) == 1
    assert "changed after" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    preset_copy = preset.parent / "other"
    assert cli.main(["upload", "hf://me/repo", str(preset_copy)]) == 1
    assert "not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("uri", ["hf://me/repo/../other", "hf://me/..", "kaggle://me/m/keras/.."])
def test_dot_segments_are_refused(clients, preset, uri):
    with pytest.raises(ValueError, match="its parts cannot be"):
        presets.upload_preset(uri, preset)
    assert clients == []
