"""`Routing`'s deferred losses and metrics: computed only when read, inside
the call, with the values they had when computed up front."""

import dataclasses

import keras
import numpy as np
import pytest
from keras import ops

from keras_vmoe.layers import ExpertChoiceRouter
from keras_vmoe.layers import MoeLayer
from keras_vmoe.layers import TokenChoiceRouter
from keras_vmoe.layers.routing import base
from keras_vmoe.layers.routing import expert_choice
from keras_vmoe.layers.routing import token_choice


def test_deferred_computes_once_and_only_when_read():
    calls = []

    def compute():
        calls.append(1)
        return {"a": 1.0}

    routing = base.Routing(capacity=2, metrics=base.Deferred(compute))
    assert calls == []
    assert routing.metrics == {"a": 1.0} and routing.metrics == {"a": 1.0}
    assert calls == [1]
    # Plain values pass through.
    assert base.Routing(capacity=2, metrics={"b": 2}).metrics == {"b": 2}
    assert base.resolve(3) == 3 and base.resolve(base.Deferred(lambda: 4)) == 4


def _count_calls(monkeypatch, owner, name):
    calls = []
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def _layer(router):
    keras.utils.set_random_seed(0)
    layer = MoeLayer(4, 16, router=router, name="moe")
    x = keras.random.normal((2, 8, 8), seed=1)
    layer(x)  # build
    return layer, x


@pytest.mark.heavy
def test_inference_computes_no_auxiliary_losses_or_metrics(monkeypatch):
    layer, x = _layer({"name": "token_choice", "num_selected_experts": 2})
    losses = _count_calls(monkeypatch, layer.router, "auxiliary_losses")
    metrics = _count_calls(monkeypatch, token_choice, "sparse_metrics")
    layer(x, training=False)
    assert losses == [] and metrics == []
    # Training adds the weighted losses (weights > 0): computed, metrics not.
    layer(x, training=True)
    assert losses == [1] and metrics == []
    assert len(layer.losses) == 1


@pytest.mark.heavy
def test_expert_choice_metrics_are_deferred(monkeypatch):
    layer, x = _layer({"name": "expert_choice"})
    metrics = _count_calls(monkeypatch, expert_choice, "sparse_metrics")
    layer(x, training=False)
    assert metrics == []
    _, values = layer(x, training=False, return_metrics=True)
    assert metrics == [1] and "min_selected_gate" in values


@pytest.mark.heavy
def test_returned_routing_is_materialized_with_the_same_values():
    layer, x = _layer({"name": "token_choice", "num_selected_experts": 2})
    _, routing = layer(x, training=False, return_routing=True)
    stored = {f.name: routing.__dict__[f.name] for f in dataclasses.fields(routing)}
    assert not any(isinstance(v, base.Deferred) for v in stored.values())
    # The same losses as computed directly from the router's gates.
    grouped = ops.reshape(x, (1, 16, 8))
    logits = ops.matmul(grouped, layer.router.kernel)
    gates = ops.softmax(logits, axis=-1)
    expected = layer.router.auxiliary_losses(logits, logits, gates, gates)
    for name, value in expected.items():
        np.testing.assert_allclose(ops.convert_to_numpy(routing.auxiliary_losses[name]),
                                   ops.convert_to_numpy(value), rtol=1e-6)
    assert isinstance(routing.metrics, dict) and routing.metrics


@pytest.mark.heavy
def test_zero_loss_weights_compute_no_losses(monkeypatch):
    router = TokenChoiceRouter(4, importance_loss_weight=0.0, load_loss_weight=0.0)
    calls = _count_calls(monkeypatch, router, "auxiliary_losses")
    routing = router(keras.random.normal((1, 8, 8), seed=0), training=True)
    assert routing.auxiliary_loss == 0.0 and calls == []
    assert set(routing.auxiliary_losses) >= {"importance_loss", "gshard_loss"}
    assert calls == [1]


def test_expert_choice_router_direct_call_reads_metrics_lazily():
    router = ExpertChoiceRouter(4)
    routing = router(keras.random.normal((1, 8, 8), seed=0))
    assert isinstance(routing.__dict__["metrics"], base.Deferred)
    assert "max_selected_gate" in routing.metrics
    assert not isinstance(routing.__dict__["metrics"], base.Deferred)
