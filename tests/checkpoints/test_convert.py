"""Converter internals: architecture inference, name mapping and its errors,
routing from the preset catalog, ViT `.npz` checkpoints, streaming reads."""

import io
import json
import math
import sys
import zipfile

import numpy as np
import pytest
from checkpoint_tampering import BOMB_SHAPE
from checkpoint_tampering import HEAD
from checkpoint_tampering import run_convert as _run_convert

from keras_vmoe.cli import convert_cmd
from keras_vmoe.conversion import ConversionError
from keras_vmoe.conversion import ValidationError
from keras_vmoe.conversion import build as conversion_build
from keras_vmoe.conversion import build_model_from_upstream
from keras_vmoe.conversion import infer
from keras_vmoe.conversion import preset_for_upstream
from keras_vmoe.conversion import routing_from_preset
from keras_vmoe.conversion import validate
from keras_vmoe.conversion.weights import conversion_plan
from keras_vmoe.formats import CheckpointError
from keras_vmoe.formats import load_upstream_params
from keras_vmoe.formats import partitioned as P
from keras_vmoe.formats import read_upstream_shapes
from keras_vmoe.formats import save_checkpoint
from keras_vmoe.formats import vit_npz
from keras_vmoe.models.vit_embeddings import resize_position_embedding
from keras_vmoe.presets import convert_vit_npz_to_preset

FIXTURES = ("vmoe_tiny", "vmoe_tiny_ec", "eee_tiny", "softmoe_tiny")


def _prefix(upstream_dir, fixture):
    return str(upstream_dir / fixture / "checkpoint")


@pytest.fixture(scope="module")
def vmoe_tiny_params(upstream_dir):
    return load_upstream_params(_prefix(upstream_dir, "vmoe_tiny"))


VMOE_TINY_ROUTING = dict(num_selected_experts=2, capacity_factor=1.0, group_size=34,
                         batch_priority=False)


@pytest.fixture(scope="module")
def vmoe_tiny_model(vmoe_tiny_params):
    return build_model_from_upstream(vmoe_tiny_params, **VMOE_TINY_ROUTING)


# ---------------------------------------------------------------------------
# Architecture inference.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", FIXTURES)
def test_infer_architecture_matches_upstream_config(upstream_dir, fixture):
    config = json.loads((upstream_dir / fixture / "config.json").read_text())
    hyper = next(iter(config["variants"].values()))["hyperparameters"]
    shapes = read_upstream_shapes(_prefix(upstream_dir, fixture))
    arch = infer.infer_architecture(shapes)
    assert arch.hidden_dim == hyper["hidden_size"]
    assert arch.num_layers == hyper["num_layers"]
    assert arch.num_heads == hyper["num_heads"]
    assert arch.mlp_dim == arch.expert_mlp_dim == hyper["mlp_dim"]
    assert arch.patch_size == tuple(hyper["patch_size"])
    assert arch.image_size == tuple(hyper["image_size"])
    assert arch.tokens_per_image == hyper["tokens_per_image"]
    assert arch.classifier == hyper["classifier"]
    assert arch.representation_size == hyper["representation_size"]
    assert arch.num_classes == hyper["num_classes"]
    assert arch.moe_layers == tuple(hyper["moe_layers"])
    assert arch.num_experts == hyper["num_experts"]
    assert arch.qk_norm is (hyper["attention_qk_norm"] is True)
    assert arch.position_embedding == "learned"
    assert arch.ensemble_size == hyper.get("ensemble_size", 1)
    assert arch.num_slots == hyper.get("num_slots")
    kind = {"vmoe_tiny": "sparse", "vmoe_tiny_ec": "sparse", "eee_tiny": "partitioned",
            "softmoe_tiny": "soft"}[fixture]
    assert arch.moe_kind == kind
    assert arch.naming == "vmoe"


