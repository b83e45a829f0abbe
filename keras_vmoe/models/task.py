"""`Task`: the base class of keras_vmoe tasks (a head on a backbone).

The base carries what every task shares: presets, LoRA and int8 quantization
(`ModelBase`), export, routing control delegated to the backbone, and the input
path of `fit`/`evaluate`/`predict` (preprocessing, label checks, padding of a
partial last routing group, the MoE auxiliary loss in the logs).
"""

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
from keras_vmoe.utils.validation import check_model_kwargs
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


PARTIAL_GROUP_MODES = ("zero_images", "mask")
OPTIMIZER_BUILT_KEY = "optimizer_built"


def predict_bucket(num_images, batch_size, group=1):
    """The batch shape `predict` pads a partial last batch of `num_images` to on
    JAX: the next power of two, rounded up to a multiple of the routing `group`,
    at most `batch_size`.

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
    """The `keras.Input` named `"images"` of `backbone`'s input shape."""
    if not isinstance(backbone, keras.Model):
        raise ValueError(
            f"`backbone` must be a keras.Model (a VisionTransformerBackbone). "
            f"Received: backbone={backbone!r}"
        )
    return keras.Input(shape=backbone.input_shape[1:], name="images")


def classification_head(backbone, num_classes, bias_init=0.0, dtype=None,
                        activation=None):
    """The `Dense(num_classes)` head named `"head"` (zero kernel, constant
    bias `bias_init`, dtype default the backbone's), or `None` for no classes.
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

    A subclass builds its functional graph in `__init__` (input from
    `images_input(backbone)`), then calls `super().__init__(backbone,
    preprocessor, inputs=..., outputs=..., compile=compile, **kwargs)` and
    adds its arguments to `get_config`; docs/development.md builds one.

    Args:
        backbone: a `keras_vmoe.models.Backbone`.
        preprocessor: an `ImageClassifierPreprocessor` (resized to the
            backbone's input size), or `None` for a default one.
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
        check_model_kwargs(type(self), kwargs)
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
        # The MoE auxiliary losses (already in "loss") in the `fit` logs.
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
        """Exports the model for serving (`keras_vmoe.deploy.export_model`):
        `format` `"tf_saved_model"` or `"onnx"` (needs `batch_size`). An
        `input_signature` or another format goes to Keras' `Model.export`.
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
        # No auxiliary losses in evaluation: leave "auxiliary_loss" out.
        self._evaluating = True
        try:
            return super().evaluate(x, y, *args, **kwargs)
        finally:
            self._evaluating = False

    @state_guard.restore_on_error
    def predict(self, x, *args, partial_group="zero_images", **kwargs):
        """Keras `predict`, with upstream's padding of a partial last group.

        On JAX, a partial last batch is padded with zero images to a bucket
        (`predict_bucket`) where that changes no real image's output, so few
        batch shapes are compiled.

        Args:
            x: images (see the class docstring).
            *args: `keras.Model.predict` arguments.
            partial_group: how an array batch that does not fill its last
                routing group is routed: `"zero_images"` (default, padded
                with zero images that take capacity, then dropped) or
                `"mask"` (pad tokens masked). Datasets are not padded.
            **kwargs: `keras.Model.predict` arguments.
        """
        check_one_of(partial_group, "partial_group", PARTIAL_GROUP_MODES)
        state_guard.check_data_arguments("predict", (x, *args), kwargs)
        x = self.preprocessor.convert(x)
        if not is_array(x):
            return state_guard.predict_whole_batches(super().predict, (x, *args), kwargs)
        kwargs.update(zip(("batch_size", "verbose", "steps", "callbacks"), args,
                          strict=False))
        backbone = getattr(self, "backbone", None)
        layers = backbone.get_moe_layers() if hasattr(backbone, "get_moe_layers") else []
        # `images_per_group` of every MoE layer at inference (None: routed jointly).
        counts = [layer.routing_phase(False).images_per_group for layer in layers]
        images_per_group = math.lcm(*(int(c) for c in counts if c))
        group = images_per_group if partial_group == "zero_images" else 1
        # Images whose outputs depend only on each other (None: a layer routes
        # a whole batch jointly, where padding would change the real images).
        independent = images_per_group if all(counts) else None
        bucketed = (keras.backend.backend() == "jax" and kwargs.get("steps") is None
                    and independent is not None
                    and (partial_group == "zero_images" or independent == 1))
        if group == 1 and not bucketed:
            return state_guard.predict_whole_batches(super().predict, (x,), kwargs)
        # Under a distribution the padded batch must split evenly over devices.
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
            x: images (anything `predict` accepts).
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
        """`VisionTransformerBackbone.extract_features` after this task's
        image converter.

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
        # Keras records the resolved `jit_compile`; a file saved on JAX would
        # then run `torch.compile` on PyTorch. The config keeps what was asked.
        super().compile(*args, jit_compile=jit_compile, **kwargs)
        self._requested_jit_compile = jit_compile

    def get_compile_config(self):
        config = super().get_compile_config()
        if config is None:
            return None
        requested = getattr(self, "_requested_jit_compile", None)
        if requested is not None:
            config["jit_compile"] = requested
        # Whether the saved optimizer holds its slots.
        config[OPTIMIZER_BUILT_KEY] = bool(getattr(self.optimizer, "built", False))
        return config

    def compile_from_config(self, config):
        # The optimizer is built (for the saved slots) only when the saved one
        # was: otherwise Keras skips loading the step count, with a warning.
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
