"""VisionTransformerBackbone: families, weight paths, errors, routing."""
# Hand-built configs: the subject is the backbone's constructor arguments and their errors.

import json

import keras
import numpy as np
import pytest
import testing
import tiny_configs

from keras_vmoe import models
from keras_vmoe.models import ImageClassifier
from keras_vmoe.models import VisionTransformerBackbone
from keras_vmoe.models import backbone_config
from keras_vmoe.models.vit_embeddings import resize_position_embedding


def _np(variable):
    return keras.ops.convert_to_numpy(variable.value)


@pytest.mark.parametrize(
    "family,variant,overrides,rows",
    [
        ("vit", "S/16", {}, 1),
        ("vmoe", "S/32", {"num_experts": 4}, 1),
        ("vmoe_15b", None, {"num_experts": 4, "patch_size": 8}, 1),
        ("soft_moe", "S/16", {"num_experts": 4}, 1),
        ("eee", "S/32", {"num_experts": 4, "layout": "every2"}, 2),
    ],
)
def test_forward_shapes_every_family(
    tiny, images, jit_call, family, variant, overrides, rows
):
    config = backbone_config(family, variant, **{**tiny, **overrides})
    backbone = VisionTransformerBackbone(**config)
    features = np.asarray(jit_call(backbone, images))
    assert features.shape == (len(images) * rows, backbone.output_dim)
    assert np.all(np.isfinite(features))
    if rows > 1:  # E³ members are exact copies until the first MoE block.
        assert not np.allclose(features[0], features[1])
    assert backbone.name.startswith("vision_transformer_backbone")


def test_weight_paths_of_a_tiny_vmoe(tiny):
    config = backbone_config("vmoe", "S/32", **tiny, num_experts=4)
    backbone = VisionTransformerBackbone(**config)
    shapes = {v.path: tuple(v.shape) for v in backbone.weights}
    block = {
        "layer_norm_0/gamma": (32,),
        "layer_norm_0/beta": (32,),
        "attention/query/kernel": (32, 2, 16),
        "attention/query/bias": (2, 16),
        "attention/key/kernel": (32, 2, 16),
        "attention/key/bias": (2, 16),
        "attention/value/kernel": (32, 2, 16),
        "attention/value/bias": (2, 16),
        "attention/out/kernel": (2, 16, 32),
        "attention/out/bias": (32,),
        "layer_norm_1/gamma": (32,),
        "layer_norm_1/beta": (32,),
    }
    expected = {
        "patch_embedding/kernel": (8, 8, 3, 32),
        "patch_embedding/bias": (32,),
        "patch_embedding/cls": (1, 1, 32),
        "position_embedding/embedding": (1, 17, 32),
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
        "encoder_norm/gamma": (32,),
        "encoder_norm/beta": (32,),
        "pre_logits/kernel": (32, 32),
        "pre_logits/bias": (32,),
    }
    assert shapes == expected
    assert list(shapes) == list(expected)  # creation order too
    assert [layer.name for layer in backbone.get_moe_layers()] == ["moe"]


def test_config_round_trip(tiny):
    config = backbone_config(
        "eee",
        "S/32",
        **tiny,
        num_experts=4,
        layout="every2",
        qk_norm=True,
        classifier="map",
        position_embedding="sincos2d",
    )
    backbone = VisionTransformerBackbone(**config)
    saved = backbone.get_config()
    json.dumps(saved)
    revived = VisionTransformerBackbone.from_config(json.loads(json.dumps(saved)))
    assert revived.get_config() == saved
    assert [v.path for v in revived.weights] == [v.path for v in backbone.weights]


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"image_size": 30}, r"image_size.*divisible by.*patch_size.*30"),
        ({"num_heads": 3}, r"num_heads.*must divide.*hidden_dim.*3.*32"),
        ({"moe_layers": (0, 2)}, r"index 2.*out of range.*0\.\.1"),
        ({"classifier": "cls"}, r"classifier.*\('token', 'gap', 'map'\).*'cls'"),
        ({"position_embedding": "rope"}, r"position_embedding.*'rope'"),
        ({"moe_layers": (1,)}, r"needs a `moe` dict"),
        (
            {"moe_layers": (1,), "moe": {"num_experts": 6}, "ensemble_size": 4},
            r"num_experts.*\(6\).*divisible by.*ensemble_size.*\(4\)",
        ),
        (
            {"moe_layers": (1,), "moe": {"num_experts": 4, "type": "dense"}},
            r"moe\['type'\].*'dense'",
        ),
        (
            {
                "moe_layers": (1,),
                "moe": {"type": "soft", "num_experts": 4},
                "ensemble_size": 2,
            },
            r"soft.*not supported",
        ),
        ({"ensemble_size": 2}, r"ensemble_size=2.*needs at least one MoE block"),
    ],
)
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


