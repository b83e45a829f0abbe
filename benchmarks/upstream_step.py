"""keras_vmoe's JAX train step against upstream's Flax train step, program by program.

One SGD train step (softmax cross-entropy plus the MoE auxiliary losses,
float32 weights, no scan, no remat) of the same two models built both ways:

- `dense`: ViT S/32 (8 blocks, D=512, M=2048, 8 heads, class token,
  pre-logits of size 512, 1000 classes), 224 px;
- `vmoe`: V-MoE S/32 Last-2 (MoE MLPs in blocks 5 and 7), 8 experts, top-2,
  capacity factor 1.5, groups of 400 tokens (8 images), router noise
  1/E, importance and load loss weights 0.005, bfloat16 dispatch.

keras_vmoe's step is `benchmarks/train_step.py`'s raw step: the model's
`compute_loss_and_updates` under `jax.value_and_grad`, then
`optimizer.stateless_apply`, in one `jax.jit` with every state buffer
donated. Upstream's is `vmoe.nn.vit_moe.VisionTransformerMoe` in the form of
`vmoe.train.trainer.train_step`: the model applied with split `gating` and
`dropout` keys, `optax.softmax_cross_entropy` on one-hot labels plus the mean
auxiliary loss, `jax.value_and_grad`, then `optax.sgd`, parameters,
optimizer state and keys donated.

Dispatchers are compared like for like. Upstream routes through `einsum`
(one-hot `(G, S, E, C)` tensors, its configs' default) or `indices`
(`router.dispatcher.name`); keras_vmoe's `MoeLayer` has `dispatch="einsum"`
(the one-hot reference) and `dispatch="index"` (gather/scatter, its
default). Each V-MoE row carries its `dispatcher` (`einsum` or `indices`;
keras_vmoe's `index` is labelled `indices`), and `comparisons` pairs rows with
the same dispatcher, plus keras_vmoe's default (`indices`) against upstream's
default (`einsum`).

Per program, each compiled in a fresh process: parameters, and from XLA's
analysis of the compiled step `flops`, `bytes_accessed`, `transcendentals`
(`cost_analysis()`) and `temp_bytes` (`memory_analysis()`), which are
properties of the program and do not depend on the machine's load; then the
step time (median, min and max of `--reps` steps after `--warmup` steps), which
does. With `--reps 0` nothing is timed.

Upstream's code is not part of this repository. Get it beside the project,
in one folder holding both checkouts:

    mkdir -p ~/upstream_src && cd ~/upstream_src
    git clone https://github.com/google-research/vmoe
    git clone https://github.com/google-research/vision_transformer

so that `~/upstream_src/vmoe/vmoe/moe.py` and
`~/upstream_src/vision_transformer/vit_jax/models_vit.py` exist (the script
puts both folders on the children's `PYTHONPATH`; nothing is installed from
them). Then run the script in a virtualenv with flax, optax and
ml_collections beside keras and the project's JAX; keras_vmoe itself is
taken from this checkout:

    python3.11 -m venv ~/flaxvenv
    ~/flaxvenv/bin/pip install "jax==0.10.2" flax optax ml_collections \\
        "keras>=3.15" msgpack scipy
    ~/flaxvenv/bin/python benchmarks/upstream_step.py \\
        --upstream-src ~/upstream_src --dispatcher both --output result.json

Versions that worked: jax/jaxlib 0.10.2, flax 0.12.8, optax 0.2.8,
ml_collections 1.1.0, keras 3.15.1 (Python 3.11); vmoe at 942a78b,
vision_transformer at c6de1e5.

ONE JSON document goes to stdout (and `--output`, refused on a loaded
machine: see `benchmarks/harness.py`). Exit status 2, with a message saying
what is missing, when the upstream checkouts or flax/optax are not there.
"""

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import harness  # noqa: E402

