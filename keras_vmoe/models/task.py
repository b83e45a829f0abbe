"""`Task`: the base class of keras_vmoe tasks (a head on a backbone).

A task wraps a `Backbone` (`self.backbone`) and adds a head; it is what
`fit`, `evaluate` and `predict` are called on. The base carries what every
task shares, as KerasHub's `Task` does: the class-owned presets
(`from_preset`, `save_to_preset`, `presets`), LoRA, int8 quantization of the
expert banks, export, routing control delegated to the backbone, and the
input path of `fit`/`evaluate`/`predict`: the image converter (raw images
of any size and dtype), label checks, upstream's padding of a partial last
routing group, and the MoE auxiliary loss in the logs.
"""

import math

import keras
import numpy as np

from keras_vmoe.data.labels import check_class_ids
from keras_vmoe.deploy import export as export_lib
from keras_vmoe.models import lora
from keras_vmoe.models import quantized_config
from keras_vmoe.models import state_guard
from keras_vmoe.models.backbone import PresetListing
from keras_vmoe.models.backbone import load_preset
from keras_vmoe.models.backbone import quantize_with_experts
from keras_vmoe.models.backbone import save_preset
from keras_vmoe.models.size_estimate import check_head
from keras_vmoe.models.size_estimate import in_abstract_build
from keras_vmoe.preprocessing import ImageConverter
from keras_vmoe.preprocessing.value_range import check_pixel_values


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


def _is_tf_dataset(x):
    # Checked by class name so that TensorFlow is never imported here.
    return any(
        c.__module__.startswith("tensorflow") and c.__name__ == "DatasetV2"
        for c in type(x).__mro__
    )


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


def _is_array(x):
    return isinstance(x, np.ndarray) or (
        hasattr(x, "shape") and hasattr(x, "dtype") and not _is_tf_dataset(x)
        and not isinstance(x, (dict, list, tuple))
    )


def _is_image_list(x):
    """A non-empty list/tuple of arrays (or PIL-like images): raw images.

    The task models have a single input, so a list is never a list of
    model inputs."""
    return (
        isinstance(x, (list, tuple))
        and len(x) > 0
        and all(
            _is_array(item) or hasattr(item, "__array_interface__")
            or hasattr(item, "__array__")
            for item in x
        )
        and not all(np.ndim(item) == 0 for item in x)
    )


