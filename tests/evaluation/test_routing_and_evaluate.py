"""Routing statistics, capacity sweep, `evaluate` and the CLI on a tiny V-MoE."""

import json
import time

import keras
import numpy as np
import pytest
import tiny_configs

from keras_vmoe import cli
from keras_vmoe import evaluation
from keras_vmoe import models
from keras_vmoe import presets
from keras_vmoe.evaluation import metrics
from keras_vmoe.layers import MoeLayer
from keras_vmoe.models import routing_analysis

from .test_metrics import png_size

NUM_CLASSES = 3
K = 2


@pytest.fixture(scope="module")
def tiny_vmoe():
    keras.utils.set_random_seed(0)
    config = tiny_configs.vmoe(px=16, representation_size=None)
    model = models.ImageClassifier(models.VisionTransformerBackbone(**config),
                                   num_classes=NUM_CLASSES)
    rng = np.random.default_rng(0)
    model.get_layer("head").kernel.assign(rng.normal(size=(16, NUM_CLASSES)).astype("float32"))
    images = rng.uniform(-1, 1, size=(12, 16, 16, 3)).astype("float32")
    labels = np.arange(12) % NUM_CLASSES
    return model, images, labels


@pytest.mark.heavy
def test_return_routing_keeps_the_outputs():
    layer = MoeLayer(4, 8, router={"num_selected_experts": 2, "capacity_factor": 0.5})
    x = keras.random.normal((2, 6, 4), seed=1)
    y, routing = layer(x, return_routing=True)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(layer(x)))
    assignments = routing_analysis.token_assignments(layer, routing, (2, 6, 4))
    processed = np.asarray(assignments["processed"])
    requested = np.asarray(assignments["requested"])
    assert processed.shape == requested.shape == (2, 6, 4)
    assert requested.sum() == 2 * 6 * K and (processed <= requested).all()
    kept = np.asarray(routing.buffer_token) < 12
    assert processed.sum() == kept.sum()


@pytest.mark.heavy
def test_routing_statistics_are_consistent(tiny_vmoe):
    model, images, labels = tiny_vmoe
    backbone = model.backbone
    model.set_routing(capacity_factor=0.5)
    try:
        stats = evaluation.routing_statistics(model, images, labels, batch_size=12)
        metrics = backbone.routing_metrics(images)["encoderblock_1"]
    finally:
        model.set_routing(capacity_factor=1.05)
    tokens = backbone.num_tokens
    assert stats["num_images"] == 12 and stats["num_tokens"] == tokens == 5
    assert stats["num_classes"] == NUM_CLASSES
    layer = stats["layers"]["encoderblock_1"]
    counts = np.asarray(layer["expert_counts"])
    requested = np.asarray(layer["requested_counts"])
    assert counts.shape == requested.shape == (4,)
    assert requested.sum() == 12 * tokens * K
    # Processed = requested minus the dropped assignments.
    dropped = layer["dropped_assignments_fraction"]
    assert dropped > 0.1  # capacity factor 0.5 drops
    assert counts.sum() == pytest.approx(requested.sum() * (1 - dropped))
    # 8 images per group (upstream's): 12 images make 2 groups, the second
    # padded; the padding takes no slot.
    assert backbone.get_moe_layers()[0].images_per_group == 8
    assert counts.sum() <= 4 * layer["capacity"] * 2
    assert sum(layer["expert_load"]) == pytest.approx(1.0)
    positions = np.asarray(layer["expert_position_counts"])
    classes = np.asarray(layer["expert_class_counts"])
    assert positions.shape == (4, tokens) and classes.shape == (4, NUM_CLASSES)
    np.testing.assert_allclose(positions.sum(1), counts)
    np.testing.assert_allclose(classes.sum(1), counts)
    assert layer["class_token_counts"] == [4 * tokens] * NUM_CLASSES
    # Same batch, same group: agrees with the backbone's own metrics.
    assert layer["tokens_dropped_fraction"] == pytest.approx(metrics["tokens_dropped_fraction"])
    assert dropped == pytest.approx(metrics["dropped_assignments_fraction"], abs=1e-6)


@pytest.mark.heavy
def test_capacity_sweep_drops_fewer_tokens_with_more_capacity(tiny_vmoe):
    model, images, labels = tiny_vmoe
    backbone = model.backbone
    before = backbone.get_config()
    sweep = evaluation.capacity_sweep(backbone, images, capacity_factors=(0.25, 1.0, 4.0),
                                      batch_priorities=(False,), batch_size=12)
    assert backbone.get_config() == before  # routing restored
    dropped = [row["tokens_dropped_fraction"] for row in sweep["rows"]]
    assert dropped[0] > 0.3 and dropped[0] >= dropped[1] >= dropped[2] == 0.0
    assert [row["accuracy"] for row in sweep["rows"]] == [None] * 3  # backbone: no head
    with pytest.raises(ValueError, match="capacity_factors"):
        evaluation.capacity_sweep(backbone, images, capacity_factors=(0.0,))


