"""keras_vmoe.models.image_classifier: ImageClassifier, and what it shares
with the E³ EnsembleImageClassifier."""

import math

import keras
import numpy as np
import pytest
import testing
import tiny_configs

from keras_vmoe import models
from keras_vmoe.models import EnsembleAccuracy
from keras_vmoe.models import EnsembleCrossentropy
from keras_vmoe.models import EnsembleImageClassifier
from keras_vmoe.models import ImageClassifier
from keras_vmoe.models import VisionTransformerBackbone
from keras_vmoe.models.ensemble_classifier import ensemble_log_probabilities
from keras_vmoe.models.ensemble_classifier import ensemble_probabilities


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _fitted(task_class, config, images, labels):
    """A `task_class` on `config` after one `fit` step; history kept on the model."""
    model = task_class(VisionTransformerBackbone(**config), num_classes=3)
    model.fit_history = model.fit(images, labels, batch_size=4, epochs=1, verbose=0)
    return model


@pytest.fixture(scope="module")
def vmoe_classifier(images, labels):
    return _fitted(ImageClassifier, tiny_configs.vmoe(), images, labels)


@pytest.fixture(scope="module")
def eee_classifier(images, labels):
    return _fitted(EnsembleImageClassifier, tiny_configs.e3(), images, labels)


def test_fit_one_step_includes_the_auxiliary_loss(vmoe_classifier, images):
    model = vmoe_classifier
    loss = model.fit_history.history["loss"][0]
    # Zero-initialised head: the cross-entropy of the first step is log(3);
    # the rest is the weighted MoE auxiliary loss (importance + load).
    assert 0.0 < loss - math.log(3) < 0.05
    assert "accuracy" in model.fit_history.history
    # The auxiliary loss is also reported on its own in the fit logs.
    aux = model.fit_history.history["auxiliary_loss"][0]
    assert 0.0 < aux < 0.05
    assert abs((loss - math.log(3)) - aux) < 1e-3
    assert isinstance(model.optimizer, keras.optimizers.Adam)
    assert model.get_layer("head").kernel.trainable


@pytest.mark.slow  # keeps the default suite under 10 min; run with -m slow
def test_save_and_load_gives_identical_outputs(vmoe_classifier, images, tmp_path):
    path = str(tmp_path / "model.keras")
    vmoe_classifier.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded) is ImageClassifier
    assert type(loaded.backbone) is VisionTransformerBackbone
    assert loaded.get_config() == vmoe_classifier.get_config()
    np.testing.assert_array_equal(
        loaded.predict(images, verbose=0), vmoe_classifier.predict(images, verbose=0)
    )
    assert loaded.optimizer.iterations.numpy() == 1  # compile state restored


def test_classifier_without_head(images, jit_call):
    backbone = VisionTransformerBackbone(**tiny_configs.vit_s16())
    model = ImageClassifier(backbone)
    assert [v.path for v in model.weights] == [v.path for v in backbone.weights]
    assert tuple(model.output.shape) == (None, 32)
    assert model.loss is None
    revived = ImageClassifier.from_config(model.get_config())
    assert revived.num_classes is None


def test_classifier_head_and_errors():
    backbone = VisionTransformerBackbone(**tiny_configs.vit_s16())
    model = ImageClassifier(
        backbone, num_classes=7, head_bias_init=-math.log(7), activation="softmax"
    )
    head = model.get_layer("head")
    assert [v.path for v in head.weights] == ["head/kernel", "head/bias"]
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(head.kernel.value), 0.0)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(head.bias.value), -math.log(7)
    )
    assert not model.loss.get_config()["from_logits"]
    with pytest.raises(ValueError, match="num_classes"):
        ImageClassifier(backbone, num_classes=0)
    eee = VisionTransformerBackbone(**tiny_configs.e3())
    with pytest.raises(ValueError, match="EnsembleImageClassifier"):
        ImageClassifier(eee, num_classes=3)


