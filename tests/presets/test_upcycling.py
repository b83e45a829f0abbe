"""Sparse upcycling: dense ViT (model, preset, vit_jax .npz) -> MoE."""

import json
import os

import keras
import numpy as np
import pytest
import tiny_configs

import keras_vmoe
from keras_vmoe import cli
from keras_vmoe.formats import vit_npz
from keras_vmoe.models import ImageClassifier
from keras_vmoe.models import VisionTransformerBackbone
from keras_vmoe.presets import upcycle

DENSE = tiny_configs.vit(px=16, patch_size=4, num_layers=4)
EXPERT_SOURCE = {"kernel_0": "mlp/dense_0/kernel", "bias_0": "mlp/dense_0/bias",
                 "kernel_1": "mlp/dense_1/kernel", "bias_1": "mlp/dense_1/bias"}


def _randomize(model, seed=0):
    rng = np.random.default_rng(seed)
    for v in model.weights:
        v.assign((0.3 * rng.standard_normal(v.shape)).astype("float32"))
    return model


@pytest.fixture(scope="module")
def dense_task():
    keras.utils.set_random_seed(0)
    return _randomize(ImageClassifier(VisionTransformerBackbone(**DENSE), num_classes=5))


@pytest.fixture(scope="module")
def images16():
    return np.random.default_rng(1).uniform(-1, 1, (4, 16, 16, 3)).astype("float32")


def _values(model):
    return {v.path: keras.ops.convert_to_numpy(v.value) for v in model.weights}


def _check_upcycled(dense_values, moe, layers, num_experts):
    values = _values(moe)
    for path, value in values.items():
        block, _, rest = path.partition("/")
        if int(block.rsplit("_", 1)[-1] if block.startswith("encoderblock_") else -1) in (
                layers) and rest.startswith("moe/"):
            if "/experts/" in path:
                source = dense_values[f"{block}/{EXPERT_SOURCE[path.rsplit('/', 1)[1]]}"]
                assert value.shape == (num_experts, *source.shape)
                for e in range(num_experts):  # every expert: an exact copy
                    np.testing.assert_array_equal(value[e], source)
            continue
        np.testing.assert_array_equal(value, dense_values[path], err_msg=path)


def test_backbone_source_copies_mlps_and_seeds_routers(dense_task):
    dense = dense_task.backbone
    moe = upcycle(dense, num_experts=4, layout="last2", seed=3)
    assert isinstance(moe, VisionTransformerBackbone)
    assert moe.moe_layers == (1, 3) and moe.moe["num_experts"] == 4
    _check_upcycled(_values(dense), moe, (1, 3), 4)
    router = lambda m, i: keras.ops.convert_to_numpy(  # noqa: E731
        m.get_layer(f"encoderblock_{i}").moe_layer.router.kernel)
    again = upcycle(dense, num_experts=4, layout="last2", seed=3)
    other = upcycle(dense, num_experts=4, moe_layers=[1, 3], seed=4)
    np.testing.assert_array_equal(router(moe, 1), router(again, 1))
    assert not np.allclose(router(moe, 1), router(other, 1))
    assert not np.allclose(router(moe, 1), router(moe, 3))  # per-block seeds
    assert np.std(router(moe, 1)) > 0.05  # a real (lecun-normal) draw
    every = upcycle(dense, num_experts=2)  # default layout every2
    assert every.moe_layers == (1, 3)


def test_task_source_saves_and_loads_as_preset(dense_task, images16, tmp_path):
    moe = upcycle(dense_task, num_experts=4, moe_layers=(2,),
                  router={"num_selected_experts": 1})
    assert isinstance(moe, ImageClassifier) and moe.num_classes == 5
    _check_upcycled(_values(dense_task), moe, (2,), 4)
    path = keras_vmoe.presets.save_to_preset(moe, str(tmp_path / "up"))
    with open(os.path.join(path, "metadata.json")) as f:
        weights = json.load(f)["weights"]
    assert weights["kind"] == "upcycled" and weights["num_experts"] == 4
    assert weights["moe_layers"] == [2] and weights["source"]["kind"] == "model"
    loaded = keras_vmoe.presets.from_preset(path)
    assert loaded.backbone.moe_layers == (2,)
    assert loaded.backbone.moe["router"]["num_selected_experts"] == 1
    np.testing.assert_allclose(loaded.predict(images16, verbose=0),
                               moe.predict(images16, verbose=0), atol=1e-6)