def _dense_vit_shapes(prefix="Transformer", scheme="prelinen", layers=2, d=16, m=32,
                      heads=2, patch=4, tokens=5, cls=True, classes=5, rep=None):
    names = {
        "prelinen": ("LayerNorm_0", "MultiHeadDotProductAttention_1", "LayerNorm_2",
                     "MlpBlock_3"),
        "linen": ("LayerNorm_0", "MultiHeadDotProductAttention_0", "LayerNorm_1",
                  "MlpBlock_0"),
        "vmoe": ("LayerNorm_0", "SelfAttention", "LayerNorm_1", "Mlp"),
    }[scheme]
    ln0, att, ln1, mlp = names
    shapes = {"embedding/kernel": (patch, patch, 3, d), "embedding/bias": (d,),
              f"{prefix}/posembed_input/pos_embedding": (1, tokens, d),
              f"{prefix}/encoder_norm/scale": (d,), f"{prefix}/encoder_norm/bias": (d,)}
    if cls:
        shapes["cls"] = (1, 1, d)
    for i in range(layers):
        b = f"{prefix}/encoderblock_{i}"
        for ln in (ln0, ln1):
            shapes[f"{b}/{ln}/scale"] = (d,)
            shapes[f"{b}/{ln}/bias"] = (d,)
        for p in ("query", "key", "value"):
            shapes[f"{b}/{att}/{p}/kernel"] = (d, heads, d // heads)
            shapes[f"{b}/{att}/{p}/bias"] = (heads, d // heads)
        shapes[f"{b}/{att}/out/kernel"] = (heads, d // heads, d)
        shapes[f"{b}/{att}/out/bias"] = (d,)
        shapes[f"{b}/{mlp}/Dense_0/kernel"] = (d, m)
        shapes[f"{b}/{mlp}/Dense_0/bias"] = (m,)
        shapes[f"{b}/{mlp}/Dense_1/kernel"] = (m, d)
        shapes[f"{b}/{mlp}/Dense_1/bias"] = (d,)
    if rep:
        shapes["pre_logits/kernel"] = (d, rep)
        shapes["pre_logits/bias"] = (rep,)
    if classes:
        shapes["head/kernel"] = (rep or d, classes)
        shapes["head/bias"] = (classes,)
    return shapes


def test_canonical_names_agree_across_naming_schemes():
    canon = {
        scheme: set(infer.canonicalize(_dense_vit_shapes(
            prefix="Encoder" if scheme == "vmoe" else "Transformer", scheme=scheme)))
        for scheme in ("prelinen", "linen", "vmoe")
    }
    assert canon["prelinen"] == canon["linen"] == canon["vmoe"]
    wrapped = {f"opt/target/{k}": v for k, v in _dense_vit_shapes().items()}
    assert set(infer.canonicalize(wrapped)) == canon["vmoe"]
    arch = infer.infer_architecture(wrapped)
    assert arch.naming == "vit_jax" and arch.moe_kind is None
    assert (arch.image_size, arch.num_heads, arch.mlp_dim) == ((8, 8), 2, 32)


def test_infer_architecture_options_and_errors():
    gap = _dense_vit_shapes(cls=False, tokens=4, classes=None)
    arch = infer.infer_architecture(gap)
    assert (arch.classifier, arch.num_classes, arch.image_size) == ("gap", None, (8, 8))
    assert infer.infer_architecture(gap, image_size=16).image_size == (16, 16)

    no_pos = {k: v for k, v in gap.items() if "posembed" not in k}
    arch = infer.infer_architecture(no_pos, image_size=12, position_embedding="none")
    assert (arch.position_embedding, arch.image_size) == ("none", (12, 12))
    assert infer.infer_architecture(no_pos).position_embedding == "sincos2d"
    with pytest.raises(infer.ConversionError, match="learned position embedding"):
        infer.infer_architecture(gap, position_embedding="sincos2d")

    with pytest.raises(infer.ConversionError, match="embedding/kernel"):
        infer.infer_architecture({"foo/kernel": (3, 3)})
    with pytest.raises(infer.ConversionError, match=r"blocks \[0\] are missing"):
        infer.infer_architecture(
            {k: v for k, v in gap.items() if "encoderblock_0" not in k})
    with pytest.raises(infer.ConversionError, match="not a square grid"):
        infer.infer_architecture(_dense_vit_shapes(cls=False, tokens=6))
    rect = infer.infer_architecture(_dense_vit_shapes(cls=False, tokens=6),
                                    image_size=(8, 12))
    assert rect.image_size == (8, 12)


def test_resolve_routing_defaults_and_errors(upstream_dir):
    vmoe = infer.infer_architecture(read_upstream_shapes(
        _prefix(upstream_dir, "vmoe_tiny")))
    eee = infer.infer_architecture(read_upstream_shapes(
        _prefix(upstream_dir, "eee_tiny")))
    soft = infer.infer_architecture(read_upstream_shapes(
        _prefix(upstream_dir, "softmoe_tiny")))
    settings = infer.resolve_routing(vmoe)
    assert settings == dict(router="token_choice", num_selected_experts=2,
                            capacity_factor=1.05, bfloat16_dispatch=True,
                            batch_priority=False, capacity_ceil_or_round="ceil",
                            capacity_multiple_of=4, group_size=None,
                            images_per_group=8)  # upstream's 8 images per group
    assert infer.resolve_routing(eee)["num_selected_experts"] == 1
    assert infer.resolve_routing(eee)["images_per_group"] == 128  # E³ configs
    assert infer.resolve_routing(vmoe, {"images_per_group": 2})["images_per_group"] == 2
    grouped = infer.resolve_routing(eee, {"group_size": 68})
    assert (grouped["group_size"], grouped["images_per_group"]) == (68, None)
    assert infer.resolve_routing(vmoe, {"group_size": "all"})["images_per_group"] is None
    assert infer.resolve_routing(soft) == {"bfloat16_dispatch": True}
    ec = infer.resolve_routing(vmoe, {"router": "expert_choice"})
    assert "num_selected_experts" not in ec and ec["router"] == "expert_choice"
    for arch, routing, match in [
        (eee, {"num_selected_experts": 3}, "between 1 and 2"),
        (vmoe, {"num_selected_experts": 5}, "between 1 and 4"),
        (eee, {"router": "expert_choice"}, "Token Choice only"),
        (vmoe, {"router": "expert_choice", "num_selected_experts": 2}, "no"),
        (soft, {"num_selected_experts": 2}, "fixed routing"),
        (eee, {"group_size": 33}, "divisible by ensemble_size=2"),
        (vmoe, {"router": "switch"}, "router"),
        (vmoe, {"capacity_factor": 0}, "capacity_factor"),
    ]:
        with pytest.raises(infer.ConversionError, match=match):
            infer.resolve_routing(arch, routing)
    with pytest.raises(TypeError, match="Unknown routing settings"):
        infer.RoutingSettings().merged(top_k=2)


# ---------------------------------------------------------------------------
# Mapping errors name the paths and shapes.
# ---------------------------------------------------------------------------


def test_shape_mismatch_names_both_paths_and_shapes(vmoe_tiny_params, vmoe_tiny_model):
    shapes = {k: v.shape for k, v in vmoe_tiny_params.items()}
    shapes["Encoder/encoderblock_0/Mlp/Dense_0/bias"] = (95,)
    with pytest.raises(ConversionError) as info:
        conversion_plan(shapes, vmoe_tiny_model)
    message = str(info.value)
    assert "'Encoder/encoderblock_0/Mlp/Dense_0/bias' has shape (95,)" in message
    assert "'encoderblock_0/mlp/dense_0/bias' has shape (96,)" in message

    params = dict(vmoe_tiny_params)
    params["Encoder/encoderblock_2/Mlp/Dense_1/bias"] = np.zeros(47, np.float32)
    with pytest.raises(ConversionError, match=r"Dense_1/bias' has shape \(47,\)"):
        build_model_from_upstream(params, **VMOE_TINY_ROUTING)


def test_leftover_and_missing_weights_are_listed(vmoe_tiny_params, vmoe_tiny_model):
    shapes = {k: v.shape for k, v in vmoe_tiny_params.items()}
    extra = dict(shapes, **{"Encoder/encoderblock_0/Adapter/kernel": (48, 8),
                            "step": ()})
    with pytest.raises(ConversionError) as info:
        conversion_plan(extra, vmoe_tiny_model)
    message = str(info.value)
    assert "no Keras counterpart" in message
    assert "Encoder/encoderblock_0/Adapter/kernel (48, 8)" in message
    assert "step ()" in message

    missing = {k: v for k, v in shapes.items()
               if k != "Encoder/encoderblock_0/LayerNorm_0/bias"}
    with pytest.raises(ConversionError) as info:
        conversion_plan(missing, vmoe_tiny_model)
    assert "Keras weights no upstream array provides" in str(info.value)
    assert "encoderblock_0/layer_norm_0/beta (48,)" in str(info.value)


def test_full_path_and_head_options(vmoe_tiny_params, vmoe_tiny_model, upstream_dir):
    inputs = np.load(upstream_dir / "vmoe_tiny" / "inputs.npy")
    backbone = build_model_from_upstream(
        vmoe_tiny_params, include_head=False, **VMOE_TINY_ROUTING)
    assert type(backbone).__name__ == "VisionTransformerBackbone"
    expected = np.load(upstream_dir / "vmoe_tiny" / "pre_logits_bf16dispatch.npy")
    assert validate(backbone, inputs, expected, atol=1e-3) <= 1e-3
    with pytest.raises(ValidationError, match="max abs diff"):
        validate(backbone, inputs, expected + 1.0, atol=1e-3)
    with pytest.raises(ValidationError, match="shape"):
        validate(backbone, inputs, expected[:2], atol=1e-3)
    with pytest.raises(TypeError, match="Unknown arguments"):
        build_model_from_upstream(vmoe_tiny_params, top_k=2)


def test_position_embedding_is_resized_for_another_resolution(vmoe_tiny_params):
    model = build_model_from_upstream(
        vmoe_tiny_params, image_size=48, num_selected_experts=2, capacity_factor=1.0,
        group_size="all")
    pos = model.backbone.get_layer("position_embedding").embedding
    upstream = vmoe_tiny_params["Encoder/posembed_input/pos_embedding"]
    expected = resize_position_embedding(upstream, (6, 6), has_cls=True)
    assert tuple(pos.shape) == (1, 37, 48)
    np.testing.assert_allclose(np.asarray(pos), expected, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(pos)[:, :1], upstream[:, :1])
    assert model.predict_on_batch(np.zeros((2, 48, 48, 3), np.float32)).shape == (2, 10)


# ---------------------------------------------------------------------------
# Routing from the preset catalog.
# ---------------------------------------------------------------------------


def test_routing_from_released_presets():
    light1 = routing_from_preset("vmoe_s32_last2_ilsvrc2012_randaug_light1")
    # Trains (fine-tunes) at 1.5 as upstream, evaluates at 4.0.
    assert light1 == infer.RoutingSettings(
        router="token_choice", num_selected_experts=2, capacity_factor=1.5,
        images_per_group=8, batch_priority=False, bfloat16_dispatch=True,
        eval_routing={"capacity_factor": 4.0})
    eee = routing_from_preset("eee_s32_last2_ilsvrc2012_ft_cifar100")
    assert (eee.num_selected_experts, eee.capacity_factor) == (1, 1.5)
    assert routing_from_preset("vit_b16_augreg_imagenet21k") == \
        infer.RoutingSettings()
    assert preset_for_upstream(
        "gs://vmoe_checkpoints/eee_s32_last2_ilsvrc2012_ft_cifar100"
    ) == "eee_s32_last2_ilsvrc2012_ft_cifar100"
    assert preset_for_upstream(
        "/mirror/vmoe_b16_imagenet21k_randaug_strong_ft_ilsvrc2012.index"
    ) == "vmoe_b16_imagenet21k_randaug_strong_ft_ilsvrc2012"
    assert preset_for_upstream("/tmp/checkpoint") is None
    with pytest.raises(ValueError, match="Unknown preset"):
        routing_from_preset("no_such_preset")


def test_preset_routing_plus_group_size_reproduces_upstream(upstream_dir, caplog):
    """The E³ release's catalog routing (K=1, cf 1.5, bf16) with the
    fixture's group size reproduces the upstream E³ outputs."""
    fixture_dir = upstream_dir / "eee_tiny"
    model = build_model_from_upstream(
        str(fixture_dir / "checkpoint"), preset="eee_s32_last2_ilsvrc2012_ft_cifar100",
        group_size=68)
    assert model.head_bias_init == -10.0
    moe = model.backbone.moe
    assert moe["router"]["num_selected_experts"] == 1
    assert moe["router"]["capacity_factor"] == 1.5 and moe["bfloat16_dispatch"]
    assert "listed at 128px" in caplog.text
    diff = validate(model, fixture_dir / "inputs.npy",
                            fixture_dir / "logits_bf16dispatch.npy", atol=1e-3)
    assert diff <= 1e-3


# ---------------------------------------------------------------------------
# Streaming: multi-shard, legacy index, expert-sliced chunks, bfloat16.
# ---------------------------------------------------------------------------


def test_multishard_legacy_expert_sliced_checkpoint(vmoe_tiny_params, vmoe_tiny_model,
                                                    upstream_dir, tmp_path):
    tree = {}
    for path, value in vmoe_tiny_params.items():
        node = tree
        *parents, leaf = path.split("/")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    experts = [k for k in vmoe_tiny_params if "/Moe/Mlp/" in k]
    slices = {k: [[(e, e + 1)] + [(0, d) for d in vmoe_tiny_params[k].shape[1:]]
                  for e in range(4)] for k in experts}
    prefix = str(tmp_path / "sharded")
    save_checkpoint(prefix, tree, num_shards=3, version=None, chunk_slices=slices)
    model = build_model_from_upstream(prefix + ".index", **VMOE_TINY_ROUTING)
    for ours, ref in zip(model.weights, vmoe_tiny_model.weights, strict=True):
        assert ours.path == ref.path
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref))


def test_bfloat16_checkpoint_is_cast_to_float32(vmoe_tiny_params, tmp_path):
    import ml_dtypes

    bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in vmoe_tiny_params.items()}
    tree = {}
    for path, value in bf16.items():
        node = tree
        *parents, leaf = path.split("/")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    save_checkpoint(str(tmp_path / "bf16"), tree)
    model = build_model_from_upstream(str(tmp_path / "bf16"),
                                              **VMOE_TINY_ROUTING)
    weight = {v.path: v for v in model.weights}["encoderblock_1/moe/experts/kernel_0"]
    assert str(weight.dtype) == "float32"
    np.testing.assert_array_equal(
        np.asarray(weight),
        bf16["Encoder/encoderblock_1/Moe/Mlp/Dense_0/kernel"].astype(np.float32))


