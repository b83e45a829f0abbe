"""`ImageClassifier`: a linear head on a `VisionTransformerBackbone`."""

import keras

from keras_vmoe.models.state_guard import RestoreStateOnErrorMixin
from keras_vmoe.models.vit_backbone import VisionTransformerBackbone


def _serialize_activation(activation):
    if activation is None or isinstance(activation, str):
        return activation
    return keras.activations.serialize(activation)


def _serialize_dtype(dtype):
    if dtype is None or isinstance(dtype, str):
        return dtype
    return keras.dtype_policies.serialize(dtype)


def _is_logits(activation):
    if activation is None:
        return True
    return keras.activations.get(activation) is keras.activations.linear


class _TaskMixin(RestoreStateOnErrorMixin):
    """Shared task plumbing: backbone (de)serialization and routing."""

    backbone_cls = VisionTransformerBackbone

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
        if tracker is not None and getattr(self, "compiled", False) and tracker not in metrics:
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

    def compile_from_config(self, config):
        # `compile()` is overridden (for its "auto" defaults), so Keras
        # needs this to restore the saved compile arguments on load.
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if getattr(self, "optimizer", None) is not None and self.built:
            self.optimizer.build(self.trainable_variables)

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        if isinstance(config.get("backbone"), dict):
            config["backbone"] = keras.layers.deserialize(config["backbone"])
        return cls(**config)


@keras.saving.register_keras_serializable(package="keras_vmoe")
class ImageClassifier(_TaskMixin, keras.Model):
    """Image classification task: backbone representation -> `head` Dense.

    The head (layer `head`) has a zero-initialised kernel and a constant
    bias `head_bias_init`, as upstream (use `-log(num_classes)` or `-10` as
    in the papers' configs). With `num_classes=None` there is no head and
    the model outputs the backbone representation (e.g. for few-shot
    probes). The model is compiled with default settings on construction,
    so `fit` works right away; the MoE auxiliary losses are added to the
    task loss in training.

    Args:
        backbone: a `VisionTransformerBackbone` (not an E³ one; use
            `EnsembleImageClassifier` when `ensemble_size > 1`).
        num_classes: int, or `None` for no head.
        head_bias_init: float, initial value of the head bias.
        activation: `None` (logits) or an activation such as `"softmax"`.
        head_dtype: dtype policy of the head (default: the backbone's).
        compile: bool, compile with `compile()`'s defaults.
        **kwargs: `keras.Model` arguments (`name`, `trainable`).

    Examples:

    ```python
    import numpy as np
    import keras_vmoe

    # V-MoE S/32 Last-2, shrunk to run in seconds (drop the size overrides).
    backbone = keras_vmoe.models.VisionTransformerBackbone(
        **keras_vmoe.models.backbone_config(
            "vmoe", "S/32", layout="every2", image_size=32, patch_size=16,
            hidden_dim=32, num_heads=2, mlp_dim=64, num_layers=2, num_experts=4))
    model = keras_vmoe.models.ImageClassifier(backbone, num_classes=10)
    images = np.random.uniform(-1, 1, (8, 32, 32, 3)).astype("float32")
    labels = np.arange(8) % 10
    model.fit(images, labels, batch_size=8, verbose=0)
    model.set_routing(capacity_factor=4.0)  # more capacity at test time
    ```
    """

    def __init__(
        self,
        backbone,
        num_classes=None,
        head_bias_init=0.0,
        activation=None,
        head_dtype=None,
        compile=True,
        **kwargs,
    ):
        if getattr(backbone, "ensemble_size", 1) > 1:
            raise ValueError(
                "This backbone is an E³ ensemble (ensemble_size="
                f"{backbone.ensemble_size}); its outputs have one row per "
                "(image, member). Use `EnsembleImageClassifier` instead."
            )
        if num_classes is not None and (
            not isinstance(num_classes, int)
            or isinstance(num_classes, bool)
            or num_classes < 1
        ):
            raise ValueError(
                f"`num_classes` must be None or an integer >= 1. Received: "
                f"num_classes={num_classes!r}"
            )
        # === Layers ===
        head = None
        if num_classes:
            head = keras.layers.Dense(
                num_classes,
                activation=activation,
                kernel_initializer="zeros",
                bias_initializer=keras.initializers.Constant(head_bias_init),
                name="head",
                dtype=head_dtype or backbone.dtype_policy,
            )

        # === Functional Model ===
        images = self._task_images_input(backbone)
        x = backbone(images)  # (B, R)
        outputs = head(x) if head is not None else x  # (B, C)
        super().__init__(inputs=images, outputs=outputs, **kwargs)

        # === Config ===
        self.backbone = backbone
        self.num_classes = num_classes
        self.head_bias_init = head_bias_init
        self.activation = activation
        self.head_dtype = head_dtype
        self._finish_task(backbone, compile)

    def compile(self, optimizer="auto", loss="auto", *, metrics="auto", **kwargs):
        """Configures training; `"auto"` picks the defaults.

        Defaults: `Adam(5e-5)` (a fine-tuning learning rate, as KerasHub),
        `SparseCategoricalCrossentropy(from_logits=...)` matching
        `activation`, and `SparseCategoricalAccuracy`. Without a head the
        default loss and metrics are `None`.
        """
        if optimizer == "auto":
            optimizer = keras.optimizers.Adam(5e-5)
        if loss == "auto":
            loss = (
                keras.losses.SparseCategoricalCrossentropy(
                    from_logits=_is_logits(self.activation)
                )
                if self.num_classes
                else None
            )
        if metrics == "auto":
            metrics = (
                [keras.metrics.SparseCategoricalAccuracy(name="accuracy")]
                if self.num_classes
                else None
            )
        super().compile(optimizer=optimizer, loss=loss, metrics=metrics, **kwargs)

    def get_config(self):
        return {
            "name": self.name,
            "trainable": self.trainable,
            "backbone": keras.layers.serialize(self.backbone),
            "num_classes": self.num_classes,
            "head_bias_init": self.head_bias_init,
            "activation": _serialize_activation(self.activation),
            "head_dtype": _serialize_dtype(self.head_dtype),
        }
