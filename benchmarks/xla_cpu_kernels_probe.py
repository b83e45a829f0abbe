"""Probe: XLA:CPU's matmul kernel libraries at the experts' shapes.

XLA:CPU can hand dots to several libraries, chosen by process-wide
``XLA_FLAGS`` (read once, when the backend starts). jax 0.10 runs dots
through YNNPACK by default (``__ynn_fusion`` in the optimized HLO); with
YNNPACK switched off they fall back to XLA's Eigen kernels, or go to
XNNPACK or oneDNN when those are asked for. Whether another library is
faster at the experts' small per-expert row counts decides whether the
many-expert layer's distance from its floor is the kernels' or ours, so
this script measures it instead of assuming.

For each flag set it starts a fresh Python process with those flags, which
compiles and times, interleaved, for each shape ``(E, rows, D, M)``:

- the experts' MLP without biases, ``(E, rows, D) @ (E, D, M)``, tanh-GELU,
  ``(E, rows, M) @ (E, M, D)`` (``ragged_dot_probe.batched_mlp``), forward
  and forward+backward (gradients w.r.t. the inputs and both weights);

and records the median time, the FLOP rate, the library fusions XLA put in
the optimized HLO (so a flag that took no effect shows) and the forward
output's largest difference from the default flags' output. Shapes with
``E=1`` are the dense MLPs with the same activated FLOPs that
``moe_layer.py`` compares the layers with. A flag set that this jaxlib
rejects or that fails to compile is recorded with its error.

ONE JSON object goes to stdout (progress to stderr).

Run from the repository root::

    KERAS_BACKEND=jax python benchmarks/xla_cpu_kernels_probe.py --output kernels.json
    KERAS_BACKEND=jax python benchmarks/xla_cpu_kernels_probe.py --quick
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# name -> XLA_FLAGS. Flag names are those of jaxlib 0.10.2; a jaxlib without
# one of them rejects it, which is recorded.
FLAG_SETS = {
    "default": "",
    "eigen": "--xla_cpu_experimental_ynn_fusion_type=",
    "xnnpack": ("--xla_cpu_experimental_ynn_fusion_type= "
                "--xla_cpu_experimental_xnn_fusion_type=LIBRARY_FUSION_TYPE_DOT"),
    "onednn": ("--xla_cpu_experimental_ynn_fusion_type= --xla_cpu_use_onednn=true "
               "--xla_cpu_experimental_onednn_fusion_type=LIBRARY_FUSION_TYPE_DOT"),
    "ynnpack_dot_and_eltwise": (
        "--xla_cpu_experimental_ynn_fusion_type="
        "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_ELTWISE"),
}
# (E, rows per expert, D, M): the E=32 layer of moe_layer.py (28 rows), its
# dense baseline (400 tokens, hidden K·M), V-MoE-B/16 E=8 and its dense
# baseline, Soft MoE S/16 at batch 8 (128 experts of 8 rows).
DEFAULT_SHAPES = (
    (32, 28, 512, 2048),
    (1, 400, 512, 4096),
    (8, 416, 768, 3072),
    (1, 1576, 768, 6144),
    (128, 8, 384, 1536),
)
QUICK_SHAPES = ((4, 8, 8, 16),)
QUICK_FLAG_SETS = ("default", "eigen")
MODES = ("fwd", "fwd_bwd")


def library_fusions(hlo_text):
    """Library fusion kinds (`__ynn_fusion`, ...) in an optimized HLO module."""
    return sorted(set(re.findall(r'"kind":"(__\w+_fusion)"', hlo_text)))


def measure(shapes, reps, warmup, seed):
    """In this process (flags already set): times of every shape and mode.

    Returns:
        ``(rows, outputs)``: one dict per shape, with each mode's median and
        min ms, GFLOP/s and library fusions; and ``{shape index: forward
        output}`` for the comparison of flag sets.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.moe_layer import compile_fn
    from benchmarks.moe_layer import summarize_ms
    from benchmarks.moe_layer import time_interleaved
    from benchmarks.ragged_dot_probe import batched_mlp

    def forward(x, w0, w1):
        return batched_mlp(x, w0, w1, None)  # (E, rows, D)

    def loss(x, w0, w1):  # a cotangent of ones
        return jnp.sum(forward(x, w0, w1))

    entries, rows_out, outputs = {}, [], {}
    for index, (e, rows, d, m) in enumerate(shapes):
        rng = np.random.default_rng(seed + index)
        x = jnp.asarray(rng.standard_normal((e, rows, d), dtype=np.float32))
        w0 = jnp.asarray(rng.standard_normal((e, d, m), dtype=np.float32) * 0.02)
        w1 = jnp.asarray(rng.standard_normal((e, m, d), dtype=np.float32) * 0.02)
        args = (x, w0, w1)
        entries[(index, "fwd")] = compile_fn(forward, args)
        entries[(index, "fwd_bwd")] = compile_fn(
            jax.value_and_grad(loss, argnums=(0, 1, 2)), args)
        outputs[index] = np.asarray(entries[(index, "fwd")]["compiled"](*args))
    samples, _ = time_interleaved(entries, reps, warmup, calls=1)
    for index, (e, rows, d, m) in enumerate(shapes):
        row = {"num_experts_E": e, "rows": rows, "hidden_D": d, "expert_mlp_M": m}
        for mode in MODES:
            entry = entries[(index, mode)]
            flops = 2 * 2 * e * rows * d * m * (1 if mode == "fwd" else 3)
            times = summarize_ms(samples[(index, mode)])
            row[mode] = {
                **times,
                "gflops": flops / times["median_ms"] / 1e6,
                "library_fusions": library_fusions(entry["compiled"].as_text()),
            }
        rows_out.append(row)
    return rows_out, outputs


