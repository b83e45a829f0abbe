"""The JAX training step through Keras (`train_on_batch`, `fit`) against its floor.

In one process, on each model (the tiny V-MoE of the backend comparison and
V-MoE S/32 at 224 px), all with the same SGD optimizer and the model's own
loss (auxiliary MoE losses included):

- `train_on_batch`: one call per step;
- `fit`: per-step cost, the slope between a `fit` of `--fit-steps` steps and
  one of 1 step (the intercept is `fit`'s fixed per-call cost, also
  reported);
- `raw`: the floor, a hand-written `jax.jit` step: `model.stateless_call`
  through `compute_loss_and_updates`, `jax.value_and_grad`, then
  `optimizer.stateless_apply`, every state buffer donated.

Besides times (medians and ranges of `--reps` runs after warm-up), each path
reports what it costs in **counts**, which do not depend on the machine's
load: XLA compilations and traces during the timed calls, and device->host
transfers per step (array values read by the host). `--tensorflow` also
runs `train_on_batch` and `fit` under `KERAS_BACKEND=tensorflow` in a
subprocess and reports `jax / tensorflow` ratios.

    KERAS_BACKEND=jax python benchmarks/train_step.py --tensorflow \\
        --output benchmarks/results/train_step.json
    KERAS_BACKEND=jax python benchmarks/train_step.py --quick   # the smoke test

ONE JSON object goes to stdout (and `--output`, refused on a loaded
machine: see `benchmarks/harness.py`).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import harness  # noqa: E402

NUM_CLASSES = 10
# Overrides of `from_preset("vmoe_s32", load_weights=False, ...)`: the tiny
# model (64 px, patch 8, D=128, 4 blocks, 8 experts top-2 in two of them).
TINY = dict(image_size=64, patch_size=8, hidden_dim=128, num_heads=4, mlp_dim=256,
            num_layers=4, num_experts=8, representation_size=None)
QUICK = dict(image_size=16, patch_size=8, hidden_dim=16, num_heads=2, mlp_dim=32,
             num_layers=4, num_experts=4, representation_size=None)
# `*_scan`: the JAX step with scanned blocks (`scan=True`); TensorFlow, which
# has no scan, runs the same model unscanned, so `jax / tensorflow` compares
# the two ways a user would run it.
MODELS = {"tiny": (TINY, 8), "vmoe_s32": ({"representation_size": None}, 8),
          "vmoe_s32_scan": ({"representation_size": None, "scan": True}, 8)}
QUICK_MODELS = {"quick": (QUICK, 2)}
LEARNING_RATE = 0.01


def log(*args):
    print("[train_step]", *args, file=sys.stderr, flush=True)


class Counters:
    """Counts, while active: XLA compilations and traces (`jax.monitoring`),
    array values read by the host through `jax.Array._value` (`float()`,
    `.item()`, ...; NumPy's buffer-protocol reads of CPU arrays bypass it),
    and Keras' synchronous log reads (`pythonify_logs` on the training
    thread: each waits for the step and copies every metric to the host)."""

    def __init__(self):
        self.compiles = 0
        self.traces = 0
        self.host_reads = 0
        self.log_reads = 0
        self.active = False
        self._install()

    def _install(self):
        import jax
        from jax._src import array as array_lib

        def on_duration(event, duration, **kwargs):
            if not self.active:
                return
            if event.endswith("backend_compile_duration"):
                self.compiles += 1
            elif event.endswith("jaxpr_trace_duration"):
                self.traces += 1

        jax.monitoring.register_event_duration_secs_listener(on_duration)
        cls = array_lib.ArrayImpl
        original = cls._value
        counters = self

        def _value(array):
            if counters.active and getattr(array, "_npy_value", None) is None:
                counters.host_reads += 1
            return original.fget(array)

        cls._value = property(_value)

        import threading

        from keras.src.utils import python_utils

        pythonify = python_utils.pythonify_logs
        main_thread = threading.main_thread()

        def pythonify_logs(logs):
            if (counters.active and logs
                    and threading.current_thread() is main_thread):
                counters.log_reads += 1
            return pythonify(logs)

        python_utils.pythonify_logs = pythonify_logs

    def __enter__(self):
        self.compiles = self.traces = self.host_reads = self.log_reads = 0
        self.active = True
        return self

    def __exit__(self, *exc):
        self.active = False

    def as_dict(self, steps):
        return {"compiles": self.compiles, "traces": self.traces,
                "host_reads": self.host_reads,
                "host_reads_per_step": round(self.host_reads / max(steps, 1), 3),
                "sync_log_reads": self.log_reads,
                "sync_log_reads_per_step": round(self.log_reads / max(steps, 1), 3)}


def build(overrides, seed=0):
    import keras

    import keras_vmoe

    keras.utils.set_random_seed(seed)
    model = keras_vmoe.presets.from_preset(
        "vmoe_s32", load_weights=False, num_classes=NUM_CLASSES, **overrides)
    model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE))
    return model


def data(model, batch, steps, seed=0):
    import numpy as np

    size = model.backbone.image_size
    rng = np.random.default_rng(seed)
    images = rng.uniform(-1.0, 1.0, (batch * steps, size, size, 3)).astype("float32")
    labels = rng.integers(0, NUM_CLASSES, (batch * steps,))
    return images, labels


def summary(values):
    values = sorted(values)
    return {"median_ms": round(statistics.median(values), 3),
            "min_ms": round(values[0], 3), "max_ms": round(values[-1], 3),
            "runs": len(values)}


def _timed(fn, reps):
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return times


def python_calls(fn, calls=5):
    """Python function calls (cProfile) per call of `fn`, and those made in
    keras_vmoe's own code: the host-side work of a step, independent of load."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        fn()
    profile.disable()
    stats = pstats.Stats(profile).stats
    total = sum(entry[1] for entry in stats.values())
    own = sum(entry[1] for (path, _, _), entry in stats.items()
              if f"{os.sep}keras_vmoe{os.sep}" in path)
    return {"python_calls": round(total / calls, 1),
            "keras_vmoe_python_calls": round(own / calls, 1)}


