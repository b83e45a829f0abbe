"""Evaluation of keras_vmoe models.

Classification metrics (top-1/top-5, NLL, ECE with a reliability diagram),
the closed-form few-shot linear probe of the V-MoE paper, E³ ensemble vs
member metrics, per-layer routing statistics with heatmaps, and accuracy
vs inference capacity factor (with and without Batch Prioritized
Routing). `evaluate` runs what applies to a model and writes a metrics
JSON and the PNGs. NumPy does the statistics; matplotlib (Agg) draws.
"""

from keras_vmoe._lazy import deprecated_exports
from keras_vmoe.evaluation.capacity import capacity_sweep
from keras_vmoe.evaluation.ensemble import ensemble_metrics
from keras_vmoe.evaluation.ensemble import kl_diversity
from keras_vmoe.evaluation.evaluate import evaluate
from keras_vmoe.evaluation.fewshot import LinearProbe
from keras_vmoe.evaluation.fewshot import best_l2_by_rank
from keras_vmoe.evaluation.fewshot import few_shot_evaluation
from keras_vmoe.evaluation.fewshot import pooled_features
from keras_vmoe.evaluation.fewshot import select_l2_across_datasets
from keras_vmoe.evaluation.metrics import brier_score
from keras_vmoe.evaluation.metrics import calibration_bins
from keras_vmoe.evaluation.metrics import classification_metrics
from keras_vmoe.evaluation.metrics import expected_calibration_error
from keras_vmoe.evaluation.metrics import log_softmax
from keras_vmoe.evaluation.metrics import negative_log_likelihood
from keras_vmoe.evaluation.metrics import top_k_accuracy
from keras_vmoe.evaluation.plots import plot_capacity_curve
from keras_vmoe.evaluation.plots import plot_reliability_diagram
from keras_vmoe.evaluation.plots import plot_routing_heatmaps
from keras_vmoe.evaluation.predictions import predict_log_probabilities
from keras_vmoe.evaluation.routing_stats import routing_statistics

__all__ = [
    "LinearProbe",
    "best_l2_by_rank",
    "brier_score",
    "calibration_bins",
    "capacity_sweep",
    "classification_metrics",
    "ensemble_metrics",
    "evaluate",
    "expected_calibration_error",
    "few_shot_evaluation",
    "kl_diversity",
    "log_softmax",
    "negative_log_likelihood",
    "plot_capacity_curve",
    "plot_reliability_diagram",
    "plot_routing_heatmaps",
    "pooled_features",
    "predict_log_probabilities",
    "routing_statistics",
    "select_l2_across_datasets",
    "top_k_accuracy",
]

# `extract_features` is the backbone's method (block tokens); the pooled
# few-shot features are `pooled_features`.
__getattr__ = deprecated_exports(
    __name__, {"extract_features": "keras_vmoe.evaluation.fewshot:pooled_features"})
