"""keras_vmoe.layers.capacity: a bad `capacity_factor` gets a clear error at
every entry point (layer and model parts).

One table of bad values, one table of entry points; every pair must raise a
`ValueError` (or `TypeError`) naming the setting.
"""

import math

import numpy as np
import pytest
import tiny_configs
from tiny_configs import tiny_moe_layer as _moe_layer

from keras_vmoe import presets
from keras_vmoe.layers import ExpertChoiceRouter
from keras_vmoe.layers import MoeLayer
from keras_vmoe.layers import TokenChoiceRouter
from keras_vmoe.layers import compute_capacity
from keras_vmoe.layers.capacity import validate_capacity_factor
from keras_vmoe.models import VisionTransformerBackbone

BAD_CAPACITY_FACTORS = [math.nan, math.inf, -math.inf, np.float32("nan"), "abc",
                        "2.0", True, 0.0, -1.0, [1.0]]


CAPACITY_FACTOR_ENTRY_POINTS = {
    "validate_capacity_factor": validate_capacity_factor,
    "compute_capacity": lambda v: compute_capacity(8, 4, v),
    "TokenChoiceRouter": lambda v: TokenChoiceRouter(4, capacity_factor=v),
    "ExpertChoiceRouter": lambda v: ExpertChoiceRouter(4, capacity_factor=v),
    "router attribute": lambda v: setattr(TokenChoiceRouter(4), "capacity_factor", v),
    "MoeLayer router dict": lambda v: MoeLayer(
        4, 8, router={"name": "expert_choice", "capacity_factor": v}),
    "MoeLayer attribute": lambda v: setattr(_moe_layer(), "capacity_factor", v),
    "backbone config": lambda v: VisionTransformerBackbone(**tiny_configs.vmoe(
        px=16, router={"capacity_factor": v})),
}


def _check(entry_point, value, setting):
    with pytest.raises((ValueError, TypeError), match=setting):
        entry_point(value)


@pytest.mark.parametrize("value", BAD_CAPACITY_FACTORS, ids=repr)
@pytest.mark.parametrize("entry_point", sorted(CAPACITY_FACTOR_ENTRY_POINTS))
def test_bad_capacity_factor(entry_point, value):
    _check(CAPACITY_FACTOR_ENTRY_POINTS[entry_point], value, "capacity_factor")


@pytest.mark.parametrize("value", BAD_CAPACITY_FACTORS, ids=repr)
def test_bad_capacity_factor_in_set_routing(classifier, value):
    _check(lambda v: classifier.set_routing(capacity_factor=v), value, "capacity_factor")
    assert classifier.backbone.get_moe_layers()[0].capacity_factor == 1.05


@pytest.mark.parametrize("value", [math.nan, "abc"], ids=repr)
def test_bad_capacity_factor_in_from_preset(value):
    overrides = tiny_configs.vit(px=16, num_layers=4, num_experts=4)
    _check(lambda v: presets.from_preset("vmoe_s32", load_weights=False, num_classes=3,
                                         capacity_factor=v, **overrides),
           value, "capacity_factor")
