"""`ImageClassifier`: a linear head on a `VisionTransformerBackbone`."""

import keras

from keras_vmoe.models.task import Task
from keras_vmoe.models.task import classification_head
from keras_vmoe.models.task import images_input
from keras_vmoe.models.task import is_logits
from keras_vmoe.models.task import serialize_activation
from keras_vmoe.models.task import serialize_dtype
from keras_vmoe.utils.initialization import batched_build


@keras.saving.register_keras_serializable(package="keras_vmoe")
class ImageClassifier(Task):
    """Image classification task: backbone representation -> `head` Dense.

    The head has a zero kernel and a constant bias `head_bias_init`, as
    upstream. `predict(x)` returns class scores `(B, num_classes)` whose
    softmax is the predicted distribution; `predict_probabilities(x)` the
    probabilities. `x` may be an array, a list of raw images or a dataset.

    Args:
        backbone: a `VisionTransformerBackbone` with `ensemble_size=1`.
        num_classes: int, or `None` for no head.
        head_bias_init: float, initial value of the head bias.
        activation: `None` (logits) or an activation such as `"softmax"`.
        head_dtype: dtype policy of the head (default: the backbone's).
        preprocessor: `None` (a default `ImageClassifierPreprocessor`) or
            an `ImageClassifierPreprocessor`, applied by `fit`, `evaluate`
            and `predict` (not by `model(x)`, which takes [-1, 1] floats).
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
    logits = model.predict(images, verbose=0)  # (8, 10)
    probs = model.predict_probabilities(  # raw uint8 photos, any sizes
        [np.zeros((40, 60, 3), "uint8"), np.zeros((20, 20, 3), "uint8")], verbose=0)
    ```
    """

    @batched_build  # on JAX, the head's random weights drawn in one XLA program
    def __init__(
        self,
        backbone,
        num_classes=None,
        head_bias_init=0.0,
        activation=None,
        head_dtype=None,
        preprocessor=None,
        compile=True,
        **kwargs,
    ):
        if getattr(backbone, "ensemble_size", 1) > 1:
            raise ValueError(
                "This backbone is an E³ ensemble (ensemble_size="
                f"{backbone.ensemble_size}); its outputs have one row per "
                "(image, member). Use `EnsembleImageClassifier` instead."
            )
        head = classification_head(backbone, num_classes, head_bias_init, head_dtype,
                                   activation=activation)
        self.num_classes = num_classes
        self.head_bias_init = head_bias_init
        self.activation = activation
        self.head_dtype = head_dtype
        images = images_input(backbone)
        x = backbone(images)  # (B, R)
        outputs = head(x) if head is not None else x  # (B, C)
        super().__init__(backbone, preprocessor, inputs=images, outputs=outputs,
                         compile=compile, **kwargs)

    def compile(self, optimizer="auto", loss="auto", *, metrics="auto", **kwargs):
        """Configures training; `"auto"` picks `Adam(5e-5)`,
        `SparseCategoricalCrossentropy` and `SparseCategoricalAccuracy`
        (`None` without a head)."""
        if optimizer == "auto":
            optimizer = keras.optimizers.Adam(5e-5)
        if loss == "auto":
            loss = None
            if self.num_classes:
                loss = keras.losses.SparseCategoricalCrossentropy(
                    from_logits=is_logits(self.activation))
        if metrics == "auto":
            metrics = None
            if self.num_classes:
                metrics = [keras.metrics.SparseCategoricalAccuracy(name="accuracy")]
        super().compile(optimizer=optimizer, loss=loss, metrics=metrics, **kwargs)

    def get_config(self):
        config = super().get_config()
        config.update({
            "num_classes": self.num_classes,
            "head_bias_init": self.head_bias_init,
            "activation": serialize_activation(self.activation),
            "head_dtype": serialize_dtype(self.head_dtype),
        })
        return config
