"""keras-vmoe finetune: fine-tune a V-MoE on a dataset, evaluate, save.

With no arguments: trains a small V-MoE (Token Choice top-2, 8 experts in 2
of 4 blocks) on the handwritten digits shipped in the package (offline,
fixed train/test split) with the `digits` recipe (100 epochs of SGD, MixUp
0.2), prints the test accuracy and writes into --output: preset/ (the model,
with class names), metrics.json, routing_heatmap.png and checkpoints/ (the
training state after every epoch).

Ctrl-C (or SIGTERM) stops after the current step, saves and exits with 130
(143); run the same command again to resume (also after a kill or a crash):
the result is that of an uninterrupted run. A finished run is not redone
(--overwrite starts again). A NaN or inf loss stops the run naming the step.

--data takes 'digits', 'tfds:NAME' or an image folder (one sub-folder per
class, or train/ and test/ folders of class folders; without them 20% of
each class, chosen by a hash of the file names, is the 'test' split).
--preset starts from a preset (new head, position embeddings resized).
"""

import argparse
import math
import os
import pathlib

from keras_vmoe import presets
from keras_vmoe.catalog import PRESETS
from keras_vmoe.catalog.names import resolve_preset_name
from keras_vmoe.cli import CliError
from keras_vmoe.cli import emit_json
from keras_vmoe.cli import progress
from keras_vmoe.cli.arguments import dataset_spec
from keras_vmoe.cli.arguments import int_between
from keras_vmoe.cli.arguments import positive_float as _positive_float
from keras_vmoe.cli.arguments import positive_int as _positive_int
from keras_vmoe.cli.demo import DEMO_BACKBONE
from keras_vmoe.utils import keras_internals
from keras_vmoe.utils import safe_files
from keras_vmoe.utils.arrays import nbytes

DEFAULT_OUTPUT = "keras_vmoe_finetune"

# The default model: the demo's V-MoE, narrower, for 32x32 inputs (16 tokens).
SMALL_VMOE = {
    **DEMO_BACKBONE,
    "image_size": 32,
    "patch_size": 8,
    "hidden_dim": 96,
    "mlp_dim": 192,
    "dropout_rate": 0.1,
}
# The default job (digits, the small V-MoE): the `digits` recipe's length,
# peak rate and MixUp. Other data train DEFAULT_EPOCHS epochs, without MixUp.
DIGITS_DEFAULTS = {"epochs": 100, "learning_rate": 0.1, "batch_size": 64, "mixup": 0.2}
DEFAULT_EPOCHS = 30


