"""Features used together: presets, LoRA, int8, upcycling, recipes, resume, export.

Each test takes one pair of features through tiny models (`composition_model`
in tests/tiny_configs.py) and checks what must hold for the pair: which
weights train, which routing applies in each phase, logits parity
(tolerances stated per test), that saved files load back, and that a pair
the library does not support is refused at the first call with a clear
error. Kinds: V (V-MoE, Token Choice), S (Soft MoE), E (E³, 2 members).

| pair                                   | kinds | what holds                                   |
| -------------------------------------- | ----- | -------------------------------------------- |
| LoRA x int8 preset                     | V S E | only the float factors train                 |
| LoRA x save_to_preset / reload         | V S E | merged kernels; the adapter loads back       |
| int8 x preset reload and overrides     | V S E | exact reload; a new head stays float         |
| upcycle x LoRA x int8                  | V S   | small int8 error; only the factors train     |
| finetune(recipe) x LoRA                | V E   | factors and head train; each phase's routing |
| finetune(recipe) x int8                | V     | refused without LoRA; QLoRA-style with it    |
| save_to_preset / reload x finetune     | V E   | both phases' routing and the logits kept     |
| stop-and-resume x LoRA                 | V E   | resumed run equals the uninterrupted one     |
| export (SavedModel, ONNX) x LoRA       | V E   | the Keras logits                             |
| export (SavedModel, ONNX) x int8       | V S   | the Keras logits                             |

Every LoRA pair meets both entry points: LoRA enabled on the task
(`model.enable_lora`) and on the backbone it wraps
(`model.backbone.enable_lora`, KerasHub's call). The entry point is paired
with the kind (`LORA_ON`), so each pair runs each kind once and still sees
both entry points (a pairwise design, not the full product).

Soft MoE routing is fixed (recipes leave it), so the recipe pairs use V and
E. The torch and tensorflow backends against JAX with LoRA and int8 models
(V S E) are in tests/backends/test_lora_int8.py (marker `backends`: that
group has torch installed).

Markers: `heavy` (model builds and train steps; .ci/run runs the group) and,
for the export pairs, `export` instead (they need the converters of the
`export` extra; the export group runs them).
"""

import dataclasses
import os
import signal

import keras
import numpy as np
import pytest
from tiny_configs import VIT_16PX
from tiny_configs import composition_model

import keras_vmoe
from keras_vmoe import training
from keras_vmoe.deploy.quantize import quantized_layers
from keras_vmoe.models import ImageClassifier
from keras_vmoe.models import VisionTransformerBackbone
from keras_vmoe.models import lora

heavy = pytest.mark.heavy

TINY = VIT_16PX
KINDS = ("sparse", "soft", "ensemble")
# Where LoRA is enabled (on the task, or on the backbone it wraps), paired
# with the kind: every pair over (V, S, E), (V, S) or (V, E) sees both.
LORA_ON = {"sparse": "backbone", "soft": "task", "ensemble": "task"}
_model = composition_model


def _enable_lora(model, lora_on, rank=2, **kwargs):
    """`enable_lora` on the task or on its backbone; returns the task."""
    (model if lora_on == "task" else model.backbone).enable_lora(rank, **kwargs)
    return model


def _backbone_trainable(model):
    """Paths of the backbone's trainable weights (the head left out)."""
    return {v.path for v in model.backbone.trainable_weights}


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


@heavy
def test_lora_over_int8_preset_trains_only_the_float_factors(presets_of, images, labels):
    kind, _, int8_path = presets_of
    model = _enable_lora(keras_vmoe.presets.from_preset(int8_path), LORA_ON[kind],
                         experts=True)
    factors = {v.path for v in model.weights if "lora_kernel" in v.path}
    assert _backbone_trainable(model) == factors
    # The int8 head stays frozen wherever LoRA was enabled (finetune's rule).
    lora.set_lora_trainable(model)
    trainable = {v.path for v in model.trainable_weights}
    assert trainable == factors
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


@heavy
def test_lora_save_to_preset_reloads_the_merged_model(presets_of, images, labels, tmp_path):
    kind, float_path, _ = presets_of
    model = _enable_lora(keras_vmoe.presets.from_preset(float_path), LORA_ON[kind],
                         targets=("query", "value", "out"), experts=True)
    rng = np.random.default_rng(5)
    for v in model.weights:
        if "lora_kernel" in v.path:
            v.assign((0.2 * rng.standard_normal(v.shape)).astype("float32"))
    expected = np.asarray(model.predict_on_batch(images))
    adapter = model.save_lora_weights(str(tmp_path / "adapter"))
    merged = keras_vmoe.presets.from_preset(
        keras_vmoe.presets.save_to_preset(model, tmp_path / "merged"))
    assert lora.lora_config(merged) is None
    assert lora.lora_config(merged.backbone) is None
    # Merged kernels vs factors applied at call time: float32 rounding only.
    np.testing.assert_allclose(merged.predict_on_batch(images), expected, atol=1e-5)
    applied = keras_vmoe.presets.from_preset(float_path)
    applied.load_lora_weights(adapter)
    assert lora.lora_config(applied) == lora.lora_config(model)
    np.testing.assert_allclose(applied.predict_on_batch(images), expected, atol=1e-6)