class Task(keras.Model):
    """Base class of the keras_vmoe tasks: a head on a `Backbone`.

    Subclass it and build the graph in `__init__` with the functional API:
    create `self.backbone`, the head (`_build_head`), the image converter
    (`_make_image_converter`) and the images input
    (`_task_images_input`), call `super().__init__(inputs=...,
    outputs=..., **kwargs)`, then `_finish_task(backbone, compile)`.
    Implement `get_config` (with the serialized backbone). The base gives
    the subclass presets, `save_to_preset`, LoRA, int8 quantization of the
    expert banks, export, routing control and the image and label handling
    of `fit`/`evaluate`/`predict`. `ImageClassifier` and
    `EnsembleImageClassifier` are the tasks here.

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

    presets = PresetListing()
    _CONVERT_CHUNK = 256

    @classmethod
    def from_preset(cls, preset, load_weights=True, **overrides):
        """Builds this task from a preset name, directory or handle.

        Takes the arguments of `keras_vmoe.presets.from_preset`. A task
        preset gives its task; a backbone preset gives a new task with a
        fresh head (`num_classes` is then required).

        Args:
            preset: a built-in preset name (see `Class.presets`), a preset
                directory or a handle (`hf://`, `kaggle://`, `gs://`).
            load_weights: bool, `False` builds the architecture with random
                weights.
            **overrides: as `keras_vmoe.presets.from_preset` (routing,
                `image_size`, `num_classes`, `dtype`, ...).

        Returns:
            An instance of this class.
        """
        return load_preset(cls, preset, load_weights, **overrides)

    def save_to_preset(self, preset_dir, **kwargs):
        """Saves this task as a preset directory, atomically.

        Args:
            preset_dir: local directory to create.
            **kwargs: `preset_name`, `metadata`, `dtype`, as
                `keras_vmoe.presets.save_to_preset`.

        Returns:
            The absolute path of the preset directory.
        """
        return save_preset(self, preset_dir, **kwargs)

    def enable_lora(self, rank, **kwargs):
        """LoRA on the backbone's attention query/value (and optionally the
        experts); only the factors and the head train afterwards.

        Args:
            rank: int r.
            **kwargs: `lora_alpha`, `targets`, `experts`, `train_head`, as
                `keras_vmoe.models.lora.enable_lora`.

        Returns:
            This task.
        """
        return lora.enable_lora(self, rank, **kwargs)

    def save_lora_weights(self, path, **kwargs):
        """Writes the LoRA factors (and the head) to a `.npz`
        (`keras_vmoe.models.lora`)."""
        return lora.save_lora_weights(self, path, **kwargs)

    def load_lora_weights(self, path):
        """Loads LoRA factors (and a head) saved by `save_lora_weights`."""
        return lora.load_lora_weights(self, path)

    def quantize(self, mode=None, config=None, filters=None, **kwargs):
        """Keras' `Model.quantize`, plus the MoE expert banks (int8)."""
        quantize_with_experts(self, mode, config=config, filters=filters, **kwargs)

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

    def _make_image_converter(self, image_converter, backbone):
        """Builds `self.image_converter` (see the task docstrings)."""

        size = backbone.image_size
        if image_converter is None:
            converter = ImageConverter(size, upstream_resize=True,
                                       name="image_converter")
            custom = False
        else:
            if isinstance(image_converter, dict):
                image_converter = keras.layers.deserialize(image_converter)
            if not isinstance(image_converter, ImageConverter):
                raise ValueError(
                    "`image_converter` must be None or a "
                    "keras_vmoe.preprocessing.ImageConverter. Received: "
                    f"image_converter={image_converter!r}"
                )
            converter = image_converter
            if tuple(converter._size) != tuple(
                size if isinstance(size, (list, tuple)) else (size, size)
            ):
                # The converter feeds this backbone: follow its resolution
                # (e.g. a preset loaded with an `image_size` override).
                config = converter.get_config()
                config["image_size"] = size
                converter = ImageConverter.from_config(config)
            custom = True
        self._custom_image_converter = custom
        return converter

    def _converter_is_identity(self, x):
        converter = self.image_converter
        return (
            "float" in str(x.dtype)
            and tuple(converter.float_range) == (-1.0, 1.0)
            and tuple(x.shape[1:3]) == tuple(converter._size)
        )

    def _convert_image_list(self, images):
        """A list of raw images (any sizes, any of the converter's dtypes) ->
        one converted `(B, H, W, 3)` batch; each item is one image `(H, W, 3)`
        or a batch `(b, H, W, 3)`."""
        converter = self.image_converter
        batches = []
        for index, image in enumerate(images):
            image = np.asarray(image)
            if image.ndim == 2:
                raise ValueError(
                    f"Image {index} of the list has shape {image.shape}: a grayscale "
                    "image. Each item must be an RGB image (height, width, 3) or a "
                    "batch (batch, height, width, 3); convert it with "
                    "`np.repeat(image[..., None], 3, axis=-1)`.")
            if image.ndim == 3:
                image = image[None]
            try:
                converter.check_images(tuple(image.shape), image.dtype)
            except ValueError as error:
                raise ValueError(f"Image {index} of the list: {error}") from None
            if not self._converter_is_identity(image):
                image = np.asarray(converter(image))
            batches.append(np.asarray(image, dtype="float32"))
        return np.concatenate(batches)

    def _convert_images(self, x):
        """Applies the image converter to arrays, lists of raw images (any
        sizes) and `tf.data` datasets."""
        converter = self.image_converter
        if _is_image_list(x):
            return self._convert_image_list(x)
        if _is_tf_dataset(x):
            return x.map(lambda images, *rest: (converter.call(images), *rest))
        if not _is_array(x):
            return x  # generators, PyDatasets, dicts: passed through as is
        converter.check_images(tuple(x.shape), x.dtype)
        check_pixel_values(x, tuple(converter.float_range))
        if self._converter_is_identity(x):
            return x
        chunks = [
            np.asarray(converter(x[i:i + self._CONVERT_CHUNK]))
            for i in range(0, len(x), self._CONVERT_CHUNK)
        ]
        return np.concatenate(chunks) if chunks else x

    def _labels_are_sparse(self):
        loss = getattr(self, "loss", None)
        sparse = getattr(loss, "sparse", None)
        if sparse is not None:
            return bool(sparse)
        name = type(loss).__name__ if loss is not None else ""
        return "Sparse" in name or (isinstance(loss, str) and "sparse" in loss)

    def _check_labels(self, x, y, where):
        """Checks labels of arrays now, of `tf.data` datasets as they stream."""
        num_classes = getattr(self, "num_classes", None)
        sparse = self._labels_are_sparse()
        if y is not None and _is_array(y):
            check_class_ids(y, num_classes if sparse else None, where,
                            name="labels `y`")
            return x
        if y is None and _is_tf_dataset(x) and num_classes:
            import tensorflow as tf

            def check(images, labels, *rest):
                checks = []
                if labels.dtype.is_floating:
                    checks.append(tf.debugging.assert_all_finite(
                        labels, f"{where}: the labels contain NaN or inf values"))
                if sparse:
                    message = (f"{where}: labels must be integer class ids in "
                               f"[0, {num_classes - 1}] ({num_classes} classes)")
                    checks.append(tf.debugging.assert_non_negative(
                        labels, message=message))
                    checks.append(tf.debugging.assert_less(
                        tf.cast(labels, "float32"), float(num_classes),
                        message=message))
                with tf.control_dependencies(checks):
                    labels = tf.identity(labels)
                return (images, labels, *rest)

            return x.map(check)
        return x

    @state_guard.restore_on_error
    def fit(self, x=None, y=None, *args, validation_data=None, **kwargs):
        state_guard.check_not_empty("fit", (x,), {})
        x = self._check_labels(self._convert_images(x), y, "fit")
        if validation_data is not None:
            if isinstance(validation_data, tuple):
                vx, *rest = validation_data
                if rest:
                    num_classes = getattr(self, "num_classes", None)
                    check_class_ids(
                        rest[0], num_classes if self._labels_are_sparse() else None,
                        "fit(validation_data)", name="labels `y`")
                validation_data = (self._convert_images(vx), *rest)
            else:
                validation_data = self._check_labels(
                    self._convert_images(validation_data), None,
                    "fit(validation_data)")
        return super().fit(x, y, *args, validation_data=validation_data, **kwargs)

    @state_guard.restore_on_error
    def evaluate(self, x=None, y=None, *args, **kwargs):
        state_guard.check_not_empty("evaluate", (x,), {})
        x = self._check_labels(self._convert_images(x), y, "evaluate")
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
        if partial_group not in PARTIAL_GROUP_MODES:
            raise ValueError(
                f"`partial_group` must be one of {PARTIAL_GROUP_MODES}. "
                f"Received: partial_group={partial_group!r}")
        state_guard.check_not_empty("predict", (x,), {})
        x = self._convert_images(x)
        if not _is_array(x):
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

    @staticmethod
    def _build_head(backbone, num_classes, bias_init, dtype, activation=None):
        """The classification head `Dense(num_classes)` (zero kernel,
        constant bias), or None for `num_classes=None`."""
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

    def _task_images_input(self, backbone):
        if not isinstance(backbone, keras.Model):
            raise ValueError(
                f"`backbone` must be a keras.Model (a VisionTransformerBackbone). "
                f"Received: backbone={backbone!r}"
            )
        return keras.Input(shape=backbone.input_shape[1:], name="images")

    def _finish_task(self, backbone, compile):
        self.dtype_policy = backbone.dtype_policy
        # Reports the MoE auxiliary losses (already part of "loss") in the
        # `fit` logs as "auxiliary_loss".
        self._auxiliary_loss_tracker = keras.metrics.Mean(name="auxiliary_loss")
        if hasattr(backbone, "_register_routing_dependent"):
            backbone._register_routing_dependent(self)
        if compile:
            self.compile()

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

    def _serialize_image_converter(self):
        if not getattr(self, "_custom_image_converter", False):
            return None
        return keras.layers.serialize(self.image_converter)

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
        `image_converter`: `images` may be anything `predict` takes but a
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
        kwargs.setdefault("image_converter", self.image_converter)
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

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        layers = quantized_config.pop_quantized_layers(config)
        if isinstance(config.get("backbone"), dict):
            config["backbone"] = keras.layers.deserialize(config["backbone"])
        return quantized_config.quantize_layers(cls(**config), layers)
