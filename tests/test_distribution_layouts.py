"""Data, expert and expert+model parallel training on 8 virtual CPU devices."""

import re

import jax
import keras
import numpy as np
import pytest
import tiny_configs

from keras_vmoe import distribution
from keras_vmoe.models.image_classifier import ImageClassifier
from keras_vmoe.models.vit_backbone import VisionTransformerBackbone

pytestmark = pytest.mark.multi_device

# 8x8 images, 4x4 patches: 4 tokens; one image per token group, so a batch
# of 16 makes 16 groups that split over the 8 devices.
CONFIG = tiny_configs.expert_parallel_8px()
# The fit tests use one (MoE) block: compiling is most of their time.
FIT_CONFIG = dict(CONFIG, num_layers=1, moe_layers=(0,))
BATCH = 16
MESHES = {"data": {}, "expert": {"data": 2, "expert": 4},
          "expert_model": {"data": 2, "expert": 2, "model": 2},
          "pod": {"data": 2, "expert": 2, "model": 2}}


@pytest.fixture(autouse=True)
def _needs_8_devices():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (virtual) devices")
    yield
    keras.distribution.set_distribution(None)


def _data():
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, size=(2 * BATCH, 8, 8, 3)).astype("float32")
    return x, np.arange(2 * BATCH) % 3


def _build(layout=None, weights=None, config=FIT_CONFIG):
    if layout is not None:
        mesh = distribution.make_mesh(**MESHES[layout])
        keras.distribution.set_distribution(distribution.make_distribution(
            layout, mesh, config=config, batch_size=BATCH))
    keras.utils.set_random_seed(0)
    model = ImageClassifier(VisionTransformerBackbone(**config), num_classes=3,
                            compile=False)
    if weights is not None:
        model.set_weights(weights)
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _weight(model, suffix):
    return next(v for v in model.weights if v.path.endswith(suffix))


def _shard_shape(variable):
    return {s.data.shape for s in variable.value.addressable_shards}


@pytest.fixture(scope="module")
def reference():
    """Two fit steps on one device (no distribution)."""
    keras.distribution.set_distribution(None)
    model = _build()
    initial = model.get_weights()
    x, y = _data()
    losses = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False,
                       verbose=0).history["loss"]
    return initial, losses, model.get_weights()


# `data` and `expert_model` compile two more train steps (~1 min each on a
# loaded 2-core machine): slow. `expert` also checks the compiled HLO.
@pytest.mark.parametrize("layout", [
    pytest.param("data", marks=pytest.mark.slow),
    "expert",
    pytest.param("expert_model", marks=pytest.mark.slow),
])
@pytest.mark.heavy
def test_fit_matches_one_device(layout, reference):
    initial, expected_losses, expected_weights = reference
    model = _build(layout, weights=initial)
    x, y = _data()
    # Per-step losses: a callback records them batch by batch.
    losses = []
    callback = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: losses.append(logs["loss"]))
    history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                        callbacks=[callback])
    np.testing.assert_allclose(history.history["loss"], expected_losses, rtol=1e-5)
    for got, want in zip(model.get_weights(), expected_weights, strict=True):
        np.testing.assert_allclose(got, want, atol=2e-5)
    if layout == "expert":
        # The compiled step dispatches with all-to-all and never all-gathers
        # token tensors (G, S, ...) / (G, E, C, D).
        state = jax.tree.map(lambda v: v.value, (
            model.trainable_variables, model.non_trainable_variables,
            model.optimizer.variables, model.metrics_variables))
        dist = keras.distribution.distribution()
        xs = jax.device_put(x[:BATCH], dist.get_data_layout(x[:BATCH].shape).backend_layout)
        ys = jax.device_put(y[:BATCH], dist.get_data_layout(y[:BATCH].shape).backend_layout)
        hlo = jax.jit(model.train_step).lower(state, (xs, ys)).compile().as_text()
        assert re.search(r" all-to-all\(", hlo)
        gathers = [line for line in hlo.splitlines() if " all-gather(" in line]
        assert gathers == [], gathers


