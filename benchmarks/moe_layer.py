"""Benchmark of `MoeLayer` against a dense MLP with the same activated FLOPs.

For each shape, the script compiles and times, interleaved in one process:

- ``dense``: a two-layer tanh-GELU MLP of hidden size ``K·M`` (the FLOPs a
  token activates in a top-K MoE of expert size ``M``), written with
  ``jnp`` matmuls;
- ``index``: ``MoeLayer(dispatch="index")``, the gather/scatter fast path
  (the layer's default), with its default expert implementation
  (``Experts(implementation="auto")``: batched matmuls, or a loop over the
  experts at inference when the batched hidden activations would be large);
- ``index_alt``: the same layer with the other expert implementation in
  each mode (loop vs batched), to show what the default choice gains;
- ``einsum``: ``MoeLayer(dispatch="einsum")``, the one-hot ``(G, S, E, C)``
  reference.

Each variant is measured in forward (``fwd``: an inference call,
``training=False``) and forward+backward (``fwd_bwd``: ``jax.value_and_grad``
w.r.t. the inputs and all the trainable weights of a stateless training call,
``training=True``, with router noise off) mode. It reports the median wall
time and its ratio to the dense MLP (also the median of per-repetition
paired ratios, the ratio of the minima, and a process-CPU-time ratio, which
are less sensitive to other processes on a shared machine), the compiled temp
memory
(``memory_analysis().temp_size_in_bytes``) and its ratio to the dense
MLP's, and XLA's cost-analysis FLOPs. The result is ONE JSON object on
stdout; progress goes to stderr.

Run (from the repository root)::

    KERAS_BACKEND=jax python benchmarks/moe_layer.py           # ~1-2 min on 2 CPU cores
    KERAS_BACKEND=jax python benchmarks/moe_layer.py --quick   # fewer repetitions
    KERAS_BACKEND=jax python benchmarks/moe_layer.py --batch 4 --output out.json

Each variant is also compared with a floor measured in the same process:
``max(compute floor, memory floor)``, the unavoidable expert FLOPs at the
throughput of a large dense matmul and the weight/activation bytes at the
bandwidth of a large streaming read (``machine`` in the JSON). The
experts' batched matmuls are also timed alone at the layer's per-expert row
count, forward and forward+backward (``expert_matmuls_*``), and once more
with only as many experts as keep their weights in cache
(``expert_matmuls_*_resident``): the throughput the matmul kernels attain
at that row count with no memory traffic. ``small_row_floor_ms`` is the
floor with the FLOPs at that throughput, what no implementation on top of
these kernels can beat (CPU only: on an accelerator so little work measures
launch latency, and ``small_row_floor_ms`` is null).

On an accelerator each timing sample is 10 back-to-back calls and one wait
(``--calls-per-sample``), since one call there is shorter than the host's
launch-and-wait latency, and the probes are larger (an 8192 matmul, a 2 GiB
read).

The targets reported in ``targets_met`` (index within 1.10x dense at the
first shape and within 1.5x of the floor at the many-expert shape, both
modes; temp memory of the default path <= 2x the dense MLP's) are
informational: the script never fails on them.
"""

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

# Run from a checkout without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import harness  # noqa: E402
from keras_vmoe.layers import MoeLayer  # noqa: E402
from keras_vmoe.layers.capacity import compute_capacity  # noqa: E402
from keras_vmoe.layers.experts import compute_platform  # noqa: E402
from keras_vmoe.utils.malloc_tuning import reuse_freed_memory  # noqa: E402
from keras_vmoe.utils.malloc_tuning import reusing_freed_memory  # noqa: E402

# (S, D, M, E, K, capacity_factor): V-MoE-B/16 at 224px with 8 experts, and
# a smaller many-expert layer.
DEFAULT_SHAPES = (
    (1576, 768, 3072, 8, 2, 1.05),
    (400, 512, 2048, 32, 2, 1.05),
)
VARIANTS = ("dense", "index", "index_alt", "einsum")
MODES = ("fwd", "fwd_bwd")
FLOAT32_BYTES = 4
DENSE_TIME_RATIO_TARGET = 1.10
FLOOR_TIME_RATIO_TARGET = 1.5
TEMP_MEMORY_RATIO_TARGET = 2.0


