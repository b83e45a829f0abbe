"""Routing groups, padding of partial groups and train/eval routing.

Upstream routes groups of 8 images (V-MoE configs, "min batch per device
8"; E³ fine-tuning 128 images x 2 members). A call whose tokens are not a
whole number of groups is padded with masked tokens that must take no
capacity and count in no auxiliary loss, so an image's output depends only
on the images of its own group.
"""

import jax
import keras
import numpy as np
import pytest
import tiny_configs
from keras import ops

from keras_vmoe.layers import MoeLayer
from keras_vmoe.layers import PartitionedMoE
from keras_vmoe.layers import SoftMoE
from keras_vmoe.layers import SoftRouter
from keras_vmoe.layers import TokenChoiceRouter
from keras_vmoe.layers import losses
from keras_vmoe.layers import tile_for_ensemble

TOKENS, HIDDEN = 5, 8


def _images(batch, seed=0):
    return np.random.default_rng(seed).normal(size=(batch, TOKENS, HIDDEN)).astype(
        "float32"
    )


def _jit(layer, **call_kwargs):
    """`x -> layer(x)` compiled with `jax.jit` (the batch is static, as under
    `predict`)."""
    variables = list(layer.variables)
    values = [v.value for v in variables]

    def run(values, x):
        mapping = list(zip(variables, values, strict=True))
        with keras.StatelessScope(state_mapping=mapping):
            return layer(x, **call_kwargs)

    compiled = jax.jit(run)
    return lambda x: np.asarray(compiled(values, x))


@pytest.mark.parametrize("router", [
    {"name": "token_choice", "num_selected_experts": 2, "capacity_factor": 0.5},
    {"name": "expert_choice", "capacity_factor": 0.5},
], ids=["token_choice", "expert_choice"])
@pytest.mark.heavy
def test_images_per_group_one_makes_outputs_independent_of_the_batch(router):
    layer = MoeLayer(4, 16, router=router, images_per_group=1, identical_init=False)
    x = _images(64)
    layer(x[:1])
    run = _jit(layer)
    full = run(x)
    for batch in (1, 7, 8):
        np.testing.assert_allclose(run(x[:batch]), full[:batch], rtol=0, atol=1e-5)
    # One group of the whole call (the old default) does depend on the batch.
    layer.images_per_group = None
    assert np.abs(_jit(layer)(x[:8]) - _jit(layer)(x)[:8]).max() > 1e-3


@pytest.mark.parametrize("router", [
    {"name": "token_choice", "num_selected_experts": 2, "batch_priority": True},
    {"name": "expert_choice"},
], ids=["token_choice_bpr", "expert_choice"])
@pytest.mark.heavy
def test_padding_takes_no_capacity_and_no_auxiliary_loss(router):
    """Batch 6 with 4 images per group: the last group holds 2 images and 2
    padding images. Its routing must equal that of a group made of the 2
    images alone with the same number of slots per expert."""
    padded = MoeLayer(4, 16, router=dict(router, capacity_factor=0.5),
                      images_per_group=4, identical_init=False)
    x = _images(6, seed=1)
    y, routing = padded(x, return_routing=True)
    capacity = routing.capacity  # from the full group of 4 images (S = 20)
    assert capacity == padded.router.get_capacity(4 * TOKENS)
    alone = MoeLayer(4, 16, router=dict(router, capacity=capacity),
                     group_size=2 * TOKENS, identical_init=False)
    alone(x[4:])
    alone.set_weights(padded.get_weights())
    y_alone, routing_alone = alone(x[4:], return_routing=True)
    np.testing.assert_allclose(np.asarray(y)[4:], np.asarray(y_alone), atol=1e-6)
    for name, value in routing.auxiliary_losses.items():
        np.testing.assert_allclose(
            np.asarray(value)[1], np.asarray(routing_alone.auxiliary_losses[name])[0],
            rtol=1e-5, err_msg=name,
        )
    metrics = padded.routing_metrics(routing)
    assert float(metrics["experts_per_token_min"]) >= 0.0
    # Padding never occupies a slot.
    filled = np.asarray(routing.buffer_token)[1]  # (E, C), S marks empty
    assert (filled[filled < 4 * TOKENS] < 2 * TOKENS).all()


