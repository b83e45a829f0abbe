"""Quantized presets round-trip; the int8 byte plan equals the measured bytes;
`keras-vmoe quantize` writes a preset that loads and predicts like the model
it printed figures for; a tampered quantization record is refused.

Marker `export` (the deploy group that .ci/run runs; about 2 min of model
builds on 2 cores), with no export extra needed."""

import json

import numpy as np
import pytest
import tiny_configs

import keras_vmoe
from keras_vmoe.cli import main as cli_main
from keras_vmoe.deploy import int8_plan
from keras_vmoe.deploy import quantize_model
from keras_vmoe.deploy.quantize import weight_bytes
from keras_vmoe.presets import integrity
from keras_vmoe.presets.quantization import QUANTIZATION_KEY

pytestmark = pytest.mark.export

KINDS = ("sparse", "soft", "ensemble")
# Random weights everywhere (a zero head would move no logit).
_model = tiny_configs.composition_model


def _images(n=4):
    return np.random.default_rng(1).uniform(-1, 1, (n, 16, 16, 3)).astype("float32")


@pytest.mark.parametrize("kind", KINDS)
def test_quantized_preset_round_trips_exactly(kind, tmp_path):
    model = _model(kind)
    x = _images()
    before = np.asarray(model.predict_on_batch(x))
    plan = int8_plan(model)
    report = quantize_model(model)
    after = np.asarray(model.predict_on_batch(x))
    assert report["bytes_after"] == plan["int8_bytes"] == weight_bytes(model)["total"]
    assert report["layers"] >= 9  # 2 blocks x (q, k, v, out) + experts/mlp + head
    assert 0 < np.abs(after - before).max() < 0.05 * np.abs(before).max() + 1e-3

    path = keras_vmoe.presets.save_to_preset(model, tmp_path / "int8")
    config = json.loads((tmp_path / "int8" / "config.json").read_text())
    assert any(p.endswith("moe/experts") for p in config[QUANTIZATION_KEY]["layers"])
    loaded = keras_vmoe.presets.from_preset(path)
    np.testing.assert_array_equal(np.asarray(loaded.predict_on_batch(x)), after)
    assert weight_bytes(loaded) == weight_bytes(model)
    metadata = json.loads((tmp_path / "int8" / "metadata.json").read_text())
    assert metadata["quantization"] == {"mode": "int8", "layers": report["layers"]}


def test_float_preset_has_no_quantization_record(tmp_path):
    keras_vmoe.presets.save_to_preset(_model("sparse"), tmp_path / "f32")
    config = json.loads((tmp_path / "f32" / "config.json").read_text())
    assert QUANTIZATION_KEY not in config


def _rewrite_config(preset, edit):
    config_path = preset / "config.json"
    config = json.loads(config_path.read_text())
    edit(config)
    config_path.write_text(json.dumps(config))
    metadata_path = preset / "metadata.json"
    metadata = json.loads(metadata_path.read_text())
    integrity.record_hashes(metadata, str(preset))  # a consistent, edited preset
    metadata_path.write_text(json.dumps(metadata))


@pytest.mark.parametrize("edit,message", [
    (lambda c: c[QUANTIZATION_KEY]["layers"].update({"no/such/layer": "int8"}),
     "does not have: \\['no/such/layer'\\]"),
    (lambda c: c[QUANTIZATION_KEY]["layers"].update(head="int4"),
     "layer 'head' has mode 'int4'; valid modes: \\['int8'\\]"),
    (lambda c: c.update({QUANTIZATION_KEY: ["head"]}), "must be"),
    (lambda c: c.pop(QUANTIZATION_KEY), "does not describe the weights"),
])
def test_tampered_quantization_record_is_refused(tmp_path, edit, message):
    model = _model("sparse")
    quantize_model(model)
    keras_vmoe.presets.save_to_preset(model, tmp_path / "int8")
    _rewrite_config(tmp_path / "int8", edit)
    with pytest.raises(ValueError, match=message):
        keras_vmoe.presets.from_preset(str(tmp_path / "int8"))


def test_quantize_twice_and_unknown_mode_are_refused():
    model = _model("sparse")
    with pytest.raises(ValueError, match="mode='int4'"):
        quantize_model(model, "int4")
    quantize_model(model)
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(model)


def test_cli_quantize_writes_a_loadable_int8_preset(tmp_path, capsys):
    model = _model("sparse")
    keras_vmoe.presets.save_to_preset(model, tmp_path / "f32")
    code = cli_main(["quantize", "--preset", str(tmp_path / "f32"),
                     "--output", str(tmp_path / "int8"), "--probe-images", "4"])
    assert code == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["mode"] == "int8" and report["ratio"] > 1.5
    assert 0 < report["probe"]["max_abs_logit_change"] < 0.5
    loaded = keras_vmoe.presets.from_preset(report["output"])
    assert weight_bytes(loaded)["total"] == report["bytes_after"]
    assert weight_bytes(loaded)["int8"] > 0


