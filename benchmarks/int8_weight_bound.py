"""float32 vs int8 where int8 should pay off: weight-bound inference.

At batch 1 a large-expert model reads every weight once per image: the
time is the weight bytes over the memory bandwidth, so int8 weights (a
quarter of the bytes) should be faster, if the kernels read int8. Cases
(random weights, 224 px):

- Soft MoE S/16 (128 experts) at batch 1 and 8;
- V-MoE B/16, E=32 in every 2nd block, at batch 1.

Each case is timed (median / min / max of `--reps` calls after 2 warm-up
calls) through Keras (`predict_on_batch`, float32, then after
`model.quantize("int8")`) and, where onnxruntime is installed (the export
environment), through the exported ONNX model: float32, the int8 Keras
model exported, and the float32 export quantized by onnxruntime
(`quantize_dynamic`, int8 weights with its integer matmul kernels).

It also **counts** what each int8 path runs (independent of load): the ONNX
graphs' operator types (`MatMulInteger`/`DynamicQuantizeLinear`: integer
matmuls; `DequantizeLinear` + `MatMul`: weights widened to float before a
float matmul) and, for Keras on JAX, the compiled program's dot operand
types (an `s8` dot reads int8; a `convert` of the weights to `f32` before an
`f32` dot reads them as float).

    KERAS_BACKEND=jax python benchmarks/int8_weight_bound.py \\
        --output benchmarks/results/int8_weight_bound.json   # export venv: + ONNX
    KERAS_BACKEND=jax python benchmarks/int8_weight_bound.py --quick
"""

import argparse
import collections
import os
import re
import shutil
import sys
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import harness  # noqa: E402

# name: (preset, overrides, batch)
CASES = {
    "soft_moe_s16_batch1": ("soft_moe_s16_128e", {}, 1),
    "soft_moe_s16_batch8": ("soft_moe_s16_128e", {}, 8),
    "vmoe_b16_e32_batch1": ("vmoe_b16_every2", {"num_experts": 32}, 1),
}
TINY = dict(image_size=32, patch_size=16, hidden_dim=32, num_heads=2, mlp_dim=64,
            num_layers=2)
QUICK_CASES = {
    "soft_moe_tiny_batch1": ("soft_moe_s16_128e", {**TINY, "num_experts": 8}, 1),
    "vmoe_tiny_batch1": ("vmoe_b16_every2", {**TINY, "num_experts": 4}, 1),
}


def log(*args):
    print("[int8_weight_bound]", *args, file=sys.stderr, flush=True)


def _timed(fn, reps):
    fn()
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return {"median_ms": round(float(np.median(times)), 3),
            "min_ms": round(min(times), 3), "max_ms": round(max(times), 3),
            "runs": reps}


def weight_bytes(model):
    return int(sum(np.prod(v.shape) * np.dtype(v.dtype).itemsize
                   for v in model.weights))


def xla_dot_operands(model, x):
    """Counts the compiled inference program's dots by operand types, and
    converts from s8 (JAX only): how XLA reads the int8 weights."""
    import jax
    import keras

    if keras.backend.backend() != "jax":
        return None
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    def forward(t, n, images):
        return model.stateless_call(t, n, images, training=False)[0]

    text = jax.jit(forward).lower(trainable, non_trainable, x).compile().as_text()
    # HLO names operands without their types: look them up by name.
    types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", text))
    dots = collections.Counter()
    for match in re.finditer(r"= (\w+)\[[^\]]*\][^ ]* (?:dot|convolution)\(([^)]*)\)",
                             text):
        operands = [types.get(name, "?")
                    for name in re.findall(r"%([\w.\-]+)", match.group(2))]
        dots[f"{match.group(1)} <- {' x '.join(operands) or '?'}"] += 1
    converts = len(re.findall(r"= f32\[[^\]]*\][^ ]* convert\(s8\[", text))
    fusion_converts = len(re.findall(r"convert\(s8", text))
    return {"dots_by_types": dict(dots), "s8_to_f32_converts": converts,
            "convert_from_s8_anywhere": fusion_converts}


