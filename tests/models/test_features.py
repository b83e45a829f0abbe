"""keras_vmoe.models.features: block tokens, grids, routing alongside, the
token output switch."""

import keras
import numpy as np
import pytest
import tiny_configs

from keras_vmoe.models import VisionTransformerBackbone


@pytest.fixture(scope="module")
def vmoe():
    return VisionTransformerBackbone(**tiny_configs.vmoe())


@pytest.fixture(scope="module")
def vmoe_tokens(vmoe):
    tokens = VisionTransformerBackbone(**{**vmoe.get_config(), "pooled_output": False})
    tokens.load_weights_from(vmoe)
    return tokens


def test_every_block_from_one_call(vmoe, images):
    features = vmoe.extract_features(images)
    assert sorted(features) == ["encoderblock_0", "encoderblock_1"]
    for tokens in features.values():
        assert tokens.shape == (4, vmoe.num_tokens, vmoe.hidden_dim)


@pytest.mark.heavy
def test_last_block_normed_equals_the_token_output(vmoe, vmoe_tokens, images, jit_call):
    features = vmoe.extract_features(images, blocks=-1, norm=True)
    expected = np.asarray(jit_call(vmoe_tokens, images))
    assert expected.shape == (4, vmoe.num_tokens, vmoe.hidden_dim)
    np.testing.assert_allclose(features["encoderblock_1"], expected, atol=1e-5)
    # The pooled output is the pre-logits of the class token of that sequence.
    pooled = np.asarray(jit_call(vmoe, images))
    pre_logits = np.asarray(vmoe.get_layer("pre_logits")(expected[:, 0]))
    np.testing.assert_allclose(pooled, pre_logits, atol=1e-5)


def test_symbolic_block_outputs_build_a_feature_model(vmoe, images, jit_call):
    model = keras.Model(vmoe.inputs, vmoe.block_outputs)
    symbolic = jit_call(model, images)
    # Both compiled: an op-by-op run rounds differently (unfused ops), and
    # in a routed block a rounding difference can move a token past the
    # capacity boundary.
    compiled = vmoe.extract_features(images)
    for name, tokens in compiled.items():
        np.testing.assert_allclose(np.asarray(symbolic[name]), tokens, atol=1e-4)
    assert tuple(vmoe.token_output.shape) == (None, vmoe.num_tokens, vmoe.hidden_dim)


def test_grid_without_class_token(vmoe, images):
    full = vmoe.extract_features(images, blocks=[0])["encoderblock_0"]
    grid = vmoe.extract_features(images, blocks=0, class_token=False, grid=True)
    h, w = vmoe.grid_size
    assert grid["encoderblock_0"].shape == (4, h, w, vmoe.hidden_dim)
    # Row-major patch order: token 1 + (r·w + c) is grid cell (r, c).
    np.testing.assert_allclose(grid["encoderblock_0"][:, 1, 2], full[:, 1 + w + 2])
    no_cls = vmoe.extract_features(images, blocks=0, class_token=False)
    assert no_cls["encoderblock_0"].shape == (4, h * w, vmoe.hidden_dim)


@pytest.mark.heavy
def test_routing_alongside_the_features(vmoe, images):
    features, routing = vmoe.extract_features(images, blocks=-1, return_routing=True)
    assignments = vmoe.routing_assignments(images)
    assert sorted(routing) == sorted(assignments) == ["encoderblock_1"]
    for key, value in assignments["encoderblock_1"].items():
        np.testing.assert_array_equal(routing["encoderblock_1"][key], value)
    plain = vmoe.extract_features(images, blocks=-1)
    np.testing.assert_allclose(features["encoderblock_1"], plain["encoderblock_1"])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"blocks": 2}, "blocks"),
        ({"blocks": ()}, "at least one block"),
        ({"blocks": "0"}, "blocks"),
        ({"grid": True}, "class_token=False"),
        ({"blocks": 1.0}, r"`blocks` must be None, a block index.*blocks=1.0"),
        ({"blocks": True}, r"`blocks` must be None, a block index.*blocks=True"),
        ({"return_routing": "no"}, r"`return_routing` must be True or False"),
        ({"norm": "yes"}, r"`norm` must be True or False"),
    ],
)
def test_bad_feature_arguments(vmoe, images, kwargs, match):
    with pytest.raises(ValueError, match=match):
        vmoe.extract_features(images, **kwargs)


