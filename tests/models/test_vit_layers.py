# Hand-built configs: the subject is the blocks' constructor arguments (`moe`, sizes).

import math

import keras
import numpy as np
import pytest
import scipy.ndimage
import testing

from keras_vmoe.models import vit_embeddings
from keras_vmoe.models import vit_layers
from keras_vmoe.models.vit_embeddings import PatchEmbedding
from keras_vmoe.models.vit_embeddings import PositionEmbedding
from keras_vmoe.models.vit_embeddings import resize_position_embedding
from keras_vmoe.models.vit_embeddings import sincos2d_position_embedding
from keras_vmoe.models.vit_layers import EncoderBlock
from keras_vmoe.models.vit_layers import MapHead
from keras_vmoe.models.vit_layers import MlpBlock
from keras_vmoe.models.vit_layers import MultiHeadSelfAttention


def _np(variable):
    return keras.ops.convert_to_numpy(variable.value)


def _layer_norm(x, scale, bias=None, eps=1e-6):
    mean = x.mean(-1, keepdims=True)
    var = x.var(-1, keepdims=True)
    y = (x - mean) / np.sqrt(var + eps) * scale
    return y if bias is None else y + bias


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


@pytest.mark.parametrize("qk_norm", [False, True])
def test_attention_matches_numpy_reference(qk_norm):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 5, 8)).astype("float32")
    layer = MultiHeadSelfAttention(num_heads=2, qk_norm=qk_norm, name="attention")
    layer.build((None, None, 8))
    shapes = {v.path: tuple(v.shape) for v in layer.weights}
    expected = {
        "attention/query/kernel": (8, 2, 4),
        "attention/query/bias": (2, 4),
        "attention/key/kernel": (8, 2, 4),
        "attention/key/bias": (2, 4),
        "attention/value/kernel": (8, 2, 4),
        "attention/value/bias": (2, 4),
        "attention/out/kernel": (2, 4, 8),
        "attention/out/bias": (8,),
    }
    if qk_norm:
        expected.update(
            {"attention/query_ln/gamma": (4,), "attention/key_ln/gamma": (4,)}
        )
    assert shapes == expected
    for v in layer.weights:  # non-trivial biases and norm scales
        v.assign(_np(v) + rng.normal(scale=0.1, size=v.shape).astype("float32"))
    w = {v.path.split("attention/")[1]: _np(v) for v in layer.weights}
    q = np.einsum("btd,dnk->btnk", x, w["query/kernel"]) + w["query/bias"]
    k = np.einsum("btd,dnk->btnk", x, w["key/kernel"]) + w["key/bias"]
    v = np.einsum("btd,dnk->btnk", x, w["value/kernel"]) + w["value/bias"]
    if qk_norm:
        q = _layer_norm(q, w["query_ln/gamma"])
        k = _layer_norm(k, w["key_ln/gamma"])
    logits = np.einsum("btnk,bsnk->bnts", q / math.sqrt(4), k)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    mixed = np.einsum("bnts,bsnk->btnk", weights, v)
    want = np.einsum("btnk,nkd->btd", mixed, w["out/kernel"]) + w["out/bias"]
    np.testing.assert_allclose(np.asarray(layer(x)), want, atol=1e-5)


def test_attention_kernels_use_flattened_fans():
    layer = MultiHeadSelfAttention(num_heads=4)
    layer.build((None, None, 256))
    q, k = _np(layer.query.kernel), _np(layer.key.kernel)
    assert not np.allclose(q, k)  # independent draws
    # xavier_uniform on the flattened (256, 256) matrix: limit sqrt(6/512).
    limit = math.sqrt(6 / 512)
    assert np.abs(q).max() <= limit
    assert np.abs(q).max() > 0.9 * limit


def test_mlp_block_matches_numpy_reference():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(2, 3, 6)).astype("float32")
    mlp = MlpBlock(10, name="mlp")
    out = np.asarray(mlp(x))
    assert [v.path for v in mlp.weights] == [
        "mlp/dense_0/kernel",
        "mlp/dense_0/bias",
        "mlp/dense_1/kernel",
        "mlp/dense_1/bias",
    ]
    w0, b0, w1, b1 = (_np(v) for v in mlp.weights)
    assert np.abs(b0).max() < 1e-4  # normal(1e-6) biases
    np.testing.assert_allclose(out, _gelu_tanh(x @ w0 + b0) @ w1 + b1, atol=1e-5)


