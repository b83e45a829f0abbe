"""Bad routing settings and inputs get a clear error at every entry point
(layer and model parts).

One table of bad values per setting, one table of entry points; every pair
must raise a `ValueError` (or `TypeError`) naming the setting.
"""

import math

import keras
import numpy as np
import pytest
from tiny_configs import VIT_16PX

from keras_vmoe import presets
from keras_vmoe.layers import ExpertChoiceRouter
from keras_vmoe.layers import MoeLayer
from keras_vmoe.layers import PartitionedMoE
from keras_vmoe.layers import TokenChoiceRouter
from keras_vmoe.layers import compute_capacity
from keras_vmoe.layers.capacity import validate_capacity_factor
from keras_vmoe.models import ImageClassifier
from keras_vmoe.models import VisionTransformerBackbone
from keras_vmoe.models import backbone_config

TINY = VIT_16PX

BAD_CAPACITY_FACTORS = [math.nan, math.inf, -math.inf, np.float32("nan"), "abc",
                        "2.0", True, 0.0, -1.0, [1.0]]
BAD_NOISE_STDS = [math.nan, math.inf, "abc", True, -0.5]
BAD_COUNTS = [math.nan, 1.5, True, "2", 0]  # num_selected_experts, group_size


@pytest.fixture(scope="module")
def classifier():
    config = backbone_config("vmoe", "S/32", **TINY, num_experts=4)
    return ImageClassifier(VisionTransformerBackbone(**config), num_classes=3)


def _moe_layer():
    return MoeLayer(4, 8, router={"name": "token_choice", "num_selected_experts": 2})


CAPACITY_FACTOR_ENTRY_POINTS = {
    "validate_capacity_factor": validate_capacity_factor,
    "compute_capacity": lambda v: compute_capacity(8, 4, v),
    "TokenChoiceRouter": lambda v: TokenChoiceRouter(4, capacity_factor=v),
    "ExpertChoiceRouter": lambda v: ExpertChoiceRouter(4, capacity_factor=v),
    "router attribute": lambda v: setattr(TokenChoiceRouter(4), "capacity_factor", v),
    "MoeLayer router dict": lambda v: MoeLayer(
        4, 8, router={"name": "expert_choice", "capacity_factor": v}),
    "MoeLayer attribute": lambda v: setattr(_moe_layer(), "capacity_factor", v),
    "backbone config": lambda v: VisionTransformerBackbone(**backbone_config(
        "vmoe", "S/32", **TINY, num_experts=4, router={"capacity_factor": v})),
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
    overrides = {**TINY, "num_layers": 4, "num_experts": 4}
    _check(lambda v: presets.from_preset("vmoe_s32", load_weights=False, num_classes=3,
                                         capacity_factor=v, **overrides),
           value, "capacity_factor")


@pytest.mark.parametrize("value", BAD_NOISE_STDS, ids=repr)
@pytest.mark.parametrize("router", [TokenChoiceRouter, ExpertChoiceRouter])
def test_bad_noise_std(router, value):
    _check(lambda v: router(4, noise_std=v), value, "noise_std")
    _check(lambda v: setattr(router(4), "noise_std", v), value, "noise_std")


COUNT_ENTRY_POINTS = {
    ("num_selected_experts", "TokenChoiceRouter"): lambda v: TokenChoiceRouter(
        4, num_selected_experts=v),
    ("num_selected_experts", "MoeLayer attribute"): lambda v: setattr(
        _moe_layer(), "num_selected_experts", v),
    ("group_size", "MoeLayer"): lambda v: MoeLayer(4, 8, group_size=v),
    ("group_size", "MoeLayer attribute"): lambda v: setattr(_moe_layer(), "group_size", v),
}


@pytest.mark.parametrize("value", BAD_COUNTS, ids=repr)
@pytest.mark.parametrize("setting,entry_point", sorted(COUNT_ENTRY_POINTS))
def test_bad_counts(setting, entry_point, value):
    _check(COUNT_ENTRY_POINTS[setting, entry_point], value, setting)


@pytest.mark.parametrize("setting", ["num_selected_experts", "group_size"])
@pytest.mark.parametrize("value", BAD_COUNTS, ids=repr)
def test_bad_counts_in_set_routing(classifier, setting, value):
    _check(lambda v: classifier.set_routing(**{setting: v}), value, setting)


@pytest.mark.parametrize(
    "layer,router",
    [
        (MoeLayer, keras.layers.Dense(4)),
        (MoeLayer, ["token_choice"]),
        (PartitionedMoE, keras.layers.Dense(4)),
        (PartitionedMoE, TokenChoiceRouter(4)),  # not partitioned
    ],
    ids=["moe-dense", "moe-list", "partitioned-dense", "partitioned-token-choice"],
)
def test_a_non_router_object_is_refused_at_construction(layer, router):
    with pytest.raises(TypeError, match=r"router.*Valid names.*token_choice"):
        layer(4, 8, router=router, **({"num_partitions": 2} if layer is PartitionedMoE else {}))


def test_an_empty_batch_names_the_batch_size(classifier):
    with pytest.raises(ValueError, match="batch size 0"):
        _moe_layer()(np.zeros((0, 4, 8), "float32"))
    empty = np.zeros((0, 16, 16, 3), "float32")
    for method in (classifier.predict, classifier.backbone.predict):
        with pytest.raises(ValueError, match="batch size 0"):
            method(empty, verbose=0)
    with pytest.raises(ValueError, match="batch size 0"):
        classifier.evaluate(empty, np.zeros((0,), "int32"), verbose=0)
    # The model stays usable.
    assert classifier.predict(np.zeros((2, 16, 16, 3), "float32"), verbose=0).shape == (2, 3)
