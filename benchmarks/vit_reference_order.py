"""Benchmark of the dense ViT trunk against the reference's order of operations.

Companion of `soft_moe_layer.py`. The reference Flax code cannot be installed
here, so this script times keras_vmoe's dense ViT classifier (the trunk that
Soft MoE S/16 shares with ViT-S/16: GAP head, qk-norm) against a plain-`jnp`
transcription of the computation upstream's `VisionTransformer` performs,
with the same weights (`../shared/upstream` section 2; written from that
description, not copied): a `P x P` stride-`P` convolution, learned
position embeddings, pre-LayerNorm blocks (eps 1e-6) with query/key
LayerNorm (no bias), `softmax(q·k/√K)` attention, a tanh-GELU MLP, the
encoder LayerNorm, mean over tokens, the head. It checks that both give the
same logits and prints ONE JSON object.

Run from the repository root::

    KERAS_BACKEND=jax python benchmarks/vit_reference_order.py            # ViT-S/16, batch 8
    KERAS_BACKEND=jax python benchmarks/vit_reference_order.py --quick    # tiny, checks it runs
"""

import argparse
import math
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.models import TINY  # noqa: E402
from benchmarks.models import build_task  # noqa: E402
from benchmarks.models import images_for  # noqa: E402
from benchmarks.models import inference_entry  # noqa: E402
from benchmarks.models import time_interleaved  # noqa: E402
from benchmarks.moe_layer import add_common_arguments  # noqa: E402
from benchmarks.moe_layer import compile_fn  # noqa: E402
from benchmarks.moe_layer import emit_json  # noqa: E402
from benchmarks.moe_layer import environment  # noqa: E402
from benchmarks.moe_layer import parse_arguments  # noqa: E402
from benchmarks.moe_layer import summarize_ms  # noqa: E402
from keras_vmoe.models import backbone_config  # noqa: E402

MAX_ABS_DIFF = 1e-4  # float32, same operations in another order of fusion


def layer_norm(x, gamma, beta=None, eps=1e-6):
    mean = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + eps) * gamma
    return y if beta is None else y + beta


def reference_order(w, images, num_layers, patch_size):
    """Upstream's ViT forward (GAP, qk-norm) in plain `jnp`; `w` by weight path."""
    x = jax.lax.conv_general_dilated(
        images, w["patch_embedding/kernel"], (patch_size, patch_size), "VALID",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    ) + w["patch_embedding/bias"]  # (B, H/P, W/P, D)
    x = x.reshape(x.shape[0], -1, x.shape[-1]) + w["position_embedding/embedding"]
    for i in range(num_layers):
        p = f"encoderblock_{i}/"
        h = layer_norm(x, w[p + "layer_norm_0/gamma"], w[p + "layer_norm_0/beta"])
        q, k, v = (
            jnp.einsum("btd,dnk->btnk", h, w[p + f"attention/{name}/kernel"])
            + w[p + f"attention/{name}/bias"]
            for name in ("query", "key", "value")
        )  # (B, T, N, K)
        q = layer_norm(q, w[p + "attention/query_ln/gamma"])
        k = layer_norm(k, w[p + "attention/key_ln/gamma"])
        q = q / math.sqrt(q.shape[-1])
        weights = jax.nn.softmax(jnp.einsum("btnk,bsnk->bnts", q, k), -1)  # (B, N, T, S)
        mixed = jnp.einsum("bnts,bsnk->btnk", weights, v)
        x = x + jnp.einsum("btnk,nkd->btd", mixed, w[p + "attention/out/kernel"])
        x = x + w[p + "attention/out/bias"]
        h = layer_norm(x, w[p + "layer_norm_1/gamma"], w[p + "layer_norm_1/beta"])
        h = jax.nn.gelu(h @ w[p + "mlp/dense_0/kernel"] + w[p + "mlp/dense_0/bias"],
                        approximate=True)  # (B, T, M)
        x = x + h @ w[p + "mlp/dense_1/kernel"] + w[p + "mlp/dense_1/bias"]
    x = layer_norm(x, w["encoder_norm/gamma"], w["encoder_norm/beta"]).mean(1)  # (B, D)
    return x @ w["head/kernel"] + w["head/bias"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny ViT, 3 repetitions (checks the script runs)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    add_common_arguments(parser)
    args = parse_arguments(parser, argv)
    reps = args.reps or (3 if args.quick else 15)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)

    start = time.perf_counter()
    overrides = dict(TINY, patch_size=4) if args.quick else {}
    config = backbone_config("soft_moe", "S/16", layout="none", **overrides)
    model = build_task(config, args.seed)
    head = next(v for v in model.weights if v.path == "head/kernel")
    rng = np.random.default_rng(args.seed)
    # The head starts at zero; random values make the logits comparable.
    head.assign(0.05 * rng.standard_normal(head.shape).astype("float32"))
    images = images_for(config, args.batch, args.seed)
    weights = {v.path: v.value for v in model.weights}

    def reference(w, x):
        return reference_order(w, x, config["num_layers"], config["patch_size"])

    entries = {
        "keras_vmoe": inference_entry(model, images),
        "reference_order": compile_fn(reference, (weights, jnp.asarray(images))),
    }
    logits = {name: np.asarray(e["compiled"](*e["args"])) for name, e in entries.items()}
    diff = float(np.max(np.abs(logits["keras_vmoe"] - logits["reference_order"])))
    samples = time_interleaved(entries, reps, warmup)
    timings = {name: summarize_ms(values) for name, values in samples.items()}
    paired = [a / b for a, b in zip(samples["keras_vmoe"], samples["reference_order"],
                                     strict=True)]
    result = {
        "benchmark": "keras_vmoe ViT trunk vs the reference's order of operations",
        "environment": environment(),
        "settings": {"reps": reps, "warmup": warmup, "quick": args.quick,
                     "batch": args.batch, "dtype": "float32"},
        "config": {k: config[k] for k in ("image_size", "patch_size", "hidden_dim",
                                          "mlp_dim", "num_heads", "num_layers",
                                          "classifier", "qk_norm")},
        "max_abs_diff_logits": diff,
        "outputs_match_reference_order": diff <= MAX_ABS_DIFF,
        "inference": timings,
        "time_ratio_vs_reference_order": (
            timings["keras_vmoe"]["median_ms"] / timings["reference_order"]["median_ms"]
        ),
        "paired_time_ratio_vs_reference_order": statistics.median(paired),
    }
    result["total_runtime_s"] = time.perf_counter() - start
    emit_json(result, args.output)
    print(f"keras_vmoe {timings['keras_vmoe']['median_ms']:.1f} ms, reference order "
          f"{timings['reference_order']['median_ms']:.1f} ms, logits diff {diff:.2e}",
          file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