def test_eee_fit_one_step(eee_classifier):
    loss = eee_classifier.fit_history.history["loss"][0]
    assert 0.0 < loss - math.log(3) < 0.05  # mean member CE + aux loss


@pytest.mark.slow  # keeps the default suite under 10 min; run with -m slow
def test_eee_prediction_is_the_mean_of_member_softmax(eee_classifier, images):
    model = eee_classifier
    model.get_layer("head").kernel.assign(
        np.random.default_rng(1).normal(size=(32, 3)).astype("float32")
    )
    logits = model.predict_members(images, verbose=0)
    assert logits.shape == (4, 2, 3)
    assert not np.allclose(logits[:, 0], logits[:, 1])
    want = _softmax(logits.astype("float64")).mean(axis=1)
    np.testing.assert_allclose(
        model.predict_probabilities(images, verbose=0), want, rtol=1e-5
    )
    np.testing.assert_allclose(
        np.asarray(ensemble_probabilities(logits)), want, rtol=1e-5
    )
    np.testing.assert_allclose(
        np.asarray(ensemble_log_probabilities(logits)), np.log(want), atol=1e-5
    )
    np.testing.assert_allclose(
        model.predict_probabilities(images, log=True, verbose=0),
        np.log(want),
        atol=1e-5,
    )


def test_every_classifier_predicts_class_scores_members_one_call_away(
        eee_classifier, vmoe_classifier, images):
    # One convention: predict -> (B, classes) scores whose softmax is the
    # prediction; E³ members through predict_members.
    for model in (vmoe_classifier, eee_classifier):
        scores = np.asarray(model.predict(images, verbose=0))
        assert scores.shape == (4, 3)
        np.testing.assert_allclose(
            model.predict_probabilities(images, verbose=0),
            _softmax(scores.astype("float64")), atol=1e-5)
    members = np.asarray(eee_classifier.predict_members(images, verbose=0))
    assert members.shape == (4, 2, 3)
    np.testing.assert_allclose(
        np.asarray(eee_classifier.predict(images, verbose=0)),
        np.asarray(ensemble_log_probabilities(members)), atol=1e-5)
    # The evaluation still sees the members.
    from keras_vmoe.evaluation.predictions import predict_log_probabilities

    result = predict_log_probabilities(eee_classifier, images, batch_size=4)
    np.testing.assert_allclose(result["member_logits"], members, atol=1e-5)
    np.testing.assert_allclose(
        result["log_probabilities"],
        eee_classifier.predict_probabilities(images, log=True, verbose=0), atol=1e-5)


def test_predict_takes_a_list_of_raw_images_of_different_sizes(eee_classifier):
    rng = np.random.default_rng(3)
    # 4 photos: the batch size of the fixtures' calls (no new compile).
    photos = [rng.integers(0, 256, size, dtype="uint8")
              for size in ((40, 60, 3), (16, 16, 3), (23, 31, 3), (9, 70, 3))]
    together = np.asarray(eee_classifier.predict(photos, verbose=0))
    assert together.shape == (4, 3)
    converter = eee_classifier.preprocessor.image_converter
    one_by_one = np.concatenate([np.asarray(converter(p[None])) for p in photos])
    np.testing.assert_allclose(
        together, eee_classifier.predict(one_by_one, verbose=0), atol=1e-5)
    with pytest.raises(ValueError, match="Image 1 of the list"):
        eee_classifier.predict([photos[0], photos[1][..., :2]], verbose=0)
    gray = photos[1][..., 0]  # (H, W): described as a grayscale image, with the fix
    with pytest.raises(ValueError, match=r"Image 1 of the list has shape \(16, 16\): a "
                       r"grayscale image.*np\.repeat\(image\[\.\.\., None\], 3"):
        eee_classifier.predict([photos[0], gray], verbose=0)


