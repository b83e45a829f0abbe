"""Sweep of `Experts` forward time, loop vs batched, over expert shapes.

For each `(E, rows, D, M)` it times `Experts(implementation="loop")` and
`Experts(implementation="batched")` at inference on `(1, E, rows, D)`
buffers (same weights, interleaved in one process). It also records what
`implementation="auto"` picks, so that its limits (`LOOP_MIN_ROWS`,
`LOOP_MIN_HIDDEN_BYTES` in `keras_vmoe/layers/experts.py`) can be checked
against the machine at hand. ONE JSON object goes to stdout.

Run from the repository root::

    KERAS_BACKEND=jax python benchmarks/expert_paths.py --output paths.json
    KERAS_BACKEND=jax python benchmarks/expert_paths.py --quick
"""

import argparse
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.moe_layer import add_common_arguments  # noqa: E402
from benchmarks.moe_layer import compile_fn  # noqa: E402
from benchmarks.moe_layer import emit_json  # noqa: E402
from benchmarks.moe_layer import environment  # noqa: E402
from benchmarks.moe_layer import parse_arguments  # noqa: E402
from benchmarks.moe_layer import positive_ints  # noqa: E402
from benchmarks.moe_layer import summarize_ms  # noqa: E402
from benchmarks.moe_layer import time_interleaved  # noqa: E402
from keras_vmoe.layers import Experts  # noqa: E402

# (E, rows per expert, D, M): Soft MoE S/16 at batch 8 and 32, the E=32
# layer of benchmarks/moe_layer.py at growing batch, V-MoE-B/16 E=8.
DEFAULT_SHAPES = (
    (128, 8, 384, 1536),
    (128, 32, 384, 1536),
    (32, 28, 512, 2048),
    (32, 64, 512, 2048),
    (32, 108, 512, 2048),
    (32, 128, 512, 2048),
    (32, 256, 512, 2048),
    (8, 200, 768, 3072),
    (8, 300, 768, 3072),
    (8, 416, 768, 3072),
    (16, 512, 384, 1536),
)
QUICK_SHAPES = ((4, 8, 8, 16), (2, 16, 8, 16))
PATHS = ("loop", "batched")


def shape_entries(shape, seed):
    """Compiled forward of each path (same layer and weights), and auto's pick."""
    e, rows, d, m = shape
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((1, e, rows, d), dtype=np.float32))
    layer = Experts(e, m, name="experts")
    layer.build(x.shape)
    auto = "loop" if layer.uses_loop(False, rows=rows) else "batched"
    weights = [v.value for v in layer.trainable_variables]

    def forward(w, x):
        return layer.stateless_call(w, [], x, training=False)[0]

    entries = {}
    for path in PATHS:
        layer.implementation = path  # read when the call is traced (compiled)
        entries[(f"{shape}:{path}", "fwd")] = compile_fn(forward, (weights, x))
    return entries, auto


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes, 3 repetitions (checks the script runs)")
    parser.add_argument("--shape", type=positive_ints(("E", "ROWS", "D", "M")),
                        action="append", default=None,
                        metavar="E,ROWS,D,M", help="sweep these shapes (repeatable)")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    add_common_arguments(parser)
    args = parse_arguments(parser, argv)
    shapes = args.shape or list(QUICK_SHAPES if args.quick else DEFAULT_SHAPES)
    reps = args.reps or (3 if args.quick else 11)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)

    start = time.perf_counter()
    rows_out = []
    for shape in shapes:
        entries, auto = shape_entries(shape, args.seed)
        samples, _ = time_interleaved(entries, reps, warmup)
        e, rows, d, m = shape
        times = {path: summarize_ms(samples[(f"{shape}:{path}", "fwd")]) for path in PATHS}
        faster = min(PATHS, key=lambda p: times[p]["median_ms"])
        rows_out.append({
            "num_experts_E": e, "rows": rows, "hidden_D": d, "expert_mlp_M": m,
            "hidden_mib": e * rows * m * 4 / 2**20,
            **{f"{path}_ms": times[path] for path in PATHS},
            "loop_vs_batched": times["loop"]["median_ms"] / times["batched"]["median_ms"],
            "faster": faster,
            "auto_picks": auto,
        })
        print(f"E={e} rows={rows} M={m}: loop {times['loop']['median_ms']:.1f} ms, "
              f"batched {times['batched']['median_ms']:.1f} ms, auto {auto}",
              file=sys.stderr)
    result = {
        "benchmark": "keras_vmoe Experts forward: loop vs batched",
        "environment": environment(),
        "settings": {"reps": reps, "warmup": warmup, "quick": args.quick,
                     "dtype": "float32"},
        "shapes": rows_out,
        "auto_picks_faster": sum(r["auto_picks"] == r["faster"] for r in rows_out),
        "total_runtime_s": time.perf_counter() - start,
    }
    emit_json(result, args.output)
    return result


if __name__ == "__main__":
    main()
