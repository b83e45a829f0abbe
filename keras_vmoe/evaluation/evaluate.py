"""`evaluate`: every evaluation that applies to a model, with its outputs."""

import json
import os
import pathlib

import numpy as np

from keras_vmoe.evaluation._batches import collect
from keras_vmoe.evaluation._batches import get_backbone
from keras_vmoe.evaluation.capacity import CAPACITY_FACTORS
from keras_vmoe.evaluation.capacity import capacity_sweep
from keras_vmoe.evaluation.capacity import check_capacity_factors
from keras_vmoe.evaluation.ensemble import ensemble_metrics
from keras_vmoe.evaluation.fewshot import L2_REGS
from keras_vmoe.evaluation.fewshot import SHOTS
from keras_vmoe.evaluation.fewshot import few_shot_evaluation
from keras_vmoe.evaluation.fewshot import pooled_features
from keras_vmoe.evaluation.metrics import ECE_BINS
from keras_vmoe.evaluation.metrics import calibration_bins
from keras_vmoe.evaluation.metrics import classification_metrics
from keras_vmoe.evaluation.plots import plot_capacity_curve
from keras_vmoe.evaluation.plots import plot_reliability_diagram
from keras_vmoe.evaluation.plots import plot_routing_heatmaps
from keras_vmoe.evaluation.predictions import has_head
from keras_vmoe.evaluation.predictions import predict_log_probabilities
from keras_vmoe.evaluation.routing_stats import routing_statistics
from keras_vmoe.utils.safe_files import write_atomically
from keras_vmoe.utils.validation import check_int

METRICS_FILE = "metrics.json"
RELIABILITY_FILE = "reliability_diagram.png"
ROUTING_FILE = "routing_heatmaps.png"
CAPACITY_FILE = "capacity_curve.png"


def _reiterable(data):
    """Whether `data` can be read several times (not a one-shot iterator)."""
    if data is None or isinstance(data, np.ndarray) or hasattr(data, "as_numpy_iterator"):
        return data is not None
    return iter(data) is not data


def evaluate(model, data, labels=None, output_dir=None, batch_size=32,
             capacity_factors=CAPACITY_FACTORS, few_shot_data=None, shots=SHOTS,
             l2_regs=L2_REGS, num_bins=ECE_BINS, routing=True, progress=None):
    """Evaluates a model with everything that applies to it.

    Classification metrics and reliability diagram (a head and labels; E³
    adds the member metrics), routing statistics and heatmaps (MoE), the
    capacity sweep (sparse MoE) and the few-shot probe (`few_shot_data`).

    Args:
        model: a keras_vmoe task or `VisionTransformerBackbone`.
        data: `(B, H, W, C)` images with `labels`, or an iterable of
            `(images, labels)` batches (one-shot iterators are read first).
        labels: `(B,)` labels for array `data`.
        output_dir: folder for `metrics.json` and the PNGs, or `None`.
        batch_size: int, batch size for array inputs.
        capacity_factors: capacity factors of the sweep; `None` skips it.
        few_shot_data: `(images, labels)` or labelled batches, the few-shot
            training pool.
        shots: few-shot shot counts.
        l2_regs: few-shot L2 strengths (see `few_shot_evaluation`).
        num_bins: int, ECE bins.
        routing: bool, compute the routing statistics.
        progress: optional callable taking a progress message.

    Returns:
        The metrics dict (as written to `metrics.json`); its `files` entry
        maps each written figure to its path.

    Examples:

    ```python
    import numpy as np
    import keras_vmoe

    config = keras_vmoe.models.backbone_config(   # a tiny, untrained V-MoE
        "vmoe", "S/32", image_size=32, patch_size=16, hidden_dim=32,
        num_heads=2, mlp_dim=64, num_layers=2, layout="every2", num_experts=4)
    model = keras_vmoe.models.ImageClassifier(
        keras_vmoe.models.VisionTransformerBackbone(**config), num_classes=10)
    images = np.random.default_rng(0).integers(0, 256, (16, 32, 32, 3), "uint8")
    labels = np.arange(16) % 10
    report = keras_vmoe.evaluation.evaluate(model, images, labels,
                                            output_dir="./eval",
                                            capacity_factors=(1.0, 2.0))
    print(report["classification"]["top1_accuracy"])
    print(sorted(report["files"]))   # the PNGs written to ./eval
    ```
    """
    batch_size = check_int(batch_size, "batch_size")
    progress = progress or (lambda message: None)
    if capacity_factors is not None:
        capacity_factors = check_capacity_factors(capacity_factors)
    if output_dir is not None and os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise NotADirectoryError(f"`output_dir` {output_dir!r} exists and is not a folder.")
    if not _reiterable(data):
        data, labels = collect(data, labels, batch_size)
    backbone = get_backbone(model)
    report = {"model": model.name, "class": type(model).__name__,
              "moe_type": backbone.moe_type, "ensemble_size": backbone.ensemble_size}
    figures = []

    if has_head(model):
        progress("predicting")
        predictions = predict_log_probabilities(model, data, labels, batch_size)
        if predictions["labels"] is not None:
            y = predictions["labels"]
            report["classification"] = classification_metrics(
                predictions["log_probabilities"], y, num_bins)
            calibration = report["calibration"] = calibration_bins(
                np.exp(predictions["log_probabilities"]), y, num_bins)
            figures.append((RELIABILITY_FILE, plot_reliability_diagram, calibration))
            if predictions["member_logits"] is not None:
                report["ensemble"] = ensemble_metrics(predictions["member_logits"], y,
                                                      num_bins)
    if routing and backbone.moe_layers:
        progress("routing statistics")
        stats = report["routing"] = routing_statistics(model, data, labels,
                                                       batch_size=batch_size)
        figures.append((ROUTING_FILE, plot_routing_heatmaps, stats))
    if capacity_factors and backbone.moe_layers and backbone.moe_type != "soft":
        progress(f"capacity sweep over {capacity_factors}")
        sweep = report["capacity_sweep"] = capacity_sweep(
            model, data, labels, capacity_factors, batch_size=batch_size)
        figures.append((CAPACITY_FILE, plot_capacity_curve, sweep))
    if few_shot_data is not None:
        progress("few-shot linear probe")
        pool_images, pool_labels = (few_shot_data if isinstance(few_shot_data, tuple)
                                    else (few_shot_data, None))
        train_features, train_labels = pooled_features(
            model, pool_images, pool_labels, batch_size)
        test_features, test_labels = pooled_features(model, data, labels, batch_size)
        if train_labels is None or test_labels is None:
            raise ValueError("The few-shot probe needs labelled data.")
        report["few_shot"] = few_shot_evaluation(  # the few-shot data's classes
            train_features, train_labels, test_features, test_labels, shots=shots,
            l2_regs=l2_regs, num_classes=None)

    if output_dir is not None:
        report["files"] = {}
        for name, plot, values in figures:
            path = os.path.join(output_dir, name)
            plot(values, path)
            report["files"][name] = path
        text = json.dumps(report, indent=2, sort_keys=True) + "\n"
        write_atomically(os.path.join(output_dir, METRICS_FILE),
                         lambda temp: pathlib.Path(temp).write_text(text))
    return report
