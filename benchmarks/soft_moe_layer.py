"""Benchmark of `SoftMoE` against the reference code's order of operations.

The reference Flax code (google-research/vmoe, `projects/soft_moe`) cannot
be installed here, so this script times keras_vmoe's `SoftMoE` against a
plain-`jnp` transcription of the computation the reference performs
(`../shared/upstream` section 4.6; written from that description, not copied):

1. L2-normalise the tokens and `mu` over D, scale, `einsum('gmd,dnp->gmnp')`;
2. dispatch weights: softmax over the tokens; combine weights: softmax over
   all slots;
3. bfloat16 dispatcher: tokens cast to bfloat16, dispatch
   `einsum('gmnp,gmd->gnpd')` (promoted to float32), back to float32;
4. the experts as flax's lifted `vmap` lowers them: two batched matmuls over
   the leading expert axis `(E, G·P, D)`, tanh-GELU;
5. expert outputs cast to bfloat16, combine `einsum('gmnp,gnpd->gmd')`.

Variants, interleaved in one process: ``dense`` (a ViT MLP block of size M
on the same tokens: what the Soft MoE block replaces), ``default``
(`SoftMoE`, `Experts(implementation="auto")`), ``loop`` and ``batched``
(each expert path forced), ``reference_order`` (the transcription above,
same weights), and ``bare_experts``: step 4 alone, the experts' two batched
matmuls, biases and GELU on a `(E, G·P, D)` input with the same weights.
``bare_experts`` is the block's floor on these kernels: no order of
operations around the experts can make the block faster than its experts
(``time_ratio_vs_bare_experts``). ``same_optimized_program_as_reference_order``
records whether XLA compiled a path and the transcription to the same
kernels on the same shapes in the same order. Modes ``fwd`` (inference) and
``fwd_bwd`` (gradients w.r.t.
the inputs and every weight). It checks that ``default`` and
``reference_order`` give the same outputs (bfloat16 dispatch: up to a few
bfloat16 steps, see ENVIRONMENT notes) and prints ONE JSON object.

Run from the repository root::

    KERAS_BACKEND=jax python benchmarks/soft_moe_layer.py          # Soft MoE S/16, batch 8
    KERAS_BACKEND=jax python benchmarks/soft_moe_layer.py --quick  # tiny, checks it runs
"""

import argparse
import os
import re
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.moe_layer import add_common_arguments  # noqa: E402
from benchmarks.moe_layer import compile_fn  # noqa: E402
from benchmarks.moe_layer import emit_json  # noqa: E402
from benchmarks.moe_layer import environment  # noqa: E402
from benchmarks.moe_layer import parse_arguments  # noqa: E402
from benchmarks.moe_layer import positive_ints  # noqa: E402
from benchmarks.moe_layer import ratio  # noqa: E402
from benchmarks.moe_layer import summarize_ms  # noqa: E402
from benchmarks.moe_layer import time_interleaved  # noqa: E402
from keras_vmoe.layers import SoftMoE  # noqa: E402

# (batch B, tokens T, D, M, experts E, slots P): Soft MoE S/16 at 224 px.
DEFAULT_SHAPE = (8, 196, 384, 1536, 128, 1)
QUICK_SHAPE = (2, 16, 8, 16, 8, 1)
VARIANTS = ("dense", "default", "loop", "batched", "reference_order", "bare_experts")
MODES = ("fwd", "fwd_bwd")
# bfloat16 rounding of the dispatched tokens can flip at ties depending on
# fusion; one flip is one bfloat16 step of a slot (ENVIRONMENT.md).
MAX_ABS_DIFF = 2e-2


def bare_experts(weights, xe):
    """Step 4 of `reference_order`, the experts: (E, G·P, D) -> (E, G·P, D)."""
    _, _, kernel_0, bias_0, kernel_1, bias_1 = weights
    h = jnp.einsum("erd,edm->erm", xe, kernel_0) + bias_0[:, None]  # (E, G·P, M)
    h = jax.nn.gelu(h, approximate=True)
    return jnp.einsum("erm,emd->erd", h, kernel_1) + bias_1[:, None]  # (E, G·P, D)