# ---------------------------------------------------------------------------
# google-research/vision_transformer .npz checkpoints (synthetic).
# ---------------------------------------------------------------------------


def _random_params(shapes, seed=0):
    rng = np.random.default_rng(seed)
    params = {}
    for path, shape in shapes.items():
        if path.endswith("/scale"):
            params[path] = 1 + 0.1 * rng.standard_normal(shape)
        else:
            params[path] = 0.3 * rng.standard_normal(shape)
    return {k: v.astype(np.float32) for k, v in params.items()}


def _layer_norm(x, scale, bias, eps=1e-6):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * scale + bias


def _gelu(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _reference_vit(params, images, block_names, prefix="Transformer"):
    """Plain numpy forward pass of vit_jax's ViT (float64)."""
    p = {k: v.astype(np.float64) for k, v in params.items()}
    ln0, att, ln1, mlp = block_names
    kernel = p["embedding/kernel"]
    size = kernel.shape[0]
    b, h, w, c = images.shape
    patches = images.reshape(b, h // size, size, w // size, size, c)
    patches = patches.transpose(0, 1, 3, 2, 4, 5).reshape(b, -1, size * size * c)
    x = patches @ kernel.reshape(-1, kernel.shape[-1]) + p["embedding/bias"]
    if "cls" in p:
        x = np.concatenate([np.broadcast_to(p["cls"], (b, 1, x.shape[-1])), x], axis=1)
    x = x + p[f"{prefix}/posembed_input/pos_embedding"]
    i = 0
    while f"{prefix}/encoderblock_{i}/{ln0}/scale" in p:
        blk = f"{prefix}/encoderblock_{i}"
        y = _layer_norm(x, p[f"{blk}/{ln0}/scale"], p[f"{blk}/{ln0}/bias"])
        q, k, v = (np.einsum("btd,dnh->btnh", y, p[f"{blk}/{att}/{n}/kernel"])
                   + p[f"{blk}/{att}/{n}/bias"] for n in ("query", "key", "value"))
        logits = np.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(q.shape[-1])
        weights = np.exp(logits - logits.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        mixed = np.einsum("bnts,bsnh->btnh", weights, v)
        x = x + np.einsum("btnh,nhd->btd", mixed, p[f"{blk}/{att}/out/kernel"]) \
            + p[f"{blk}/{att}/out/bias"]
        y = _layer_norm(x, p[f"{blk}/{ln1}/scale"], p[f"{blk}/{ln1}/bias"])
        y = _gelu(y @ p[f"{blk}/{mlp}/Dense_0/kernel"] + p[f"{blk}/{mlp}/Dense_0/bias"])
        x = x + y @ p[f"{blk}/{mlp}/Dense_1/kernel"] + p[f"{blk}/{mlp}/Dense_1/bias"]
        i += 1
    x = _layer_norm(x, p[f"{prefix}/encoder_norm/scale"], p[f"{prefix}/encoder_norm/bias"])
    x = x[:, 0] if "cls" in p else x.mean(1)
    if "pre_logits/kernel" in p:
        x = np.tanh(x @ p["pre_logits/kernel"] + p["pre_logits/bias"])
    return x @ p["head/kernel"] + p["head/bias"]


@pytest.mark.parametrize("scheme,wrapper,cls,rep", [
    ("prelinen", "", True, 12),
    ("linen", "opt/target/", False, None),
])
def test_vit_npz_matches_numpy_reference(tmp_path, scheme, wrapper, cls, rep):
    shapes = _dense_vit_shapes(scheme=scheme, cls=cls, tokens=5 if cls else 4, rep=rep)
    params = _random_params(shapes)
    path = tmp_path / "vit.npz"
    vit_npz.save(path, {wrapper + k: v for k, v in params.items()})
    assert vit_npz.read_shapes(path) == {wrapper + k: v for k, v in shapes.items()}

    model = build_model_from_upstream(str(path))
    backbone = model.backbone
    assert (backbone.classifier, backbone.representation_size) == (
        "token" if cls else "gap", rep)
    assert backbone.moe_layers == () and backbone.image_size == 8
    images = np.random.default_rng(1).uniform(-1, 1, (3, 8, 8, 3)).astype(np.float32)
    names = {"prelinen": ("LayerNorm_0", "MultiHeadDotProductAttention_1",
                          "LayerNorm_2", "MlpBlock_3"),
             "linen": ("LayerNorm_0", "MultiHeadDotProductAttention_0", "LayerNorm_1",
                       "MlpBlock_0")}[scheme]
    expected = _reference_vit(params, images.astype(np.float64), names)
    assert validate(model, images, expected, atol=1e-4) <= 1e-4


def test_vit_npz_preset_and_errors(tmp_path):
    from keras_vmoe.presets import from_preset

    params = _random_params(_dense_vit_shapes(rep=12))
    path = tmp_path / "vit.npz"
    vit_npz.save(path, params)
    out = convert_vit_npz_to_preset(str(path), str(tmp_path / "preset"))
    images = np.random.default_rng(2).uniform(-1, 1, (2, 8, 8, 3)).astype(np.float32)
    expected = _reference_vit(params, images.astype(np.float64),
                              ("LayerNorm_0", "MultiHeadDotProductAttention_1",
                               "LayerNorm_2", "MlpBlock_3"))
    assert validate(from_preset(out), images, expected, atol=1e-4) <= 1e-4

    # A hybrid (ResNet stem) checkpoint: the ResNet parameters are listed.
    hybrid = dict(params, **{"conv_root/kernel": np.zeros((7, 7, 3, 4), np.float32)})
    vit_npz.save(tmp_path / "hybrid.npz", hybrid)
    with pytest.raises(ConversionError, match=r"conv_root/kernel \(7, 7, 3, 4\)"):
        build_model_from_upstream(str(tmp_path / "hybrid.npz"))

    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="truncated.npz"):
        build_model_from_upstream(str(truncated))
    with pytest.raises(CheckpointError, match="not found"):
        load_upstream_params(str(tmp_path / "missing.npz"))
    with pytest.raises(ValueError, match=".npz"):
        convert_vit_npz_to_preset(str(tmp_path / "x"), str(tmp_path / "o"))
    assert not (tmp_path / "o").exists()


def test_convert_checks_sizes_before_building_the_model(
    bomb_prefix, tmp_path, monkeypatch, capsys
):
    def no_build(*args, **kwargs):
        raise AssertionError("the model was built from an unchecked index")

    monkeypatch.setattr(conversion_build, "_build_keras_model", no_build)
    with pytest.raises(P.CheckpointError, match="head/kernel"):
        build_model_from_upstream(bomb_prefix)
    code, err = _run_convert(
        ["--upstream", bomb_prefix, "--output", tmp_path / "out"], capsys
    )
    assert code == 1
    assert err.startswith("error: ") and HEAD in err and "holds only" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "abc", "-1", "0"])