def test_masked_losses_equal_the_losses_of_the_real_tokens():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(2, 6, 4)).astype("float32")
    noisy = logits + rng.normal(size=logits.shape).astype("float32") / 4
    gates = np.asarray(ops.softmax(logits, axis=-1))
    mask = np.array([[True] * 6, [True] * 4 + [False] * 2])
    for name, fn, args in [
        ("importance", losses.importance_loss, (gates,)),
        ("gshard", losses.gshard_loss, (gates,)),
        ("load", lambda *a, mask=None: losses.load_loss(*a, 0.25, 2, mask=mask),
         (logits, noisy)),
    ]:
        masked = np.asarray(fn(*args, mask=mask))
        real = np.asarray(fn(*(a[1:, :4] for a in args)))
        np.testing.assert_allclose(masked[1], real[0], rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(masked[0], np.asarray(fn(*args))[0], rtol=1e-6)


@pytest.mark.heavy
def test_partitioned_moe_pads_whole_images_with_their_copies():
    layer = PartitionedMoE(4, 16, num_partitions=2, images_per_group=1,
                           router={"capacity_factor": 0.5}, identical_init=False)
    x = tile_for_ensemble(ops.convert_to_tensor(_images(3, seed=3)), 2)  # (6, T, D)
    layer(x)
    run = _jit(layer)
    full = run(x)
    np.testing.assert_allclose(run(x[:2]), full[:2], atol=1e-5)
    layer.images_per_group = 2  # 3 images: one full group, one padded
    y = _jit(layer)(x)
    assert y.shape == tuple(x.shape) and np.isfinite(y).all()


def test_grouping_settings_are_exclusive_and_serialized():
    layer = MoeLayer(4, 16, images_per_group=8,
                     eval_routing={"capacity_factor": 4.0})
    config = layer.get_config()
    assert config["images_per_group"] == 8 and config["group_size"] is None
    assert config["eval_routing"] == {"capacity_factor": 4.0}
    clone = MoeLayer.from_config(config)
    assert clone.images_per_group == 8 and clone.eval_routing == {"capacity_factor": 4.0}
    layer.group_size = 40
    assert layer.images_per_group is None
    with pytest.raises(ValueError, match="at most one"):
        MoeLayer(4, 16, group_size=8, images_per_group=2)
    with pytest.raises(ValueError, match="eval_routing"):
        MoeLayer(4, 16, eval_routing={"noise_std": 0.0})
    with pytest.raises(ValueError, match="capacity_factor"):
        MoeLayer(4, 16, eval_routing={"capacity_factor": -1})


@keras.saving.register_keras_serializable(package="keras_vmoe_tests")
class _RecordingRouter(TokenChoiceRouter):
    """Records the (training, capacity factor) of every trace."""

    def route(self, x, training=False, token_mask=None):
        self.traces.append((bool(training), self.capacity_factor))
        return super().route(x, training=training, token_mask=token_mask)


@pytest.mark.heavy
def test_fit_routes_with_the_training_routing_evaluate_and_predict_with_eval():
    router = _RecordingRouter(4, num_selected_experts=2, capacity_factor=1.5,
                              name="router")
    router.traces = []
    inputs = keras.Input((TOKENS, HIDDEN))
    moe = MoeLayer(4, 16, router=router, images_per_group=2,
                   eval_routing={"capacity_factor": 4.0})
    outputs = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(moe(inputs)))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    x, y = _images(4), np.array([0, 1, 2, 0])
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    # The train step routes at 1.5 (Keras may also build the model once in
    # inference mode, which routes at 4.0).
    assert {cf for training, cf in router.traces if training} == {1.5}
    assert {cf for training, cf in router.traces if not training} <= {4.0}
    router.traces.clear()
    model.evaluate(x, y, batch_size=4, verbose=0)
    model.predict(x, batch_size=4, verbose=0)
    assert set(router.traces) == {(False, 4.0)}
    assert router.capacity_factor == 1.5  # restored after every trace


def test_set_routing_phases():
    layer = MoeLayer(4, 16, router={"capacity_factor": 1.5}, images_per_group=8)
    layer.set_routing(phase="eval", capacity_factor=4.0)
    assert (layer.capacity_factor, layer.eval_routing) == (1.5, {"capacity_factor": 4.0})
    layer.set_routing(phase="train", capacity_factor=1.05)
    assert (layer.capacity_factor, layer.eval_routing) == (1.05, {"capacity_factor": 4.0})
    layer.set_routing(phase="train", images_per_group=2)  # eval keeps 8 images
    assert layer.images_per_group == 2
    assert layer.eval_routing["images_per_group"] == 8
    layer.set_routing(capacity_factor=2.0, images_per_group=4)  # both phases
    assert (layer.capacity_factor, layer.images_per_group) == (2.0, 4)
    assert layer.eval_routing == {}
    with pytest.raises(ValueError, match="phase"):
        layer.set_routing(phase="test", capacity_factor=1.0)


def test_routing_phase_is_the_training_routing_plus_the_eval_overrides():
    layer = MoeLayer(4, 16, router={"num_selected_experts": 2, "capacity_factor": 1.5},
                     group_size=10, eval_routing={"capacity_factor": 4.0,
                                                  "images_per_group": 2})
    train, evaluation = layer.routing_phase(True), layer.routing_phase(False)
    assert (train.capacity_factor, train.group_size, train.images_per_group) == (1.5, 10, None)
    assert (evaluation.capacity_factor, evaluation.group_size,
            evaluation.images_per_group) == (4.0, None, 2)
    assert evaluation.num_selected_experts == train.num_selected_experts == 2
    assert train == layer.train_routing


