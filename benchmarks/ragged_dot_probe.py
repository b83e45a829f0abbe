"""Probe: the experts as `jax.lax.ragged_dot` against the batched matmuls.

`jax.lax.ragged_dot` multiplies row groups of one `(rows, D)` matrix by
per-group weights, so it could run the experts on only the buffer rows that
hold tokens (no capacity-padding FLOPs). Whether it is fast depends on how
the backend lowers it, so this script measures it instead of assuming. For
each `(E, rows, D, M)` and dtype it times, interleaved in one process:

- ``batched``: `Experts`' batched path, `(E, rows, D) @ (E, D, M)`, tanh-GELU,
  `(E, rows, M) @ (E, M, D)`;
- ``ragged_all``: the same two products as `ragged_dot` over the `E·rows`
  rows, every group `rows` long (the same FLOPs);
- ``ragged_filled``: `ragged_dot` with each expert's group cut to the rows
  a capacity-limited router fills (a fixed draw of 60-100% per expert), as
  a path that skips empty slots would run it;

forward and forward+backward (gradients w.r.t. the inputs and both
weights). ONE JSON object goes to stdout (progress to stderr). Nothing in the
package uses `ragged_dot`: on XLA:CPU and on an H100 (XLA:GPU) it was 5-50x
slower than the batched matmuls (benchmarks/README.md).

Run from the repository root::

    KERAS_BACKEND=jax python benchmarks/ragged_dot_probe.py --output ragged.json
    KERAS_BACKEND=jax python benchmarks/ragged_dot_probe.py --quick
"""

import argparse
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.moe_layer import add_common_arguments  # noqa: E402
from benchmarks.moe_layer import calls_per_sample  # noqa: E402
from benchmarks.moe_layer import compile_fn  # noqa: E402
from benchmarks.moe_layer import emit_json  # noqa: E402
from benchmarks.moe_layer import environment  # noqa: E402
from benchmarks.moe_layer import log  # noqa: E402
from benchmarks.moe_layer import parse_arguments  # noqa: E402
from benchmarks.moe_layer import positive_ints  # noqa: E402
from benchmarks.moe_layer import summarize_ms  # noqa: E402
from benchmarks.moe_layer import time_interleaved  # noqa: E402

# (E, rows per expert, D, M): the E=32 layer of benchmarks/moe_layer.py at
# 1 and 32 groups, V-MoE-B/16 E=8, Soft MoE S/16 at batch 8.
DEFAULT_SHAPES = (
    (32, 28, 512, 2048),
    (32, 896, 512, 2048),
    (8, 416, 768, 3072),
    (128, 8, 384, 1536),
)
QUICK_SHAPES = ((4, 8, 8, 16),)
PATHS = ("batched", "ragged_all", "ragged_filled")
MODES = ("fwd", "fwd_bwd")


def batched_mlp(x, w0, w1, group_sizes):
    """`Experts`' batched path without biases. x (E, rows, D) -> (E, rows, D)."""
    del group_sizes
    h = jax.nn.gelu(jnp.matmul(x, w0), approximate=True)  # (E, rows, M)
    return jnp.matmul(h, w1)


def ragged_mlp(x, w0, w1, group_sizes):
    """The same MLP as `ragged_dot` over the E·rows rows, grouped by expert.

    Rows past an expert's group size belong to no group: `ragged_dot`
    returns zeros there.
    """
    e, rows, d = x.shape
    flat = jnp.reshape(x, (e * rows, d))  # (E·rows, D)
    h = jax.nn.gelu(jax.lax.ragged_dot(flat, w0, group_sizes), approximate=True)
    return jnp.reshape(jax.lax.ragged_dot(h, w1, group_sizes), (e, rows, d))


def filled_rows(num_experts, rows, seed):
    """Rows a capacity-limited router fills per expert: 60-100% of `rows`."""
    rng = np.random.default_rng(seed)
    return np.maximum(1, (rows * rng.uniform(0.6, 1.0, num_experts)).astype(np.int32))


