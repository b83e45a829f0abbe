"""Start-up costs: imports, building, loading, first predict and train step.

Every measurement runs in a fresh Python process, as a command-line call,
a notebook or a serving process starts: the import times of `keras_vmoe`,
`keras_vmoe.models` and the CLI; building a model without weights; loading
it from a local preset (saved once, with random weights, to a temporary
folder) against reading its `.weights.h5` with h5py alone, and the peak
memory that loading adds; loading the same model from a `.keras` file
(`keras.saving.load_model`); the first `predict` and the first training
step of the loaded model. Each step records its wall and CPU seconds
(the CPU seconds of this process: less sensitive to other processes than
the wall time, still not a quiet figure). On JAX each step after the
imports also counts the XLA programs it compiled (lowered for
compilation); each import records which of Keras, JAX, TensorFlow and
PyTorch it loaded.

Models: `small` (the command line's default V-MoE,
`keras_vmoe.cli.finetune.SMALL_VMOE`, 10 classes), `s32`
(`vmoe_s32_last2_ilsvrc2012_randaug_light1`, 57M parameters, built with
random weights) and, with `--models ...,b16`, `b16`
(`vmoe_b16_imagenet21k_randaug_strong`).

    python benchmarks/start_up.py --backends jax,torch,tensorflow \\
        --output benchmarks/results/start_up_<date>.json
    python benchmarks/start_up.py --quick   # the small model on JAX
"""

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import harness  # noqa: E402

MODELS = {
    "small": None,
    "s32": "vmoe_s32_last2_ilsvrc2012_randaug_light1",
    "b16": "vmoe_b16_imagenet21k_randaug_strong",
}
IMPORTS = {
    "keras_vmoe": "import keras_vmoe",
    "keras_vmoe.models": "import keras_vmoe.models",
    "cli": "import keras_vmoe.cli",
}
STEPS = ("build", "load", "keras_load", "predict", "train_step")


# -- child process ------------------------------------------------------------


class _Programs:
    """Counts the XLA programs JAX lowers for compilation (0 off JAX)."""

    def __init__(self):
        self.count = 0
        if os.environ.get("KERAS_BACKEND") == "jax":
            import jax

            lowered = "/jax/core/compile/jaxpr_to_mlir_module_duration"

            def listener(event, duration, **kwargs):
                if event == lowered:
                    self.count += 1

            jax.monitoring.register_event_duration_secs_listener(listener)


def _cpu_seconds():
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _peak_rss_bytes():
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _build(model_name):
    import keras

    from keras_vmoe import models
    from keras_vmoe import presets

    keras.utils.set_random_seed(0)
    if MODELS[model_name] is not None:
        return presets.from_preset(MODELS[model_name], load_weights=False)
    from keras_vmoe.cli.finetune import SMALL_VMOE

    backbone = models.VisionTransformerBackbone(**SMALL_VMOE, name="small_vmoe")
    return models.ImageClassifier(backbone, num_classes=10)


def _read_weights(path):
    """Seconds to read every array of a `.weights.h5` file with h5py."""
    import h5py

    def read(name, item):
        if isinstance(item, h5py.Dataset):
            item[()]
        # None: `visititems` stops at the first other return value.

    start = time.perf_counter()
    with h5py.File(path, "r") as f:
        f.visititems(read)
    return time.perf_counter() - start


def _start_backend():
    """Starts the backend's runtime (no program compiled) and loads h5py, so
    that the memory they take is not counted as loading's."""
    import h5py  # noqa: F401
    import keras
    import numpy as np

    keras.ops.convert_to_numpy(keras.ops.convert_to_tensor(np.zeros(4, "float32")))


def _warm_page_cache(path):
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def _batch(model, batch_size=2):
    import numpy as np

    size = model.backbone.image_size
    size = (size, size) if isinstance(size, int) else tuple(size)
    images = np.random.RandomState(0).uniform(-1, 1, (batch_size, *size, 3))
    return images.astype("float32"), np.arange(batch_size) % model.num_classes