# The exit status when upstream's code or flax is missing.
MISSING_EXIT_STATUS = 2
# Files whose presence shows that `--upstream-src` holds each checkout.
UPSTREAM_FILES = {
    "vmoe": os.path.join("vmoe", "moe.py"),
    "vision_transformer": os.path.join("vit_jax", "models_vit.py"),
}
UPSTREAM_REPOS = {
    "vmoe": "https://github.com/google-research/vmoe",
    "vision_transformer": "https://github.com/google-research/vision_transformer",
}
# Modules the script imports in its children besides the project's own.
REQUIRED_MODULES = ("flax", "optax", "ml_collections", "keras", "jax")
# The models, as architecture settings shared by both implementations.
ARCHITECTURES = {
    "full": dict(image_size=224, patch_size=32, hidden_dim=512, mlp_dim=2048,
                 num_heads=8, num_layers=8, representation_size=512,
                 num_classes=1000, batch=8),
    # --quick: a tiny model with the same structure (checks the script).
    "quick": dict(image_size=32, patch_size=8, hidden_dim=32, mlp_dim=64,
                  num_heads=2, num_layers=4, representation_size=32,
                  num_classes=10, batch=2),
}
MODELS = ("dense", "vmoe")
DISPATCHERS = ("einsum", "indices")
# keras_vmoe's `MoeLayer(dispatch=...)` for each upstream dispatcher name.
KERAS_DISPATCH = {"einsum": "einsum", "indices": "index"}
LEARNING_RATE = 0.01


def log(*args):
    print("[upstream_step]", *args, file=sys.stderr, flush=True)


def missing_requirements(upstream_src):
    """Everything the comparison needs that is not there, as sentences."""
    problems = []
    if not upstream_src:
        problems.append("no --upstream-src was given")
    else:
        for name, relative in UPSTREAM_FILES.items():
            path = os.path.join(upstream_src, name, relative)
            if not os.path.isfile(path):
                problems.append(f"{path} does not exist (no {name} checkout in "
                                f"{upstream_src})")
    absent = [m for m in REQUIRED_MODULES if importlib.util.find_spec(m) is None]
    if absent:
        problems.append(f"{', '.join(absent)} cannot be imported by "
                        f"{sys.executable}")
    return problems


def missing_message(problems):
    """One paragraph: what is missing and how to get it."""
    return (
        "upstream_step.py compares keras_vmoe's train step with upstream's Flax "
        f"one and cannot run: {'; '.join(problems)}. Put checkouts of "
        f"{UPSTREAM_REPOS['vmoe']} and {UPSTREAM_REPOS['vision_transformer']} "
        "in one folder (`git clone` both into it, giving PATH/vmoe and "
        "PATH/vision_transformer) and pass --upstream-src PATH; run the script "
        "with a Python that has flax, optax and ml_collections beside keras and "
        "jax, ideally a separate virtualenv "
        "(`pip install \"jax==0.10.2\" flax optax ml_collections keras msgpack "
        "scipy`; flax 0.12.8 and optax 0.2.8 worked). See `--help`.")


def upstream_revision(upstream_src, name):
    """The checkout's commit, or None where it is not a git work tree."""
    try:
        done = subprocess.run(
            ["git", "-C", os.path.join(upstream_src, name), "rev-parse", "HEAD"],
            capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode:
        return None
    return done.stdout.strip() or None


def settings_for(args):
    """The settings both implementations are built with."""
    arch = dict(ARCHITECTURES["quick" if args.quick else "full"])
    if args.batch:
        arch["batch"] = args.batch
    tokens = (arch["image_size"] // arch["patch_size"]) ** 2 + 1
    images_per_group = min(8, arch["batch"])
    if arch["batch"] % images_per_group:
        raise ValueError(f"--batch must be a multiple of 8 or below it; "
                         f"received {arch['batch']}")
    return {
        **arch,
        "tokens_per_image": tokens,
        "num_experts": 8,
        "num_selected_experts": 2,
        "capacity_factor": args.capacity_factor,
        "group_size": images_per_group * tokens,
        "noise_std": 1.0,
        "importance_loss_weight": 0.005,
        "load_loss_weight": 0.005,
        "batch_priority": False,
        "bfloat16_dispatch": not args.float32_dispatch,
        "dtype": "float32",
        "optimizer": f"SGD({LEARNING_RATE})",
        "reps": args.reps,
        "warmup": args.warmup,
    }


# ---------------------------------------------------------------------------
# Children: one program each.


def inputs(settings, seed=0):
    """Images `(B, H, W, 3)` in [-1, 1] and integer labels `(B,)`."""
    import numpy as np

    rng = np.random.default_rng(seed)
    size, batch = settings["image_size"], settings["batch"]
    images = rng.uniform(-1.0, 1.0, (batch, size, size, 3)).astype("float32")
    labels = rng.integers(0, settings["num_classes"], (batch,)).astype("int32")
    return images, labels


def keras_program(model, dispatcher, settings):
    """keras_vmoe's raw train step.

    Returns:
        `(jitted step, state, inputs, parameter count, MoE block indices)`.
    """
    import jax
    import keras

    from benchmarks import train_step
    from keras_vmoe.models import ImageClassifier
    from keras_vmoe.models import VisionTransformerBackbone
    from keras_vmoe.models.configs import backbone_config

    s = settings
    overrides = {k: s[k] for k in ("image_size", "patch_size", "hidden_dim",
                                   "mlp_dim", "num_heads", "num_layers",
                                   "representation_size")}
    if model == "dense":
        config = backbone_config("vmoe", "S/32", layout="none", **overrides)
    else:
        config = backbone_config(
            "vmoe", "S/32", layout="last2", num_experts=s["num_experts"],
            num_selected_experts=s["num_selected_experts"],
            capacity_factor=s["capacity_factor"], group_size=s["group_size"],
            batch_priority=s["batch_priority"],
            bfloat16_dispatch=s["bfloat16_dispatch"],
            router={"noise_std": s["noise_std"],
                    "importance_loss_weight": s["importance_loss_weight"],
                    "load_loss_weight": s["load_loss_weight"]},
            moe={"dispatch": KERAS_DISPATCH[dispatcher]}, **overrides)
    keras.utils.set_random_seed(0)
    backbone = VisionTransformerBackbone(**config)
    classifier = ImageClassifier(backbone, num_classes=s["num_classes"])
    classifier.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE))
    step, state = train_step.raw_step(classifier)
    images, labels = inputs(s)
    return (step, tuple(state), (jax.device_put(images), jax.device_put(labels)),
            classifier.count_params(), list(config["moe_layers"]))


