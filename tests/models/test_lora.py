"""LoRA on backbones and tasks: what trains, merge, separate save/load."""

import os

import keras
import numpy as np
import pytest
import tiny_configs

import keras_vmoe
from keras_vmoe.models import ImageClassifier
from keras_vmoe.models import VisionTransformerBackbone
from keras_vmoe.models import lora

# 16 patches and the class token: one image per token group.
CONFIG = tiny_configs.vit(px=16, patch_size=4, moe_layers=(1,), moe=tiny_configs.moe(
    router={"capacity_factor": 2.0}, group_size=17))


def _task(seed=0):
    keras.utils.set_random_seed(seed)
    model = ImageClassifier(VisionTransformerBackbone(**CONFIG), num_classes=3)
    rng = np.random.default_rng(seed)
    for v in model.weights:
        v.assign((0.3 * rng.standard_normal(v.shape)).astype("float32"))
    return model


def _lora_values(model, seed=1):
    """Random non-zero LoRA factors (B starts at zero)."""
    rng = np.random.default_rng(seed)
    for v in model.weights:
        if "lora_kernel" in v.path:
            v.assign((0.2 * rng.standard_normal(v.shape)).astype("float32"))


@pytest.fixture(scope="module")
def images16():
    return np.random.default_rng(3).uniform(-1, 1, (4, 16, 16, 3)).astype("float32")


@pytest.mark.heavy
def test_only_lora_factors_and_head_train(images16):
    model = _task()
    before = model.predict(images16, verbose=0)
    full = lora.trainable_parameter_count(model)
    model.enable_lora(2, experts=True)
    paths = sorted(v.path for v in model.trainable_weights)
    assert paths == sorted(
        [f"encoderblock_{i}/attention/{p}/lora_kernel_{ab}" for i in range(2)
         for p in ("query", "value") for ab in "ab"]
        + [f"encoderblock_1/moe/experts/lora_kernel_{k}_{ab}" for k in (0, 1)
           for ab in "ab"]
        + ["head/bias", "head/kernel"])
    # query/value A (D, r), B (r, N, K); experts A (E, D|M, r), B (E, r, M|D).
    expected = 2 * 2 * (16 * 2 + 2 * 2 * 8) + 4 * (16 * 2 + 2 * 32) * 2 + 16 * 3 + 3
    assert lora.trainable_parameter_count(model) == expected < full
    np.testing.assert_allclose(model.predict(images16, verbose=0), before, atol=1e-6)

    frozen = {v.path: np.array(v.value) for v in model.weights if not v.trainable}
    x = np.concatenate([images16] * 4)
    y = np.array([0, 1, 2, 1] * 4, "int32")
    model.compile(optimizer=keras.optimizers.Adam(1e-2))
    model.fit(x, y, epochs=2, batch_size=8, verbose=0)
    for v in model.weights:
        if v.path in frozen:
            np.testing.assert_array_equal(np.array(v.value), frozen[v.path], v.path)
    b = model.backbone.get_layer("encoderblock_1").moe_layer.experts.lora_kernel_1_b
    assert np.abs(np.array(b.value)).max() > 0  # the expert LoRA trained


@pytest.mark.heavy  # ~20-30 s on 2 cores (trains LoRA factors); .ci/run runs the group
def test_merged_model_equals_base_plus_low_rank_update(images16, tmp_path):
    model = _task()
    base = {v.path: np.array(v.value) for v in model.weights}
    model.enable_lora(2, lora_alpha=4, experts=True)
    _lora_values(model)
    expected = dict(base)
    values = {v.path: np.array(v.value) for v in model.weights}
    for i in range(2):
        for p in ("query", "value"):
            prefix = f"encoderblock_{i}/attention/{p}"
            a, b = values[f"{prefix}/lora_kernel_a"], values[f"{prefix}/lora_kernel_b"]
            expected[f"{prefix}/kernel"] = base[f"{prefix}/kernel"] + 2.0 * np.einsum(
                "dr,rnk->dnk", a, b)
    for k in (0, 1):
        prefix = "encoderblock_1/moe/experts"
        a, b = values[f"{prefix}/lora_kernel_{k}_a"], values[f"{prefix}/lora_kernel_{k}_b"]
        expected[f"{prefix}/kernel_{k}"] = base[f"{prefix}/kernel_{k}"] + 2.0 * np.einsum(
            "edr,erm->edm", a, b)
    plain = _task()
    for v in plain.weights:
        v.assign(expected[v.path])
    y = model.predict(images16, verbose=0)
    np.testing.assert_allclose(y, plain.predict(images16, verbose=0), atol=1e-4)
    assert not np.allclose(y, _task().predict(images16, verbose=0), atol=1e-3)
    # The base preset stores the merged kernels and loads without LoRA.
    path = keras_vmoe.presets.save_to_preset(model, str(tmp_path / "merged"))
    merged = keras_vmoe.presets.from_preset(path)
    assert lora.lora_config(merged) is None
    for v in merged.weights:
        np.testing.assert_allclose(np.array(v.value), expected[v.path], atol=1e-5,
                                   err_msg=v.path)


