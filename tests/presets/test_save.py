"""keras_vmoe.presets.save: `save_to_preset` names a bad model or target."""

import os

import pytest

from keras_vmoe import presets


def test_save_to_preset_needs_a_model(tmp_path):
    with pytest.raises(ValueError, match="expects a keras.Model.*'notamodel'.*str"):
        presets.save_to_preset("notamodel", tmp_path / "preset")
    assert os.listdir(tmp_path) == []


def test_unwritable_parent_names_the_target(tiny_classifier, tmp_path, monkeypatch):
    parent = tmp_path / "readonly"
    parent.mkdir()
    real_mkdir = os.mkdir

    def denied(path, *args, **kwargs):  # as chmod 0o555 would (tests may run as root)
        if os.path.dirname(os.fspath(path)) == str(parent):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", denied)
    target = parent / "preset"
    with pytest.raises(PermissionError) as info:
        presets.save_to_preset(tiny_classifier, target)
    message = str(info.value)
    assert str(target) in message and "Permission denied" in message
    assert ".tmp-" not in message


def test_parent_that_is_a_file_names_the_target(tiny_classifier, tmp_path):
    (tmp_path / "file").write_text("not a directory")
    target = tmp_path / "file" / "preset"
    with pytest.raises(NotADirectoryError, match="Cannot write .*file/preset"):
        presets.save_to_preset(tiny_classifier, target)


@pytest.fixture
def preset_copy(tiny_preset_dir, tmp_path):
    """A writable copy of the tiny preset."""
    import shutil

    path = tmp_path / "preset"
    shutil.copytree(tiny_preset_dir, path)
    return path


def test_save_refuses_a_preset_directory_holding_other_files(
    tiny_classifier, preset_copy
):
    (preset_copy / "notes.txt").write_text("mine")
    (preset_copy / "sub").mkdir()
    (preset_copy / "sub" / "data.bin").write_bytes(b"\0" * 8)
    with pytest.raises(FileExistsError, match="notes.txt, sub"):
        presets.save_to_preset(tiny_classifier, preset_copy)
    assert (preset_copy / "notes.txt").read_text() == "mine"
    assert (preset_copy / "sub" / "data.bin").exists()
    os.remove(preset_copy / "notes.txt")
    os.remove(preset_copy / "sub" / "data.bin")
    os.rmdir(preset_copy / "sub")
    presets.save_to_preset(tiny_classifier, preset_copy)  # its own files: replaced
