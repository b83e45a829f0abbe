"""Closed-form few-shot linear probe on pre-logits, as upstream's
`vmoe/evaluate/fewshot.py` (N training examples, D features, C classes).
"""

import numpy as np

from keras_vmoe.evaluation._batches import get_backbone
from keras_vmoe.evaluation._batches import iterate_batches
from keras_vmoe.evaluation.metrics import _check
from keras_vmoe.evaluation.routing_stats import convert_images
from keras_vmoe.utils.validation import check_int
from keras_vmoe.utils.validation import check_one_of

SHOTS = (1, 5, 10, 25)
L2_REGS = tuple(2.0**i for i in range(-10, 20))
BIAS_FEATURE = 100.0
STD_EPSILON = 1e-5


def pooled_features(model_or_backbone, images, labels=None, batch_size=32):
    """Pre-logit features of a backbone (the task's head is not used).

    Args:
        model_or_backbone: a keras_vmoe task or `VisionTransformerBackbone`.
        images: `(B, H, W, C)` array or an iterable of batches; a task's
            preprocessor is applied.
        labels: `(B,)` labels for array `images` (passed through).
        batch_size: int, batch size for array inputs.

    Returns:
        `(features (B, R), labels (B,) or None)`; for E³ the N member
        features concatenated, `(B, N·R)`.
    """
    backbone = get_backbone(model_or_backbone)
    features, batch_labels = [], []
    for x, y in iterate_batches(images, labels, batch_size):
        x = convert_images(model_or_backbone, x)
        out = np.asarray(backbone.predict_on_batch(x), dtype="float64")
        # Rows are image-major (b·N + m): one row of N·R per image.
        features.append(out.reshape(x.shape[0], -1))
        batch_labels.append(y)
    if not features:
        raise ValueError("`images` is empty: there are no features to extract.")
    has_labels = all(y is not None for y in batch_labels)
    return np.concatenate(features), np.concatenate(batch_labels) if has_labels else None


