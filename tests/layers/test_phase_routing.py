"""`PhaseRouting`: the checked routing of one phase of an `MoeLayer`."""

import dataclasses

import numpy as np
import pytest

from keras_vmoe.layers import ExpertChoiceRouter
from keras_vmoe.layers import TokenChoiceRouter
from keras_vmoe.layers.phase_routing import PhaseRouting


@pytest.mark.parametrize("settings,message", [
    ({"num_selected_experts": 0}, r"num_selected_experts.*Received: num_selected_experts=0"),
    ({"num_selected_experts": 1.5}, r"num_selected_experts.*1\.5"),
    ({"capacity_factor": 0.0}, r"capacity_factor.*0\.0"),
    ({"capacity_factor": float("nan")}, r"capacity_factor.*nan"),
    ({"batch_priority": "yes"}, r"batch_priority.*True or False.*'yes'"),
    ({"group_size": 0}, r"group_size.*Received: group_size=0"),
    ({"images_per_group": True}, r"images_per_group.*True"),
    ({"group_size": 8, "images_per_group": 2}, r"at most one.*group_size=8.*images_per_group=2"),
])
def test_invalid_settings_are_refused_naming_the_setting_and_value(settings, message):
    with pytest.raises(ValueError, match=message):
        PhaseRouting(**settings)
    with pytest.raises(ValueError, match=message):
        PhaseRouting().replace(**settings)


def test_values_are_normalised_and_the_object_is_frozen():
    settings = PhaseRouting(num_selected_experts=np.int64(2), capacity_factor=4,
                               batch_priority=np.bool_(True), images_per_group=8)
    assert settings == PhaseRouting(2, 4.0, True, None, 8)
    assert type(settings.num_selected_experts) is int
    assert type(settings.capacity_factor) is float
    assert type(settings.batch_priority) is bool
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.capacity_factor = 2.0


def test_replace_refuses_unknown_settings_and_moves_the_group_pair():
    base = PhaseRouting(capacity_factor=1.0, group_size=16)
    with pytest.raises(ValueError, match=r"Unknown routing settings \['noise_std'\]"):
        base.replace(noise_std=0.0)
    moved = base.replace(images_per_group=2)  # setting one clears the other
    assert (moved.group_size, moved.images_per_group) == (None, 2)
    assert base.replace(capacity_factor=2.0).group_size == 16


def test_overrides_of_gives_back_the_settings_from_the_base():
    base = PhaseRouting(num_selected_experts=2, capacity_factor=1.05, group_size=16)
    evaluation = base.replace(capacity_factor=4.0, images_per_group=8)
    overrides = evaluation.overrides_of(base)
    assert overrides == {"capacity_factor": 4.0, "group_size": None, "images_per_group": 8}
    assert base.replace(**overrides) == evaluation
    assert base.overrides_of(base) == {}


def test_check_router_refuses_settings_the_router_has_not():
    token_choice = TokenChoiceRouter(4, num_selected_experts=1)
    assert PhaseRouting(num_selected_experts=4).check_router(token_choice)
    with pytest.raises(ValueError, match=r"num_selected_experts.*between 1 and 4.*"
                                         r"Received: num_selected_experts=5"):
        PhaseRouting(num_selected_experts=5).check_router(token_choice)
    expert_choice = ExpertChoiceRouter(4)
    with pytest.raises(ValueError, match=r"ExpertChoiceRouter has no `batch_priority` "
                                         r"setting \(eval_routing\)"):
        PhaseRouting(batch_priority=True).check_router(expert_choice, "eval_routing")
    assert PhaseRouting.of_router(expert_choice).num_selected_experts is None


def test_a_group_whose_token_choices_exceed_int32_is_refused():
    from keras_vmoe.layers import MoeLayer

    PhaseRouting(group_size=2**31 - 1)
    with pytest.raises(ValueError, match=r"`group_size=2147483648` with "
                       r"num_selected_experts=1 .*int32.* at most 2147483647\."):
        PhaseRouting(group_size=2**31)
    with pytest.raises(ValueError, match=r"`group_size=1000000000000` .* at most 1073741823"):
        PhaseRouting(group_size=10**12, num_selected_experts=2)
    layer = MoeLayer(4, 8, router={"num_selected_experts": 2}, group_size=8)
    with pytest.raises(ValueError, match=r"`group_size=1000000000000`"):
        layer.set_routing(group_size=10**12)
    assert layer.group_size == 8
