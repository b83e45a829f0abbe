"""from_preset / save_to_preset / handles, on tiny models (no network)."""

import json
import os
import re
import shutil
import sys
import types
import warnings

import keras
import numpy as np
import pytest
import tiny_configs

import keras_vmoe
from keras_vmoe import models
from keras_vmoe import presets
from keras_vmoe.models.vit_embeddings import resize_position_embedding
from keras_vmoe.presets import hub_vits
from keras_vmoe.presets import save as save_module

LIGHT1 = "vmoe_s32_last2_ilsvrc2012_randaug_light1"


def _predict(model, x):
    # An eager call: every tiny model of the standard shapes reuses the per-op
    # compilation cache, where `predict` would compile each new model.
    return np.asarray(model(x, training=False))


def _predict_jit(model, x):
    # For shapes seen once (another resolution, the E³ tiling, other routing
    # groups), one jit compilation is cheaper than compiling every eager op.
    return np.asarray(model.predict(x, verbose=0))


def _weights(model):
    return [np.asarray(v.value) for v in model.weights]


# ----------------------------------------------------------------------
# Save / load.
# ----------------------------------------------------------------------


@pytest.mark.heavy
def test_round_trip_gives_identical_outputs(tiny_classifier, tiny_preset_dir, images):
    assert sorted(os.listdir(tiny_preset_dir)) == [
        "config.json",
        "metadata.json",
        "model.weights.h5",
    ]
    loaded = presets.from_preset(tiny_preset_dir)
    assert isinstance(loaded, models.ImageClassifier)
    assert loaded.backbone.get_config() == tiny_classifier.backbone.get_config()
    np.testing.assert_array_equal(
        _predict(loaded, images), _predict(tiny_classifier, images)
    )
    # String paths and file:// work too.
    again = presets.from_preset(f"file://{tiny_preset_dir}")
    np.testing.assert_array_equal(_weights(again)[0], _weights(loaded)[0])


def test_preset_files(tiny_classifier, tiny_preset_dir):
    with open(tiny_preset_dir / "config.json") as f:
        config = json.load(f)
    assert config["registered_name"] == "keras_vmoe>ImageClassifier"
    assert "compile_config" not in config and "build_config" not in config
    assert config["config"]["backbone"]["registered_name"] == (
        "keras_vmoe>VisionTransformerBackbone"
    )
    with open(tiny_preset_dir / "metadata.json") as f:
        metadata = json.load(f)
    assert metadata["keras_vmoe_version"] == keras_vmoe.__version__
    assert metadata["keras_version"] == keras.__version__
    assert metadata["parameter_count"] == tiny_classifier.count_params()
    assert metadata["date_saved"]
    # The model came from the catalog: its entry is recorded.
    assert metadata["preset_name"] == "vmoe_s32_last2"
    assert metadata["catalog"]["paper"] == "arXiv:2106.05974"
    assert metadata["preset_overrides"]["hidden_dim"] == 32


@pytest.mark.heavy
def test_backbone_round_trip(tiny_classifier, tmp_path, images):
    backbone = tiny_classifier.backbone
    presets.save_to_preset(backbone, tmp_path / "backbone", metadata={"note": "x"})
    loaded = presets.from_preset(tmp_path / "backbone")
    assert isinstance(loaded, models.VisionTransformerBackbone)
    np.testing.assert_array_equal(_predict(loaded, images), _predict(backbone, images))
    with open(tmp_path / "backbone" / "metadata.json") as f:
        assert json.load(f)["note"] == "x"


@pytest.mark.heavy
def test_ensemble_round_trip(tiny_overrides, tmp_path, images):
    model = presets.from_preset(
        "eee_s32", load_weights=False, num_classes=3, **tiny_overrides
    )
    assert isinstance(model, models.EnsembleImageClassifier)
    assert model.backbone.ensemble_size == 2
    presets.save_to_preset(model, tmp_path / "eee")
    loaded = presets.from_preset(tmp_path / "eee")
    assert isinstance(loaded, models.EnsembleImageClassifier)
    assert loaded.backbone.get_config() == model.backbone.get_config()
    for saved, restored in zip(_weights(model), _weights(loaded), strict=True):
        np.testing.assert_array_equal(saved, restored)
    assert _predict_jit(loaded, images[:2]).shape == (2, 3)  # the ensemble's scores
    assert loaded.predict_members(images[:2], verbose=0).shape == (2, 2, 3)