def _randaugment(text):
    from keras_vmoe.preprocessing import augmentation  # lazy: no Keras at start-up

    limit = augmentation.MAX_RANDAUGMENT_OPS
    try:
        num_ops, magnitude = (float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected NUM_OPS,MAGNITUDE (e.g. 2,10), got {text!r}") from None
    if num_ops != int(num_ops) or not 0 <= num_ops <= limit or not 0 <= magnitude <= 30:
        raise argparse.ArgumentTypeError(
            f"expected 0 <= NUM_OPS <= {limit} (int) and 0 <= MAGNITUDE "
            f"<= 30, got {text!r}")
    return int(num_ops), magnitude


def _mixup_alpha(text):
    """--mixup: a concentration > 0, or 0 for no MixUp."""
    try:
        if float(text) == 0:
            return 0.0
    except ValueError:
        pass  # the message of `_positive_float`
    return _positive_float(text)


def add_arguments(parser):
    parser.add_argument("--data", type=dataset_spec, default="digits",
                        help="'digits' (embedded, default), 'tfds:NAME' or an image folder")
    parser.add_argument("--train-split", default="train", help="training split (default: train)")
    parser.add_argument("--test-split", default="test",
                        help="test split (default: test; a folder without split "
                        "sub-folders holds out 20%% of each class as 'test')")
    parser.add_argument("--preset", default=None,
                        help="start from this preset (name or directory) instead of "
                        "the small default V-MoE")
    parser.add_argument("--no-weights", action="store_true",
                        help="with --preset: random initial weights")
    parser.add_argument("--image-size", type=_positive_int, default=None,
                        help="model resolution (default: 32, or the preset's)")
    parser.add_argument("--epochs", type=_positive_int, default=None,
                        help=f"default {DIGITS_DEFAULTS['epochs']} for the default "
                        f"digits job, else {DEFAULT_EPOCHS}")
    parser.add_argument("--batch-size", type=_positive_int,
                        default=DIGITS_DEFAULTS["batch_size"])
    parser.add_argument("--learning-rate", type=_positive_float, default=None,
                        help=f"peak SGD learning rate (default {DIGITS_DEFAULTS['learning_rate']}, "
                        "0.01 with --preset, the recipe's with --recipe)")
    parser.add_argument("--warmup-steps", type=int, default=None,
                        help="linear warm-up steps (default: 5%% of the steps)")
    parser.add_argument("--recipe", default=None,
                        help="a named upstream recipe (optimizer, schedule, clip, "
                        "capacity factor; --learning-rate, if given, overrides its "
                        "peak rate): vmoe_ft_imagenet, vmoe_ft_cifar10, "
                        "e3_ft_cifar100, soft_moe_ft, digits")
    parser.add_argument("--freeze-backbone", action="store_true", help="train the head only")
    parser.add_argument("--remat", action="store_true",
                        help="rematerialise the encoder blocks: recompute their "
                        "activations in the backward pass (less memory, slower steps)")
    parser.add_argument("--scan", action="store_true",
                        help="run the repeated encoder blocks as scans (JAX): faster "
                        "compiles of deep models")
    parser.add_argument("--randaugment", type=_randaugment, default=None,
                        help="upstream's RandAugment NUM_OPS,MAGNITUDE (e.g. 2,10)")
    parser.add_argument("--mixup", type=_mixup_alpha, default=None,
                        help="upstream's MixUp concentration (e.g. 0.2; default "
                        f"{DIGITS_DEFAULTS['mixup']} for the default digits job, else "
                        "none; 0 turns it off)")
    parser.add_argument("--no-flip", action="store_true",
                        help="no horizontal flips (always off for digits)")
    parser.add_argument("--output", default=DEFAULT_OUTPUT,
                        help=f"output directory (default: ./{DEFAULT_OUTPUT})")
    parser.add_argument("--seed", type=int_between(0, 2**32 - 1), default=0)
    parser.add_argument("--json", action="store_true",
                        help="print the metrics as JSON on stdout (the rest: stderr)")
    parser.add_argument("--overwrite", action="store_true",
                        help="discard the checkpoints and results in --output (by "
                        "default a stopped run resumes, a finished one is not redone)")
    parser.add_argument("--pipeline", choices=("numpy", "tf"), default=None,
                        help="'numpy' (no TensorFlow; default for digits) or 'tf' "
                        "(default for TFDS, and for folders with TensorFlow)")
    parser.add_argument("--download", action="store_true",
                        help="with tfds:NAME: let TFDS download it (network)")


def _output_path(path, data=None):
    """The absolute output directory (checked, not created)."""
    if not path or not path.strip():
        raise CliError("--output is empty: name a directory for the results "
                       f"(default: ./{DEFAULT_OUTPUT}).")
    if "://" in path:
        raise CliError(f"--output must be a local directory. Received: {path!r}")
    if os.path.exists(path) and not os.path.isdir(path):
        raise CliError(f"--output {path!r} exists and is not a directory.")
    if data is not None and os.path.isdir(data):
        inner, outer = os.path.realpath(path), os.path.realpath(data)
        if os.path.commonpath([inner, outer]) == outer:
            raise CliError(
                f"--output {path!r} is inside --data {data!r}: the results (preset, "
                "checkpoints, heatmap) would be read as images by the next run. "
                "Choose an --output outside the data folder.")
    return os.path.abspath(path)


def _check_output(path):
    """Creates the output directory and checks that it is writable."""
    import tempfile

    path = _output_path(path)
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path) as probe:
            probe.write(b"0" * 4096)
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as error:
        raise CliError(f"--output {path!r} is not writable: {error.strerror or error}. "
                       "Choose another directory.") from None
    return path


