"""E³ ensembles: metrics of the ensemble vs its members (B images, N members)."""

import numpy as np

from keras_vmoe.evaluation.metrics import ECE_BINS
from keras_vmoe.evaluation.metrics import classification_metrics
from keras_vmoe.evaluation.metrics import log_softmax


def kl_diversity(member_logits):
    """Mean pairwise KL divergence between the members' predictions.

    `KL(p_m || p_m')` averaged over images and member pairs m < m' (the E³
    paper's "KL" diversity); 0 for one member.

    Args:
        member_logits: `(B, N, C)` logits.

    Returns:
        float (nats).
    """
    log_p = log_softmax(member_logits)  # (B, N, C)
    members = log_p.shape[1]
    pairs = [(i, j) for i in range(members) for j in range(i + 1, members)]
    if not pairs:
        return 0.0
    kls = [np.mean(np.sum(np.exp(log_p[:, i]) * (log_p[:, i] - log_p[:, j]), axis=-1))
           for i, j in pairs]
    return float(np.mean(kls))


def ensemble_metrics(member_logits, labels, num_bins=ECE_BINS):
    """Metrics of an E³ ensemble and of each of its members.

    The ensemble predicts the mean of the members' softmax probabilities.

    Args:
        member_logits: `(B, N, C)` logits of an `EnsembleImageClassifier`.
        labels: `(B,)` integer class ids.
        num_bins: int, ECE bins.

    Returns:
        A dict: `ensemble` and `members` (N dicts) of `classification_metrics`,
        `member_mean`, `ensemble_gain` (ensemble minus member mean),
        `disagreement` (share of (image, member pair) with different top-1),
        `normalized_disagreement` (over the ensemble's error), `kl_diversity`.
    """
    from keras_vmoe.models.ensemble_classifier import (
        ensemble_log_probabilities,  # lazy: evaluation loads without Keras
    )

    member_logits = np.asarray(member_logits, dtype="float64")
    if member_logits.ndim != 3:
        raise ValueError(
            "`member_logits` must have shape (images, members, classes). "
            f"Received shape {member_logits.shape}."
        )
    members = member_logits.shape[1]
    ensemble = classification_metrics(np.asarray(
        ensemble_log_probabilities(member_logits), dtype="float64"), labels, num_bins)
    per_member = [
        classification_metrics(log_softmax(member_logits[:, n]), labels, num_bins)
        for n in range(members)
    ]
    keys = [k for k in ensemble if k != "num_examples"]
    mean = {k: float(np.mean([m[k] for m in per_member])) for k in keys}
    predictions = member_logits.argmax(axis=-1)  # (B, N)
    pairs = [(i, j) for i in range(members) for j in range(i + 1, members)]
    disagreement = (
        float(np.mean([np.mean(predictions[:, i] != predictions[:, j]) for i, j in pairs]))
        if pairs else 0.0
    )
    error = 1.0 - ensemble["top1_accuracy"]
    return {
        "kl_diversity": kl_diversity(member_logits),
        "normalized_disagreement": disagreement / error if error > 0 else None,
        "ensemble": ensemble,
        "members": per_member,
        "member_mean": mean,
        "ensemble_gain": {k: ensemble[k] - mean[k] for k in keys},
        "disagreement": disagreement,
    }
