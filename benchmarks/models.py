"""Model-level benchmark: V-MoE, Soft MoE and E³ against their dense baselines.

Pairs compared (model vs baseline), float32, JAX backend:

- ``vmoe_s32_last2_e8`` vs ``vit_s32``: V-MoE S/32 Last-2, 8 experts, vs the
  same ViT without MoE layers (the V-MoE paper's dense baseline);
- ``vmoe_s32_last2_e32`` vs ``vit_s32``: the same with 32 experts;
- ``soft_moe_s16`` vs ``vit_s16``: Soft MoE S/16 (128 experts, 1 slot,
  bfloat16 dispatch) vs ViT-S/16 with the same GAP/qk-norm settings;
- ``eee_s32`` vs ``vmoe_s32_last2_e32``: E³ S/32 (2 members, K=1) vs V-MoE.

Measured for every model (all models of one batch size interleaved in one
process, order rotated every repetition):

- ``inference``: a jitted ``stateless_call(training=False)`` per batch
  size: median/p25/p75/min latency, images/s, the ratio to the baseline's
  median (and the median of per-repetition paired ratios), compiled temp
  memory (``memory_analysis().temp_size_in_bytes``), and the fraction of
  tokens dropped by the MoE layers (``routing_metrics``);
- the **bare-matmul floor** of each MoE model whose baseline is the same ViT
  without MoE blocks (timed with the models, interleaved): the baseline's
  time, minus the dense MLPs that the MoE blocks replace, plus the MoE
  blocks' experts run as bare batched MLPs at their real row counts (no
  routing, dispatch or combine; each block with its own weights).
  ``bare_matmul_floor_ratio`` is what no implementation on the backend's
  batched matmuls can beat; ``time_ratio_vs_bare_matmul_floor`` is the
  model's distance to it;
- ``train`` (one batch size): images/s of ``Model.fit`` (Keras, SGD, the
  model's task loss plus the MoE auxiliary losses) and of a raw jitted
  step (``value_and_grad`` of the same ``compute_loss_and_updates`` + an SGD
  update, donated weights), so Keras' own overhead is visible.

``--quick`` runs tiny configurations of the same families (a few seconds of
compute: it checks that the script works, the timings mean nothing).
``--group-size-sweep`` (full mode) also times one V-MoE layer over group
sizes 200...6304 with the index (default) and one-hot einsum dispatch and
writes a PNG: time and temp memory linear in the group size for the
index path, quadratic for the einsum reference.

Run from the repository root::

    KERAS_BACKEND=jax python benchmarks/models.py --quick
    KERAS_BACKEND=jax python benchmarks/models.py --output models.json
    KERAS_BACKEND=jax python benchmarks/models.py --batches 1,8,32,128

ONE JSON object goes to stdout (and ``--output``); a short table and progress
go to stderr.
"""

import argparse
import os
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
from benchmarks.moe_layer import dense_mlp  # noqa: E402
from benchmarks.moe_layer import emit_json  # noqa: E402
from benchmarks.moe_layer import environment  # noqa: E402
from benchmarks.moe_layer import parse_arguments  # noqa: E402
from benchmarks.moe_layer import summarize_ms  # noqa: E402
from benchmarks.moe_layer import time_interleaved as layer_time_interleaved  # noqa: E402
from keras_vmoe.layers import Experts  # noqa: E402
from keras_vmoe.layers import MoeLayer  # noqa: E402
from keras_vmoe.layers import SoftMoE  # noqa: E402
from keras_vmoe.models import EnsembleImageClassifier  # noqa: E402
from keras_vmoe.models import ImageClassifier  # noqa: E402
from keras_vmoe.models import VisionTransformerBackbone  # noqa: E402
from keras_vmoe.models import backbone_config  # noqa: E402

