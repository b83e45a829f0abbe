"""keras_vmoe.presets.load: loading presets edited by their publisher (NaN
weights, unknown arguments, configs larger than the machine, files that block),
and the class-owned API (`Class.from_preset` returns that class, `Class.presets`
lists what it loads)."""

import json
import os
import subprocess
import sys
import textwrap
import threading

import h5py
import numpy as np
import pytest
import testing
import tiny_configs

from keras_vmoe import catalog
from keras_vmoe import cli
from keras_vmoe import models
from keras_vmoe import presets
from keras_vmoe.catalog import names
from keras_vmoe.presets import integrity
from keras_vmoe.presets import save
from keras_vmoe.utils import memory_budget

CONFIG, WEIGHTS, METADATA = names.CONFIG_FILE, save.WEIGHTS_FILE, save.METADATA_FILE


def _republish(path, name, key):
    """Records the new SHA-256 of an edited file, as its publisher would."""
    meta_path = path / METADATA
    meta = json.loads(meta_path.read_text())
    meta[key] = integrity.sha256_file(path / name)
    meta_path.write_text(json.dumps(meta))


def test_nan_weights_are_refused_naming_the_weight(preset_copy):
    with h5py.File(preset_copy / WEIGHTS, "r+") as f:
        datasets = []
        f.visititems(lambda name, node: datasets.append(name)
                     if isinstance(node, h5py.Dataset) and node.dtype.kind == "f"
                     and node.size > 1 else None)
        values = f[datasets[0]][...]
        values.flat[0] = np.nan
        f[datasets[0]][...] = values
    _republish(preset_copy, WEIGHTS, integrity.WEIGHTS_HASH_KEY)
    with pytest.raises(integrity.PresetIntegrityError,
                       match=r"model.weights.h5: weight .* holds NaN or infinite"):
        presets.from_preset(preset_copy)


def test_an_unknown_backbone_argument_is_refused_naming_it(preset_copy):
    path = preset_copy / CONFIG
    config = json.loads(path.read_text())
    config["config"]["backbone"]["config"]["sneaky_option"] = 3
    path.write_text(json.dumps(config))
    _republish(preset_copy, CONFIG, integrity.CONFIG_HASH_KEY)
    with pytest.raises(integrity.PresetIntegrityError,
                       match=r"config.json: the backbone config holds unknown "
                       r"argument\(s\) \['sneaky_option'\]"):
        presets.from_preset(preset_copy, load_weights=False)


@pytest.mark.parametrize("payload, message", [
    ({"module": "os", "class_name": "system", "config": {}, "registered_name": None},
     "an object of module 'os'"),
    ({"class_name": "__lambda__", "config": {"code": "x"}}, "a Python lambda"),
    ({"module": "builtins", "class_name": "function", "config": "eval"},
     "module 'builtins'"),
])
def test_foreign_objects_in_the_config_name_the_field(preset_copy, payload, message):
    path = preset_copy / CONFIG
    config = json.loads(path.read_text())
    config["config"]["backbone"]["config"]["moe"]["router"] = payload
    path.write_text(json.dumps(config))
    _republish(preset_copy, CONFIG, integrity.CONFIG_HASH_KEY)
    with pytest.raises(integrity.PresetIntegrityError) as error:
        presets.from_preset(preset_copy, load_weights=False)
    assert "field $.config.backbone.config.moe.router holds" in str(error.value)
    assert message in str(error.value)


def _run_cli(argv, capsys):
    code = cli.main([str(a) for a in argv])
    return code, capsys.readouterr().err


def test_gs_preset_without_tensorflow_is_a_cli_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorflow", None)
    code, err = _run_cli(["demo", "--preset", "gs://bucket/preset"], capsys)
    assert code == 1 and "\nerror: " in "\n" + err and "gs://bucket/preset" in err


GIB = 2**30


@pytest.fixture
def machine_16gib(monkeypatch):
    """A machine with 16 GiB, whatever runs the tests; no override set."""
    monkeypatch.delenv(memory_budget.ALLOW_ENV, raising=False)
    monkeypatch.setattr(memory_budget, "memory_limit", lambda: 16 * GIB)


def _edit_json(path, edit):
    with open(path) as f:
        value = json.load(f)
    edit(value)
    with open(path, "w") as f:
        json.dump(value, f)


def _backbone(config):
    return config["config"]["backbone"]["config"]


