"""VisionTransformerBackbone: the shared test base on each kind of backbone,
then what is specific to it: families, weight paths, argument errors,
int8 in `.keras` files, `load_weights_from`."""
# Hand-built configs: the subject is the backbone's constructor arguments and their errors.

import keras
import numpy as np
import pytest
import testing
import tiny_configs

from keras_vmoe.models import VisionTransformerBackbone
from keras_vmoe.models import backbone_config
from keras_vmoe.models.vit_embeddings import resize_position_embedding

IMAGES = np.random.default_rng(0).uniform(-1, 1, size=(4, 32, 32, 3)).astype("float32")

BACKBONES = {
    "vit": tiny_configs.vit(),
    "vmoe": tiny_configs.vmoe(),
    "soft_moe": tiny_configs.soft_moe(),
    # Two members per image; query/key norm, MAP head, fixed position table.
    "e3": tiny_configs.e3(qk_norm=True, classifier="map", position_embedding="sincos2d"),
    "tokens": tiny_configs.vit(pooled_output=False),
    "vmoe_remat": tiny_configs.vmoe(remat=True),
    "vmoe_scan": tiny_configs.vmoe(num_layers=4, scan=True),  # one scan over 2 pairs
}
OUTPUT_SHAPES = {"e3": (8, 32), "tokens": (4, 17, 32)}


# Each compiles several models (jit, int8, LoRA, saving): the heavy group.
@pytest.mark.heavy
@pytest.mark.parametrize("name", sorted(BACKBONES))
def test_backbone_through_the_shared_base(name, tmp_path):
    testing.run_backbone_test(VisionTransformerBackbone, BACKBONES[name], IMAGES,
                              OUTPUT_SHAPES.get(name, (4, 32)), run_saving=True,
                              tmp_path=tmp_path)


@pytest.mark.parametrize("family,variant,overrides,rows", [
    ("vit", "S/16", {}, 1),
    ("vmoe", "S/32", {"num_experts": 4}, 1),
    ("vmoe_15b", None, {"num_experts": 4, "patch_size": 8}, 1),
    ("soft_moe", "S/16", {"num_experts": 4}, 1),
    ("eee", "S/32", {"num_experts": 4, "layout": "every2"}, 2),
])
def test_forward_shapes_every_family(tiny, images, jit_call, family, variant,
                                     overrides, rows):
    backbone = VisionTransformerBackbone(
        **backbone_config(family, variant, **{**tiny, **overrides}))
    features = np.asarray(jit_call(backbone, images))
    assert features.shape == (len(images) * rows, backbone.output_dim)
    assert np.all(np.isfinite(features))
    if rows > 1:  # E³ members are exact copies until the first MoE block.
        assert not np.allclose(features[0], features[1])
    assert backbone.name.startswith("vision_transformer_backbone")


def test_weight_paths_of_a_tiny_vmoe():
    backbone = VisionTransformerBackbone(**tiny_configs.vmoe())
    block = {"layer_norm_0/gamma": (32,), "layer_norm_0/beta": (32,)}
    for name in ("query", "key", "value"):
        block.update({f"attention/{name}/kernel": (32, 2, 16),
                      f"attention/{name}/bias": (2, 16)})
    block.update({"attention/out/kernel": (2, 16, 32), "attention/out/bias": (32,),
                  "layer_norm_1/gamma": (32,), "layer_norm_1/beta": (32,)})
    expected = {
        "patch_embedding/kernel": (8, 8, 3, 32), "patch_embedding/bias": (32,),
        "patch_embedding/cls": (1, 1, 32), "position_embedding/embedding": (1, 17, 32),
        **{f"encoderblock_0/{k}": v for k, v in block.items()},
        "encoderblock_0/mlp/dense_0/kernel": (32, 64),
        "encoderblock_0/mlp/dense_0/bias": (64,),
        "encoderblock_0/mlp/dense_1/kernel": (64, 32),
        "encoderblock_0/mlp/dense_1/bias": (32,),
        **{f"encoderblock_1/{k}": v for k, v in block.items()},
        "encoderblock_1/moe/router/kernel": (32, 4),
        "encoderblock_1/moe/experts/kernel_0": (4, 32, 64),
        "encoderblock_1/moe/experts/bias_0": (4, 64),
        "encoderblock_1/moe/experts/kernel_1": (4, 64, 32),
        "encoderblock_1/moe/experts/bias_1": (4, 32),
        "encoder_norm/gamma": (32,), "encoder_norm/beta": (32,),
        "pre_logits/kernel": (32, 32), "pre_logits/bias": (32,),
    }
    shapes = {v.path: tuple(v.shape) for v in backbone.weights}
    assert shapes == expected
    assert list(shapes) == list(expected)  # creation order too
    assert [layer.name for layer in backbone.get_moe_layers()] == ["moe"]