NUM_CLASSES = 10
# (model, baseline) pairs.
PAIRS = (
    ("vmoe_s32_last2_e8", "vit_s32"),
    ("vmoe_s32_last2_e32", "vit_s32"),
    ("soft_moe_s16", "vit_s16"),
    ("eee_s32", "vmoe_s32_last2_e32"),
)
# Tiny architecture overrides for --quick (same families and layouts).
TINY = dict(
    image_size=32, hidden_dim=32, mlp_dim=64, num_heads=2, num_layers=4
)


def log(*args):
    print(*args, file=sys.stderr, flush=True)


def model_configs(quick):
    """name -> backbone config."""
    tiny = TINY if quick else {}
    s32 = dict(tiny, patch_size=8) if quick else {}
    s16 = dict(tiny, patch_size=4) if quick else {}
    return {
        "vit_s32": backbone_config("vmoe", "S/32", layout="none", **s32),
        "vmoe_s32_last2_e8": backbone_config(
            "vmoe", "S/32", layout="last2", num_experts=8, **s32
        ),
        "vmoe_s32_last2_e32": backbone_config("vmoe", "S/32", layout="last2", **s32),
        "eee_s32": backbone_config("eee", "S/32", **s32),
        "vit_s16": backbone_config("soft_moe", "S/16", layout="none", **s16),
        "soft_moe_s16": backbone_config(
            "soft_moe", "S/16", **s16, **({"num_experts": 16} if quick else {})
        ),
    }


def build_task(config, seed):
    keras.utils.set_random_seed(seed)
    backbone = VisionTransformerBackbone(**config)
    if getattr(backbone, "ensemble_size", 1) > 1:
        model = EnsembleImageClassifier(backbone, num_classes=NUM_CLASSES)
    else:
        model = ImageClassifier(backbone, num_classes=NUM_CLASSES)
    return model


def set_experts_implementation(model, implementation):
    """Sets every `Experts` layer's path (read when a call is compiled)."""
    for layer in model._flatten_layers():
        if isinstance(layer, Experts):
            layer.implementation = implementation


def images_for(config, batch, seed):
    size = config["image_size"]
    rng = np.random.default_rng(seed)
    # Images in the models' declared float range, (-1, 1).
    return rng.uniform(-1.0, 1.0, (batch, size, size, 3)).astype(np.float32)


def inference_entry(model, images):
    def forward(trainable, non_trainable, x):
        return model.stateless_call(trainable, non_trainable, x, training=False)[0]

    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    return compile_fn(forward, (trainable, non_trainable, jnp.asarray(images)))


def dropped_fraction(model, images):
    backbone = model.backbone
    if not getattr(backbone, "moe_layers", None):
        return None
    metrics = backbone.routing_metrics(images)
    values = [
        m["tokens_dropped_fraction"]
        for m in metrics.values()
        if isinstance(m, dict) and "tokens_dropped_fraction" in m
    ]
    return statistics.mean(values) if values else 0.0


def expert_shapes(model, batch):
    """`(E, rows per expert, D, M)` of every MoE block at inference, in order.

    Rows per expert are `G·C` (sparse MoE: groups times capacity) or `B·P`
    (Soft MoE: one group per image, P slots).
    """
    backbone = model.backbone
    tokens = batch * backbone.num_tokens
    shapes = []
    for layer in backbone._flatten_layers():
        if not isinstance(layer, MoeLayer):
            continue
        if isinstance(layer, SoftMoE):
            rows = batch * layer.router.num_slots
        else:
            size = layer.group_size or tokens
            rows = tokens // size * layer.router.get_capacity(size)
        shapes.append((layer.num_experts, rows, backbone.hidden_dim, layer.mlp_dim))
    return shapes