def test_ensemble_loss_and_accuracy():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(5, 3, 4)).astype("float32")
    labels = np.array([0, 3, 1, 1, 2])
    log_probs = np.log(_softmax(logits.astype("float64")))
    want = -log_probs[np.arange(5), :, labels].mean()  # mean member CE
    loss = EnsembleCrossentropy()
    assert float(loss(labels, logits)) == pytest.approx(want, rel=1e-5)
    assert float(loss(labels[:, None], logits)) == pytest.approx(want, rel=1e-5)
    dense = EnsembleCrossentropy(sparse=False)
    assert float(dense(np.eye(4)[labels], logits)) == pytest.approx(want, rel=1e-5)
    probs = EnsembleCrossentropy(from_logits=False)
    assert float(probs(labels, _softmax(logits))) == pytest.approx(want, rel=1e-4)
    metric = EnsembleAccuracy()
    metric.update_state(labels, logits)
    predicted = _softmax(logits).mean(1).argmax(-1)
    assert float(metric.result()) == pytest.approx(np.mean(predicted == labels))
    assert EnsembleCrossentropy.from_config(loss.get_config()).sparse


def test_eee_config_round_trip_and_routing(eee_classifier, tmp_path):
    config = eee_classifier.get_config()
    revived = EnsembleImageClassifier.from_config(config)
    assert revived.get_config() == config
    assert revived.ensemble_size == 2
    eee_classifier.set_routing(capacity_factor=8.0)  # the E³ eval capacity
    assert eee_classifier.predict_function is None
    assert eee_classifier.backbone.get_moe_layers()[0].capacity_factor == 8.0
    path = str(tmp_path / "eee.keras")
    eee_classifier.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.backbone.moe["router"]["capacity_factor"] == 8.0
    for a, b in zip(loaded.weights, eee_classifier.weights, strict=True):
        assert a.path == b.path
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(a.value), keras.ops.convert_to_numpy(b.value)
        )


def _upstream_model(upstream_dir, fixture):
    import json

    from keras_vmoe.conversion import build_model_from_upstream
    from keras_vmoe.conversion import routing_from_upstream_config

    folder = upstream_dir / fixture
    variant = json.loads((folder / "config.json").read_text())["variants"]["f32dispatch"]
    routing = routing_from_upstream_config(variant["model_config"], image_size=32)
    assert routing["images_per_group"] == 2
    model = build_model_from_upstream(
        str(folder / "checkpoint"), **routing)
    return model, np.load(folder / "inputs.npy")


@pytest.mark.parametrize("fixture", ["vmoe_tiny", "eee_tiny"])
def test_predict_pads_a_partial_group_with_routed_zero_images_as_upstream(
        upstream_dir, fixture):
    # Upstream's evaluation pipeline (vmoe/data/input_pipeline.py, get_dataset)
    # appends zero examples (after preprocessing) to fill the last batch and
    # runs the model on them: 3 images in groups of 2 are routed as
    # [x0, x1], [x2, zeros].
    model, x = _upstream_model(upstream_dir, fixture)
    padded = np.concatenate([x[:3], np.zeros_like(x[:1])])
    upstream = np.asarray(model.predict_on_batch(padded))[:3]
    if upstream.ndim == 3:
        upstream = np.asarray(ensemble_log_probabilities(upstream))
    np.testing.assert_allclose(model.predict(x[:3], verbose=0), upstream, atol=1e-6)
    masked = model.predict(x[:3], verbose=0, partial_group="mask")
    assert masked.shape == upstream.shape
    if fixture == "vmoe_tiny":  # its capacity binds in the partial group
        assert np.abs(masked - upstream).max() > 1e-3
    with pytest.raises(ValueError, match="partial_group"):
        model.predict(x, partial_group="drop")


