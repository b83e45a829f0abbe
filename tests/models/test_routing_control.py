"""keras_vmoe.models.routing_control: `set_routing` on a backbone and the
tasks wrapping it (settings, compiled functions, config, errors), and the
routing groups no batch can hold, refused before anything is allocated."""

import json

import numpy as np
import pytest
import tiny_configs

from keras_vmoe.models import VisionTransformerBackbone
from keras_vmoe.utils import memory_budget


@pytest.mark.heavy
def test_set_routing_changes_a_compiled_model(routed_model, images):
    model = routed_model
    weights = [id(v) for v in model.weights]
    before = model.predict(images, verbose=0)
    assert model.predict_function is not None

    model.set_routing(capacity_factor=0.01)
    assert model.predict_function is None
    after = model.predict(images, verbose=0)
    assert np.abs(after - before).max() > 1e-3
    assert [id(v) for v in model.weights] == weights
    dropped = model.routing_metrics(images)["encoderblock_1"]
    assert dropped["capacity"] == 4 and dropped["dropped_assignments_fraction"] > 0.5
    assert model.backbone.moe["router"]["capacity_factor"] == 0.01
    assert model.backbone.get_config()["moe"]["router"]["capacity_factor"] == 0.01

    model.set_routing(num_selected_experts=1, batch_priority=True, group_size=17)
    layer = model.backbone.get_moe_layers()[0]
    assert (layer.num_selected_experts, layer.batch_priority, layer.group_size) == (
        1, True, 17)
    model.set_routing(group_size="all")
    assert layer.group_size is None and model.backbone.moe["group_size"] is None


def test_set_routing_errors(routed_model):
    with pytest.raises(ValueError, match=r"num_selected_experts.*between 1 and 4.*5"):
        routed_model.set_routing(num_selected_experts=5)
    with pytest.raises(ValueError, match=r"capacity_factor.*> 0.*-1"):
        routed_model.set_routing(capacity_factor=-1)
    with pytest.raises(ValueError, match="group_size"):
        routed_model.set_routing(group_size=0)
    soft = VisionTransformerBackbone(**tiny_configs.soft_moe())
    with pytest.raises(ValueError, match="Soft MoE"):
        soft.set_routing(capacity_factor=2.0)
    expert_choice = VisionTransformerBackbone(
        **tiny_configs.vmoe(router={"name": "expert_choice"}))
    with pytest.raises(ValueError, match="no `num_selected_experts` setting"):
        expert_choice.set_routing(num_selected_experts=1)
    expert_choice.set_routing(capacity_factor=2.0)  # supported
    dense = VisionTransformerBackbone(**tiny_configs.vit_s16())
    with pytest.raises(ValueError, match="no MoE layers"):
        dense.set_routing(capacity_factor=2.0)


def test_set_routing_and_get_config_do_not_copy_the_model(monkeypatch):
    # `self.moe` is a Keras-tracked dict; deep-copying it would drag in the
    # tracker and serialize the whole model (seconds for a real V-MoE, and a
    # crash when a variable has no value).
    from keras.src.saving.keras_saveable import KerasSaveable

    backbone = VisionTransformerBackbone(**tiny_configs.vmoe())
    backbone.set_routing(capacity_factor=2.0)  # nested dicts now tracked too

    def no_copy(self, *args):
        raise AssertionError(f"{type(self).__name__} was copied")

    monkeypatch.setattr(KerasSaveable, "__reduce__", no_copy)
    # NumPy scalars (e.g. from a sweep over np.linspace) are accepted and
    # stored as Python numbers, so the config stays JSON-serializable.
    backbone.set_routing(
        capacity_factor=np.float32(1.5), group_size=np.int64(17),
        num_selected_experts=np.int64(1),
    )
    config = backbone.get_config()
    assert type(config["moe"]) is dict and type(config["moe"]["router"]) is dict
    assert config["moe"]["router"]["capacity_factor"] == 1.5
    assert type(config["moe"]["group_size"]) is int
    assert backbone.get_moe_layers()[0].num_selected_experts == 1
    json.dumps(config)


@pytest.mark.parametrize("family", ["vmoe", "e3"])
def test_set_routing_refuses_groups_no_batch_can_hold(family, monkeypatch):
    backbone = VisionTransformerBackbone(**getattr(tiny_configs, family)(px=16))
    before = backbone.get_config()
    tokens = 5 * backbone.ensemble_size  # 4 patches and the class token, per copy
    k = backbone.get_moe_layers()[0].num_selected_experts
    with pytest.raises(ValueError, match=rf"`images_per_group=1000000000` makes routing "
                       rf"groups of {10**9 * tokens} tokens.* at most "
                       rf"{(2**31 - 1) // k // tokens}\b"):
        backbone.set_routing(images_per_group=10**9)
    with pytest.raises(ValueError, match=r"`group_size=1000000000000` .*int32"):
        backbone.set_routing(group_size=10**12, phase="eval")
    monkeypatch.setattr(memory_budget, "memory_limit", lambda: 2**30)
    with pytest.raises(memory_budget.MemoryBudgetError,
                       match=r"routing group of 10000000 images.*: images_per_group=10000000"):
        backbone.set_routing(images_per_group=10**7)
    with pytest.raises(memory_budget.MemoryBudgetError, match=r": group_size=1000000000\."):
        backbone.set_routing(group_size=10**9)
    assert backbone.get_config() == before
    backbone.set_routing(images_per_group=1000)
    assert backbone.get_moe_layers()[0].images_per_group == 1000