def child(step, model_name, preset_dir):
    """One measurement in this process; returns its JSON record."""
    if step in IMPORTS:  # timed first: counting programs imports JAX
        start = time.perf_counter()
        exec(IMPORTS[step], {})
        return {"seconds": time.perf_counter() - start,
                "modules": sorted(m for m in ("keras", "jax", "tensorflow", "torch")
                                  if m in sys.modules)}
    programs = _Programs()
    import keras

    from keras_vmoe import presets

    record = {}
    if step == "save":
        model = _build(model_name)
        presets.save_to_preset(model, preset_dir)
        model.save(os.path.join(preset_dir, "model.keras"))
        return {"parameters": int(model.count_params())}
    if step == "build":
        start, cpu = time.perf_counter(), _cpu_seconds()
        _build(model_name)
        return {"seconds": time.perf_counter() - start,
                "cpu_seconds": _cpu_seconds() - cpu, "programs": programs.count}
    if step == "keras_load":
        path = os.path.join(preset_dir, "model.keras")
        _warm_page_cache(path)
        import keras_vmoe.models  # noqa: F401 - registers the classes

        _start_backend()
        programs.count = 0
        start, cpu = time.perf_counter(), _cpu_seconds()
        keras.saving.load_model(path)
        return {"seconds": time.perf_counter() - start,
                "cpu_seconds": _cpu_seconds() - cpu, "programs": programs.count,
                "file_bytes": os.path.getsize(path)}
    weights = os.path.join(preset_dir, "model.weights.h5")
    _warm_page_cache(weights)
    _start_backend()
    programs.count = 0
    before = _peak_rss_bytes()
    start, cpu = time.perf_counter(), _cpu_seconds()
    model = presets.from_preset(preset_dir)
    record["load_seconds"] = time.perf_counter() - start
    record["load_cpu_seconds"] = _cpu_seconds() - cpu
    record["load_programs"] = programs.count
    record["load_peak_added_bytes"] = _peak_rss_bytes() - before
    record["weights_bytes"] = os.path.getsize(weights)
    record["h5py_read_seconds"] = _read_weights(weights)
    if step == "load":
        return record
    images, labels = _batch(model)
    programs.count = 0
    start = time.perf_counter()
    if step == "predict":
        model.predict(images, verbose=0)
    else:
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        model.train_on_batch(images, labels)
    return {**record, "seconds": time.perf_counter() - start,
            "programs": programs.count}


# -- parent process -----------------------------------------------------------


def _run_child(backend, step, model_name=None, preset_dir=None, timeout=1800):
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    argv = [sys.executable, os.path.abspath(__file__), "--child", step,
            "--model", model_name or "small", "--preset-dir", preset_dir or ""]
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1:] or [done.returncode]}
    record = json.loads(done.stdout.strip().splitlines()[-1])
    record["process_seconds"] = round(time.perf_counter() - start, 3)
    return record


def _rounded(record):
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in record.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="jax",
                        help="comma-separated: jax, torch, tensorflow")
    parser.add_argument("--models", default="small,s32",
                        help=f"comma-separated, of {sorted(MODELS)} (b16 is large)")
    parser.add_argument("--quick", action="store_true",
                        help="the small model on the first backend only")
    parser.add_argument("--output", default=None, help="also write the JSON here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default="small", help=argparse.SUPPRESS)
    parser.add_argument("--preset-dir", default="", help=argparse.SUPPRESS)
    harness.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.model, args.preset_dir)))
        return None
    harness.record_start(args.allow_loaded)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    model_names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(model_names) - set(MODELS))
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {sorted(MODELS)}")
    if args.quick:
        backends, model_names = backends[:1], ["small"]
    results = {}
    folder = tempfile.mkdtemp(prefix="keras_vmoe_start_up-")
    try:
        for backend in backends:
            rows = {"imports": {name: _rounded(_run_child(backend, name))
                                for name in IMPORTS}}
            for model_name in model_names:
                preset_dir = os.path.join(folder, f"{backend}_{model_name}")
                saved = _run_child(backend, "save", model_name, preset_dir)
                # The kernel writes the saved files back meanwhile otherwise,
                # slowing the first load measured.
                os.sync()
                row = {"parameters": saved.get("parameters")}
                if "error" in saved:
                    row["error"] = saved["error"]
                else:
                    for step in STEPS:
                        row[step] = _rounded(_run_child(backend, step, model_name,
                                                        preset_dir))
                    shutil.rmtree(preset_dir, ignore_errors=True)
                rows[model_name] = row
            results[backend] = rows
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return harness.write_result({
        "benchmark": "start_up",
        "models": {m: MODELS[m] or "keras_vmoe.cli.finetune.SMALL_VMOE"
                   for m in model_names},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version()},
        "results": results,
    }, args.output, indent=1)


if __name__ == "__main__":
    main()