@heavy
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


@heavy
@pytest.mark.parametrize("moe_type", ["sparse", "soft"])
def test_upcycled_model_takes_lora_and_int8(dense_classifier, images, labels, moe_type):
    from keras_vmoe.presets.upcycling import upcycle

    model = upcycle(dense_classifier, num_experts=4, moe_layers=(1,), moe_type=moe_type)
    before = np.asarray(model.predict_on_batch(images))
    model.quantize("int8")
    quantized = np.asarray(model.predict_on_batch(images))
    # int8 error stays small against the logits' scale.
    assert np.abs(quantized - before).max() < 0.1 * np.abs(before).max() + 1e-3
    _enable_lora(model, LORA_ON[moe_type], experts=True)
    lora.set_lora_trainable(model)
    assert all("lora_kernel" in v.path for v in model.trainable_weights)
    frozen = {p: v for p, v in _values(model).items() if "lora_kernel" not in p}
    _train_step(model, images, labels)
    after = _values(model)
    for path, value in frozen.items():
        np.testing.assert_array_equal(after[path], value, path)


# --- finetune with a recipe ---------------------------------------------------

@pytest.fixture(scope="module")
def images12():
    return np.random.default_rng(2).uniform(-1, 1, (12, 16, 16, 3)).astype("float32")


@pytest.fixture(scope="module")
def labels12():
    return np.array([0, 1, 2] * 4, "int32")


def _dataset(images, labels):
    """Batches of 4, in order (a finite `tf.data` pipeline resumes exactly)."""
    tf = pytest.importorskip("tensorflow")
    return tf.data.Dataset.from_tensor_slices((images, labels)).batch(4)


def _recipe(train_capacity_factor, eval_capacity_factor):
    """vmoe_ft_cifar10 at a learning rate that moves the tiny models, with
    the given capacity factors; the models keep their routing groups."""
    return dataclasses.replace(
        training.get_recipe("vmoe_ft_cifar10"), learning_rate=0.05,
        train_capacity_factor=train_capacity_factor,
        eval_capacity_factor=eval_capacity_factor, images_per_group=None)


def _eval_capacity_factor(model):
    layer = model.backbone.get_moe_layers()[0]
    return layer.eval_routing.get("capacity_factor", layer.capacity_factor)


def _phase_capacities(model, images):
    """`(training, evaluation)` capacity the MoE block routes `images` with."""
    backbone = model.backbone
    block = f"encoderblock_{backbone.moe_layers[0]}"
    return tuple(backbone.routing_metrics(images, training=phase)[block]["capacity"]
                 for phase in (True, False))


def _capacity_at(model, images, capacity_factor):
    """The capacity the model's router gives `images` at `capacity_factor`
    (its own capacity rule, on the group the MoE block forms)."""
    backbone = model.backbone
    layer = backbone.get_moe_layers()[0]
    members = getattr(layer, "num_partitions", 1)  # E³ groups hold the N copies
    group = layer.resolved_group_size(len(images), backbone.num_tokens * members)
    router = layer.router
    probe = type(router).from_config({**router.get_config(),
                                      "capacity_factor": capacity_factor})
    return int(probe.get_capacity(group))


def _assert_recipe_routing(model, images, recipe, eval_capacity_factor):
    train_capacity, eval_capacity = _phase_capacities(model, images)
    assert train_capacity == _capacity_at(model, images, recipe.train_capacity_factor)
    assert eval_capacity == _capacity_at(model, images, eval_capacity_factor)
    assert train_capacity != eval_capacity  # the two phases are told apart


@pytest.fixture(scope="module", params=["sparse", "ensemble"])
def lora_finetuned(request, images12, labels12):
    """A LoRA model fine-tuned one epoch (3 steps) with a recipe.

    V-MoE: the recipe trains at capacity factor 1.0 and evaluates at 4.0
    (the model had 2.0). E³: it trains at 1.0 and has no evaluation
    factor, so the model's 1.5 stays for evaluation.

    Returns `(model, weights before, recipe, evaluation capacity factor)`.
    """
    kind = request.param
    model = _model(kind)
    recipe = _recipe(1.0, 4.0 if kind == "sparse" else None)
    eval_factor = recipe.eval_capacity_factor or _eval_capacity_factor(model)
    _enable_lora(model, LORA_ON[kind], experts=True)
    before = _values(model)
    training.finetune(model, _dataset(images12, labels12), epochs=1, recipe=recipe,
                      verbose=0)
    return model, before, recipe, eval_factor