def _publish(path, edit):
    """Edits config.json as a hostile publisher would: hash recomputed."""
    _edit_json(path / CONFIG, edit)
    digest = integrity.sha256_file(path / CONFIG)
    _edit_json(path / METADATA, lambda m: m.update({integrity.CONFIG_HASH_KEY: digest}))


def _set(key, value):
    def edit(config):
        if key == "num_classes":
            config["config"]["num_classes"] = value
        elif key == "num_experts":
            _backbone(config)["moe"]["num_experts"] = value
        else:
            _backbone(config)[key] = value

    return edit


BOMBS = [
    ("hidden_dim", 10**9),
    ("mlp_dim", 10**9),
    ("num_layers", 10**6),
    ("num_experts", 10**8),
    ("num_classes", 10**9),
    ("image_size", 10**6),
]


@pytest.mark.parametrize("load_weights", [True, False])
@pytest.mark.parametrize("key, value", BOMBS)
def test_giant_config_is_refused_before_building(
    preset_copy, machine_16gib, monkeypatch, key, value, load_weights
):
    built = []
    monkeypatch.setattr(
        integrity, "expected_weight_shapes", lambda *a: built.append(a) or {}
    )
    _publish(preset_copy, _set(key, value))
    with pytest.raises(ValueError) as info:
        presets.from_preset(preset_copy, load_weights=load_weights)
    message = str(info.value)
    assert str(preset_copy / CONFIG) in message
    assert str(value) in message
    if key != "num_layers":
        assert isinstance(info.value, memory_budget.MemoryBudgetError)
        assert "17179869184 bytes" in message and memory_budget.ALLOW_ENV in message
    assert built == []  # not even an abstract build


def test_override_lets_a_large_config_through(preset_copy, machine_16gib, monkeypatch):
    _publish(preset_copy, _set("mlp_dim", 10**9))
    monkeypatch.setenv(memory_budget.ALLOW_ENV, "1")
    # Past the budget, the weights' shapes still disagree with the config.
    with pytest.raises(integrity.PresetIntegrityError, match="dense_0/kernel"):
        presets.from_preset(preset_copy)


@pytest.mark.heavy
def test_memory_bomb_under_an_address_space_limit(preset_copy, tmp_path):
    """A real process with RLIMIT_AS set: a clear error, no MemoryError/abort."""
    _publish(preset_copy, _set("num_experts", 10**8))
    script = textwrap.dedent(
        f"""
        import resource
        import keras_vmoe.presets as presets
        from keras_vmoe.utils import memory_budget

        with open("/proc/self/statm") as f:
            used = int(f.read().split()[0]) * resource.getpagesize()
        limit = used + 3 * 2**30  # what is mapped now, plus 3 GiB
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        try:
            presets.from_preset({str(preset_copy)!r}, load_weights=False)
        except memory_budget.MemoryBudgetError as error:
            print("REFUSED", error)
        """
    )
    env = {**os.environ, "KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu"}
    env.pop(memory_budget.ALLOW_ENV, None)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True,
        timeout=300, env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "REFUSED" in result.stdout, result.stdout + result.stderr[-3000:]
    assert "num_experts" in result.stdout and "100000000" in result.stdout


def _returns_within(seconds, function):
    """Runs `function` in a daemon thread; its outcome or a timeout failure."""
    outcome = {}

    def target():
        try:
            outcome["value"] = function()
        except BaseException as error:  # noqa: BLE001 - reported below
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still blocked after {seconds} s"
    return outcome


@pytest.mark.parametrize("name", [CONFIG, METADATA, WEIGHTS])
def test_fifo_in_place_of_a_preset_file_is_refused(preset_copy, name):
    os.remove(preset_copy / name)
    os.mkfifo(preset_copy / name)
    outcome = _returns_within(30, lambda: presets.from_preset(preset_copy))
    error = outcome.get("error")
    assert isinstance(error, integrity.PresetIntegrityError), outcome
    assert str(preset_copy / name) in str(error) and "FIFO" in str(error)


@pytest.mark.parametrize("load_weights", [True, False])
def test_sinkhorn_iteration_bomb_in_a_preset_is_refused(preset_copy, load_weights):
    def edit(config):
        _backbone(config)["moe"]["router"].update(
            name="sinkhorn_token_choice", sinkhorn_iterations=10**7
        )

    _publish(preset_copy, edit)
    outcome = _returns_within(
        60, lambda: presets.from_preset(preset_copy, load_weights=load_weights)
    )
    error = outcome.get("error")
    assert isinstance(error, (ValueError, TypeError)), outcome  # Keras wraps some
    assert "`sinkhorn_iterations` must be an integer between 1 and 1000" in str(error)