def log(*args):
    print(*args, file=sys.stderr, flush=True)


def parse_shape(text):
    parts = text.split(",")
    if len(parts) != 6:
        raise argparse.ArgumentTypeError(
            f"--shape expects S,D,M,E,K,CF (6 comma-separated values). Received: {text!r}"
        )
    s, d, m, e, k = (int(p) for p in parts[:5])
    return (s, d, m, e, k, float(parts[5]))


def dense_mlp(params, x):
    """The dense baseline: Dense(K·M) -> tanh-GELU -> Dense(D)."""
    w0, b0, w1, b1 = params
    h = jnp.matmul(x, w0) + b0
    h = jax.nn.gelu(h, approximate=True)
    return jnp.matmul(h, w1) + b1


def make_dense(hidden, mlp_dim, seed):
    rng = np.random.default_rng(seed)
    lim0 = np.sqrt(6.0 / (hidden + mlp_dim))
    w0 = rng.uniform(-lim0, lim0, (hidden, mlp_dim)).astype("float32")
    w1 = rng.uniform(-lim0, lim0, (mlp_dim, hidden)).astype("float32")
    b0 = np.zeros((mlp_dim,), "float32")
    b1 = np.zeros((hidden,), "float32")
    return tuple(jnp.asarray(a) for a in (w0, b0, w1, b1))


def on_accelerator():
    """Whether the backend computes on an accelerator (GPU/TPU), not the CPU."""
    return compute_platform() != "cpu"