@heavy
def test_finetune_recipe_under_lora_trains_factors_and_head_and_routes_each_phase(
        lora_finetuned, images):
    model, before, recipe, eval_factor = lora_finetuned
    after = _values(model)
    factors = {p for p in after if "lora_kernel" in p}
    head = {p for p in after if p.startswith("head/")}
    assert factors and head
    assert {v.path for v in model.trainable_weights} == factors | head
    for path, value in before.items():
        if path not in factors | head:
            np.testing.assert_array_equal(after[path], value, path)
    assert any(np.abs(after[p]).max() > 0 for p in factors if p.endswith("b"))
    assert any(not np.array_equal(after[p], before[p]) for p in head)
    assert isinstance(model.optimizer, training.UpstreamSGD)
    _assert_recipe_routing(model, images, recipe, eval_factor)


@heavy
def test_preset_of_a_recipe_finetuned_model_keeps_both_phases(lora_finetuned, images,
                                                              tmp_path):
    model, _, recipe, eval_factor = lora_finetuned
    loaded = keras_vmoe.presets.from_preset(
        keras_vmoe.presets.save_to_preset(model, tmp_path / "tuned"))
    assert lora.lora_config(loaded) is None  # the factors are merged
    layer = loaded.backbone.get_moe_layers()[0]
    assert layer.capacity_factor == recipe.train_capacity_factor
    assert _eval_capacity_factor(loaded) == eval_factor
    _assert_recipe_routing(loaded, images, recipe, eval_factor)
    # Merged kernels vs factors applied at call time: float32 rounding only.
    np.testing.assert_allclose(loaded.predict_on_batch(images),
                               model.predict_on_batch(images), atol=1e-5)


@heavy
def test_finetune_recipe_on_int8_needs_lora_and_keeps_the_int8_kernels(
        images12, labels12, images):
    model = _model("sparse")
    model.quantize("int8")
    layer = model.backbone.get_moe_layers()[0]
    routing = (layer.capacity_factor, layer.eval_routing)
    recipe = _recipe(1.0, 4.0)
    data = _dataset(images12, labels12)
    with pytest.raises(ValueError, match=r"quantized \(int8: \d+ of its layers.*"
                                         r"model\.enable_lora\(rank\)"):
        training.finetune(model, data, epochs=1, recipe=recipe, verbose=0)
    with pytest.raises(ValueError, match=r"quantized \(int8: its head\).*cannot train"):
        training.finetune(model, data, epochs=1, recipe=recipe, freeze_backbone=True,
                          verbose=0)
    # Refused before anything changed: routing as it was, no recipe optimizer.
    assert (layer.capacity_factor, layer.eval_routing) == routing
    assert not isinstance(getattr(model, "optimizer", None), training.UpstreamSGD)

    # QLoRA-style: float factors over the frozen int8 kernels.
    _enable_lora(model, LORA_ON["sparse"], experts=True)
    before = _values(model)
    training.finetune(model, data, epochs=1, recipe=recipe, verbose=0)
    after = _values(model)
    factors = {p for p in after if "lora_kernel" in p}
    assert {v.path for v in model.trainable_weights} == factors  # int8 head: frozen
    for path, value in before.items():
        if path not in factors:
            np.testing.assert_array_equal(after[path], value, path)
    assert any(np.abs(after[p]).max() > 0 for p in factors if p.endswith("b"))
    assert set(quantized_layers(model)) and "head" in quantized_layers(model)
    _assert_recipe_routing(model, images, recipe, 4.0)


def test_each_lora_pair_meets_both_entry_points():
    for kinds in (KINDS, ("sparse", "soft"), ("sparse", "ensemble")):
        assert {LORA_ON[kind] for kind in kinds} == {"task", "backbone"}, kinds
    assert {feature for feature, _ in EXPORT_CASES} >= {"lora", "backbone_lora"}


# --- stop and resume ------------------------------------------------------------

class _CtrlC(keras.callbacks.Callback):
    """Sends this process SIGINT (as Ctrl-C would) after global step `step`.

    `finetune`'s run control turns the signal into a stop after the next
    step, with the state saved, and raises `TrainingInterrupted`.
    """

    def __init__(self, step):
        super().__init__()
        self.step, self.seen = step, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.step:
            from keras_vmoe.training.run_control import StopSignals

            # Only into the run control's handler (never pytest's own).
            handler = signal.getsignal(signal.SIGINT)
            assert isinstance(getattr(handler, "__self__", None), StopSignals), handler
            os.kill(os.getpid(), signal.SIGINT)


