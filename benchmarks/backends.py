"""Speed of each Keras backend (JAX, PyTorch, TensorFlow) as ratios to JAX.

Every backend runs in its own subprocess (Keras picks its backend once per
process), one after the other, on the same shapes: an `MoeLayer` (Token
Choice, K=2) and a small V-MoE classifier, each timed for a forward pass
(`predict_on_batch`: `jax.jit`, `tf.function`, eager PyTorch) and a
training step (`train_on_batch`, SGD). The median of `--reps` timed calls
after `--warmup` untimed ones is reported, with the min and max, and the
ratio `backend_ms / jax_ms` of the medians (above 1: slower than JAX).

    python benchmarks/backends.py --output benchmarks/results/backends.json

Prints the JSON (also written to `--output`). `--quick` uses tiny shapes
(the tests run it).
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import harness  # noqa: E402

BACKENDS = ("jax", "torch", "tensorflow")
# (batch, tokens, hidden, expert hidden, experts) of the layer benchmark.
LAYER = (8, 65, 128, 512, 8)
QUICK_LAYER = (2, 9, 16, 32, 4)
# Model overrides of `from_preset("vmoe_s32", load_weights=False, ...)`.
MODEL = dict(image_size=64, patch_size=8, hidden_dim=128, num_heads=4, mlp_dim=256,
             num_layers=4, num_experts=8, representation_size=None)
QUICK_MODEL = dict(image_size=16, patch_size=8, hidden_dim=16, num_heads=2,
                   mlp_dim=32, num_layers=4, num_experts=4, representation_size=None)
MODEL_BATCH = 8


def _time(fn, reps, warmup):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    times.sort()
    return {"median_ms": times[len(times) // 2], "min_ms": times[0], "max_ms": times[-1]}


def child(args):
    """Times the workloads on this process's backend; prints one JSON line."""
    import keras
    import numpy as np

    import keras_vmoe
    from keras_vmoe.layers import MoeLayer

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    batch, tokens, hidden, mlp, experts = QUICK_LAYER if args.quick else LAYER
    inputs = keras.Input((tokens, hidden))
    layer = MoeLayer(experts, mlp, router={"name": "token_choice",
                                           "num_selected_experts": 2,
                                           "capacity_factor": 1.05}, name="moe")
    layer_model = keras.Model(inputs, layer(inputs))
    layer_model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    x = rng.normal(size=(batch, tokens, hidden)).astype("float32")
    results = {
        "layer_forward": _time(lambda: layer_model.predict_on_batch(x),
                               args.reps, args.warmup),
        "layer_train_step": _time(lambda: layer_model.train_on_batch(x, x),
                                  args.reps, args.warmup),
    }
    overrides = QUICK_MODEL if args.quick else MODEL
    model = keras_vmoe.presets.from_preset("vmoe_s32", load_weights=False,
                                           num_classes=10, **overrides)
    model.compile(optimizer=keras.optimizers.SGD(0.01))
    size = overrides["image_size"]
    images = rng.uniform(-1, 1, (MODEL_BATCH, size, size, 3)).astype("float32")
    labels = np.arange(MODEL_BATCH) % 10
    results["model_forward"] = _time(lambda: model.predict_on_batch(images),
                                     args.reps, args.warmup)
    results["model_train_step"] = _time(lambda: model.train_on_batch(images, labels),
                                        args.reps, args.warmup)
    print(json.dumps({"backend": keras.config.backend(), "results": results}))


def _run_backend(backend, argv):
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", *argv],
                          env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        return {"error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])["results"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny shapes")
    parser.add_argument("--machine", default=platform.processor() or platform.machine())
    parser.add_argument("--output", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    harness.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    harness.record_start(args.allow_loaded)
    passed = ["--reps", str(args.reps), "--warmup", str(args.warmup)]
    if args.quick:
        passed.append("--quick")
    backends = [b for b in args.backends.split(",") if b]
    per_backend = {b: _run_backend(b, passed) for b in backends}
    jax = per_backend.get("jax", {})
    ratios = {}
    for backend, results in per_backend.items():
        if "error" in results or "error" in jax or not jax:
            continue
        ratios[backend] = {name: round(r["median_ms"] / jax[name]["median_ms"], 3)
                           for name, r in results.items()}
    report = {
        "benchmark": "backends",
        "machine": args.machine,
        "cpu_count": os.cpu_count(),
        "reps": args.reps,
        "warmup": args.warmup,
        "layer_shape": dict(zip(("batch", "tokens", "hidden", "expert_hidden", "experts"),
                                QUICK_LAYER if args.quick else LAYER, strict=True)),
        "model": {**(QUICK_MODEL if args.quick else MODEL), "batch": MODEL_BATCH},
        "results": per_backend,
        "ratio_to_jax": ratios,
    }
    return harness.write_result(report, args.output, indent=1)


if __name__ == "__main__":
    main()