def raw_step(model):
    """The floor: the model's loss and optimizer in one donated `jax.jit`."""
    import jax

    optimizer = model.optimizer
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    grad_fn = jax.value_and_grad(model.compute_loss_and_updates, has_aux=True)

    def step(trainable, non_trainable, optimizer_vars, metrics_vars, x, y):
        (loss, (_, _, non_trainable, metrics_vars)), grads = grad_fn(
            trainable, non_trainable, metrics_vars, x, y, None,
            training=True, optimizer_variables=optimizer_vars)
        trainable, optimizer_vars = optimizer.stateless_apply(
            optimizer_vars, grads, trainable)
        return loss, trainable, non_trainable, optimizer_vars, metrics_vars

    state = ([jax.numpy.copy(v.value) for v in model.trainable_variables],
             [jax.numpy.copy(v.value) for v in model.non_trainable_variables],
             [jax.numpy.copy(v.value) for v in optimizer.variables],
             [jax.numpy.copy(v.value) for v in model.metrics_variables])
    return jax.jit(step, donate_argnums=(0, 1, 2, 3)), state


def jax_paths(overrides, batch, reps, fit_steps, counters):
    import jax

    out = {}
    model = build(overrides)
    x, y = data(model, batch, fit_steps)
    xb, yb = x[:batch], y[:batch]

    # train_on_batch
    for _ in range(2):
        model.train_on_batch(xb, yb)
    with counters:
        times = _timed(lambda: model.train_on_batch(xb, yb), reps)
    out["train_on_batch"] = {**summary(times), **counters.as_dict(reps),
                             **python_calls(lambda: model.train_on_batch(xb, yb))}

    # fit: per-step slope between fit_steps steps and 1 step.
    def fit(n):
        model.fit(x[:batch * n], y[:batch * n], batch_size=batch, epochs=1,
                  shuffle=False, verbose=0)

    fit(fit_steps)
    fit(1)
    long_times, short_times = [], []
    with counters:
        for _ in range(reps):
            long_times += _timed(lambda: fit(fit_steps), 1)
        long_counts = counters.as_dict(fit_steps * reps)
    with counters:
        for _ in range(reps):
            short_times += _timed(lambda: fit(1), 1)
        short_counts = counters.as_dict(reps)
    per_step = [(a - b) / (fit_steps - 1) for a, b in zip(long_times, short_times,
                                                            strict=True)]
    fixed = [b - s for b, s in zip(short_times, per_step, strict=True)]
    out["fit_per_step"] = {**summary(per_step), "steps_per_call": fit_steps,
                           f"counts_fit_{fit_steps}_steps": long_counts,
                           "counts_fit_1_step": short_counts}
    out["fit_fixed_per_call"] = summary(fixed)
    long_calls = python_calls(lambda: fit(fit_steps), 1)
    short_calls = python_calls(lambda: fit(1), 1)
    out["fit_per_step"].update({
        key: round((long_calls[key] - short_calls[key]) / (fit_steps - 1), 1)
        for key in long_calls})
    out["fit_fixed_per_call"].update(short_calls)

    # raw jitted step
    step, state = raw_step(model)
    xj, yj = jax.device_put(xb), jax.device_put(yb)

    def run_raw():
        nonlocal state
        loss, *state = step(*state, xj, yj)
        jax.block_until_ready(loss)

    for _ in range(2):
        run_raw()
    with counters:
        times = _timed(run_raw, reps)
    out["raw_jit"] = {**summary(times), **counters.as_dict(reps),
                      **python_calls(run_raw)}
    base = out["raw_jit"]["median_ms"]
    out["ratio_to_raw"] = {
        "train_on_batch": round(out["train_on_batch"]["median_ms"] / base, 3),
        "fit_per_step": round(out["fit_per_step"]["median_ms"] / base, 3)}
    return out


