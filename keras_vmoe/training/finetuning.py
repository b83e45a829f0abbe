"""`finetune`: compile with upstream's fine-tuning recipe, then `fit`."""

from keras_vmoe.deploy.quantize import quantized_layers
from keras_vmoe.models import lora
from keras_vmoe.training import recipes
from keras_vmoe.training import run_control
from keras_vmoe.training.recipes import UpstreamSGD
from keras_vmoe.training.schedules import WarmupCosineDecay
from keras_vmoe.utils.validation import check_int
from keras_vmoe.utils.validation import check_number


def finetune_optimizer(learning_rate, total_steps, warmup_steps, momentum=0.9,
                       clipnorm=10.0, end_learning_rate=1e-5):
    """Upstream's fine-tuning optimizer: `UpstreamSGD` with `WarmupCosineDecay`.

    Args:
        learning_rate: peak learning rate.
        total_steps: int, number of training steps.
        warmup_steps: int, linear warm-up steps (< `total_steps`).
        momentum: SGD momentum.
        clipnorm: global gradient norm clip, or None.
        end_learning_rate: learning rate at `total_steps`.

    Returns:
        A `keras_vmoe.training.UpstreamSGD`.
    """
    # The schedule checks the step counts and the optimizer the momentum.
    learning_rate = check_number(learning_rate, "learning_rate", inclusive=False)
    end_learning_rate = check_number(end_learning_rate, "end_learning_rate")
    schedule = WarmupCosineDecay(learning_rate, total_steps, warmup_steps,
                                 end_learning_rate=min(end_learning_rate, learning_rate))
    if clipnorm is not None:
        clipnorm = check_number(clipnorm, "clipnorm", inclusive=False)
    return UpstreamSGD(schedule, momentum=momentum, global_clipnorm=clipnorm)


def _steps_per_epoch(train, steps_per_epoch):
    if steps_per_epoch is not None:
        return check_int(steps_per_epoch, "steps_per_epoch", 1)
    cardinality = getattr(train, "cardinality", None)
    n = int(cardinality()) if cardinality is not None else None
    if n is not None and n > 0:
        return n
    try:
        length = len(train)
    except TypeError:
        length = None
    if n == 0 or length == 0:
        examples = getattr(train, "num_examples", None)
        have = f"{examples} examples, " if examples is not None else ""
        raise ValueError(
            f"`train` yields no batch ({have}drop_remainder=True drops a last "
            "batch smaller than batch_size in training pipelines). Use a "
            "batch_size no larger than the number of training examples.")
    if length is None:
        raise ValueError(
            "Cannot tell the number of batches per epoch of `train` (infinite or "
            "unknown cardinality): pass `steps_per_epoch`.")
    return check_int(length, "len(train)", 1)


def _labels_are_dense(dataset):
    if getattr(dataset, "dense_labels", None) is not None:  # NumPy pipeline
        return bool(dataset.dense_labels)
    spec = getattr(dataset, "element_spec", None)
    if not isinstance(spec, tuple) or len(spec) < 2:
        return False
    return spec[1].shape.rank == 2


def to_dense_labels(dataset, num_classes):
    """`dataset` with one-hot labels (to evaluate a model trained on MixUp).

    Args:
        dataset: a `load_dataset` NumPy pipeline or a `tf.data.Dataset` of
            `(images, class ids, ...)`.
        num_classes: int.

    Returns:
        The same batches with float32 one-hot labels `(B, num_classes)`.
    """
    if hasattr(dataset, "with_one_hot"):  # NumPy pipeline
        return dataset.with_one_hot(num_classes)
    import tensorflow as tf

    def one_hot(images, labels, *rest):
        return (images, tf.one_hot(tf.cast(labels, "int32"), num_classes), *rest)

    return dataset.map(one_hot)