@pytest.mark.heavy
def test_lora_weights_round_trip_separately_from_the_base(images16, tmp_path):
    base_path = keras_vmoe.presets.save_to_preset(_task(), str(tmp_path / "base"))
    model = keras_vmoe.presets.from_preset(base_path)
    model.enable_lora(3)  # query/value only (the default)
    _lora_values(model)
    model.get_layer("head").bias.assign(np.array([1.0, -1.0, 0.5], "float32"))
    written = model.save_lora_weights(str(tmp_path / "adapter"))
    assert written.endswith("adapter.npz")
    assert sorted(os.listdir(tmp_path)) == ["adapter.npz", "base"]  # no temp file
    with np.load(written) as data:
        assert all("lora_kernel" in k or k.startswith(("head/", "__")) for k in data.files)
    fresh = keras_vmoe.presets.from_preset(base_path)
    fresh.load_lora_weights(written)  # enables LoRA with the saved settings
    assert lora.lora_config(fresh)["rank"] == 3
    np.testing.assert_allclose(fresh.predict(images16, verbose=0),
                               model.predict(images16, verbose=0), atol=1e-6)

    other = keras_vmoe.presets.from_preset(base_path)
    other.enable_lora(2)
    with pytest.raises(ValueError, match="differ"):
        other.load_lora_weights(written)
    with pytest.raises(FileNotFoundError):
        fresh.load_lora_weights(str(tmp_path / "missing.npz"))
    bad = tmp_path / "bad.npz"
    np.savez(bad, x=np.zeros(2))
    with pytest.raises(ValueError, match="LoRA settings"):
        keras_vmoe.presets.from_preset(base_path).load_lora_weights(str(bad))


def test_backbone_lora_and_bad_arguments():
    backbone = _task().backbone
    with pytest.raises(ValueError, match="rank"):
        backbone.enable_lora(0)
    with pytest.raises(ValueError, match="targets"):
        backbone.enable_lora(2, targets=("keys",))
    backbone.enable_lora(2, targets=("query", "key", "value", "out"))
    assert len(backbone.trainable_weights) == 2 * 4 * 2
    with pytest.raises(ValueError, match="already enabled"):
        backbone.enable_lora(2)
    dense = VisionTransformerBackbone(**dict(CONFIG, moe_layers=(), moe=None))
    with pytest.raises(ValueError, match="dense"):
        dense.enable_lora(2, experts=True)
    with pytest.raises(ValueError, match="not enabled"):
        lora.save_lora_weights(dense, "x.npz")


class _Batches(keras.utils.PyDataset):
    """Two batches of (images, labels), with a length (finetune needs one)."""

    def __init__(self, images, labels):
        super().__init__()
        self.images, self.labels = images, labels

    def __len__(self):
        return 2

    def __getitem__(self, index):
        part = slice(4 * index, 4 * index + 4)
        return self.images[part], self.labels[part]


