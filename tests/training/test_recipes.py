"""Recipes as data: each one against the upstream config it transcribes.

Upstream: google-research/vmoe at 942a78b. File and line of every value in
the comments of `EXPECTED`.
"""

import dataclasses
import re

import keras
import numpy as np
import pytest
import tiny_configs

from keras_vmoe import training
from keras_vmoe.models import ImageClassifier
from keras_vmoe.models import VisionTransformerBackbone
from keras_vmoe.training import finetuning
from keras_vmoe.training import recipes

VP = "vmoe/configs/vmoe_paper/"

# name: (optimizer class, peak lr, end lr, warm-up, steps, batch, clip, momentum
#        or weight decay, train cf, eval cf, images per group, loss,
#        representation_size, image size, eval preprocessing)
EXPECTED = {
    # vmoe_s32_last2_ilsvrc2012_randaug_light1_ft_ilsvrc2012.py: :41 batch 1024,
    # :43 384 px, :60/:64 decode|resize(384), :75 softmax_xent, :77 10_000 steps,
    # :102-111 sgd momentum 0.9, peak 0.003, end 1e-5, warm-up 500, clip 10.0,
    # :152 representation_size None, :153 capacity 1.5; common.py:206-208 8 images.
    "vmoe_ft_imagenet": ("sgd", 0.003, 1e-5, 500, 10_000, 1024, 10.0, 0.9,
                         1.5, 1.5, 8, "softmax_xent", None, 384, "resize"),
    # vmoe_b16_imagenet21k_randaug_strong_ft_cifar10.py: :33 batch 1024, :35
    # 128 px, :63 resize(128), :68 softmax_xent, :70 1_000 steps, :93-102 sgd
    # 0.9, peak 0.0015, end 1e-5, warm-up 100, clip 10.0, :130-131 None, 1.5.
    "vmoe_ft_cifar10": ("sgd", 0.0015, 1e-5, 100, 1_000, 1024, 10.0, 0.9,
                        1.5, 1.5, 8, "softmax_xent", None, 128, "resize"),
    # eee_paper/eee_s32_last2_ilsvrc2012_ft_cifar100.py: :35 batch 1024, :37
    # 128 px, :51 and :124 group (1024 // 8) images x 2 members, :78
    # resize(128), :83 ensemble_softmax_xent, :87 2_000 steps, :113
    # representation_size 512, :141 capacity 1.5, :155-164 sgd 0.9, peak
    # 0.005, end 1e-5, warm-up 200, clip 10.0; no evaluation override, so
    # evaluation also routes at 1.5.
    "e3_ft_cifar100": ("sgd", 0.005, 1e-5, 200, 2_000, 1024, 10.0, 0.9,
                       1.5, 1.5, 128, "ensemble_softmax_xent", 512, 128, "resize"),
    # No upstream Soft MoE fine-tune config: vmoe_b16_..._ft_ilsvrc2012.py
    # :34-36, :85, :108-117 protocol; Soft MoE groups are single images.
    "soft_moe_ft": ("sgd", 0.003, 1e-5, 500, 10_000, 1024, 10.0, 0.9,
                    None, None, 1, "softmax_xent", None, 384, "resize"),
    # cli/finetune.py DIGITS_DEFAULTS (100 epochs x 22 batches of 64, lr 0.1,
    # 5% warm-up, cosine to zero) with upstream's optimizer but keras_vmoe's
    # clip 1.0; the model keeps its routing groups.
    "digits": ("sgd", 0.1, 0.0, 110, 2200, 64, 1.0, 0.9,
               None, None, None, "softmax_xent", None, 32, "resize"),
    # pretrain_imagenet21k.py: :53 batch 4096, :61 resize_small(256)|
    # central_crop(224), :68 sigmoid_xent, :75 mixup 0.5, :127 8 images,
    # :166 capacity 1.05, :186-191 adam 0.9/0.999 weight decay 0.1 on
    # kernels, :195-205 warmup_linear_decay peak 8e-4 (B/16) end 1e-5
    # warm-up 10_000, :208 clip 1.0.
    "vmoe_pretrain_imagenet21k": ("adam", 8e-4, 1e-5, 10_000, 300 * 13_000_000 // 4096,
                                  4096, 1.0, 0.1, 1.05, 1.05, 8, "sigmoid_xent", None,
                                  224, "resize_small_central_crop"),
    # vmoe_s32_last2_ilsvrc2012_randaug_light1.py: :49 batch 8192, :76
    # sigmoid_xent, :90-91 eval capacity 4.0, :113 resize_small|central_crop,
    # :128-130 weight decay 0.1, peak 3e-3, clip 1.0, :137 expert dropout
    # 0.2; common.py:163-164 end 1e-5, warm-up 10_000, :216 representation D.
    "vmoe_pretrain_ilsvrc2012_light1": ("adam", 3e-3, 1e-5, 10_000, 46_449, 8192, 1.0,
                                        0.1, 1.05, 4.0, 8, "sigmoid_xent", 512, 224,
                                        "resize_small_central_crop"),
}