def finetune(model, train, validation=None, *, epochs=10, learning_rate=None,
             warmup_steps=None, momentum=0.9, clipnorm=10.0, freeze_backbone=False,
             checkpoint_dir=None, steps_per_epoch=None, callbacks=(),
             verbose="auto", overwrite=False, log=None, recipe=None, remat=None,
             scan=None):
    """Fine-tunes a task with upstream's recipe; stoppable and resumable.

    Compiles `model` with upstream's fine-tuning optimizer (SGD momentum
    0.9, warm-up then cosine decay to 1e-5, clip 10.0) or a named `recipe`,
    then runs `fit` through `run_control.run_training`: checkpoints every
    epoch, exact resume when called again, Ctrl-C/SIGTERM stop after the
    current step, and a stop at a non-finite loss. `train`'s `class_names`,
    if any, are kept on the model.

    Args:
        model: an `ImageClassifier` or `EnsembleImageClassifier`.
        train: a `tf.data.Dataset` or `keras.utils.PyDataset` of `(images,
            labels)` batches; one-hot labels (MixUp) select a categorical
            loss.
        validation: optional dataset evaluated after every epoch.
        epochs: int.
        learning_rate: peak learning rate (default 0.003; with `recipe`,
            the recipe's, which a rate given here overrides).
        warmup_steps: int (default: 5% of the steps, at least 1 when there
            is more than one step; with `recipe`, the recipe's share).
        momentum: SGD momentum (ignored with `recipe`).
        clipnorm: global gradient-norm clip (None: no clipping; ignored
            with `recipe`).
        freeze_backbone: bool, train the head only. With LoRA enabled only
            the factors and head train, and this freezes the factors too.
            An int8 model trains only with LoRA, or with this and a float
            head (else `ValueError`).
        checkpoint_dir: directory for the checkpoints; resume from there.
        steps_per_epoch: int, needed when `train` has no known length.
        callbacks: extra Keras callbacks.
        verbose: `fit` verbosity.
        overwrite: bool, discard the checkpoints in `checkpoint_dir` and
            start again.
        log: callable printing one progress line (default: stderr).
        recipe: a `keras_vmoe.training.Recipe` or its name: its optimizer,
            schedule (over this run's steps), clip, routing and dropout.
        remat: optional bool, rematerialise the encoder blocks for this
            run; `None` keeps the model's setting.
        scan: optional bool, run the repeated encoder blocks as scans for
            this run (JAX); `None` keeps the model's setting.

    Returns:
        A `keras.callbacks.History` covering the whole run, resumed pieces
        included, with `fit_seconds` (all pieces) and `resumed_from`.

    Raises:
        TrainingInterrupted: stopped by SIGINT/SIGTERM (state saved).
        NonFiniteLossError: the loss became NaN or inf.
        ValueError: bad arguments, or int8 layers to train without LoRA.

    Examples:

    ```python
    import keras_vmoe

    # V-MoE S/32 shrunk to run in seconds (drop the size overrides, and use
    # load_weights=True for the released weights).
    model = keras_vmoe.presets.from_preset(
        "vmoe_s32", num_classes=10, image_size=32, load_weights=False,
        hidden_dim=32, num_heads=2, mlp_dim=64, num_layers=4, num_experts=4,
        representation_size=None)
    train = keras_vmoe.data.load_dataset("digits", "train", image_size=32,
                                         batch_size=64, training=True)
    history = keras_vmoe.training.finetune(model, train, epochs=1, verbose=0)
    ```
    """
    if not hasattr(model, "backbone") or not getattr(model, "num_classes", None):
        raise ValueError(
            "`model` must be an ImageClassifier or EnsembleImageClassifier with a "
            f"head (num_classes set). Received: {type(model).__name__}")
    epochs = check_int(epochs, "epochs", 1)
    _check_quantized(model, freeze_backbone)
    if remat is not None:
        model.backbone.set_remat(remat)
    if scan is not None:
        model.backbone.set_scan(scan)
    steps = _steps_per_epoch(train, steps_per_epoch)
    total = steps * epochs
    label_smoothing = 0.0
    if recipe is not None:
        recipe = recipes.with_learning_rate(recipes.get_recipe(recipe), learning_rate)
        # What is recorded (and compared on resume) is what trains.
        learning_rate, momentum = recipe.learning_rate, recipe.momentum
        clipnorm = recipe.clip_global_norm
        label_smoothing = recipe.label_smoothing
        optimizer = recipes.build_optimizer(recipe, total, warmup_steps)
        recipes.set_routing(model, recipe, training=True)
        if remat is None and recipe.remat is not None:
            model.backbone.set_remat(recipe.remat)
        if scan is None and recipe.scan is not None:
            model.backbone.set_scan(recipe.scan)
    else:
        learning_rate = 0.003 if learning_rate is None else learning_rate
        if warmup_steps is None:
            warmup_steps = max(1, round(0.05 * total)) if total > 1 else 0
        optimizer = finetune_optimizer(learning_rate, total, warmup_steps, momentum,
                                       clipnorm)
    names = getattr(train, "class_names", None)
    if names is not None:
        if len(names) != model.num_classes:
            raise ValueError(
                f"`train` has {len(names)} classes ({_preview(names)}) but the model's "
                f"head has num_classes={model.num_classes}.")
        model.class_names = [str(n) for n in names]
    dense = _labels_are_dense(train)
    if dense and validation is not None and not _labels_are_dense(validation):
        validation = to_dense_labels(validation, model.num_classes)
    if lora.lora_config(model) is not None:
        # Only the LoRA factors (and the head) train; the base stays frozen.
        lora.set_lora_trainable(model, train_factors=not freeze_backbone)
    else:
        model.backbone.trainable = not freeze_backbone
    recipes.compile_classifier(model, optimizer, dense, label_smoothing)
    data = getattr(train, "data_fingerprint", None)  # recorded by `load_dataset`
    settings = {"epochs": epochs, "steps_per_epoch": steps,
                "learning_rate": float(learning_rate), "warmup_steps": warmup_steps,
                "momentum": float(momentum),
                "clipnorm": None if clipnorm is None else float(clipnorm),
                "freeze_backbone": bool(freeze_backbone),
                "num_classes": int(model.num_classes),
                "recipe": None if recipe is None else recipe.name,
                "label_smoothing": float(label_smoothing),
                "model": _model_fingerprint(model),
                "data": dict(data) if isinstance(data, dict) else None}
    # Datasets shuffle themselves (`load_dataset(training=True)`); Keras warns
    # about its default `shuffle=True` for them otherwise.
    shuffle = not (hasattr(train, "element_spec")
                   or getattr(train, "shuffles_itself", False))
    return run_control.run_training(
        model, train, validation, epochs=epochs, steps_per_epoch=steps,
        fit_steps_per_epoch=steps_per_epoch, checkpoint_dir=checkpoint_dir,
        settings=settings, overwrite=overwrite, callbacks=list(callbacks),
        verbose=verbose, shuffle=shuffle, log=log or run_control.log_stderr)