def test_loading_compiles_at_most_two_programs_and_gives_the_saved_model(
        tiny_classifier, preset_copy, images):
    import keras
    from testing import Programs

    if keras.backend.backend() == "jax":
        with Programs() as programs:
            model = presets.from_preset(preset_copy)
        assert programs.count <= 2
    else:
        model = presets.from_preset(preset_copy)
    for a, b in zip(tiny_classifier.weights, model.weights, strict=True):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(a.value),
                                      keras.ops.convert_to_numpy(b.value))
    np.testing.assert_array_equal(tiny_classifier.predict(images, verbose=0),
                                  model.predict(images, verbose=0))


def test_a_weight_missing_from_the_file_is_refused_naming_it(preset_copy):
    with h5py.File(preset_copy / WEIGHTS, "r+") as f:
        datasets = []
        f.visititems(lambda name, node: datasets.append(name)
                     if isinstance(node, h5py.Dataset) else None)
        missing = datasets[-1]
        del f[missing]
    _republish(preset_copy, WEIGHTS, integrity.WEIGHTS_HASH_KEY)
    with pytest.raises(integrity.PresetIntegrityError,
                       match=r"does not describe the weights .*: missing from the "
                       "weights file"):
        presets.from_preset(preset_copy)


def test_a_weight_the_loader_never_assigns_is_refused(preset_copy, monkeypatch):
    """Past the file checks, a weight left at its placeholder zeros still raises."""
    import keras

    from keras_vmoe.utils import initialization

    def load_all_but_the_last(model, path, **kwargs):
        for variable in model.weights[:-1]:
            variable.assign(variable.value)

    monkeypatch.setattr(keras.saving, "load_weights", load_all_but_the_last)
    with pytest.raises(initialization.UnassignedWeightsError, match="1 weight"):
        presets.from_preset(preset_copy)


def test_a_new_head_and_random_builds_draw_as_without_weights(preset_copy):
    """Builds that want random values are not under `skip_initializers`."""
    import keras

    keras.utils.set_random_seed(4)
    tuned = presets.from_preset(preset_copy, num_classes=3)
    bias = keras.ops.convert_to_numpy(tuned.get_layer("head").bias.value)
    np.testing.assert_allclose(bias, -np.log(3), rtol=1e-6)
    keras.utils.set_random_seed(4)
    a = presets.from_preset(preset_copy, load_weights=False)
    keras.utils.set_random_seed(4)
    b = presets.from_preset(preset_copy, load_weights=False)
    assert any(np.any(keras.ops.convert_to_numpy(v.value)) for v in a.weights
               if v.path.endswith("kernel"))
    for x, y in zip(a.weights, b.weights, strict=True):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(x.value),
                                      keras.ops.convert_to_numpy(y.value))


# --- `Class.from_preset` and `Class.presets` ------------------------------


def test_backbone_from_preset_returns_the_backbone(tiny_overrides):
    backbone = models.VisionTransformerBackbone.from_preset(
        "vmoe_s32", load_weights=False, **tiny_overrides
    )
    assert type(backbone) is models.VisionTransformerBackbone
    assert backbone.hidden_dim == tiny_overrides["hidden_dim"]


def test_task_from_preset_returns_the_task(tiny_preset_dir, tiny_classifier, images):
    model = models.ImageClassifier.from_preset(tiny_preset_dir)
    assert type(model) is models.ImageClassifier
    np.testing.assert_allclose(
        np.asarray(model(images)), np.asarray(tiny_classifier(images)), atol=1e-5
    )
    assert presets.from_preset(tiny_preset_dir).num_classes == 5


def test_backbone_preset_into_a_task_builds_a_new_head(tiny_classifier, tmp_path):
    presets.save_to_preset(tiny_classifier.backbone, tmp_path / "backbone")
    with pytest.raises(ValueError, match="num_classes"):
        models.ImageClassifier.from_preset(tmp_path / "backbone")
    model = models.ImageClassifier.from_preset(tmp_path / "backbone", num_classes=3)
    assert type(model) is models.ImageClassifier
    assert model.num_classes == 3
    for mine, theirs in zip(
        model.backbone.weights, tiny_classifier.backbone.weights, strict=True
    ):
        np.testing.assert_array_equal(np.asarray(mine.value), np.asarray(theirs.value))


