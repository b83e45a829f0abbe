"""Closed-form few-shot linear probe on pre-logits (V-MoE paper, §3.4).

Axis letters: N training examples, D feature size, C classes.

The recipe of the V-MoE paper (following ViT): freeze the model, take the
pre-logits representation, standardise it with the training mean and
standard deviation (+1e-5), append a large constant feature (an almost
unregularised bias), and fit an L2-regularised least-squares map onto
one-hot targets rescaled to {-1, +1}; predict the arg-max. The solution
comes from one eigendecomposition of `XᵀX` (D ≤ N) or `XXᵀ` (N < D), so a
sweep over L2 strengths costs one decomposition.
"""

import numpy as np

from keras_vmoe.evaluation._batches import get_backbone
from keras_vmoe.evaluation._batches import iterate_batches
from keras_vmoe.evaluation.metrics import _check

SHOTS = (1, 5, 10, 25)
L2_REGS = tuple(2.0**i for i in range(-10, 20))
BIAS_FEATURE = 100.0
STD_EPSILON = 1e-5


def extract_features(model_or_backbone, images, labels=None, batch_size=32):
    """Pre-logit features of a backbone (the task's head is not used).

    Args:
        model_or_backbone: a keras_vmoe task or `VisionTransformerBackbone`.
        images: `(B, H, W, C)` array or an iterable of batches (see
            `routing_statistics`); a task's `image_converter` is applied.
        labels: `(B,)` labels for array `images` (passed through).
        batch_size: int, batch size for array inputs.

    Returns:
        `(features (B, R), labels (B,) or None)`. For E³ the features are
        the mean of the N member representations.
    """
    from keras_vmoe.evaluation.routing_stats import convert_images

    backbone = get_backbone(model_or_backbone)
    features, batch_labels = [], []
    for x, y in iterate_batches(images, labels, batch_size):
        x = convert_images(model_or_backbone, x)
        out = np.asarray(backbone.predict_on_batch(x), dtype="float64")
        members = backbone.ensemble_size
        features.append(out.reshape(x.shape[0], members, -1).mean(axis=1))
        batch_labels.append(y)
    if not features:
        raise ValueError("`images` is empty: there are no features to extract.")
    has_labels = all(y is not None for y in batch_labels)
    return np.concatenate(features), np.concatenate(batch_labels) if has_labels else None


class LinearProbe:
    """L2-regularised least squares onto {-1, +1} one-hot targets.

    Args:
        features: `(N, D)` training features.
        labels: `(N,)` integer class ids.
        num_classes: int C (default: the largest label + 1).

    Examples:

    ```python
    import numpy as np
    from keras_vmoe.evaluation import LinearProbe

    rng = np.random.default_rng(0)
    train_labels, test_labels = np.arange(50) % 10, np.arange(20) % 10
    centres = rng.normal(size=(10, 64))            # pre-logits of 10 classes
    train_features = centres[train_labels] + rng.normal(size=(50, 64))
    test_features = centres[test_labels] + rng.normal(size=(20, 64))
    probe = LinearProbe(train_features, train_labels, num_classes=10)
    accuracy = probe.accuracy(test_features, test_labels, l2=2.0**-4)
    ```
    """

    def __init__(self, features, labels, num_classes=None):
        features = np.asarray(features, dtype="float64")
        if features.ndim != 2 or features.shape[0] == 0:
            raise ValueError(
                f"`features` must be a non-empty (examples, dims) array. Received "
                f"shape {features.shape}."
            )
        labels = np.asarray(labels).reshape(-1)
        if num_classes is None:
            num_classes = int(labels.max()) + 1 if labels.size else 0
        _, labels = _check(np.zeros((features.shape[0], num_classes)), labels, "features")
        self.num_classes = num_classes
        self.mean = features.mean(axis=0, keepdims=True)
        self.std = features.std(axis=0, keepdims=True) + STD_EPSILON
        x = self._design(features)  # (N, D + 1)
        y = 2.0 * np.eye(num_classes)[labels] - 1.0  # (N, C)
        self._primal = x.shape[0] >= x.shape[1]
        gram = x.T @ x if self._primal else x @ x.T  # (D+1, D+1) or (N, N)
        self._eigenvalues, self._eigenvectors = np.linalg.eigh(gram)
        if self._primal:
            self._projected = self._eigenvectors.T @ (x.T @ y)  # (D+1, C)
        else:
            self._projected = self._eigenvectors.T @ y  # (N, C)
            self._x = x

    def _design(self, features):
        x = (np.asarray(features, dtype="float64") - self.mean) / self.std
        return np.concatenate([x, np.full((x.shape[0], 1), BIAS_FEATURE)], axis=1)

    def weights(self, l2):
        """`(D + 1, C)` weights (last row: bias feature) for L2 strength `l2`.

        `(XᵀX + l2·I)⁻¹XᵀY`, or the equal `Xᵀ(XXᵀ + l2·I)⁻¹Y` when N < D.
        """
        if not l2 > 0:
            raise ValueError(f"`l2` must be > 0. Received: l2={l2!r}")
        scaled = self._projected / (self._eigenvalues + l2)[:, None]
        weights = self._eigenvectors @ scaled
        return weights if self._primal else self._x.T @ weights

    def predict(self, features, l2):
        """Predicted class ids `(B,)`."""
        return (self._design(features) @ self.weights(l2)).argmax(axis=-1)

    def accuracy(self, features, labels, l2):
        """Top-1 accuracy on `(features, labels)`."""
        labels = np.asarray(labels).reshape(-1)
        return float(np.mean(self.predict(features, l2) == labels))