def test_variables_and_optimizer_slots_follow_the_layout():
    model = _build("pod", config=CONFIG)
    optimizer = model.optimizer
    optimizer.build(model.trainable_variables)
    e, d, m, h = 8, CONFIG["hidden_dim"], CONFIG["mlp_dim"], CONFIG["num_heads"]
    expected = {  # pod on data=2, expert=2, model=2
        "moe/experts/kernel_0": (e // 2, d // 2, m // 2),
        "moe/experts/kernel_1": (e // 2, m // 2, d // 2),
        "attention/query/kernel": (d // 2, h // 2, d // h),
        "attention/out/kernel": (h // 2, d // h, d // 2),
        "mlp/dense_0/kernel": (d // 2, m // 2),
        "moe/router/kernel": (d, e),  # replicated, as upstream
    }
    for suffix, shape in expected.items():
        variable = _weight(model, suffix)
        assert _shard_shape(variable) == {shape}, suffix
        index = optimizer._get_variable_index(variable)
        slots = [optimizer._momentums[index], optimizer._velocities[index]]
        for slot in slots:
            assert _shard_shape(slot) == {shape}, (suffix, slot.path)


def test_backbone_layout_map_and_preset_reload(tmp_path):
    from keras_vmoe.presets import from_preset
    from keras_vmoe.presets import save_to_preset

    mesh = distribution.make_mesh(data=2, expert=4)
    backbone_layout = VisionTransformerBackbone(**CONFIG).get_layout_map(mesh, "expert")
    assert backbone_layout["encoderblock_1/moe/experts/kernel_0"].axes == (
        "expert", None, None)
    model = _build("expert", config=CONFIG)
    assert _shard_shape(_weight(model, "experts/kernel_0")) == {(2, 16, 32)}
    expected = model.get_weights()
    save_to_preset(model, str(tmp_path / "preset"))
    keras.distribution.set_distribution(None)
    reloaded = from_preset(str(tmp_path / "preset"))
    kernel = _weight(reloaded, "experts/kernel_0")
    assert len(kernel.value.sharding.device_set) == 1
    for got, want in zip(reloaded.get_weights(), expected, strict=True):
        np.testing.assert_array_equal(got, want)


def test_indivisible_layouts_fail_clearly():
    with pytest.raises(ValueError, match=r"num_experts=8 is not divisible by the 'expert'"):
        distribution.check_divisible({"data": 1, "expert": 3, "model": 1}, "expert",
                                     config=CONFIG)
    with pytest.raises(ValueError, match=r"num_heads=2 is not divisible by the 'model'"):
        distribution.check_divisible({"data": 1, "expert": 2, "model": 4},
                                     "expert_model", config=CONFIG)
    with pytest.raises(ValueError, match=r"batch_size=12 is not divisible"):
        distribution.make_distribution("expert", distribution.make_mesh(data=2, expert=4),
                                       config=CONFIG, batch_size=12)
    one_group = dict(CONFIG, moe=dict(CONFIG["moe"], group_size=None))
    with pytest.raises(ValueError, match=r"makes 1 token group"):
        distribution.check_divisible({"data": 2, "expert": 4, "model": 1}, "expert",
                                     config=one_group, batch_size=16)
    with pytest.raises(ValueError, match="must use exactly the 8"):
        distribution.make_mesh(data=3, expert=2)
    assert keras.distribution.distribution() is None


@pytest.mark.parametrize("layout", ["expert", "pod"])
def test_padded_token_groups_match_one_device(layout):
    """3 images per group, so a batch of 16 makes 6 groups, the last
    one padded with 2 masked images; the sharded prediction (static shapes
    under jit) equals the single-device one."""
    config = dict(CONFIG, moe=dict(CONFIG["moe"], group_size=None, images_per_group=3,
                                   router={"num_selected_experts": 2, "noise_std": 0.0,
                                           "capacity_factor": 0.5}))
    keras.distribution.set_distribution(None)
    x, _ = _data()
    reference = _build(config=config)
    expected = np.asarray(reference.predict(x[:BATCH], batch_size=BATCH, verbose=0))
    model = _build(layout, weights=reference.get_weights(), config=config)
    got = np.asarray(model.predict(x[:BATCH], batch_size=BATCH, verbose=0))
    np.testing.assert_allclose(got, expected, atol=1e-5)
