"""The layers, models, presets and training on PyTorch and TensorFlow, exact to JAX.

Marker `backends` (deselected by default; `.ci/run` installs the `torch`
extra and runs them). `driver.py` runs under each backend in its own
process (see conftest.py): the logits of every converted upstream fixture
must match the JAX logits (f32 dispatch <= 1e-5; bf16 dispatch, Soft MoE
included, within the noise of bf16 rounding ties: 2e-4) and the upstream
ones, and a few `fit` epochs, `evaluate` and `keras_vmoe.training.finetune`
must give the JAX losses (rtol 1e-4; Soft MoE, bf16 dispatch, from the
second epoch on 5e-3). On TensorFlow `fit` runs as a
`tf.function` with an unknown batch size, with the fixture grouping and
with the default one (all the tokens of a batch in one group), and with a
partial last batch (another group size and capacity).
"""

import json
import pathlib

import numpy as np
import pytest

pytestmark = pytest.mark.backends
# The tests that read the drivers' results share one worker under
# `--dist loadgroup` (`.ci/run`), so the drivers run once.
DRIVER = pytest.mark.xdist_group("driver_results")


def _driver():
    """driver.py as a module (it also runs as a script in each backend's process)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_backends_driver", pathlib.Path(__file__).with_name("driver.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_DRIVER = _driver()
UPSTREAM = _DRIVER.UPSTREAM
CASES = _DRIVER.CASES
FIT_CASES = tuple("-".join(case) for case in _DRIVER.FIT_CASES)


def _result(driver_results, backend):
    for name in ("jax", backend):
        assert "error" not in driver_results[name], (
            f"the driver failed on {name}:\n{driver_results[name]['error']}")
    return driver_results["jax"], driver_results[backend]


def _upstream_logits(fixture, variant):
    suffix = "" if variant == "main" else f"_{variant}"
    return np.load(UPSTREAM / fixture / f"logits{suffix}.npy")


@DRIVER
@pytest.mark.parametrize("fixture,variant", CASES, ids=[f"{f}-{v}" for f, v in CASES])
def test_fixture_logits_match_jax(driver_results, backend, fixture, variant):
    jax_out, out = _result(driver_results, backend)
    key = f"{fixture}-{variant}"
    actual = np.asarray(out["logits"][key])
    expected = np.asarray(jax_out["logits"][key])
    f32 = variant == "f32dispatch"
    # bf16 dispatch: a float32 difference of one ulp between backends can
    # round a dispatched value to the neighbouring bfloat16 (2**-8 relative);
    # the tiny Soft MoE, whose every token reaches every slot, shows the most
    # (1.3e-4 to 2.1e-4 on TensorFlow, depending on the CPU's instruction set).
    atol = 1e-5 if f32 else 5e-4
    diff = float(np.max(np.abs(actual - expected)))
    assert diff <= atol, f"{backend} {key}: max abs diff to JAX {diff:.3g} > {atol}"
    upstream = _upstream_logits(fixture, variant).reshape(actual.shape)
    assert np.max(np.abs(actual - upstream)) <= (1e-4 if f32 else 1e-3)


@DRIVER
def test_saved_and_reloaded_preset_matches_jax(driver_results, backend):
    jax_out, out = _result(driver_results, backend)
    actual = np.asarray(out["preset"])
    np.testing.assert_allclose(actual, np.asarray(jax_out["preset"]), rtol=0, atol=1e-5)
    upstream = _upstream_logits("vmoe_tiny", "f32dispatch").reshape(actual.shape)
    np.testing.assert_allclose(actual, upstream, rtol=0, atol=1e-4)


@DRIVER
@pytest.mark.parametrize("case", FIT_CASES)
def test_fit_and_evaluate_losses_match_jax(driver_results, backend, case):
    jax_out, out = _result(driver_results, backend)
    expected, actual = jax_out["fit"][case], out["fit"][case]
    assert expected["fit"][0] != expected["fit"][-1]  # it trained
    # Soft MoE always dispatches in bf16: a 1-ulp difference before a bf16
    # rounding moves a value by one bf16 step. The first epoch's loss agrees
    # to 1e-4 (3e-5 seen); SGD at lr 0.1 (the loss jumps to 5.8 in epoch 2)
    # amplifies such ties, to 2e-3 relative after three epochs. f32
    # dispatch: 1e-4 throughout (3e-6 seen).
    rtol = 5e-3 if case.startswith("softmoe") else 1e-4
    np.testing.assert_allclose(actual["fit"][0], expected["fit"][0], rtol=1e-4,
                               err_msg=f"{backend} {case} first-epoch loss")
    np.testing.assert_allclose(actual["fit"], expected["fit"], rtol=rtol,
                               err_msg=f"{backend} {case} fit losses")
    np.testing.assert_allclose(actual["evaluate"], expected["evaluate"], rtol=rtol,
                               err_msg=f"{backend} {case} evaluate loss")


@DRIVER
def test_finetune_recipe_losses_match_jax(driver_results, backend):
    jax_out, out = _result(driver_results, backend)
    assert jax_out["finetune"][0] != jax_out["finetune"][-1]
    np.testing.assert_allclose(out["finetune"], jax_out["finetune"], rtol=1e-4)


JAX_ONLY = r"""
import json, os
import keras_vmoe
from keras_vmoe import distribution
from keras_vmoe.training import memory_plan
from keras_vmoe.utils import malloc_tuning
from keras_vmoe.utils.backend import JaxOnlyError