def test_convert_rejects_bad_capacity_factor(value, capsys):
    with pytest.raises(SystemExit) as info:
        convert_cmd.build_parser().parse_args(
            ["--upstream", "x", "--output", "y", f"--capacity-factor={value}"]
        )
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--capacity-factor" in err and repr(value) in err


def test_convert_accepts_a_good_capacity_factor():
    args = convert_cmd.build_parser().parse_args(
        ["--upstream", "x", "--output", "y", "--capacity-factor", "1.25"]
    )
    assert args.capacity_factor == 1.25


def test_gs_without_tensorflow_is_a_cli_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "tensorflow", None)
    source = "gs://vmoe_checkpoints/vmoe_s32"
    code, err = _run_convert(["--upstream", source, "--output", tmp_path / "out"], capsys)
    assert code == 1
    # Read over HTTPS as a public object (a closed port on 127.0.0.1 here).
    assert err.startswith("error: ") and "vmoe_checkpoints/vmoe_s32.index" in err
    assert "Cannot connect" in err


ROUTER = "Encoder/encoderblock_1/Moe/Router/dense/kernel"


ROUTING = dict(num_selected_experts=2, capacity_factor=1.0, group_size=34,
               batch_priority=False)


@pytest.fixture(scope="module")
def params(upstream_dir):
    return load_upstream_params(upstream_dir / "vmoe_tiny" / "checkpoint")