def shape_entries(shape, dtype, seed):
    """Compiled forward and forward+backward of each path at one shape."""
    e, rows, d, m = shape
    rng = np.random.default_rng(seed)

    def normal(*dims, scale=1.0):
        return jnp.asarray(rng.standard_normal(dims, dtype=np.float32) * scale, dtype)

    x, w0, w1 = normal(e, rows, d), normal(e, d, m, scale=0.02), normal(e, m, d, scale=0.02)
    cotangent = jnp.ones((e, rows, d), dtype)
    # `ragged_filled` packs its groups at the front of the rows, as a path
    # that sorted the filled slots by expert would lay them out; the rows
    # after them belong to no group. Only its time matters, not its output.
    full = jnp.full((e,), rows, jnp.int32)
    filled = filled_rows(e, rows, seed)
    sizes = {"batched": full, "ragged_all": full,
             "ragged_filled": jnp.asarray(filled)}
    functions = {"batched": batched_mlp, "ragged_all": ragged_mlp, "ragged_filled": ragged_mlp}
    entries = {}
    for path, fn in functions.items():
        def loss(x, w0, w1, group_sizes, fn=fn):
            y = fn(x, w0, w1, group_sizes).astype(jnp.float32)
            return jnp.sum(y * cotangent.astype(jnp.float32))

        grad = jax.value_and_grad(loss, argnums=(0, 1, 2))
        args = (x, w0, w1, sizes[path])
        entries[(path, "fwd")] = compile_fn(fn, args)
        entries[(path, "fwd_bwd")] = compile_fn(grad, args)
    fwd = {p: entries[(p, "fwd")]["compiled"] for p in ("batched", "ragged_all")}
    diff = jnp.max(jnp.abs(fwd["batched"](x, w0, w1, full).astype(jnp.float32)
                           - fwd["ragged_all"](x, w0, w1, full).astype(jnp.float32)))
    return entries, float(filled.sum()) / (e * rows), float(diff)


def failing_entries(entries):
    """Runs each compiled entry once; `{key: error}` for those that fail.

    XLA:CPU lowers `ragged_dot` to dense products over every group: at 896
    rows per expert its forward+backward asked for 34.5 GB, which is itself
    the result to report rather than a reason to stop. The call doubles as
    the first warm-up call.
    """
    errors = {}
    for key, entry in entries.items():
        try:
            jax.block_until_ready(entry["compiled"](*entry["args"]))
        except jax.errors.JaxRuntimeError as error:
            errors[key] = str(error).splitlines()[0][:300]
            log(f"{key}: {errors[key]}")
    return errors


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="one tiny shape, 3 repetitions (checks the script runs)")
    parser.add_argument("--shape", type=positive_ints(("E", "ROWS", "D", "M")),
                        action="append", default=None, metavar="E,ROWS,D,M",
                        help="probe these shapes (repeatable)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), action="append",
                        default=None, help="dtypes to probe (default float32)")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    add_common_arguments(parser)
    args = parse_arguments(parser, argv)
    shapes = args.shape or list(QUICK_SHAPES if args.quick else DEFAULT_SHAPES)
    dtypes = args.dtype or ["float32"]
    reps = args.reps or (3 if args.quick else 7)
    warmup = args.warmup if args.warmup is not None else 1
    calls = calls_per_sample()

    start = time.perf_counter()
    rows_out = []
    for shape in shapes:
        for dtype in dtypes:
            entries, fill, diff = shape_entries(shape, dtype, args.seed)
            errors = failing_entries(entries)
            log(f"timing E,rows,D,M={shape} {dtype} ...")
            samples, _ = time_interleaved(
                {key: v for key, v in entries.items() if key not in errors},
                reps, max(warmup - 1, 0), calls)
            e, rows, d, m = shape
            row = {"num_experts_E": e, "rows": rows, "hidden_D": d, "expert_mlp_M": m,
                   "dtype": dtype, "filled_fraction": fill,
                   "ragged_all_vs_batched_max_abs_diff": diff}
            for mode in MODES:
                times = {p: summarize_ms(samples[(p, mode)]) for p in PATHS
                         if (p, mode) in samples}
                batched = times["batched"]["median_ms"]
                row[mode] = {
                    p: {**t, "time_ratio_vs_batched": t["median_ms"] / batched}
                    for p, t in times.items()
                }
                row[mode].update({path: {"error": error}
                                  for (path, path_mode), error in errors.items()
                                  if path_mode == mode})
            rows_out.append(row)
    ratios = [row[mode][p]["time_ratio_vs_batched"] for row in rows_out
              for mode in MODES for p in PATHS
              if p != "batched" and "error" not in row[mode][p]]
    result = {
        "benchmark": "experts as jax.lax.ragged_dot vs batched matmuls",
        "environment": environment(),
        "settings": {"reps": reps, "warmup": warmup, "quick": args.quick,
                     "calls_per_sample": calls, "dtypes": dtypes},
        "shapes": rows_out,
        "best_ragged_time_ratio_vs_batched": min(ratios, default=None),
        "ragged_faster_anywhere": bool(ratios) and min(ratios) < 1.0,
        "total_runtime_s": time.perf_counter() - start,
    }
    emit_json(result, args.output)
    return result


if __name__ == "__main__":
    main()