@pytest.mark.heavy
def test_evaluate_without_sweep(tiny_vmoe, tmp_path):
    model, images, labels = tiny_vmoe
    report = evaluation.evaluate(model, images, labels, output_dir=tmp_path, batch_size=12,
                                 capacity_factors=None)
    logits = np.asarray(model.predict(images, batch_size=12, verbose=0))
    expected = evaluation.classification_metrics(metrics.log_softmax(logits), labels)
    assert report["classification"] == pytest.approx(expected, rel=1e-5)
    assert "capacity_sweep" not in report and "few_shot" not in report
    assert json.loads((tmp_path / "metrics.json").read_text())["routing"] == report["routing"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "metrics.json", "reliability_diagram.png", "routing_heatmaps.png"]


@pytest.mark.slow
def test_evaluate_writes_metrics_and_figures(tiny_vmoe, tmp_path):
    model, images, labels = tiny_vmoe
    router = model.backbone.get_moe_layers()[0].router
    before = (router.capacity_factor, router.batch_priority, model.backbone.get_config())
    report = evaluation.evaluate(
        model, images, labels, output_dir=tmp_path, batch_size=12,
        capacity_factors=(0.25, 4.0), few_shot_data=(images, labels), shots=(1, 5),
        l2_regs=(1.0,))
    assert (router.capacity_factor, router.batch_priority,
            model.backbone.get_config()) == before  # routing restored
    written = json.loads((tmp_path / "metrics.json").read_text())
    assert written["classification"] == pytest.approx(report["classification"])
    logits = np.asarray(model.predict(images, batch_size=12, verbose=0))
    expected = evaluation.classification_metrics(metrics.log_softmax(logits), labels)
    assert report["classification"]["nll"] == pytest.approx(expected["nll"], rel=1e-5)
    assert report["classification"]["top1_accuracy"] == expected["top1_accuracy"]
    rows = report["capacity_sweep"]["rows"]
    assert [(r["capacity_factor"], r["batch_priority"]) for r in rows] == [
        (c, b) for c in (0.25, 4.0) for b in (False, True)]
    for priority in (False, True):
        dropped = [r["tokens_dropped_fraction"] for r in rows if r["batch_priority"] == priority]
        assert dropped[0] > 0.3 and dropped[1] == 0.0
    assert rows[2]["accuracy"] == report["classification"]["top1_accuracy"]
    assert report["few_shot"]["skipped"] == [5]  # 4 examples per class
    assert 0.0 <= report["few_shot"]["1shot"]["accuracy"] <= 1.0
    for name in ("reliability_diagram.png", "routing_heatmaps.png", "capacity_curve.png"):
        width, height = png_size(tmp_path / name)
        assert width > 200 and height > 200
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["metrics.json", "reliability_diagram.png", "routing_heatmaps.png",
         "capacity_curve.png"])


@pytest.mark.heavy
def test_cli_evaluate_smoke(tiny_vmoe, tmp_path, capsys):
    model, _, _ = tiny_vmoe
    preset = tmp_path / "preset"
    # Digits have 10 classes.
    presets.save_to_preset(models.ImageClassifier(model.backbone, num_classes=10), preset)
    out = tmp_path / "eval"
    argv = ["evaluate", "--preset", str(preset), "--split", "test[:12]",
            "--capacity-factors", "none", "--batch-size", "12", "--output", str(out), "--json"]
    assert cli.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["classification"]["num_examples"] == 12
    assert report["data"] == "digits" and "capacity_sweep" not in report
    assert (out / "metrics.json").is_file() and png_size(out / "routing_heatmaps.png")[0] > 0


@pytest.mark.parametrize("argv, message", [
    (["--preset", "no_such_preset"], "Unknown preset"),
    (["--preset", "vmoe_s32", "--data", "no/such/folder"], "unknown dataset"),
    (["--preset", "vmoe_s32", "--capacity-factors", "0,1"], "capacity factors"),
    (["--preset", "vmoe_s32", "--shots", "1,x"], "integer"),
])
def test_cli_evaluate_argument_errors_are_fast(argv, message, capsys):
    started = time.perf_counter()
    try:
        status = cli.main(["evaluate", *argv])
    except SystemExit as exit_:
        status = exit_.code
    assert status in (1, 2)
    assert time.perf_counter() - started < 1.0
    assert message in capsys.readouterr().err
