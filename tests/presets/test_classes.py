"""keras_vmoe.presets.classes: `Class.from_preset` returns that class, and
`Class.presets` lists what it loads."""

import numpy as np
import pytest
import testing
import tiny_configs

from keras_vmoe import catalog
from keras_vmoe import models
from keras_vmoe import presets


def test_backbone_from_preset_returns_the_backbone(tiny_overrides):
    backbone = models.VisionTransformerBackbone.from_preset(
        "vmoe_s32", load_weights=False, **tiny_overrides
    )
    assert type(backbone) is models.VisionTransformerBackbone
    assert backbone.hidden_dim == tiny_overrides["hidden_dim"]


def test_task_from_preset_returns_the_task(tiny_preset_dir, tiny_classifier, images):
    model = models.ImageClassifier.from_preset(tiny_preset_dir)
    assert type(model) is models.ImageClassifier
    np.testing.assert_allclose(
        np.asarray(model(images)), np.asarray(tiny_classifier(images)), atol=1e-5
    )
    assert presets.from_preset(tiny_preset_dir).num_classes == 5


def test_backbone_preset_into_a_task_builds_a_new_head(tiny_classifier, tmp_path):
    presets.save_to_preset(tiny_classifier.backbone, tmp_path / "backbone")
    with pytest.raises(ValueError, match="num_classes"):
        models.ImageClassifier.from_preset(tmp_path / "backbone")
    model = models.ImageClassifier.from_preset(tmp_path / "backbone", num_classes=3)
    assert type(model) is models.ImageClassifier
    assert model.num_classes == 3
    for mine, theirs in zip(
        model.backbone.weights, tiny_classifier.backbone.weights, strict=True
    ):
        np.testing.assert_array_equal(np.asarray(mine.value), np.asarray(theirs.value))


def test_ensemble_classes_and_errors(tiny_overrides):
    ensemble = models.EnsembleImageClassifier.from_preset(
        "eee_s32_last2", load_weights=False, num_classes=4, **tiny_overrides
    )
    assert type(ensemble) is models.EnsembleImageClassifier
    with pytest.raises(ValueError, match="EnsembleImageClassifier.from_preset"):
        models.ImageClassifier.from_preset(
            "eee_s32_last2", load_weights=False, num_classes=4, **tiny_overrides
        )
    with pytest.raises(ValueError, match="num_classes"):
        models.VisionTransformerBackbone.from_preset(
            "vmoe_s32", load_weights=False, num_classes=4, **tiny_overrides
        )


def test_presets_listing_per_class():
    every = models.VisionTransformerBackbone.presets
    single = models.ImageClassifier.presets
    ensembles = models.EnsembleImageClassifier.presets
    assert "vmoe_b32_last2" in single and "vmoe_b32_last2" not in ensembles
    assert all(name.startswith("eee") for name in ensembles)
    assert set(single) | set(ensembles) == set(every) == set(catalog.PRESETS)
    assert all(isinstance(text, str) and text for text in every.values())


# --- The shared test base (tests/testing.py) --------------------------------

IMAGES = np.random.default_rng(0).uniform(-1, 1, size=(4, 32, 32, 3)).astype("float32")

@pytest.mark.heavy
@pytest.mark.parametrize(
    "cls,preset,shape",
    [
        (models.VisionTransformerBackbone, "vmoe_s32", (4, 32)),
        (models.ImageClassifier, "vmoe_s32", (4, 5)),
        (models.EnsembleImageClassifier, "eee_s32_last2", (4, 2, 5)),
    ],
    ids=lambda v: getattr(v, "__name__", v if isinstance(v, str) else ""),
)
def test_class_presets_through_the_shared_base(cls, preset, shape):
    overrides = tiny_configs.preset_overrides(load_weights=False)
    if cls is not models.VisionTransformerBackbone:
        overrides["num_classes"] = 5
    testing.run_preset_test(cls, preset, IMAGES, shape, **overrides)


def test_remat_override_on_every_class_keeps_the_weights(tiny_preset_dir, tiny_classifier,
                                                         tiny_overrides, images):
    model = models.ImageClassifier.from_preset(tiny_preset_dir, remat=True)
    assert model.backbone.remat and model.backbone.get_config()["remat"] is True
    np.testing.assert_allclose(np.asarray(model(images)),
                               np.asarray(tiny_classifier(images)), atol=1e-6)
    backbone = models.VisionTransformerBackbone.from_preset(tiny_preset_dir, remat=True)
    assert backbone.remat
    assert presets.from_preset(tiny_preset_dir, remat=False).backbone.remat is False
    built = models.VisionTransformerBackbone.from_preset(
        "vmoe_s32", load_weights=False, remat=True, **tiny_overrides)
    assert built.remat and all(b.remat for b in built.get_encoder_blocks())
    ensemble = models.EnsembleImageClassifier.from_preset(
        "eee_s32_last2", load_weights=False, num_classes=4, remat=True, **tiny_overrides)
    assert ensemble.backbone.remat
    with pytest.raises(ValueError, match="`remat` must be True or False"):
        presets.from_preset(tiny_preset_dir, remat="yes")


def test_scan_override_on_every_class_keeps_the_weights(tiny_preset_dir, tiny_classifier,
                                                        tiny_overrides):
    model = models.ImageClassifier.from_preset(tiny_preset_dir, scan=True)
    assert model.backbone.scan and model.backbone.get_config()["scan"] is True
    for loaded, saved in zip(model.weights, tiny_classifier.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(loaded.value), np.asarray(saved.value))
    assert models.VisionTransformerBackbone.from_preset(tiny_preset_dir, scan=True).scan
    assert presets.from_preset(tiny_preset_dir, scan=False).backbone.scan is False
    built = models.VisionTransformerBackbone.from_preset(
        "vmoe_s32", load_weights=False, scan=True, remat=True, **tiny_overrides)
    assert built.scan and built.remat
    ensemble = models.EnsembleImageClassifier.from_preset(
        "eee_s32_last2", load_weights=False, num_classes=4, scan=True, **tiny_overrides)
    assert ensemble.backbone.scan
    with pytest.raises(ValueError, match="`scan` must be True or False"):
        presets.from_preset(tiny_preset_dir, scan="yes")