def test_cli_quantize_bad_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli_main(["quantize", "--preset", "x", "--output", str(tmp_path / "o"),
                  "--probe-images", "100000"])
    assert "between 1 and 256" in capsys.readouterr().err
    assert cli_main(["quantize", "--preset", "no_such_preset",
                     "--output", str(tmp_path / "o")]) != 0
    assert "Unknown preset 'no_such_preset'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_int8_benchmark_quick_reports_bytes_and_fixture_changes(tmp_path):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[2] / "benchmarks" / "int8.py"
    spec = importlib.util.spec_from_file_location("_bench_int8", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "int8.json"
    module.main(["--quick", "--allow-loaded", "--output", str(out)])
    result = json.loads(out.read_text())
    plan = result["bytes"]["soft_moe_s16_128e"]
    assert 3.9 < plan["ratio"] < 4.0 and plan["parameters"] > 9e8
    assert set(result["fixtures"]) == {"vmoe_tiny", "vmoe_tiny_ec", "eee_tiny",
                                       "softmoe_tiny"}
    for name, fixture in result["fixtures"].items():
        assert fixture["relative_to_max_logit"] < 0.05, (name, fixture)


@pytest.fixture(scope="module")
def int8_preset(tmp_path_factory):
    """An int8 V-MoE preset and the float model it was quantized from."""
    directory = tmp_path_factory.mktemp("int8_overrides")
    model = _model("sparse")
    float_path = keras_vmoe.presets.save_to_preset(model, directory / "float")
    quantize_model(model)
    return str(float_path), str(keras_vmoe.presets.save_to_preset(model, directory / "int8"))


@pytest.mark.parametrize("overrides", [
    {"image_size": 32}, {"num_classes": 5}, {"image_size": 32, "num_classes": 5}])
def test_int8_preset_takes_the_preset_overrides(int8_preset, overrides):
    from keras_vmoe.deploy.quantize import quantized_layers

    float_path, int8_path = int8_preset
    loaded = keras_vmoe.presets.from_preset(int8_path, **overrides)
    size = overrides.get("image_size", 16)
    x = np.random.default_rng(2).uniform(-1, 1, (2, size, size, 3)).astype("float32")
    layers = quantized_layers(loaded)
    assert "encoderblock_1/moe/experts" in layers
    assert ("head" in layers) == ("num_classes" not in overrides)  # a new head is float
    # The same as overriding the float preset, then quantizing it: int8 values
    # and scales come from the same float weights.
    reference = keras_vmoe.presets.from_preset(float_path, **overrides)
    reference.quantize("int8")
    if "num_classes" in overrides:  # new heads: same zero kernel, same bias
        assert "head" not in layers
        reference = keras_vmoe.presets.from_preset(float_path, **overrides)
        from keras_vmoe.presets.overrides import _quantize_like

        _quantize_like(loaded, reference)
    for a, b in zip(loaded.weights, reference.weights, strict=True):
        assert a.path == b.path and str(a.dtype) == str(b.dtype)
        np.testing.assert_array_equal(np.asarray(a.value), np.asarray(b.value), a.path)
    assert np.asarray(loaded.predict_on_batch(x)).shape == (2, overrides.get("num_classes", 3))


def _tamper_weights(preset, edit):
    import h5py

    from keras_vmoe.presets import integrity

    with h5py.File(preset / "model.weights.h5", "r+") as file:
        datasets = []
        file.visititems(lambda name, item: datasets.append(name)
                        if isinstance(item, h5py.Dataset) else None)
        edit(file, datasets)
    metadata_path = preset / "metadata.json"
    metadata = json.loads(metadata_path.read_text())
    integrity.record_hashes(metadata, str(preset))  # a consistent, edited preset
    metadata_path.write_text(json.dumps(metadata))


def _float_in_place_of_int8(file, datasets):
    name = next(n for n in datasets if file[n].dtype == np.int8)
    values = file[name][()].astype("float32") + 0.25
    del file[name]
    file[name] = values


def _nan_scale(file, datasets):
    # An expert bank's scales: float (E, out), all positive (its random
    # biases of the same shape have negative values).
    name = next(n for n in datasets if "experts" in n and file[n].dtype == np.float32
                and file[n].ndim == 2 and np.all(file[n][()] > 0))
    values = file[name][()]
    values[0, 0] = np.nan
    file[name][...] = values


def _nan_head_bias(file, datasets):
    # The head (the task's only top-level Dense): its float bias of
    # `num_classes` values.
    name = next(n for n in datasets if n.startswith("layers/dense/") and file[n].ndim == 1
                and file[n].shape[0] == 3 and file[n].dtype == np.float32)
    values = file[name][()]
    values[1] = np.nan
    file[name][...] = values


@pytest.mark.parametrize("edit, message", [
    (_float_in_place_of_int8, r"stored as float32, not int8"),
    (_nan_scale, r"scales that are not finite"),
    (_nan_head_bias, r"weight head/bias holds NaN or infinite values"),
])
def test_int8_preset_with_tampered_weights_is_refused(int8_preset, tmp_path, edit, message):
    import shutil

    preset = tmp_path / "tampered"
    shutil.copytree(int8_preset[1], preset)
    _tamper_weights(preset, edit)
    with pytest.raises(ValueError, match=message) as error:
        keras_vmoe.presets.from_preset(str(preset))
    assert "model.weights.h5" in str(error.value)