@pytest.mark.heavy
@pytest.mark.parametrize("freeze_backbone", [False, True])
def test_finetune_keeps_the_base_frozen_under_lora(images16, freeze_backbone):
    from keras_vmoe import training

    model = _task()
    model.enable_lora(2, experts=True)
    lora_paths = {v.path for v in model.weights if "lora_kernel" in v.path}
    trained = lora_paths | {"head/kernel", "head/bias"}
    assert {v.path for v in model.trainable_weights} == trained
    frozen = {v.path: np.array(v.value) for v in model.weights if v.path not in trained}
    images = np.concatenate([images16, images16[::-1]])
    labels = np.array([0, 1, 2, 1, 2, 0, 1, 0], "int32")
    training.finetune(model, _Batches(images, labels), epochs=1, learning_rate=0.05,
                      freeze_backbone=freeze_backbone, verbose=0)
    expected = trained - (lora_paths if freeze_backbone else set())
    assert {v.path for v in model.trainable_weights} == expected
    for v in model.weights:
        if v.path in frozen:
            np.testing.assert_array_equal(np.array(v.value), frozen[v.path], v.path)
    b_values = [np.abs(np.array(v.value)).max() for v in model.weights
                if v.path in lora_paths and v.path.endswith("b")]
    assert (max(b_values) > 0) != freeze_backbone


def test_query_update_has_rank_r_and_a_follows_loralib():
    model = _task()
    model.enable_lora(3, targets=("query", "out"), experts=True)
    query = model.backbone.get_layer("encoderblock_0").attention.query
    assert tuple(query.lora_kernel_a.shape) == (16, 3)
    assert tuple(query.lora_kernel_b.shape) == (3, 2, 8)
    rng = np.random.default_rng(0)
    query.lora_kernel_b.assign(rng.standard_normal((3, 2, 8)).astype("float32"))
    delta = np.array(query.kernel) - np.array(query._kernel)  # (D, N, K)
    assert np.linalg.matrix_rank(delta.reshape(16, 16), tol=1e-5) == 3
    # Kaiming-uniform with a = √5: |A| < 1/√fan_in, and not much smaller.
    for a, fan_in in [(query.lora_kernel_a, 16),
                      (model.backbone.get_layer("encoderblock_0").attention.out
                       .lora_kernel_a, 16),
                      (model.backbone.get_layer("encoderblock_1").moe_layer.experts
                       .lora_kernel_1_a, 32)]:
        a = np.abs(np.array(a.value))
        assert 0.5 / np.sqrt(fan_in) < a.max() <= 1 / np.sqrt(fan_in), a.max()


@pytest.mark.parametrize("rank", [17, 10**9])
def test_a_rank_above_the_layer_dimensions_is_refused_before_allocating(rank):
    model = _task()
    count = len(model.weights)
    with pytest.raises(ValueError, match=r"rank.*at most min\(fan_in, fan_out\) = 16"):
        model.enable_lora(rank)
    assert len(model.weights) == count and lora.lora_config(model) is None
    with pytest.raises(ValueError, match="min.* = 16"):
        model.backbone.get_layer("encoderblock_1").moe_layer.experts.enable_lora(17)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """A base preset and a LoRA file for it: `(base path, {member: array})`."""
    directory = tmp_path_factory.mktemp("lora_files")
    base = keras_vmoe.presets.save_to_preset(_task(), str(directory / "base"))
    model = keras_vmoe.presets.from_preset(base)
    model.enable_lora(2)
    _lora_values(model)
    written = model.save_lora_weights(str(directory / "adapter"))
    with np.load(written) as data:
        return base, {k: data[k] for k in data.files}


@pytest.fixture(scope="module")
def adapter_base_model(adapter):
    return keras_vmoe.presets.from_preset(adapter[0])


def _write(tmp_path, members, name="tampered.npz"):
    path = str(tmp_path / name)
    np.savez(path, **members)
    return path


def _settings(members):
    import json

    return json.loads(str(members["__lora_config__"]))


def _with_settings(members, **changes):
    import json

    settings = dict(_settings(members), **changes)
    return dict(members, __lora_config__=np.array(json.dumps(settings)))


