"""The backbone's `moe` dict: the expert MLP size is `mlp_dim`, which may
differ from the dense blocks' `mlp_dim`; it reaches the layers, the config
and presets with LoRA files."""
# Hand-built configs: the subject is the `moe` dict's `mlp_dim` key.

import numpy as np
import pytest
from tiny_configs import vmoe_8px

from keras_vmoe import layers
from keras_vmoe import models

IMAGES = np.random.default_rng(0).uniform(-1, 1, (2, 8, 8, 3)).astype("float32")


def _config():
    """The 8px V-MoE with an expert MLP size (24) other than the dense one (32)."""
    config = vmoe_8px()
    config["moe"]["mlp_dim"] = 24
    return config


@pytest.mark.parametrize("cls,kwargs", [
    (layers.MoeLayer, {}),
    (layers.SoftMoE, {"num_slots": 1}),
    (layers.PartitionedMoE, {"num_partitions": 2}),
    (layers.Experts, {}),
], ids=lambda v: getattr(v, "__name__", ""))
def test_layers_take_mlp_dim(cls, kwargs):
    layer = cls(num_experts=4, mlp_dim=24, **kwargs)
    assert layer.mlp_dim == 24
    assert "hidden_dim" not in layer.get_config() and layer.get_config()["mlp_dim"] == 24


def test_backbone_moe_dict_sets_the_expert_mlp_dim():
    backbone = models.VisionTransformerBackbone(**_config())
    assert backbone.moe["mlp_dim"] == 24
    assert backbone.get_moe_layers()[0].mlp_dim == 24
    assert backbone.get_config()["moe"]["mlp_dim"] == 24
    unknown = _config()
    unknown["moe"]["hidden_dim"] = 8
    with pytest.raises(ValueError, match=r"Unknown `moe` keys \['hidden_dim'\]"):
        models.VisionTransformerBackbone(**unknown)


def test_a_preset_and_lora_file_keep_the_expert_mlp_dim(tmp_path):
    model = models.ImageClassifier(models.VisionTransformerBackbone(**_config()),
                                   num_classes=3)
    model.save_to_preset(tmp_path / "preset")
    model.enable_lora(2, experts=True)
    rng = np.random.default_rng(2)
    for variable in model.weights:
        if "lora_kernel" in variable.path:
            variable.assign(rng.normal(size=variable.shape).astype("float32") * 0.1)
    adapter = model.save_lora_weights(tmp_path / "adapter")
    expected = np.asarray(model.predict_on_batch(IMAGES))
    loaded = models.ImageClassifier.from_preset(tmp_path / "preset")
    assert loaded.backbone.get_moe_layers()[0].mlp_dim == 24
    loaded.load_lora_weights(adapter)
    np.testing.assert_allclose(np.asarray(loaded.predict_on_batch(IMAGES)), expected,
                               atol=1e-6)