def run_flag_set(name, flags, shapes, reps, warmup, seed, timeout, workdir):
    """Runs `measure` in a fresh process with `XLA_FLAGS=flags`.

    The child writes its forward outputs to `workdir/<name>.npz`.

    Returns:
        ``(rows, outputs_path)``, or ``({"error": ...}, None)`` when the
        process fails (a flag this jaxlib rejects, a failed compile).
    """
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), flags) if f)
    outputs_path = os.path.join(workdir, f"{name}.npz")
    spec = json.dumps({"shapes": shapes, "reps": reps, "warmup": warmup,
                       "seed": seed, "outputs": outputs_path})
    try:
        done = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--child", spec],
            env=env, capture_output=True, text=True, timeout=timeout, check=False)
        error = None if done.returncode == 0 else [
            line for line in done.stderr.splitlines() if line.strip()][-1:]
    except subprocess.TimeoutExpired:
        error = [f"timed out after {timeout} s"]
    if error is not None:
        return {"error": (error[0] if error else f"exit code {done.returncode}")[:300]}, None
    return json.loads(done.stdout.strip().splitlines()[-1]), outputs_path


def child(spec_text):
    """The `--child` entry: measures, writes the outputs, prints the rows."""
    import numpy as np

    spec = json.loads(spec_text)
    rows, outputs = measure([tuple(s) for s in spec["shapes"]], spec["reps"],
                            spec["warmup"], spec["seed"])
    np.savez(spec["outputs"], **{str(k): v for k, v in outputs.items()})
    print(json.dumps(rows))


def compare(results, outputs_paths):
    """Adds each flag set's time ratios and output differences vs `default`."""
    import numpy as np

    base_rows = results.get("default")
    base_outputs = outputs_paths.get("default")
    for name, rows in results.items():
        if isinstance(rows, dict) or not isinstance(base_rows, list):
            continue
        outputs = np.load(outputs_paths[name]) if outputs_paths.get(name) else None
        reference = np.load(base_outputs) if base_outputs else None
        for index, row in enumerate(rows):
            for mode in MODES:
                row[mode]["time_ratio_vs_default"] = (
                    row[mode]["median_ms"] / base_rows[index][mode]["median_ms"])
            if outputs is not None and reference is not None:
                row["fwd_max_abs_diff_vs_default"] = float(
                    np.max(np.abs(outputs[str(index)] - reference[str(index)])))


def best_per_shape(results, shapes):
    """For each shape and mode: the fastest flag set and its ratio to default."""
    best = []
    for index, shape in enumerate(shapes):
        for mode in MODES:
            timed = {name: rows[index][mode]["median_ms"] for name, rows in results.items()
                     if isinstance(rows, list)}
            if not timed:
                continue
            name = min(timed, key=timed.get)
            best.append({"shape_E_rows_D_M": list(shape), "mode": mode, "fastest": name,
                         "time_ratio_vs_default": timed[name] / timed.get("default", timed[name])})
    return best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="one tiny shape, two flag sets (checks the script runs)")
    parser.add_argument("--flag-sets", default=None,
                        help=f"comma-separated names of {sorted(FLAG_SETS)}")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--timeout", type=int, default=900,
                        help="seconds allowed to each flag set's process")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="also write the JSON here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--allow-loaded", action="store_true",
                        help="write --output even on a shared machine (recorded)")
    args = parser.parse_args(argv)
    if args.child is not None:
        child(args.child)
        return None
    from benchmarks import harness

    harness.record_start(args.allow_loaded)
    names = (args.flag_sets.split(",") if args.flag_sets
             else list(QUICK_FLAG_SETS if args.quick else FLAG_SETS))
    unknown = [n for n in names if n not in FLAG_SETS]
    if unknown:
        parser.error(f"--flag-sets: unknown {unknown}; valid: {sorted(FLAG_SETS)}")
    if "default" not in names:
        names.insert(0, "default")
    shapes = [list(s) for s in (QUICK_SHAPES if args.quick else DEFAULT_SHAPES)]
    reps = args.reps or (2 if args.quick else 9)
    if reps < 1 or args.warmup < 0 or args.timeout < 1:
        parser.error(f"--reps and --timeout must be >= 1 and --warmup >= 0; received "
                     f"reps={reps}, timeout={args.timeout}, warmup={args.warmup}")

    # The parent only starts processes; importing jax here is harmless.
    from benchmarks.moe_layer import emit_json
    from benchmarks.moe_layer import environment
    from benchmarks.moe_layer import log

    start = time.perf_counter()
    results, outputs_paths = {}, {}
    with tempfile.TemporaryDirectory(prefix="xla_cpu_kernels_") as workdir:
        for name in names:
            log(f"flag set {name!r}: XLA_FLAGS={FLAG_SETS[name]!r} ...")
            results[name], outputs_paths[name] = run_flag_set(
                name, FLAG_SETS[name], shapes, reps, args.warmup, args.seed,
                args.timeout, workdir)
        compare(results, outputs_paths)

    result = {
        "benchmark": "XLA:CPU matmul kernel libraries at the experts' shapes",
        "environment": environment(),
        "settings": {"reps": reps, "warmup": args.warmup, "quick": args.quick,
                     "flag_sets": {n: FLAG_SETS[n] for n in names},
                     "timing": "median wall time of compiled calls, shapes and modes "
                               "interleaved, each flag set in its own process"},
        "shapes_E_rows_D_M": shapes,
        "flag_sets": results,
        "fastest": best_per_shape(results, shapes),
        "total_runtime_s": time.perf_counter() - start,
    }
    emit_json(result, args.output)
    return result


if __name__ == "__main__":
    main()