def _check_quantized(model, freeze_backbone):
    """Refuses to train int8 layers (their kernels cannot move) without LoRA."""
    if lora.lora_config(model) is not None:
        return
    quantized = quantized_layers(model)
    head = {path: mode for path, mode in quantized.items()
            if path == "head" or path.startswith("head/")}
    trained = head if freeze_backbone else quantized
    if not trained:
        return
    first = next(iter(trained))
    what = ("its head" if freeze_backbone
            else f"{len(trained)} of its layers (e.g. {first!r})")
    raise ValueError(
        f"`model` is quantized ({trained[first]}: {what}), and int8 kernels cannot "
        f"train: with freeze_backbone={bool(freeze_backbone)} only the float biases "
        "and norms around them would move. Enable LoRA first "
        "(`model.enable_lora(rank)`: float factors over the frozen int8 kernels, "
        "QLoRA-style), train a float head over the int8 backbone "
        "(`from_preset(..., num_classes=N)` and freeze_backbone=True), or fine-tune "
        "the float model and quantize it afterwards.")


def _model_fingerprint(model):
    """The model's class and a hash of its training configuration."""
    import hashlib
    import json

    def unnamed(node, key=None):
        # Without made-up layer names (a layer config holds "trainable"), the
        # evaluation-only routing, and `moe` keys at their default (None).
        if isinstance(node, dict):
            return {k: unnamed(v, k) for k, v in node.items()
                    if not (k == "name" and "trainable" in node)
                    and k != "eval_routing" and not (key == "moe" and v is None)}
        if isinstance(node, (list, tuple)):
            return [unnamed(v) for v in node]
        return node

    try:
        config = json.dumps(unnamed(model.get_config()), sort_keys=True,
                            default=lambda value: type(value).__name__)
    except (NotImplementedError, TypeError, ValueError):
        return type(model).__name__
    digest = hashlib.sha256(config.encode("utf-8")).hexdigest()[:16]
    return f"{type(model).__name__}, config sha256 {digest}"


def _preview(names, limit=5):
    names = [str(n) for n in names]
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")