def bare_mlps(shapes, seed):
    """Compiled chain of bare MLPs (bias, tanh-GELU, no routing), one per shape.

    Each `(E, rows, D, M)` is `E` MLPs `D -> M -> D` run as two batched
    matmuls over `rows` rows each, with its own weights (as every block of
    a model has), so the chain reads as many weight bytes as the model's
    blocks do.
    """
    rng = np.random.default_rng(seed)
    params = []
    for e, _, d, m in shapes:
        scale0, scale1 = 1 / np.sqrt(d), 1 / np.sqrt(m)
        params.append(tuple(jnp.asarray(a) for a in (
            rng.standard_normal((e, d, m), dtype=np.float32) * scale0,
            np.zeros((e, 1, m), np.float32),
            rng.standard_normal((e, m, d), dtype=np.float32) * scale1,
            np.zeros((e, 1, d), np.float32),
        )))
    e, rows, d, _ = shapes[0]
    x = jnp.asarray(rng.standard_normal((e, rows, d), dtype=np.float32))

    def chain(params, x):
        for block in params:
            x = dense_mlp(block, x)  # (E, rows, D) -> (E, rows, M) -> (E, rows, D)
        return x

    return compile_fn(chain, (params, x))


def bare_matmul_floor_entries(models, batch, seed):
    """Entries for the bare-matmul floor of each MoE model against a dense ViT.

    For a model whose baseline is the same ViT without MoE blocks, two
    chains are timed with the models: its MoE blocks' experts as bare
    batched MLPs (`floor_experts:<model>`) and the dense MLPs they replace
    (`floor_mlps:<model>`, `(1, B·T, D) -> M -> D`). The baseline's time
    minus the second plus the first is the model with routing, dispatch
    and combine free and the experts at the speed of the backend's own
    batched matmuls at their row count.
    """
    entries = {}
    for name, base in PAIRS:
        if name not in models or base not in models or models[base].backbone.moe_layers:
            continue
        shapes = expert_shapes(models[name], batch)
        if not shapes:
            continue
        tokens = batch * models[name].backbone.num_tokens
        dense = [(1, tokens, d, m) for _, _, d, m in shapes]
        entries[f"floor_experts:{name}"] = bare_mlps(shapes, seed)
        entries[f"floor_mlps:{name}"] = bare_mlps(dense, seed)
    return entries


def add_bare_matmul_floor(out, entries_ms, name, base):
    """Adds the bare-matmul floor of `name` (see `bare_matmul_floor_entries`)."""
    experts = entries_ms.get(f"floor_experts:{name}")
    if experts is None:
        return
    floor_ms = out[base]["median_ms"] - entries_ms[f"floor_mlps:{name}"] + experts
    out[name]["vs"][base].update({
        "bare_matmul_floor_ms": floor_ms,
        "bare_matmul_floor_ratio": floor_ms / out[base]["median_ms"],
        "time_ratio_vs_bare_matmul_floor": out[name]["median_ms"] / floor_ms,
        "bare_experts_ms": experts,
        "bare_dense_mlps_ms": entries_ms[f"floor_mlps:{name}"],
    })


def time_interleaved(entries, reps, warmup):
    """Latency samples, one call and one wait each, order rotated. -> name: [s].

    `moe_layer.time_interleaved` with one mode and `calls=1` even on an
    accelerator: a model's latency is one call's, where the layer
    benchmarks queue several calls per sample to time the device.
    """
    samples, _ = layer_time_interleaved(
        {(name, "latency"): entry for name, entry in entries.items()}, reps, warmup, calls=1)
    return {name: samples[(name, "latency")] for name in entries}


