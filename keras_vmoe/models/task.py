"""`Task`: the base class of keras_vmoe tasks (a head on a backbone).

A task wraps a `Backbone` (`self.backbone`) and a preprocessor
(`self.preprocessor`, e.g. an `ImageClassifierPreprocessor`) and adds a
head; it is what `fit`, `evaluate` and `predict` are called on. The base
carries what every task shares, as KerasHub's `Task` does: presets, LoRA
and int8 quantization (`ModelBase`), export, routing control delegated to
the backbone, and the input path of `fit`/`evaluate`/`predict`: the
preprocessor's conversion of arrays, lists of raw images, `tf.data`
datasets and generators, label checks, upstream's padding of a partial
last routing group, and the MoE auxiliary loss in the logs.
"""

import inspect
import math

import keras
import numpy as np

from keras_vmoe.deploy import export as export_lib
from keras_vmoe.models import quantized_config
from keras_vmoe.models import state_guard
from keras_vmoe.models.image_classifier_preprocessor import ImageClassifierPreprocessor
from keras_vmoe.models.image_classifier_preprocessor import is_array
from keras_vmoe.models.model_base import ModelBase
from keras_vmoe.models.size_estimate import check_head
from keras_vmoe.models.size_estimate import in_abstract_build
from keras_vmoe.utils.validation import check_one_of


def serialize_activation(activation):
    if activation is None or isinstance(activation, str):
        return activation
    return keras.activations.serialize(activation)


def serialize_dtype(dtype):
    if dtype is None or isinstance(dtype, str):
        return dtype
    return keras.dtype_policies.serialize(dtype)


def is_logits(activation):
    if activation is None:
        return True
    return keras.activations.get(activation) is keras.activations.linear


# The `keras.Model` arguments a task passes on.
MODEL_ARGUMENTS = ("name", "trainable")
# How `predict` routes a partial last routing group (see `predict`).
PARTIAL_GROUP_MODES = ("zero_images", "mask")
# The compile config's record of whether the optimizer had been built.
OPTIMIZER_BUILT_KEY = "optimizer_built"


