"""Few-shot evaluation (`keras_vmoe.evaluation.fewshot`) as upstream / the E³ paper."""

import keras
import numpy as np
import pytest
import tiny_configs
from tiny_configs import e3_16px_classifier as _e3

from keras_vmoe import evaluation
from keras_vmoe import models
from keras_vmoe.evaluation import fewshot


@pytest.mark.heavy
def test_e3_few_shot_features_concatenate_the_members():
    # E3 paper App. A.5.1: the M member pre-logits are concatenated ("joint").
    model = _e3()
    images = np.random.default_rng(0).uniform(-1, 1, (3, 16, 16, 3)).astype("float32")
    features, _ = evaluation.pooled_features(model, images)
    members = np.asarray(model.backbone.predict_on_batch(images))  # (B·N, R)
    assert features.shape == (3, 2 * 8)
    np.testing.assert_allclose(features, members.reshape(3, 2, 8).reshape(3, 16),
                               rtol=1e-6)
    assert not np.allclose(features[:, :8], features[:, 8:])


def _upstream_shots(labels, num_classes, shots, seed, sub_seed=0):
    # Transcribed from vmoe/evaluate/fewshot.py: callback_fn's
    # permute_seed = hash((seed, sub_seed)), passed as permute_seed % 2**31 to
    # _compute_fewshot_metrics, which draws from default_rng(seed).
    rng = np.random.default_rng(hash((seed, sub_seed)) % 2**31)
    class_indices = [rng.permutation(np.where(labels == c)[0]) for c in range(num_classes)]
    return {shot: np.concatenate([idx[:shot] for idx in class_indices]) for shot in shots}


def test_shots_are_nested_and_drawn_as_upstream():
    labels = np.random.default_rng(3).integers(0, 5, 200)
    ours = fewshot.sample_shots(labels, (1, 5, 10), seed=7)
    theirs = _upstream_shots(labels, 5, (1, 5, 10), seed=7)
    for k in (1, 5, 10):
        np.testing.assert_array_equal(ours[k], theirs[k])
    assert set(ours[1]) <= set(ours[5]) <= set(ours[10])
    np.testing.assert_array_equal(fewshot.sample_shots(labels, 5, seed=7, sub_seed=2),
                                  _upstream_shots(labels, 5, (5,), seed=7, sub_seed=2)[5])
    with pytest.raises(ValueError, match="seed"):
        fewshot.sample_shots(labels, 5, seed=0.5)


def test_l2_ties_are_ranked_by_numpy_default_argsort_as_upstream():
    # vmoe/evaluate/fewshot.py _find_best_l2_reg: argsort(argsort(accuracies))
    # with numpy's default sort over upstream's 30 L2 strengths; with 30
    # values that sort is not stable, so tied accuracies do not rank in order.
    accuracies = [0.1] * 10 + [0.9] * 5 + [0.2] * 15
    table = dict(zip(fewshot.L2_REGS, accuracies, strict=True))
    ranks = np.argsort(np.argsort(np.asarray(accuracies, "float32")))
    expected = fewshot.L2_REGS[int(np.argmax(ranks))]
    assert expected == 8.0  # a stable sort would pick 16.0
    assert fewshot.best_l2_by_rank(table) == expected


def test_l2_is_chosen_by_mean_rank_largest_on_ties():
    # vmoe/evaluate/fewshot.py:294-307: ranks per dataset, argmax of the mean.
    assert fewshot.best_l2_by_rank({0.5: 0.8, 1.0: 0.9, 2.0: 0.9}) == 2.0
    a = {0.5: 0.70, 1.0: 0.60, 2.0: 0.50}   # ranks 2, 1, 0
    b = {0.5: 0.10, 1.0: 0.40, 2.0: 0.30}   # ranks 0, 2, 1
    c = {0.5: 0.20, 1.0: 0.50, 2.0: 0.45}   # ranks 0, 2, 1
    assert fewshot.best_l2_by_rank([a, b, c]) == 1.0  # mean ranks 2/3, 5/3, 2/3
    results = {name: {"1shot": {"accuracy_by_l2": {repr(k): v for k, v in t.items()}}}
               for name, t in (("a", a), ("b", b), ("c", c))}
    report = fewshot.select_l2_across_datasets(results)
    assert report["best_l2"] == {"1shot": 1.0}
    assert report["accuracy"]["a"] == {"1shot": 0.60}  # not a's own best, 0.70


@pytest.mark.heavy
def test_few_shot_probe_has_the_few_shot_datasets_classes(monkeypatch):
    # evaluate() sized the probe by the model head (10 classes); upstream
    # uses the few-shot dataset's classes (here 4).
    sizes = []

    class Recording(fewshot.LinearProbe):
        def __init__(self, features, labels, num_classes=None, **kwargs):
            sizes.append(num_classes)
            super().__init__(features, labels, num_classes, **kwargs)

    monkeypatch.setattr(fewshot, "LinearProbe", Recording)
    keras.utils.set_random_seed(0)
    config = tiny_configs.vmoe(px=16)
    model = models.ImageClassifier(models.VisionTransformerBackbone(**config),
                                   num_classes=10)
    rng = np.random.default_rng(0)
    images = rng.uniform(-1, 1, (8, 16, 16, 3)).astype("float32")
    labels = np.arange(8) % 4
    report = evaluation.evaluate(model, images, labels, capacity_factors=None,
                                 routing=False, few_shot_data=(images, labels),
                                 shots=(1, 2), l2_regs=(1.0,))
    assert set(report["few_shot"]) >= {"1shot", "2shot"}
    assert sizes == [4, 4]