def test_every_recipe_is_checked():
    assert set(EXPECTED) == set(training.RECIPES)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_recipe_builds_the_transcribed_optimizer_schedule_and_routing(name):
    (kind, peak, end, warmup, steps, batch, clip, momentum_or_wd, train_cf, eval_cf,
     images_per_group, loss, representation, size, eval_pp) = EXPECTED[name]
    recipe = training.get_recipe(name)
    assert (recipe.train_steps, recipe.batch_size, recipe.loss) == (steps, batch, loss)
    assert (recipe.train_capacity_factor, recipe.eval_capacity_factor) == (train_cf, eval_cf)
    assert recipe.images_per_group == images_per_group
    assert (recipe.representation_size, recipe.image_size) == (representation, size)
    assert recipe.eval_preprocessing == eval_pp
    assert recipe.source and recipe.reproduces
    optimizer = training.build_optimizer(name)
    assert optimizer.global_clipnorm == clip
    if kind == "sgd":
        assert isinstance(optimizer, training.UpstreamSGD)
        assert optimizer.momentum == momentum_or_wd
    else:
        assert isinstance(optimizer, training.UpstreamAdam)
        assert optimizer.weight_decay == momentum_or_wd
        assert (optimizer.beta_1, optimizer.beta_2, optimizer.epsilon) == (0.9, 0.999, 1e-8)
    schedule = optimizer._learning_rate
    lr = [float(schedule(s)) for s in (0, warmup // 2, warmup, steps, steps + 10)]
    assert lr[0] == 0.0
    assert lr[1] == pytest.approx(peak * (warmup // 2) / warmup, rel=1e-5)
    assert lr[2] == pytest.approx(peak, rel=1e-6)
    assert lr[3] == pytest.approx(end, rel=1e-4) and lr[4] == pytest.approx(end, rel=1e-4)
    middle = (warmup + steps) // 2
    fraction = (middle - warmup) / (steps - warmup)
    # optax warmup_cosine_decay_schedule / upstream warmup_linear_decay
    # (vmoe/train/schedule.py:33-36, :45-57).
    decay = 0.5 * (1 + np.cos(np.pi * fraction)) if kind == "sgd" else 1 - fraction
    assert float(schedule(middle)) == pytest.approx(end + (peak - end) * decay, rel=1e-4)


def test_unknown_recipe_lists_the_valid_names():
    with pytest.raises(ValueError, match="vmoe_ft_imagenet"):
        training.get_recipe("vmoe_ft_imagenett")


def _displacement(optimizer, steps=7):
    w = keras.Variable(np.zeros(()), dtype="float32")
    optimizer.build([w])
    for _ in range(steps):
        optimizer.apply_gradients([(keras.ops.ones(()), w)])
    return float(w.numpy())


def test_momentum_scales_the_velocity_by_todays_learning_rate():
    # Example: a unit gradient, peak 0.01 reached after 5 warm-up
    # steps (0, .002, ..., .008, then .01, .01). optax trace + scale(-lr_t)
    # (vmoe/train/optimizer.py:117-134): -sum_t lr_t v_t = -0.167; Keras SGD
    # (lr inside the velocity): -0.097.
    upstream = finetuning.finetune_optimizer(0.01, total_steps=1000, warmup_steps=5)
    assert _displacement(upstream) == pytest.approx(-0.167, abs=5e-4)
    lrs = [0.0, 0.002, 0.004, 0.006, 0.008, 0.01, 0.01]
    velocity, expected = 0.0, 0.0
    for lr in lrs:
        velocity = 1.0 + 0.9 * velocity
        expected -= lr * velocity
    assert _displacement(finetuning.finetune_optimizer(0.01, 1000, 5)) == pytest.approx(
        expected, abs=1e-5)
    keras_sgd = keras.optimizers.SGD(
        keras.optimizers.schedules.CosineDecay(0.0, 995, warmup_target=0.01,
                                               warmup_steps=5), momentum=0.9)
    assert _displacement(keras_sgd) == pytest.approx(-0.097, abs=5e-4)


def test_upstream_sgd_round_trips_and_validates():
    optimizer = training.UpstreamSGD(0.1, momentum=0.5, global_clipnorm=10.0)
    restored = training.UpstreamSGD.from_config(optimizer.get_config())
    assert restored.momentum == 0.5 and restored.global_clipnorm == 10.0
    with pytest.raises(ValueError, match="momentum"):
        training.UpstreamSGD(0.1, momentum=1.0)


def _optax_adam_chain(params, grads_per_step, lrs, b1, b2, eps, wd, decayed, clip):
    """numpy transcription of upstream's chain: clip_by_global_norm,
    scale_by_adam, add_decayed_weights on `decayed`, scale(-lr_t)."""
    params = {k: v.astype("float64") for k, v in params.items()}
    mu = {k: np.zeros_like(v) for k, v in params.items()}
    nu = {k: np.zeros_like(v) for k, v in params.items()}
    for count, (grads, lr) in enumerate(zip(grads_per_step, lrs, strict=True), start=1):
        norm = np.sqrt(sum(np.sum(g.astype("float64") ** 2) for g in grads.values()))
        scale = 1.0 if norm < clip else clip / norm
        for k, g in grads.items():
            g = g.astype("float64") * scale
            mu[k] = (1 - b1) * g + b1 * mu[k]
            nu[k] = (1 - b2) * g**2 + b2 * nu[k]
            update = (mu[k] / (1 - b1**count)) / (np.sqrt(nu[k] / (1 - b2**count)) + eps)
            if k in decayed:
                update = update + wd * params[k]
            params[k] = params[k] - lr * update
    return params


def test_adam_recipes_follow_optax_and_decay_only_kernels():
    model = _tiny()
    model.build((None, 8, 8, 3))
    optimizer = training.build_optimizer("vmoe_pretrain_ilsvrc2012_light1", total_steps=40,
                                         warmup_steps=5, learning_rate=0.05)
    variables = model.trainable_variables
    optimizer.build(variables)
    decayed = {v.path for v in variables if optimizer._use_weight_decay(v)}
    # Upstream decays '.*/kernel' (pretrain configs, train/optimizer.py:57-63):
    # the experts' kernel_0/kernel_1 are its Moe/Mlp/Dense_{0,1}/kernel.
    assert decayed == {v.path for v in variables
                       if v.name in ("kernel", "kernel_0", "kernel_1")}
    assert "position_embedding/embedding" not in decayed
    assert "patch_embedding/cls" not in decayed
    rng = np.random.default_rng(0)
    start = {v.path: np.array(v.numpy()) for v in variables}
    steps = []
    for step in range(40):
        grads = {}
        for v in variables:
            g = rng.normal(0, 1, v.shape).astype("float32")
            # Tiny gradients on some entries: where epsilon's placement shows.
            g[..., ::2] *= 1e-7 if step % 3 else 1.0
            grads[v.path] = g
        steps.append(grads)
    final = _apply_steps(optimizer, variables, steps)
    schedule = optimizer._learning_rate
    lrs = [float(schedule(t)) for t in range(40)]
    expected = _optax_adam_chain(start, steps, lrs, 0.9, 0.999, 1e-8, 0.1, decayed, 1.0)
    for v, value in zip(variables, final, strict=True):
        np.testing.assert_allclose(value, expected[v.path], rtol=0, atol=1e-6,
                                   err_msg=v.path)


def _apply_steps(optimizer, variables, steps):
    """Applies each step's gradients (dicts by variable path); returns the
    variables' final values. On JAX the steps run as one compiled
    `stateless_apply`, the update `fit` compiles, rather than eagerly, where
    every operation of every variable shape is compiled on its own."""
    if keras.backend.backend() != "jax":
        for grads in steps:
            optimizer.apply([keras.ops.convert_to_tensor(grads[v.path]) for v in variables],
                            variables)
        return [v.numpy() for v in variables]
    import jax

    apply = jax.jit(optimizer.stateless_apply)
    values = [v.value for v in variables]
    state = [v.value for v in optimizer.variables]
    for grads in steps:
        values, state = apply(state, [grads[v.path] for v in variables], values)
    return [np.asarray(value) for value in values]


def test_upstream_adam_adds_epsilon_after_the_bias_correction():
    # One step from zero moments with g = 1e-8: optax gives
    # u = g / (|g| + eps) = 0.5; adding eps before the correction (Keras'
    # Adam) gives g / (|g| + eps / sqrt(1 - b2)) = 0.0307.
    for optimizer, expected in ((training.UpstreamAdam(1.0), -0.5),
                                (keras.optimizers.Adam(1.0, epsilon=1e-8), None)):
        w = keras.Variable(np.zeros(()), dtype="float32")
        optimizer.build([w])
        optimizer.apply([keras.ops.convert_to_tensor(1e-8, "float32")], [w])
        if expected is None:
            assert float(w.numpy()) == pytest.approx(-1 / (1 + 1 / np.sqrt(1e-3)), rel=1e-4)
        else:
            assert float(w.numpy()) == pytest.approx(expected, rel=1e-6)


def test_upstream_adam_round_trips_and_validates():
    optimizer = training.UpstreamAdam(0.1, beta_2=0.99, weight_decay=0.1,
                                      decay_pattern="head/kernel", global_clipnorm=1.0)
    restored = training.UpstreamAdam.from_config(optimizer.get_config())
    assert (restored.beta_2, restored.weight_decay, restored.decay_pattern) == (
        0.99, 0.1, "head/kernel")
    with pytest.raises(ValueError, match="beta_1"):
        training.UpstreamAdam(0.1, beta_1=1.0)
    with pytest.raises(ValueError, match="epsilon"):
        training.UpstreamAdam(0.1, epsilon=0.0)
    with pytest.raises(ValueError, match="decay_pattern"):
        training.UpstreamAdam(0.1, decay_pattern="(")


@pytest.mark.parametrize("arguments, name", [
    ({"learning_rate": float("nan")}, "learning_rate"),
    ({"learning_rate": float("inf")}, "learning_rate"),
    ({"learning_rate": -0.1}, "learning_rate"),
    ({"learning_rate": 0.0}, "learning_rate"),
    ({"weight_decay": -0.1}, "weight_decay"),
    ({"weight_decay": float("nan")}, "weight_decay"),
    ({"epsilon": float("inf")}, "epsilon"),
    ({"epsilon": float("nan")}, "epsilon"),
    ({"beta_1": float("nan")}, "beta_1"),
])
def test_upstream_adam_refuses_numbers_that_break_training(arguments, name):
    arguments = {"learning_rate": 0.1, **arguments}
    with pytest.raises(ValueError, match=rf"`{name}` must be .*Received: {name}="):
        training.UpstreamAdam(**arguments)


@pytest.mark.parametrize("arguments, name", [
    ({"learning_rate": float("nan")}, "learning_rate"),
    ({"learning_rate": -1.0}, "learning_rate"),
    ({"momentum": float("nan")}, "momentum"),
])
def test_upstream_sgd_refuses_numbers_that_break_training(arguments, name):
    arguments = {"learning_rate": 0.1, **arguments}
    with pytest.raises(ValueError, match=rf"`{name}` must be .*Received: {name}="):
        training.UpstreamSGD(**arguments)


def test_upstream_optimizers_take_a_schedule():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    assert training.UpstreamAdam(schedule).get_config()["learning_rate"]
    assert training.UpstreamSGD(schedule).get_config()["learning_rate"]


def test_upstream_adam_leaves_soft_moe_mu_and_scale_undecayed():
    config = tiny_configs.vmoe_8px(router={"name": "soft", "num_slots": 1},
                                   classifier="gap")
    model = ImageClassifier(VisionTransformerBackbone(**config), num_classes=3)
    model.build((None, 8, 8, 3))
    optimizer = training.UpstreamAdam(1e-3, weight_decay=0.1)
    optimizer.build(model.trainable_variables)
    names = {v.name for v in model.trainable_variables if optimizer._use_weight_decay(v)}
    assert names == {"kernel", "kernel_0", "kernel_1"}
    assert {"mu", "scale"} <= {v.name for v in model.trainable_variables}


def test_sigmoid_crossentropy_sums_over_classes():
    logits = np.array([[2.0, -1.0, 0.5], [-3.0, 0.0, 4.0]], "float32")
    targets = np.array([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]], "float32")
    p = 1 / (1 + np.exp(-logits.astype("float64")))
    expected = -(targets * np.log(p) + (1 - targets) * np.log(1 - p)).sum(-1).mean()
    loss = training.SigmoidCrossentropy()(targets, logits)
    assert float(loss) == pytest.approx(expected, rel=1e-5)


def test_smoothed_crossentropy_equals_keras_on_one_hot_labels():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 5)).astype("float32") * 3
    labels = np.array([0, 4, 2, 2, 1, 3])
    one_hot = np.eye(5, dtype="float32")[labels]
    for smoothing in (0.0, 0.1, 0.5):
        expected = keras.losses.CategoricalCrossentropy(
            from_logits=True, label_smoothing=smoothing)(one_hot, logits)
        sparse = training.SmoothedCrossentropy(smoothing)
        dense = training.SmoothedCrossentropy(smoothing, sparse=False)
        assert float(sparse(labels, logits)) == pytest.approx(float(expected), rel=1e-6)
        assert float(sparse(labels[:, None], logits)) == pytest.approx(float(expected),
                                                                        rel=1e-6)
        assert float(dense(one_hot, logits)) == pytest.approx(float(expected), rel=1e-6)
    probabilities = keras.ops.softmax(logits)
    from_probabilities = training.SmoothedCrossentropy(0.1, from_logits=False)
    assert float(from_probabilities(labels, probabilities)) == pytest.approx(
        float(training.SmoothedCrossentropy(0.1)(labels, logits)), rel=1e-5)
    config = training.SmoothedCrossentropy(0.2, sparse=False).get_config()
    restored = training.SmoothedCrossentropy.from_config(config)
    assert (restored.label_smoothing, restored.sparse) == (0.2, False)
    for bad in (1.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match="label_smoothing"):
            training.SmoothedCrossentropy(bad)


def test_compile_classifier_picks_the_loss_for_labels_and_smoothing():
    model = _tiny()
    recipes.compile_classifier(model, "sgd")
    assert isinstance(model.loss, keras.losses.SparseCategoricalCrossentropy)
    recipes.compile_classifier(model, "sgd", label_smoothing=0.1)
    assert isinstance(model.loss, training.SmoothedCrossentropy)
    assert model.loss.sparse and model.loss.label_smoothing == 0.1
    recipes.compile_classifier(model, "sgd", dense_labels=True, label_smoothing=0.1)
    assert isinstance(model.loss, keras.losses.CategoricalCrossentropy)
    assert model.loss.get_config()["label_smoothing"] == 0.1
    # A smoothed recipe compiles its smoothing (softmax recipes too).
    smoothed = dataclasses.replace(training.get_recipe("vmoe_ft_cifar10"),
                                   label_smoothing=0.2)
    training.compile_model(model, smoothed, total_steps=10)
    assert model.loss.label_smoothing == 0.2


def test_ensemble_crossentropy_smooths_its_targets():
    from keras_vmoe.models.ensemble_classifier import EnsembleCrossentropy

    rng = np.random.default_rng(1)
    logits = rng.normal(size=(4, 2, 3)).astype("float32")  # (B, N, C)
    labels = np.array([0, 2, 1, 1])
    smoothed = EnsembleCrossentropy(label_smoothing=0.3)(labels, logits)
    members = [keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=0.3)(
        np.eye(3)[labels], logits[:, n]) for n in range(2)]
    assert float(smoothed) == pytest.approx(float(np.mean(members)), rel=1e-5)
    assert EnsembleCrossentropy.from_config(
        EnsembleCrossentropy(label_smoothing=0.3).get_config()).label_smoothing == 0.3


