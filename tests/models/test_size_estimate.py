"""keras_vmoe.models.size_estimate: parameter estimates of backbone configs."""
# Hand-built configs: the subject is the parameter estimate of each family's paper config.

import pytest


@pytest.mark.parametrize(
    "family, variant, overrides",
    [("vmoe", "B/32", {"layout": "last2"}), ("soft_moe", "S/16", {}),
     ("vit", "B/16", {}), ("eee", "S/32", {}), ("vmoe_15b", None, {})],
)
def test_size_estimate_never_exceeds_the_real_count(family, variant, overrides):
    """The refusal compares a lower bound: no real model is refused early."""
    from keras_vmoe.models import backbone_config
    from keras_vmoe.models import count_parameters
    from keras_vmoe.models.size_estimate import backbone_sizes

    config = backbone_config(family, variant, **overrides)
    estimate, _ = backbone_sizes(config)
    real = count_parameters(config)
    assert 0.9 * real <= estimate <= real


def test_a_config_whose_routing_group_no_batch_can_hold_is_refused(monkeypatch):
    import tiny_configs

    from keras_vmoe.models.size_estimate import check_backbone
    from keras_vmoe.utils import memory_budget

    config = tiny_configs.e3(px=16)
    check_backbone(config)
    config["moe"]["eval_routing"] = {"images_per_group": 10**9}
    with pytest.raises(ValueError, match=r"`moe\['images_per_group'\]=1000000000` makes "
                       r"routing groups of 10000000000 tokens \(10 per image with its copies"):
        check_backbone(config)
    config["moe"]["eval_routing"] = {"group_size": 4 * 10**8}
    monkeypatch.setattr(memory_budget, "memory_limit", lambda: 2**30)
    with pytest.raises(memory_budget.MemoryBudgetError,
                       match=r"routing group of 40000000 images.*moe\['group_size'\]=400000000"):
        check_backbone(config)
    check_backbone(config, check_memory=False)  # an abstract build allocates nothing