def machine_probes(quick):
    """Compiled probes of the machine's matmul throughput and memory bandwidth.

    - ``matmul``: an ``(N, N) @ (N, N)`` float32 matmul (N=2048 on a CPU,
      8192 on an accelerator, which a 2048 matmul leaves mostly idle; 512
      with ``--quick``), ``2·N³`` FLOPs, at the backend's default float32
      matmul precision (TF32 on recent NVIDIA GPUs), like the variants;
    - ``stream``: the sum of a float32 array much larger than the last-level
      cache (256 MiB on a CPU, 2 GiB on an accelerator, 64 MiB with
      ``--quick``): every byte is read once from memory.

    They are timed interleaved with the variants, so the floor is measured
    under the same machine load.

    Returns:
        dict ``name -> (compiled entry, work)``, work in FLOPs or bytes.
    """
    large = on_accelerator() and not quick
    n = 512 if quick else (8192 if large else 2048)
    stream_bytes = (64 if quick else (2048 if large else 256)) * 2**20
    rng = np.random.default_rng(1)
    a = jnp.asarray(rng.standard_normal((n, n), dtype=np.float32))
    b = jnp.asarray(rng.standard_normal((n, n), dtype=np.float32))
    big = jnp.ones((stream_bytes // FLOAT32_BYTES,), "float32")
    return {
        "matmul": (compile_fn(jnp.matmul, (a, b)), 2.0 * n**3),
        "stream": (compile_fn(jnp.sum, (big,)), float(stream_bytes)),
    }


# The cache-resident probe (`expert_matmul_probe(..., resident=True)`) runs
# at least one expert per core, and more while their weights take at most
# this many bytes, and chains this many passes over the same weights in one
# call: after the first pass they come from cache, even though other
# variants ran in between.
RESIDENT_WEIGHT_BYTES = 8 * 2**20
RESIDENT_PASSES = 8


def expert_matmul_probe(shape, batch, mode="fwd", resident=False):
    """The expert MLP's batched matmuls alone, at the layer's shapes.

    ``(E, G·C, D) @ (E, D, M)`` then ``(E, G·C, M) @ (E, M, D)`` (no bias,
    activation, routing or dispatch): what the backend's matmul kernels
    attain at the experts' small per-expert row count ``G·C``. The MoE
    layer's ratio to it is the cost of everything else. ``mode="fwd_bwd"``
    times their ``value_and_grad`` (the four backward matmuls too).

    With ``resident=True`` only a few experts run (one per core, more while
    their weights fit in ``RESIDENT_WEIGHT_BYTES``), ``RESIDENT_PASSES``
    times in a chain over the same weights: the matmul kernels' throughput
    at this row count with the weights in cache, i.e. the best these
    kernels can do at this shape without memory traffic.

    Returns:
        ``(compiled entry, FLOPs of one call)``.
    """
    s, d, m, e, k, cf = shape
    rows = batch * compute_capacity(s * k, e, cf)
    passes = 1
    if resident:
        expert_bytes = 2 * d * m * FLOAT32_BYTES
        e = min(e, max(os.cpu_count() or 1, RESIDENT_WEIGHT_BYTES // expert_bytes))
        passes = RESIDENT_PASSES
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((e, rows, d), dtype=np.float32))
    w0 = jnp.asarray(rng.standard_normal((e, d, m), dtype=np.float32) / np.sqrt(d))
    w1 = jnp.asarray(rng.standard_normal((e, m, d), dtype=np.float32) / np.sqrt(m))

    def two_matmuls(x, w0, w1):
        def one_pass(_, y):  # each pass reads the last one's output
            return jnp.matmul(jnp.matmul(y, w0), w1)  # (E, rows, M) -> (E, rows, D)

        return jax.lax.fori_loop(0, passes, one_pass, x)

    flops = 2 * 2 * e * rows * d * m * passes
    if mode == "fwd":
        return compile_fn(two_matmuls, (x, w0, w1)), flops
    cotangent = jnp.ones_like(x)

    def loss(x, w0, w1):
        return jnp.sum(two_matmuls(x, w0, w1) * cotangent)

    return compile_fn(jax.value_and_grad(loss, argnums=(0, 1, 2)), (x, w0, w1)), 3 * flops


def numpy_expert_matmuls(shape, batch, reps):
    """The same two batched matmuls through NumPy's BLAS (another library).

    A second implementation of the experts' matmuls at their row count:
    if it is no faster than XLA's, the gap to the large-matmul floor is the
    shape's (few rows per weight read), not XLA's. Not interleaved with the
    compiled variants (best of ``reps`` calls).

    Returns:
        dict: ``min_ms``, ``gflops`` and the BLAS library's name.
    """
    s, d, m, e, k, cf = shape
    rows = batch * compute_capacity(s * k, e, cf)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((e, rows, d), dtype=np.float32)
    w0 = rng.standard_normal((e, d, m), dtype=np.float32)
    w1 = rng.standard_normal((e, m, d), dtype=np.float32)
    hidden = np.empty((e, rows, m), np.float32)
    out = np.empty((e, rows, d), np.float32)
    times = []
    for _ in range(max(reps, 3)):
        start = time.perf_counter()
        np.matmul(np.matmul(x, w0, out=hidden), w1, out=out)
        times.append(time.perf_counter() - start)
    try:
        blas = np.__config__.CONFIG["Build Dependencies"]["blas"]["name"]
    except (AttributeError, KeyError, TypeError):
        blas = None
    best = min(times)
    return {
        "min_ms": best * 1e3,
        "gflops": 2 * 2 * e * rows * d * m / best / 1e9,
        "blas": blas,
    }


def floor_work(shape, batch, mode, moe):
    """Unavoidable FLOPs and memory bytes of one call.

    FLOPs: the two expert matmuls of the tokens actually routed
    (``G·min(K·S, E·C)`` token-expert pairs, capacity padding excluded), the
    same for the dense MLP (``G·S`` tokens, hidden ``K·M``); ``fwd_bwd``
    counts 3x the forward (input and weight gradients). Bytes: the weights
    read once, plus the input read and the output written; ``fwd_bwd`` also
    writes the weight gradients once and reads the cotangent and writes the
    input gradient. Biases, routing and activations' round trips are
    ignored, so this is a lower bound.
    """
    s, d, m, e, k, cf = shape
    capacity = compute_capacity(s * k, e, cf)
    if moe:
        pairs = batch * min(k * s, e * capacity)
        weights = e * (2 * d * m + m + d)
    else:
        pairs = batch * s * k  # dense hidden K·M == K pairs of size M
        weights = 2 * d * k * m + k * m + d
    flops = 2 * 2 * pairs * d * m
    tokens = batch * s * d
    if mode == "fwd":
        # Weights read; x read, y written.
        bytes_ = (weights + 2 * tokens) * FLOAT32_BYTES
    else:
        # Weights read, weight gradients written; x and cotangent read,
        # input gradient written.
        flops *= 3
        bytes_ = (2 * weights + 3 * tokens) * FLOAT32_BYTES
    return flops, bytes_


def make_moe(dispatch, num_experts, mlp_dim, k, cf, input_shape):
    layer = MoeLayer(
        num_experts,
        mlp_dim,
        router={
            "name": "token_choice",
            "num_selected_experts": k,
            "capacity_factor": cf,
            "noise_std": 0.0,  # training calls stay deterministic
        },
        group_size=input_shape[1],
        dispatch=dispatch,
        identical_init=False,
    )
    layer.build(input_shape)
    return layer


def moe_functions(layer):
    """Forward (inference) and forward+backward (training) pure functions."""

    def forward(trainable, non_trainable, x, training=False):
        y, _ = layer.stateless_call(trainable, non_trainable, x, training=training)
        return y

    def loss(trainable, non_trainable, x, cotangent):
        y = forward(trainable, non_trainable, x, training=True)
        return jnp.sum(y * cotangent)

    grad = jax.value_and_grad(loss, argnums=(0, 2))

    def forward_backward(trainable, non_trainable, x, cotangent):
        return grad(trainable, non_trainable, x, cotangent)

    return forward, forward_backward


def dense_functions():
    def loss(params, x, cotangent):
        return jnp.sum(dense_mlp(params, x) * cotangent)

    grad = jax.value_and_grad(loss, argnums=(0, 1))
    return dense_mlp, grad


def compile_fn(fn, args):
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax: one dict per computation
        cost = cost[0] if cost else {}
    cost = cost or {}
    return {
        "compiled": compiled,
        "args": args,
        "compile_s": seconds,
        "temp_bytes": int(memory.temp_size_in_bytes) if memory is not None else None,
        "flops": float(cost["flops"]) if "flops" in cost else None,
        "bytes_accessed": (
            float(cost["bytes accessed"]) if "bytes accessed" in cost else None
        ),
    }


def time_interleaved(entries, reps, warmup, calls=None):
    """Times every entry once per repetition, interleaved.

    Entries are keyed `(variant, mode)`. In each repetition the variants of
    one mode run back to back (so that their paired ratios compare calls made
    under the same machine load), in an order rotated every repetition. Each
    sample is `calls` back-to-back calls then one wait, divided by `calls`
    (default `calls_per_sample()`): on an accelerator this measures the
    device time rather than the host's launch-and-wait latency.
    """
    calls = calls_per_sample(calls)
    for entry in entries.values():
        for _ in range(warmup):
            jax.block_until_ready(entry["compiled"](*entry["args"]))
    modes = list(dict.fromkeys(mode for _, mode in entries))
    samples = {key: [] for key in entries}
    cpu_samples = {key: [] for key in entries}
    for rep in range(reps):
        for mode in modes:
            keys = [key for key in entries if key[1] == mode]
            shift = rep % len(keys)
            for key in keys[shift:] + keys[:shift]:
                entry = entries[key]
                cpu_start = time.process_time()
                start = time.perf_counter()
                for _ in range(calls):
                    out = entry["compiled"](*entry["args"])
                jax.block_until_ready(out)
                samples[key].append((time.perf_counter() - start) / calls)
                cpu_samples[key].append((time.process_time() - cpu_start) / calls)
    return samples, cpu_samples


def calls_per_sample(requested=None):
    """Calls per timing sample: 1 on a CPU, 10 on an accelerator (or `requested`)."""
    if requested is not None:
        return requested
    return 10 if on_accelerator() else 1


def ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return a / b


def summarize_ms(values):
    ms = sorted(v * 1e3 for v in values)
    q = statistics.quantiles(ms, n=4) if len(ms) >= 2 else [ms[0]] * 3
    return {
        "median_ms": statistics.median(ms),
        "p25_ms": q[0],
        "p75_ms": q[2],
        "min_ms": ms[0],
    }


def bench_shape(shape, batch, reps, warmup, seed, quick=False, calls=None):
    s, d, m, e, k, cf = shape
    input_shape = (batch, s, d)
    capacity = compute_capacity(s * k, e, cf)
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal(input_shape, dtype=np.float32))
    cotangent = jnp.asarray(rng.standard_normal(input_shape, dtype=np.float32))

    keras.utils.set_random_seed(seed)
    layers = {
        name: make_moe(name, e, m, k, cf, input_shape) for name in ("index", "einsum")
    }
    layers["index_alt"] = make_moe("index", e, m, k, cf, input_shape)
    # Both MoE variants use the same weights (the variables are in the same
    # order), so their outputs must agree.
    trainable = [v.value for v in layers["index"].trainable_variables]
    non_trainable = [v.value for v in layers["index"].non_trainable_variables]
    dense_params = make_dense(d, k * m, seed)

    entries = {}
    dense_fwd, dense_fwd_bwd = dense_functions()
    entries[("dense", "fwd")] = compile_fn(dense_fwd, (dense_params, x))
    entries[("dense", "fwd_bwd")] = compile_fn(
        dense_fwd_bwd, (dense_params, x, cotangent)
    )
    # The expert path `auto` picks per mode; `index_alt` runs the other one.
    rows = batch * capacity
    default_paths = {
        mode: "loop" if layers["index"].experts.uses_loop(training, rows=rows) else "batched"
        for mode, training in (("fwd", False), ("fwd_bwd", True))
    }
    alt_paths = {
        mode: "batched" if path == "loop" else "loop" for mode, path in default_paths.items()
    }
    implementations = {}  # (variant, mode) -> the expert path it runs
    for name, layer in layers.items():
        fwd, fwd_bwd = moe_functions(layer)
        for mode, function, args in (
            ("fwd", fwd, (trainable, non_trainable, x)),
            ("fwd_bwd", fwd_bwd, (trainable, non_trainable, x, cotangent)),
        ):
            # The implementation is read when the call is traced (compiled).
            if name == "index_alt":
                layer.experts.implementation = alt_paths[mode]
                implementations[(name, mode)] = alt_paths[mode]
            elif name == "index":
                implementations[(name, mode)] = default_paths[mode]
            entries[(name, mode)] = compile_fn(function, args)

    probes = machine_probes(quick)
    for name, (entry, _) in probes.items():
        entries[(name, "machine")] = entry
    probe_flops = {}
    for mode in MODES:
        for resident in (False, True):
            name = f"expert_matmuls_{mode}" + ("_resident" if resident else "")
            entries[(name, "machine")], probe_flops[name] = expert_matmul_probe(
                shape, batch, mode, resident
            )

    y_index = entries[("index", "fwd")]["compiled"](trainable, non_trainable, x)
    y_einsum = entries[("einsum", "fwd")]["compiled"](trainable, non_trainable, x)
    max_abs_diff = float(jnp.max(jnp.abs(y_index - y_einsum)))

    log(f"timing shape S={s} D={d} M={m} E={e} K={k} cf={cf} batch={batch} ...")
    samples, cpu_samples = time_interleaved(entries, reps, warmup, calls)

    result = {
        "config": {
            "group_size_S": s,
            "hidden_D": d,
            "expert_mlp_M": m,
            "num_experts_E": e,
            "num_selected_experts_K": k,
            "capacity_factor": cf,
            "capacity_C": capacity,
            "num_groups_G": batch,
            "input_shape": list(input_shape),
            "dense_mlp_hidden": k * m,
            # Expert matmul FLOPs of the MoE relative to the dense MLP's:
            # E·C buffer slots vs K·S activated tokens.
            "analytic_expert_flops_ratio": (e * capacity) / (k * s),
        },
        "index_vs_einsum_max_abs_diff": max_abs_diff,
    }
    # Best (minimum) probe times: the machine's attainable peaks in this run.
    peak_flops = probes["matmul"][1] / min(samples[("matmul", "machine")])
    bandwidth = probes["stream"][1] / min(samples[("stream", "machine")])
    result["machine"] = {
        "matmul_gflops": peak_flops / 1e9,
        "matmul_gflops_median": probes["matmul"][1]
        / statistics.median(samples[("matmul", "machine")])
        / 1e9,
        "stream_read_gbytes_per_s": bandwidth / 1e9,
        "stream_read_gbytes_per_s_median": probes["stream"][1]
        / statistics.median(samples[("stream", "machine")])
        / 1e9,
    }
    expert_matmul_ms = {}
    for name, flops in probe_flops.items():
        expert_matmul_ms[name] = summarize_ms(samples[(name, "machine")])
        result["machine"][name] = {
            **expert_matmul_ms[name],
            "gflops": flops / expert_matmul_ms[name]["min_ms"] / 1e6,
        }
    result["machine"]["expert_matmuls_fwd_numpy"] = numpy_expert_matmuls(
        shape, batch, reps
    )
    for mode in MODES:
        # The rate the matmul kernels attain at the experts' row count with
        # the weights in cache (the resident probe): nothing at this shape
        # beats it without faster small-row kernels. On an accelerator the
        # resident probe is too small to fill the device (it measures launch
        # latency), so it gives no floor there.
        small_row_gflops = (
            None if on_accelerator()
            else result["machine"][f"expert_matmuls_{mode}_resident"]["gflops"]
        )
        dense = entries[("dense", mode)]
        dense_samples = samples[("dense", mode)]
        dense_ms = summarize_ms(dense_samples)
        mode_result = {}
        for name in VARIANTS:
            entry = entries[(name, mode)]
            timing = summarize_ms(samples[(name, mode)])
            flops, bytes_ = floor_work(shape, batch, mode, moe=name != "dense")
            compute_floor_ms = flops / peak_flops * 1e3
            memory_floor_ms = bytes_ / bandwidth * 1e3
            floor_ms = max(compute_floor_ms, memory_floor_ms)
            # The same floor with the FLOPs at the small-row rate (None for
            # the dense MLP, whose rows are not the experts').
            small_row_floor_ms = (
                max(flops / (small_row_gflops * 1e9) * 1e3, memory_floor_ms)
                if name != "dense" and small_row_gflops else None
            )
            # Ratio of the two calls of the same repetition (measured close
            # in time), then the median over repetitions: robust to slow
            # drifts of the machine's load.
            paired = [
                a / b for a, b in zip(samples[(name, mode)], dense_samples, strict=True)
            ]
            mode_result[name] = {
                **timing,
                "experts_implementation": implementations.get((name, mode)),
                "time_ratio_vs_dense": ratio(
                    timing["median_ms"], dense_ms["median_ms"]
                ),
                "paired_time_ratio_vs_dense": statistics.median(paired),
                "min_time_ratio_vs_dense": ratio(timing["min_ms"], dense_ms["min_ms"]),
                # CPU time of this process (all threads): less sensitive than
                # wall time to other processes sharing the cores.
                "median_cpu_ms": statistics.median(cpu_samples[(name, mode)]) * 1e3,
                "cpu_time_ratio_vs_dense": ratio(
                    statistics.median(cpu_samples[(name, mode)]),
                    statistics.median(cpu_samples[("dense", mode)]),
                ),
                "floor_flops": flops,
                "floor_bytes": bytes_,
                "compute_floor_ms": compute_floor_ms,
                "memory_floor_ms": memory_floor_ms,
                "floor_ms": floor_ms,
                "floor_bound": (
                    "compute" if compute_floor_ms >= memory_floor_ms else "memory"
                ),
                # Median time over max(compute floor, memory floor); the floor
                # uses the best probe times, the `min_` ratio the best call.
                "time_ratio_vs_floor": ratio(timing["median_ms"], floor_ms),
                "min_time_ratio_vs_floor": ratio(timing["min_ms"], floor_ms),
                "small_row_floor_ms": small_row_floor_ms,
                "time_ratio_vs_small_row_floor": ratio(
                    timing["median_ms"], small_row_floor_ms
                ),
                f"time_ratio_vs_expert_matmuls_{mode}": ratio(
                    timing["median_ms"],
                    expert_matmul_ms[f"expert_matmuls_{mode}"]["median_ms"],
                ),
                "temp_bytes": entry["temp_bytes"],
                "temp_ratio_vs_dense": ratio(entry["temp_bytes"], dense["temp_bytes"]),
                "xla_flops": entry["flops"],
                "xla_flops_ratio_vs_dense": ratio(entry["flops"], dense["flops"]),
                "xla_bytes_accessed": entry["bytes_accessed"],
                "compile_s": entry["compile_s"],
            }
        result[mode] = mode_result
    return result


def add_common_arguments(parser):
    """`--seed`, `--reuse-freed-memory` and `--output`, shared by the scripts."""
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--reuse-freed-memory", action="store_true",
        help="call keras_vmoe.utils.malloc_tuning.reuse_freed_memory() first (glibc "
        "malloc keeps and reuses freed buffers; recorded in the JSON)",
    )
    parser.add_argument("--output", default=None, help="also write the JSON here")
    harness.add_arguments(parser)


def parse_arguments(parser, argv):
    """Parses, records the load average (`benchmarks.harness`), then applies
    `--reuse-freed-memory` before JAX runs anything."""
    args = parser.parse_args(argv)
    harness.record_start(getattr(args, "allow_loaded", False))
    if args.reuse_freed_memory:
        reuse_freed_memory()
    return args


def positive_ints(names):
    """An argparse type: comma-separated positive ints, one per name."""

    def parse(text):
        try:
            values = tuple(int(v) for v in text.split(","))
        except ValueError:
            values = ()
        if len(values) != len(names) or min(values) < 1:
            raise argparse.ArgumentTypeError(
                f"expected {len(names)} positive ints {','.join(names)}; "
                f"received {text!r}"
            )
        return values

    return parse


def emit_json(result, output=None):
    """Prints ONE JSON object; with `output`, also writes it atomically,
    unless the load average says the machine was shared
    (`benchmarks.harness.write_result`)."""
    return harness.write_result(result, output)


def git_commit():
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=os.path.dirname(os.path.abspath(__file__)),
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment():
    devices = jax.devices()
    return {
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax_version": jax.__version__,
        "jaxlib_version": _jaxlib_version(),
        "keras_version": keras.__version__,
        "keras_backend": keras.backend.backend(),
        "python_version": platform.python_version(),
        "devices": [str(dev) for dev in devices],
        "device_kind": devices[0].device_kind,
        "platform": devices[0].platform,
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        **cpu_description(),
        "xla_flags": os.environ.get("XLA_FLAGS"),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
        "reuse_freed_memory": reusing_freed_memory(),
        "git_commit": git_commit(),
    }


def cpu_description():
    """CPU model, family and widest vector ISA (Linux `/proc/cpuinfo`).

    Ratios differ between CPU generations (e.g. AVX2 vs AVX-512 cores), so
    every result records which one it ran on.
    """
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model", "flags"):
                    info.setdefault(key, value.strip())
    except OSError:
        return {"cpu_model": platform.processor() or None, "cpu_vector_isa": None}
    flags = set(info.get("flags", "").split())
    isa = next(
        (name for name in ("avx512f", "avx2", "avx", "sse4_2") if name in flags), None
    )
    family = info.get("cpu family")
    return {
        "cpu_model": info.get("model name"),
        "cpu_family_model": f"{family}/{info.get('model')}" if family else None,
        "cpu_vector_isa": isa,
    }


def _jaxlib_version():
    try:
        import jaxlib

        return jaxlib.__version__
    except (ImportError, AttributeError):
        return None


def targets(shape_results):
    """Issue-11 targets (informational: the run never fails on them).

    - the first shape (few experts): ``index`` within
      ``DENSE_TIME_RATIO_TARGET`` of the dense MLP, forward and fwd+bwd;
    - the shape with the most experts: ``index`` within
      ``FLOOR_TIME_RATIO_TARGET`` of the measured floor, both modes;
    - the default path's temp memory at most 2x the dense MLP's everywhere.
    """
    first = shape_results[0]
    many = max(shape_results, key=lambda r: r["config"]["num_experts_E"])
    default = "index"  # MoeLayer's default dispatch
    values, met = {}, {}
    for mode in MODES:
        value = first[mode][default]["time_ratio_vs_dense"]
        values[f"index_{mode}_time_ratio_vs_dense_first_shape"] = value
        values[f"index_{mode}_paired_time_ratio_vs_dense_first_shape"] = first[mode][
            default
        ]["paired_time_ratio_vs_dense"]
        met[f"index_{mode}_le_{DENSE_TIME_RATIO_TARGET:g}x_dense_first_shape"] = (
            value <= DENSE_TIME_RATIO_TARGET
        )
        value = many[mode][default]["time_ratio_vs_floor"]
        values[f"index_{mode}_time_ratio_vs_floor_most_experts"] = value
        met[f"index_{mode}_le_{FLOOR_TIME_RATIO_TARGET:g}x_floor_most_experts"] = (
            value <= FLOOR_TIME_RATIO_TARGET
        )
    for mode in MODES:
        ratios = [r[mode][default]["temp_ratio_vs_dense"] for r in shape_results]
        values[f"default_path_temp_ratio_{mode}_max_over_shapes"] = max(
            (v for v in ratios if v is not None), default=None
        )
        met[
            f"default_path_temp_memory_{mode}_le_{TEMP_MEMORY_RATIO_TARGET:g}x_all_shapes"
        ] = all(v is not None and v <= TEMP_MEMORY_RATIO_TARGET for v in ratios)
    met["all"] = all(met.values())
    return values, met


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="5 repetitions and 1 warm-up call (default: 15 and 3)",
    )
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions")
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed calls per variant"
    )
    parser.add_argument(
        "--calls-per-sample",
        type=int,
        default=None,
        help="back-to-back calls per timing sample (default 1 on a CPU, 10 on "
        "an accelerator, where one call is shorter than its launch latency)",
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=1,
        help="groups of S tokens per call (input (batch, S, D))",
    )
    parser.add_argument(
        "--shape",
        type=parse_shape,
        action="append",
        default=None,
        metavar="S,D,M,E,K,CF",
        help="benchmark this shape instead of the defaults (repeatable)",
    )
    add_common_arguments(parser)
    args = parse_arguments(parser, argv)

    reps = args.reps or (5 if args.quick else 15)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    shapes = args.shape or list(DEFAULT_SHAPES)
    calls = calls_per_sample(args.calls_per_sample)

    start = time.perf_counter()
    shape_results = [
        bench_shape(shape, args.batch, reps, warmup, args.seed, args.quick, calls)
        for shape in shapes
    ]
    result = {
        "benchmark": "keras_vmoe MoeLayer vs dense MLP (same activated FLOPs)",
        "environment": environment(),
        "settings": {
            "reps": reps,
            "warmup": warmup,
            "batch": args.batch,
            "quick": args.quick,
            "calls_per_sample": calls,
            "timing": "median wall time of compiled calls, variants interleaved "
            "(order rotated every repetition), after warm-up; each sample is "
            "calls_per_sample back-to-back calls and one wait, divided",
            "fwd_bwd": "jax.value_and_grad of sum(y * cotangent) w.r.t. inputs "
            "and all trainable weights",
            "dtype": "float32",
        },
        "shapes": shape_results,
        "targets": {
            "index_time_ratio_vs_dense_first_shape_max": DENSE_TIME_RATIO_TARGET,
            "index_time_ratio_vs_floor_most_experts_max": FLOOR_TIME_RATIO_TARGET,
            "default_path_temp_memory_ratio_max": TEMP_MEMORY_RATIO_TARGET,
        },
    }
    result["target_values"], result["targets_met"] = targets(shape_results)
    result["total_runtime_s"] = time.perf_counter() - start
    emit_json(result, args.output)


if __name__ == "__main__":
    main()