@pytest.mark.heavy
def test_step0_token_choice_scales_the_mlp_by_the_kept_gates(dense_task):
    """Documented step-0 function: MoE(x) = c(x) · MLP(x), c = sum of the
    kept choices' un-renormalised top-K gates (< 1)."""
    moe = upcycle(dense_task.backbone, num_experts=4, moe_layers=(1,),
                  router={"num_selected_experts": 2, "capacity_factor": 0.5},
                  moe={"images_per_group": None, "group_size": 16})
    x = np.random.default_rng(2).standard_normal((4, 16, 16)).astype("float32")
    layer = moe.get_layer("encoderblock_1").moe_layer
    y, routing = layer(x, return_routing=True)
    mlp = dense_task.backbone.get_layer("encoderblock_1").mlp_layer
    scale = np.sum(np.asarray(routing.token_weight), axis=-1).reshape(4, 16, 1)
    np.testing.assert_allclose(np.asarray(y), scale * np.asarray(mlp(x)), atol=2e-5)
    assert scale.max() < 1.0  # un-renormalised gates
    # Some choices are dropped at capacity factor 0.5: they add nothing.
    assert (np.asarray(routing.token_slot) >= routing.capacity).any()


def test_renormalized_gates_start_exactly_at_the_dense_function(dense_task, images16):
    moe = upcycle(dense_task, num_experts=4, layout="every2", renormalize_gates=True,
                  moe={"eval_routing": {"capacity_factor": 2.0}})  # = E/K: no drops
    assert type(moe.backbone.get_layer("encoderblock_1").moe_layer.router).__name__ == (
        "RenormalizedTokenChoiceRouter")
    np.testing.assert_allclose(moe.predict(images16, verbose=0),
                               dense_task.predict(images16, verbose=0), atol=2e-5)
    plain = upcycle(dense_task, num_experts=4, layout="every2",
                    moe={"eval_routing": {"capacity_factor": 2.0}})
    assert not np.allclose(plain.predict(images16, verbose=0),
                           dense_task.predict(images16, verbose=0), atol=1e-3)


@pytest.mark.heavy
def test_soft_and_ensemble_upcycling(dense_task, images16):
    soft = upcycle(dense_task, num_experts=4, layout="last2", moe_type="soft")
    assert soft.backbone.moe_type == "soft"
    _check_upcycled(_values(dense_task), soft, (1, 3), 4)
    eee = upcycle(dense_task, num_experts=4, layout="last2", moe_type="ensemble",
                  ensemble_size=2)
    assert type(eee).__name__ == "EnsembleImageClassifier"
    assert eee.backbone.ensemble_size == 2
    _check_upcycled(_values(dense_task), eee, (1, 3), 4)
    assert eee.predict_members(images16, verbose=0).shape == (4, 2, 5)


