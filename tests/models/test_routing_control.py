"""keras_vmoe.models.routing_control: `set_routing` refuses routing groups
that no batch can hold, naming the argument, before anything is allocated."""

import pytest
import tiny_configs

from keras_vmoe import memory_budget
from keras_vmoe.models import VisionTransformerBackbone


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