os.environ["KERAS_DISTRIBUTION_NUM_PROCESSES"] = "2"
calls = {
    "make_mesh": lambda: distribution.make_mesh(data=1),
    "make_distribution": lambda: distribution.make_distribution("data"),
    "layout_map": lambda: distribution.layout_map(None, "expert"),
    "memory_plan": lambda: memory_plan.memory_plan("vmoe_b32", {"data": 1}, 8),
    "initialize": distribution.initialize,
    "launch": lambda: distribution.launch.launch(["true"]),
    "reuse_freed_memory": malloc_tuning.reuse_freed_memory,
    "restart_with_hugepages": malloc_tuning.restart_with_hugepages,
}
errors = {}
for name, call in calls.items():
    try:
        call()
        errors[name] = None
    except JaxOnlyError as e:
        errors[name] = str(e)
print(json.dumps(errors))
"""


def test_jax_only_features_refuse_other_backends(backend, run_script):
    errors = run_script(backend, "import keras_vmoe.distribution.launch\n" + JAX_ONLY)
    for name, message in errors.items():
        assert message is not None, f"{name} ran on {backend}"
        assert f"Keras runs on '{backend}'" in message, message
        assert "KERAS_BACKEND=jax" in message, message
        assert name in message, message


IMPORT_KERAS_FIRST = r"""
import json, os, warnings
os.environ.pop("KERAS_BACKEND", None)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    {imports}
    import keras
print(json.dumps({{"backend": keras.config.backend(),
                  "env": os.environ["KERAS_BACKEND"],
                  "warnings": [str(w.message) for w in caught
                               if "KERAS_BACKEND" in str(w.message)]}}))
"""


def test_keras_imported_first_keeps_its_backend_quietly(tmp_path, run_script):
    # A fresh KERAS_HOME: Keras writes its own default backend (TensorFlow)
    # into a new keras.json; keras_vmoe follows Keras' choice.
    code = IMPORT_KERAS_FIRST.format(imports="import keras; import keras_vmoe")
    code = f"import os; os.environ['KERAS_HOME'] = {str(tmp_path)!r}\n" + code
    out = run_script("jax", code)
    assert out == {"backend": "tensorflow", "env": "tensorflow", "warnings": []}


def test_keras_vmoe_imported_first_selects_jax_quietly(tmp_path, run_script):
    code = IMPORT_KERAS_FIRST.format(imports="import keras_vmoe")
    code = f"import os; os.environ['KERAS_HOME'] = {str(tmp_path)!r}\n" + code
    out = run_script("jax", code)
    assert out == {"backend": "jax", "env": "jax", "warnings": []}


def test_missing_backend_package_gives_an_install_hint(run_script):
    code = (
        "import json, sys\n"
        "sys.modules['torch'] = None  # as if PyTorch were not installed\n"
        "try:\n"
        "    import keras_vmoe\n"
        "    print(json.dumps(None))\n"
        "except ImportError as e:\n"
        "    print(json.dumps(str(e)))\n"
    )
    message = run_script("torch", code)
    assert message is not None
    assert "KERAS_BACKEND=torch" in message and "pip install" in message


@DRIVER
def test_driver_output_is_json_serialisable(driver_results):
    # The comparison above reads these; a failed backend shows its log here.
    json.dumps(driver_results)


SYMBOLIC_CAPACITY = r"""
import json
import tensorflow as tf
from keras_vmoe.layers.capacity import compute_capacity

