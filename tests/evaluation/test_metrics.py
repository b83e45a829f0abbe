"""Classification metrics, few-shot probe, ensemble metrics and plots (NumPy)."""

import math

import numpy as np
import pytest

from keras_vmoe import evaluation
from keras_vmoe.evaluation import ensemble
from keras_vmoe.evaluation import fewshot
from keras_vmoe.evaluation import metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path):
    data = open(path, "rb").read()
    assert data[:8] == PNG_MAGIC
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_top_k_accuracy_by_hand():
    scores = np.array([[0.1, 0.5, 0.4], [0.7, 0.2, 0.1], [0.2, 0.3, 0.5], [0.3, 0.3, 0.4]])
    labels = np.array([2, 0, 0, 1])
    # Ranks of the labels: 1, 0, 2, 2 (a tie with a lower class index ranks first).
    assert metrics.top_k_accuracy(scores, labels, 1) == 0.25
    assert metrics.top_k_accuracy(scores, labels, 2) == 0.5
    assert metrics.top_k_accuracy(scores, labels, 3) == 1.0
    with pytest.raises(ValueError, match="labels.*in \\[0, 3\\)"):
        metrics.top_k_accuracy(scores, np.array([0, 1, 2, 3]), 1)
    with pytest.raises(ValueError, match="k"):
        metrics.top_k_accuracy(scores, labels, 0)
    # All-equal scores (an untrained zero head): top-1 is argmax's, not 100%.
    flat = np.zeros((4, 3))
    assert metrics.top_k_accuracy(flat, [0, 1, 2, 0], 1) == 0.5
    assert metrics.top_k_accuracy(flat, [0, 1, 2, 0], 2) == 0.75


def test_nll_by_hand():
    probs = np.array([[0.5, 0.25, 0.25], [0.1, 0.8, 0.1]])
    nll = metrics.negative_log_likelihood(np.log(probs), [0, 2])
    assert nll == pytest.approx(-(math.log(0.5) + math.log(0.1)) / 2, abs=1e-12)
    logits = np.array([[2.0, 0.0, -1.0]])
    expected = -(2.0 - math.log(math.exp(2) + 1 + math.exp(-1)))
    assert metrics.negative_log_likelihood(metrics.log_softmax(logits), [0]) == (
        pytest.approx(expected, abs=1e-12))


def test_ece_by_hand_15_bins():
    # Confidences 0.95, 0.95 (one right) -> bin 14; 0.55 right -> bin 8;
    # 0.4 wrong -> bin 6 (bins are [lo, hi): 0.4 = 6/15 opens bin 6, as
    # tf.histogram_fixed_width_bins in uncertainty-baselines' ECE).
    probs = np.array([
        [0.95, 0.05, 0.0], [0.0, 0.95, 0.05], [0.55, 0.45, 0.0], [0.4, 0.3, 0.3]])
    labels = np.array([0, 0, 0, 1])
    bins = metrics.calibration_bins(probs, labels)
    expected = (2 * abs(0.5 - 0.95) + abs(1 - 0.55) + abs(0 - 0.4)) / 4
    assert bins["ece"] == pytest.approx(expected, abs=1e-12)
    assert metrics.expected_calibration_error(probs, labels) == pytest.approx(expected)
    assert len(bins["bin_edges"]) == 16
    assert bins["bin_count"][14] == 2 and bins["bin_count"][8] == 1
    assert bins["bin_count"][6] == 1 and sum(bins["bin_count"]) == 4
    assert bins["bin_accuracy"][14] == 0.5 and bins["bin_accuracy"][0] is None
    # A confidence on a bin edge goes to the upper bin: [lo, hi) (the
    # uncertainty-baselines / robustness_metrics ECE the E3 paper uses).
    edge = np.array([[2 / 3, 1 / 3]])
    assert metrics.calibration_bins(edge, [0])["bin_count"][10] == 1
    assert metrics.calibration_bins(np.array([[1.0, 0.0]]), [0])["bin_count"][14] == 1
    # Perfect calibration: ECE 0.
    assert metrics.expected_calibration_error(np.eye(3), [0, 1, 2]) == 0.0


