"""Rematerialised encoder blocks: train-step peak memory and compile time (JAX).

For each model, with and without `remat`, one training step (forward,
backward, Adam update; parameters and optimizer slots donated, as `fit`
does) is lowered with abstract weights and compiled ahead of time by XLA,
through `keras_vmoe.training.memory_plan` on one CPU device, float32, a
1000-class head. Nothing is executed and nothing is allocated.

- Peak memory: XLA's `compiled.memory_analysis()` of the whole step
  (arguments + outputs - aliased + temporaries), and the temporaries alone
  (saved activations, workspace). These are properties of the compiled
  program: they do not depend on the machine's load.
- Compile time: seconds of `lower` and of `compile` of the same step, each
  repetition in a fresh process with JAX's persistent compilation cache off.
  These DO depend on the load; the JSON records the load around the run
  and gives the median and the range of `--reps` runs.

Models: `tiny` (the tiny V-MoE of the tests: 32 px, patch 8, D=32, 4
blocks, MoE in blocks 1 and 3 with 4 experts, batch 8), `vit_b16` (dense
ViT B/16 at 224 px) and `vit_l16` (ViT L/16), and `vmoe_b16` (V-MoE B/16
Every-2, E=32, K=2), the large ones at `--batch` (64).

    KERAS_BACKEND=jax python benchmarks/remat.py --output benchmarks/results/remat.json
    KERAS_BACKEND=jax python benchmarks/remat.py --quick   # tiny model, one run

ONE JSON object goes to stdout (and `--output`, refused on a loaded
machine unless `--allow-loaded`: see `benchmarks/harness.py`).
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import harness  # noqa: E402

NUM_CLASSES = 1000
TINY = dict(hidden_dim=32, num_heads=2, mlp_dim=64, num_layers=4, num_experts=4,
            representation_size=None, image_size=32, patch_size=8)
# name: (family, variant, overrides, batch: None = --batch)
MODELS = {
    "tiny": ("vmoe", "S/32", TINY, 8),
    "vit_b16": ("vit", "B/16", {}, None),
    "vit_l16": ("vit", "L/16", {}, None),
    "vmoe_b16": ("vmoe", "B/16", {"images_per_group": None}, None),
}


def log(*args):
    print("[remat]", *args, file=sys.stderr, flush=True)


def compile_step(model, batch, **options):
    """Compiles one step of `model` (a `MODELS` entry) in this process, with
    the backbone `options` (`remat`, `scan`): `{"bytes", "seconds",
    "num_parameters"}`."""
    from keras_vmoe.models.configs import backbone_config
    from keras_vmoe.training import memory_plan

    family, variant, overrides, _ = model
    config = backbone_config(family, variant, **overrides)
    config.update(options)
    if config.get("moe") and config["moe"].get("images_per_group") is None:
        config["moe"] = dict(config["moe"], group_size=None)
    result = memory_plan._measure_one(config, NUM_CLASSES, {"data": 1, "expert": 1,
                                                            "model": 1},
                                      batch, "adam", "data", compile_step=True)
    return {"bytes": result["bytes"], "seconds": result["seconds"],
            "num_parameters": result["num_parameters"]}


def measure_one(name, remat, batch):
    """Compiles one step in this process: `{"bytes": ..., "seconds": ...}`."""
    return compile_step(MODELS[name], batch, remat=remat)


def run_child(argv, what):
    """Runs this folder's script `argv` in a fresh process (one device, no
    compilation cache) and returns the JSON of its last output line."""
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu",
               JAX_ENABLE_COMPILATION_CACHE="false", TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags)
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                          env=env, check=False)
    if done.returncode:
        raise RuntimeError(f"{what}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_in_subprocess(name, remat, batch):
    return run_child([os.path.abspath(__file__), "--one", name, "--batch", str(batch),
                      *(["--remat"] if remat else [])], f"{name} remat={remat}")


def summary(values):
    return {"median": round(statistics.median(values), 2),
            "min": round(min(values), 2), "max": round(max(values), 2),
            "runs": [round(v, 2) for v in values]}


def run_model(name, batch, reps):
    rows = {}
    for remat in (False, True):
        runs = []
        for rep in range(reps):
            log(f"{name} remat={remat} run {rep + 1}/{reps}")
            runs.append(measure_in_subprocess(name, remat, batch))
        first = runs[0]
        # Memory is a property of the program: every run must agree.
        assert all(r["bytes"] == first["bytes"] for r in runs), "memory differs"
        rows["remat" if remat else "plain"] = {
            "peak_bytes": first["bytes"]["peak"],
            "peak_gib": round(first["bytes"]["peak"] / 2**30, 3),
            "temporaries_gib": round(first["bytes"]["xla_temporaries"] / 2**30, 3),
            "lower_s": summary([r["seconds"]["lower"] for r in runs]),
            "compile_s": summary([r["seconds"]["compile"] for r in runs]),
        }
    rows["num_parameters"] = first["num_parameters"]
    rows["batch"] = batch
    rows["peak_ratio_remat_over_plain"] = round(
        rows["remat"]["peak_bytes"] / rows["plain"]["peak_bytes"], 3)
    rows["compile_ratio_remat_over_plain"] = round(
        rows["remat"]["compile_s"]["median"] / rows["plain"]["compile_s"]["median"], 3)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated, from {', '.join(MODELS)}")
    parser.add_argument("--batch", type=int, default=64,
                        help="batch of the large models (default 64)")
    parser.add_argument("--reps", type=int, default=3, help="compiles per setting")
    parser.add_argument("--quick", action="store_true", help="tiny model, one run")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--remat", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--output", default=None, help="also write the JSON here")
    harness.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure_one(args.one, args.remat, args.batch)))
        return 0
    harness.record_start(args.allow_loaded)
    names = ["tiny"] if args.quick else args.models.split(",")
    reps = 1 if args.quick else args.reps
    unknown = set(names) - set(MODELS)
    if unknown:
        parser.error(f"unknown models {sorted(unknown)}; valid: {', '.join(MODELS)}")
    results = {}
    for name in names:
        batch = MODELS[name][3] or args.batch
        results[name] = run_model(name, batch, reps)
    return write_step_result("remat", results, args.output)


def write_step_result(benchmark, models, output):
    """Writes (and returns) the JSON of a compiled-train-step benchmark."""
    import jax
    import keras

    return harness.write_result({
        "benchmark": benchmark,
        "what": "one train step (Adam, float32, 1000 classes), compiled ahead of time "
                "by XLA:CPU on one device; memory from compiled.memory_analysis()",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "jax": jax.__version__, "keras": keras.__version__},
        "models": models,
    }, output, indent=1)


if __name__ == "__main__":
    main()