def _vit_npz(path, scheme):
    """A tiny vit_jax checkpoint: 'prelinen' (original release, AugReg) or
    'linen' naming; D=16, 2 blocks, 8px images of 4px patches, cls token."""
    att, ln1, mlp = {"prelinen": ("MultiHeadDotProductAttention_1", "LayerNorm_2",
                                  "MlpBlock_3"),
                     "linen": ("MultiHeadDotProductAttention_0", "LayerNorm_1",
                               "MlpBlock_0")}[scheme]
    d, m, h = 16, 32, 2
    shapes = {"embedding/kernel": (4, 4, 3, d), "embedding/bias": (d,), "cls": (1, 1, d),
              "Transformer/posembed_input/pos_embedding": (1, 5, d),
              "Transformer/encoder_norm/scale": (d,), "Transformer/encoder_norm/bias": (d,),
              "head/kernel": (d, 3), "head/bias": (3,)}
    for i in range(2):
        b = f"Transformer/encoderblock_{i}"
        for ln in ("LayerNorm_0", ln1):
            shapes.update({f"{b}/{ln}/scale": (d,), f"{b}/{ln}/bias": (d,)})
        for p in ("query", "key", "value"):
            shapes.update({f"{b}/{att}/{p}/kernel": (d, h, d // h),
                           f"{b}/{att}/{p}/bias": (h, d // h)})
        shapes.update({f"{b}/{att}/out/kernel": (h, d // h, d), f"{b}/{att}/out/bias": (d,),
                       f"{b}/{mlp}/Dense_0/kernel": (d, m), f"{b}/{mlp}/Dense_0/bias": (m,),
                       f"{b}/{mlp}/Dense_1/kernel": (m, d), f"{b}/{mlp}/Dense_1/bias": (d,)})
    rng = np.random.default_rng(0)
    params = {k: (0.3 * rng.standard_normal(s)).astype("float32") for k, s in shapes.items()}
    vit_npz.save(path, params)
    return params, mlp


@pytest.mark.parametrize("scheme", ["prelinen", "linen"])
def test_vit_npz_source(tmp_path, scheme):
    path = tmp_path / "ViT-tiny.npz"
    params, mlp = _vit_npz(path, scheme)
    moe = upcycle(str(path), num_experts=2, moe_layers=(1,),
                  preset_overrides={"num_classes": 7} if scheme == "linen" else None)
    assert moe.num_classes == (7 if scheme == "linen" else 3)
    kernel = keras.ops.convert_to_numpy(
        moe.backbone.get_layer("encoderblock_1").moe_layer.experts.kernel_1)
    for e in range(2):
        np.testing.assert_array_equal(
            kernel[e], params[f"Transformer/encoderblock_1/{mlp}/Dense_1/kernel"])
    dense0 = moe.backbone.get_layer("encoderblock_0").mlp_layer.dense_0.kernel
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(dense0),
        params[f"Transformer/encoderblock_0/{mlp}/Dense_0/kernel"])
    assert moe._keras_vmoe_weights["source"] == {"kind": "vit_npz", "path": str(path)}


def test_preset_source_and_cli(dense_task, tmp_path, capsys):
    base = keras_vmoe.presets.save_to_preset(dense_task, str(tmp_path / "dense"))
    out = str(tmp_path / "up")
    assert cli.main(["upcycle", "--from", base, "--output", out, "--num-experts", "2",
                     "--layout", "last2", "--renormalize-gates", "--seed", "5"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["moe_layers"] == [1, 3]
    model = keras_vmoe.presets.from_preset(out)
    assert model.backbone.moe["router"]["name"] == "renormalized_token_choice"
    _check_upcycled(_values(dense_task), model, (1, 3), 2)
    with open(os.path.join(out, "metadata.json")) as f:
        weights = json.load(f)["weights"]
    assert weights["source"] == {"kind": "preset", "preset": base}
    assert weights["router_seed"] == 5
    assert cli.main(["upcycle", "--from", base, "--output", str(tmp_path / "x"),
                     "--moe-type", "soft", "--capacity-factor", "2"]) == 1
    assert not os.path.exists(tmp_path / "x")


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_experts=0), "num_experts"),
    (dict(moe_type="dense"), "moe_type"),
    (dict(moe_layers=(9,)), "out of range"),
    (dict(layout="none"), "at least one MoE block"),
    (dict(layout="last2", moe_layers=(1,)), "at most one"),
    (dict(moe_type="soft", router={"num_selected_experts": 2}), "router"),
    (dict(moe_type="ensemble", num_experts=3), "divisible"),
    (dict(moe_type="ensemble", renormalize_gates=True), "renormalize_gates"),
])
def test_bad_arguments(dense_task, kwargs, match):
    with pytest.raises(ValueError, match=match):
        upcycle(dense_task, **kwargs)


def test_bad_sources(dense_task):
    with pytest.raises(ValueError, match="source"):
        upcycle(42)
    moe = upcycle(dense_task.backbone, num_experts=2, moe_layers=(1,))
    with pytest.raises(ValueError, match="already MoE blocks"):
        upcycle(moe, num_experts=2, moe_layers=(1,))


@pytest.mark.heavy
def test_upcycled_model_trains(dense_task):
    """Tiny budget: the loss goes down and the expert copies diverge."""
    moe = upcycle(dense_task, num_experts=2, moe_layers=(3,), seed=1,
                  router={"capacity_factor": 2.0})
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (32, 16, 16, 3)).astype("float32")
    y = rng.integers(0, 5, (32,)).astype("int32")
    moe.compile(optimizer=keras.optimizers.Adam(3e-3))
    history = moe.fit(x, y, epochs=6, batch_size=16, verbose=0)
    losses = history.history["loss"]
    assert losses[-1] < losses[0]
    experts = moe.backbone.get_layer("encoderblock_3").moe_layer.experts
    kernel = keras.ops.convert_to_numpy(experts.kernel_0)
    assert not np.allclose(kernel[0], kernel[1])