def _finished(output, args):
    """The metrics of a finished run with these settings in `output`, or None."""
    path = os.path.join(output, "metrics.json")
    if not os.path.lexists(path):
        return None
    try:
        metrics = safe_files.read_json_file(path, "metrics file", CliError)
    except CliError as error:
        if os.path.exists(path) and not os.path.isfile(path):
            raise CliError(f"{error} Remove it or pass --overwrite.") from None
        return None  # damaged: the run is done again
    except OSError:
        return None
    accuracy = metrics.get("test_accuracy")
    # Not a result this program wrote (or with other settings): done again.
    if (not metrics.get("completed") or isinstance(accuracy, bool)
            or not isinstance(accuracy, (int, float))
            or metrics.get("arguments") != _arguments_record(args)
            or not os.path.isfile(os.path.join(output, "preset", "config.json"))):
        return None
    return metrics


def _check_resumable(output, args):
    """Refuses, before data and model, checkpoints of a run with other data settings."""
    from keras_vmoe.training import checkpoints  # lazy: no Keras at CLI start-up
    from keras_vmoe.training import run_control  # lazy: no Keras at CLI start-up

    directory = os.path.join(output, "checkpoints")
    if not os.path.isfile(os.path.join(directory, checkpoints.POINTER)):
        return
    digits = args.data == "digits"
    data = {
        "source": args.data if digits or args.data.startswith("tfds:")
        else os.path.abspath(args.data),
        "split": args.train_split,
        "seed": args.seed,
        "flip": not (args.no_flip or digits),
        "randaugment": None if args.randaugment is None else list(args.randaugment),
        "mixup": args.mixup,
    }
    if args.pipeline:
        data["pipeline"] = args.pipeline
    settings = {"epochs": _epochs(args), "data": data}
    try:
        run_control.check_resumable(directory, settings)
    except checkpoints.CheckpointError as error:
        raise CliError(str(error).replace("overwrite=True (--overwrite)",
                                          "--overwrite")) from None


def _arguments_record(args):
    """The arguments that decide a run's result (not --output, --json, ...)."""
    skip = {"output", "json", "overwrite", "command", "download", "argv"}
    return {k: (list(v) if isinstance(v, tuple) else v)
            for k, v in sorted(vars(args).items()) if k not in skip}


def _build_model(args, num_classes, image_size):
    from keras_vmoe import models  # lazy: no Keras at CLI start-up
    from keras_vmoe import preprocessing  # lazy: no Keras at CLI start-up

    keras_internals.set_random_seed(args.seed)
    if args.preset:
        overrides = {"num_classes": num_classes} if num_classes else {}
        if image_size:
            overrides["image_size"] = image_size
        return presets.from_preset(args.preset, load_weights=not args.no_weights,
                                   **overrides)
    config = {**SMALL_VMOE, "image_size": image_size}
    backbone = models.VisionTransformerBackbone(**config, name="small_vmoe")
    preprocessor = models.ImageClassifierPreprocessor(preprocessing.ImageConverter(
        image_size, crop="central_crop", name="image_converter"))
    return models.ImageClassifier(backbone, num_classes=num_classes,
                                  preprocessor=preprocessor, name="small_vmoe_classifier")


