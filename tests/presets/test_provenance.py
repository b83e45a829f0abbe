"""Honest preset metadata (weights provenance) and bfloat16 weight storage."""

import json

import numpy as np
import pytest

from keras_vmoe import catalog
from keras_vmoe import presets
from keras_vmoe.presets import provenance

LIGHT1 = "vmoe_s32_last2_ilsvrc2012_randaug_light1"


def _metadata(path):
    with open(path / "metadata.json") as f:
        return json.load(f)


def test_random_weights_do_not_carry_the_release_metadata(tiny_overrides, tmp_path):
    tiny = dict(tiny_overrides, num_classes=3)
    model = presets.from_preset(LIGHT1, load_weights=False, **tiny)
    presets.save_to_preset(model, tmp_path / "random")
    metadata = _metadata(tmp_path / "random")
    assert metadata["weights"] == {"kind": "random", "preset": LIGHT1}
    assert metadata["preset_name"] == LIGHT1
    assert "accuracy" not in metadata["catalog"] and "upstream_weights" not in metadata
    assert "randomly initialised" in metadata["description"]
    assert metadata["description"] != catalog.PRESETS[LIGHT1]["description"]
    # Loading and saving again keeps the record.
    again = presets.from_preset(tmp_path / "random")
    presets.save_to_preset(again, tmp_path / "again")
    assert _metadata(tmp_path / "again")["weights"]["kind"] == "random"
    assert "accuracy" not in _metadata(tmp_path / "again")["catalog"]


@pytest.mark.heavy
def test_released_weights_carry_the_catalog_and_changes_drop_it(
    tiny_overrides, tmp_path
):
    entry = catalog.PRESETS[LIGHT1]
    unchanged = provenance.builtin_record(LIGHT1, entry, True, {"capacity_factor": 2})
    assert unchanged == {"kind": "pretrained", "preset": LIGHT1,
                         "source": entry["weights"]["upstream"]}
    assert provenance.is_released(unchanged, LIGHT1)
    new_head = provenance.builtin_record(LIGHT1, entry, True, {"num_classes": 10})
    assert new_head["changes"] == ["num_classes=10"]
    assert not provenance.is_released(new_head, LIGHT1)
    # A model holding the released weights (as a converted cache would) keeps
    # the catalog facts; once fit, it does not.
    model = presets.from_preset(LIGHT1, load_weights=False, **tiny_overrides)
    provenance.record(model, unchanged)
    presets.save_to_preset(model, tmp_path / "released")
    metadata = _metadata(tmp_path / "released")
    assert metadata["catalog"]["accuracy"] == entry["metadata"]["accuracy"]
    assert metadata["description"] == entry["description"]
    assert metadata["upstream_weights"] == entry["weights"]
    # One optimizer step, as `fit` or a custom training loop takes.
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    variables = model.trainable_variables
    model.optimizer.apply([np.zeros(v.shape, "float32") for v in variables], variables)
    presets.save_to_preset(model, tmp_path / "tuned")
    metadata = _metadata(tmp_path / "tuned")
    assert metadata["weights"]["kind"] == "fine_tuned"
    assert metadata["weights"]["from"]["kind"] == "pretrained"
    assert metadata["weights"]["optimizer_steps"] == 1
    assert "accuracy" not in metadata["catalog"] and "upstream_weights" not in metadata
    assert metadata["description"].startswith(f"Trained from {LIGHT1}")


@pytest.mark.heavy
def test_bfloat16_storage_halves_the_weights_and_loads_back(
    tiny_classifier, tmp_path, images
):
    presets.save_to_preset(tiny_classifier, tmp_path / "f32")
    presets.save_to_preset(tiny_classifier, tmp_path / "bf16", dtype="bfloat16")
    full = (tmp_path / "f32" / "model.weights.h5").stat().st_size
    half = (tmp_path / "bf16" / "model.weights.h5").stat().st_size
    # Float weights take half the bytes; HDF5 headers do not shrink.
    weight_bytes = 4 * tiny_classifier.count_params()
    assert full - half > 0.45 * weight_bytes
    assert _metadata(tmp_path / "bf16")["weights_dtype"] == "bfloat16"
    loaded = presets.from_preset(tmp_path / "bf16")
    assert {v.dtype for v in loaded.weights} == {v.dtype for v in tiny_classifier.weights}
    rounded = 0
    for a, b in zip(loaded.weights, tiny_classifier.weights, strict=True):
        a, b = np.asarray(a.value), np.asarray(b.value)
        np.testing.assert_allclose(a, b, rtol=2**-8, atol=1e-30)
        rounded += not np.array_equal(a, b)
    assert rounded > 5  # the stored values really are bfloat16
    expected = np.asarray(tiny_classifier.predict_on_batch(images))
    np.testing.assert_allclose(
        np.asarray(loaded.predict_on_batch(images)), expected, atol=0.05)


def test_storage_dtype_is_validated_before_writing(tiny_classifier, tmp_path):
    with pytest.raises(ValueError, match="dtype='int8'"):
        presets.save_to_preset(tiny_classifier, tmp_path / "x", dtype="int8")
    assert not (tmp_path / "x").exists()
