"""keras_vmoe.models.task: a subclass passes the shared test base; then what
`Task` gives every task: `predict` padding of partial routing groups and
batches (as upstream, in buckets, under a distribution), the requested
`jit_compile` and changed (int8, LoRA) models kept in `.keras` files."""

import jax
import keras
import numpy as np
import pytest
import testing
import tiny_configs
from tiny_configs import composition_model

from keras_vmoe import distribution
from keras_vmoe.models import Task
from keras_vmoe.models.ensemble_classifier import EnsembleImageClassifier
from keras_vmoe.models.ensemble_classifier import ensemble_log_probabilities
from keras_vmoe.models.image_classifier import ImageClassifier
from keras_vmoe.models.task import classification_head
from keras_vmoe.models.task import images_input
from keras_vmoe.models.task import predict_bucket
from keras_vmoe.models.vit_backbone import VisionTransformerBackbone


@keras.saving.register_keras_serializable(package="keras_vmoe_tests")
class HeadOnTheFeatures(Task):
    """The smallest `Task` subclass the base documents: a classification
    head on the backbone's pooled features, and its own compile defaults."""

    def __init__(self, backbone, num_classes, preprocessor=None, compile=True, **kwargs):
        head = classification_head(backbone, num_classes)
        self.num_classes = num_classes
        images = images_input(backbone)
        super().__init__(backbone, preprocessor, inputs=images,
                         outputs=head(backbone(images)), compile=compile, **kwargs)

    def compile(self, optimizer="adam", loss=None, **kwargs):
        loss = loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        super().compile(optimizer=optimizer, loss=loss, **kwargs)

    def get_config(self):
        return {**super().get_config(), "num_classes": self.num_classes}


# A task compiles several models (jit, int8, LoRA, one fit step): the heavy
# group runs it.
@pytest.mark.heavy
def test_a_task_subclass_passes_the_shared_base():
    rng = np.random.default_rng(0)
    images = rng.uniform(-1, 1, size=(4, 16, 16, 3)).astype("float32")
    labels = np.array([0, 1, 2, 1], dtype="int32")
    backbone = VisionTransformerBackbone(**tiny_configs.vit(px=16))
    task = testing.run_task_test(HeadOnTheFeatures, {"backbone": backbone, "num_classes": 3},
                                 (images, labels), (4, 3))
    assert isinstance(task, Task)


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
    model = composition_model("soft")  # slots shared by the whole batch
    images = np.random.default_rng(2).uniform(-1, 1, (6, 16, 16, 3)).astype("float32")
    expected = keras.ops.convert_to_numpy(model(images))
    traced = _count_predict_traces(model)
    np.testing.assert_allclose(model.predict(images, verbose=0), expected, atol=1e-5)
    assert len(traced) == 1


# One token group per image (4 tokens), 8 experts split over the devices.
EXPERT_PARALLEL = tiny_configs.expert_parallel_8px(num_layers=1, moe_layers=(0,))


@pytest.fixture
def eight_devices():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (virtual) devices")
    yield
    keras.distribution.set_distribution(None)


def _expert_parallel_model(weights=None):
    keras.utils.set_random_seed(0)
    model = ImageClassifier(VisionTransformerBackbone(**EXPERT_PARALLEL), num_classes=3,
                            compile=False)
    if weights is not None:
        model.set_weights(weights)
    return model


@pytest.mark.heavy
@pytest.mark.multi_device
@pytest.mark.usefixtures("eight_devices")
def test_predict_pads_the_partial_last_batch_under_the_expert_layout():
    # 20 images in batches of 16 on 8 devices.
    x = np.random.default_rng(0).uniform(-1, 1, size=(20, 8, 8, 3)).astype("float32")
    reference = _expert_parallel_model()
    expected = reference.predict(x, batch_size=20, verbose=0)  # one compile
    mesh = distribution.make_mesh(data=2, expert=4)
    keras.distribution.set_distribution(distribution.make_distribution(
        "expert", mesh, config=EXPERT_PARALLEL, batch_size=16))
    model = _expert_parallel_model(reference.get_weights())
    actual = model.predict(x, batch_size=16, verbose=0)
    assert actual.shape == (20, 3)
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5)


def test_keras_file_keeps_the_requested_jit_compile_not_the_backends_choice(tmp_path):
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
    model = composition_model("sparse")
    model.quantize("int8")
    loaded = _check_keras_file_round_trip(model, tmp_path)
    assert loaded.get_config() == model.get_config()
    int8 = sorted(v.path for v in loaded.weights if str(v.dtype) == "int8")
    assert int8 == sorted(v.path for v in model.weights if str(v.dtype) == "int8")
    assert any("experts" in path for path in int8)