def _npy_bytes(array, declared_shape=None):
    """`.npy` bytes of `array`, its header optionally declaring another shape."""
    buffer = io.BytesIO()
    header = {"descr": np.lib.format.dtype_to_descr(array.dtype),
              "fortran_order": False,
              "shape": tuple(declared_shape or array.shape)}
    np.lib.format.write_array_header_1_0(buffer, header)
    buffer.write(array.tobytes())
    return buffer.getvalue()


def test_npz_header_declaring_a_huge_array_is_refused(params, tmp_path):
    path = tmp_path / "ViT.npz"
    with zipfile.ZipFile(path, "w") as archive:
        for key, value in params.items():
            shape = BOMB_SHAPE if key == HEAD else None
            archive.writestr(key + ".npy", _npy_bytes(np.asarray(value), shape))
    for read in (vit_npz.read_shapes, lambda p: dict(vit_npz.iter_arrays(p)),
                 build_model_from_upstream):
        with pytest.raises(P.CheckpointError) as info:
            read(str(path))
        message = str(info.value)
        assert "head/kernel.npy" in message and str(BOMB_SHAPE) in message
        assert "19200000000 bytes" in message


def _with(params, path, value):
    return {**params, path: value}


@pytest.mark.parametrize(
    "path, make, expected",
    [
        (HEAD, lambda v: (v * 100).astype(np.int32), "dtype int32"),
        (HEAD, lambda v: v > 0, "dtype bool"),
        (HEAD, lambda v: v.astype(np.complex64) + 1j, "dtype complex64"),
        (HEAD, lambda v: np.where(np.arange(v.size).reshape(v.shape) == 3, np.inf, v),
         "1 non-finite value"),
        (ROUTER, lambda v: np.full_like(v, np.nan), "192 non-finite value"),
    ],
    ids=["int32", "bool", "complex", "inf_head", "nan_router"],
)
def test_converter_refuses_values_that_are_not_float_weights(params, path, make,
                                                             expected):
    bad = _with(params, path, make(np.asarray(params[path])))
    with pytest.raises(ConversionError) as info:
        build_model_from_upstream(bad, **ROUTING)
    assert repr(path) in str(info.value) and expected in str(info.value)


def test_bfloat16_weights_are_still_accepted(params):
    import ml_dtypes

    small = _with(params, HEAD, np.asarray(params[HEAD]).astype(ml_dtypes.bfloat16))
    model = build_model_from_upstream(small, **ROUTING)
    assert model.get_layer("head").kernel.shape == (48, 10)