def test_load_weights_false_gives_fresh_weights(tiny_classifier, tiny_preset_dir):
    fresh = presets.from_preset(tiny_preset_dir, load_weights=False)
    assert fresh.backbone.get_config() == tiny_classifier.backbone.get_config()
    head = fresh.get_layer("head").kernel
    assert not np.any(np.asarray(head.value))  # zero-initialised, not loaded


def test_save_is_atomic(tiny_classifier, tmp_path, monkeypatch):
    def broken_save_weights(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(keras.saving, "save_weights", broken_save_weights)
    target = tmp_path / "target"
    with pytest.raises(RuntimeError, match="disk full"):
        presets.save_to_preset(tiny_classifier, target)
    assert not target.exists()
    assert os.listdir(tmp_path) == []  # no temporary directory left behind


def test_failed_overwrite_keeps_old_preset(
    tiny_classifier, tiny_preset_dir, tmp_path, monkeypatch
):
    target = tmp_path / "preset"
    shutil.copytree(tiny_preset_dir, target)
    before = sorted(os.listdir(target))

    def broken_metadata(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(save_module, "_build_metadata", broken_metadata)
    with pytest.raises(RuntimeError, match="boom"):
        presets.save_to_preset(tiny_classifier, target)
    assert sorted(os.listdir(target)) == before
    assert sorted(os.listdir(tmp_path)) == ["preset"]


def test_overwrites_a_preset_but_not_other_directories(tiny_classifier, tmp_path):
    target = tmp_path / "preset"
    presets.save_to_preset(tiny_classifier, target)
    presets.save_to_preset(tiny_classifier, target)  # replaced in place
    assert sorted(os.listdir(tmp_path)) == ["preset"]
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a preset directory"):
        presets.save_to_preset(tiny_classifier, other)
    assert (other / "notes.txt").read_text() == "keep me"


# ----------------------------------------------------------------------
# Names.
# ----------------------------------------------------------------------


def test_unknown_name_lists_close_matches():
    with pytest.raises(ValueError) as info:
        presets.from_preset("vmoe_b33")
    message = str(info.value)
    assert "vmoe_b32" in message and "list_presets()" in message
    with pytest.raises(ValueError, match="Did you mean: .*soft_moe_b16"):
        presets.from_preset("softmoe_b16")


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        presets.from_preset(tmp_path)
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        presets.from_preset(tmp_path / "file.txt")


def test_architecture_preset_warns(tiny_overrides, images):
    with pytest.warns(UserWarning, match="has no pretrained weights"):
        model = presets.from_preset(
            "vmoe_b32", num_classes=4, layout="every2", **tiny_overrides
        )
    assert isinstance(model, models.ImageClassifier)
    assert model.backbone.moe_layers == (1, 3)
    assert _predict(model, images).shape == (4, 4)


def test_load_weights_false_does_not_warn(tiny_overrides):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = presets.from_preset(
            "soft_moe_s16", load_weights=False, num_classes=3, **tiny_overrides
        )
    assert model.backbone.moe_type == "soft"
    assert model.backbone.classifier == "gap"


def test_catalog_routing_and_head_are_applied(tiny_overrides):
    model = presets.from_preset(LIGHT1, load_weights=False, **tiny_overrides)
    router = model.backbone.moe["router"]
    # Upstream fine-tunes light1 at capacity factor 1.5
    # (configs/vmoe_paper/vmoe_s32_last2_ilsvrc2012_randaug_light1_ft_ilsvrc2012.py)
    # and evaluates it at 4.0 (its config's eval override); 8 images per group.
    assert router["num_selected_experts"] == 2 and router["capacity_factor"] == 1.5
    assert model.backbone.moe["eval_routing"] == {"capacity_factor": 4.0}
    layer = model.backbone.get_moe_layers()[0]
    assert layer.images_per_group == 8 and layer.eval_routing == {"capacity_factor": 4.0}
    model = presets.from_preset(LIGHT1, load_weights=False,
                                eval_routing={"capacity_factor": 2.0}, **tiny_overrides)
    assert model.backbone.moe["eval_routing"] == {"capacity_factor": 2.0}
    assert model.backbone.moe["router"]["capacity_factor"] == 1.5
    assert model.num_classes == 1000
    np.testing.assert_allclose(
        np.asarray(model.get_layer("head").bias.value), -np.log(1000.0), rtol=1e-5
    )


def test_architecture_overrides_need_load_weights_false(
    isolated_cache, tiny_preset_dir
):
    with pytest.raises(ValueError, match="load_weights=False"):
        presets.from_preset(LIGHT1, **tiny_configs.preset_overrides())
    with pytest.raises(ValueError, match="load_weights=False"):
        presets.from_preset(tiny_preset_dir, num_layers=2)
    small = presets.from_preset(
        tiny_preset_dir, load_weights=False, num_layers=2, moe_layers=(1,)
    )
    assert small.backbone.num_layers == 2


# ----------------------------------------------------------------------
# Released checkpoints: cache, mirror, converter, error.
# ----------------------------------------------------------------------


def test_released_preset_without_weights_raises_informative_error(isolated_cache):
    with pytest.raises(presets.PresetWeightsUnavailableError) as info:
        presets.from_preset(LIGHT1)
    message = str(info.value)
    assert f"gs://vmoe_checkpoints/{LIGHT1}" in message
    assert f"keras-vmoe convert --upstream gs://vmoe_checkpoints/{LIGHT1}" in message
    assert f"--preset {LIGHT1}" in message
    assert "KERAS_VMOE_CHECKPOINT_ROOT" in message
    # The download from the public bucket (a closed local port in tests) fails.
    assert f"http://127.0.0.1:9/vmoe_checkpoints/{LIGHT1}" in message
    assert "no connection to the server" in message and "hf://" in message
    assert "load_weights=False" in message
    assert str(isolated_cache) in message  # where the converted preset would go
    assert isinstance(info.value, FileNotFoundError)


def test_mirror_without_the_checkpoint_is_reported(
    isolated_cache, tmp_path, monkeypatch
):
    monkeypatch.setenv("KERAS_VMOE_CHECKPOINT_ROOT", str(tmp_path / "mirror"))
    with pytest.raises(presets.PresetWeightsUnavailableError) as info:
        presets.from_preset(LIGHT1)
    assert str(tmp_path / "mirror" / f"{LIGHT1}.index") in str(info.value)


def _fake_converter_module(monkeypatch, source_preset, calls, name="convert_to_preset"):
    from keras_vmoe.presets import convert as module

    def convert(source, output_dir, preset_name=None):
        calls.append((source, output_dir, preset_name))
        shutil.copytree(source_preset, output_dir)

    monkeypatch.setattr(module, name, convert)
    return module


def test_mirror_is_converted_once_and_cached(
    isolated_cache, tmp_path, monkeypatch, tiny_preset_dir, tiny_classifier, images
):
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    (mirror / f"{LIGHT1}.index").write_bytes(b"")
    monkeypatch.setenv("KERAS_VMOE_CHECKPOINT_ROOT", str(mirror))
    calls = []
    _fake_converter_module(monkeypatch, tiny_preset_dir, calls)
    model = presets.from_preset(LIGHT1)
    assert calls[0][0] == str(mirror / LIGHT1)
    assert calls[0][2] == LIGHT1
    cache = isolated_cache / "keras_vmoe" / LIGHT1
    assert presets.preset_cache_dir(LIGHT1) == str(cache)
    assert (cache / "config.json").exists()
    assert [p for p in os.listdir(cache.parent) if p.startswith(".")] == []
    np.testing.assert_array_equal(
        _predict(model, images), _predict(tiny_classifier, images)
    )
    # Second call: served from the cache, the converter is not called again.
    monkeypatch.delenv("KERAS_VMOE_CHECKPOINT_ROOT")
    presets.from_preset(LIGHT1, capacity_factor=1.5)
    assert len(calls) == 1


def test_mirror_under_the_bucket_name(
    isolated_cache, tmp_path, monkeypatch, tiny_preset_dir
):
    mirror = tmp_path / "mirror"
    (mirror / "vmoe_checkpoints").mkdir(parents=True)
    (mirror / "vmoe_checkpoints" / f"{LIGHT1}.index").write_bytes(b"")
    monkeypatch.setenv("KERAS_VMOE_CHECKPOINT_ROOT", str(mirror))
    calls = []
    _fake_converter_module(monkeypatch, tiny_preset_dir, calls)
    presets.from_preset(LIGHT1)
    assert calls[0][0] == str(mirror / "vmoe_checkpoints" / LIGHT1)




def test_failed_conversion_leaves_no_cache(isolated_cache, tmp_path, monkeypatch):
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    (mirror / f"{LIGHT1}.index").write_bytes(b"")
    monkeypatch.setenv("KERAS_VMOE_CHECKPOINT_ROOT", str(mirror))
    from keras_vmoe.presets import convert as module

    def convert(source, output_dir, preset_name=None):
        os.makedirs(output_dir)
        with open(os.path.join(output_dir, "config.json"), "w") as f:
            f.write("{")
        raise ValueError("corrupt checkpoint")

    monkeypatch.setattr(module, "convert_to_preset", convert)
    with pytest.raises(ValueError, match="corrupt checkpoint"):
        presets.from_preset(LIGHT1)
    assert os.listdir(isolated_cache / "keras_vmoe") == []


def test_a_failed_conversion_of_a_download_is_not_hidden(
        isolated_cache, monkeypatch, tmp_path, upstream_dir):
    from http_server import Server

    from keras_vmoe.presets import convert as module

    bucket = tmp_path / "served" / "vmoe_checkpoints"
    bucket.mkdir(parents=True)
    for suffix in (".index", ".data-00000-of-00001"):
        shutil.copy(upstream_dir / "vmoe_tiny" / f"checkpoint{suffix}",
                    bucket / f"{LIGHT1}{suffix}")

    def convert(source, output_dir, preset_name=None):
        raise PermissionError("storage.objects.get denied")

    monkeypatch.setattr(module, "convert_to_preset", convert)
    with Server(tmp_path / "served") as server:
        monkeypatch.setenv("KERAS_VMOE_CHECKPOINT_ROOT", server.base)
        with pytest.raises(PermissionError, match="storage.objects.get denied"):
            presets.from_preset(LIGHT1, verbose=0)
    assert os.listdir(isolated_cache / "keras_vmoe") == [".downloads"]


# ----------------------------------------------------------------------
# Overrides.
# ----------------------------------------------------------------------


@pytest.mark.heavy
def test_image_size_override_resizes_position_embedding(
    tiny_classifier, tiny_preset_dir, images
):
    old = np.asarray(
        tiny_classifier.backbone.get_layer("position_embedding").embedding.value
    )
    model = presets.from_preset(tiny_preset_dir, image_size=48)
    assert model.backbone.image_size == 48 and model.backbone.grid_size == (6, 6)
    new = np.asarray(model.backbone.get_layer("position_embedding").embedding.value)
    assert old.shape == (1, 17, 32) and new.shape == (1, 37, 32)
    np.testing.assert_array_equal(new[:, :1], old[:, :1])  # class token row kept
    expected = resize_position_embedding(old, (6, 6), has_cls=True)
    np.testing.assert_allclose(new, expected, rtol=1e-6)
    # Corners of a bilinear zoom (order=1, aligned corners) are the old corners.
    np.testing.assert_allclose(new[0, 1], old[0, 1], rtol=1e-6)
    # Other weights (head, experts) are the saved ones.
    np.testing.assert_array_equal(
        np.asarray(model.get_layer("head").kernel.value),
        np.asarray(tiny_classifier.get_layer("head").kernel.value),
    )
    big = np.repeat(np.repeat(images, 3, axis=1), 3, axis=2)[:, :48, :48]
    assert _predict_jit(model, big).shape == (4, 5)


@pytest.mark.heavy
def test_image_size_override_keeps_images_per_group(tiny_overrides, tmp_path):
    model = presets.from_preset(
        "vmoe_s32",
        load_weights=False,
        num_classes=2,
        group_size=2 * 17,
        **tiny_overrides,
    )
    assert model.backbone.moe["group_size"] == 34
    presets.save_to_preset(model, tmp_path / "p")
    resized = presets.from_preset(tmp_path / "p", image_size=48)
    assert resized.backbone.moe["group_size"] == 2 * 37
    with pytest.raises(ValueError, match="multiple of the patch size"):
        presets.from_preset(tmp_path / "p", image_size=50)


@pytest.mark.heavy
def test_routing_overrides(tiny_preset_dir):
    model = presets.from_preset(
        tiny_preset_dir,
        num_selected_experts=1,
        capacity_factor=2.5,
        batch_priority=True,
        group_size=34,
    )
    router = model.backbone.moe["router"]
    assert router["num_selected_experts"] == 1
    assert router["capacity_factor"] == 2.5
    assert router["batch_priority"] is True
    assert model.backbone.moe["group_size"] == 34
    for layer in model.backbone.get_moe_layers():
        assert layer.num_selected_experts == 1
        assert layer.capacity_factor == 2.5
        assert layer.batch_priority is True
        assert layer.group_size == 34
    x = np.zeros((2, 32, 32, 3), "float32")
    assert _predict_jit(model, x).shape == (2, 5)


def test_routing_override_on_a_soft_moe_is_rejected(tiny_overrides):
    with pytest.raises(ValueError, match="Soft MoE"):
        presets.from_preset(
            "soft_moe_s16",
            load_weights=False,
            num_classes=2,
            capacity_factor=2.0,
            **tiny_overrides,
        )


def test_num_classes_override_replaces_the_head(
    tiny_classifier, tiny_preset_dir, images
):
    model = presets.from_preset(tiny_preset_dir, num_classes=7, head_bias_init=-2.0)
    assert model.num_classes == 7
    head = model.get_layer("head")
    assert tuple(head.kernel.shape) == (32, 7)
    assert not np.any(np.asarray(head.kernel.value))
    np.testing.assert_allclose(np.asarray(head.bias.value), -2.0)
    saved = dict(
        zip(
            [v.path for v in tiny_classifier.backbone.weights],
            _weights(tiny_classifier.backbone),
            strict=True,
        )
    )
    for variable in model.backbone.weights:
        np.testing.assert_array_equal(np.asarray(variable.value), saved[variable.path])
    logits = _predict(model, images)
    np.testing.assert_allclose(logits, -2.0, atol=1e-6)  # zero kernel


@pytest.mark.slow
def test_fine_tuning_a_loaded_preset(tiny_preset_dir, images):
    model = presets.from_preset(tiny_preset_dir, num_classes=7, image_size=48)
    big = np.repeat(np.repeat(images, 3, axis=1), 3, axis=2)[:, :48, :48]
    history = model.fit(big, np.arange(4) % 7, epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()


@pytest.mark.heavy
def test_dtype_override(tmp_path):
    # A one-block dense ViT keeps the number of (per-dtype compiled)
    # initializers small.
    reference = presets.from_preset(
        "vit_b16",
        load_weights=False,
        num_classes=3,
        **tiny_configs.vit(num_layers=1),
    )
    presets.save_to_preset(reference, tmp_path / "vit")
    model = presets.from_preset(tmp_path / "vit", dtype="bfloat16")
    assert model.backbone.dtype_policy.name == "bfloat16"
    assert model.get_layer("head").dtype_policy.name == "bfloat16"
    for variable, saved in zip(model.weights, reference.weights, strict=True):
        assert variable.dtype == "bfloat16", variable.path
        np.testing.assert_allclose(
            np.asarray(variable.value, "float32"),
            np.asarray(saved.value),
            rtol=1e-2,
            atol=1e-6,
        )


@pytest.mark.slow
def test_mixed_bfloat16_preset_runs(tiny_preset_dir, images):
    model = presets.from_preset(tiny_preset_dir, dtype="mixed_bfloat16")
    assert model.backbone.dtype_policy.name == "mixed_bfloat16"
    assert all(v.dtype == "float32" for v in model.weights)
    assert _predict_jit(model, images).shape == (4, 5)


def test_unknown_override_is_an_error(tiny_preset_dir):
    with pytest.raises(ValueError, match="not_an_option"):
        presets.from_preset("vmoe_s32", load_weights=False, not_an_option=1)
    with pytest.raises(ValueError, match="Unknown overrides"):
        presets.from_preset(tiny_preset_dir, load_weights=False, not_an_option=1)
    # With weights too: not the misleading "they need load_weights=False".
    with pytest.raises(ValueError, match=r"Unknown overrides \['num_expert'\]"):
        presets.from_preset(tiny_preset_dir, num_expert=8)
    with pytest.raises(ValueError, match=r"Unknown overrides \['num_expert'\]"):
        presets.from_preset(LIGHT1, num_expert=8)
    with pytest.raises(ValueError, match="pass `num_classes` too"):
        presets.from_preset(tiny_preset_dir, head_bias_init=-1.0)


# ----------------------------------------------------------------------
# Remote handles (clients monkeypatched: no network).
# ----------------------------------------------------------------------


def test_hf_handle(monkeypatch, tiny_preset_dir, tmp_path):
    snapshot = tmp_path / "snapshot"
    shutil.copytree(tiny_preset_dir, snapshot / "sub")
    calls = []

    def snapshot_download(repo_id, **kwargs):
        calls.append(repo_id)
        return str(snapshot)

    fake = types.ModuleType("huggingface_hub")
    fake.snapshot_download = snapshot_download
    monkeypatch.setitem(sys.modules, "huggingface_hub", fake)
    # Its config.json names no timm/transformers ViT: a keras_vmoe preset.
    monkeypatch.setattr(hub_vits, "fetch_hf", lambda handle, verbose: None)
    model = presets.from_preset("hf://someone/tiny-vmoe/sub", capacity_factor=3.0)
    assert calls == ["someone/tiny-vmoe"]
    assert model.backbone.moe["router"]["capacity_factor"] == 3.0
    with pytest.raises(ValueError, match="hf://owner/repo"):
        presets.from_preset("hf://just-a-name")


@pytest.mark.parametrize("handle", [
    "hf://o/r/../../..", "hf://o/../x", "hf://o/r/./sub",
    "kaggle://o/m/keras/..", "kaggle://o/m/keras/v/.."])
def test_hub_handles_with_dot_segments_are_refused_here(monkeypatch, handle):
    calls = []
    hub = types.ModuleType("huggingface_hub")
    hub.snapshot_download = lambda repo_id, **kwargs: calls.append(repo_id) or "/"
    kaggle = types.ModuleType("kagglehub")
    kaggle.model_download = lambda path, **kwargs: calls.append(path) or "/"
    monkeypatch.setitem(sys.modules, "huggingface_hub", hub)
    monkeypatch.setitem(sys.modules, "kagglehub", kaggle)
    with pytest.raises(ValueError, match=r"its parts cannot be '\.\.?'\. Received: "
                                         + re.escape(repr(handle))):
        presets.from_preset(handle)
    assert calls == []
    # Without the client installed, the same answer (no install advice).
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    monkeypatch.setitem(sys.modules, "kagglehub", None)
    with pytest.raises(ValueError, match="its parts cannot be"):
        presets.from_preset(handle)


def test_hf_handle_without_client(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    monkeypatch.setattr(hub_vits, "fetch_hf", lambda handle, verbose: None)
    with pytest.raises(ImportError, match="pip install huggingface_hub"):
        presets.from_preset("hf://someone/tiny-vmoe")


def test_kaggle_handle(monkeypatch, tiny_preset_dir):
    calls = []

    def model_download(handle, **kwargs):
        calls.append(handle)
        return str(tiny_preset_dir)

    fake = types.ModuleType("kagglehub")
    fake.model_download = model_download
    monkeypatch.setitem(sys.modules, "kagglehub", fake)
    model = presets.from_preset("kaggle://someone/vmoe/keras/tiny/2")
    assert calls == ["someone/vmoe/keras/tiny/2"]
    assert isinstance(model, models.ImageClassifier)
    with pytest.raises(ValueError, match="kaggle://owner/model/keras/variant"):
        presets.from_preset("kaggle://someone/vmoe")


def test_kaggle_handle_without_client(monkeypatch):
    monkeypatch.setitem(sys.modules, "kagglehub", None)
    with pytest.raises(ImportError, match="pip install kagglehub"):
        presets.from_preset("kaggle://someone/vmoe/keras/tiny")


def test_gs_handle_needs_tensorflow(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow", None)
    with pytest.raises(ImportError, match=r"keras-vmoe\[tensorflow\]"):
        presets.from_preset("gs://bucket/presets/tiny")


def test_gs_handle_through_gfile(monkeypatch, tiny_preset_dir, images, tiny_classifier):
    root = "gs://bucket/presets/tiny"

    def local(path):
        assert path.startswith(root)
        return str(tiny_preset_dir) + path[len(root) :]

    gfile = types.SimpleNamespace(
        exists=lambda p: os.path.exists(local(p)),
        isdir=lambda p: os.path.isdir(local(p)),
        listdir=lambda p: os.listdir(local(p)),
        copy=lambda src, dst, overwrite=False: shutil.copyfile(local(src), dst),
    )
    fake_tf = types.ModuleType("tensorflow")
    fake_tf.io = types.SimpleNamespace(gfile=gfile)
    monkeypatch.setitem(sys.modules, "tensorflow", fake_tf)
    model = presets.from_preset(root)
    np.testing.assert_array_equal(
        _predict(model, images), _predict(tiny_classifier, images)
    )


# ----------------------------------------------------------------------
# The short names of the brief.
# ----------------------------------------------------------------------


def test_vmoe_b32_short_name_is_a_working_classifier(tiny_overrides, images):
    model = presets.from_preset(
        "vmoe_b32", load_weights=False, num_classes=3, layout="every2", **tiny_overrides
    )
    assert model.backbone.hidden_dim == 32 and model.backbone.patch_size == 8
    assert model.backbone.moe["num_experts"] == 4
    assert _predict(model, images).shape == (4, 3)


@pytest.mark.slow
def test_vmoe_b32_full_size(images):
    with pytest.warns(UserWarning, match="no pretrained weights"):
        model = presets.from_preset("vmoe_b32")
    info = presets.get_preset_info("vmoe_b32")
    assert model.count_params() == info["metadata"]["params"]
    assert model.backbone.moe_layers == (9, 11)
    assert model.backbone.moe["num_experts"] == 32
    x = np.zeros((2, 224, 224, 3), "float32")
    assert _predict(model, x).shape == (2, 18291)


@pytest.mark.heavy
def test_released_preset_end_to_end_with_the_real_converter(
    isolated_cache, tmp_path, monkeypatch, upstream_dir
):
    """A mirror holding an upstream-format checkpoint (the tiny V-MoE fixture,
    renamed to a released prefix) is converted, cached and reproduces the
    upstream logits."""
    fixture = upstream_dir / "vmoe_tiny"
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    shutil.copy(fixture / "checkpoint.index", mirror / f"{LIGHT1}.index")
    shutil.copy(
        fixture / "checkpoint.data-00000-of-00001",
        mirror / f"{LIGHT1}.data-00000-of-00001",
    )
    monkeypatch.setenv("KERAS_VMOE_CHECKPOINT_ROOT", str(mirror))
    # The fixture was routed with capacity factor 1.0 in groups of 2 images.
    model = presets.from_preset(LIGHT1, capacity_factor=1.0, group_size=34)
    assert (isolated_cache / "keras_vmoe" / LIGHT1 / "config.json").exists()
    logits = _predict_jit(model, np.load(fixture / "inputs.npy"))
    expected = np.load(fixture / "logits_bf16dispatch.npy")
    np.testing.assert_allclose(logits, expected, atol=1e-4)
    with open(isolated_cache / "keras_vmoe" / LIGHT1 / "metadata.json") as f:
        metadata = json.load(f)
    assert metadata["preset_name"] == LIGHT1
    assert metadata["upstream_weights"]["upstream"] == f"gs://vmoe_checkpoints/{LIGHT1}"


def test_saved_preset_directory_is_world_readable(tmp_path):
    import keras

    import keras_vmoe

    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(inputs))
    target = tmp_path / "preset"
    keras_vmoe.presets.save_to_preset(model, str(target))
    umask = os.umask(0)
    os.umask(umask)
    assert (target.stat().st_mode & 0o777) == (0o777 & ~umask)


def test_preset_of_a_trained_model_holds_no_optimizer_state(tmp_path):
    import h5py

    model = presets.from_preset(
        "vit_b16", load_weights=False, num_classes=3, **tiny_configs.vit(num_layers=1))
    # The Adam slots a fit builds, without compiling a training step.
    model.optimizer.build(model.trainable_variables)
    assert model.optimizer.variables
    presets.save_to_preset(model, tmp_path / "trained")
    with h5py.File(tmp_path / "trained" / save_module.WEIGHTS_FILE) as f:
        assert "optimizer" not in f
    # Presets written with the optimizer state (by older versions, which
    # recorded no weights hash) still load, with the one warning that they
    # are unverified (none about the optimizer state).
    model.save_weights(tmp_path / "trained" / save_module.WEIGHTS_FILE)
    with h5py.File(tmp_path / "trained" / save_module.WEIGHTS_FILE) as f:
        assert "optimizer" in f
    metadata_path = tmp_path / "trained" / save_module.METADATA_FILE
    metadata = json.loads(metadata_path.read_text())
    del metadata["weights_sha256"]
    metadata_path.write_text(json.dumps(metadata))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message="The preset .* is UNVERIFIED")
        loaded = presets.from_preset(tmp_path / "trained")
    for a, b in zip(loaded.weights, model.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(a.value), np.asarray(b.value))


def test_outputs_must_be_local_directories():
    from keras_vmoe.presets.convert import convert_to_preset
    from keras_vmoe.presets.save import local_directory

    with pytest.raises(ValueError, match="save_to_preset writes to a local directory"):
        local_directory("gs://bucket/preset", "save_to_preset")
    with pytest.raises(ValueError, match="convert_to_preset writes to a local directory"):
        convert_to_preset("unused", "gs://bucket/preset")


def test_a_new_head_starts_at_minus_log_num_classes(tiny_overrides, tiny_preset_dir):
    # The catalog head of this preset starts at -10; a new head does not.
    built = presets.from_preset("eee_s32_last2_ilsvrc2012", load_weights=False,
                                num_classes=7, **tiny_overrides)
    np.testing.assert_allclose(np.asarray(built.get_layer("head").bias.value),
                               -np.log(7), rtol=1e-6)
    kept = presets.from_preset("eee_s32_last2_ilsvrc2012", load_weights=False,
                               **tiny_overrides)
    np.testing.assert_allclose(np.asarray(kept.get_layer("head").bias.value), -10.0)
    loaded = presets.from_preset(tiny_preset_dir, num_classes=5)
    np.testing.assert_allclose(np.asarray(loaded.get_layer("head").bias.value),
                               -np.log(5), rtol=1e-6)