def reference_order(weights, x):
    """The reference's Soft MoE block in plain `jnp` (module docstring)."""
    mu, scale = weights[:2]
    batch, tokens, _ = x.shape
    num_experts, slots = mu.shape[1], mu.shape[2]
    x_norm = x * jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)
    mu_norm = mu * jax.lax.rsqrt(jnp.sum(mu * mu, 0, keepdims=True) + 1e-6)
    logits = jnp.einsum("gmd,dnp->gmnp", x_norm, mu_norm * scale)  # (G, T, E, P)
    dispatch = jax.nn.softmax(logits, axis=1)
    combine = jax.nn.softmax(
        logits.reshape(batch, tokens, num_experts * slots), axis=-1
    ).reshape(logits.shape)
    x_bf16 = x.astype(jnp.bfloat16)
    slots_in = jnp.einsum("gmnp,gmd->gnpd", dispatch, x_bf16).astype(x.dtype)  # (G, E, P, D)
    xe = slots_in.transpose(1, 0, 2, 3).reshape(num_experts, batch * slots, -1)
    y = bare_experts(weights, xe)  # (E, G·P, D)
    y = y.reshape(num_experts, batch, slots, -1).transpose(1, 0, 2, 3)  # (G, E, P, D)
    y = y.astype(jnp.bfloat16)
    return jnp.einsum("gmnp,gnpd->gmd", combine, y).astype(x.dtype)  # (G, T, D)


def dense_block(weights, x):
    kernel_0, bias_0, kernel_1, bias_1 = weights
    h = jax.nn.gelu(x @ kernel_0 + bias_0, approximate=True)  # (B, T, M)
    return h @ kernel_1 + bias_1  # (B, T, D)


def with_backward(forward):
    """value_and_grad of sum(y * cotangent) w.r.t. the weights and inputs."""

    def loss(weights, x, cotangent):
        return jnp.sum(forward(weights, x) * cotangent)

    return jax.value_and_grad(loss, argnums=(0, 1))


def entry_program(compiled):
    """The optimized HLO program as nested (op, shape, fusion kind, body) rows.

    The entry computation's instructions in order, each fusion with the rows
    of the computation it calls. Names and metadata are left out, so two
    programs that run the same kernels on the same shapes in the same order
    compare equal.
    """
    computations, current = {}, None
    for line in compiled.as_text().splitlines():
        header = re.match(r"(ENTRY )?%(\S+) \(.*\{$", line)
        if header:
            current = computations.setdefault(
                "ENTRY" if header.group(1) else header.group(2), [])
            continue
        instruction = re.match(r"\s*(?:ROOT )?%\S+ = (.+?) ([\w-]+)\(", line)
        if instruction and current is not None:
            kind = re.search(r"kind=(\w+)", line)
            called = re.search(r"calls=%([\w.-]+)", line)
            current.append((instruction.group(2), instruction.group(1),
                            kind.group(1) if kind else None,
                            called.group(1) if called else None))

    def expand(rows):
        return [(op, shape, kind, expand(computations.get(called, [])) if called else None)
                for op, shape, kind, called in rows]

    return expand(computations["ENTRY"])


def make_layer(shape, implementation, seed):
    batch, tokens, d, m, e, p = shape
    keras.utils.set_random_seed(seed)
    layer = SoftMoE(
        e, m, num_slots=p, bfloat16_dispatch=True, identical_init=False,
        name="soft_moe",
    )
    layer.build((batch, tokens, d))
    layer.experts.implementation = implementation
    return layer


def layer_forward(layer):
    non_trainable = [v.value for v in layer.non_trainable_variables]  # seed state

    def forward(weights, x, training=False):
        y, _ = layer.stateless_call(list(weights), non_trainable, x, training=training)
        return y

    return forward