def upstream_moe_layers(settings):
    """Upstream's Last-2: the last two odd-numbered blocks."""
    return list(range(1, settings["num_layers"], 2))[-2:]


def upstream_program(model, dispatcher, settings):
    """Upstream's Flax train step.

    Returns:
        `(jitted step, state, inputs, parameter count, MoE block indices)`.
    """
    import jax
    import jax.numpy as jnp
    import optax
    from vmoe import utils as vmoe_utils
    from vmoe.nn import vit_moe

    s = settings
    encoder = dict(num_layers=s["num_layers"], mlp_dim=s["mlp_dim"],
                   num_heads=s["num_heads"], dropout_rate=0.0,
                   attention_dropout_rate=0.0)
    if model == "vmoe":
        encoder["moe"] = dict(
            layers=tuple(upstream_moe_layers(s)), num_experts=s["num_experts"],
            group_size=s["group_size"], dropout_rate=0.0, split_rngs=False,
            router=dict(
                num_selected_experts=s["num_selected_experts"],
                noise_std=s["noise_std"],
                importance_loss_weight=s["importance_loss_weight"],
                load_loss_weight=s["load_loss_weight"],
                dispatcher=dict(name=dispatcher, bfloat16=s["bfloat16_dispatch"],
                                capacity_factor=s["capacity_factor"],
                                batch_priority=s["batch_priority"])))
    net = vit_moe.VisionTransformerMoe(
        num_classes=s["num_classes"], patch_size=(s["patch_size"],) * 2,
        hidden_size=s["hidden_dim"], encoder=encoder, classifier="token",
        representation_size=s["representation_size"], deterministic=False)
    images, labels = inputs(s)
    onehot = jax.nn.one_hot(labels, s["num_classes"], dtype=jnp.float32)
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    params = jax.jit(net.init)(
        {"params": keys[0], "gating": keys[1], "dropout": keys[2]}, images)["params"]
    rngs = {"gating": keys[1], "dropout": keys[2]}
    tx = optax.sgd(LEARNING_RATE)
    opt_state = tx.init(params)

    def loss_fn(params, images, labels, rngs):
        rngs, next_rngs = vmoe_utils.tree_rngs_split(rngs)
        logits, metrics = net.apply({"params": params}, images, rngs=rngs)
        main_loss = jnp.mean(optax.softmax_cross_entropy(logits, labels))
        total = main_loss + jnp.mean(metrics.get("auxiliary_loss", 0.0))
        return total, next_rngs

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def step(params, opt_state, rngs, images, labels):
        (loss, next_rngs), grads = grad_fn(params, images, labels, rngs)
        updates, opt_state = tx.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state, next_rngs

    count = sum(leaf.size for leaf in jax.tree_util.tree_leaves(params))
    layers = upstream_moe_layers(s) if model == "vmoe" else []
    return (jax.jit(step, donate_argnums=(0, 1, 2)), (params, opt_state, rngs),
            (jax.device_put(images), onehot), count, layers)