def bench_inference(models, configs, batch, reps, warmup, seed):
    entries, dropped = {}, {}
    for name, model in models.items():
        images = images_for(configs[name], batch, seed)
        entries[name] = inference_entry(model, images)
        dropped[name] = dropped_fraction(model, images)
    floor_entries = bare_matmul_floor_entries(models, batch, seed)
    samples = time_interleaved({**entries, **floor_entries}, reps, warmup)
    floor_ms = {
        name: statistics.median(samples[name]) * 1e3 for name in floor_entries
    }
    out = {}
    for name in models:
        timing = summarize_ms(samples[name])
        out[name] = {
            **timing,
            "images_per_s": batch / (timing["median_ms"] / 1e3),
            "temp_bytes": entries[name]["temp_bytes"],
            "xla_flops": entries[name]["flops"],
            "compile_s": entries[name]["compile_s"],
            "tokens_dropped_fraction": dropped[name],
        }
    for model_name, base in PAIRS:
        if model_name in out and base in out:
            paired = [
                a / b for a, b in zip(samples[model_name], samples[base], strict=True)
            ]
            out[model_name].setdefault("vs", {})[base] = {
                "time_ratio": out[model_name]["median_ms"] / out[base]["median_ms"],
                "paired_time_ratio": statistics.median(paired),
                "temp_ratio": (
                    out[model_name]["temp_bytes"] / out[base]["temp_bytes"]
                    if out[model_name]["temp_bytes"] and out[base]["temp_bytes"]
                    else None
                ),
            }
            add_bare_matmul_floor(out, floor_ms, model_name, base)
    return out


def raw_train_step(model):
    """A jitted SGD step on the model's own loss (what `fit` computes)."""
    grad_fn = jax.value_and_grad(model.compute_loss_and_updates, has_aux=True)
    learning_rate = 1e-3

    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    optimizer_vars = [jnp.copy(v.value) for v in model.optimizer.variables]

    def step(trainable, non_trainable, metrics_vars, x, y):
        (loss, aux), grads = grad_fn(
            trainable, non_trainable, metrics_vars, x, y, None,
            training=True, optimizer_variables=optimizer_vars,
        )
        trainable = [w - learning_rate * g for w, g in zip(trainable, grads, strict=True)]
        return loss, trainable, aux[2]

    return jax.jit(step, donate_argnums=(0,))


def bench_train(models, configs, batch, steps, rounds, seed):
    """images/s of `fit` and of a raw jitted step, models alternated per round."""
    data, raw = {}, {}
    for name, model in models.items():
        x = images_for(configs[name], batch * steps, seed)
        y = np.random.default_rng(seed).integers(0, NUM_CLASSES, (batch * steps,))
        data[name] = (x, y)
        model.compile(
            optimizer=keras.optimizers.SGD(1e-3),
            loss=model.loss,
            jit_compile=True,
        )
        step = raw_train_step(model)
        # Copies: `fit` donates (deletes) the buffers of the model's variables.
        state = [
            [jnp.copy(v.value) for v in variables]
            for variables in (
                model.trainable_variables,
                model.non_trainable_variables,
                model.metrics_variables,
            )
        ]
        raw[name] = (step, state)
    fit_s = {name: [] for name in models}
    raw_s = {name: [] for name in models}
    for round_index in range(rounds + 1):  # round 0 compiles (warm-up)
        for name, model in models.items():
            x, y = data[name]
            start = time.perf_counter()
            model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
            elapsed = time.perf_counter() - start
            step, state = raw[name]
            trainable, non_trainable, metrics_vars = state
            start_raw = time.perf_counter()
            for i in range(steps):
                xb = jnp.asarray(x[i * batch : (i + 1) * batch])
                yb = jnp.asarray(y[i * batch : (i + 1) * batch])
                loss, trainable, non_trainable = step(
                    trainable, non_trainable, metrics_vars, xb, yb
                )
            jax.block_until_ready(loss)
            elapsed_raw = time.perf_counter() - start_raw
            raw[name] = (step, [trainable, non_trainable, metrics_vars])
            if round_index:
                fit_s[name].append(elapsed / steps)
                raw_s[name].append(elapsed_raw / steps)
    out = {}
    for name in models:
        fit_ms, raw_ms = summarize_ms(fit_s[name]), summarize_ms(raw_s[name])
        out[name] = {
            "batch": batch,
            "steps_per_round": steps,
            "fit_step": fit_ms,
            "fit_images_per_s": batch / (fit_ms["median_ms"] / 1e3),
            "raw_step": raw_ms,
            "raw_images_per_s": batch / (raw_ms["median_ms"] / 1e3),
            "fit_overhead_ratio": fit_ms["median_ms"] / raw_ms["median_ms"],
        }
    for model_name, base in PAIRS:
        if model_name in out and base in out:
            out[model_name].setdefault("vs", {})[base] = {
                "fit_time_ratio": out[model_name]["fit_step"]["median_ms"]
                / out[base]["fit_step"]["median_ms"],
                "raw_time_ratio": out[model_name]["raw_step"]["median_ms"]
                / out[base]["raw_step"]["median_ms"],
            }
    return out