cases, expected = [], []
for n in (1, 7, 34, 65, 130, 800, 1576, 4097):
    for e in (2, 4, 8, 32):
        for cf in (0.5, 1.0, 1.05, 1.25, 1.5, 2.0, 4.0, 8.0):
            for rounding in ("ceil", "round"):
                for multiple in (1, 4):
                    for cap in (None, max(1, n // 2)):
                        try:
                            expected.append(compute_capacity(n, e, cf, rounding,
                                                             multiple, cap))
                        except ValueError:
                            continue
                        cases.append((n, e, cf, rounding, multiple, cap))

@tf.function(input_signature=[tf.TensorSpec((), tf.int32)])
def symbolic(n):  # n is a graph tensor, as the batch size in `fit`
    return tf.stack([compute_capacity(n * 0 + c[0], c[1], c[2], c[3], c[4],
                                      None if c[5] is None else n * 0 + c[5])
                     for c in cases])

print(json.dumps({"expected": expected, "actual": symbolic(0).numpy().tolist()}))
"""


def test_symbolic_capacity_in_a_tensorflow_graph_equals_the_python_one(run_script):
    pytest.importorskip("tensorflow")
    out = run_script("tensorflow", SYMBOLIC_CAPACITY)
    assert len(out["expected"]) > 1000
    assert out["actual"] == out["expected"]


SKIPPED_LOADS = r"""
import json, os, sys, tempfile
import keras, numpy as np
sys.path.insert(0, {tests!r})
from tiny_configs import vmoe
from keras_vmoe import models, presets
from keras_vmoe.utils import initialization

keras.utils.set_random_seed(2)
model = models.ImageClassifier(models.VisionTransformerBackbone(**vmoe()), num_classes=3)
with initialization.eager_initializers():
    keras.utils.set_random_seed(2)
    eager = models.ImageClassifier(models.VisionTransformerBackbone(**vmoe()), num_classes=3)
images = np.random.RandomState(0).uniform(-1, 1, (2, 32, 32, 3)).astype("float32")
expected = np.asarray(model.predict(images, verbose=0))
folder = tempfile.mkdtemp()
presets.save_to_preset(model, os.path.join(folder, "preset"))
model.save(os.path.join(folder, "model.keras"))
calls = []
for cls in (keras.initializers.VarianceScaling, keras.initializers.RandomNormal,
            keras.initializers.Zeros, keras.initializers.Ones, keras.initializers.Constant):
    def record(self, shape, dtype=None, original=cls.__call__):
        calls.append(list(shape))
        return original(self, shape, dtype=dtype)
    cls.__call__ = record
out = {{"eager_build_equal": all(
    np.array_equal(keras.ops.convert_to_numpy(a.value), keras.ops.convert_to_numpy(b.value))
    for a, b in zip(model.weights, eager.weights, strict=True))}}
for kind, load in (("preset", lambda: presets.from_preset(os.path.join(folder, "preset"))),
                   ("keras", lambda: keras.saving.load_model(os.path.join(folder, "model.keras")))):
    calls.clear()
    loaded = load()
    out[kind] = {{
        "draws": list(calls),
        "weights_equal": all(np.array_equal(keras.ops.convert_to_numpy(a.value),
                                            keras.ops.convert_to_numpy(b.value))
                             for a, b in zip(model.weights, loaded.weights, strict=True)),
        "outputs_equal": bool(np.array_equal(
            np.asarray(loaded.predict(images, verbose=0)), expected)),
    }}
print(json.dumps(out))
"""


def test_presets_and_keras_files_load_without_draws_and_equal(backend, run_script):
    # Loading builds the model under `skip_initializers()`: no initializer
    # runs (on every backend), and the weights and outputs are the saved
    # model's, bit for bit. Random builds are the same batched or not.
    tests = str(pathlib.Path(__file__).resolve().parents[1])
    out = run_script(backend, SKIPPED_LOADS.format(tests=tests))
    assert out["eager_build_equal"]
    for kind in ("preset", "keras"):
        assert out[kind] == {"draws": [], "weights_equal": True, "outputs_equal": True}, kind
