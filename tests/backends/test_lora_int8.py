"""LoRA and int8 models on PyTorch and TensorFlow against JAX.

The backend pairs of the composition matrix (tests/test_composition.py):
for a tiny V-MoE, Soft MoE and E³ model (`composition_model`), this (JAX)
process writes an int8 preset, an int8 `.keras` file, and a float preset
with a LoRA adapter (random factors on query, value, out and the experts);
one process per backend loads all of them (`from_preset`,
`keras.saving.load_model`, `load_lora_weights`) and predicts the same
images. Marker `backends` (.ci/run installs torch and runs the
group).
"""

import json

import keras
import numpy as np
import pytest
from tiny_configs import composition_model

import keras_vmoe

pytestmark = pytest.mark.backends

KINDS = ("sparse", "soft", "ensemble")

PREDICT = r"""
import json
import numpy as np
import keras
import keras_vmoe

cases = json.loads({cases!r})
images = np.load({images!r})
logits = {{}}
for name, case in cases.items():
    if case.get("keras"):
        model = keras.saving.load_model(case["keras"])
    else:
        model = keras_vmoe.presets.from_preset(case["preset"])
    if case["adapter"]:
        model.load_lora_weights(case["adapter"])
    logits[name] = keras.ops.convert_to_numpy(model.predict_on_batch(images)).tolist()
print(json.dumps(logits))
"""


@pytest.fixture(scope="module")
def jax_cases(tmp_path_factory):
    """`(cases, images path, {case: JAX logits})`, written by this process."""
    assert keras.config.backend() == "jax"
    root = tmp_path_factory.mktemp("lora_int8")
    images = np.random.default_rng(1).uniform(-1, 1, (4, 16, 16, 3)).astype("float32")
    np.save(root / "images.npy", images)
    cases, logits = {}, {}
    for kind in KINDS:
        model = composition_model(kind)
        float_preset = keras_vmoe.presets.save_to_preset(model, root / f"{kind}_float")
        model.enable_lora(2, targets=("query", "value", "out"), experts=True)
        rng = np.random.default_rng(5)  # B starts at zero: give it values
        for v in model.weights:
            if "lora_kernel" in v.path:
                v.assign((0.2 * rng.standard_normal(v.shape)).astype("float32"))
        adapter = model.save_lora_weights(str(root / f"{kind}.lora.npz"))
        cases[f"{kind}-lora"] = {"preset": str(float_preset), "adapter": str(adapter)}
        logits[f"{kind}-lora"] = np.asarray(model.predict_on_batch(images))

        quantized = composition_model(kind)
        quantized.quantize("int8")
        cases[f"{kind}-int8"] = {"adapter": None, "preset": str(
            keras_vmoe.presets.save_to_preset(quantized, root / f"{kind}_int8"))}
        logits[f"{kind}-int8"] = np.asarray(quantized.predict_on_batch(images))
        keras_file = str(root / f"{kind}_int8.keras")
        quantized.save(keras_file)
        cases[f"{kind}-int8-keras"] = {"adapter": None, "keras": keras_file}
        logits[f"{kind}-int8-keras"] = logits[f"{kind}-int8"]
    return cases, str(root / "images.npy"), logits


# Float32 dispatch (V-MoE): 1e-5; bfloat16 dispatch (Soft MoE, E³): a
# 1-ulp difference before a bf16 rounding moves a value by one bf16 step,
# 1e-4 as in test_backends.py (LoRA and int8 alike: 1.5e-7 seen). The int8
# Dense layers also quantize their inputs per token (W8A8): a 1-ulp
# difference before that rounding moves one activation by a whole int8 step
# (1/127 of its token's abs-max). E³ int8 meets such a tie on these images
# (its ensemble probabilities 3.7e-3 from JAX's, the same on torch and
# tensorflow): 1e-2 there.
BOUNDS = {"sparse-lora": 1e-5, "soft-lora": 1e-4, "ensemble-lora": 1e-4,
          "sparse-int8": 1e-5, "soft-int8": 1e-4, "ensemble-int8": 1e-2,
          "sparse-int8-keras": 1e-5, "soft-int8-keras": 1e-4, "ensemble-int8-keras": 1e-2}


@pytest.mark.xdist_group("jax_cases")  # built once, on one worker
def test_lora_and_int8_presets_give_the_jax_logits(jax_cases, backend, run_script):
    cases, images, expected = jax_cases
    actual = run_script(backend, PREDICT.format(cases=json.dumps(cases), images=images))
    assert set(actual) == set(expected)
    failures = []
    for name, want in expected.items():
        got = np.asarray(actual[name])
        bound = BOUNDS[name]
        diff = float(np.max(np.abs(got - want))) if got.shape == want.shape else np.inf
        print(f"{backend} {name}: max abs diff to JAX {diff:.3g} (bound {bound})")
        if not diff <= bound:
            failures.append(f"{name}: max abs diff to JAX {diff:.3g} > {bound}")
    assert not failures, f"{backend}: " + "; ".join(failures)
