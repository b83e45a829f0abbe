"""Evaluation of keras_vmoe models.

Classification metrics (top-1/top-5, NLL, ECE with a reliability diagram),
the closed-form few-shot linear probe of the V-MoE paper, E³ ensemble vs
member metrics, per-layer routing statistics with heatmaps, and accuracy
vs inference capacity factor (with and without Batch Prioritized
Routing). `evaluate` runs what applies to a model and writes a metrics
JSON and the PNGs. NumPy does the statistics; matplotlib (Agg) draws.
"""

from keras_vmoe.evaluation.plots import plot_capacity_curve
from keras_vmoe.evaluation.plots import plot_reliability_diagram
from keras_vmoe.evaluation.plots import plot_routing_heatmaps
from keras_vmoe.evaluation.routing_stats import routing_statistics

__all__ = [
    "plot_capacity_curve",
    "plot_reliability_diagram",
    "plot_routing_heatmaps",
    "routing_statistics",
]
