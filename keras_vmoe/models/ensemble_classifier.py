"""E³ efficient ensembles: per-member logits, mean-probability prediction.

Axis letters: B images, N ensemble members, C classes. The ensemble prediction
is the mean of the members' softmax probabilities (logits are not averaged);
the training loss is the mean of the per-member cross-entropies.
"""

import math

import keras
import numpy as np
from keras import ops

from keras_vmoe.models.task import Task
from keras_vmoe.models.task import classification_head
from keras_vmoe.models.task import images_input
from keras_vmoe.models.task import serialize_dtype
from keras_vmoe.utils.initialization import batched_build


def ensemble_log_probabilities(logits):
    """`(B, N, C)` member logits -> `(B, C)` log of the mean probabilities."""
    num_members = ops.shape(logits)[1]
    log_probs = ops.log_softmax(ops.cast(logits, "float32"), axis=-1)
    return ops.logsumexp(log_probs, axis=1) - math.log(num_members)


def ensemble_probabilities(logits):
    """`(B, N, C)` member logits -> `(B, C)` mean of the members' softmax."""
    return ops.mean(ops.softmax(ops.cast(logits, "float32"), axis=-1), axis=1)


def _member_log_probabilities(y_pred, from_logits):
    y_pred = ops.cast(y_pred, "float32")
    if from_logits:
        return ops.log_softmax(y_pred, axis=-1)
    return ops.log(ops.clip(y_pred, 1e-7, 1.0))


def _labels_to_dense(y_true, num_classes, sparse):
    if sparse:
        labels = ops.cast(ops.reshape(y_true, (-1,)), "int32")
        return ops.one_hot(labels, num_classes, dtype="float32")  # (B, C)
    return ops.cast(y_true, "float32")


@keras.saving.register_keras_serializable(package="keras_vmoe")
class EnsembleCrossentropy(keras.losses.Loss):
    """Mean over ensemble members of the per-member cross-entropy.

    `y_pred` is `(B, N, C)`; `y_true` one label per image (class ids, or
    `(B, C)` one-hot / soft labels with `sparse=False`).

    Args:
        from_logits: bool, `y_pred` are logits.
        sparse: bool, integer labels.
        label_smoothing: float in [0, 1): the targets are
            `(1 - label_smoothing) * labels + label_smoothing / C`.
        **kwargs: `keras.losses.Loss` arguments.
    """

    def __init__(
        self, from_logits=True, sparse=True, label_smoothing=0.0,
        name="ensemble_crossentropy", **kwargs
    ):
        super().__init__(name=name, **kwargs)
        self.from_logits = from_logits
        self.sparse = sparse
        self.label_smoothing = float(label_smoothing)

    def call(self, y_true, y_pred):
        log_probs = _member_log_probabilities(y_pred, self.from_logits)  # (B, N, C)
        num_classes = ops.shape(y_pred)[-1]
        targets = _labels_to_dense(y_true, num_classes, self.sparse)  # (B, C)
        if self.label_smoothing:
            targets = (targets * (1.0 - self.label_smoothing)
                       + self.label_smoothing / num_classes)
        member_losses = -ops.sum(targets[:, None, :] * log_probs, axis=-1)  # (B, N)
        return ops.mean(member_losses, axis=-1)  # (B,)

    def get_config(self):
        config = super().get_config()
        config.update({"from_logits": self.from_logits, "sparse": self.sparse,
                       "label_smoothing": self.label_smoothing})
        return config


def ensemble_accuracy(y_true, y_pred, sparse=True):
    """Accuracy of the mean-probability prediction. `(B, N, C)` -> `(B,)`."""
    predicted = ops.argmax(ensemble_probabilities(y_pred), axis=-1)
    labels = ops.reshape(y_true, (-1,)) if sparse else ops.argmax(y_true, axis=-1)
    return ops.cast(
        ops.equal(ops.cast(labels, "int32"), ops.cast(predicted, "int32")), "float32"
    )


@keras.saving.register_keras_serializable(package="keras_vmoe")
class EnsembleAccuracy(keras.metrics.MeanMetricWrapper):
    """Accuracy of the E³ ensemble prediction (mean of member softmax).

    Args:
        sparse: bool, integer labels (else one-hot).
        name: metric name.
        dtype: metric dtype.
    """

    def __init__(self, sparse=True, name="accuracy", dtype=None):
        super().__init__(ensemble_accuracy, name=name, dtype=dtype, sparse=sparse)
        self.sparse = sparse

    def get_config(self):
        return {"name": self.name, "dtype": self.dtype, "sparse": self.sparse}