def predict_bucket(num_images, batch_size, group=1):
    """The batch shape `predict` pads a partial last batch to on JAX.

    The next power of two of `num_images`, rounded up to a multiple of
    `group`, at most `batch_size` (itself a multiple of `group`): a call
    with any number of images compiles for `batch_size` and for one of
    about log2(batch_size) buckets.

    Args:
        num_images: int, images in the last batch (>= 1).
        batch_size: int, the batch size.
        group: int, the routing group the batch must be a multiple of.

    Returns:
        int, the padded size of the last batch.

    Examples:

    ```python
    from keras_vmoe.models.task import predict_bucket

    print(predict_bucket(6, 32), predict_bucket(17, 32), predict_bucket(3, 32, 8))
    # 8 32 8
    ```
    """
    bucket = 1
    while bucket < num_images:
        bucket *= 2
    return min(-(-bucket // group) * group, batch_size)


def images_input(backbone):
    """The images input of a task's graph: `keras.Input` of the backbone's
    input shape, named `"images"`.

    Args:
        backbone: a `keras_vmoe.models.Backbone` (any `keras.Model`).

    Returns:
        A symbolic `keras.Input`.
    """
    if not isinstance(backbone, keras.Model):
        raise ValueError(
            f"`backbone` must be a keras.Model (a VisionTransformerBackbone). "
            f"Received: backbone={backbone!r}"
        )
    return keras.Input(shape=backbone.input_shape[1:], name="images")


def classification_head(backbone, num_classes, bias_init=0.0, dtype=None,
                        activation=None):
    """The classification head `Dense(num_classes)` named `"head"` (zero
    kernel, constant bias), or `None` for `num_classes=None`.

    Args:
        backbone: the backbone the head sits on (its width, its dtype).
        num_classes: int >= 1, or `None` for no head.
        bias_init: float, the bias' initial value.
        dtype: the head's dtype policy (default: the backbone's).
        activation: `None` (logits) or a Keras activation.

    Returns:
        A `keras.layers.Dense`, or `None`.
    """
    if num_classes is not None and (
        not isinstance(num_classes, int)
        or isinstance(num_classes, bool)
        or num_classes < 1
    ):
        raise ValueError(
            f"`num_classes` must be None or an integer >= 1. Received: "
            f"num_classes={num_classes!r}"
        )
    if not num_classes:
        return None
    check_head(
        getattr(backbone, "representation_size", None)
        or getattr(backbone, "hidden_dim", 1),
        num_classes,
        check_memory=not in_abstract_build(),
    )
    return keras.layers.Dense(
        num_classes,
        activation=activation,
        kernel_initializer="zeros",
        bias_initializer=keras.initializers.Constant(bias_init),
        name="head",
        dtype=dtype or backbone.dtype_policy,
    )


class Task(ModelBase):
    """Base class of the keras_vmoe tasks: a head on a `Backbone`.

    A subclass builds its graph in `__init__` with the functional API (the
    images input from `images_input(backbone)`, the backbone, its head),
    sets its own config attributes, then calls
    `super().__init__(backbone, preprocessor, inputs=..., outputs=...,
    compile=compile, **kwargs)`; it implements `get_config` by adding its
    arguments to the base's. The base gives the subclass presets,
    `save_to_preset`, LoRA, int8 quantization of the expert banks, export,
    routing control and the preprocessing and label checks of
    `fit`/`evaluate`/`predict`. `ImageClassifier` and
    `EnsembleImageClassifier` are the tasks here; docs/development.md
    ("Adding a task") builds one.

    Args:
        backbone: a `keras_vmoe.models.Backbone`.
        preprocessor: `None` (an `ImageClassifierPreprocessor` for the
            backbone's input size) or an `ImageClassifierPreprocessor`
            (resized to the backbone's input size when it differs).
        inputs: the graph's input (`images_input(backbone)`).
        outputs: the graph's outputs.
        compile: bool, compile with the subclass' `compile()` defaults.
        **kwargs: `keras.Model` arguments (`name`, `trainable`).

    Examples:

    ```python
    import keras_vmoe

    classifier = keras_vmoe.models.ImageClassifier.from_preset(
        "vmoe_b32", load_weights=False, hidden_dim=64, num_heads=4,
        mlp_dim=128, num_layers=4, num_experts=4, image_size=32,
        num_classes=10)
    assert isinstance(classifier, keras_vmoe.models.Task)
    path = classifier.save_to_preset("tiny_classifier_preset")
    again = keras_vmoe.models.ImageClassifier.from_preset(path)
    ```
    """

    def __init__(self, backbone, preprocessor=None, *, inputs, outputs, compile=True,
                 **kwargs):
        unknown = sorted(set(kwargs) - set(MODEL_ARGUMENTS))
        if unknown:
            # Keras' functional models drop unknown arguments silently.
            valid = [name for name in inspect.signature(type(self).__init__).parameters
                     if name not in ("self", "kwargs")]
            raise TypeError(
                f"{type(self).__name__} got unexpected arguments {unknown}. Valid "
                f"arguments: {valid + list(MODEL_ARGUMENTS)}.")
        super().__init__(inputs=inputs, outputs=outputs, **kwargs)
        self.backbone = backbone
        size = tuple(backbone.input_shape[1:3])
        if isinstance(preprocessor, dict):
            preprocessor = keras.layers.deserialize(preprocessor)
        if preprocessor is None:
            preprocessor = ImageClassifierPreprocessor(image_size=size)
        elif not isinstance(preprocessor, ImageClassifierPreprocessor):
            raise ValueError(
                "`preprocessor` must be None or a "
                "keras_vmoe.models.ImageClassifierPreprocessor. Received: "
                f"preprocessor={preprocessor!r}")
        self.preprocessor = preprocessor.resized(size)
        self.dtype_policy = backbone.dtype_policy
        # Reports the MoE auxiliary losses (already part of "loss") in the
        # `fit` logs as "auxiliary_loss".
        self._auxiliary_loss_tracker = keras.metrics.Mean(name="auxiliary_loss")
        if hasattr(backbone, "_register_routing_dependent"):
            backbone._register_routing_dependent(self)
        if compile:
            self.compile()

    @classmethod
    def loads_task(cls, task_class_name):
        found = keras.saving.get_registered_object(f"keras_vmoe>{task_class_name}")
        return isinstance(found, type) and issubclass(found, cls)

    def export(self, filepath, format="tf_saved_model", verbose=None,
               input_signature=None, **kwargs):
        """Exports the model for serving (`keras_vmoe.deploy.export_model`).

        `format` is `"tf_saved_model"` (dynamic batch, plus a
        `serve_image_bytes` endpoint) or `"onnx"` (a static `batch_size`,
        required), with the current evaluation routing baked in. An
        explicit `input_signature` or another format goes to Keras'
        `Model.export` unchanged.
        """

        if input_signature is not None or format not in export_lib.FORMATS:
            return keras.Model.export(self, filepath, format=format, verbose=verbose,
                                      input_signature=input_signature, **kwargs)
        return export_lib.export_model(self, filepath, format, verbose=bool(verbose),
                                       **kwargs)

    def _labels_are_sparse(self):
        loss = getattr(self, "loss", None)
        sparse = getattr(loss, "sparse", None)
        if sparse is not None:
            return bool(sparse)
        name = type(loss).__name__ if loss is not None else ""
        return "Sparse" in name or (isinstance(loss, str) and "sparse" in loss)

    def _preprocess(self, x, y, where):
        """`x` converted by the preprocessor, its labels checked."""
        num_classes = getattr(self, "num_classes", None)
        return self.preprocessor.check_labels(
            self.preprocessor.convert(x), y, num_classes, self._labels_are_sparse(),
            where)

    @state_guard.restore_on_error
    def fit(self, x=None, y=None, *args, validation_data=None, **kwargs):
        state_guard.check_data_arguments("fit", (x, y, *args), kwargs)
        x = self._preprocess(x, y, "fit")
        if isinstance(validation_data, tuple):
            vx, *rest = validation_data
            validation_data = (self._preprocess(vx, rest[0] if rest else None,
                                                "fit(validation_data)"), *rest)
        elif validation_data is not None:
            validation_data = self._preprocess(validation_data, None,
                                               "fit(validation_data)")
        return super().fit(x, y, *args, validation_data=validation_data, **kwargs)

    @state_guard.restore_on_error
    def evaluate(self, x=None, y=None, *args, **kwargs):
        state_guard.check_data_arguments("evaluate", (x, y, *args), kwargs)
        x = self._preprocess(x, y, "evaluate")
        # The MoE auxiliary losses are added in training only: leave
        # "auxiliary_loss" out of evaluation logs (`val_auxiliary_loss`
        # would be a constant 0).
        self._evaluating = True
        try:
            return super().evaluate(x, y, *args, **kwargs)
        finally:
            self._evaluating = False

    def _inference_groups(self):
        """`images_per_group` of every MoE layer at inference (None where a
        layer routes a whole batch, or a token group, jointly)."""
        backbone = getattr(self, "backbone", None)
        layers = backbone.get_moe_layers() if hasattr(backbone, "get_moe_layers") else []
        return [layer.routing_phase(False).images_per_group for layer in layers]

    def _images_per_inference_group(self):
        """Images every MoE layer routes together at inference (the least
        common multiple over layers), or None when no layer groups images."""
        counts = [int(c) for c in self._inference_groups() if c]
        return math.lcm(*counts) if counts else None

    def _independent_image_group(self):
        """The images whose outputs depend only on each other at inference:
        1 without MoE layers or with Soft MoE only (each image is its own
        group), else the least common multiple of `images_per_group`; None
        when a layer routes a whole batch (or a token group) jointly, where
        any padding image would change the real ones' routing."""
        counts = self._inference_groups()
        if not all(counts):
            return None
        return math.lcm(*(int(c) for c in counts)) if counts else 1

    @state_guard.restore_on_error
    def predict(self, x, *args, partial_group="zero_images", **kwargs):
        """Keras `predict`, with upstream's padding of a partial last group.

        On the JAX backend, an array whose last batch is partial is padded
        with zero images up to a bucket (a power of two, rounded up to the
        routing group, at most `batch_size`) and the padding's outputs are
        dropped, so that calls with any number of images compile for a few
        batch shapes only (each new shape is a new XLA compilation). This
        is done only where it changes no real image's output: models whose
        images are routed alone or in `images_per_group` groups (dense
        ViTs, Soft MoE, `images_per_group` routing); a layer that routes a
        whole batch jointly gets the batch as given.

        Args:
            x: images (see the class docstring).
            *args: `keras.Model.predict` arguments.
            partial_group: how an array batch that does not fill its last
                routing group (`images_per_group`) is routed.
                `"zero_images"` (default, upstream's evaluation: the batch
                is padded with zero images, which are routed and take
                capacity, then dropped; the batch size is rounded up to a
                multiple of the group) or `"mask"` (the pad tokens are
                masked: the real images of the partial group share the
                whole group's capacity). Datasets and generators are not
                padded (`"mask"` applies to their partial groups).
            **kwargs: `keras.Model.predict` arguments.
        """
        check_one_of(partial_group, "partial_group", PARTIAL_GROUP_MODES)
        state_guard.check_data_arguments("predict", (x, *args), kwargs)
        x = self.preprocessor.convert(x)
        if not is_array(x):
            return state_guard.predict_whole_batches(super().predict, (x, *args), kwargs)
        kwargs.update(zip(("batch_size", "verbose", "steps", "callbacks"), args,
                          strict=False))
        group = (self._images_per_inference_group()
                 if partial_group == "zero_images" else None)
        independent = self._independent_image_group()
        bucketed = (keras.backend.backend() == "jax" and kwargs.get("steps") is None
                    and independent is not None
                    and (partial_group == "zero_images" or independent == 1))
        if (not group or group == 1) and not bucketed:
            return state_guard.predict_whole_batches(super().predict, (x,), kwargs)
        group = group or 1
        # Under a distribution the padded batch must also split evenly over
        # the devices: whole groups of zero images past the partial one
        # change no real image's group.
        distribution = keras.distribution.distribution()
        if distribution is not None:
            group = math.lcm(group, int(np.size(distribution.device_mesh.devices)))
        batch_size = kwargs.get("batch_size") or 32
        batch_size = -(-batch_size // group) * group
        kwargs["batch_size"] = batch_size
        x = np.asarray(x)
        num_images = x.shape[0]
        padded = num_images + (-num_images % group)
        last = padded % batch_size
        if bucketed and last:
            padded += predict_bucket(last, batch_size, group) - last
        if padded > num_images:
            x = np.concatenate(
                [x, np.zeros((padded - num_images, *x.shape[1:]), x.dtype)])
        outputs = state_guard.predict_whole_batches(super().predict, (x,), kwargs)
        return keras.tree.map_structure(lambda a: a[:num_images], outputs)

    def predict_probabilities(self, x, log=False, **kwargs):
        """Class probabilities `(B, C)`: the softmax of `predict`'s output.

        Args:
            x: images (anything `predict` accepts: a `(B, H, W, 3)` array,
                a list of raw images of any sizes, a `tf.data` dataset).
            log: bool, return log-probabilities (computed stably).
            **kwargs: `predict` arguments (`batch_size`, `verbose`, ...).

        Returns:
            numpy float32 array `(B, C)`; rows sum to 1 (`log=False`).
        """
        if not self.num_classes:
            raise ValueError(
                "This model has no classification head (num_classes=None): "
                "there are no class probabilities."
            )
        scores = np.asarray(self.predict(x, **kwargs), dtype="float64")
        if not is_logits(getattr(self, "activation", None)):
            # The head already applies its activation (e.g. "softmax").
            scores = np.log(np.clip(scores, 1e-30, None))
        scores = scores - scores.max(axis=-1, keepdims=True)
        log_probs = scores - np.log(np.exp(scores).sum(axis=-1, keepdims=True))
        return (log_probs if log else np.exp(log_probs)).astype("float32")

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                     training=True):
        total = super().compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
        )
        if training and self.losses:
            self._auxiliary_loss_tracker.update_state(
                keras.ops.sum(keras.ops.stack([keras.ops.cast(v, "float32")
                                               for v in self.losses]))
            )
        return total

    @property
    def metrics(self):
        metrics = list(super().metrics)
        tracker = getattr(self, "_auxiliary_loss_tracker", None)
        if tracker is None:
            return metrics
        if getattr(self, "_evaluating", False):
            # Evaluation adds no auxiliary loss: do not report a constant 0.
            return [m for m in metrics if m is not tracker]
        if getattr(self, "compiled", False) and tracker not in metrics:
            metrics.append(tracker)
        return metrics

    def set_routing(self, **kwargs):
        """Changes the routing of all MoE layers; see
        `VisionTransformerBackbone.set_routing`. Compiled functions are reset."""
        self.backbone.set_routing(**kwargs)

    def routing_metrics(self, images, **kwargs):
        """Per-MoE-block routing metrics; see
        `VisionTransformerBackbone.routing_metrics`."""
        return self.backbone.routing_metrics(images, **kwargs)

    def extract_features(self, images, blocks=None, **kwargs):
        """Token sequences of chosen encoder blocks of the backbone.

        `VisionTransformerBackbone.extract_features` after this task's
        image converter: `images` may be anything `predict` takes but a
        dataset (raw `uint8` photos of any size, a list of them).

        Args:
            images: a `(B, H, W, 3)` array or a list of raw images.
            blocks: block indices (`None`: every block).
            **kwargs: `keras_vmoe.models.features.extract_features`
                arguments (`norm`, `class_token`, `grid`, ...).

        Returns:
            `{"encoderblock_i": array}` (and the routing with
            `return_routing=True`).
        """
        kwargs.setdefault("image_converter", self.preprocessor.image_converter)
        return self.backbone.extract_features(images, blocks=blocks, **kwargs)

    def compile(self, *args, jit_compile="auto", **kwargs):
        # Keras records the resolved `jit_compile` (True for "auto" on JAX)
        # in the compile config a `.keras` file keeps; a file saved on JAX
        # would then run `torch.compile` when loaded on PyTorch (minutes of
        # recompiles on its first predict). The config keeps what was asked.
        super().compile(*args, jit_compile=jit_compile, **kwargs)
        self._requested_jit_compile = jit_compile

    def get_compile_config(self):
        config = super().get_compile_config()
        requested = getattr(self, "_requested_jit_compile", None)
        if config is not None and requested is not None:
            config["jit_compile"] = requested
        if config is not None:
            # Whether the saved optimizer holds its slots: a model never
            # trained saves only its step count and learning rate.
            optimizer = getattr(self, "optimizer", None)
            config[OPTIMIZER_BUILT_KEY] = bool(getattr(optimizer, "built", False))
        return config

    def compile_from_config(self, config):
        # `compile()` is overridden (for its "auto" defaults), so Keras
        # needs this to restore the saved compile arguments on load. The
        # optimizer is built (its slots created for the saved ones to load
        # into) only when the saved one was: otherwise Keras would skip
        # loading the saved step count, with a warning on every load.
        config = dict(config)
        built = config.pop(OPTIMIZER_BUILT_KEY, True)
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if built and getattr(self, "optimizer", None) is not None and self.built:
            self.optimizer.build(self.trainable_variables)

    def get_config(self):
        config = {
            "name": self.name,
            "trainable": self.trainable,
            "backbone": keras.layers.serialize(self.backbone),
            "preprocessor": keras.layers.serialize(self.preprocessor),
        }
        return quantized_config.add_quantized_layers(config, self)

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        layers = quantized_config.pop_quantized_layers(config)
        for key in ("backbone", "preprocessor"):
            if isinstance(config.get(key), dict):
                config[key] = keras.layers.deserialize(config[key])
        return quantized_config.quantize_layers(cls(**config), layers)
