"""Closed-form few-shot linear probe on pre-logits (V-MoE paper, §3.4).

Axis letters: N training examples, D feature size, C classes.

The recipe of the V-MoE paper (following ViT): freeze the model, take the
pre-logits representation, standardise it with the training mean and
standard deviation (+1e-5), append a large constant feature (an almost
unregularised bias), and fit an L2-regularised least-squares map onto
one-hot targets rescaled to {-1, +1}; predict the arg-max. The solution
comes from one eigendecomposition of `XᵀX` (D ≤ N) or `XXᵀ` (N < D), so a
sweep over L2 strengths costs one decomposition.

As upstream (`vmoe/evaluate/fewshot.py`): the probe runs in float32
(`dtype="float64"` is an option), the shots are drawn from
`np.random.default_rng(hash((seed, sub_seed)) % 2**31)`, and the L2 ranks
use numpy's default (unstable) argsort.
"""

import numpy as np

from keras_vmoe.evaluation._batches import get_backbone
from keras_vmoe.evaluation._batches import iterate_batches
from keras_vmoe.evaluation.metrics import _check
from keras_vmoe.evaluation.routing_stats import convert_images
from keras_vmoe.utils.validation import check_int

SHOTS = (1, 5, 10, 25)
L2_REGS = tuple(2.0**i for i in range(-10, 20))
BIAS_FEATURE = 100.0
STD_EPSILON = 1e-5


def pooled_features(model_or_backbone, images, labels=None, batch_size=32):
    """Pre-logit features of a backbone (the task's head is not used).

    Args:
        model_or_backbone: a keras_vmoe task or `VisionTransformerBackbone`.
        images: `(B, H, W, C)` array or an iterable of batches (see
            `routing_statistics`); a task's preprocessor is applied.
        labels: `(B,)` labels for array `images` (passed through).
        batch_size: int, batch size for array inputs.

    Returns:
        `(features (B, R), labels (B,) or None)`. For E³ the features are
        the N member representations concatenated, `(B, N·R)` (the E³
        paper's "joint" few-shot features, App. A.5.1).
    """

    backbone = get_backbone(model_or_backbone)
    features, batch_labels = [], []
    for x, y in iterate_batches(images, labels, batch_size):
        x = convert_images(model_or_backbone, x)
        out = np.asarray(backbone.predict_on_batch(x), dtype="float64")
        members = backbone.ensemble_size
        # Rows are image-major (b·N + m): one row of N·R per image.
        features.append(out.reshape(x.shape[0], members * out.shape[-1]))
        batch_labels.append(y)
    if not features:
        raise ValueError("`images` is empty: there are no features to extract.")
    has_labels = all(y is not None for y in batch_labels)
    return np.concatenate(features), np.concatenate(batch_labels) if has_labels else None


class LinearProbe:
    """L2-regularised least squares onto {-1, +1} one-hot targets.

    Computed as upstream's `_precompute_cache` / `_eig_fewshot_acc_fn`
    (`vmoe/evaluate/fewshot.py`), in `dtype`: float32 as upstream (jax
    without x64), or float64 (less rounding; at a fixed L2 the two can be
    up to about a point of accuracy apart).

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
        if str(dtype) not in ("float32", "float64"):
            raise ValueError(
                f"`dtype` must be 'float32' (upstream) or 'float64'. Received: "
                f"dtype={dtype!r}")
        self.dtype = np.dtype(str(dtype))
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
        self._primal = x.shape[0] >= x.shape[1]
        # Weights = lhs · diag(1 / (eigenvalues + l2)) · rhs, with
        # XᵀX = Q·diag(eigenvalues)·Qᵀ: lhs = Q, rhs = Qᵀ(XᵀY) (N ≥ D + 1),
        # or XXᵀ = Q·diag(eigenvalues)·Qᵀ: lhs = XᵀQ, rhs = QᵀY (N < D + 1).
        if self._primal:
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
        """`(D + 1, C)` weights (last row: bias feature) for L2 strength `l2`.

        `(XᵀX + l2·I)⁻¹XᵀY`, or the equal `Xᵀ(XXᵀ + l2·I)⁻¹Y` when N < D.
        """
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

    As upstream (`vmoe/evaluate/fewshot.py`, `callback_fn` and
    `_compute_fewshot_metrics`): the generator is
    `np.random.default_rng(hash((seed, sub_seed)) % 2**31)` (`sub_seed` is
    upstream's index in `range(seeds_per_step)`, 0 by default), one
    permutation of every class's examples is drawn from it (classes
    0 … C-1 in order), and a k-shot probe takes the first k,
    so the shot sets are nested (the 1-shot examples are among the 5-shot
    ones). Raises a `ValueError` naming the class when one has fewer
    examples.

    Args:
        labels: `(N,)` integer class ids.
        shots: int k, or a sequence of them (then a dict k -> indices).
        seed: int, upstream's few-shot `seed`.
        num_classes: int C (default: the largest label + 1).
        sub_seed: int, upstream's `sub_seed`.

    Returns:
        `(C·k,)` indices, class by class; a dict of them for several k.
    """
    labels = np.asarray(labels).reshape(-1)
    if num_classes is None:
        num_classes = int(labels.max()) + 1 if labels.size else 0
    seed = check_int(seed, "seed", minimum=None)
    sub_seed = check_int(sub_seed, "sub_seed", minimum=None)
    # Python's hash of a tuple of ints is deterministic (no hash salt).
    rng = np.random.default_rng(hash((int(seed), int(sub_seed))) % 2**31)
    orders = [rng.permutation(np.flatnonzero(labels == c)) for c in range(num_classes)]
    several = not isinstance(shots, (int, np.integer))
    result = {}
    for k in (shots if several else [shots]):
        for label, order in enumerate(orders):
            if order.size and order.size < k:
                raise ValueError(
                    f"{k}-shot needs {k} training examples of every class; "
                    f"class {label} has {order.size}."
                )
        result[int(k)] = np.concatenate([order[:k] for order in orders])
    return result if several else result[int(shots)]


