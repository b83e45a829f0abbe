"""timm, transformers and KerasHub ViT checkpoints through `from_preset` (presets.hub_vits).

The default tests write timm-format checkpoints with NumPy (no torch) and
check them against a NumPy forward pass of timm's ViT, the `hf://` path
against a local HTTP server, and the refusals. The `hub_vits` group
(`pytest -m hub_vits`, after `pip install '.[hub-vits]'`) builds
random-weight models with timm, transformers and KerasHub themselves,
saves them as each library does and compares logits on JAX, PyTorch and
TensorFlow. No test reaches the network. The group runs in its own pytest
process (`.ci/run`): torch imported into a process that already imported
TensorFlow can crash it.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import scipy.special
from http_server import Server

from keras_vmoe import models
from keras_vmoe import presets
from keras_vmoe.conversion import hub_vits as mapping
from keras_vmoe.formats import safetensors
from keras_vmoe.presets import hub_vits
from keras_vmoe.presets import provenance

WIDTH, DEPTH, HEADS, CLASSES, SIZE, PATCH = 32, 2, 2, 5, 32, 8
TIMM_ARGS = {"img_size": SIZE, "patch_size": PATCH, "embed_dim": WIDTH, "depth": DEPTH,
             "num_heads": HEADS, "num_classes": CLASSES}
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _timm_state(rng, class_token=True, tokens=None):
    """A random timm ViT state dict (PyTorch layouts), as NumPy arrays."""
    grid = (SIZE // PATCH) ** 2
    tokens = tokens or grid + int(class_token)

    def normal(*shape):
        return rng.normal(0, 0.2, shape).astype("float32")

    state = {"patch_embed.proj.weight": normal(WIDTH, 3, PATCH, PATCH),
             "patch_embed.proj.bias": normal(WIDTH), "pos_embed": normal(1, tokens, WIDTH),
             "norm.weight": 1 + normal(WIDTH), "norm.bias": normal(WIDTH),
             "head.weight": normal(CLASSES, WIDTH), "head.bias": normal(CLASSES)}
    if class_token:
        state["cls_token"] = normal(1, 1, WIDTH)
    for i in range(DEPTH):
        b = f"blocks.{i}."
        state.update({
            b + "norm1.weight": 1 + normal(WIDTH), b + "norm1.bias": normal(WIDTH),
            b + "attn.qkv.weight": normal(3 * WIDTH, WIDTH), b + "attn.qkv.bias": normal(3 * WIDTH),
            b + "attn.proj.weight": normal(WIDTH, WIDTH), b + "attn.proj.bias": normal(WIDTH),
            b + "norm2.weight": 1 + normal(WIDTH), b + "norm2.bias": normal(WIDTH),
            b + "mlp.fc1.weight": normal(4 * WIDTH, WIDTH), b + "mlp.fc1.bias": normal(4 * WIDTH),
            b + "mlp.fc2.weight": normal(WIDTH, 4 * WIDTH), b + "mlp.fc2.bias": normal(WIDTH)})
    return state


def _write_timm(path, state, architecture="vit_tiny_patch16_224", **model_args):
    os.makedirs(path, exist_ok=True)
    config = {"architecture": architecture, "num_classes": CLASSES, "num_features": WIDTH,
              "model_args": {**TIMM_ARGS, **model_args},
              "pretrained_cfg": {"tag": "augreg_in21k", "input_size": [3, SIZE, SIZE],
                                 "interpolation": "bicubic", "mean": list(MEAN),
                                 "std": list(STD), "num_classes": CLASSES}}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    safetensors.save(os.path.join(path, "model.safetensors"), state)
    return path


def _layer_norm(x, gamma, beta, eps=1e-6):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gamma + beta


def _timm_forward(state, images, pool="token"):
    """timm's `VisionTransformer.forward` in NumPy (float64), exact GELU."""
    s = {k: v.astype("float64") for k, v in state.items()}
    x = (images / 255.0 - np.array(MEAN)) / np.array(STD)  # (B, H, W, 3)
    b, g = x.shape[0], SIZE // PATCH
    patches = x.reshape(b, g, PATCH, g, PATCH, 3).transpose(0, 1, 3, 5, 2, 4)
    x = patches.reshape(b, g * g, -1) @ s["patch_embed.proj.weight"].reshape(WIDTH, -1).T
    x = x + s["patch_embed.proj.bias"]
    if "cls_token" in s:
        x = np.concatenate([np.broadcast_to(s["cls_token"], (b, 1, WIDTH)), x], 1)
    x = x + s["pos_embed"]
    k = WIDTH // HEADS
    for i in range(DEPTH):
        p = f"blocks.{i}."
        h = _layer_norm(x, s[p + "norm1.weight"], s[p + "norm1.bias"])
        qkv = (h @ s[p + "attn.qkv.weight"].T + s[p + "attn.qkv.bias"]).reshape(
            b, -1, 3, HEADS, k).transpose(2, 0, 3, 1, 4)
        logits = qkv[0] @ qkv[1].transpose(0, 1, 3, 2) / np.sqrt(k)
        weights = np.exp(logits - logits.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        a = (weights @ qkv[2]).transpose(0, 2, 1, 3).reshape(b, -1, WIDTH)
        x = x + a @ s[p + "attn.proj.weight"].T + s[p + "attn.proj.bias"]
        h = _layer_norm(x, s[p + "norm2.weight"], s[p + "norm2.bias"])
        h = h @ s[p + "mlp.fc1.weight"].T + s[p + "mlp.fc1.bias"]
        h = 0.5 * h * (1 + scipy.special.erf(h / np.sqrt(2)))
        x = x + h @ s[p + "mlp.fc2.weight"].T + s[p + "mlp.fc2.bias"]
    x = _layer_norm(x, s["norm.weight"], s["norm.bias"])
    x = x[:, 0] if pool == "token" else x.mean(1)
    return x @ s["head.weight"].T + s["head.bias"]


@pytest.fixture(scope="module")
def images():
    return np.random.RandomState(0).randint(0, 256, (4, SIZE, SIZE, 3)).astype("uint8")


@pytest.fixture(scope="module")
def timm_dir(tmp_path_factory):
    state = _timm_state(np.random.RandomState(0))
    path = _write_timm(str(tmp_path_factory.mktemp("timm") / "vit"), state)
    return path, state


def test_timm_directory_gives_timms_logits(timm_dir, images):
    path, state = timm_dir
    model = models.ImageClassifier.from_preset(path)
    config = model.backbone.get_config()
    assert config["mlp_activation"] == "gelu" and config["layer_norm_epsilon"] == 1e-6
    assert model.preprocessor.image_converter.interpolation == "bicubic"
    logits = model.predict(images, verbose=0)
    np.testing.assert_allclose(logits, _timm_forward(state, images), atol=1e-4, rtol=0)
    features = models.VisionTransformerBackbone.from_preset(path)
    assert features.output_dim == WIDTH
    again = models.VisionTransformerBackbone.from_config(config)
    assert again.get_config() == config


def test_timm_average_pooling_and_bias_free_attention(tmp_path, images):
    state = _timm_state(np.random.RandomState(1), class_token=False)
    for i in range(DEPTH):
        del state[f"blocks.{i}.attn.qkv.bias"]
    path = _write_timm(str(tmp_path / "gap"), state, architecture="vit_base_patch16_gap_224",
                       qkv_bias=False)
    model = presets.from_preset(path)
    assert model.backbone.classifier == "gap"
    state = dict(state)
    for i in range(DEPTH):
        state[f"blocks.{i}.attn.qkv.bias"] = np.zeros(3 * WIDTH, "float32")
    np.testing.assert_allclose(model.predict(images, verbose=0),
                               _timm_forward(state, images, pool="avg"), atol=1e-4, rtol=0)


@pytest.mark.parametrize("architecture,model_args,feature", [
    ("vit_base_patch14_reg4_dinov2", {}, "register tokens"),
    ("deit3_base_patch16_224", {}, "layer scale"),
    ("vit_base_patch16_clip_224", {}, "pre-norm"),
    ("vit_tiny_patch16_224", {"qk_norm": True}, "qk-norm"),
    ("vit_tiny_patch16_224", {"global_pool": "avg", "class_token": False}, "fc_norm"),
    ("deit_base_distilled_patch16_224", {}, "distillation token"),
    ("eva02_base_patch14_224", {}, "another architecture"),
    ("vit_base_patch16_rope_224", {}, "not one of timm's plain"),
])
def test_unsupported_timm_features_are_named(tmp_path, architecture, model_args, feature):
    path = _write_timm(str(tmp_path / "x"), {"w": np.zeros(1, "float32")},
                       architecture=architecture, **model_args)
    with pytest.raises(mapping.UnsupportedHubVitError, match=feature):
        presets.from_preset(path)


@pytest.mark.parametrize("config,feature", [
    ({"model_type": "dinov2"}, "layer scale"),
    ({"model_type": "deit"}, "distillation token"),
    ({"model_type": "vit", "hidden_act": "relu"}, "hidden_act='relu'"),
    ({"model_type": "vit", "architectures": ["ViTForMaskedImageModeling"]},
     "ViTForMaskedImageModeling"),
])
def test_unsupported_transformers_configs_are_named(config, feature):
    assert mapping.detect_source(config) == "transformers"
    with pytest.raises(mapping.UnsupportedHubVitError, match=feature):
        mapping.read_spec("transformers", config)


def test_upcycled_timm_vit_starts_at_the_dense_function(timm_dir, images):
    path, _ = timm_dir
    dense = presets.from_preset(path)
    moe = presets.upcycle(path, num_experts=4, layout="every2", renormalize_gates=True)
    moe.set_routing(capacity_factor=4.0)  # E/K = 2: no token is dropped
    experts = moe.backbone.get_layer("encoderblock_1").moe_layer.experts
    assert experts.activation == "gelu"
    np.testing.assert_allclose(moe.predict(images, verbose=0),
                               dense.predict(images, verbose=0), atol=1e-4, rtol=0)


@pytest.fixture
def hub(tmp_path, monkeypatch, timm_dir):
    """A local stand-in of the Hub serving `<owner>/<repo>/resolve/main/<file>`."""
    root = tmp_path / "hub"
    repo = root / "timm" / "vit_tiny" / "resolve" / "main"
    repo.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (repo / name).write_bytes(open(os.path.join(timm_dir[0], name), "rb").read())
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras_home"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with Server(root) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.base)
        yield server, root


def test_hf_handle_downloads_config_then_weights_and_caches_them(hub, images, timm_dir,
                                                                 monkeypatch):
    server, _ = hub
    model = presets.from_preset("hf://timm/vit_tiny")
    gets = [path for method, path, _ in server.requests if method == "GET"]
    assert gets[0].endswith("config.json") and gets[-1].endswith("model.safetensors")
    np.testing.assert_allclose(model.predict(images, verbose=0),
                               _timm_forward(timm_dir[1], images), atol=1e-4, rtol=0)
    assert provenance.current(model)["kind"] == "timm"
    server.requests.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the cache alone
    presets.from_preset("hf://timm/vit_tiny")
    assert server.requests == []


def test_unsupported_hub_checkpoint_is_refused_before_its_weights(hub):
    server, root = hub
    config_path = root / "timm" / "vit_tiny" / "resolve" / "main" / "config.json"
    config = json.loads(config_path.read_text())
    config["architecture"] = "vit_base_patch14_reg4_dinov2"
    config_path.write_text(json.dumps(config))
    with pytest.raises(mapping.UnsupportedHubVitError, match="register tokens"):
        presets.from_preset("hf://timm/vit_tiny")
    assert not any(path.endswith("model.safetensors") for _, path, _ in server.requests)


def test_missing_hub_files_name_the_handle_and_the_offline_way(hub, monkeypatch):
    with pytest.raises(FileNotFoundError, match="hf://timm/absent.*no config.json"):
        presets.from_preset("hf://timm/absent")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE.*offline"):
        presets.from_preset("hf://timm/absent")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(OSError, match="cannot be reached.*offline"):
        presets.from_preset("hf://timm/other")
    assert hub_vits.hf_cache_dir("hf://timm/other").endswith(
        os.path.join("keras_vmoe_hub", "hf", "timm", "other"))


def test_architecture_overrides_are_refused_for_hub_checkpoints(timm_dir):
    with pytest.raises(ValueError, match="architecture comes from its config"):
        presets.from_preset(timm_dir[0], hidden_dim=WIDTH * 2)
    model = presets.from_preset(timm_dir[0], num_classes=3, image_size=2 * SIZE)
    assert model.num_classes == 3 and model.backbone.image_size == 2 * SIZE


@pytest.mark.parametrize("setting", [{"remat": True}, {"dtype": "bfloat16"}])
def test_settings_overrides_of_hub_checkpoints_copy_the_head_and_draw_none(
        timm_dir, setting, monkeypatch):
    import keras

    from keras_vmoe.presets import overrides
    from keras_vmoe.utils import initialization

    plain = presets.from_preset(timm_dir[0])
    model = presets.from_preset(timm_dir[0], **setting)
    for a, b in zip(plain.weights, model.weights, strict=True):  # in the new dtype
        expected = keras.ops.convert_to_numpy(keras.ops.cast(a.value, b.dtype))
        np.testing.assert_array_equal(np.asarray(b.value, "float32"),
                                      expected.astype("float32"))
    # The rebuilt head is a placeholder until copied: a head left uncopied raises.
    monkeypatch.setattr(overrides, "_copy_head_weights", lambda source, target: None)
    with pytest.raises(initialization.UnassignedWeightsError, match="head"):
        presets.from_preset(timm_dir[0], **setting)


# --- The libraries themselves (the `hub_vits` group) ---------------------------

_BACKEND_SCRIPT = """
import json, sys
import numpy as np
import keras_vmoe
images = np.load(sys.argv[1])
out = {path: keras_vmoe.presets.from_preset(path).predict(images, verbose=0).tolist()
       for path in sys.argv[2:]}
print("LOGITS" + json.dumps(out))
"""


def _save_timm(path):
    import timm
    import torch
    from timm.models._hub import save_for_hf

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224.augreg_in21k", pretrained=False,
                              **TIMM_ARGS).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    save_for_hf(model, path, safe_serialization=True)
    return model


