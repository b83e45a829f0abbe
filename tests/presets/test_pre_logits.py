"""Fine-tuning drops `pre_logits` as upstream's V-MoE fine-tuning configs do."""

import keras
import numpy as np
import pytest

from keras_vmoe import presets


@pytest.mark.heavy
def test_representation_size_none_drops_pre_logits_and_keeps_the_rest(
        tiny_overrides, tmp_path):
    # vmoe_s32_last2_ilsvrc2012_randaug_light1_ft_ilsvrc2012.py:88 does not
    # restore `pre_logits/.*` and :152 sets representation_size=None; light1
    # itself has a 512-wide tanh pre_logits layer.
    keras.utils.set_random_seed(0)
    overrides = {**tiny_overrides, "representation_size": 16}
    source = presets.from_preset("vmoe_s32", load_weights=False, num_classes=5,
                                 **overrides)
    presets.save_to_preset(source, tmp_path / "light1_like")
    with pytest.raises(ValueError, match="num_classes"):
        presets.from_preset(tmp_path / "light1_like", representation_size=None)
    model = presets.from_preset(tmp_path / "light1_like", num_classes=3,
                                representation_size=None)
    assert model.backbone.representation_size is None
    assert not any("pre_logits" in v.path for v in model.weights)
    assert model.get_layer("head").kernel.shape == (32, 3)  # hidden_dim -> classes
    old = {v.path: np.asarray(v) for v in source.backbone.weights}
    for variable in model.backbone.weights:
        np.testing.assert_array_equal(np.asarray(variable), old[variable.path])
    # Keeping it stays possible (the E3 CIFAR-100 config restores it, :113).
    kept = presets.from_preset(tmp_path / "light1_like", num_classes=3)
    assert kept.backbone.representation_size == 16