def best_l2_by_rank(accuracy_by_l2):
    """The L2 strength upstream picks from `{l2: accuracy}` dicts.

    Upstream (`vmoe/evaluate/fewshot.py`, `_find_best_l2_reg`) ranks the
    L2 strengths of every dataset by accuracy (`argsort(argsort(...))`
    with numpy's default sort: ties are ranked as that unstable sort
    leaves them) and takes the best mean rank across datasets (the first
    L2, in the order given, of equal mean ranks): one L2 per shot count for
    all datasets.

    Args:
        accuracy_by_l2: a `{l2: accuracy}` dict, or a list of them (one per
            dataset, same L2 keys), keys in upstream's `l2_regs` order
            (the first dict's order is used).

    Returns:
        The chosen L2 (a key of the dicts).
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

    Args:
        results: `{dataset name: few_shot_evaluation(...) output}`.

    Returns:
        `{"best_l2": {"<k>shot": l2}, "accuracy": {name: {"<k>shot": acc}}}`,
        each dataset's accuracy read at the shot count's common L2.
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

    For each `k` in `shots`, the first `k` examples of every class in one
    seeded per-class order (nested sets, see `sample_shots`) train a
    `LinearProbe`, evaluated on the test features for every L2 strength in
    `l2_regs`.

    Args:
        train_features, train_labels: pool to draw the shots from.
        test_features, test_labels: evaluation set.
        shots: shot counts (default 1, 5, 10, 25). Counts a class cannot
            provide are skipped and listed under `skipped`.
        l2_regs: L2 strengths (default upstream's sweep 2^-10 … 2^19).
            With several values, `accuracy` is the one at the L2 upstream's
            rule picks for this dataset alone (`best_l2_by_rank`: best
            accuracy, ties as upstream's argsort); for several datasets use
            `select_l2_across_datasets` (upstream's report). Pass one value
            for an unbiased number.
        num_classes: int C, the few-shot dataset's classes (default: from
            the labels).
        seed: int, shot sampling seed (upstream's `seed`, see
            `sample_shots`).
        dtype: the probe's precision, `"float32"` (upstream) or
            `"float64"`.

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
    for index, k in enumerate(shots):
        check_int(k, f"shots[{index}]")
    results = {"skipped": []}
    for k in shots:
        try:
            index = sample_shots(train_labels, int(k), seed=seed, num_classes=num_classes)
        except ValueError:
            results["skipped"].append(int(k))
            continue
        probe = LinearProbe(np.asarray(train_features)[index], train_labels[index],
                            num_classes, dtype=dtype)
        by_l2 = {repr(l2): probe.accuracy(test_features, test_labels, l2) for l2 in l2_regs}
        best = float(best_l2_by_rank({l2: by_l2[repr(l2)] for l2 in l2_regs}))
        results[f"{int(k)}shot"] = {
            "accuracy": by_l2[repr(best)],
            "l2": best,
            "accuracy_by_l2": by_l2,
        }
    return results
