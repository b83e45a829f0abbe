"""Scanned encoder blocks: train-step compile time and peak memory (JAX).

For each model and each setting of `scan` and `remat`, one training step
(forward, backward, Adam update; parameters and optimizer slots donated,
as `fit` does) is lowered with abstract weights and compiled ahead of time
by XLA:CPU on one device, float32, a 1000-class head, through
`keras_vmoe.training.memory_plan` (the code path of `benchmarks/remat.py`).
Nothing is executed and nothing is allocated: no real weights, even for
V-MoE-15B.

- Compile time: seconds of `lower` and of `compile`, each repetition in a
  fresh process with JAX's persistent compilation cache off. These depend
  on the machine's load; the JSON records the load around the run and the
  median and range of `--reps` runs.
- Peak memory: XLA's `compiled.memory_analysis()` of the whole step
  (arguments + outputs - aliased + temporaries) and the temporaries alone,
  properties of the compiled program.

Models: `tiny` (the tiny V-MoE of the tests, batch 8), `vit_b16`, `vit_l16`,
`vit_h14` (dense ViTs at 224 px) at `--batch` (64), and `vmoe_15b`
(V-MoE-15B, 48 blocks, MoE every second block, 8 images per routing group)
at `--batch-15b` (8).

    KERAS_BACKEND=jax python benchmarks/scan.py --output benchmarks/results/scan.json
    KERAS_BACKEND=jax python benchmarks/scan.py --quick   # tiny, plain and scan, one run
    KERAS_BACKEND=jax python benchmarks/scan.py --models vmoe_15b --settings plain,scan

ONE JSON object goes to stdout (and `--output`, refused on a loaded
machine unless `--allow-loaded`: see `benchmarks/harness.py`).
"""

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import harness  # noqa: E402
from benchmarks.remat import TINY  # noqa: E402
from benchmarks.remat import compile_step  # noqa: E402
from benchmarks.remat import run_child  # noqa: E402
from benchmarks.remat import summary  # noqa: E402
from benchmarks.remat import write_step_result  # noqa: E402

# name: (family, variant, overrides, batch: None = --batch, "15b" = --batch-15b)
MODELS = {
    "tiny": ("vmoe", "S/32", TINY, 8),
    "vit_b16": ("vit", "B/16", {}, None),
    "vit_l16": ("vit", "L/16", {}, None),
    "vit_h14": ("vit", "H/14", {}, None),
    "vmoe_15b": ("vmoe_15b", None, {}, "15b"),
}
# setting: (scan, remat)
SETTINGS = {"plain": (False, False), "scan": (True, False),
            "remat": (False, True), "scan_remat": (True, True)}


def log(*args):
    print("[scan]", *args, file=sys.stderr, flush=True)


def measure_one(name, scan, remat, batch):
    """Compiles one step in this process: `{"bytes": ..., "seconds": ...}`."""
    return compile_step(MODELS[name], batch, scan=scan, remat=remat)


def measure_in_subprocess(name, setting, batch):
    return run_child([os.path.abspath(__file__), "--one", name, "--setting", setting,
                      "--batch", str(batch)], f"{name} {setting}")


def run_model(name, batch, settings, reps):
    rows = {"batch": batch}
    for setting in settings:
        runs = []
        for rep in range(reps):
            log(f"{name} {setting} run {rep + 1}/{reps}")
            runs.append(measure_in_subprocess(name, setting, batch))
        first = runs[0]
        # Memory is a property of the program: every run must agree.
        assert all(r["bytes"] == first["bytes"] for r in runs), "memory differs"
        rows["num_parameters"] = first["num_parameters"]
        rows[setting] = {
            "peak_bytes": first["bytes"]["peak"],
            "peak_gib": round(first["bytes"]["peak"] / 2**30, 3),
            "temporaries_gib": round(first["bytes"]["xla_temporaries"] / 2**30, 3),
            "lower_s": summary([r["seconds"]["lower"] for r in runs]),
            "compile_s": summary([r["seconds"]["compile"] for r in runs]),
        }
    if "plain" in rows and "scan" in rows:
        def total(row):
            return row["lower_s"]["median"] + row["compile_s"]["median"]

        rows["compile_ratio_scan_over_plain"] = round(
            rows["scan"]["compile_s"]["median"] / rows["plain"]["compile_s"]["median"], 3)
        rows["lower_plus_compile_ratio_scan_over_plain"] = round(
            total(rows["scan"]) / total(rows["plain"]), 3)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="vit_b16,vit_l16,vit_h14,vmoe_15b",
                        help=f"comma-separated, from {', '.join(MODELS)}")
    parser.add_argument("--settings", default=",".join(SETTINGS),
                        help=f"comma-separated, from {', '.join(SETTINGS)}")
    parser.add_argument("--batch", type=int, default=64,
                        help="batch of the dense models (default 64)")
    parser.add_argument("--batch-15b", type=int, default=8,
                        help="batch of V-MoE-15B (default 8: one routing group)")
    parser.add_argument("--reps", type=int, default=3, help="compiles per setting")
    parser.add_argument("--quick", action="store_true",
                        help="tiny model, plain and scan, one run")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--setting", default="plain", help=argparse.SUPPRESS)
    parser.add_argument("--output", default=None, help="also write the JSON here")
    harness.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.one:
        scan, remat = SETTINGS[args.setting]
        print(json.dumps(measure_one(args.one, scan, remat, args.batch)))
        return 0
    harness.record_start(args.allow_loaded)
    names = ["tiny"] if args.quick else args.models.split(",")
    settings = ["plain", "scan"] if args.quick else args.settings.split(",")
    reps = 1 if args.quick else args.reps
    unknown = (set(names) - set(MODELS)) | (set(settings) - set(SETTINGS))
    if unknown:
        parser.error(f"unknown models or settings {sorted(unknown)}; valid: "
                     f"{', '.join(MODELS)}; {', '.join(SETTINGS)}")
    results = {}
    for name in names:
        batch = MODELS[name][3]
        batch = args.batch if batch is None else args.batch_15b if batch == "15b" else batch
        results[name] = run_model(name, batch, settings, reps)
    return write_step_result("scan", results, args.output)


if __name__ == "__main__":
    main()
