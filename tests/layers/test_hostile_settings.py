"""Router and layer settings nobody checked.

Every setting is validated at construction, on every assignment and when
a (possibly hostile) config is deserialized, with its name, the value and
the valid range; NaN inputs stay in their own image on every dispatch path;
layers larger than the machine are refused before the first call allocates.
"""

import keras
import numpy as np
import pytest

from keras_vmoe import budget
from keras_vmoe.layers import MoeLayer
from keras_vmoe.layers import PartitionedMoE
from keras_vmoe.layers import SoftMoE
from keras_vmoe.layers.routing import MAX_ITERATIONS
from keras_vmoe.layers.routing import ExpertChoiceRouter
from keras_vmoe.layers.routing import TokenChoiceRouter

GIB = 2**30


@pytest.fixture
def machine_16gib(monkeypatch):
    monkeypatch.delenv(budget.ALLOW_ENV, raising=False)
    monkeypatch.setattr(budget, "memory_limit", lambda: 16 * GIB)


# ----------------------------------------------------------------------
# Item 8 (and 4): one validation per setting.
# ----------------------------------------------------------------------

NAN = float("nan")
BAD_SETTINGS = [
    (TokenChoiceRouter, {"affinity": "sinkhorn"}, "sinkhorn_iterations", -5),
    (TokenChoiceRouter, {"affinity": "sinkhorn"}, "sinkhorn_iterations", 2.5),
    (TokenChoiceRouter, {"affinity": "sinkhorn"}, "sinkhorn_iterations", 10**7),
    (TokenChoiceRouter, {}, "importance_loss_weight", NAN),
    (TokenChoiceRouter, {}, "load_loss_weight", -1.0),
    (TokenChoiceRouter, {}, "gshard_loss_weight", float("inf")),
    (TokenChoiceRouter, {}, "capacity_multiple_of", -4),
    (ExpertChoiceRouter, {"affinity": "sinkhorn"}, "sinkhorn_iterations", 0),
    (ExpertChoiceRouter, {"affinity": "sparse"}, "sparse_steps", 0),
    (ExpertChoiceRouter, {"affinity": "sparse"}, "sparse_learning_rate", NAN),
    (ExpertChoiceRouter, {}, "capacity_multiple_of", 0),
]


def _message_names(error, name, value):
    message = str(error)
    assert f"`{name}`" in message and f"{name}={value!r}" in message


@pytest.mark.parametrize("cls, base, name, value", BAD_SETTINGS)
def test_bad_setting_is_refused_at_construction(cls, base, name, value):
    with pytest.raises(ValueError) as info:
        cls(4, **base, **{name: value})
    _message_names(info.value, name, value)


@pytest.mark.parametrize("cls, base, name, value", BAD_SETTINGS)
def test_bad_setting_is_refused_by_the_setter(cls, base, name, value):
    router = cls(4, **base)
    before = getattr(router, name)
    with pytest.raises(ValueError) as info:
        setattr(router, name, value)
    _message_names(info.value, name, value)
    assert getattr(router, name) == before


@pytest.mark.parametrize("cls, base, name, value", BAD_SETTINGS)
def test_bad_setting_is_refused_in_a_config(cls, base, name, value):
    config = cls(4, **base).get_config()
    config[name] = value
    # Keras wraps errors raised in `from_config` in a TypeError.
    with pytest.raises((ValueError, TypeError)) as info:
        cls.from_config(config)
    _message_names(info.value, name, value)


def test_largest_iteration_count_is_accepted():
    router = TokenChoiceRouter(4, affinity="sinkhorn", sinkhorn_iterations=MAX_ITERATIONS)
    assert router.get_config()["sinkhorn_iterations"] == MAX_ITERATIONS


@pytest.mark.parametrize(
    "router",
    [
        keras.saving.serialize_keras_object(TokenChoiceRouter(4, name="router")),
        keras.saving.serialize_keras_object(keras.layers.Dense(4)),
    ],
    ids=["token_choice_router", "dense"],
)
def test_partitioned_moe_refuses_a_non_partitioned_router(router):
    with pytest.raises(TypeError, match="PartitionedTokenChoiceRouter"):
        PartitionedMoE(num_experts=4, mlp_dim=8, num_partitions=2, router=router)


def test_partitioned_moe_refuses_a_router_of_other_partitions():
    other = PartitionedMoE(num_experts=4, mlp_dim=8, num_partitions=4).router
    config = keras.saving.serialize_keras_object(other)
    with pytest.raises(ValueError, match="num_partitions=4.*num_partitions=2"):
        PartitionedMoE(num_experts=4, mlp_dim=8, num_partitions=2, router=config)


# ----------------------------------------------------------------------
# Item 7: one NaN image stays in its image on the einsum reference path.
# ----------------------------------------------------------------------

# The dispatch path is the same for all five; the affinity variants are slow.
SPARSE_ROUTERS = [
    "token_choice",
    "expert_choice",
    pytest.param("sinkhorn_token_choice", marks=pytest.mark.slow),
    pytest.param("sinkhorn_expert_choice", marks=pytest.mark.slow),
    pytest.param("sparse_expert_choice", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("router", SPARSE_ROUTERS)
def test_einsum_dispatch_isolates_a_nan_image(router):
    keras.utils.set_random_seed(0)
    x = np.random.RandomState(0).normal(size=(4, 6, 8)).astype("float32")
    x[1] = np.nan
    index = MoeLayer(4, 16, router={"name": router, "capacity_factor": 2.0})
    einsum = MoeLayer(4, 16, router={"name": router, "capacity_factor": 2.0},
                      dispatch="einsum")
    index.build(x.shape)
    einsum.build(x.shape)
    for source, target in zip(index.weights, einsum.weights, strict=True):
        target.assign(source.value)
    expected = np.asarray(index(x))
    actual = np.asarray(einsum(x))
    others = [0, 2, 3]
    assert np.isfinite(actual[others]).all(), "the NaN image spread to the others"
    np.testing.assert_allclose(actual[others], expected[others], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------
# Item 11: layers larger than the machine are refused before allocating.
# ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, setting",
    [
        (lambda: SoftMoE(num_experts=4, mlp_dim=8, num_slots=10**9),
         "num_slots=1000000000"),
        (lambda: MoeLayer(num_experts=4, mlp_dim=10**9), "mlp_dim=1000000000"),
    ],
    ids=["soft_moe_slots", "moe_mlp_dim"],
)
def test_giant_layer_is_refused_before_the_first_call(machine_16gib, make, setting):
    layer = make()
    with pytest.raises(budget.MemoryBudgetError) as info:
        layer(np.zeros((1, 4, 16), "float32"))
    assert setting in str(info.value) and "17179869184 bytes" in str(info.value)