def test_patch_embedding_is_a_strided_convolution():
    rng = np.random.default_rng(3)
    images = rng.normal(size=(2, 8, 12, 3)).astype("float32")
    layer = PatchEmbedding(
        5, patch_size=4, use_class_token=True, name="patch_embedding"
    )
    tokens = np.asarray(layer(images))
    assert tokens.shape == (2, 1 + 2 * 3, 5)
    np.testing.assert_array_equal(tokens[:, 0], 0.0)  # cls init zeros
    kernel, bias = _np(layer.kernel), _np(layer.bias)
    patches = images.reshape(2, 2, 4, 3, 4, 3).transpose(0, 1, 3, 2, 4, 5)
    want = np.einsum("bhwpqc,pqcd->bhwd", patches, kernel).reshape(2, 6, 5) + bias
    np.testing.assert_allclose(tokens[:, 1:], want, atol=1e-5)


def test_sincos2d_table():
    table = sincos2d_position_embedding((2, 3), 16)
    assert table.shape == (1, 6, 16)
    np.testing.assert_allclose(
        table[0, 0], [0] * 4 + [1] * 4 + [0] * 4 + [1] * 4, atol=1e-7
    )
    # Position 4 is (y=1, x=1); the first frequency is 1 (omega_0 = 1).
    assert table[0, 4, 0] == pytest.approx(math.sin(1.0))
    assert table[0, 4, 8] == pytest.approx(math.sin(1.0))
    # The last frequency is 1/temperature.
    assert table[0, 5, 3] == pytest.approx(math.sin(2 * 1e-4), rel=1e-4)
    with pytest.raises(ValueError, match="multiple of 4"):
        sincos2d_position_embedding(2, 10)


@pytest.mark.parametrize("kind", ["learned", "sincos2d", "none"])
def test_position_embedding_kinds(kind):
    x = np.ones((2, 5, 8), "float32")
    layer = PositionEmbedding((2, 2), kind=kind, has_class_token=True)
    y = np.asarray(layer(x))
    assert len(layer.weights) == (1 if kind == "learned" else 0)
    if kind == "sincos2d":
        np.testing.assert_allclose(y[:, 0], 1.0)  # the cls token gets none
        want = 1.0 + np.broadcast_to(sincos2d_position_embedding(2, 8), (2, 4, 8))
        np.testing.assert_allclose(y[:, 1:], want, atol=1e-6)
    if kind == "none":
        np.testing.assert_array_equal(y, x)
    with pytest.raises(ValueError, match="position_embedding"):
        PositionEmbedding(2, kind="rope")


def test_resize_position_embedding():
    rng = np.random.default_rng(4)
    pos_emb = rng.normal(size=(1, 1 + 16, 6)).astype("float32")
    same = resize_position_embedding(pos_emb, 4, has_cls=True)
    np.testing.assert_array_equal(same, pos_emb)
    bigger = resize_position_embedding(pos_emb, (6, 8), has_cls=True)
    assert bigger.shape == (1, 1 + 48, 6) and bigger.dtype == np.float32
    np.testing.assert_array_equal(bigger[:, 0], pos_emb[:, 0])
    want = scipy.ndimage.zoom(
        pos_emb[0, 1:].reshape(4, 4, 6), (6 / 4, 8 / 4, 1), order=1
    )
    np.testing.assert_allclose(bigger[0, 1:], want.reshape(48, 6), atol=1e-6)
    # Corners of a bilinear zoom are the original corners.
    np.testing.assert_allclose(bigger[0, 1], pos_emb[0, 1], atol=1e-6)
    no_cls = resize_position_embedding(pos_emb[:, 1:], 2, has_cls=False)
    assert no_cls.shape == (1, 4, 6)
    with pytest.raises(ValueError, match="square grid"):
        resize_position_embedding(pos_emb[:, :15], 3, has_cls=False)


