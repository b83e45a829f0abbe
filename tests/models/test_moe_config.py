"""The backbone's `moe` dict: the expert MLP size is `mlp_dim`; configs,
presets and LoRA files written with its old name `hidden_dim` still load,
with a `DeprecationWarning` that names the new one."""
# Hand-built configs: the subject is the `moe` dict's old `hidden_dim` key and its migration.

import json
import warnings

import numpy as np
import pytest
from tiny_configs import vmoe_8px

from keras_vmoe import layers
from keras_vmoe import models
from keras_vmoe.presets import integrity

IMAGES = np.random.default_rng(0).uniform(-1, 1, (2, 8, 8, 3)).astype("float32")
TOKENS = np.random.default_rng(1).normal(size=(2, 4, 16)).astype("float32")


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
def test_layers_take_hidden_dim_with_a_warning(cls, kwargs):
    with pytest.warns(DeprecationWarning, match=r"hidden_dim=.*use `mlp_dim=`"):
        old = cls(num_experts=4, hidden_dim=24, **kwargs)
    assert old.mlp_dim == 24
    assert "hidden_dim" not in old.get_config() and old.get_config()["mlp_dim"] == 24
    with pytest.warns(DeprecationWarning, match=r"\.hidden_dim.*use `mlp_dim`"):
        assert old.hidden_dim == 24
    with pytest.raises(ValueError, match=r"pass `mlp_dim` only.*hidden_dim=8"):
        cls(num_experts=4, mlp_dim=24, hidden_dim=8, **kwargs)


@pytest.mark.heavy
def test_a_layer_config_saved_with_hidden_dim_loads():
    layer = layers.MoeLayer(4, 24, name="moe")
    expected = np.asarray(layer(TOKENS, training=False))
    config = layer.get_config()
    config["hidden_dim"] = config.pop("mlp_dim")
    with pytest.warns(DeprecationWarning, match="mlp_dim"):
        old = layers.MoeLayer.from_config(config)
    old(TOKENS, training=False)
    old.set_weights(layer.get_weights())
    np.testing.assert_array_equal(np.asarray(old(TOKENS, training=False)), expected)


def test_backbone_moe_dict_renames_hidden_dim():
    config = _config()
    config["moe"]["hidden_dim"] = config["moe"].pop("mlp_dim")
    with pytest.warns(DeprecationWarning, match=r"moe\['hidden_dim'\].*moe\['mlp_dim'\]"):
        backbone = models.VisionTransformerBackbone(**config)
    assert backbone.moe["mlp_dim"] == 24 and "hidden_dim" not in backbone.moe
    assert backbone.get_moe_layers()[0].mlp_dim == 24
    assert backbone.get_config()["moe"]["mlp_dim"] == 24
    both = _config()
    both["moe"]["hidden_dim"] = 8
    with pytest.raises(ValueError, match="both 'mlp_dim' and its deprecated name"):
        models.VisionTransformerBackbone(**both)


def test_a_preset_and_lora_file_written_with_hidden_dim_load(tmp_path):
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
    # The preset as an earlier version wrote it: the old key, hashes recorded.
    config_path = tmp_path / "preset" / "config.json"
    text = config_path.read_text()
    assert text.count('"mlp_dim": 24') == 1
    config_path.write_text(text.replace('"mlp_dim": 24', '"hidden_dim": 24'))
    metadata_path = tmp_path / "preset" / "metadata.json"
    metadata = json.loads(metadata_path.read_text())
    integrity.record_hashes(metadata, str(tmp_path / "preset"))
    metadata_path.write_text(json.dumps(metadata))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = models.ImageClassifier.from_preset(tmp_path / "preset")
    renamed = [w for w in caught if issubclass(w.category, DeprecationWarning)
               and "moe['mlp_dim']" in str(w.message)]
    assert renamed, [str(w.message) for w in caught]
    assert loaded.backbone.get_moe_layers()[0].mlp_dim == 24
    loaded.load_lora_weights(adapter)
    np.testing.assert_allclose(np.asarray(loaded.predict_on_batch(IMAGES)), expected,
                               atol=1e-6)