def _cost(compiled):
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return cost or {}


def measure(step, state, step_inputs, reps, warmup):
    """XLA's analysis of the compiled step, then `reps` timed steps."""
    import jax

    from benchmarks import train_step

    start = time.perf_counter()
    compiled = step.lower(*state, *step_inputs).compile()
    compile_s = time.perf_counter() - start
    cost, memory = _cost(compiled), compiled.memory_analysis()
    out = {
        "flops": float(cost.get("flops", -1.0)),
        "bytes_accessed": float(cost.get("bytes accessed", -1.0)),
        "transcendentals": float(cost.get("transcendentals", -1.0)),
        "temp_bytes": int(memory.temp_size_in_bytes),
        "argument_bytes": int(memory.argument_size_in_bytes),
        "output_bytes": int(memory.output_size_in_bytes),
        "compile_s": round(compile_s, 2),
    }
    if reps <= 0:
        return out

    def run():
        nonlocal state
        loss, *rest = compiled(*state, *step_inputs)
        state = tuple(rest)
        jax.block_until_ready(loss)
        return float(loss)

    for _ in range(warmup):
        run()
    before = harness.load_average()
    times = []
    for _ in range(reps):
        begin = time.perf_counter()
        loss = run()
        times.append((time.perf_counter() - begin) * 1000)
    after = harness.load_average()
    threshold = harness.load_threshold()
    quiet = bool(before and after) and max(before["load1"], after["load1"]) <= threshold
    out["step_time"] = {**train_step.summary(times), "load_before": before,
                        "load_after": after, "under_load": not quiet,
                        "last_loss": round(loss, 5)}
    return out


def child(spec, settings):
    """Builds, compiles and times one program; prints its JSON line."""
    impl, model, dispatcher = spec.split(":")
    dispatcher = None if dispatcher == "none" else dispatcher
    build = keras_program if impl == "keras_vmoe" else upstream_program
    step, state, step_inputs, params, moe_layers = build(model, dispatcher, settings)
    row = {"impl": impl, "model": model, "dispatcher": dispatcher,
           "keras_dispatch": (KERAS_DISPATCH[dispatcher]
                              if impl == "keras_vmoe" and dispatcher else None),
           "params": int(params), "moe_layers": moe_layers,
           **measure(step, state, step_inputs, settings["reps"], settings["warmup"])}
    print(json.dumps(row), flush=True)


# ---------------------------------------------------------------------------
# Parent.