@pytest.mark.parametrize("bad, match", [
    (lambda x: (x + 1.0) * 127.5, r"float_range=\(-1.0, 1.0\).*\[0, 255\] values"),
    (lambda x: np.where(x > 0.5, np.nan, x), "NaN or inf"),
])
def test_features_check_the_input_range_as_predict_does(vmoe, images, bad, match):
    with pytest.raises(ValueError, match=match):
        vmoe.extract_features(bad(np.asarray(images)), blocks=-1)


def test_token_backbone_has_no_pooling_layers_and_round_trips(tiny):
    config = tiny_configs.vit_s16(classifier="map", representation_size=16)
    backbone = VisionTransformerBackbone(**config, pooled_output=False)
    names = {layer.name for layer in backbone.layers}
    assert "map_head" not in names and "pre_logits" not in names
    assert backbone.output_dim == tiny["hidden_dim"]
    restored = VisionTransformerBackbone.from_config(backbone.get_config())
    assert restored.pooled_output is False


def test_configs_without_the_switch_load_pooled(tiny):
    config = VisionTransformerBackbone(**tiny).get_config()
    del config["pooled_output"]
    restored = VisionTransformerBackbone.from_config(config)
    assert restored.pooled_output is True
    assert tuple(restored.output.shape) == (None, tiny["hidden_dim"])


def test_raw_images_go_through_the_image_converter(vmoe):
    from keras_vmoe.models import ImageClassifier
    from keras_vmoe.models import ImageClassifierPreprocessor
    from keras_vmoe.preprocessing import ImageConverter

    rng = np.random.default_rng(4)
    photos = rng.integers(0, 256, (2, 48, 40, 3)).astype("uint8")
    converted = np.asarray(ImageConverter(vmoe.image_size)(photos))
    expected = vmoe.extract_features(converted, blocks=-1)["encoderblock_1"]
    from_photos = vmoe.extract_features(photos, blocks=-1)["encoderblock_1"]
    np.testing.assert_allclose(from_photos, expected, atol=1e-5)
    # A list of photos, as `predict` takes (the routing groups images of a
    # batch together, so a batch of other photos routes differently). Each
    # image of a list is converted on its own: the inputs equal the batch's
    # to float32 rounding, and a rounding step can flip a near-tie in the
    # routing, so the features are compared with those of the same inputs.
    one_by_one = np.concatenate([np.asarray(ImageConverter(vmoe.image_size)(p[None]))
                                 for p in photos])
    np.testing.assert_allclose(one_by_one, converted, atol=1e-5)
    listed = vmoe.extract_features([photos[0], photos[1]], blocks=-1)
    np.testing.assert_allclose(
        listed["encoderblock_1"],
        vmoe.extract_features(one_by_one, blocks=-1)["encoderblock_1"], atol=1e-6)
    sizes = vmoe.extract_features([photos[0], photos[1, :30]], blocks=-1)
    assert sizes["encoderblock_1"].shape == expected.shape
    # A task applies its own converter (here floats read as [0, 1]).
    unit_converter = ImageConverter(32, float_range=(0, 1))
    task = ImageClassifier(vmoe, num_classes=3, compile=False,
                           preprocessor=ImageClassifierPreprocessor(unit_converter))
    unit = photos.astype("float32") / 255.0
    np.testing.assert_allclose(
        task.extract_features(unit, blocks=-1)["encoderblock_1"],
        vmoe.extract_features(np.asarray(unit_converter(unit)), blocks=-1)["encoderblock_1"],
        atol=1e-5)
    with pytest.raises(ValueError, match="Image 1 of the list.*channels"):
        vmoe.extract_features([photos[0], photos[1, ..., :2]])
