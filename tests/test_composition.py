"""Features used together: LoRA, int8, presets and upcycling on V-MoE, Soft MoE and E³.

Each test takes one pair of features through a tiny model of each kind and
checks what must hold for the pair: which weights train, logits parity
(tolerances stated per test) and that saved files load back.

Marker `heavy` (several minutes of model builds and train steps on 2 cores);
.ci/run runs the group.
"""

import keras
import numpy as np
import pytest

import keras_vmoe
from keras_vmoe.deploy.quantize import quantized_layers
from keras_vmoe.models import EnsembleImageClassifier
from keras_vmoe.models import ImageClassifier
from keras_vmoe.models import VisionTransformerBackbone
from keras_vmoe.models import lora

pytestmark = pytest.mark.heavy

TINY = dict(image_size=16, patch_size=8, hidden_dim=16, num_layers=2, num_heads=2,
            mlp_dim=32)
KINDS = ("sparse", "soft", "ensemble")


def _model(kind, seed=0):
    from keras_vmoe import models

    keras.utils.set_random_seed(seed)
    if kind == "ensemble":
        config = models.backbone_config("eee", "S/32", **TINY, layout="every2",
                                        num_experts=4, representation_size=None)
        model = EnsembleImageClassifier(VisionTransformerBackbone(**config), num_classes=3)
    else:
        moe = ({"num_experts": 4, "router": {"name": "token_choice", "capacity_factor": 2.0}}
               if kind == "sparse"
               else {"num_experts": 4, "router": {"name": "soft", "num_slots": 2}})
        model = ImageClassifier(VisionTransformerBackbone(
            **TINY, classifier="token" if kind == "sparse" else "gap", moe_layers=(1,),
            moe=moe), num_classes=3)
    rng = np.random.default_rng(seed)  # a zero head would move no logit
    model.set_weights([rng.normal(0, 0.3, w.shape).astype(w.dtype)
                       for w in model.get_weights()])
    return model


@pytest.fixture(scope="module")
def images():
    return np.random.default_rng(1).uniform(-1, 1, (4, 16, 16, 3)).astype("float32")


@pytest.fixture(scope="module")
def labels():
    return np.array([0, 1, 2, 1], "int32")


@pytest.fixture(scope="module", params=KINDS)
def presets_of(request, tmp_path_factory):
    """`(kind, float preset path, int8 preset path)` of one tiny model."""
    directory = tmp_path_factory.mktemp(f"compose_{request.param}")
    model = _model(request.param)
    float_path = keras_vmoe.presets.save_to_preset(model, directory / "float")
    model.quantize("int8")
    int8_path = keras_vmoe.presets.save_to_preset(model, directory / "int8")
    return request.param, str(float_path), str(int8_path)


def _train_step(model, images, labels):
    model.compile(optimizer=keras.optimizers.SGD(0.5))
    model.train_on_batch(images, labels)


def _values(model):
    return {v.path: np.array(v.value) for v in model.weights}


def test_lora_over_int8_preset_trains_only_the_float_factors(presets_of, images, labels):
    kind, _, int8_path = presets_of
    model = keras_vmoe.presets.from_preset(int8_path)
    model.enable_lora(2, experts=True)
    trainable = {v.path for v in model.trainable_weights}
    assert trainable == {v.path for v in model.weights if "lora_kernel" in v.path}
    before = _values(model)
    # B starts at zero: the model is the int8 preset until trained.
    reference = keras_vmoe.presets.from_preset(int8_path)
    np.testing.assert_allclose(model.predict_on_batch(images),
                               reference.predict_on_batch(images), atol=1e-6)
    _train_step(model, images, labels)
    after = _values(model)
    for path, value in before.items():
        if path not in trainable:
            np.testing.assert_array_equal(after[path], value, path)
    assert any(np.abs(after[p]).max() > 0 for p in trainable if p.endswith("b"))


def test_lora_save_to_preset_reloads_the_merged_model(presets_of, images, labels, tmp_path):
    kind, float_path, _ = presets_of
    model = keras_vmoe.presets.from_preset(float_path)
    model.enable_lora(2, targets=("query", "value", "out"), experts=True)
    rng = np.random.default_rng(5)
    for v in model.weights:
        if "lora_kernel" in v.path:
            v.assign((0.2 * rng.standard_normal(v.shape)).astype("float32"))
    expected = np.asarray(model.predict_on_batch(images))
    adapter = model.save_lora_weights(str(tmp_path / "adapter"))
    merged = keras_vmoe.presets.from_preset(
        keras_vmoe.presets.save_to_preset(model, tmp_path / "merged"))
    assert lora.lora_config(merged) is None
    # Merged kernels vs factors applied at call time: float32 rounding only.
    np.testing.assert_allclose(merged.predict_on_batch(images), expected, atol=1e-5)
    applied = keras_vmoe.presets.from_preset(float_path)
    applied.load_lora_weights(adapter)
    np.testing.assert_allclose(applied.predict_on_batch(images), expected, atol=1e-6)


def test_int8_preset_reloads_exactly_and_takes_overrides(presets_of, images):
    kind, float_path, int8_path = presets_of
    quantized = keras_vmoe.presets.from_preset(float_path)
    quantized.quantize("int8")
    loaded = keras_vmoe.presets.from_preset(int8_path)
    np.testing.assert_array_equal(loaded.predict_on_batch(images),
                                  quantized.predict_on_batch(images))
    resized = keras_vmoe.presets.from_preset(int8_path, image_size=32, num_classes=5)
    assert set(quantized_layers(resized)) == set(quantized_layers(loaded)) - {"head"}
    big = np.concatenate([images, images], axis=1)
    big = np.concatenate([big, big], axis=2)  # (4, 32, 32, 3)
    assert np.asarray(resized.predict_on_batch(big)).shape[-1] == 5


@pytest.fixture(scope="module")
def dense_classifier():
    keras.utils.set_random_seed(0)
    model = ImageClassifier(VisionTransformerBackbone(**TINY), num_classes=3)
    rng = np.random.default_rng(0)
    model.set_weights([rng.normal(0, 0.3, w.shape).astype(w.dtype)
                       for w in model.get_weights()])
    return model


@pytest.mark.parametrize("moe_type", ["sparse", "soft"])
def test_upcycled_model_takes_lora_and_int8(dense_classifier, images, labels, moe_type):
    from keras_vmoe.models.upcycle import upcycle

    model = upcycle(dense_classifier, num_experts=4, moe_layers=(1,), moe_type=moe_type)
    before = np.asarray(model.predict_on_batch(images))
    model.quantize("int8")
    quantized = np.asarray(model.predict_on_batch(images))
    # int8 error stays small against the logits' scale.
    assert np.abs(quantized - before).max() < 0.1 * np.abs(before).max() + 1e-3
    model.enable_lora(2, experts=True)
    assert all("lora_kernel" in v.path for v in model.trainable_weights)
    frozen = {p: v for p, v in _values(model).items() if "lora_kernel" not in p}
    _train_step(model, images, labels)
    after = _values(model)
    for path, value in frozen.items():
        np.testing.assert_array_equal(after[path], value, path)