def _epoch_lines(epochs):
    """A Keras callback: one progress line per epoch on stderr."""
    import time

    import keras

    class EpochLines(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.time()

        def on_epoch_end(self, epoch, logs=None):
            values = " ".join(f"{k}={v:.4f}" for k, v in sorted((logs or {}).items())
                              if isinstance(v, (int, float)))
            progress(f"epoch {epoch + 1}/{epochs} ({time.time() - self.start:.1f}s) "
                     f"{values}")

    return EpochLines()


def _batch_size(requested, num_examples, progress):
    """The training batch size: smaller than requested for a small dataset."""
    if num_examples is None or num_examples >= requested:
        return requested
    if num_examples < 1:
        raise ValueError("The training split has no images.")
    progress(f"only {num_examples} training images, fewer than --batch-size "
             f"{requested}: using batch size {num_examples} (set --batch-size to "
             "choose another)")
    return num_examples


# A test accuracy up to this multiple of chance (1 / classes) is "near chance".
NEAR_CHANCE = 1.2
# A training loss that fell by less than this fraction of its first value is flat.
FLAT_LOSS = 0.05
# A flat loss after fewer optimizer steps than this asks for more steps.
FEW_STEPS = 50


def training_advice(losses, accuracy, num_classes, pretrained, steps=None):
    """Sentences of advice for a run that diverged or learned nothing (else []).

    `losses` per epoch: one that became nan or inf, rose, or stayed flat points
    at the learning rate (or, within `FEW_STEPS` optimizer `steps`, at the
    number of steps); one still falling at near-chance test `accuracy` asks
    for more epochs or images.
    """
    advice = []
    start = ("" if pretrained else ", or start from pretrained weights "
             "(--preset, see `keras-vmoe presets --with-weights`)")
    rate = "try a lower --learning-rate (e.g. 10 times lower)" + start
    longer = "train longer (--epochs) or on more images" + start
    finite = [loss for loss in losses if math.isfinite(loss)]
    if len(finite) < len(losses):
        advice.append(f"the training loss became nan or inf: the run diverged; {rate}.")
    elif len(finite) >= 2 and finite[-1] > finite[0]:
        advice.append(f"the training loss rose from {finite[0]:.3g} to {finite[-1]:.3g}: "
                      f"the run diverged; {rate}.")
    chance = 1.0 / max(num_classes, 1)
    if not (math.isfinite(accuracy) and accuracy <= NEAR_CHANCE * chance):
        return advice
    near = (f"test accuracy {accuracy:.3f} is near chance (1/{num_classes} = "
            f"{chance:.3f}): the model has not learned the classes")
    if advice:  # the loss already says why
        advice.append(near + ".")
    elif len(finite) < 2:
        advice.append(f"{near}; {longer}.")
    elif finite[-1] < (1 - FLAT_LOSS) * finite[0]:
        advice.append(f"{near} yet, but the training loss fell from {finite[0]:.3g} to "
                      f"{finite[-1]:.3g}: it is still learning; {longer}.")
    elif steps is not None and steps < FEW_STEPS:
        advice.append(f"{near}, and the training loss barely moved ({finite[0]:.3g} to "
                      f"{finite[-1]:.3g}) in only {steps} optimizer steps: train longer "
                      "(--epochs) or in smaller batches (--batch-size).")
    else:
        advice.append(f"{near}, and the training loss stayed flat ({finite[0]:.3g} to "
                      f"{finite[-1]:.3g}); {rate}.")
    return advice


def run(args):
    import time

    output = _output_path(args.output, args.data)
    if args.preset is None and args.no_weights:
        raise ValueError("--no-weights needs --preset.")
    if args.warmup_steps is not None and args.warmup_steps < 0:
        raise ValueError(f"--warmup-steps must be >= 0. Received: {args.warmup_steps}")
    args.mixup = _mixup(args)  # what trains is what is recorded and compared
    if not args.overwrite:
        done = _finished(output, args)
        if done is not None:
            return _report_finished(output, done, args)
    started = time.time()
    _check_preset(args)  # a missing preset or its weights: before Keras and the data
    if not args.overwrite:
        _check_resumable(output, args)
    progress("loading Keras and JAX")
    from keras_vmoe import data  # lazy: a faster CLI start-up
    from keras_vmoe import training  # lazy: no Keras at CLI start-up

    if args.recipe is not None:
        training.get_recipe(args.recipe)  # an unknown recipe: before data and model
    _check_output(output)  # created and checked writable only now
    image_size = _model_image_size(args)
    common = _data_arguments(args, image_size)
    train, test, probe, batch_size = _load_data(args, common)
    names = probe.class_names
    progress(f"building the model ({len(names)} classes)")
    model = _build_model(args, len(names), image_size)
    recipe, learning_rate = _recipe(args, training)
    epochs = _epochs(args)
    progress(f"fine-tuning for {epochs} epochs (data={args.data}, image_size={image_size}, "
             f"batch_size={batch_size}, learning_rate={learning_rate})")
    try:
        history = training.finetune(
            model, train, test, epochs=epochs, learning_rate=learning_rate,
            warmup_steps=args.warmup_steps, freeze_backbone=args.freeze_backbone,
            checkpoint_dir=os.path.join(output, "checkpoints"),
            callbacks=[_epoch_lines(epochs)], verbose=0, overwrite=args.overwrite,
            log=progress, recipe=recipe,
            remat=args.remat or None, scan=args.scan or None)
    except training.TrainingInterrupted as stop:
        return _report_interrupted(stop, args)
    progress("evaluating on the test split")
    evaluation_data = data.load_dataset(args.data, args.test_split,
                                        batch_size=args.batch_size, **common)
    if args.mixup is not None:  # compiled for MixUp's one-hot labels
        evaluation_data = training.finetuning.to_dense_labels(evaluation_data, len(names))
    results = model.evaluate(evaluation_data, verbose=0, return_dict=True)
    preset_dir = _save_preset(model, output, names, args)
    routing, heatmap = _routing_summary(model, args, image_size, names, output)
    metrics = {
        "dataset": str(args.data),
        "train_split": args.train_split,
        "test_split": args.test_split,
        "train_examples": probe.num_examples,
        "test_examples": test.num_examples,
        "split_note": probe.split_note,
        "test_accuracy": float(results.get("accuracy", math.nan)),
        "test_loss": float(results.get("loss", math.nan)),
        "epochs": epochs,
        "image_size": image_size,
        "batch_size": batch_size,
        "learning_rate": learning_rate,
        "num_classes": len(names),
        "class_names": names,
        "parameters": int(model.count_params()),
        "fit_seconds": round(float(history.fit_seconds), 1),
        "total_seconds": round(time.time() - started, 1),
        "resumed_from": history.resumed_from,
        "history": {k: [float(v) for v in vals] for k, vals in history.history.items()},
        "routing": routing,
        "preset": preset_dir,
        "routing_heatmap": heatmap,
        "completed": True,
        "arguments": _arguments_record(args),
    }
    _report(metrics, args, output, float(history.fit_seconds))
    return 0


def _report_finished(output, done, args):
    """Says that this run finished earlier (its metrics `done`); exit status 0."""
    accuracy = done.get("test_accuracy", math.nan)
    progress(f"this run already finished in {output} (test accuracy {accuracy:.4f}); "
             "nothing to do. Pass --overwrite to train again.")
    if args.json:
        emit_json(done)
    else:
        print(f"test accuracy: {accuracy:.4f} "
              f"(finished earlier; {os.path.join(output, 'metrics.json')})")
    return 0


def _check_preset(args):
    """Refuses an unknown preset or unobtainable weights before Keras and the data."""
    from keras_vmoe.presets import released  # lazy: kept out of the CLI start-up

    if not args.preset or os.path.isdir(args.preset):
        return
    name = presets.resolve_preset_name(args.preset)
    if name is None:
        raise ValueError(f"Unknown preset {args.preset!r}. See `keras-vmoe presets`.")
    if not args.no_weights:
        released.check_released_weights(name, PRESETS[name])


def _default_job(args):
    """Whether the run trains the small V-MoE on the digits (the main job)."""
    return args.data == "digits" and not args.preset


def _epochs(args):
    """--epochs, or the default: the digits recipe's for the default job."""
    if args.epochs:
        return args.epochs
    return DIGITS_DEFAULTS["epochs"] if _default_job(args) else DEFAULT_EPOCHS


def _mixup(args):
    """The MixUp concentration of the run (None: no MixUp)."""
    if args.mixup is None:
        return DIGITS_DEFAULTS["mixup"] if _default_job(args) else None
    return args.mixup or None  # --mixup 0: off


def _model_image_size(args):
    """--image-size, the default model's, or the preset's (built if it must be)."""
    image_size = args.image_size or (None if args.preset else SMALL_VMOE["image_size"])
    if image_size is None:
        image_size = _preset_image_size(args.preset)
    if image_size is None:  # an unusual preset: read its size off the model
        image_size = _build_model(args, None, None).backbone.image_size
    return image_size if isinstance(image_size, int) else tuple(image_size)


def _data_arguments(args, image_size):
    """The `load_dataset` arguments shared by the training and test splits."""
    common = {"image_size": image_size, "seed": args.seed}
    if args.download:
        common["download"] = True
    if getattr(args, "pipeline", None):
        common["pipeline"] = args.pipeline
    return common


def _load_data(args, common):
    """`(train, test, probe, batch_size)`, checked before any model is built.

    `probe` is the training split without augmentation (class names, size).
    """
    from keras_vmoe import data  # lazy: a faster CLI start-up

    digits = args.data == "digits"
    test, probe = (data.load_dataset(args.data, split, batch_size=args.batch_size,
                                     **common)
                   for split in (args.test_split, args.train_split))
    names = probe.class_names
    if len(names) < 2:
        raise CliError(
            f"--data {args.data!r} has {len(names)} class ({', '.join(map(repr, names))}): "
            "a classifier needs at least two, or it reaches accuracy 1.0 without "
            "learning anything. Put each class's images in its own sub-folder "
            "(DATA/<class>/<image>).")
    batch_size = _batch_size(args.batch_size, probe.num_examples, progress)
    train = data.load_dataset(
        args.data, args.train_split, training=True, flip=not (args.no_flip or digits),
        batch_size=batch_size,
        # Digits are centred and small: mild crops only.
        crop_area_range=(0.6, 1.0) if digits else (0.05, 1.0),
        randaugment=args.randaugment, mixup=args.mixup, **common)
    if probe.split_note:
        progress(probe.split_note)
    counts = ", ".join(f"{n} {what} images" for n, what in (
        (probe.num_examples, f"training ({args.train_split!r})"),
        (test.num_examples, f"test ({args.test_split!r})")) if n is not None)
    progress(f"data: {args.data}, {len(names)} classes" + (f"; {counts}" if counts else ""))
    return train, test, probe, batch_size


def _recipe(args, training):
    """`(recipe or None, peak learning rate)` of the run."""
    learning_rate = args.learning_rate or (0.01 if args.preset else
                                           DIGITS_DEFAULTS["learning_rate"])
    recipe = args.recipe or ("digits" if _default_job(args)
                             and args.learning_rate is None else None)
    if recipe is None:
        return None, learning_rate
    recipe = training.recipes.with_learning_rate(training.get_recipe(recipe),
                                                 args.learning_rate)
    return recipe, recipe.learning_rate


def _report_interrupted(stop, args):
    """Says how to resume a stopped run; its exit status (130 or 143)."""
    import shlex

    progress(f"interrupted: {stop}")
    argv = list(getattr(args, "argv", None) or [])
    if argv and argv[0] == "finetune":
        argv = argv[1:]
    argv = [shlex.quote(a) for a in argv if a != "--overwrite"]
    progress("to resume, run the same command again: "
             + " ".join(["keras-vmoe", "finetune", *argv]))
    return stop.exit_code


def _save_preset(model, output, names, args):
    """Writes the fine-tuned model as a preset into `output`; its path."""
    from keras_vmoe.training import checkpoints  # lazy: no Keras at CLI start-up

    preset_dir = os.path.join(output, "preset")
    # HDF5 can crash the process on a full disk: check the room first (the
    # preset is written to a temporary folder, then renamed).
    checkpoints.ensure_free_space(output, sum(nbytes(w) for w in model.weights),
                                  "the preset")
    presets.save_to_preset(model, preset_dir, metadata={
        "class_names": names, "dataset": str(args.data)})
    return preset_dir


def _routing_summary(model, args, image_size, names, output, limit=512):
    """`(per-layer expert load and drops, heatmap path)`, `(None, None)` without MoE.

    The statistics and the heatmap PNG are of (up to `limit`) test images.
    """
    if not model.backbone.moe_layers:
        return None, None
    import numpy as np

    from keras_vmoe import data  # lazy: a faster CLI start-up
    from keras_vmoe import evaluation  # lazy: a faster CLI start-up

    progress("routing statistics and heatmap")
    heatmap = os.path.join(output, "routing_heatmap.png")
    images, labels = [], []
    for x, y in data.load_dataset(args.data, args.test_split, image_size=image_size,
                                  batch_size=64):
        images.append(np.asarray(x))
        labels.append(np.asarray(y))
        if sum(len(b) for b in images) >= limit:
            break
    stats = evaluation.routing_statistics(model, np.concatenate(images)[:limit],
                                          labels=np.concatenate(labels)[:limit])
    stats.setdefault("class_names", list(names))
    evaluation.plot_routing_heatmaps(stats, heatmap)
    routing = {name: {k: v for k, v in layer.items()
                      if k in ("expert_load", "tokens_dropped_fraction")}
               for name, layer in stats.get("layers", {}).items()}
    return routing, heatmap


def _report(metrics, args, output, fit_seconds):
    """Adds the advice, writes metrics.json (atomically) and prints the result."""
    import json

    names, accuracy = metrics["class_names"], metrics["test_accuracy"]
    losses = metrics["history"].get("loss", [])
    examples, batch_size = metrics["train_examples"], metrics["batch_size"]
    steps = None if examples is None else len(losses) * math.ceil(examples / batch_size)
    advice = training_advice(losses, accuracy, len(names), pretrained=bool(args.preset),
                             steps=steps)
    metrics["warnings"] = advice
    for line in advice:
        progress(f"warning: {line}")
    path = safe_files.write_atomically(
        os.path.join(output, "metrics.json"),
        lambda temp: pathlib.Path(temp).write_text(
            json.dumps(metrics, indent=2, default=float)))
    if args.json:
        emit_json(metrics)
        return
    heatmap = metrics["routing_heatmap"]
    print(f"test accuracy: {accuracy:.4f} ({args.data}, split {args.test_split!r}, "
          f"{len(names)} classes)")
    print(f"fine-tuning took {fit_seconds:.0f} s; preset: {metrics['preset']}")
    print(f"metrics: {path}"
          + (f"; routing heatmap: {heatmap}" if heatmap else ""))


def _preset_image_size(preset):
    """The image size a preset was built for, without building it (or None)."""
    if not os.path.isdir(preset):
        name = resolve_preset_name(preset)
        return PRESETS[name].get("image_size") if name else None

    def find(node):
        if isinstance(node, dict):
            if "image_size" in node:
                return node["image_size"]
            for value in node.values():
                found = find(value)
                if found is not None:
                    return found
        return None

    try:
        size = find(safe_files.read_json_file(os.path.join(preset, "config.json"),
                                              "preset config file"))
    except (OSError, ValueError, RecursionError):
        return None
    if isinstance(size, list) and len(size) == 2:
        size = tuple(size)
    ok = isinstance(size, int) or (isinstance(size, tuple) and all(
        isinstance(v, int) for v in size))
    return size if ok else None
