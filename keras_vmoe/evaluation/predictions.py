"""Predictions of a task over a dataset, as log-probabilities."""

import numpy as np

from keras_vmoe.data.labels import check_class_ids
from keras_vmoe.evaluation._batches import iterate_batches
from keras_vmoe.evaluation.metrics import log_softmax


def has_head(model):
    """Whether `model` is a task with a classification head."""
    return bool(getattr(model, "num_classes", None))


def predict_log_probabilities(model, images, labels=None, batch_size=32):
    """Runs a task with a head over the data.

    Returns a dict: `log_probabilities` `(B, C)` (E³: of the mean member
    probabilities), `member_logits` `(B, N, C)` for E³ (else `None`) and
    `labels` `(B,)` or `None`.
    """
    if not has_head(model):
        raise ValueError(
            "The model has no classification head (num_classes=None); there "
            "are no predictions to evaluate."
        )
    # Labels that are no class id would count as wrong predictions.
    if labels is not None:
        check_class_ids(labels, model.num_classes, "evaluation")
    outputs, all_labels = [], []
    ensemble = hasattr(model, "predict_members")  # E³: the member logits
    predict = model.predict_members if ensemble else model.predict
    for x, y in iterate_batches(images, labels, batch_size):
        if y is not None:
            check_class_ids(y, model.num_classes, "evaluation")
        outputs.append(np.asarray(predict(x, batch_size=x.shape[0], verbose=0),
                                  dtype="float64"))
        all_labels.append(y)
    if not outputs:
        raise ValueError("The evaluation data is empty.")
    outputs = np.concatenate(outputs)
    has_labels = all(y is not None for y in all_labels)
    y = np.concatenate(all_labels).astype("int64") if has_labels else None
    if ensemble:
        from keras_vmoe.models.ensemble_classifier import (
            ensemble_log_probabilities,  # lazy: evaluation loads without Keras
        )

        log_p = np.asarray(ensemble_log_probabilities(outputs), dtype="float64")
        return {"labels": y, "member_logits": outputs, "log_probabilities": log_p}
    from keras_vmoe.models.task import is_logits  # lazy: evaluation loads without Keras

    if is_logits(getattr(model, "activation", None)):
        log_p = log_softmax(outputs)
    else:
        log_p = np.log(np.clip(outputs, 1e-12, 1.0))
    return {"labels": y, "member_logits": None, "log_probabilities": log_p}