@heavy
@pytest.mark.parametrize("kind", ["sparse", "ensemble"])
def test_lora_run_stopped_and_resumed_equals_the_uninterrupted_run(
        kind, images12, labels12, tmp_path):
    def run(**kwargs):
        model = _enable_lora(_model(kind, seed=1), LORA_ON[kind], experts=True)
        history = training.finetune(model, _dataset(images12, labels12), epochs=2,
                                    learning_rate=0.05, verbose=0, **kwargs)
        return model, history

    reference, _ = run()
    checkpoint_dir = str(tmp_path / "ckpt")
    # 3 steps per epoch: SIGINT after global step 4 stops after step 5,
    # part-way through the second epoch (past one epoch-end checkpoint).
    with pytest.raises(training.TrainingInterrupted):
        run(checkpoint_dir=checkpoint_dir, callbacks=[_CtrlC(4)])
    resumed, history = run(checkpoint_dir=checkpoint_dir)
    assert history.resumed_from == {"epoch": 1, "step": 2, "global_step": 5}
    assert lora.lora_config(resumed) == lora.lora_config(reference)
    # Same programs on the same machine: bit for bit.
    for want, got in zip(reference.weights, resumed.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), want.path)
    assert any("lora_kernel" in v.path and v.path.endswith("b")
               and np.abs(np.asarray(v)).max() > 0 for v in resumed.weights)


# --- export -----------------------------------------------------------------------

# `(feature, kind)` of the exported models. int8 V-MoE to ONNX is also in
# tests/deploy/test_export.py (the command-line model).
EXPORT_CASES = (("lora", "ensemble"), ("backbone_lora", "sparse"), ("int8", "sparse"),
                ("int8", "soft"))
# bfloat16 dispatch (E³, Soft MoE): a 1-ulp difference before a bf16
# rounding moves a value by one bf16 step (the bound of
# tests/deploy/test_export_parity.py); float32 dispatch: 1e-5.
EXPORT_BOUNDS = {"sparse": 1e-5, "soft": 1e-3, "ensemble": 1e-3}


@pytest.fixture(scope="module")
def exportable():
    """`get(feature, kind)`: a cached `(model, images, Keras logits)`."""
    cache = {}

    def get(feature, kind):
        if (feature, kind) not in cache:
            model = _model(kind)
            if feature in ("lora", "backbone_lora"):
                _enable_lora(model, "task" if feature == "lora" else "backbone",
                             targets=("query", "value", "out"), experts=True)
                rng = np.random.default_rng(5)  # B starts at zero: give it values
                for v in model.weights:
                    if "lora_kernel" in v.path:
                        v.assign((0.2 * rng.standard_normal(v.shape)).astype("float32"))
            else:
                model.quantize("int8")
            x = np.random.default_rng(1).uniform(-1, 1, (4, 16, 16, 3)).astype("float32")
            cache[feature, kind] = model, x, np.asarray(model.predict_on_batch(x))
        return cache[feature, kind]

    return get


def _check_export(kind, fmt, actual, expected):
    diff = float(np.max(np.abs(actual - expected)))
    assert actual.shape == expected.shape
    assert diff <= EXPORT_BOUNDS[kind], f"{kind} {fmt}: max abs diff {diff:.3g}"


@pytest.mark.export
@pytest.mark.parametrize("feature,kind", EXPORT_CASES)
def test_saved_model_export_gives_the_keras_logits(exportable, feature, kind, tmp_path):
    tf = pytest.importorskip("tensorflow")
    from keras_vmoe.deploy import export_model

    model, x, expected = exportable(feature, kind)
    # A static batch keeps the model's routing groups (all the tokens of a call).
    export_model(model, tmp_path / "sm", "tf_saved_model", batch_size=len(x),
                 image_bytes=False)
    served = tf.saved_model.load(str(tmp_path / "sm"))
    _check_export(kind, "tf_saved_model", served.serve(x).numpy(), expected)


@pytest.mark.export
@pytest.mark.parametrize("feature,kind", EXPORT_CASES)
def test_onnx_export_gives_the_keras_logits(exportable, feature, kind, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("jax2onnx")
    from keras_vmoe.deploy import export_model

    model, x, expected = exportable(feature, kind)
    path = export_model(model, tmp_path / "m.onnx", "onnx", batch_size=len(x))
    session = ort.InferenceSession(str(path))
    actual = session.run(None, {session.get_inputs()[0].name: x})[0]
    _check_export(kind, "onnx", actual, expected)