def _save_transformers(path):
    import torch
    from transformers import ViTConfig
    from transformers import ViTForImageClassification
    from transformers import ViTImageProcessor

    torch.manual_seed(0)
    config = ViTConfig(hidden_size=WIDTH, num_hidden_layers=DEPTH, num_attention_heads=HEADS,
                       intermediate_size=4 * WIDTH, image_size=SIZE, patch_size=PATCH,
                       num_labels=CLASSES)
    model = ViTForImageClassification(config).eval()
    model.save_pretrained(path)
    ViTImageProcessor(size={"height": SIZE, "width": SIZE}, image_mean=list(MEAN),
                      image_std=list(STD)).save_pretrained(path)
    return model


def _save_keras_hub(path):
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.ViTBackbone(
        image_shape=(SIZE, SIZE, 3), patch_size=PATCH, num_layers=DEPTH, num_heads=HEADS,
        hidden_dim=WIDTH, mlp_dim=4 * WIDTH)
    converter = keras_hub.layers.ViTImageConverter(image_size=(SIZE, SIZE),
                                                   scale=1 / 127.5, offset=-1)
    model = keras_hub.models.ViTImageClassifier(
        backbone=backbone, num_classes=CLASSES, intermediate_dim=WIDTH + 8,
        preprocessor=keras_hub.models.ViTImageClassifierPreprocessor(
            image_converter=converter))
    for variable in model.weights:
        variable.assign(variable.value + keras.random.normal(variable.shape) * 0.05)
    model.save_to_preset(path)
    return model