@pytest.mark.parametrize("overrides,message", [
    ({"image_size": 30}, r"image_size.*divisible by.*patch_size.*30"),
    ({"num_heads": 3}, r"num_heads.*must divide.*hidden_dim.*3.*32"),
    ({"moe_layers": (0, 2)}, r"index 2.*out of range.*0\.\.1"),
    ({"classifier": "cls"}, r"classifier.*\('token', 'gap', 'map'\).*'cls'"),
    ({"position_embedding": "rope"}, r"position_embedding.*'rope'"),
    ({"moe_layers": (1,)}, r"needs a `moe` dict"),
    ({"moe_layers": (1,), "moe": {"num_experts": 6}, "ensemble_size": 4},
     r"num_experts.*\(6\).*divisible by.*ensemble_size.*\(4\)"),
    ({"moe_layers": (1,), "moe": {"num_experts": 4, "type": "dense"}},
     r"moe\['type'\].*'dense'"),
    ({"moe_layers": (1,), "moe": {"type": "soft", "num_experts": 4}, "ensemble_size": 2},
     r"soft.*not supported"),
    ({"ensemble_size": 2}, r"ensemble_size=2.*needs at least one MoE block"),
])
def test_validation_errors(tiny, overrides, message):
    with pytest.raises(ValueError, match=message):
        VisionTransformerBackbone(**{**tiny, **overrides})


@pytest.mark.parametrize("extra", [{"bogus_arg": 3}, {"remat_policy": "full"}])
def test_unknown_constructor_arguments_are_refused(tiny, extra):
    (key,) = extra
    with pytest.raises(TypeError, match=rf"\['{key}'\].*Valid arguments:.*'mlp_dim'"):
        VisionTransformerBackbone(**tiny, **extra)
    with pytest.raises(TypeError, match=key):
        config = VisionTransformerBackbone(**tiny).get_config()
        VisionTransformerBackbone.from_config({**config, **extra})


@pytest.mark.heavy
def test_int8_backbone_survives_keras_file(tmp_path):
    backbone = tiny_configs.composition_model("soft").backbone
    backbone.quantize("int8")
    images = np.random.default_rng(1).uniform(-1, 1, (2, 16, 16, 3)).astype("float32")
    path = str(tmp_path / "backbone.keras")
    backbone.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.get_config() == backbone.get_config()
    testing.assert_close(loaded(images), backbone(images), atol=1e-6)


def test_load_weights_from_resizes_the_position_embedding():
    small = VisionTransformerBackbone(**tiny_configs.vit_s16())
    large = VisionTransformerBackbone(**tiny_configs.vit_s16(image_size=(48, 64)))
    large.load_weights_from(small)
    weights = [{v.path: keras.ops.convert_to_numpy(v.value) for v in model.weights}
               for model in (small, large)]
    source, target = (w["position_embedding/embedding"] for w in weights)
    assert target.shape == (1, 1 + 6 * 8, 32)
    np.testing.assert_allclose(
        target, resize_position_embedding(source, (6, 8), has_cls=True), atol=1e-6)
    for path in ("encoderblock_1/attention/query/kernel", "patch_embedding/cls"):
        np.testing.assert_array_equal(weights[1][path], weights[0][path])