@pytest.mark.parametrize("case, match", [
    ("foreign weight", "neither LoRA factors nor the head"),
    ("nan factor", "non-finite"),
    ("complex factor", "complex.*real floating point"),
    ("settings not a dict", "must be a JSON object"),
    ("settings not json", "not a JSON record"),
    ("settings without rank", r"lack \['rank'\]"),
    ("settings rank 1e9", r"at most min\(fan_in, fan_out\) = 16"),
    ("settings an int array", "not one string"),
    ("old query layout", "old keras_vmoe.lora/1 layout"),
])
def test_bad_lora_files_are_refused_naming_the_file(adapter, adapter_base_model, tmp_path,
                                                    case, match):
    import json

    members = dict(adapter[1])
    factor = "encoderblock_0/attention/query/lora_kernel_b"
    if case == "foreign weight":
        members["encoderblock_0/mlp/dense_0/kernel"] = np.zeros((16, 32), "float32")
    elif case == "nan factor":
        members[factor] = np.where(members[factor] > 0, np.nan, members[factor])
    elif case == "complex factor":
        members[factor] = members[factor] * (1 + 1j)
    elif case == "settings not a dict":
        members["__lora_config__"] = np.array(json.dumps([1, 2]))
    elif case == "settings not json":
        members["__lora_config__"] = np.array("{rank: 2")
    elif case == "settings without rank":
        settings = _settings(members)
        del settings["rank"]
        members["__lora_config__"] = np.array(json.dumps(settings))
    elif case == "settings rank 1e9":
        members = _with_settings(members, rank=10**9)
    elif case == "settings an int array":
        members["__lora_config__"] = np.arange(3)
    elif case == "old query layout":
        members = _with_settings(members, format="keras_vmoe.lora/1")
    path = _write(tmp_path, members)
    model = adapter_base_model
    before = {v.path: np.array(v.value) for v in model.weights}
    with pytest.raises(ValueError, match=match) as error:
        model.load_lora_weights(path)
    assert path in str(error.value)
    # Nothing was allocated or assigned: the shared model stays without LoRA.
    assert lora.lora_config(model) is None
    assert [v.path for v in model.weights] == list(before)
    for v in model.weights:
        np.testing.assert_array_equal(np.array(v.value), before[v.path])


@pytest.mark.heavy  # training and saving an int8 model with LoRA: about 25 s
def test_lora_over_int8_trains_float_factors_and_keeps_int8_frozen(images16, tmp_path):
    model = _task()
    model.quantize("int8")
    with pytest.raises(ValueError, match="head is quantized"):
        model.enable_lora(2, train_head=True)
    assert lora.lora_config(model) is None
    model.enable_lora(2, experts=True)  # the int8 head stays frozen
    trainable = {v.path for v in model.trainable_weights}
    assert trainable and all("lora_kernel" in p for p in trainable)
    assert all("float" in str(v.dtype) for v in model.trainable_weights)
    frozen = {v.path: np.array(v.value) for v in model.weights if v.path not in trainable}
    x = np.concatenate([images16] * 2)
    y = np.array([0, 1, 2, 1] * 2, "int32")
    before = model.predict(x, verbose=0)
    model.compile(optimizer=keras.optimizers.Adam(1e-2))
    model.fit(x, y, epochs=2, batch_size=4, verbose=0)
    for v in model.weights:
        if v.path in frozen:
            np.testing.assert_array_equal(np.array(v.value), frozen[v.path], v.path)
    after = model.predict(x, verbose=0)
    assert np.abs(after - before).max() > 1e-4  # the float factors trained
    # The preset stores the merged kernels quantized again (int8 rounding).
    path = keras_vmoe.presets.save_to_preset(model, str(tmp_path / "merged"))
    merged = keras_vmoe.presets.from_preset(path)
    assert lora.lora_config(merged) is None
    assert str(merged.backbone.get_layer("encoderblock_1").moe_layer.experts
               .kernel_0.dtype) == "int8"
    np.testing.assert_allclose(merged.predict(x, verbose=0), after,
                               atol=0.05 * np.abs(after).max())


def test_a_lora_file_of_other_layers_still_loads(adapter, tmp_path):
    """A file without query/key/value factors reads in the previous format too."""
    base, members = adapter
    model = keras_vmoe.presets.from_preset(base)
    model.enable_lora(2, targets=("out",))
    _lora_values(model)
    written = model.save_lora_weights(str(tmp_path / "out_only"))
    with np.load(written) as data:
        old = _with_settings({k: data[k] for k in data.files}, format="keras_vmoe.lora/1")
    fresh = keras_vmoe.presets.from_preset(base)
    fresh.load_lora_weights(_write(tmp_path, old, "old.npz"))
    saved = {w.path: np.array(w.value) for w in model.weights}
    for v in fresh.weights:
        np.testing.assert_array_equal(np.array(v.value), saved[v.path], v.path)