TINY = tiny_configs.vmoe_8px(router={"capacity_factor": 4.0})


def _tiny(num_classes=3, expert_dropout=None):
    keras.utils.set_random_seed(0)
    config = dict(TINY)
    if expert_dropout is not None:
        config["moe"] = {**TINY["moe"], "dropout_rate": expert_dropout}
    return ImageClassifier(VisionTransformerBackbone(**config), num_classes=num_classes)


@pytest.mark.heavy
def test_finetune_with_a_recipe_uses_its_optimizer_and_training_capacity():
    import tensorflow as tf

    model = _tiny()
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (16, 8, 8, 3)).astype("float32")
    y = rng.integers(0, 3, 16).astype("int32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    training.finetune(model, ds, epochs=1, recipe="vmoe_ft_cifar10", verbose=0)
    assert isinstance(model.optimizer, training.UpstreamSGD)
    assert model.optimizer.global_clipnorm == 10.0
    schedule = model.optimizer._learning_rate
    assert schedule.learning_rate == 0.0015 and schedule.total_steps == 2
    # The preset's 4.0 is an evaluation value; the recipe trains at 1.5.
    assert [layer.capacity_factor for layer in model.backbone.get_moe_layers()] == [1.5]


@pytest.mark.heavy
def test_a_recipes_remat_and_scan_apply_unless_finetune_sets_them():
    import dataclasses

    import tensorflow as tf

    recipe = dataclasses.replace(training.get_recipe("vmoe_ft_cifar10"), remat=True,
                                 scan=True)
    assert training.get_recipe("vmoe_ft_cifar10").scan is None  # keep the model's
    rng = np.random.default_rng(0)
    ds = tf.data.Dataset.from_tensor_slices((
        rng.uniform(-1, 1, (8, 8, 8, 3)).astype("float32"),
        rng.integers(0, 3, 8).astype("int32"))).batch(8)
    model = _tiny()
    training.finetune(model, ds, epochs=1, recipe=recipe, remat=False, verbose=0)
    assert model.backbone.scan is True and model.backbone.remat is False


@pytest.mark.heavy
def test_a_learning_rate_given_with_a_recipe_overrides_its_rate_everywhere():
    import tensorflow as tf

    from keras_vmoe.cli import finetune as finetune_cmd

    model = _tiny()
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (16, 8, 8, 3)).astype("float32")
    y = rng.integers(0, 3, 16).astype("int32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    training.finetune(model, ds, epochs=1, recipe="vmoe_ft_cifar10", learning_rate=1e-6,
                      verbose=0)
    schedule = model.optimizer._learning_rate
    assert schedule.learning_rate == 1e-6 and schedule.end_learning_rate <= 1e-6
    # The command line follows the same rule, and says so once.
    recipe = recipes.with_learning_rate(training.get_recipe("vmoe_ft_cifar10"), 0.5)
    assert (recipe.learning_rate, recipe.end_learning_rate) == (0.5, 1e-5)
    assert recipes.with_learning_rate(recipe, None) is recipe
    import argparse

    parser = argparse.ArgumentParser()
    finetune_cmd.add_arguments(parser)
    help_text = " ".join(parser.format_help().split())
    assert "replaces --learning-rate" not in help_text
    assert "--learning-rate, if given, overrides its peak rate" in help_text


