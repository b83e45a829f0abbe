"""keras_vmoe.models.routing_analysis: `routing_metrics` of a backbone."""

import pytest


def test_routing_metrics_in_training_mode(routed_model, images):
    metrics = routed_model.backbone.routing_metrics(images, training=True)
    assert set(metrics) == {"encoderblock_1", "auxiliary_loss"}
    assert "load_loss" in metrics["encoderblock_1"]  # noisy routing
    assert metrics["auxiliary_loss"] == pytest.approx(
        metrics["encoderblock_1"]["auxiliary_loss"])


@pytest.mark.slow
def test_routing_metrics_eager_matches_jit(routed_model, images):
    jit = routed_model.backbone.routing_metrics(images)
    eager = routed_model.backbone.routing_metrics(images, jit_compile=False)
    assert jit.keys() == eager.keys()
    for name, values in eager["encoderblock_1"].items():
        assert jit["encoderblock_1"][name] == pytest.approx(values, abs=1e-5), name
