"""Speed of each Keras backend (JAX, PyTorch, TensorFlow) as ratios to JAX.

Every backend runs in its own subprocess (Keras picks its backend once per
process), one after the other, on the same shapes: an `MoeLayer` (Token
Choice, K=2) and a V-MoE classifier (`--model tiny`: 64 px, D=128, 4 blocks,
8 experts; `--model s32`: V-MoE S/32 at 224 px), each timed for a forward
pass (`predict_on_batch`: `jax.jit`, `tf.function`, eager PyTorch) and a
training step (`train_on_batch`, SGD). Each workload reports the median of
`--reps` timed calls after `--warmup` untimed ones, with the min and max,
and the first call's seconds (tracing and compiling included).

`--rounds N` runs the backends N times, alternating their order, each in a
fresh process; `ratio_to_jax` is the ratio of the medians over the rounds
(above 1: slower than JAX) and `ratio_to_jax_range` its min and max over
the rounds. `--torch-compile` adds `torch_compile`: PyTorch with
`jit_compile=True` (`torch.compile`).

    python benchmarks/backends.py --rounds 3 --output benchmarks/results/backends.json

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
MODELS = {
    "tiny": dict(image_size=64, patch_size=8, hidden_dim=128, num_heads=4, mlp_dim=256,
                 num_layers=4, num_experts=8, representation_size=None),
    "s32": dict(representation_size=None),
}
QUICK_MODEL = dict(image_size=16, patch_size=8, hidden_dim=16, num_heads=2,
                   mlp_dim=32, num_layers=4, num_experts=4, representation_size=None)
MODEL_BATCH = 8


def _time(fn, reps, warmup):
    start = time.perf_counter()
    fn()
    first_call_s = time.perf_counter() - start
    for _ in range(warmup - 1):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    times.sort()
    return {"median_ms": times[len(times) // 2], "min_ms": times[0], "max_ms": times[-1],
            "first_call_s": round(first_call_s, 3)}


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
    layer_model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse",
                        jit_compile=args.jit_compile)
    x = rng.normal(size=(batch, tokens, hidden)).astype("float32")
    results = {
        "layer_forward": _time(lambda: layer_model.predict_on_batch(x),
                               args.reps, args.warmup),
        "layer_train_step": _time(lambda: layer_model.train_on_batch(x, x),
                                  args.reps, args.warmup),
    }
    overrides = QUICK_MODEL if args.quick else MODELS[args.model]
    model = keras_vmoe.presets.from_preset("vmoe_s32", load_weights=False,
                                           num_classes=10, **overrides)
    model.compile(optimizer=keras.optimizers.SGD(0.01), jit_compile=args.jit_compile)
    size = model.backbone.image_size
    images = rng.uniform(-1, 1, (MODEL_BATCH, size, size, 3)).astype("float32")
    labels = np.arange(MODEL_BATCH) % 10
    results["model_forward"] = _time(lambda: model.predict_on_batch(images),
                                     args.reps, args.warmup)
    results["model_train_step"] = _time(lambda: model.train_on_batch(images, labels),
                                        args.reps, args.warmup)
    print(json.dumps({"backend": keras.config.backend(), "results": results}))


def _run_backend(backend, argv):
    variant = {"torch_compile": ("torch", ["--jit-compile"])}
    keras_backend, extra = variant.get(backend, (backend, []))
    env = dict(os.environ, KERAS_BACKEND=keras_backend, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", *argv, *extra],
        env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        return {"error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])["results"]


def _median(values):
    values = sorted(values)
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2


def _ratios(rounds, backends):
    """Per backend and workload: the ratio of medians over rounds to JAX's, and its range."""
    ratios, ranges = {}, {}
    for backend in backends:
        runs = [r for r in rounds if "error" not in r[backend] and "error" not in r["jax"]]
        if not runs:
            continue
        ratios[backend], ranges[backend] = {}, {}
        for name in runs[0][backend]:
            per_round = [r[backend][name]["median_ms"] / r["jax"][name]["median_ms"]
                         for r in runs]
            ratios[backend][name] = round(
                _median([r[backend][name]["median_ms"] for r in runs])
                / _median([r["jax"][name]["median_ms"] for r in runs]), 3)
            ranges[backend][name] = [round(min(per_round), 3), round(max(per_round), 3)]
    return ratios, ranges


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--model", default="tiny", choices=sorted(MODELS))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--torch-compile", action="store_true",
                        help="also time PyTorch with jit_compile=True")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny shapes")
    parser.add_argument("--machine", default=platform.processor() or platform.machine())
    parser.add_argument("--output", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--jit-compile", action="store_true", help=argparse.SUPPRESS)
    harness.add_arguments(parser)
    args = parser.parse_args(argv)
    args.jit_compile = True if args.jit_compile else "auto"
    if args.child:
        return child(args)
    harness.record_start(args.allow_loaded)
    passed = ["--reps", str(args.reps), "--warmup", str(args.warmup), "--model", args.model]
    if args.quick:
        passed.append("--quick")
    backends = [b for b in args.backends.split(",") if b]
    if args.torch_compile:
        backends.append("torch_compile")
    if "jax" not in backends:
        backends.insert(0, "jax")
    rounds = []
    for index in range(args.rounds):
        order = backends if index % 2 == 0 else backends[::-1]
        results = {b: _run_backend(b, passed) for b in order}
        rounds.append({b: results[b] for b in backends})
    ratios, ranges = _ratios(rounds, backends)
    report = {
        "benchmark": "backends",
        "machine": args.machine,
        "cpu_count": os.cpu_count(),
        "reps": args.reps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "layer_shape": dict(zip(("batch", "tokens", "hidden", "expert_hidden", "experts"),
                                QUICK_LAYER if args.quick else LAYER, strict=True)),
        "model": {"name": "quick" if args.quick else args.model,
                  "overrides": QUICK_MODEL if args.quick else MODELS[args.model],
                  "batch": MODEL_BATCH},
        "results": rounds[0] if args.rounds == 1 else rounds,
        "ratio_to_jax": ratios,
        "ratio_to_jax_range": ranges,
    }
    return harness.write_result(report, args.output, indent=1)


if __name__ == "__main__":
    main()