def test_ensemble_classes_and_errors(tiny_overrides):
    ensemble = models.EnsembleImageClassifier.from_preset(
        "eee_s32_last2", load_weights=False, num_classes=4, **tiny_overrides
    )
    assert type(ensemble) is models.EnsembleImageClassifier
    with pytest.raises(ValueError, match="EnsembleImageClassifier.from_preset"):
        models.ImageClassifier.from_preset(
            "eee_s32_last2", load_weights=False, num_classes=4, **tiny_overrides
        )
    with pytest.raises(ValueError, match="num_classes"):
        models.VisionTransformerBackbone.from_preset(
            "vmoe_s32", load_weights=False, num_classes=4, **tiny_overrides
        )


def test_presets_listing_per_class():
    every = models.VisionTransformerBackbone.presets
    single = models.ImageClassifier.presets
    ensembles = models.EnsembleImageClassifier.presets
    assert "vmoe_b32_last2" in single and "vmoe_b32_last2" not in ensembles
    assert all(name.startswith("eee") for name in ensembles)
    assert set(single) | set(ensembles) == set(every) == set(catalog.PRESETS)
    assert all(isinstance(text, str) and text for text in every.values())


# --- The shared test base (tests/testing.py) --------------------------------

IMAGES = np.random.default_rng(0).uniform(-1, 1, size=(4, 32, 32, 3)).astype("float32")

@pytest.mark.heavy
@pytest.mark.parametrize(
    "cls,preset,shape",
    [
        (models.VisionTransformerBackbone, "vmoe_s32", (4, 32)),
        (models.ImageClassifier, "vmoe_s32", (4, 5)),
        (models.EnsembleImageClassifier, "eee_s32_last2", (4, 2, 5)),
    ],
    ids=lambda v: getattr(v, "__name__", v if isinstance(v, str) else ""),
)
def test_class_presets_through_the_shared_base(cls, preset, shape):
    overrides = tiny_configs.preset_overrides(load_weights=False)
    if cls is not models.VisionTransformerBackbone:
        overrides["num_classes"] = 5
    testing.run_preset_test(cls, preset, IMAGES, shape, **overrides)


def test_remat_override_on_every_class_keeps_the_weights(tiny_preset_dir, tiny_classifier,
                                                         tiny_overrides, images):
    model = models.ImageClassifier.from_preset(tiny_preset_dir, remat=True)
    assert model.backbone.remat and model.backbone.get_config()["remat"] is True
    np.testing.assert_allclose(np.asarray(model(images)),
                               np.asarray(tiny_classifier(images)), atol=1e-6)
    backbone = models.VisionTransformerBackbone.from_preset(tiny_preset_dir, remat=True)
    assert backbone.remat
    assert presets.from_preset(tiny_preset_dir, remat=False).backbone.remat is False
    built = models.VisionTransformerBackbone.from_preset(
        "vmoe_s32", load_weights=False, remat=True, **tiny_overrides)
    assert built.remat and all(b.remat for b in built.get_encoder_blocks())
    ensemble = models.EnsembleImageClassifier.from_preset(
        "eee_s32_last2", load_weights=False, num_classes=4, remat=True, **tiny_overrides)
    assert ensemble.backbone.remat
    with pytest.raises(ValueError, match="`remat` must be True or False"):
        presets.from_preset(tiny_preset_dir, remat="yes")


def test_scan_override_on_every_class_keeps_the_weights(tiny_preset_dir, tiny_classifier,
                                                        tiny_overrides):
    model = models.ImageClassifier.from_preset(tiny_preset_dir, scan=True)
    assert model.backbone.scan and model.backbone.get_config()["scan"] is True
    for loaded, saved in zip(model.weights, tiny_classifier.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(loaded.value), np.asarray(saved.value))
    assert models.VisionTransformerBackbone.from_preset(tiny_preset_dir, scan=True).scan
    assert presets.from_preset(tiny_preset_dir, scan=False).backbone.scan is False
    built = models.VisionTransformerBackbone.from_preset(
        "vmoe_s32", load_weights=False, scan=True, remat=True, **tiny_overrides)
    assert built.scan and built.remat
    ensemble = models.EnsembleImageClassifier.from_preset(
        "eee_s32_last2", load_weights=False, num_classes=4, scan=True, **tiny_overrides)
    assert ensemble.backbone.scan
    with pytest.raises(ValueError, match="`scan` must be True or False"):
        presets.from_preset(tiny_preset_dir, scan="yes")
