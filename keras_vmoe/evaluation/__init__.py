"""Evaluation of keras_vmoe models: metrics, few-shot probe, routing, capacity.

`evaluate` runs what applies to a model and writes a metrics JSON and PNGs.
The single metrics are in `keras_vmoe.evaluation.metrics` (and
`kl_diversity` in `keras_vmoe.evaluation.ensemble`).
"""

from keras_vmoe.evaluation.capacity import capacity_sweep
from keras_vmoe.evaluation.ensemble import ensemble_metrics
from keras_vmoe.evaluation.evaluate import evaluate
from keras_vmoe.evaluation.fewshot import LinearProbe
from keras_vmoe.evaluation.fewshot import few_shot_evaluation
from keras_vmoe.evaluation.fewshot import pooled_features
from keras_vmoe.evaluation.metrics import classification_metrics
from keras_vmoe.evaluation.plots import plot_capacity_curve
from keras_vmoe.evaluation.plots import plot_reliability_diagram
from keras_vmoe.evaluation.plots import plot_routing_heatmaps
from keras_vmoe.evaluation.routing_stats import routing_statistics

__all__ = ["LinearProbe", "capacity_sweep", "classification_metrics",
           "ensemble_metrics", "evaluate", "few_shot_evaluation", "plot_capacity_curve",
           "plot_reliability_diagram", "plot_routing_heatmaps", "pooled_features",
           "routing_statistics"]