def test_classification_metrics_and_label_errors():
    logits = np.array([[3.0, 1.0, 0.0, 0, 0, 0], [0.0, 0, 0, 0, 0, 5.0]])
    result = evaluation.classification_metrics(metrics.log_softmax(logits), [0, 1])
    assert result["top1_accuracy"] == 0.5 and result["top5_accuracy"] == 1.0
    assert result["num_examples"] == 2
    with pytest.raises(ValueError, match="integer class ids"):
        evaluation.classification_metrics(metrics.log_softmax(logits), [0.0, np.nan])
    with pytest.raises(ValueError, match="2 entries|entries"):
        evaluation.classification_metrics(metrics.log_softmax(logits), [0, 1, 2])


def _closed_form(train_x, train_y, num_classes, l2):
    mean, std = train_x.mean(0), train_x.std(0) + 1e-5
    x = np.concatenate([(train_x - mean) / std, np.full((len(train_x), 1), 100.0)], 1)
    y = 2.0 * np.eye(num_classes)[train_y] - 1.0
    return np.linalg.solve(x.T @ x + l2 * np.eye(x.shape[1]), x.T @ y), mean, std


@pytest.mark.parametrize("num_train", [40, 6])  # N >= D (primal) and N < D (dual)
def test_linear_probe_matches_regularised_least_squares(num_train):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(num_train, 8))
    y = np.arange(num_train) % 3
    probe = fewshot.LinearProbe(x, y, num_classes=3, dtype="float64")
    for l2 in (0.5, 2.0**10):
        expected, mean, std = _closed_form(x, y, 3, l2)
        np.testing.assert_allclose(probe.weights(l2), expected, rtol=1e-6, atol=1e-9)
        test = rng.normal(size=(5, 8))
        design = np.concatenate([(test - mean) / std, np.full((5, 1), 100.0)], 1)
        np.testing.assert_array_equal(probe.predict(test, l2), (design @ expected).argmax(1))


def _upstream_probe_float32(x, y, num_classes, x_test, l2):
    # vmoe/evaluate/fewshot.py _precompute_cache and _eig_fewshot_acc_fn, in
    # float32 (jax without x64).
    f32 = np.float32
    x = x.astype(f32)
    mean = x.mean(0, keepdims=True)
    std = x.std(0, keepdims=True) + f32(1e-5)
    x = np.pad((x - mean) / std, ((0, 0), (0, 1)), constant_values=f32(100.0))
    y = (2.0 * np.eye(num_classes, dtype=f32)[y] - 1.0).astype(f32)
    if x.shape[0] >= x.shape[1]:
        eigs, q = np.linalg.eigh(x.T @ x)
        rhs, lhs = q.T @ (x.T @ y), q
    else:
        eigs, q = np.linalg.eigh(x @ x.T)
        rhs, lhs = q.T @ y, x.T @ q
    w = (lhs * (1.0 / (eigs + f32(l2))).reshape(1, -1)) @ rhs
    x_test = np.pad((x_test.astype(f32) - mean) / std, ((0, 0), (0, 1)),
                    constant_values=f32(100.0))
    return w, (x_test @ w).argmax(1)


@pytest.mark.parametrize("num_train", [40, 6])
def test_linear_probe_runs_in_float32_as_upstream_by_default(num_train):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(num_train, 8))
    y = np.arange(num_train) % 3
    test = rng.normal(size=(50, 8))
    probe = fewshot.LinearProbe(x, y, num_classes=3)
    for l2 in (0.5, 2.0**10):
        expected, predicted = _upstream_probe_float32(x, y, 3, test, l2)
        weights = probe.weights(l2)
        assert weights.dtype == np.float32
        np.testing.assert_allclose(weights, expected, rtol=2e-4, atol=1e-6)
        np.testing.assert_array_equal(probe.predict(test, l2), predicted)
    with pytest.raises(ValueError, match="dtype"):
        fewshot.LinearProbe(x, y, num_classes=3, dtype="float16")


def test_few_shot_evaluation_samples_shots_and_sweeps_l2():
    rng = np.random.default_rng(1)
    centers = rng.normal(size=(4, 16)) * 5
    train_y = np.repeat(np.arange(4), 10)
    test_y = np.repeat(np.arange(4), 5)
    train_x = centers[train_y] + rng.normal(size=(40, 16))
    test_x = centers[test_y] + rng.normal(size=(20, 16))
    index = fewshot.sample_shots(train_y, 5, seed=0)
    assert np.bincount(train_y[index]).tolist() == [5, 5, 5, 5]
    result = evaluation.few_shot_evaluation(
        train_x, train_y, test_x, test_y, shots=(1, 5, 25), l2_regs=(1.0, 1024.0))
    assert result["skipped"] == [25]  # classes have 10 examples
    assert result["5shot"]["accuracy"] == 1.0
    assert set(result["1shot"]["accuracy_by_l2"]) == {"1.0", "1024.0"}
    assert result["1shot"]["accuracy"] == max(result["1shot"]["accuracy_by_l2"].values())