def tensorflow_child(args):
    """`train_on_batch` and `fit` per step on the TensorFlow backend."""
    models = QUICK_MODELS if args.quick else MODELS
    out = {}
    for name, (overrides, batch) in models.items():
        if args.models and name not in args.models:
            continue
        model = build({k: v for k, v in overrides.items() if k != "scan"})
        x, y = data(model, batch, args.fit_steps)
        xb, yb = x[:batch], y[:batch]
        for _ in range(2):
            model.train_on_batch(xb, yb)
        entry = {"train_on_batch": summary(
            _timed(lambda m=model, a=xb, b=yb: m.train_on_batch(a, b), args.reps))}

        def fit(n, m=model, a=x, b=y, bs=batch):
            m.fit(a[:bs * n], b[:bs * n], batch_size=bs, epochs=1, shuffle=False,
                  verbose=0)

        fit(args.fit_steps)
        fit(1)
        long_t = [t for _ in range(args.reps)
                  for t in _timed(lambda: fit(args.fit_steps), 1)]
        short_t = [t for _ in range(args.reps) for t in _timed(lambda: fit(1), 1)]
        entry["fit_per_step"] = summary(
            [(a - b) / (args.fit_steps - 1) for a, b in zip(long_t, short_t,
                                                            strict=True)])
        out[name] = entry
    print(json.dumps(out))


def run_tensorflow(argv):
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, os.path.abspath(__file__),
                           "--tensorflow-child", *argv],
                          env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        return {"error": done.stderr[-3000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="one tiny model, few repetitions (checks the script)")
    parser.add_argument("--models", default=None,
                        help=f"comma-separated subset of {sorted(MODELS)}")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--fit-steps", type=int, default=None,
                        help="steps of the long fit call (default 20; quick 3)")
    parser.add_argument("--tensorflow", action="store_true",
                        help="also time the TensorFlow backend (subprocess)")
    parser.add_argument("--tensorflow-child", action="store_true",
                        help=argparse.SUPPRESS)
    parser.add_argument("--output", default=None, help="also write the JSON here")
    harness.add_arguments(parser)
    args = parser.parse_args(argv)
    args.reps = args.reps or (2 if args.quick else 7)
    args.fit_steps = args.fit_steps or (3 if args.quick else 20)
    args.models = args.models.split(",") if args.models else None
    if args.reps < 1 or args.fit_steps < 2:
        parser.error(f"--reps must be >= 1 and --fit-steps >= 2; received "
                     f"reps={args.reps}, fit_steps={args.fit_steps}")
    if args.tensorflow_child:
        return tensorflow_child(args)
    harness.record_start(args.allow_loaded)
    import jax
    import keras

    if keras.backend.backend() != "jax":
        parser.error("run with KERAS_BACKEND=jax (TensorFlow runs in a subprocess)")
    models = QUICK_MODELS if args.quick else MODELS
    unknown = set(args.models or ()) - set(models)
    if unknown:
        parser.error(f"--models: unknown {sorted(unknown)}; valid: {sorted(models)}")
    counters = Counters()
    results = {}
    for name, (overrides, batch) in models.items():
        if args.models and name not in args.models:
            continue
        log(f"{name}: batch {batch} ...")
        results[name] = {"batch": batch, "overrides": overrides,
                         **jax_paths(overrides, batch, args.reps, args.fit_steps,
                                     counters)}
    result = {
        "benchmark": "train_step",
        "environment": {"jax": jax.__version__, "keras": keras.__version__,
                        "devices": [str(d) for d in jax.devices()],
                        "cpu_count": os.cpu_count()},
        "settings": {"reps": args.reps, "fit_steps": args.fit_steps,
                     "quick": args.quick, "optimizer": f"SGD({LEARNING_RATE})"},
        "jax": results,
    }
    if args.tensorflow:
        passed = ["--reps", str(args.reps), "--fit-steps", str(args.fit_steps)]
        if args.quick:
            passed.append("--quick")
        if args.models:
            passed += ["--models", ",".join(args.models)]
        tf = run_tensorflow(passed)
        result["tensorflow"] = tf
        ratios = {}
        for name, entry in results.items():
            if name in tf:
                ratios[name] = {
                    path: round(entry[path]["median_ms"] / tf[name][path]["median_ms"], 3)
                    for path in ("train_on_batch", "fit_per_step")}
                ratios[name]["raw_jit"] = round(
                    entry["raw_jit"]["median_ms"] / tf[name]["fit_per_step"]["median_ms"], 3)
        result["ratio_jax_to_tensorflow"] = ratios
    return harness.write_result(result, args.output)


if __name__ == "__main__":
    main()
