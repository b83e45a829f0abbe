"""keras_vmoe.presets.integrity: Bad, tampered, corrupt and half-written presets.

Every case must give one clear error naming the file and the problem, raised
before the model is built; interrupted writes must be recoverable; corrupt
cached conversions must be rebuilt.
"""

import json
import logging
import os
import shutil
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest

from keras_vmoe import cli
from keras_vmoe import presets
from keras_vmoe.catalog import names
from keras_vmoe.presets import integrity
from keras_vmoe.presets import save

LIGHT1 = "vmoe_s32_last2_ilsvrc2012_randaug_light1"
CONFIG, WEIGHTS, METADATA = names.CONFIG_FILE, save.WEIGHTS_FILE, save.METADATA_FILE


@pytest.fixture
def nothing_loaded(monkeypatch):
    """Fails if weights are loaded: the preset is checked against a model
    whose variables are unwritten placeholders (no memory, nothing drawn)."""

    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before the preset was checked")

    monkeypatch.setattr(keras.saving, "load_weights", refuse)


def _edit_json(path, edit):
    with open(path) as f:
        value = json.load(f)
    edit(value)  # in place
    with open(path, "w") as f:
        json.dump(value, f)


def _backbone(config):
    return config["config"]["backbone"]["config"]


def _run_cli(argv, capsys):
    code = cli.main([str(a) for a in argv])
    return code, capsys.readouterr().err


# ----------------------------------------------------------------------
# `config.json` is checked against the stored weights' shapes.
# ----------------------------------------------------------------------


def _rehash_config(path):
    """What anyone publishing a preset can do: record the edited config's hash."""
    digest = integrity.sha256_file(path / CONFIG)
    _edit_json(path / METADATA, lambda m: m.update({integrity.CONFIG_HASH_KEY: digest}))


@pytest.mark.parametrize(
    "key, value, variable",
    [("mlp_dim", 1000, "dense_0/kernel"), ("num_experts", 1000, "moe")],
)
def test_tampered_config_is_rejected_before_loading(
    preset_copy, nothing_loaded, key, value, variable
):
    def tamper(config):
        target = _backbone(config)
        (target["moe"] if key == "num_experts" else target)[key] = value

    _edit_json(preset_copy / CONFIG, tamper)
    _rehash_config(preset_copy)  # the hashes then match: the shapes cannot
    with pytest.raises(integrity.PresetIntegrityError) as info:
        presets.from_preset(preset_copy)
    message = str(info.value)
    assert str(preset_copy / CONFIG) in message and str(preset_copy / WEIGHTS) in message
    assert variable in message and str(value) in message  # variable and its shapes
    assert "shape" in message


# ----------------------------------------------------------------------
# Exact names and shapes; SHA-256 of the weights.
# ----------------------------------------------------------------------


def _drop_hash(path):
    _edit_json(path / METADATA, lambda m: m.pop(integrity.WEIGHTS_HASH_KEY, None))


def test_weights_of_another_architecture_are_rejected(preset_copy, tiny_overrides):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        deeper = presets.from_preset(
            "vmoe_s32", load_weights=False, num_classes=5,
            **dict(tiny_overrides, num_layers=5),
        )
    deeper.save_weights(preset_copy / WEIGHTS)
    _drop_hash(preset_copy)  # only the names and shapes can tell
    with pytest.raises(integrity.PresetIntegrityError) as info:
        presets.from_preset(preset_copy)
    message = str(info.value)
    assert "encoder_block_4" in message and "not a variable of the model" in message
    assert str(preset_copy / WEIGHTS) in message


def test_saved_preset_records_the_weights_hash(tiny_preset_dir):
    with open(tiny_preset_dir / METADATA) as f:
        recorded = json.load(f)[integrity.WEIGHTS_HASH_KEY]
    assert recorded == integrity.sha256_file(tiny_preset_dir / WEIGHTS)


def test_shape_check_runs_on_every_load(preset_copy, monkeypatch):
    """Matching hashes only say the files are the publisher's: the shapes are
    checked on every load. An edit that keeps the shapes (routing settings)
    loads once its hash is recorded."""
    real = integrity.check_weights_match
    calls = []
    monkeypatch.setattr(
        integrity, "check_weights_match", lambda *a: calls.append(a) or real(*a)
    )
    presets.from_preset(preset_copy)
    assert len(calls) == 1
    _edit_json(
        preset_copy / CONFIG,
        lambda c: _backbone(c)["moe"]["router"].update(capacity_factor=2.0),
    )
    _rehash_config(preset_copy)
    model = presets.from_preset(preset_copy)
    assert len(calls) == 2
    assert model.backbone.moe["router"]["capacity_factor"] == 2.0