def test_predict_does_not_depend_on_the_batch_size(upstream_dir):
    # The batch size is rounded up to whole groups: with batch_size=3 the
    # last image would otherwise be routed alone in a masked group.
    model, x = _upstream_model(upstream_dir, "vmoe_tiny")
    full = model.predict(x, verbose=0, batch_size=4)
    np.testing.assert_allclose(model.predict(x, verbose=0, batch_size=3), full, atol=1e-6)
    np.testing.assert_allclose(model.predict(x, verbose=0, batch_size=1), full, atol=1e-6)
    # An image predicted alone gets the same answer whatever else the call
    # holds after it in its group: here, the first image of each group.
    for index in (0, 2):
        np.testing.assert_allclose(model.predict(x[index:index + 1], verbose=0)[0],
                                   full[index], atol=1e-5)


# --- The shared test base (tests/testing.py) --------------------------------

IMAGES = np.random.default_rng(0).uniform(-1, 1, size=(4, 32, 32, 3)).astype("float32")
LABELS = np.array([0, 1, 2, 1], dtype="int32")

@pytest.mark.heavy
def test_image_classifier_through_the_shared_base(tmp_path):
    backbone = models.VisionTransformerBackbone(**tiny_configs.vmoe())
    testing.run_task_test(
        models.ImageClassifier, {"backbone": backbone, "num_classes": 3},
        (IMAGES, LABELS), (4, 3), run_saving=True, tmp_path=tmp_path,
    )


def _with_random_lora(model):
    """LoRA on the attention and the experts, B drawn (zero B moves nothing)."""
    model.enable_lora(2, targets=("query", "value", "out"), experts=True)
    rng = np.random.default_rng(3)
    for variable in model.weights:
        if "lora_kernel_b" in variable.path:
            variable.assign((0.2 * rng.standard_normal(variable.shape)).astype("float32"))
    return model


def _quantized(model):
    model.quantize("int8")
    return model


_SAVED_FORMS = {
    "int8": _quantized,
    "lora": _with_random_lora,
    "int8+lora": lambda model: _with_random_lora(_quantized(model)),
}


def _check_keras_file_round_trip(model, tmp_path):
    from keras_vmoe.deploy.quantize import quantized_layers

    images = np.random.default_rng(1).uniform(-1, 1, (4, 16, 16, 3)).astype("float32")
    expected = keras.ops.convert_to_numpy(model.predict_on_batch(images))
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded) is type(model)
    assert quantized_layers(loaded) == quantized_layers(model)
    actual = keras.ops.convert_to_numpy(loaded.predict_on_batch(images))
    # `.keras` holds LoRA merged into the kernels: exact for float kernels;
    # an int8 kernel is quantized again with the update (a step of its scale).
    merged_int8 = quantized_layers(model) and getattr(model, "_keras_vmoe_lora", None)
    atol = 0.05 if merged_int8 else 1e-6
    np.testing.assert_allclose(actual, expected, atol=atol)
    return loaded


@pytest.mark.heavy
def test_int8_model_survives_keras_file(tmp_path):
    from tiny_configs import composition_model

    model = composition_model("sparse")
    model.quantize("int8")
    loaded = _check_keras_file_round_trip(model, tmp_path)
    assert loaded.get_config() == model.get_config()
    int8 = sorted(v.path for v in loaded.weights if str(v.dtype) == "int8")
    assert int8 == sorted(v.path for v in model.weights if str(v.dtype) == "int8")
    assert any("experts" in path for path in int8)


@pytest.mark.heavy
def test_int8_backbone_survives_keras_file(tmp_path):
    from tiny_configs import composition_model

    backbone = composition_model("soft").backbone
    backbone.quantize("int8")
    images = np.random.default_rng(1).uniform(-1, 1, (2, 16, 16, 3)).astype("float32")
    path = str(tmp_path / "backbone.keras")
    backbone.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.get_config() == backbone.get_config()
    np.testing.assert_allclose(keras.ops.convert_to_numpy(loaded(images)),
                               keras.ops.convert_to_numpy(backbone(images)), atol=1e-6)