def test_load_weights_from_resizes_the_position_embedding(tiny):
    small = VisionTransformerBackbone(**backbone_config("vit", "S/16", **tiny))
    large = VisionTransformerBackbone(
        **backbone_config("vit", "S/16", **{**tiny, "image_size": (48, 64)})
    )
    large.load_weights_from(small)
    source = _np(small.get_layer("position_embedding").embedding)
    target = _np(large.get_layer("position_embedding").embedding)
    assert target.shape == (1, 1 + 6 * 8, 32)
    np.testing.assert_allclose(
        target, resize_position_embedding(source, (6, 8), has_cls=True), atol=1e-6
    )
    for path in ("encoderblock_1/attention/query/kernel", "patch_embedding/cls"):
        np.testing.assert_array_equal(
            _np(next(v for v in large.weights if v.path == path)),
            _np(next(v for v in small.weights if v.path == path)),
        )


def test_mixed_precision(tiny, images, jit_call):
    config = backbone_config(
        "vmoe", "S/32", **tiny, num_experts=4, dtype="mixed_bfloat16"
    )
    backbone = VisionTransformerBackbone(**config)
    assert backbone.dtype_policy.name == "mixed_bfloat16"
    assert all(v.dtype == "float32" for v in backbone.weights)
    model = ImageClassifier(backbone, num_classes=3, head_bias_init=-1.0, compile=False)
    logits = jit_call(model, images)
    assert keras.backend.standardize_dtype(logits.dtype) == "bfloat16"
    np.testing.assert_allclose(np.asarray(logits, "float32"), -1.0)
    assert VisionTransformerBackbone.from_config(
        backbone.get_config()
    ).dtype_policy.name == ("mixed_bfloat16")


@pytest.fixture(scope="module")
def routed_model(tiny):
    config = backbone_config("vmoe", "S/32", **tiny, num_experts=4)
    model = ImageClassifier(VisionTransformerBackbone(**config), num_classes=5)
    head = model.get_layer("head")
    head.kernel.assign(np.random.default_rng(0).normal(size=head.kernel.shape))
    return model


@pytest.mark.heavy
def test_set_routing_changes_a_compiled_model(routed_model, images):
    model = routed_model
    weights = [id(v) for v in model.weights]
    before = model.predict(images, verbose=0)
    assert model.predict_function is not None

    model.set_routing(capacity_factor=0.01)
    assert model.predict_function is None
    after = model.predict(images, verbose=0)
    assert np.abs(after - before).max() > 1e-3
    assert [id(v) for v in model.weights] == weights
    dropped = model.routing_metrics(images)["encoderblock_1"]
    assert dropped["capacity"] == 4 and dropped["dropped_assignments_fraction"] > 0.5
    assert model.backbone.moe["router"]["capacity_factor"] == 0.01
    assert model.backbone.get_config()["moe"]["router"]["capacity_factor"] == 0.01

    model.set_routing(num_selected_experts=1, batch_priority=True, group_size=17)
    layer = model.backbone.get_moe_layers()[0]
    assert (layer.num_selected_experts, layer.batch_priority, layer.group_size) == (
        1,
        True,
        17,
    )
    model.set_routing(group_size="all")
    assert layer.group_size is None and model.backbone.moe["group_size"] is None


def test_set_routing_errors(routed_model, tiny):
    with pytest.raises(ValueError, match=r"num_selected_experts.*between 1 and 4.*5"):
        routed_model.set_routing(num_selected_experts=5)
    with pytest.raises(ValueError, match=r"capacity_factor.*> 0.*-1"):
        routed_model.set_routing(capacity_factor=-1)
    with pytest.raises(ValueError, match="group_size"):
        routed_model.set_routing(group_size=0)
    soft = VisionTransformerBackbone(
        **backbone_config("soft_moe", "S/16", **tiny, num_experts=4)
    )
    with pytest.raises(ValueError, match="Soft MoE"):
        soft.set_routing(capacity_factor=2.0)
    expert_choice = VisionTransformerBackbone(
        **backbone_config(
            "vmoe", "S/32", **tiny, num_experts=4, router={"name": "expert_choice"}
        )
    )
    with pytest.raises(ValueError, match="no `num_selected_experts` setting"):
        expert_choice.set_routing(num_selected_experts=1)
    expert_choice.set_routing(capacity_factor=2.0)  # supported
    dense = VisionTransformerBackbone(**backbone_config("vit", "S/16", **tiny))
    with pytest.raises(ValueError, match="no MoE layers"):
        dense.set_routing(capacity_factor=2.0)