def onnx_paths(model_f32, model_int8, x, reps, workdir):
    """float32 export, int8-model export and onnxruntime dynamic quantization."""
    try:
        import onnx
        import onnxruntime as ort
        from onnxruntime.quantization import QuantType
        from onnxruntime.quantization import quantize_dynamic
    except ImportError as error:
        return {"skipped": f"onnxruntime/onnx not installed ({error}); run in the "
                           "export environment"}
    batch = int(x.shape[0])
    out = {}
    paths = {"float32": os.path.join(workdir, "f32.onnx"),
             "keras_int8": os.path.join(workdir, "int8.onnx"),
             "ort_dynamic_int8": os.path.join(workdir, "ort_int8.onnx")}
    model_f32.export(paths["float32"], format="onnx", batch_size=batch)
    try:
        model_int8.export(paths["keras_int8"], format="onnx", batch_size=batch)
    except Exception as error:  # reported, not fatal: the other paths still run
        out["keras_int8_export_error"] = f"{type(error).__name__}: {error}"[:500]
        paths.pop("keras_int8")
    try:
        # A float32 export over ONNX's 2 GiB file limit keeps its weights in
        # `.data`; the quantized model is then written the same way.
        quantize_dynamic(paths["float32"], paths["ort_dynamic_int8"],
                         weight_type=QuantType.QInt8,
                         use_external_data_format=os.path.exists(paths["float32"] + ".data"))
    except Exception as error:
        out["ort_dynamic_int8_error"] = f"{type(error).__name__}: {error}"[:500]
        paths.pop("ort_dynamic_int8")
    for name, path in paths.items():
        out[name] = {"file_bytes": sum(os.path.getsize(os.path.join(workdir, f))
                                       for f in os.listdir(workdir)
                                       if f.startswith(os.path.basename(path)))}
        try:
            graph = onnx.load(path, load_external_data=False).graph
            ops = collections.Counter(node.op_type for node in graph.node)
            out[name]["op_types"] = dict(ops.most_common())
            out[name]["external_data_files"] = sorted({
                entry.value for tensor in graph.initializer
                for entry in tensor.external_data if entry.key == "location"})
            session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
            feed = {session.get_inputs()[0].name: x}
            out[name]["logits"] = session.run(None, feed)[0]
        except Exception as error:  # e.g. an operator onnxruntime lacks
            out[name]["error"] = f"{type(error).__name__}: {error}"[:500]
            continue
        out[name]["latency"] = _timed(lambda s=session, f=feed: s.run(None, f), reps)
    reference = out["float32"].pop("logits", None)
    for name in paths:
        if name == "float32" or "logits" not in out[name] or reference is None:
            continue
        logits = out[name].pop("logits")
        out[name]["max_abs_logit_change"] = float(np.abs(logits - reference).max())
        out[name]["over_float32"] = round(
            out[name]["latency"]["median_ms"] / out["float32"]["latency"]["median_ms"], 3)
    return out


def run_case(preset, overrides, batch, reps, onnx, workdir):
    import keras

    import keras_vmoe

    keras.utils.set_random_seed(0)
    kwargs = dict(load_weights=False, num_classes=1000, **overrides)
    if "image_size" not in overrides:
        kwargs["image_size"] = 224
    model = keras_vmoe.presets.from_preset(preset, **kwargs)
    size = model.backbone.image_size
    rng = np.random.default_rng(0)
    head = model.get_layer("head")
    head.kernel.assign(rng.normal(0, 0.02, head.kernel.shape).astype("float32"))
    x = rng.uniform(-1, 1, (batch, size, size, 3)).astype("float32")
    result = {"preset": preset, "overrides": overrides, "batch": batch,
              "float32_weight_bytes": weight_bytes(model)}
    reference = np.asarray(model.predict_on_batch(x))
    result["keras_float32"] = _timed(lambda: model.predict_on_batch(x), reps)
    float_model = model
    if onnx:
        # A second float32 copy for the ONNX export (quantize is in place).
        keras.utils.set_random_seed(0)
        float_model = keras_vmoe.presets.from_preset(preset, **kwargs)
        float_model.set_weights(model.get_weights())
    model.quantize("int8")
    result["int8_weight_bytes"] = weight_bytes(model)
    logits = np.asarray(model.predict_on_batch(x))
    result["keras_int8"] = _timed(lambda: model.predict_on_batch(x), reps)
    result["keras_int8"]["max_abs_logit_change"] = float(np.abs(logits - reference).max())
    result["keras_int8_over_float32"] = round(
        result["keras_int8"]["median_ms"] / result["keras_float32"]["median_ms"], 3)
    result["keras_int8_xla"] = xla_dot_operands(model, x)
    if onnx:
        result["onnx"] = onnx_paths(float_model, model, x, reps, workdir)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models")
    parser.add_argument("--cases", default=None,
                        help=f"comma-separated subset of {sorted(CASES)}")
    parser.add_argument("--reps", type=int, default=None, help="default 10; quick 2")
    parser.add_argument("--no-onnx", action="store_true", help="Keras only")
    parser.add_argument("--output", default=None, help="also write the JSON here")
    harness.add_arguments(parser)
    args = parser.parse_args(argv)
    harness.record_start(args.allow_loaded)
    cases = QUICK_CASES if args.quick else CASES
    names = args.cases.split(",") if args.cases else list(cases)
    unknown = [n for n in names if n not in cases]
    if unknown:
        parser.error(f"--cases: unknown {unknown}; valid: {sorted(cases)}")
    reps = args.reps or (2 if args.quick else 10)
    if reps < 1:
        parser.error(f"--reps must be >= 1; received {reps}")
    import keras

    results = {}
    with tempfile.TemporaryDirectory(prefix="int8_weight_bound_") as workdir:
        for name in names:
            log(f"{name} ...")
            preset, overrides, batch = cases[name]
            case_dir = os.path.join(workdir, name)  # each case's exports apart
            os.mkdir(case_dir)
            results[name] = run_case(preset, overrides, batch, reps,
                                     not args.no_onnx, case_dir)
            shutil.rmtree(case_dir, ignore_errors=True)
            keras.backend.clear_session()
    return harness.write_result({
        "benchmark": "int8_weight_bound",
        "keras": keras.__version__, "backend": keras.backend.backend(),
        "cpu_count": os.cpu_count(), "reps": reps, "quick": args.quick,
        "cases": results,
    }, args.output)


if __name__ == "__main__":
    main()