def test_quantized_layers_record_is_checked():
    from tiny_configs import composition_model

    config = composition_model("sparse").get_config()
    with pytest.raises(ValueError, match="quantized_layers.*int4"):
        ImageClassifier.from_config({**config, "quantized_layers": {"head": "int4"}})
    with pytest.raises(ValueError, match="does not have.*nowhere"):
        ImageClassifier.from_config({**config, "quantized_layers": {"nowhere": "int8"}})


@pytest.mark.heavy
@pytest.mark.parametrize("form", sorted(_SAVED_FORMS))
@pytest.mark.parametrize("kind", ["sparse", "soft", "ensemble"])
def test_changed_models_survive_keras_file(kind, form, tmp_path):
    from tiny_configs import composition_model

    _check_keras_file_round_trip(_SAVED_FORMS[form](composition_model(kind)), tmp_path)


def _count_predict_traces(model):
    """Counts the traces of `model.predict_step` (one per compiled batch shape)."""
    traced = []
    step = model.predict_step

    def counting(*args, **kwargs):
        traced.append(1)
        return step(*args, **kwargs)

    model.predict_step = counting
    return traced


@pytest.mark.heavy
@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX compiles per shape")
def test_predict_pads_the_last_batch_to_a_bucket():
    from tiny_configs import composition_model

    from keras_vmoe.models.task import predict_bucket

    assert [predict_bucket(n, 32) for n in (1, 3, 6, 8, 9, 17, 31)] == [
        1, 4, 8, 8, 16, 32, 32]
    assert predict_bucket(3, 32, group=8) == 8 and predict_bucket(5, 12, 4) == 8
    model = composition_model("sparse")
    model.set_routing(images_per_group=1)  # each image routed alone
    images = np.random.default_rng(2).uniform(-1, 1, (75, 16, 16, 3)).astype("float32")
    expected = np.concatenate([keras.ops.convert_to_numpy(model(images[i:i + 1]))
                               for i in range(75)])
    traced = _count_predict_traces(model)
    outputs = {}
    for count in (37, 70, 38, 75):  # last batches 5, 6, 6, 11 -> buckets 8, 8, 8, 16
        outputs[count] = model.predict(images[:count], batch_size=32, verbose=0)
        assert outputs[count].shape == (count, 3)
        # Eager against compiled: a one-ulp difference before the bfloat16
        # dispatch moves a value by a bfloat16 step.
        np.testing.assert_allclose(outputs[count], expected[:count],
                                   atol=testing.BFLOAT16_DISPATCH_ATOL)
    assert len(traced) == 3  # 32, 8 and 16
    # The same compiled shape, a real image in place of a padding one: the
    # other images' outputs do not move.
    np.testing.assert_array_equal(outputs[38][:37], outputs[37])


@pytest.mark.heavy
@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX compiles per shape")
def test_predict_keeps_a_jointly_routed_batch_as_given():
    from tiny_configs import composition_model

    model = composition_model("soft")  # slots shared by the whole batch
    images = np.random.default_rng(2).uniform(-1, 1, (6, 16, 16, 3)).astype("float32")
    expected = keras.ops.convert_to_numpy(model(images))
    traced = _count_predict_traces(model)
    np.testing.assert_allclose(model.predict(images, verbose=0), expected, atol=1e-5)
    assert len(traced) == 1


def test_keras_file_keeps_the_requested_jit_compile_not_the_backends_choice(tmp_path):
    from tiny_configs import composition_model

    model = composition_model("sparse")
    assert model.get_compile_config()["jit_compile"] == "auto"
    assert model.jit_compile == (keras.backend.backend() == "jax")
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.get_compile_config()["jit_compile"] == "auto"
    assert loaded.jit_compile == model.jit_compile
    model.compile(jit_compile=False)
    assert model.get_compile_config()["jit_compile"] is False
    model.save(path)
    assert keras.saving.load_model(path).jit_compile is False
