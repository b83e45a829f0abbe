"""Sparse upcycling on the embedded digits: dense ViT vs its upcycled V-MoE.

Protocol (per seed): train a small dense ViT on digits (train split) to
convergence (`--dense-epochs`, SGD momentum 0.9, warm-up + cosine, clip 1.0:
the `digits` recipe's optimizer); then, from that same checkpoint, train
`--extra-epochs` more with a fresh warm-up + cosine schedule at
`--extra-lr` either

* `dense`: the dense model itself, or
* `upcycled`: `keras_vmoe.presets.upcycle(dense, num_experts=E,
  layout=LAYOUT)` (experts = copies of the MLP, fresh seeded router,
  V-MoE Token Choice K=2, capacity factor 1.05 in training, evaluation at
  capacity factor 2.0 as upstream evaluates above the training capacity).

Prints one JSON object: per-seed test accuracies (digits test split, 360
images) at the end of phase 1 and of both continuations, the upcycled
model's test accuracy at step 0, and mean / std / min / max per arm.

    nice -n 5 python benchmarks/upcycling_digits.py --seeds 0 1 2 > \\
        benchmarks/results/upcycling_digits_<date>.json

or one process per seed (`--seeds 0 > s0.json`, ...) and then
`--merge s0.json s1.json s2.json`.
"""

import argparse
import json
import os
import platform
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_vmoe  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import harness  # noqa: E402
from keras_vmoe.training.finetuning import finetune  # noqa: E402

DENSE = dict(image_size=32, patch_size=4, hidden_dim=64, num_layers=4, num_heads=4,
             mlp_dim=128, classifier="token")


def _data(seed, batch_size):
    # The main job's digits augmentation: mild crops, no flips (digits are
    # not mirror-symmetric).
    train = keras_vmoe.data.load_dataset("digits", "train", image_size=32,
                                         batch_size=batch_size, training=True,
                                         seed=seed, flip=False,
                                         crop_area_range=(0.6, 1.0))
    test = keras_vmoe.data.load_dataset("digits", "test", image_size=32,
                                        batch_size=120)
    return train, test


def _accuracy(model, test):
    return float(model.evaluate(test, verbose=0, return_dict=True)["accuracy"])


def _train(model, train, epochs, lr):
    finetune(model, train, epochs=epochs, learning_rate=lr, clipnorm=1.0, verbose=0,
             log=lambda *a, **k: None)


def run_seed(seed, args):
    keras.utils.set_random_seed(seed)
    train, test = _data(seed, args.batch_size)
    backbone = keras_vmoe.models.VisionTransformerBackbone(**DENSE)
    dense = keras_vmoe.models.ImageClassifier(backbone, num_classes=10)
    start = time.perf_counter()
    _train(dense, train, args.dense_epochs, args.lr)
    result = {"seed": seed, "dense_phase1": _accuracy(dense, test),
              "phase1_s": round(time.perf_counter() - start, 1)}
    weights = [np.array(w) for w in dense.get_weights()]

    upcycled = keras_vmoe.presets.upcycle(dense, num_experts=args.num_experts,
                                         layout=args.layout, seed=seed,
                                         moe={"eval_routing": {"capacity_factor": 2.0}})
    result["upcycled_step0"] = _accuracy(upcycled, test)

    keras.utils.set_random_seed(seed + 1000)
    start = time.perf_counter()
    _train(dense, train, args.extra_epochs, args.extra_lr)
    result["dense_continued"] = _accuracy(dense, test)
    result["dense_continued_s"] = round(time.perf_counter() - start, 1)

    keras.utils.set_random_seed(seed + 1000)
    start = time.perf_counter()
    _train(upcycled, train, args.extra_epochs, args.extra_lr)
    result["upcycled_continued"] = _accuracy(upcycled, test)
    result["upcycled_continued_s"] = round(time.perf_counter() - start, 1)
    dense.set_weights(weights)
    return result


def _stats(values):
    values = np.asarray(values, dtype=float)
    return {"mean": round(float(values.mean()), 4), "std": round(float(values.std()), 4),
            "min": round(float(values.min()), 4), "max": round(float(values.max()), 4),
            "runs": int(values.size)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--dense-epochs", type=int, default=30)
    parser.add_argument("--extra-epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--extra-lr", type=float, default=0.03)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--num-experts", type=int, default=4)
    parser.add_argument("--layout", default="last2")
    parser.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                        help="combine the runs of earlier outputs (e.g. one process "
                             "per seed) into one result; trains nothing")
    parser.add_argument("--quick", action="store_true",
                        help="one seed, one epoch per phase (checks the script runs)")
    parser.add_argument("--output", default=None, help="also write the JSON here")
    harness.add_arguments(parser)
    args = parser.parse_args(argv)
    harness.record_start(args.allow_loaded)
    if args.quick:
        args.seeds, args.dense_epochs, args.extra_epochs = [args.seeds[0]], 1, 1
    runs = []
    if args.merge:
        outputs = []
        for path in args.merge:
            with open(path) as f:
                outputs.append(json.load(f))
        runs = [run for output in outputs for run in output["runs"]]
        settings = outputs[0]["settings"]
        settings.update(seeds=[run["seed"] for run in runs], merged_from=args.merge)
        machine = outputs[0]["machine"]
    else:
        for seed in args.seeds:
            runs.append(run_seed(seed, args))
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)  # progress
        settings = {**vars(args), "dense": DENSE}
        machine = {"platform": platform.platform(), "processor": platform.processor(),
                   "cpus": os.cpu_count(), "backend": keras.backend.backend(),
                   "keras": keras.__version__}
    summary = {key: _stats([r[key] for r in runs])
               for key in ("dense_phase1", "upcycled_step0", "dense_continued",
                           "upcycled_continued")}
    summary["upcycled_minus_dense"] = _stats(
        [r["upcycled_continued"] - r["dense_continued"] for r in runs])
    return harness.write_result({
        "benchmark": "upcycling_digits",
        "settings": settings,
        "machine": machine,
        "runs": runs,
        "summary": summary,
    }, args.output, indent=1)


if __name__ == "__main__":
    main()