def test_encoder_block_dense_and_moe(jit_call):
    x = np.random.default_rng(5).normal(size=(2, 5, 8)).astype("float32")
    dense = EncoderBlock(num_heads=2, mlp_dim=16, name="encoderblock_0")
    dense.build(x.shape)
    assert jit_call(dense, x).shape == (2, 5, 8) and not dense.is_moe
    assert {v.path.split("/")[1] for v in dense.weights} == {
        "layer_norm_0",
        "attention",
        "layer_norm_1",
        "mlp",
    }
    assert dense.layer_norm_0.epsilon == 1e-6
    moe = EncoderBlock(
        num_heads=2, mlp_dim=16, moe={"num_experts": 4}, name="encoderblock_1"
    )
    moe.build(x.shape)
    y, metrics = jit_call(moe, x, return_metrics=True)
    assert y.shape == (2, 5, 8) and "expert_fill" in metrics
    assert "encoderblock_1/moe/experts/kernel_0" in [v.path for v in moe.weights]
    config = moe.get_config()
    assert EncoderBlock.from_config(config).get_config() == config
    with pytest.raises(ValueError, match="Unknown `moe` keys"):
        EncoderBlock(2, 16, moe={"num_experts": 4, "experts": 3})


def test_map_head(jit_call):
    x = np.random.default_rng(6).normal(size=(3, 7, 8)).astype("float32")
    head = MapHead(num_heads=2, mlp_dim=16, name="map_head")
    head.build(x.shape)
    assert jit_call(head, x).shape == (3, 8)
    paths = [v.path for v in head.weights]
    assert paths[0] == "map_head/probe"
    assert "map_head/attention/query/kernel" in paths
    assert "map_head/layer_norm/gamma" in paths
    assert "map_head/mlp/dense_1/bias" in paths


def test_layers_carry_the_dtype_policy(jit_call):
    block = EncoderBlock(2, 16, moe={"num_experts": 2}, dtype="mixed_bfloat16")
    x = np.ones((1, 4, 8), "float32")
    block.build(x.shape)
    y = jit_call(block, x)
    assert keras.backend.standardize_dtype(y.dtype) == "bfloat16"
    for layer in block._flatten_layers():
        assert layer.dtype_policy.name == "mixed_bfloat16", layer.name
    assert all(v.dtype == "float32" for v in block.weights)


# --- The shared test base (tests/testing.py) --------------------------------

RNG_SHARED = np.random.default_rng(0)
TOKENS = RNG_SHARED.normal(size=(2, 8, 16)).astype("float32")  # (B, T, D)
IMAGES = RNG_SHARED.uniform(-1, 1, size=(4, 32, 32, 3)).astype("float32")


def _name(value):
    return getattr(value, "__name__", "")


VIT_LAYERS = [
    (vit_layers.MultiHeadSelfAttention, dict(num_heads=2), TOKENS, (2, 8, 16)),
    (vit_layers.MlpBlock, dict(mlp_dim=32), TOKENS, (2, 8, 16)),
    (vit_layers.EncoderBlock, dict(num_heads=2, mlp_dim=32), TOKENS, (2, 8, 16)),
    (vit_layers.EncoderBlock, dict(num_heads=2, mlp_dim=32, moe={"num_experts": 4}),
     TOKENS, (2, 8, 16)),
    (vit_layers.EncoderBlock, dict(num_heads=2, mlp_dim=32, moe={"num_experts": 4},
                                   remat=True), TOKENS, (2, 8, 16)),
    (vit_layers.MapHead, dict(num_heads=2, mlp_dim=32), TOKENS, (2, 16)),
    (vit_embeddings.PatchEmbedding, dict(hidden_dim=16, patch_size=8), IMAGES,
     (4, 17, 16)),
    (vit_embeddings.PositionEmbedding, dict(grid_size=(2, 4), kind="learned",
                                            has_class_token=False), TOKENS, (2, 8, 16)),
]


@pytest.mark.parametrize("cls,kwargs,x,shape", VIT_LAYERS, ids=_name)
def test_vit_layers_through_the_shared_base(cls, kwargs, x, shape):
    testing.run_layer_test(cls, kwargs, x, shape, call_kwargs={"training": False})