@pytest.mark.heavy
@pytest.mark.parametrize("form", sorted(_SAVED_FORMS))
@pytest.mark.parametrize("kind", ["sparse", "soft", "ensemble"])
def test_changed_models_survive_keras_file(kind, form, tmp_path):
    _check_keras_file_round_trip(_SAVED_FORMS[form](composition_model(kind)), tmp_path)


def test_quantized_layers_record_is_checked():
    config = composition_model("sparse").get_config()
    with pytest.raises(ValueError, match="quantized_layers.*int4"):
        ImageClassifier.from_config({**config, "quantized_layers": {"head": "int4"}})
    with pytest.raises(ValueError, match="does not have.*nowhere"):
        ImageClassifier.from_config({**config, "quantized_layers": {"nowhere": "int8"}})


@pytest.mark.parametrize("task_class", [ImageClassifier, EnsembleImageClassifier])
def test_unknown_task_arguments_are_refused(task_class):
    backbone = VisionTransformerBackbone(**tiny_configs.vit(px=16, num_layers=1))
    with pytest.raises(TypeError, match=r"\['num_class'\].*Valid arguments:.*'num_classes'"):
        task_class(backbone, num_class=5)
    config = task_class(backbone, num_classes=2, compile=False).get_config()
    with pytest.raises(TypeError, match="bogus_argument"):
        task_class.from_config({**config, "bogus_argument": 1})


@pytest.mark.parametrize("batch_size", [0, -1, True, 2.5, "4"])
def test_predict_fit_and_evaluate_refuse_a_bad_batch_size(batch_size):
    backbone = VisionTransformerBackbone(**tiny_configs.vit(px=16, num_layers=1))
    model = ImageClassifier(backbone, num_classes=2)
    images = np.zeros((2, 16, 16, 3), "float32")
    with pytest.raises(ValueError, match=f"batch_size.*Received: batch_size={batch_size!r}"):
        model.predict(images, batch_size=batch_size, verbose=0)
    with pytest.raises(ValueError, match="batch_size"):
        model.fit(images, np.zeros(2), batch_size, verbose=0)
    with pytest.raises(ValueError, match="batch_size"):
        model.evaluate(images, np.zeros(2), batch_size=batch_size, verbose=0)


def test_an_empty_list_of_images_is_refused():
    backbone = VisionTransformerBackbone(**tiny_configs.vit(px=16, num_layers=1))
    model = ImageClassifier(backbone, num_classes=2)
    with pytest.raises(ValueError, match="received no images: x is an empty list"):
        model.predict([], verbose=0)
def _load_quietly(path):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = keras.saving.load_model(path)
    assert not [str(w.message) for w in caught if "optimizer" in str(w.message)]
    return loaded


def _saved_task(path):
    keras.utils.set_random_seed(0)
    model = ImageClassifier(VisionTransformerBackbone(**tiny_configs.vmoe_8px_micro()),
                            num_classes=3)
    model.save(path)
    return model


def test_a_keras_file_of_a_model_never_trained_loads_without_an_optimizer_warning(
        tmp_path):
    path = str(tmp_path / "model.keras")
    model = _saved_task(path)  # compiled, never trained: no optimizer slots
    loaded = _load_quietly(path)
    images = np.random.default_rng(0).uniform(-1, 1, (4, 8, 8, 3)).astype("float32")
    np.testing.assert_array_equal(loaded.predict_on_batch(images),
                                  model.predict_on_batch(images))
    assert not loaded.optimizer.built and int(loaded.optimizer.iterations) == 0


@pytest.mark.heavy
def test_a_keras_file_of_a_trained_model_restores_its_optimizer_without_a_warning(
        tmp_path):
    path = str(tmp_path / "model.keras")
    model = _saved_task(path)
    images = np.random.default_rng(0).uniform(-1, 1, (4, 8, 8, 3)).astype("float32")
    model.fit(images, np.array([0, 1, 2, 0]), epochs=1, verbose=0)
    model.save(path)
    loaded = _load_quietly(path)
    assert loaded.optimizer.built and int(loaded.optimizer.iterations) == 1
    for saved, restored in zip(model.optimizer.variables, loaded.optimizer.variables,
                               strict=True):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(saved),
                                      keras.ops.convert_to_numpy(restored))
    np.testing.assert_array_equal(loaded.predict_on_batch(images),
                                  model.predict_on_batch(images))