def group_size_sweep(group_sizes, reps, png_path, quick):
    """One V-MoE S layer (E=32, K=2) over group sizes: index vs einsum."""
    from keras_vmoe.layers import MoeLayer

    d, m, e = (32, 64, 8) if quick else (512, 2048, 32)
    rows = []
    for s in group_sizes:
        x = jnp.asarray(np.random.default_rng(0).standard_normal((1, s, d), "float32"))
        entries = {}
        for dispatch in ("index", "einsum"):
            layer = MoeLayer(
                e, m, router={"name": "token_choice", "num_selected_experts": 2,
                              "capacity_factor": 1.05},
                dispatch=dispatch, name=f"moe_{dispatch}",
            )
            layer.build(x.shape)

            def forward(trainable, non_trainable, x, layer=layer):
                return layer.stateless_call(trainable, non_trainable, x)[0]

            entries[dispatch] = compile_fn(
                forward,
                (
                    [v.value for v in layer.trainable_variables],
                    [v.value for v in layer.non_trainable_variables],
                    x,
                ),
            )
        samples = time_interleaved(entries, reps, 1)
        row = {"group_size": s}
        for dispatch, entry in entries.items():
            row[dispatch] = {
                **summarize_ms(samples[dispatch]),
                "temp_bytes": entry["temp_bytes"],
            }
        rows.append(row)
        log(f"group size {s}: " + ", ".join(
            f"{k} {row[k]['median_ms']:.1f} ms" for k in ("index", "einsum")))
    if png_path:
        write_sweep_png(rows, png_path)
    return {"hidden_D": d, "expert_mlp_M": m, "num_experts_E": e, "rows": rows}