@pytest.fixture(scope="module")
def library_checkpoints(tmp_path_factory, images):
    """`{source: (directory, reference logits)}` built and saved by each library."""
    pytest.importorskip("timm")
    pytest.importorskip("transformers")
    pytest.importorskip("keras_hub")
    import torch
    from transformers import ViTImageProcessor

    root = tmp_path_factory.mktemp("libraries")
    out = {}
    timm_model = _save_timm(str(root / "timm"))
    x = torch.tensor(images / 255.0, dtype=torch.float32).permute(0, 3, 1, 2)
    x = (x - 0.5) / 0.5  # the augreg checkpoints' mean and std
    with torch.no_grad():
        out["timm"] = (str(root / "timm"), timm_model(x).numpy())
    hf_model = _save_transformers(str(root / "transformers"))
    pixels = ViTImageProcessor.from_pretrained(str(root / "transformers"))(
        list(images), return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        out["transformers"] = (str(root / "transformers"),
                               hf_model(pixel_values=pixels).logits.numpy())
    kh_model = _save_keras_hub(str(root / "keras_hub"))
    out["keras_hub"] = (str(root / "keras_hub"),
                        np.asarray(kh_model.predict(images.astype("float32"), verbose=0)))
    return out


@pytest.mark.hub_vits
@pytest.mark.parametrize("source", mapping.SOURCES)
def test_library_checkpoint_gives_the_librarys_logits(library_checkpoints, images, source):
    path, reference = library_checkpoints[source]
    model = presets.from_preset(path)
    np.testing.assert_allclose(model.predict(images, verbose=0), reference,
                               atol=1e-4, rtol=0)
    moe = presets.upcycle(path, num_experts=4, layout="every2", renormalize_gates=True)
    moe.set_routing(capacity_factor=4.0)
    np.testing.assert_allclose(moe.predict(images, verbose=0), reference, atol=1e-4, rtol=0)


@pytest.mark.hub_vits
@pytest.mark.parametrize("backend", ["torch", "tensorflow"])
def test_library_checkpoints_on_other_backends(library_checkpoints, images, backend, tmp_path):
    np.save(tmp_path / "images.npy", images)
    paths = [library_checkpoints[source][0] for source in mapping.SOURCES]
    env = dict(os.environ, KERAS_BACKEND=backend)
    result = subprocess.run(
        [sys.executable, "-c", _BACKEND_SCRIPT, str(tmp_path / "images.npy"), *paths],
        env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    logits = json.loads(result.stdout.split("LOGITS", 1)[1])
    for source in mapping.SOURCES:
        path, reference = library_checkpoints[source]
        np.testing.assert_allclose(np.asarray(logits[path]), reference, atol=1e-4, rtol=0)


@pytest.mark.hub_vits
def test_timm_architecture_table_matches_the_installed_timm():
    timm = pytest.importorskip("timm")
    from timm.models import deit
    from timm.models import vision_transformer

    modules = {vision_transformer.__name__, deit.__name__}
    factories = {name for name in timm.list_models()
                 if timm.models.model_entrypoint(name).__module__ in modules}
    assert factories == set(mapping.TIMM_ARCHITECTURES)
    for name in ("vit_tiny_patch16_224", "vit_base_patch16_gap_224", "deit_small_patch16_224"):
        model = timm.create_model(name, pretrained=False, depth=1)
        args = mapping.TIMM_ARCHITECTURES[name]
        assert model.embed_dim == args["embed_dim"]
        assert model.blocks[0].attn.num_heads == args["num_heads"]
        assert model.patch_embed.patch_size[0] == args["patch_size"]
