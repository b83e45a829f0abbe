"""keras-vmoe finetune: fine-tune a V-MoE on a dataset, evaluate, save.

With no arguments: trains a small V-MoE (Token Choice top-2, 8 experts in 2
of 4 blocks) on scikit-learn's handwritten digits shipped inside the package
(offline; fixed train/test split, upsampled to the model resolution), with
the `digits` recipe (SGD momentum 0.9, warm-up + cosine decay, gradient
clipping 1.0, auxiliary losses on), then prints the test accuracy
and writes into --output:

  preset/            the fine-tuned model (keras_vmoe preset, with class names)
  metrics.json       test metrics, training history, timings
  routing_heatmap.png  expert load, expert x class, expert x patch position
  checkpoints/       per-epoch weights; rerun the same command after a kill
                     to resume from the last completed epoch

--data takes 'digits', 'tfds:NAME' or an image folder (one sub-folder per
class); --preset starts from a preset (new head for the dataset's classes,
position embeddings resized to --image-size).
"""

import argparse
import math
import os

from keras_vmoe.cli.arguments import positive_float as _positive_float
from keras_vmoe.cli.arguments import positive_int as _positive_int
from keras_vmoe.cli.demo import DEMO_BACKBONE

DEFAULT_OUTPUT = "keras_vmoe_finetune"

# The default model: a small V-MoE for 32x32 inputs (digits upsampled 4x).
SMALL_VMOE = {
    **DEMO_BACKBONE,  # the demo's V-MoE, narrower and at the digits' resolution
    "image_size": 32,
    "patch_size": 4,
    "hidden_dim": 96,
    "mlp_dim": 192,
}
DIGITS_DEFAULTS = {"epochs": 30, "learning_rate": 0.1, "batch_size": 64}


