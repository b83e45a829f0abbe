"""Classification metrics in NumPy (B examples, C classes)."""

import numpy as np

from keras_vmoe.utils.validation import check_int

ECE_BINS = 15


def log_softmax(logits):
    """Numerically stable `log_softmax` over the last axis (float64)."""
    logits = np.asarray(logits, dtype="float64")
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _check(scores, labels, name="scores"):
    scores = np.asarray(scores, dtype="float64")
    labels = np.asarray(labels).reshape(-1)
    if scores.ndim != 2:
        raise ValueError(
            f"`{name}` must have shape (examples, classes). Received shape {scores.shape}."
        )
    if labels.shape[0] != scores.shape[0]:
        raise ValueError(
            f"`labels` has {labels.shape[0]} entries for {scores.shape[0]} rows of `{name}`."
        )
    if labels.size == 0:
        raise ValueError("There are no examples to evaluate (empty `labels`).")
    if not np.issubdtype(labels.dtype, np.integer):
        wrong = ~np.isfinite(labels) | (labels != np.round(labels))
        if wrong.any():
            raise ValueError("`labels` must be integer class ids. Received non-integer "
                             f"values, e.g. {labels[wrong][0]!r}.")
        labels = labels.astype("int64")
    bad = (labels < 0) | (labels >= scores.shape[1])
    if bad.any():
        raise ValueError(
            f"`labels` must be in [0, {scores.shape[1]}) (the number of classes). "
            f"Received {labels[bad][0]}."
        )
    return scores, labels


def top_k_accuracy(scores, labels, k=1):
    """Fraction of examples whose label is among the `k` highest scores.

    Ties rank the lower class index first (as `argmax`), so they never count
    as correct for free.

    Args:
        scores: `(B, C)` logits, probabilities or log-probabilities.
        labels: `(B,)` integer class ids.
        k: int >= 1 (values above C count every example as correct).

    Returns:
        float in [0, 1].
    """
    k = check_int(k, "k")
    scores, labels = _check(scores, labels)
    label_scores = scores[np.arange(labels.size), labels]
    ties_before = (scores == label_scores[:, None]) & (
        np.arange(scores.shape[1])[None, :] < labels[:, None])
    rank = (scores > label_scores[:, None]).sum(axis=-1) + ties_before.sum(axis=-1)  # (B,)
    return float(np.mean(rank < k))


def negative_log_likelihood(log_probabilities, labels):
    """Mean negative log-likelihood `-mean(log p[label])` (nats).

    Args:
        log_probabilities: `(B, C)` normalised log-probabilities.
        labels: `(B,)` integer class ids.
    """
    log_probabilities, labels = _check(log_probabilities, labels, "log_probabilities")
    return float(-np.mean(log_probabilities[np.arange(labels.size), labels]))


def calibration_bins(probabilities, labels, num_bins=ECE_BINS):
    """Reliability statistics and the expected calibration error (ECE).

    Confidences (largest probabilities) fall into `num_bins` equal-width
    bins, bin `floor(confidence·n)` (the last also holds 1), and
    `ECE = sum_b (|b| / B) * |accuracy(b) - mean confidence(b)|`.

    Args:
        probabilities: `(B, C)` probabilities.
        labels: `(B,)` integer class ids.
        num_bins: int, number of bins.

    Returns:
        A dict: `ece` (float), `bin_edges` `[num_bins + 1]`, `bin_count`,
        `bin_accuracy` and `bin_confidence` `[num_bins]` (accuracy and
        confidence are `None` for empty bins).
    """
    num_bins = check_int(num_bins, "num_bins")
    probabilities, labels = _check(probabilities, labels, "probabilities")
    confidence = probabilities.max(axis=-1)
    correct = (probabilities.argmax(axis=-1) == labels).astype("float64")
    edges = np.linspace(0.0, 1.0, num_bins + 1)
    bins = np.clip(np.floor(confidence * num_bins), 0, num_bins - 1).astype("int64")
    count = np.bincount(bins, minlength=num_bins)
    correct_sum = np.bincount(bins, weights=correct, minlength=num_bins)
    confidence_sum = np.bincount(bins, weights=confidence, minlength=num_bins)
    gaps = np.abs(correct_sum - confidence_sum)  # = count * |acc - conf|

    def mean_per_bin(sums):
        means = sums / np.maximum(count, 1)
        return [float(m) if n else None for m, n in zip(means, count, strict=True)]

    return {"ece": float(gaps.sum() / labels.size), "bin_edges": edges.tolist(),
            "bin_count": count.tolist(), "bin_accuracy": mean_per_bin(correct_sum),
            "bin_confidence": mean_per_bin(confidence_sum)}


def brier_score(probabilities, labels):
    """Multi-class Brier score `mean_b sum_c (p_bc - 1[c = y_b])²`.

    0 is perfect, 2 the worst.

    Args:
        probabilities: `(B, C)` probabilities.
        labels: `(B,)` integer class ids.
    """
    probabilities, labels = _check(probabilities, labels, "probabilities")
    onehot = np.eye(probabilities.shape[1])[labels]
    return float(np.mean(np.sum((probabilities - onehot) ** 2, axis=-1)))


def expected_calibration_error(probabilities, labels, num_bins=ECE_BINS):
    """ECE with `num_bins` equal-width confidence bins (see `calibration_bins`)."""
    return calibration_bins(probabilities, labels, num_bins)["ece"]


def classification_metrics(log_probabilities, labels, num_bins=ECE_BINS):
    """Top-1, top-5, NLL and ECE of a prediction.

    Args:
        log_probabilities: `(B, C)` log-probabilities.
        labels: `(B,)` integer class ids.
        num_bins: int, ECE bins.

    Returns:
        A dict `{"top1_accuracy", "top5_accuracy", "nll", "ece", "brier",
        "num_examples"}` of Python numbers.
    """
    log_probabilities, labels = _check(log_probabilities, labels, "log_probabilities")
    probabilities = np.exp(log_probabilities)
    return {
        "num_examples": int(labels.size),
        "top1_accuracy": top_k_accuracy(log_probabilities, labels, 1),
        "top5_accuracy": top_k_accuracy(log_probabilities, labels, 5),
        "nll": negative_log_likelihood(log_probabilities, labels),
        "ece": expected_calibration_error(probabilities, labels, num_bins),
        "brier": brier_score(probabilities, labels),
    }