def sample_shots(labels, shots, seed=0):
    """Indices of `shots` random examples of every class (sorted).

    Raises a `ValueError` naming the class when one has fewer examples.
    """
    labels = np.asarray(labels).reshape(-1)
    rng = np.random.default_rng(seed)
    indices = []
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        if members.size < shots:
            raise ValueError(
                f"{shots}-shot needs {shots} training examples of every class; "
                f"class {label} has {members.size}."
            )
        indices.append(rng.choice(members, shots, replace=False))
    return np.sort(np.concatenate(indices))


def few_shot_evaluation(train_features, train_labels, test_features, test_labels,
                        shots=SHOTS, l2_regs=L2_REGS, num_classes=None, seed=0):
    """Few-shot linear-probe accuracy for several shot counts.

    For each `k` in `shots`, `k` examples of every class are drawn from the
    training features (seeded), a `LinearProbe` is fitted and evaluated on
    the test features for every L2 strength in `l2_regs`.

    Args:
        train_features, train_labels: pool to draw the shots from.
        test_features, test_labels: evaluation set.
        shots: shot counts (default 1, 5, 10, 25). Counts a class cannot
            provide are skipped and listed under `skipped`.
        l2_regs: L2 strengths (default upstream's sweep 2^-10 … 2^19).
            With several values, `accuracy` is the best of them on the test
            set, as upstream's sweep reports it (then pick one L2 per shot
            across datasets); pass one value for an unbiased number.
        num_classes: int C (default: from the labels).
        seed: int, shot sampling seed.

    Returns:
        `{"<k>shot": {"accuracy", "l2", "accuracy_by_l2"}, ...,
        "skipped": [k, ...]}`.
    """
    l2_regs = [float(v) for v in np.atleast_1d(l2_regs)]
    if not l2_regs or not all(v > 0 for v in l2_regs):
        raise ValueError(f"`l2_regs` must be numbers > 0. Received: l2_regs={l2_regs}")
    train_labels = np.asarray(train_labels).reshape(-1)
    test_labels = np.asarray(test_labels).reshape(-1)
    if num_classes is None:
        num_classes = int(max(train_labels.max(), test_labels.max())) + 1
    _check(np.zeros((test_labels.size, num_classes)), test_labels, "test_features")
    results = {"skipped": []}
    for k in shots:
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"`shots` must be integers >= 1. Received: shots={shots!r}")
        try:
            index = sample_shots(train_labels, int(k), seed=seed)
        except ValueError:
            results["skipped"].append(int(k))
            continue
        probe = LinearProbe(np.asarray(train_features)[index], train_labels[index], num_classes)
        by_l2 = {repr(l2): probe.accuracy(test_features, test_labels, l2) for l2 in l2_regs}
        best = max(l2_regs, key=lambda l2: by_l2[repr(l2)])
        results[f"{int(k)}shot"] = {
            "accuracy": by_l2[repr(best)],
            "l2": best,
            "accuracy_by_l2": by_l2,
        }
    return results