def test_routing_metrics_in_training_mode(routed_model, images):
    metrics = routed_model.backbone.routing_metrics(images, training=True)
    assert set(metrics) == {"encoderblock_1", "auxiliary_loss"}
    assert "load_loss" in metrics["encoderblock_1"]  # noisy routing
    assert metrics["auxiliary_loss"] == pytest.approx(
        metrics["encoderblock_1"]["auxiliary_loss"]
    )


@pytest.mark.slow
def test_routing_metrics_eager_matches_jit(routed_model, images):
    jit = routed_model.backbone.routing_metrics(images)
    eager = routed_model.backbone.routing_metrics(images, jit_compile=False)
    assert jit.keys() == eager.keys()
    for name, values in eager["encoderblock_1"].items():
        assert jit["encoderblock_1"][name] == pytest.approx(values, abs=1e-5), name


def test_set_routing_and_get_config_do_not_copy_the_model(tiny, monkeypatch):
    # `self.moe` is a Keras-tracked dict; deep-copying it used to drag in the
    # tracker and serialize the whole model (seconds for a real V-MoE, and a
    # crash when a variable had no value).
    from keras.src.saving.keras_saveable import KerasSaveable

    backbone = VisionTransformerBackbone(
        **backbone_config("vmoe", "S/32", **tiny, num_experts=4)
    )
    backbone.set_routing(capacity_factor=2.0)  # nested dicts now tracked too

    def no_copy(self, *args):
        raise AssertionError(f"{type(self).__name__} was copied")

    monkeypatch.setattr(KerasSaveable, "__reduce__", no_copy)
    # NumPy scalars (e.g. from a sweep over np.linspace) are accepted and
    # stored as Python numbers, so the config stays JSON-serializable.
    backbone.set_routing(
        capacity_factor=np.float32(1.5), group_size=np.int64(17),
        num_selected_experts=np.int64(1),
    )
    config = backbone.get_config()
    assert type(config["moe"]) is dict and type(config["moe"]["router"]) is dict
    assert config["moe"]["router"]["capacity_factor"] == 1.5
    assert type(config["moe"]["group_size"]) is int
    assert backbone.get_moe_layers()[0].num_selected_experts == 1
    json.dumps(config)


@pytest.mark.parametrize("method", ["predict", "evaluate"])
def test_a_failing_predict_or_evaluate_keeps_the_model_usable(tiny, images, method):
    # Keras' JAX trainer detaches the variables during predict/evaluate and
    # only reattaches them on success: a batch that fails part-way through
    # the loop (here the input's second batch) used to leave the model
    # broken ("'NoneType' object is not callable") for every later call.
    config = backbone_config("vmoe", "S/32", **tiny, num_experts=4)
    model = ImageClassifier(VisionTransformerBackbone(**config), num_classes=3)
    before = model.predict(images[:2], verbose=0)

    def batches():
        yield (images[:2],) if method == "predict" else (images[:2], np.zeros(2))
        raise ValueError("a broken second batch")

    with pytest.raises(ValueError, match="broken second batch"):
        getattr(model, method)(batches(), verbose=0)
    np.testing.assert_array_equal(model.predict(images[:2], verbose=0), before)
    with pytest.raises(ValueError, match="image_size"):
        model.backbone.predict(np.zeros((1, 16, 16, 3)), verbose=0)
    assert model.backbone.predict(images[:2], verbose=0).shape == (2, 32)


# --- The shared test base (tests/testing.py) --------------------------------

IMAGES = np.random.default_rng(0).uniform(-1, 1, size=(4, 32, 32, 3)).astype("float32")

BACKBONES = {
    "vit": tiny_configs.vit(),
    "vmoe": tiny_configs.vmoe(),
    "soft_moe": tiny_configs.soft_moe(),
    "tokens": tiny_configs.vit(pooled_output=False),
    "vmoe_remat": models.backbone_config("vmoe", "S/32", **tiny_configs.vit(),
                                         num_experts=4, remat=True),
    # Four blocks: one scan over two dense/MoE pairs.
    "vmoe_scan": models.backbone_config("vmoe", "S/32", **tiny_configs.vit(num_layers=4),
                                        num_experts=4, scan=True),
}


# Backbones, tasks and presets compile several models each (jit, int8, LoRA,
# one fit step): minutes on two cores, so they run in the heavy group.
@pytest.mark.heavy
@pytest.mark.parametrize("name", sorted(BACKBONES))
def test_backbone_through_the_shared_base(name, tmp_path):
    config = BACKBONES[name]
    width = config["hidden_dim"]
    shape = (4, 17, width) if name == "tokens" else (4, width)
    testing.run_backbone_test(models.VisionTransformerBackbone, config, IMAGES, shape,
                              run_saving=True, tmp_path=tmp_path)
