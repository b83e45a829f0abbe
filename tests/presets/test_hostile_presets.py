"""Presets from strangers: memory bombs, bypassed hashes, hangs.

Anyone publishing a preset can edit `config.json` and record its new
SHA-256: the hashes then only say "these are the publisher's files". Every
load must still refuse configs larger than the machine (from their numbers,
before anything is built), check the weights' shapes, and never block.
"""

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from keras_vmoe import budget
from keras_vmoe import presets
from keras_vmoe.presets import api
from keras_vmoe.presets import integrity

CONFIG, WEIGHTS, METADATA = presets.CONFIG_FILE, presets.WEIGHTS_FILE, api.METADATA_FILE
GIB = 2**30


# ----------------------------------------------------------------------
# Shared helpers.
# ----------------------------------------------------------------------


@pytest.fixture
def preset_copy(tiny_preset_dir, tmp_path):
    """A writable copy of the tiny preset."""
    import shutil

    path = tmp_path / "preset"
    shutil.copytree(tiny_preset_dir, path)
    return path


@pytest.fixture
def machine_16gib(monkeypatch):
    """A machine with 16 GiB, whatever runs the tests; no override set."""
    monkeypatch.delenv(budget.ALLOW_ENV, raising=False)
    monkeypatch.setattr(budget, "memory_limit", lambda: 16 * GIB)


def _edit_json(path, edit):
    with open(path) as f:
        value = json.load(f)
    edit(value)
    with open(path, "w") as f:
        json.dump(value, f)


def _backbone(config):
    return config["config"]["backbone"]["config"]


def _publish(path, edit):
    """Edits config.json as a hostile publisher would: hash recomputed."""
    _edit_json(path / CONFIG, edit)
    digest = integrity.sha256_file(path / CONFIG)
    _edit_json(path / METADATA, lambda m: m.update({integrity.CONFIG_HASH_KEY: digest}))


def _set(key, value):
    def edit(config):
        if key == "num_classes":
            config["config"]["num_classes"] = value
        elif key == "num_experts":
            _backbone(config)["moe"]["num_experts"] = value
        else:
            _backbone(config)[key] = value

    return edit


# ----------------------------------------------------------------------
# Item 1: giant configs are refused from their numbers.
# ----------------------------------------------------------------------

BOMBS = [
    ("hidden_dim", 10**9),
    ("mlp_dim", 10**9),
    ("num_layers", 10**6),
    ("num_experts", 10**8),
    ("num_classes", 10**9),
    ("image_size", 10**6),
]


@pytest.mark.parametrize("load_weights", [True, False])
@pytest.mark.parametrize("key, value", BOMBS)
def test_giant_config_is_refused_before_building(
    preset_copy, machine_16gib, monkeypatch, key, value, load_weights
):
    built = []
    monkeypatch.setattr(
        integrity, "expected_weight_shapes", lambda *a: built.append(a) or {}
    )
    _publish(preset_copy, _set(key, value))
    with pytest.raises(ValueError) as info:
        presets.from_preset(preset_copy, load_weights=load_weights)
    message = str(info.value)
    assert str(preset_copy / CONFIG) in message
    assert str(value) in message
    if key != "num_layers":
        assert isinstance(info.value, budget.MemoryBudgetError)
        assert "17179869184 bytes" in message and budget.ALLOW_ENV in message
    assert built == []  # not even an abstract build


@pytest.mark.parametrize(
    "family, variant, overrides",
    [("vmoe", "B/32", {"layout": "last2"}), ("soft_moe", "S/16", {}),
     ("vit", "B/16", {}), ("eee", "S/32", {}), ("vmoe_15b", None, {})],
)
def test_size_estimate_never_exceeds_the_real_count(family, variant, overrides):
    """The refusal compares a lower bound: no real model is refused early."""
    from keras_vmoe.models import backbone_config
    from keras_vmoe.models import count_parameters
    from keras_vmoe.models.size import backbone_sizes

    config = backbone_config(family, variant, **overrides)
    estimate, _ = backbone_sizes(config)
    real = count_parameters(config)
    assert 0.9 * real <= estimate <= real


def test_override_lets_a_large_config_through(preset_copy, machine_16gib, monkeypatch):
    _publish(preset_copy, _set("mlp_dim", 10**9))
    monkeypatch.setenv(budget.ALLOW_ENV, "1")
    # Past the budget, the weights' shapes still disagree with the config.
    with pytest.raises(integrity.PresetIntegrityError, match="dense_0/kernel"):
        presets.from_preset(preset_copy)


def test_memory_bomb_under_an_address_space_limit(preset_copy, tmp_path):
    """A real process with RLIMIT_AS set: a clear error, no MemoryError/abort."""
    _publish(preset_copy, _set("num_experts", 10**8))
    script = textwrap.dedent(
        f"""
        import resource
        import keras_vmoe.presets as presets
        from keras_vmoe import budget

        with open("/proc/self/statm") as f:
            used = int(f.read().split()[0]) * resource.getpagesize()
        limit = used + 3 * 2**30  # what is mapped now, plus 3 GiB
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        try:
            presets.from_preset({str(preset_copy)!r}, load_weights=False)
        except budget.MemoryBudgetError as error:
            print("REFUSED", error)
        """
    )
    env = {**os.environ, "KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu"}
    env.pop(budget.ALLOW_ENV, None)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True,
        timeout=300, env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "REFUSED" in result.stdout, result.stdout + result.stderr[-3000:]
    assert "num_experts" in result.stdout and "100000000" in result.stdout


# ----------------------------------------------------------------------
# Item 4: a FIFO in place of config.json does not block.
# ----------------------------------------------------------------------


def _returns_within(seconds, function):
    """Runs `function` in a daemon thread; its outcome or a timeout failure."""
    outcome = {}

    def target():
        try:
            outcome["value"] = function()
        except BaseException as error:  # noqa: BLE001 - reported below
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still blocked after {seconds} s"
    return outcome


@pytest.mark.parametrize("name", [CONFIG, METADATA, WEIGHTS])
def test_fifo_in_place_of_a_preset_file_is_refused(preset_copy, name):
    os.remove(preset_copy / name)
    os.mkfifo(preset_copy / name)
    outcome = _returns_within(30, lambda: presets.from_preset(preset_copy))
    error = outcome.get("error")
    assert isinstance(error, integrity.PresetIntegrityError), outcome
    assert str(preset_copy / name) in str(error) and "FIFO" in str(error)


@pytest.mark.parametrize("load_weights", [True, False])
def test_sinkhorn_iteration_bomb_in_a_preset_is_refused(preset_copy, load_weights):
    def edit(config):
        _backbone(config)["moe"]["router"].update(
            name="sinkhorn_token_choice", sinkhorn_iterations=10**7
        )

    _publish(preset_copy, edit)
    outcome = _returns_within(
        60, lambda: presets.from_preset(preset_copy, load_weights=load_weights)
    )
    error = outcome.get("error")
    assert isinstance(error, (ValueError, TypeError)), outcome  # Keras wraps some
    assert "`sinkhorn_iterations` must be an integer between 1 and 1000" in str(error)


# ----------------------------------------------------------------------
# Item 6: every loaded file is covered by the recorded hashes.
# ----------------------------------------------------------------------


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


# ----------------------------------------------------------------------
# Item 9: save_to_preset never deletes files it did not write.
# ----------------------------------------------------------------------


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


# ----------------------------------------------------------------------
# Item 11: unreadable JSON names the file.
# ----------------------------------------------------------------------


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