@keras.saving.register_keras_serializable(package="keras_vmoe")
class EnsembleImageClassifier(Task):
    """E³ classifier: one shared head, one prediction per ensemble member.

    The graph (`model(x)`, what `fit` trains) outputs the member logits
    `(B, N, C)` (`(B, N, R)` without a head). `predict(x)` returns the log
    of the members' mean probabilities `(B, C)`, `predict_probabilities(x)`
    the mean, `predict_members(x)` the member logits.

    Args:
        backbone: a `VisionTransformerBackbone` (N = its `ensemble_size`).
        num_classes: int, or `None` for no head.
        head_bias_init: float, initial value of the head bias.
        head_dtype: dtype policy of the head (default: the backbone's).
        preprocessor: `None` or an `ImageClassifierPreprocessor`.
        compile: bool, compile with `compile()`'s defaults.
        **kwargs: `keras.Model` arguments.

    Examples:

    ```python
    import numpy as np
    import keras_vmoe

    # E³ S/32 (2 members), shrunk to run in seconds (drop the size overrides).
    config = keras_vmoe.models.backbone_config(
        "eee", "S/32", image_size=32, patch_size=16, hidden_dim=32,
        num_heads=2, mlp_dim=64, num_layers=2, layout="every2", num_experts=4)
    model = keras_vmoe.models.EnsembleImageClassifier(
        keras_vmoe.models.VisionTransformerBackbone(**config), num_classes=10)
    images = np.random.uniform(-1, 1, (4, 32, 32, 3)).astype("float32")
    labels = np.arange(4)
    model.fit(images, labels, verbose=0)         # mean member cross-entropy
    scores = model.predict(images, verbose=0)                # (4, 10)
    probs = model.predict_probabilities(images, verbose=0)  # (4, 10)
    members = model.predict_members(images, verbose=0)      # (4, 2, 10)
    ```
    """

    @batched_build  # on JAX, the head's random weights drawn in one XLA program
    def __init__(
        self,
        backbone,
        num_classes=None,
        head_bias_init=0.0,
        head_dtype=None,
        preprocessor=None,
        compile=True,
        **kwargs,
    ):
        num_members = getattr(backbone, "ensemble_size", 1)
        head = classification_head(backbone, num_classes, head_bias_init, head_dtype)
        self.num_classes = num_classes
        self.head_bias_init = head_bias_init
        self.head_dtype = head_dtype
        self.ensemble_size = num_members
        images = images_input(backbone)
        x = backbone(images)  # (B·N, R)
        if head is not None:
            x = head(x)  # (B·N, C)
        outputs = ops.reshape(x, (-1, num_members, x.shape[-1]))  # (B, N, C)
        super().__init__(backbone, preprocessor, inputs=images, outputs=outputs,
                         compile=compile, **kwargs)

    def compile(self, optimizer="auto", loss="auto", *, metrics="auto", **kwargs):
        """Configures training; `"auto"` picks `Adam(5e-5)`,
        `EnsembleCrossentropy(from_logits=True)` and `EnsembleAccuracy`."""
        if optimizer == "auto":
            optimizer = keras.optimizers.Adam(5e-5)
        if loss == "auto":
            loss = EnsembleCrossentropy(from_logits=True) if self.num_classes else None
        if metrics == "auto":
            metrics = [EnsembleAccuracy()] if self.num_classes else None
        super().compile(optimizer=optimizer, loss=loss, metrics=metrics, **kwargs)

    def predict_members(self, x, *args, **kwargs):
        """Member logits `(B, N, C)` (`(B, N, R)` without a head).

        Args:
            x: images (anything `predict` accepts).
            *args: `predict` arguments.
            **kwargs: `predict` arguments.
        """
        return super().predict(x, *args, **kwargs)

    def predict(self, x, *args, **kwargs):
        """Ensemble class scores `(B, C)`: log of the members' mean softmax
        (without a head: the member representations `(B, N, R)`).

        Args:
            x: images (array, list of raw images or dataset).
            *args: `keras.Model.predict` arguments.
            **kwargs: `keras.Model.predict` arguments.
        """
        outputs = self.predict_members(x, *args, **kwargs)
        if not self.num_classes:
            return outputs
        return np.asarray(ensemble_log_probabilities(outputs), dtype="float32")

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                     training=True):
        """Training: the compiled loss; evaluation with `EnsembleCrossentropy`:
        upstream's NLL of the mean prediction, `-log p̄[y]`."""
        if training or not isinstance(getattr(self, "loss", None), EnsembleCrossentropy):
            return super().compute_loss(x=x, y=y, y_pred=y_pred,
                                        sample_weight=sample_weight, training=training)
        loss = self.loss
        log_p = (ensemble_log_probabilities(y_pred) if loss.from_logits else
                 ops.log(ops.clip(ops.mean(ops.cast(y_pred, "float32"), axis=1),
                                  1e-7, 1.0)))  # (B, C)
        targets = _labels_to_dense(y, ops.shape(y_pred)[-1], loss.sparse)
        nll = -ops.sum(targets * log_p, axis=-1)  # (B,)
        if sample_weight is not None:
            nll = nll * ops.reshape(ops.cast(sample_weight, "float32"), (-1,))
        return ops.mean(nll)

    def predict_probabilities(self, x, log=False, **kwargs):
        """Ensemble prediction: mean of the members' softmax probabilities.

        Args:
            x: images (anything `predict` accepts).
            log: bool, return `log p̄` (computed stably).
            **kwargs: `predict` arguments.

        Returns:
            numpy array `(B, C)`.
        """
        if not self.num_classes:
            raise ValueError("This model has no head (num_classes=None).")
        logits = np.asarray(self.predict_members(x, **kwargs), dtype="float64")
        if log:
            return np.asarray(ensemble_log_probabilities(logits))
        return np.asarray(ensemble_probabilities(logits))

    def get_config(self):
        config = super().get_config()
        config.update({
            "num_classes": self.num_classes,
            "head_bias_init": self.head_bias_init,
            "head_dtype": serialize_dtype(self.head_dtype),
        })
        return config