class LinearProbe:
    """L2-regularised least squares onto {-1, +1} one-hot targets.

    Features are standardised with the training statistics and get a
    constant bias feature; one eigendecomposition serves every L2.

    Args:
        features: `(N, D)` training features.
        labels: `(N,)` integer class ids.
        num_classes: int C (default: the largest label + 1).
        dtype: `"float32"` (upstream) or `"float64"`.

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

    def __init__(self, features, labels, num_classes=None, dtype="float32"):
        self.dtype = np.dtype(check_one_of(str(dtype), "dtype", ("float32", "float64")))
        features = np.asarray(features, dtype=self.dtype)
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
        self.std = features.std(axis=0, keepdims=True) + self.dtype.type(STD_EPSILON)
        x = self._design(features)  # (N, D + 1)
        y = (2.0 * np.eye(num_classes, dtype=self.dtype)[labels] - 1.0).astype(
            self.dtype)  # (N, C)
        # Weights = lhs · diag(1 / (eigenvalues + l2)) · rhs, with Q the
        # eigenvectors of XᵀX (N ≥ D + 1) or of XXᵀ (N < D + 1).
        if x.shape[0] >= x.shape[1]:
            self._eigenvalues, q = np.linalg.eigh(x.T @ x)  # (D+1,), (D+1, D+1)
            self._rhs = q.T @ (x.T @ y)  # (D+1, C)
            self._lhs = q
        else:
            self._eigenvalues, q = np.linalg.eigh(x @ x.T)  # (N,), (N, N)
            self._rhs = q.T @ y  # (N, C)
            self._lhs = x.T @ q  # (D+1, N)

    def _design(self, features):
        x = (np.asarray(features, dtype=self.dtype) - self.mean) / self.std
        bias = np.full((x.shape[0], 1), BIAS_FEATURE, dtype=self.dtype)
        return np.concatenate([x, bias], axis=1)

    def weights(self, l2):
        """`(D + 1, C)` weights (last row: bias) for L2 strength `l2`."""
        if not l2 > 0:
            raise ValueError(f"`l2` must be > 0. Received: l2={l2!r}")
        scaling = (1.0 / (self._eigenvalues + self.dtype.type(l2))).astype(self.dtype)
        return (self._lhs * scaling[None, :]) @ self._rhs

    def predict(self, features, l2):
        """Predicted class ids `(B,)`."""
        return (self._design(features) @ self.weights(l2)).argmax(axis=-1)

    def accuracy(self, features, labels, l2):
        """Top-1 accuracy on `(features, labels)`."""
        labels = np.asarray(labels).reshape(-1)
        return float(np.mean(self.predict(features, l2) == labels))


def sample_shots(labels, shots, seed=0, num_classes=None, sub_seed=0):
    """Indices of the first `shots` examples of every class in a seeded order.

    Upstream's draw: one permutation per class from
    `default_rng(hash((seed, sub_seed)) % 2**31)`, so shot sets are nested.
    `shots` is an int k (returns `(C·k,)` indices) or a sequence (a dict).
    """
    labels = np.asarray(labels).reshape(-1)
    if num_classes is None:
        num_classes = int(labels.max()) + 1 if labels.size else 0
    seed = check_int(seed, "seed", minimum=None)
    sub_seed = check_int(sub_seed, "sub_seed", minimum=None)
    # Python's hash of a tuple of ints is deterministic (no hash salt).
    rng = np.random.default_rng(hash((seed, sub_seed)) % 2**31)
    orders = [rng.permutation(np.flatnonzero(labels == c)) for c in range(num_classes)]
    several = not isinstance(shots, (int, np.integer))
    result = {}
    for k in (shots if several else [shots]):
        for label, order in enumerate(orders):
            if order.size and order.size < k:
                raise ValueError(f"{k}-shot needs {k} training examples of every "
                                 f"class; class {label} has {order.size}.")
        result[int(k)] = np.concatenate([order[:k] for order in orders])
    return result if several else result[int(shots)]


def best_l2_by_rank(accuracy_by_l2):
    """The L2 upstream's `_find_best_l2_reg` picks from `{l2: accuracy}` dicts.

    Best mean `argsort(argsort(...))` rank (numpy's unstable sort) over
    the dicts (one per dataset, keys in the first dict's order).
    """
    tables = [accuracy_by_l2] if isinstance(accuracy_by_l2, dict) else list(accuracy_by_l2)
    if not tables or not tables[0]:
        raise ValueError("`accuracy_by_l2` is empty: there is no L2 strength to pick.")
    keys = list(tables[0])
    ranks = [np.argsort(np.argsort(np.asarray([t[k] for k in keys], "float32")))
             for t in tables]
    return keys[int(np.argmax(np.mean(ranks, axis=0)))]


def select_l2_across_datasets(results):
    """Upstream's report: one L2 per shot count for all datasets.

    `results` maps dataset names to `few_shot_evaluation` outputs; returns
    `{"best_l2": {"<k>shot": l2}, "accuracy": {name: {"<k>shot": acc}}}`.
    """
    shots = sorted({key for r in results.values() for key in r if key.endswith("shot")},
                   key=lambda key: int(key[:-4]))
    best, accuracy = {}, {name: {} for name in results}
    for key in shots:
        tables = [r[key]["accuracy_by_l2"] for r in results.values() if key in r]
        best[key] = float(best_l2_by_rank(tables))
        for name, r in results.items():
            if key in r:
                accuracy[name][key] = r[key]["accuracy_by_l2"][repr(best[key])]
    return {"best_l2": best, "accuracy": accuracy}


def few_shot_evaluation(train_features, train_labels, test_features, test_labels,
                        shots=SHOTS, l2_regs=L2_REGS, num_classes=None, seed=0,
                        dtype="float32"):
    """Few-shot linear-probe accuracy for several shot counts.

    For each `k` in `shots`, `k` examples of every class train a
    `LinearProbe`, evaluated for every L2 strength in `l2_regs`.

    Args:
        train_features, train_labels: pool to draw the shots from.
        test_features, test_labels: evaluation set.
        shots: shot counts; those a class cannot provide are listed under
            `skipped`.
        l2_regs: L2 strengths (default upstream's 2^-10 … 2^19); `accuracy`
            is at the L2 upstream's rule picks (`best_l2_by_rank`).
        num_classes: int C (default: from the labels).
        seed: int, shot sampling seed (upstream's `seed`).
        dtype: the probe's precision, `"float32"` (upstream) or `"float64"`.

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
    _check(np.zeros((train_labels.size, num_classes)), train_labels, "train_features")
    shots = [check_int(k, f"shots[{index}]") for index, k in enumerate(shots)]
    results = {"skipped": []}
    for k in shots:
        try:
            index = sample_shots(train_labels, k, seed=seed, num_classes=num_classes)
        except ValueError:
            results["skipped"].append(k)
            continue
        probe = LinearProbe(np.asarray(train_features)[index], train_labels[index],
                            num_classes, dtype=dtype)
        by_l2 = {repr(l2): probe.accuracy(test_features, test_labels, l2) for l2 in l2_regs}
        best = float(best_l2_by_rank({l2: by_l2[repr(l2)] for l2 in l2_regs}))
        results[f"{k}shot"] = {"accuracy": by_l2[repr(best)], "l2": best,
                               "accuracy_by_l2": by_l2}
    return results