def run_child(spec, settings, upstream_src):
    path = [ROOT, os.path.join(upstream_src, "vmoe"),
            os.path.join(upstream_src, "vision_transformer"),
            os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(p for p in path if p))
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", spec,
         "--child-settings", json.dumps(settings)],
        env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        return {"spec": spec, "error": done.stderr[-3000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def program_specs(models, dispatchers):
    specs = []
    for model in models:
        for dispatcher in (dispatchers if model == "vmoe" else ("none",)):
            specs += [f"keras_vmoe:{model}:{dispatcher}",
                      f"upstream:{model}:{dispatcher}"]
    return specs


def percent(ours, theirs):
    if ours is None or theirs in (None, 0):
        return None
    return round((ours / theirs - 1.0) * 100.0, 3)


def compare(ours, theirs):
    """keras_vmoe against upstream: differences in % (negative: keras_vmoe less)."""
    entry = {
        "model": ours["model"],
        "keras_vmoe_dispatcher": ours["dispatcher"],
        "upstream_dispatcher": theirs["dispatcher"],
        "same_dispatcher": ours["dispatcher"] == theirs["dispatcher"],
        "params_equal": ours["params"] == theirs["params"],
    }
    for key in ("bytes_accessed", "flops", "transcendentals", "temp_bytes"):
        entry[f"{key}_pct"] = percent(ours.get(key), theirs.get(key))
    if "step_time" in ours and "step_time" in theirs:
        entry["step_time_median_ratio"] = round(
            ours["step_time"]["median_ms"] / theirs["step_time"]["median_ms"], 3)
        entry["step_time_min_ratio"] = round(
            ours["step_time"]["min_ms"] / theirs["step_time"]["min_ms"], 3)
        entry["step_time_under_load"] = (ours["step_time"]["under_load"]
                                         or theirs["step_time"]["under_load"])
    return entry


def comparisons(rows):
    found = {(r["impl"], r["model"], r["dispatcher"]): r
             for r in rows if "error" not in r}
    pairs = [(("keras_vmoe", "dense", None), ("upstream", "dense", None))]
    pairs += [(("keras_vmoe", "vmoe", d), ("upstream", "vmoe", d)) for d in DISPATCHERS]
    # keras_vmoe's default dispatcher against upstream's default one.
    pairs.append((("keras_vmoe", "vmoe", "indices"), ("upstream", "vmoe", "einsum")))
    return [compare(found[a], found[b]) for a, b in pairs
            if a in found and b in found]


def machine():
    model = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu": model or platform.processor() or None,
            "cpu_count": os.cpu_count(), "usable_cores": harness.usable_cores(),
            "platform": platform.platform(), "python": platform.python_version()}


def versions():
    from importlib import metadata

    out = {}
    for name in ("jax", "jaxlib", "flax", "optax", "ml_collections", "keras",
                 "numpy"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def keras_vmoe_revision():
    try:
        done = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def build_parser():
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--upstream-src", default=None, metavar="PATH",
        help="folder holding checkouts of google-research/vmoe (PATH/vmoe) and "
        "google-research/vision_transformer (PATH/vision_transformer)")
    parser.add_argument("--dispatcher", choices=(*DISPATCHERS, "both"),
                        default="both", help="V-MoE dispatcher(s) to compare "
                        "(keras_vmoe's `index` runs as `indices`; default both)")
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated subset of {list(MODELS)}")
    parser.add_argument("--batch", type=int, default=None,
                        help="images per step (default 8; quick 2)")
    parser.add_argument("--capacity-factor", type=float, default=1.5)
    parser.add_argument("--float32-dispatch", action="store_true",
                        help="dispatch in float32 (default: bfloat16, as upstream's configs)")
    parser.add_argument("--reps", type=int, default=None,
                        help="timed steps per program after the warm-up "
                        "(default 10; quick 1; 0: no timing, the program "
                        "analysis only)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed steps after the compile (default 2; quick 1)")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny model of the same structure (checks the script)")
    parser.add_argument("--output", default=None, help="also write the JSON here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-settings", default=None, help=argparse.SUPPRESS)
    harness.add_arguments(parser)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child, json.loads(args.child_settings))
    problems = missing_requirements(args.upstream_src)
    if problems:
        print(missing_message(problems), file=sys.stderr)
        raise SystemExit(MISSING_EXIT_STATUS)
    args.reps = (1 if args.quick else 10) if args.reps is None else args.reps
    args.warmup = (1 if args.quick else 2) if args.warmup is None else args.warmup
    models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(models) - set(MODELS))
    if unknown or not models:
        parser.error(f"--models: unknown {unknown}; valid: {list(MODELS)}")
    if args.reps < 0 or args.warmup < 0:
        parser.error("--reps and --warmup must be >= 0")
    try:
        settings = settings_for(args)
    except ValueError as error:
        parser.error(str(error))
    dispatchers = DISPATCHERS if args.dispatcher == "both" else (args.dispatcher,)
    upstream_src = os.path.abspath(args.upstream_src)
    harness.record_start(args.allow_loaded)
    rows = []
    for spec in program_specs(models, dispatchers):
        log(f"{spec} ...")
        row = run_child(spec, settings, upstream_src)
        if "error" in row:
            log(f"{spec} failed:\n{row['error']}")
        else:
            log(f"{spec}: {row['bytes_accessed'] / 1e9:.3f} GB, "
                f"{row['flops'] / 1e9:.2f} GFLOP"
                + (f", {row['step_time']['median_ms']:.0f} ms"
                   if "step_time" in row else ""))
        rows.append(row)
    result = {
        "benchmark": "upstream_step",
        "settings": settings,
        "machine": machine(),
        "versions": versions(),
        "revisions": {"keras_vmoe": keras_vmoe_revision(),
                      **{name: upstream_revision(upstream_src, name)
                         for name in UPSTREAM_FILES}},
        "programs": rows,
        "comparisons": comparisons(rows),
        "failed": [row["spec"] for row in rows if "error" in row],
    }
    harness.write_result(result, args.output)
    if result["failed"]:
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