def test_ensemble_metrics_by_hand():
    # Two members, one image each class; member 0 right on both, member 1 wrong on both.
    logits = np.log(np.array([
        [[0.9, 0.1], [0.2, 0.8]],
        [[0.3, 0.7], [0.6, 0.4]],
    ]))
    labels = np.array([0, 1])
    result = evaluation.ensemble_metrics(logits, labels)
    mean_probs = np.array([[0.55, 0.45], [0.45, 0.55]])
    assert result["ensemble"]["nll"] == pytest.approx(-np.log(0.55), abs=1e-6)  # float32
    assert result["ensemble"]["top1_accuracy"] == 1.0
    assert [m["top1_accuracy"] for m in result["members"]] == [1.0, 0.0]
    assert result["members"][1]["nll"] == pytest.approx(-np.log(0.2 * 0.4) / 2, abs=1e-9)
    assert result["member_mean"]["top1_accuracy"] == 0.5
    assert result["ensemble_gain"]["top1_accuracy"] == 0.5
    assert result["disagreement"] == 1.0
    assert result["ensemble"]["ece"] == pytest.approx(
        metrics.expected_calibration_error(mean_probs, labels))


def test_plots_write_real_pngs(tmp_path):
    probs = np.array([[0.9, 0.1], [0.3, 0.7], [0.6, 0.4]])
    path = evaluation.plot_reliability_diagram(
        metrics.calibration_bins(probs, [0, 1, 1]), tmp_path / "rel.png")
    width, height = png_size(path)
    assert width > 200 and height > 200
    stats = {
        "num_images": 2, "ensemble_size": 1, "has_class_token": True, "grid_size": [2, 2],
        "layers": {"encoderblock_1": {
            "expert_load": [0.5, 0.5], "tokens_dropped_fraction": 0.1,
            "expert_position_counts": [[1, 2, 0, 1, 1], [1, 0, 2, 1, 1]],
            "expert_class_counts": [[3, 2], [2, 3]], "class_token_counts": [5, 5]}},
    }
    width, height = png_size(evaluation.plot_routing_heatmaps(stats, tmp_path / "r.png"))
    assert width > 3 * height > 0  # three panels in one row
    sweep = {"rows": [
        {"capacity_factor": c, "batch_priority": b, "accuracy": 0.5 + c / 10,
         "tokens_dropped_fraction": 1 / (1 + c)} for c in (0.5, 1.0) for b in (False, True)]}
    assert png_size(evaluation.plot_capacity_curve(sweep, tmp_path / "c.png"))[0] > 300
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.png", "r.png", "rel.png"]
    with pytest.raises(ValueError, match="routing_statistics"):
        evaluation.plot_routing_heatmaps({}, tmp_path / "x.png")


def test_brier_score_by_hand():
    probs = np.array([[0.7, 0.2, 0.1], [0.3, 0.3, 0.4]])
    expected = ((0.3**2 + 0.2**2 + 0.1**2) + (0.3**2 + 0.7**2 + 0.4**2)) / 2
    assert metrics.brier_score(probs, [0, 1]) == pytest.approx(expected)
    result = evaluation.classification_metrics(np.log(probs), [0, 1])
    assert result["brier"] == pytest.approx(expected)


def test_kl_diversity_by_hand():
    # E3 paper §5 "KL": KL(p_m || p_m') over inputs and member pairs m < m'.
    p = np.array([[0.9, 0.1], [0.5, 0.5]])
    q = np.array([[0.6, 0.4], [0.2, 0.8]])
    logits = np.log(np.stack([p, q], axis=1))  # (B=2, N=2, C=2)
    expected = np.mean(np.sum(p * np.log(p / q), axis=-1))
    assert ensemble.kl_diversity(logits) == pytest.approx(expected)
    result = evaluation.ensemble_metrics(logits, np.array([0, 1]))
    assert result["kl_diversity"] == pytest.approx(expected)
    assert "brier" in result["ensemble"]
    assert ensemble.kl_diversity(np.log(np.stack([p, p], axis=1))) == 0.0
