"""int8 weights (`model.quantize("int8")`): bytes, CPU latency and accuracy.

Four measurements, one JSON object:

* `bytes`: weight bytes in float32 and after int8 for V-MoE B/16 (the
  released ImageNet-21k model, E=8 every 2nd block), Soft MoE S/16 (128
  experts) and V-MoE-15B, from `keras_vmoe.deploy.int8_plan` on abstract
  models (shapes only; the plan equals the measured bytes of real models,
  `tests/deploy/test_int8_presets.py`).
* `latency`: `predict_on_batch` of a V-MoE S/32 at 224 px (E=8, random
  weights), float32 vs int8, median / min / max of `--reps` calls after 2
  warm-up calls, on this CPU.
* `fixtures`: the upstream fixtures (tests/data/upstream_vmoe) converted
  with the default routing: max |logit change| after int8, relative to the
  largest logit, and top-1 agreement on their inputs.
* `digits` (with `--digits-preset`, e.g. the main job's
  `keras_vmoe_finetune/preset`): test accuracy of the digits test split
  (360 images) in float32 and int8.

    python benchmarks/int8.py --digits-preset keras_vmoe_finetune/preset \\
        --output benchmarks/results/int8.json

`--quick` skips the latency model and the byte plans of the large models
(the tests run it).
"""

import argparse
import glob
import os
import platform
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import harness  # noqa: E402

BYTES_PRESETS = ("vmoe_b16_imagenet21k_randaug_strong", "soft_moe_s16_128e", "vmoe_15b")
LATENCY = dict(image_size=224, num_classes=1000, load_weights=False)


def byte_plans(names):
    from keras_vmoe.catalog import PRESETS
    from keras_vmoe.deploy import int8_plan
    from keras_vmoe.models import ImageClassifier
    from keras_vmoe.models import VisionTransformerBackbone
    from keras_vmoe.models.configs import abstract_weights
    from keras_vmoe.presets.load import catalog_backbone_config

    plans = {}
    for name in names:
        entry = PRESETS[name]
        with abstract_weights():
            model = ImageClassifier(
                VisionTransformerBackbone(**catalog_backbone_config(entry)),
                num_classes=entry["task"]["num_classes"], compile=False)
            plans[name] = int8_plan(model)
        plans[name]["float32_gb"] = round(plans[name]["float32_bytes"] / 1e9, 3)
        plans[name]["int8_gb"] = round(plans[name]["int8_bytes"] / 1e9, 3)
    return plans


def _timed(fn, reps):
    fn()
    fn()  # compile, then one more untimed call
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return {"median_ms": round(float(np.median(times)), 2),
            "min_ms": round(min(times), 2), "max_ms": round(max(times), 2)}


def latency(reps, batch):
    import keras

    import keras_vmoe

    keras.utils.set_random_seed(0)
    model = keras_vmoe.presets.from_preset("vmoe_s32", **LATENCY)
    rng = np.random.default_rng(0)
    head = model.get_layer("head")
    head.kernel.assign(rng.normal(0, 0.02, head.kernel.shape).astype("float32"))
    x = rng.uniform(-1, 1, (batch, 224, 224, 3)).astype("float32")
    float_logits = np.asarray(model.predict_on_batch(x))
    result = {"model": "vmoe_s32 architecture, 224 px, E=8, random weights",
              "batch": batch, "float32": _timed(lambda: model.predict_on_batch(x), reps)}
    model.quantize("int8")
    int8_logits = np.asarray(model.predict_on_batch(x))
    result["int8"] = _timed(lambda: model.predict_on_batch(x), reps)
    result["int8_over_float32"] = round(
        result["int8"]["median_ms"] / result["float32"]["median_ms"], 3)
    result["max_abs_logit_change"] = float(np.abs(int8_logits - float_logits).max())
    return result


def fixtures():
    from keras_vmoe.conversion import build_model_from_upstream

    results = {}
    for folder in sorted(glob.glob(os.path.join(ROOT, "tests", "data", "upstream_vmoe",
                                                "*", "checkpoint.index"))):
        name = os.path.basename(os.path.dirname(folder))
        folder = folder[: -len(".index")]
        model = build_model_from_upstream(folder)
        x = np.load(os.path.join(ROOT, "tests", "data", "upstream_vmoe", name, "inputs.npy"))
        before = np.asarray(model.predict_on_batch(x), dtype="float64")
        model.quantize("int8")
        after = np.asarray(model.predict_on_batch(x), dtype="float64")
        change = np.abs(after - before)
        results[name] = {
            "images": int(x.shape[0]),
            "max_abs_logit_change": float(change.max()),
            "relative_to_max_logit": float(change.max() / np.abs(before).max()),
            "top1_agreement": float(np.mean(after.argmax(-1) == before.argmax(-1)))}
    return results


def digits(preset):
    import keras_vmoe

    test = keras_vmoe.data.load_dataset("digits", "test", image_size=32, batch_size=120)
    model = keras_vmoe.presets.from_preset(preset)
    result = {"preset": preset,
              "float32_accuracy": float(model.evaluate(test, verbose=0,
                                                       return_dict=True)["accuracy"])}
    model.quantize("int8")
    result["int8_accuracy"] = float(model.evaluate(test, verbose=0,
                                                   return_dict=True)["accuracy"])
    result["change_points"] = round(
        100 * (result["int8_accuracy"] - result["float32_accuracy"]), 2)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--digits-preset", default=None)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--output", default=None)
    harness.add_arguments(parser)
    args = parser.parse_args(argv)
    harness.record_start(args.allow_loaded)

    import keras

    result = {"benchmark": "int8",
              "machine": {"platform": platform.platform(),
                          "processor": platform.processor(), "cpus": os.cpu_count(),
                          "backend": keras.backend.backend(),
                          "keras": keras.__version__},
              "bytes": byte_plans(BYTES_PRESETS[1:2] if args.quick else BYTES_PRESETS),
              "fixtures": fixtures()}
    if not args.quick:
        result["latency"] = latency(args.reps, args.batch)
    if args.digits_preset:
        result["digits"] = digits(args.digits_preset)
    harness.write_result(result, args.output, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