def test_set_routing_changes_nothing_when_a_setting_is_refused():
    layer = MoeLayer(4, 16, router={"num_selected_experts": 2, "capacity_factor": 1.5},
                     eval_routing={"capacity_factor": 4.0})
    before = (layer.train_routing, layer.eval_routing)
    with pytest.raises(ValueError, match="num_selected_experts=9"):
        layer.set_routing(capacity_factor=2.0, num_selected_experts=9)
    with pytest.raises(ValueError, match="Unknown routing settings"):
        layer.set_routing(phase="eval", capacity_factor=2.0, noise_std=0.0)
    assert (layer.train_routing, layer.eval_routing) == before


def test_settings_a_router_has_not_are_refused_in_every_phase():
    layer = MoeLayer(4, 16, router={"name": "expert_choice", "capacity_factor": 1.0})
    assert layer.num_selected_experts is None
    with pytest.raises(ValueError, match="no `num_selected_experts` setting"):
        layer.num_selected_experts = 2
    with pytest.raises(ValueError, match=r"no `batch_priority` setting \(eval_routing\)"):
        layer.eval_routing = {"batch_priority": True}
    with pytest.raises(ValueError, match="no `batch_priority` setting"):
        layer.set_routing(phase="eval", batch_priority=True)


def test_partitioned_groups_hold_every_member_in_both_phases():
    layer = PartitionedMoE(4, 16, num_partitions=2, router={"num_selected_experts": 1})
    with pytest.raises(ValueError, match="divisible by num_partitions=2.*group_size=5"):
        layer.group_size = 5
    with pytest.raises(ValueError, match=r"eval_routing.*divisible.*group_size=5"):
        layer.eval_routing = {"group_size": 5}
    with pytest.raises(ValueError, match="divisible by num_partitions=2"):
        PartitionedMoE(4, 16, num_partitions=2, group_size=5)
    layer.set_routing(group_size=6)
    assert layer.group_size == 6


def test_soft_moe_routing_is_fixed():
    layer = SoftMoE(4, 16, num_slots=1)
    assert layer.routing_phase(False) == layer.routing_phase(True)
    assert (layer.group_size, layer.images_per_group) == (None, 1)
    with pytest.raises(ValueError, match="fixed routing"):
        layer.set_routing(images_per_group=2)
    with pytest.raises(ValueError, match="fixed routing"):
        layer.set_routing(phase="eval", images_per_group=2)
    with pytest.raises(ValueError, match="fixed routing"):
        layer.eval_routing = {"images_per_group": 2}


def test_soft_moe_dispatches_in_bfloat16_by_default_as_upstream():
    # upstream vmoe/projects/soft_moe/router.py: the dispatcher is always
    # wrapped in `Bfloat16Dispatcher`.
    assert SoftMoE(4, 16, num_slots=1).bfloat16_dispatch is True


def test_soft_router_noise_is_noise_std_times_a_standard_normal():
    # upstream vmoe/projects/soft_moe/router.py `add_noise`:
    # `logits + self.noise_std * normal` (no division by the experts).
    router = SoftRouter(num_experts=8, num_slots=2, noise_std=0.5)
    x = ops.convert_to_tensor(_images(64, seed=4))
    router.build(x.shape)
    assert router.effective_noise_std == 0.5
    clean = router(x, training=False)
    noisy = router(x, training=True)
    # Recover the noise from the dispatch softmax: log-ratios of the weights
    # differ from the clean ones by the noise differences between tokens.
    log_clean = np.log(np.asarray(clean.dispatch_weights))
    log_noisy = np.log(np.asarray(noisy.dispatch_weights))
    diff = log_noisy - log_clean
    diff = diff - diff.mean(axis=1, keepdims=True)  # remove the per-slot shift
    expected = 0.5 * np.sqrt(1 - 1 / TOKENS)  # std of noise minus its group mean
    assert abs(float(diff.std()) - expected) < 0.03  # old scale 0.5/8: ~0.056


def test_backbone_set_routing_phases_are_saved_in_the_config():
    from keras_vmoe.models import VisionTransformerBackbone

    backbone = VisionTransformerBackbone(**tiny_configs.vmoe(
        px=16, images_per_group=8, capacity_factor=1.5))
    backbone.set_routing(capacity_factor=4.0, phase="eval")
    assert backbone.moe["router"]["capacity_factor"] == 1.5
    assert backbone.moe["eval_routing"] == {"capacity_factor": 4.0}
    clone = VisionTransformerBackbone.from_config(backbone.get_config())
    layer = clone.get_moe_layers()[0]
    assert (layer.capacity_factor, layer.images_per_group) == (1.5, 8)
    assert layer.eval_routing == {"capacity_factor": 4.0}
    backbone.set_routing(group_size="all")
    assert backbone.moe["images_per_group"] is None and backbone.moe["group_size"] is None
    backbone.set_routing(capacity_factor=2.0)  # both phases
    assert "eval_routing" not in backbone.moe
    assert backbone.get_moe_layers()[0].eval_routing == {}
    with pytest.raises(ValueError, match="at most one"):
        backbone.set_routing(group_size=10, images_per_group=2)
