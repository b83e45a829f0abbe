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