def write_sweep_png(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["group_size"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for dispatch, label in (("index", "index (default)"), ("einsum", "one-hot einsum")):
        axes[0].plot(sizes, [r[dispatch]["median_ms"] for r in rows], "o-", label=label)
        axes[1].plot(
            sizes, [r[dispatch]["temp_bytes"] / 2**20 for r in rows], "o-", label=label
        )
    axes[0].set(xlabel="group size S", ylabel="forward time (ms)", title="time")
    axes[1].set(xlabel="group size S", ylabel="temp memory (MiB)", title="memory")
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)


def table(result):
    lines = ["model | batch | ms | images/s | vs baseline | temp MiB | dropped"]
    for batch, per_model in result["inference"].items():
        for name, r in per_model.items():
            vs = ", ".join(
                f"{v['time_ratio']:.2f}x {b}"
                + (f" (floor {v['bare_matmul_floor_ratio']:.2f}x)"
                   if "bare_matmul_floor_ratio" in v else "")
                for b, v in r.get("vs", {}).items()
            )
            dropped = r["tokens_dropped_fraction"]
            lines.append(
                f"{name} | {batch} | {r['median_ms']:.1f} | {r['images_per_s']:.1f} | "
                f"{vs or '-'} | {(r['temp_bytes'] or 0) / 2**20:.1f} | "
                f"{'-' if dropped is None else f'{dropped:.3f}'}"
            )
    for name, r in result.get("train", {}).items():
        lines.append(
            f"train {name} | {r['batch']} | fit {r['fit_images_per_s']:.2f} img/s, "
            f"raw {r['raw_images_per_s']:.2f} img/s, fit/raw "
            f"{r['fit_overhead_ratio']:.2f}"
        )
    return "\n".join(lines)


def parse_ints(text):
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers. Received: {text!r}"
        )
    return values


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny models, 3 repetitions (checks the script runs)")
    parser.add_argument("--batches", type=parse_ints, default=None,
                        help="inference batch sizes (default 1,8,32; quick 1,2)")
    parser.add_argument("--models", default=None,
                        help="comma-separated subset of the models")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--train-batch", type=int, default=None,
                        help="train batch size (default 8; quick 2); 0 skips training")
    parser.add_argument("--train-steps", type=int, default=None,
                        help="steps per timed fit call (default 3; quick 2)")
    parser.add_argument("--train-rounds", type=int, default=None,
                        help="timed fit calls per model (default 3; quick 1)")
    parser.add_argument("--group-size-sweep", default=None, metavar="PNG",
                        help="also sweep the group size and write this PNG")
    parser.add_argument("--sweep-sizes", type=parse_ints, default=None,
                        help="group sizes of the sweep (default 200,...,6304)")
    parser.add_argument("--experts-implementation", default="auto",
                        choices=("auto", "loop", "batched"),
                        help="force the expert path of every MoE layer (default auto)")
    add_common_arguments(parser)
    args = parse_arguments(parser, argv)

    quick = args.quick
    batches = args.batches or ([1, 2] if quick else [1, 8, 32])
    reps = args.reps or (3 if quick else 7)
    warmup = args.warmup if args.warmup is not None else 1
    train_batch = args.train_batch if args.train_batch is not None else (2 if quick else 8)
    train_steps = args.train_steps or (2 if quick else 3)
    train_rounds = args.train_rounds or (1 if quick else 3)
    configs = model_configs(quick)
    if args.models:
        wanted = args.models.split(",")
        unknown = sorted(set(wanted) - set(configs))
        if unknown:
            parser.error(f"--models: unknown {unknown}; valid: {sorted(configs)}")
        configs = {k: v for k, v in configs.items() if k in wanted}

    start = time.perf_counter()
    models = {}
    for name, config in configs.items():
        log(f"building {name} ...")
        models[name] = build_task(config, args.seed)
        set_experts_implementation(models[name], args.experts_implementation)
    result = {
        "benchmark": "keras_vmoe models vs dense baselines",
        "environment": environment(),
        "settings": {
            "quick": quick, "batches": batches, "reps": reps, "warmup": warmup,
            "train_batch": train_batch, "train_steps": train_steps,
            "train_rounds": train_rounds, "dtype": "float32", "pairs": PAIRS,
            "experts_implementation": args.experts_implementation,
            "timing": "median wall time of compiled calls; models of one batch "
            "size interleaved, order rotated every repetition",
        },
        "models": {
            name: {"parameters": int(m.count_params()),
                   "moe_layers": list(configs[name].get("moe_layers") or ())}
            for name, m in models.items()
        },
        "inference": {},
    }
    for batch in batches:
        log(f"inference, batch {batch} ...")
        result["inference"][str(batch)] = bench_inference(
            models, configs, batch, reps, warmup, args.seed
        )
    if train_batch:
        log(f"training, batch {train_batch} ...")
        result["train"] = bench_train(
            models, configs, train_batch, train_steps, train_rounds, args.seed
        )
    if args.group_size_sweep:
        sizes = args.sweep_sizes or (
            [16, 32, 64] if quick else [200, 400, 800, 1576, 3152, 6304]
        )
        result["group_size_sweep"] = group_size_sweep(
            sizes, reps, args.group_size_sweep, quick
        )
    result["total_runtime_s"] = time.perf_counter() - start
    log(table(result))
    emit_json(result, args.output)


if __name__ == "__main__":
    main()