def _randaugment(text):
    try:
        num_ops, magnitude = (float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected NUM_OPS,MAGNITUDE (e.g. 2,10), got {text!r}") from None
    if num_ops != int(num_ops) or num_ops < 0 or not (0 <= magnitude <= 30):
        raise argparse.ArgumentTypeError(
            f"expected NUM_OPS >= 0 (int) and 0 <= MAGNITUDE <= 30, got {text!r}")
    return int(num_ops), magnitude


def _dataset_spec(text):
    if text == "digits" or text.startswith("tfds:") and len(text) > 5:
        return text
    if os.path.isdir(text):
        return text
    raise argparse.ArgumentTypeError(
        f"unknown dataset {text!r}: use 'digits', 'tfds:NAME' (e.g. tfds:cifar10) "
        "or an existing folder with one sub-folder of images per class")


def add_arguments(parser):
    parser.add_argument("--data", type=_dataset_spec, default="digits",
                        help="'digits' (embedded, default), 'tfds:NAME' or an image folder")
    parser.add_argument("--train-split", default="train", help="training split (default: train)")
    parser.add_argument("--test-split", default="test",
                        help="test split (default: test; for a folder without "
                        "split sub-folders use e.g. --train-split 'train[:80%%]' "
                        "--test-split 'train[80%%:]')")
    parser.add_argument("--preset", default=None,
                        help="start from this preset (name or directory) instead of "
                        "the small default V-MoE")
    parser.add_argument("--no-weights", action="store_true",
                        help="with --preset: random initial weights")
    parser.add_argument("--image-size", type=_positive_int, default=None,
                        help="model resolution (default: 32, or the preset's)")
    parser.add_argument("--epochs", type=_positive_int, default=None,
                        help=f"default {DIGITS_DEFAULTS['epochs']}")
    parser.add_argument("--batch-size", type=_positive_int,
                        default=DIGITS_DEFAULTS["batch_size"])
    parser.add_argument("--learning-rate", type=_positive_float, default=None,
                        help=f"peak SGD learning rate (default {DIGITS_DEFAULTS['learning_rate']}, "
                        "0.01 with --preset)")
    parser.add_argument("--warmup-steps", type=int, default=None,
                        help="linear warm-up steps (default: 5%% of the steps)")
    parser.add_argument("--recipe", default=None,
                        help="a named upstream recipe (optimizer, schedule, clip, "
                        "capacity factor; replaces --learning-rate): vmoe_ft_imagenet, "
                        "vmoe_ft_cifar10, e3_ft_cifar100, soft_moe_ft, digits")
    parser.add_argument("--freeze-backbone", action="store_true", help="train the head only")
    parser.add_argument("--randaugment", type=_randaugment, default=None,
                        help="RandAugment NUM_OPS,MAGNITUDE (e.g. 2,10)")
    parser.add_argument("--mixup", type=_positive_float, default=None,
                        help="MixUp alpha (e.g. 0.2)")
    parser.add_argument("--no-flip", action="store_true",
                        help="no horizontal flips (always off for digits)")
    parser.add_argument("--output", default=DEFAULT_OUTPUT,
                        help=f"output directory (default: ./{DEFAULT_OUTPUT})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true",
                        help="print the metrics as JSON on stdout (progress on stderr)")


def _check_output(path):
    from keras_vmoe.cli import CliError

    if "://" in path:
        raise CliError(f"--output must be a local directory. Received: {path!r}")
    if os.path.exists(path) and not os.path.isdir(path):
        raise CliError(f"--output {path!r} exists and is not a directory.")
    return os.path.abspath(path)


def _build_model(args, num_classes):
    import keras

    from keras_vmoe import models
    from keras_vmoe import presets

    keras.utils.set_random_seed(args.seed)
    if args.preset:
        overrides = {"num_classes": num_classes}
        if args.image_size:
            overrides["image_size"] = args.image_size
        return presets.from_preset(args.preset, load_weights=not args.no_weights,
                                   **overrides)
    config = dict(SMALL_VMOE)
    if args.image_size:
        config["image_size"] = args.image_size
    backbone = models.VisionTransformerBackbone(**config, name="small_vmoe")
    converter = models_converter(config["image_size"])
    return models.ImageClassifier(backbone, num_classes=num_classes,
                                  image_converter=converter, name="small_vmoe_classifier")


def models_converter(image_size):
    from keras_vmoe.preprocessing import ImageConverter

    return ImageConverter(image_size, crop="central_crop", name="image_converter")


class _EpochLines:
    """Keras callback printing one progress line per epoch to stderr."""

    def __new__(cls, epochs):
        import time

        import keras

        from keras_vmoe.cli import progress

        class EpochLines(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                self.start = time.time()

            def on_epoch_end(self, epoch, logs=None):
                values = " ".join(f"{k}={v:.4f}" for k, v in sorted((logs or {}).items())
                                  if isinstance(v, (int, float)))
                progress(f"epoch {epoch + 1}/{epochs} ({time.time() - self.start:.1f}s) "
                         f"{values}")

        return EpochLines()


def _image_size(model):
    size = model.backbone.image_size
    return size if isinstance(size, int) else tuple(size)


def _routing_heatmap(model, spec, split, image_size, path, limit=512):
    """Routing statistics on (up to `limit`) test images and their heatmap PNG."""
    import numpy as np

    from keras_vmoe import data
    from keras_vmoe import evaluation

    images, labels = [], []
    for x, y in data.load_dataset(spec, split, image_size=image_size, batch_size=64):
        images.append(np.asarray(x))
        labels.append(np.asarray(y))
        if sum(len(b) for b in images) >= limit:
            break
    images = np.concatenate(images)[:limit]
    labels = np.concatenate(labels)[:limit]
    stats = evaluation.routing_statistics(model, images, labels=labels)
    evaluation.plot_routing_heatmaps(stats, path)
    return stats


def _write_json(path, payload):
    import json

    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2, default=float)
    os.replace(tmp, path)


def run(args):
    import json
    import time

    from keras_vmoe.cli import progress

    output = _check_output(args.output)
    if args.preset is None and args.no_weights:
        raise ValueError("--no-weights needs --preset.")
    if args.warmup_steps is not None and args.warmup_steps < 0:
        raise ValueError(f"--warmup-steps must be >= 0. Received: {args.warmup_steps}")
    started = time.time()
    progress("loading Keras, JAX and TensorFlow")
    from keras_vmoe import data
    from keras_vmoe import presets
    from keras_vmoe import training

    if args.recipe is not None:
        training.get_recipe(args.recipe)  # an unknown name fails before any work
    if args.preset:
        # Fail on an unknown preset before loading data or building anything.
        if not os.path.isdir(args.preset) and presets.resolve_preset_name(args.preset) is None:
            raise ValueError(
                f"Unknown preset {args.preset!r}. See `keras-vmoe presets`.")
    names = data.class_names(args.data, split=args.train_split)
    digits = args.data == "digits"
    epochs = args.epochs or DIGITS_DEFAULTS["epochs"]
    learning_rate = args.learning_rate or (0.01 if args.preset else
                                           DIGITS_DEFAULTS["learning_rate"])
    progress(f"building the model ({len(names)} classes)")
    model = _build_model(args, len(names))
    image_size = _image_size(model)
    flip = not (args.no_flip or digits)
    common = {"image_size": image_size, "batch_size": args.batch_size, "seed": args.seed}
    train = data.load_dataset(
        args.data, args.train_split, training=True, flip=flip,
        # Digits are centred and small: mild crops only.
        crop_area_range=(0.6, 1.0) if digits else (0.05, 1.0),
        randaugment=args.randaugment, mixup=args.mixup, **common)
    test = data.load_dataset(args.data, args.test_split, **common)
    progress(f"fine-tuning for {epochs} epochs (data={args.data}, image_size={image_size}, "
             f"batch_size={args.batch_size}, learning_rate={learning_rate})")
    fit_started = time.time()
    history = training.finetune(
        model, train, test, epochs=epochs, learning_rate=learning_rate,
        warmup_steps=args.warmup_steps, freeze_backbone=args.freeze_backbone,
        checkpoint_dir=os.path.join(output, "checkpoints"),
        callbacks=[_EpochLines(epochs)], verbose=0,
        recipe=args.recipe or ("digits" if digits and not args.preset
                               and args.learning_rate is None else None))
    fit_seconds = time.time() - fit_started
    progress("evaluating on the test split")
    results = model.evaluate(data.load_dataset(args.data, args.test_split, **common)
                             if args.mixup is None else test, verbose=0, return_dict=True)
    accuracy = float(results.get("accuracy", math.nan))
    preset_dir = os.path.join(output, "preset")
    presets.save_to_preset(model, preset_dir, metadata={
        "class_names": names, "dataset": str(args.data)})
    heatmap = os.path.join(output, "routing_heatmap.png")
    routing = None
    if model.backbone.moe_layers:
        progress("routing statistics and heatmap")
        stats = _routing_heatmap(model, args.data, args.test_split, image_size, heatmap)
        routing = {name: {k: v for k, v in layer.items()
                          if k in ("expert_load", "tokens_dropped_fraction")}
                   for name, layer in stats.get("layers", {}).items()}
    else:
        heatmap = None
    metrics = {
        "dataset": str(args.data),
        "test_split": args.test_split,
        "test_accuracy": accuracy,
        "test_loss": float(results.get("loss", math.nan)),
        "epochs": epochs,
        "image_size": image_size,
        "batch_size": args.batch_size,
        "learning_rate": learning_rate,
        "num_classes": len(names),
        "parameters": int(model.count_params()),
        "fit_seconds": round(fit_seconds, 1),
        "total_seconds": round(time.time() - started, 1),
        "history": {k: [float(v) for v in vals] for k, vals in history.history.items()},
        "routing": routing,
        "preset": preset_dir,
        "routing_heatmap": heatmap,
    }
    _write_json(os.path.join(output, "metrics.json"), metrics)
    if args.json:
        print(json.dumps(metrics, indent=2, default=float))
    else:
        print(f"test accuracy: {accuracy:.4f} ({args.data}, split {args.test_split!r}, "
              f"{len(names)} classes)")
        print(f"fine-tuning took {fit_seconds:.0f} s; preset: {preset_dir}")
        print(f"metrics: {os.path.join(output, 'metrics.json')}"
              + (f"; routing heatmap: {heatmap}" if heatmap else ""))
    return 0