def test_flipped_weight_bytes_are_detected(preset_copy):
    weights = preset_copy / WEIGHTS
    data = bytearray(weights.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
    weights.write_bytes(bytes(data))
    with pytest.raises(integrity.PresetIntegrityError) as info:
        presets.from_preset(preset_copy)
    message = str(info.value)
    assert str(weights) in message and "SHA-256" in message
    assert "re-convert" in message.lower() or "re-download" in message.lower()


def test_preset_without_hash_loads_with_a_warning(preset_copy, tiny_classifier):
    _drop_hash(preset_copy)
    with pytest.warns(UserWarning, match="UNVERIFIED.*model.weights.h5"):
        model = presets.from_preset(preset_copy)
    for loaded, saved in zip(model.weights, tiny_classifier.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(loaded.value), np.asarray(saved.value))


# ----------------------------------------------------------------------
# Replacing a preset survives a kill at any step.
# ----------------------------------------------------------------------


class _Killed(BaseException):
    """The process "dies": no later file operation of the writer happens."""


def _kill_at(monkeypatch, folder, step):
    """Makes the `step`-th rename/rmtree under `folder` (1-based) the last."""
    state = {"count": 0}
    real_rename, real_rmtree = os.rename, shutil.rmtree

    def watched(real):
        def operation(path, *args, **kwargs):
            if str(path).startswith(str(folder)):
                state["count"] += 1
                if state["count"] >= step:
                    raise _Killed(f"killed at step {state['count']}")
            return real(path, *args, **kwargs)

        return operation

    monkeypatch.setattr(os, "rename", watched(real_rename))
    monkeypatch.setattr(shutil, "rmtree", watched(real_rmtree))
    # The writer's pid is the test's, which "died": its temporaries are stale.
    monkeypatch.setattr(integrity, "_pid_alive", lambda pid: False)
    return real_rename, real_rmtree


@pytest.mark.parametrize(
    "step, next_call",
    [(1, "load"), (2, "load"), (2, "save"), (3, "save")],
    ids=["aside-load", "into-place-load", "into-place-save", "cleanup-save"],
)
def test_killed_replacement_is_recovered(
    tiny_classifier, tiny_preset_dir, tmp_path, monkeypatch, step, next_call
):
    folder = tmp_path / "out"
    folder.mkdir()
    target = folder / "preset"
    shutil.copytree(tiny_preset_dir, target)
    real_rename, real_rmtree = _kill_at(monkeypatch, folder, step)
    with pytest.raises(_Killed):
        presets.save_to_preset(tiny_classifier, target)
    monkeypatch.setattr(os, "rename", real_rename)
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    if next_call == "load":
        model = presets.from_preset(target)
        assert model.count_params() == tiny_classifier.count_params()
    else:
        presets.save_to_preset(tiny_classifier, target)
    assert sorted(os.listdir(folder)) == ["preset"]
    assert integrity.is_preset_complete(str(target))


def test_temporaries_of_a_running_writer_are_kept(tiny_classifier, tmp_path):
    target = tmp_path / "preset"
    busy = tmp_path / f".preset.tmp-{os.getpid()}-0123abcd"  # this process
    busy.mkdir()
    presets.save_to_preset(tiny_classifier, target)
    assert busy.exists()


def _dead_pid():
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


# ----------------------------------------------------------------------
# Corrupt cached conversions are rebuilt.
# ----------------------------------------------------------------------


@pytest.fixture
def mirror_with_converter(isolated_cache, tmp_path, monkeypatch, tiny_preset_dir):
    """A mirror "holding" LIGHT1 and a converter copying the tiny preset.

    Returns the list of converter calls.
    """
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    (mirror / f"{LIGHT1}.index").write_bytes(b"")
    monkeypatch.setenv("KERAS_VMOE_CHECKPOINT_ROOT", str(mirror))
    calls = []
    from keras_vmoe.presets import convert as module

    def convert(source, output_dir, preset_name=None):
        calls.append(source)
        shutil.copytree(tiny_preset_dir, output_dir)

    monkeypatch.setattr(module, "convert_to_preset", convert)
    return calls


def _truncate_weights(cache):
    weights = cache / WEIGHTS
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def _remove_config(cache):
    (cache / CONFIG).unlink()


@pytest.mark.parametrize(
    "damage, problem",
    [(_truncate_weights, "SHA-256"), (_remove_config, CONFIG)],
    ids=["truncated-weights", "no-config"],
)
def test_corrupt_cache_is_rebuilt(
    mirror_with_converter, isolated_cache, caplog, damage, problem
):
    presets.from_preset(LIGHT1)
    cache = isolated_cache / "keras_vmoe" / LIGHT1
    damage(cache)
    with caplog.at_level(logging.WARNING):
        model = presets.from_preset(LIGHT1)
    assert len(mirror_with_converter) == 2  # converted again
    assert model.count_params() > 0
    assert integrity.is_preset_complete(str(cache))
    assert sorted(os.listdir(cache.parent)) == [LIGHT1]
    logged = caplog.text
    assert str(cache) in logged and problem in logged


def test_corrupt_cache_without_source_names_the_path(
    mirror_with_converter, isolated_cache, monkeypatch
):
    presets.from_preset(LIGHT1)
    cache = isolated_cache / "keras_vmoe" / LIGHT1
    _truncate_weights(cache)
    monkeypatch.delenv("KERAS_VMOE_CHECKPOINT_ROOT")
    with pytest.raises(presets.PresetWeightsUnavailableError) as info:
        presets.from_preset(LIGHT1)
    assert f"the cached conversion {cache} is corrupt" in str(info.value)


def test_stale_cache_temporaries_are_removed(mirror_with_converter, isolated_cache):
    root = isolated_cache / "keras_vmoe"
    stale = root / f".{LIGHT1}.tmp-{_dead_pid()}-0123abcd"
    (stale / "preset").mkdir(parents=True)
    presets.from_preset(LIGHT1)
    assert sorted(os.listdir(root)) == [LIGHT1]


# ----------------------------------------------------------------------
# Unreadable files give errors naming them, also from the CLI.
# ----------------------------------------------------------------------


def _write(name, content):
    def damage(path):
        (path / name).write_bytes(content)
        return path / name

    return damage


def _directory_as(name):
    def damage(path):
        (path / name).unlink()
        (path / name).mkdir()
        return path / name

    return damage


BAD_FILES = {
    "empty-config": (_write(CONFIG, b""), "is empty"),
    "truncated-config": (_write(CONFIG, b'{"module": "keras_vmoe'), "not valid JSON"),
    "list-config": (_write(CONFIG, b"[1, 2]"), "must hold a JSON object"),
    "empty-weights": (_write(WEIGHTS, b""), "is empty"),
    "text-weights": (_write(WEIGHTS, b"<html>Not Found</html>"), "not an HDF5"),
    "config-directory": (_directory_as(CONFIG), "is a directory"),
    "weights-directory": (_directory_as(WEIGHTS), "is a directory"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_unreadable_preset_file(preset_copy, capsys, case):
    damage, problem = BAD_FILES[case]
    path = damage(preset_copy)
    with pytest.raises(ValueError, match=problem) as info:
        presets.from_preset(preset_copy)
    assert str(path) in str(info.value)
    code, err = _run_cli(["demo", "--preset", preset_copy], capsys)
    assert code == 1 and err.strip().splitlines()[-1].startswith("error: ")
    assert str(path) in err
    assert "Traceback" not in err


def _publish(path, edit):
    """Edits config.json as a hostile publisher would: hash recomputed."""
    _edit_json(path / CONFIG, edit)
    digest = integrity.sha256_file(path / CONFIG)
    _edit_json(path / METADATA, lambda m: m.update({integrity.CONFIG_HASH_KEY: digest}))


def test_sharded_weights_in_place_of_the_h5_are_refused(preset_copy, tiny_classifier):
    os.remove(preset_copy / WEIGHTS)
    tiny_classifier.save_weights(preset_copy / "model.weights.json", max_shard_size=0.001)
    assert (preset_copy / "model.weights.json").exists()
    with pytest.raises(integrity.PresetIntegrityError, match="sharded weights"):
        presets.from_preset(preset_copy)


def test_edited_router_is_refused(preset_copy):
    def to_expert_choice(config):
        router = _backbone(config)["moe"]["router"]
        router.update(name="expert_choice")
        router.pop("num_selected_experts", None)

    _edit_json(preset_copy / CONFIG, to_expert_choice)
    with pytest.raises(integrity.PresetIntegrityError) as info:
        presets.from_preset(preset_copy)
    assert str(preset_copy / CONFIG) in str(info.value)
    assert "changed after the preset was saved" in str(info.value)


@pytest.mark.parametrize("how", ["keys", "file"])
def test_preset_without_hashes_warns_that_it_is_unverified(preset_copy, how):
    if how == "file":
        os.remove(preset_copy / METADATA)
    else:
        _edit_json(
            preset_copy / METADATA,
            lambda m: [m.pop(k) for k in (integrity.CONFIG_HASH_KEY,
                                          integrity.WEIGHTS_HASH_KEY)],
        )
    with pytest.warns(UserWarning, match=r"UNVERIFIED.*config\.json, model\.weights\.h5"):
        presets.from_preset(preset_copy)


def test_deeply_nested_config_names_the_file(preset_copy):
    (preset_copy / CONFIG).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(integrity.PresetIntegrityError) as info:
        presets.from_preset(preset_copy)
    assert str(preset_copy / CONFIG) in str(info.value)
    assert "nested too deeply" in str(info.value)


def test_a_package_class_that_does_not_exist_is_named(preset_copy):
    def pwn(config):
        config["config"]["backbone"]["registered_name"] = "keras_vmoe>Pwn"
        config["config"]["backbone"]["class_name"] = "Pwn"

    _publish(preset_copy, pwn)
    with pytest.raises(integrity.PresetIntegrityError) as info:
        presets.from_preset(preset_copy)
    message = str(info.value)
    assert str(preset_copy / CONFIG) in message
    assert "'keras_vmoe>Pwn'" in message and "$.config.backbone" in message
    assert "num_layers" not in message  # no dump of the config