def bench(shape, reps, warmup, seed):
    batch, tokens, d, m, e, p = shape
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((batch, tokens, d), dtype=np.float32))
    cotangent = jnp.asarray(rng.standard_normal(x.shape, dtype=np.float32))
    layers = {name: make_layer(shape, name if name != "default" else "auto", seed)
              for name in ("default", "loop", "batched")}
    weights = tuple(v.value for v in layers["default"].trainable_variables)
    names = [v.path.split("/")[-1] for v in layers["default"].trainable_variables]
    order = ("mu", "scale", "kernel_0", "bias_0", "kernel_1", "bias_1")
    if tuple(names) != order:
        raise RuntimeError(f"SoftMoE weights are {names}, expected {order}")
    dense_weights = (
        jnp.asarray(rng.standard_normal((d, m), dtype=np.float32) / np.sqrt(d)),
        jnp.zeros((m,), jnp.float32),
        jnp.asarray(rng.standard_normal((m, d), dtype=np.float32) / np.sqrt(m)),
        jnp.zeros((d,), jnp.float32),
    )
    rows = batch * p  # rows per expert: G·P
    xe = jnp.asarray(rng.standard_normal((e, rows, d), dtype=np.float32))  # (E, G·P, D)
    forwards = {name: (layer_forward(layer), weights, x) for name, layer in layers.items()}
    forwards["reference_order"] = (reference_order, weights, x)
    forwards["dense"] = (dense_block, dense_weights, x)
    forwards["bare_experts"] = (bare_experts, weights, xe)

    entries = {}
    for name in VARIANTS:
        forward, w, inputs = forwards[name]
        entries[(name, "fwd")] = compile_fn(forward, (w, inputs))
        if name in layers:
            train_forward = lambda w, x, f=forward: f(w, x, training=True)  # noqa: E731
        else:
            train_forward = forward
        entries[(name, "fwd_bwd")] = compile_fn(
            with_backward(train_forward),
            (w, inputs, cotangent if inputs is x else jnp.ones_like(inputs)),
        )
    outputs = {
        name: entries[(name, "fwd")]["compiled"](*entries[(name, "fwd")]["args"])
        for name in ("default", "loop", "batched", "reference_order")
    }
    diffs = {
        name: float(jnp.max(jnp.abs(outputs[name] - outputs["reference_order"])))
        for name in ("default", "loop", "batched")
    }

    # The floor computes what the layer's own experts compute.
    experts = layers["batched"].experts
    layer_experts = experts.stateless_call(
        [v.value for v in experts.trainable_variables],
        [v.value for v in experts.non_trainable_variables], xe[None])[0][0]
    bare_diff = float(jnp.max(jnp.abs(
        entries[("bare_experts", "fwd")]["compiled"](weights, xe) - layer_experts)))

    reference_programs = {
        mode: entry_program(entries[("reference_order", mode)]["compiled"]) for mode in MODES}
    samples, _ = time_interleaved(entries, reps, warmup)
    result = {
        "config": {
            "batch_B": batch, "tokens_T": tokens, "hidden_D": d, "expert_mlp_M": m,
            "num_experts_E": e, "slots_P": p, "rows_per_expert": rows,
            "bfloat16_dispatch": True,
        },
        "default_experts_implementation": (
            "loop" if layers["default"].experts.uses_loop(False, rows=rows) else "batched"
        ),
        "max_abs_diff_vs_reference_order": diffs,
        "outputs_match_reference_order": all(v <= MAX_ABS_DIFF for v in diffs.values()),
        "bare_experts_vs_layer_experts_max_abs_diff": bare_diff,
        # Same kernels on the same shapes in the same order as the reference:
        # any time difference between them is then measurement noise.
        "same_optimized_program_as_reference_order": {
            f"{name}_{mode}": entry_program(entries[(name, mode)]["compiled"])
            == reference_programs[mode]
            for name in ("default", "batched") for mode in MODES
        },
    }
    for mode in MODES:
        timings = {name: summarize_ms(samples[(name, mode)]) for name in VARIANTS}
        reference = samples[("reference_order", mode)]
        result[mode] = {
            name: {
                **timings[name],
                "time_ratio_vs_reference_order": ratio(
                    timings[name]["median_ms"], timings["reference_order"]["median_ms"]
                ),
                "paired_time_ratio_vs_reference_order": statistics.median(
                    a / b for a, b in zip(samples[(name, mode)], reference, strict=True)
                ),
                "time_ratio_vs_dense": ratio(
                    timings[name]["median_ms"], timings["dense"]["median_ms"]
                ),
                "time_ratio_vs_bare_experts": ratio(
                    timings[name]["median_ms"], timings["bare_experts"]["median_ms"]
                ),
                "temp_bytes": entries[(name, mode)]["temp_bytes"],
                "compile_s": entries[(name, mode)]["compile_s"],
            }
            for name in VARIANTS
        }
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny shape, 3 repetitions (checks the script runs)")
    parser.add_argument("--shape", type=positive_ints("BTDMEP"), default=None,
                        metavar="B,T,D,M,E,P")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    add_common_arguments(parser)
    args = parse_arguments(parser, argv)
    shape = args.shape or (QUICK_SHAPE if args.quick else DEFAULT_SHAPE)
    reps = args.reps or (3 if args.quick else 15)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)

    start = time.perf_counter()
    result = {
        "benchmark": "keras_vmoe SoftMoE vs the reference code's order of operations",
        "environment": environment(),
        "settings": {"reps": reps, "warmup": warmup, "quick": args.quick,
                     "dtype": "float32 (bfloat16 dispatch)"},
        **bench(shape, reps, warmup, args.seed),
    }
    result["total_runtime_s"] = time.perf_counter() - start
    emit_json(result, args.output)
    for mode in MODES:
        row = ", ".join(
            f"{name} {result[mode][name]['median_ms']:.1f} ms "
            f"({result[mode][name]['time_ratio_vs_reference_order']:.2f}x)"
            for name in VARIANTS
        )
        print(f"{mode}: {row}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