@pytest.mark.heavy
def test_compile_model_for_pretraining_decays_kernels_only():
    with pytest.raises(ValueError, match="dropout_rate"):
        training.compile_model(_tiny(), "vmoe_pretrain_ilsvrc2012_light1")
    model = _tiny(expert_dropout=0.1)  # the paper's fine-tuning value
    training.compile_model(model, "vmoe_pretrain_ilsvrc2012_light1", total_steps=10)
    assert isinstance(model.loss, training.SigmoidCrossentropy)
    optimizer = model.optimizer
    layers = model.backbone.get_moe_layers()
    assert layers[0].capacity_factor == 1.05
    assert layers[0].experts.dropout.rate == 0.2  # light1's expert dropout
    decayed = {v.path for v in model.trainable_variables
               if optimizer._use_weight_decay(v)}
    assert any(p.endswith("kernel") for p in decayed)
    assert not any(p.endswith("bias") for p in decayed)
    x = np.random.default_rng(0).uniform(-1, 1, (4, 8, 8, 3)).astype("float32")
    history = model.fit(x, np.eye(3)[[0, 1, 2, 0]], epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_cli_rejects_an_unknown_recipe_before_any_work(tmp_path, capsys):
    from keras_vmoe import cli

    assert cli.main(["finetune", "--recipe", "vmoe_ft_imagenett",
                     "--output", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "Unknown recipe" in err and "vmoe_ft_imagenet" in err
    assert not (tmp_path / "out").exists()


def _dataset(n=8, classes=3, size=8):
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (n, size, size, 3)).astype("float32")
    y = rng.integers(0, classes, n).astype("int32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(4)


def _light1_like(expert_dropout=0.1):
    """A tiny V-MoE routed like the light1 preset: train 1.05, evaluate 4.0."""
    keras.utils.set_random_seed(0)
    moe = {**TINY["moe"], "dropout_rate": expert_dropout,
           "router": {**TINY["moe"]["router"], "capacity_factor": 1.05},
           "eval_routing": {"capacity_factor": 4.0}}
    return ImageClassifier(VisionTransformerBackbone(**{**TINY, "moe": moe}),
                           num_classes=3)


def _routing(model):
    layer = model.backbone.get_moe_layers()[0]
    return layer.capacity_factor, dict(layer.eval_routing), layer.images_per_group


@pytest.mark.heavy
def test_finetune_with_the_light1_recipe_sets_each_phase_from_its_own_field():
    model = _light1_like()
    training.finetune(model, _dataset(), epochs=1,
                      recipe="vmoe_pretrain_ilsvrc2012_light1", verbose=0)
    train_cf, eval_routing, group = _routing(model)
    assert train_cf == 1.05 and eval_routing == {"capacity_factor": 4.0}
    assert group == 8
    # The saved config carries both phases.
    moe = model.backbone.get_config()["moe"]
    assert moe["router"]["capacity_factor"] == 1.05
    assert moe["eval_routing"]["capacity_factor"] == 4.0


@pytest.mark.heavy
def test_a_recipe_training_capacity_never_overwrites_the_evaluation_capacity():
    import dataclasses

    model = _light1_like(expert_dropout=0.0)
    training.finetune(model, _dataset(), epochs=1, recipe="vmoe_ft_cifar10", verbose=0)
    # vmoe_ft_cifar10 states 1.5 for both phases.
    assert _routing(model)[:2] == (1.5, {})
    model = _light1_like(expert_dropout=0.0)
    no_eval = dataclasses.replace(training.get_recipe("vmoe_ft_cifar10"),
                                  eval_capacity_factor=None)
    training.finetune(model, _dataset(), epochs=1, recipe=no_eval, verbose=0)
    # No evaluation capacity in the recipe: the model's 4.0 stays.
    assert _routing(model)[:2] == (1.5, {"capacity_factor": 4.0})


def test_set_routing_checks_everything_before_changing_anything():
    import dataclasses

    model = _light1_like(expert_dropout=0.0)
    before = _routing(model)
    with pytest.raises(ValueError, match="dropout_rate"):
        training.set_routing(model, "vmoe_pretrain_ilsvrc2012_light1")
    assert _routing(model) == before
    model = _light1_like(expert_dropout=0.1)
    before = _routing(model)
    light1 = training.get_recipe("vmoe_pretrain_ilsvrc2012_light1")
    for bad, match in ((dict(expert_dropout=1.5), "expert_dropout"),
                       (dict(eval_capacity_factor=-1.0), "eval_capacity_factor"),
                       (dict(images_per_group=0), "images_per_group")):
        with pytest.raises(ValueError, match=match):  # refused when built
            dataclasses.replace(light1, **bad)
        # A recipe changed after it was built is checked again, before any
        # change to the model.
        recipe = dataclasses.replace(light1)
        for field, value in bad.items():
            object.__setattr__(recipe, field, value)
        with pytest.raises(ValueError, match=match):
            training.set_routing(model, recipe)
        assert _routing(model) == before
        assert model.backbone.get_moe_layers()[0].experts.dropout.rate == 0.1
    # A recipe without capacities or groups (digits) keeps the model's routing.
    training.set_routing(model, "digits")
    assert _routing(model) == before


@pytest.mark.heavy
def test_finetune_with_the_e3_recipe_sets_its_groups_and_capacities():
    from keras_vmoe.models import EnsembleImageClassifier

    keras.utils.set_random_seed(0)
    moe = {**TINY["moe"], "images_per_group": 8,
           "router": {"name": "token_choice", "num_selected_experts": 1,
                      "capacity_factor": 4.0}}
    model = EnsembleImageClassifier(
        VisionTransformerBackbone(**{**TINY, "moe": moe}, ensemble_size=2),
        num_classes=3)
    assert model.backbone.get_moe_layers()[0].images_per_group == 8
    training.finetune(model, _dataset(), epochs=1, recipe="e3_ft_cifar100", verbose=0)
    train_cf, eval_routing, group = _routing(model)
    # eee_s32_last2_ilsvrc2012_ft_cifar100.py: 128 images x 2 members per
    # group, capacity 1.5 in both phases.
    assert (train_cf, eval_routing, group) == (1.5, {}, 128)
    assert model.backbone.get_config()["moe"]["images_per_group"] == 128
    probabilities = model.predict(np.zeros((2, 8, 8, 3), "float32"), verbose=0)
    assert np.all(np.isfinite(probabilities))

@pytest.mark.parametrize("field, value, valid", [
    ("learning_rate", 0.0, "> 0"),
    ("learning_rate", float("nan"), "> 0"),
    ("warmup_steps", -5, "in [0, train_steps"),
    ("clip_global_norm", -1.0, "or None"),
    ("end_learning_rate", 1.0, "[0, learning_rate"),
    ("optimizer", "adamw", "one of ['sgd', 'adam']"),
    ("schedule", "cosine", "one of ['warmup_cosine_decay'"),
    ("train_steps", 0, "int >= 1"),
    ("expert_dropout", 1.5, "[0, 1)"),
    ("momentum", 1.0, "[0, 1)"),
    ("remat", "yes", "True, False or None"),
    ("scan", 1, "True, False or None"),
])
def test_a_replaced_recipe_is_checked(field, value, valid):
    import dataclasses

    recipe = training.get_recipe("vmoe_ft_cifar10")
    with pytest.raises(ValueError, match=rf"`{field}` must be .*{re.escape(valid)}"):
        dataclasses.replace(recipe, **{field: value})


def test_a_recipe_given_as_a_dict_is_a_clear_type_error():
    recipe = training.get_recipe("digits").to_dict()
    with pytest.raises(TypeError, match=r"must be a `keras_vmoe.training.Recipe` or "
                       r"the name of one.*Received: dict"):
        training.get_recipe(recipe)
