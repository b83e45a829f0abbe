"""keras_vmoe.layers.routing: router numerics against the papers.

Each test compares against a numpy formula written from the papers or the
upstream code, or against a batch without the offending input. Bad router
settings are refused at construction, by the setters and in configs, naming
the setting, the value and the valid range.
"""

import dataclasses
import math
import types

import jax
import keras
import numpy as np
import pytest
import testing
from keras import ops
from tiny_configs import tiny_moe_layer as _moe_layer

from keras_vmoe import layers
from keras_vmoe.layers import ExpertChoiceRouter
from keras_vmoe.layers import MoeLayer
from keras_vmoe.layers import TokenChoiceRouter
from keras_vmoe.layers import affinity
from keras_vmoe.layers.routing import MAX_ITERATIONS
from keras_vmoe.layers.routing import get_router


def _route(router, logits, training=False):
    """Routes `logits` `(G, S, E)` as the router logits (identity kernel),
    under `jax.jit`. Returns the `Routing` fields as a namespace."""
    num_experts = logits.shape[-1]
    if not router.built:
        router.build((None, None, num_experts))
        router.kernel.assign(np.eye(num_experts, dtype="float32"))
    variables = list(router.variables)

    def run(values, x):
        with keras.StatelessScope(state_mapping=list(zip(variables, values, strict=True))):
            routing = router(x, training=training)
        return {f.name: getattr(routing, f.name) for f in dataclasses.fields(routing)}

    fields = jax.jit(run)([v.value for v in variables],
                          ops.convert_to_tensor(logits, "float32"))
    return types.SimpleNamespace(**fields)


def _jit_layer(layer):
    """`x -> layer(x)` compiled with `jax.jit` (eager routing is slow)."""
    variables = list(layer.variables)
    values = [v.value for v in variables]

    def run(values, x):
        with keras.StatelessScope(state_mapping=list(zip(variables, values, strict=True))):
            return layer(x)

    compiled = jax.jit(run)
    return lambda x: np.asarray(compiled(values, x))


# Item 1 -----------------------------------------------------------------


def test_sparse_projection_keeps_exactly_k_of_tied_entries():
    p = np.asarray(affinity._sparse_simplex_projection(
        np.array([[1.0, 1.0, 1.0, 0.0]], "float32"), 2))
    np.testing.assert_allclose(p, [[0.5, 0.5, 0.0, 0.0]])


def test_sparsity_constrained_plan_with_duplicate_tokens():
    # Flat backgrounds: many identical tokens, integer logits, so that many
    # entries of a column tie with its k-th largest value.
    rng = np.random.default_rng(0)
    distinct = rng.integers(-2, 3, size=(2, 4, 4)).astype("float32")
    logits = np.repeat(distinct, 8, axis=1)  # (G, S=32, E=4)
    gates = np.asarray(ops.softmax(logits, axis=-1))
    capacity = 6  # not a multiple of the 8 copies: the 6th value is tied
    plan = np.asarray(affinity.sparsity_constrained(gates, capacity))
    mass = plan.sum(axis=1) / (32 / 4)  # 1 = the expert's share S/E
    assert ((plan > 0).sum(axis=1) <= capacity).all()
    assert (mass <= 1 + 1e-5).all(), mass.max()


# Item 2 -----------------------------------------------------------------


@pytest.mark.parametrize("name", ["sinkhorn_token_choice", "sinkhorn_expert_choice"])
def test_sinkhorn_routers_have_no_balancing_losses_by_default(name):
    router = get_router(name, 4)
    assert getattr(router, "importance_loss_weight", 0.0) == 0.0
    assert getattr(router, "load_loss_weight", 0.0) == 0.0
    logits = np.random.default_rng(1).normal(size=(2, 8, 4))
    routing = _route(router, logits, training=True)
    assert float(routing.auxiliary_loss) == 0.0


def test_softmax_token_choice_keeps_the_vmoe_loss_weights():
    router = TokenChoiceRouter(4)
    assert router.importance_loss_weight == router.load_loss_weight == 0.005
    explicit = TokenChoiceRouter(4, affinity="sinkhorn", importance_loss_weight=0.01)
    assert (explicit.importance_loss_weight, explicit.load_loss_weight) == (0.01, 0.0)
    config = explicit.get_config()
    assert TokenChoiceRouter.from_config(config).get_config() == config


# Item 3 -----------------------------------------------------------------


def test_sparsity_constrained_expert_choice_adds_no_training_noise():
    router = ExpertChoiceRouter(4, affinity="sparse", capacity=3, noise_std=1.0,
                                sparse_steps=3)
    logits = np.random.default_rng(2).normal(size=(2, 12, 4)) * 0.05
    trained = _route(router, logits, training=True)
    evaluated = _route(router, logits, training=False)
    np.testing.assert_array_equal(trained.buffer_token, evaluated.buffer_token)
    np.testing.assert_array_equal(trained.buffer_weight, evaluated.buffer_weight)


# Item 4 -----------------------------------------------------------------


def _np_sinkhorn(logits, num_iterations=20):
    """Upstream's kernel-mode Sinkhorn (ott, sequential updates, epsilon 1):
    columns (v) first, then rows (u), from u = v = 1."""
    plans = []
    for z in logits.astype("float64"):
        num_tokens, num_experts = z.shape
        kernel = np.exp(z)
        a = np.ones(num_tokens)
        b = np.full(num_experts, num_tokens / num_experts)
        u, v = np.ones(num_tokens), np.ones(num_experts)
        for _ in range(num_iterations):
            v = b / (kernel.T @ u)
            u = a / (kernel @ v)
        plans.append(u[:, None] * kernel * v[None, :])
    return np.stack(plans)


def test_sinkhorn_normalises_columns_then_rows_as_upstream():
    logits = (np.random.default_rng(3).normal(size=(2, 16, 4)) * 4).astype("float32")
    plan = np.asarray(affinity.sinkhorn(logits))
    expected = _np_sinkhorn(logits)
    np.testing.assert_allclose(plan, expected, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(plan.sum(-1), 1.0, atol=1e-5)  # rows last: exact


# Item 7 -----------------------------------------------------------------


@pytest.mark.parametrize("capacity_factor", [1e6, 1e300])
def test_token_choice_capacity_is_capped_at_the_group_size(capacity_factor):
    router = TokenChoiceRouter(4, num_selected_experts=2, capacity_factor=capacity_factor)
    assert router.get_capacity(32) == 32
    routing = _route(router, np.random.default_rng(4).normal(size=(1, 32, 4)))
    assert routing.buffer_token.shape == (1, 4, 32)
    assert float(routing.metrics["dropped_assignments_fraction"]) == 0.0


def test_expert_choice_capacity_above_the_group_size_is_capped():
    router = ExpertChoiceRouter(4, capacity=9)
    routing = _route(router, np.random.default_rng(5).normal(size=(1, 8, 4)))
    buffer_token = np.asarray(routing.buffer_token)
    assert routing.capacity == 8
    # Every expert takes every token exactly once.
    np.testing.assert_array_equal(np.sort(buffer_token, axis=-1),
                                  np.broadcast_to(np.arange(8), (1, 4, 8)))


# Item 9 -----------------------------------------------------------------

ROUTERS = [
    {"name": "token_choice", "num_selected_experts": 2},
    {"name": "token_choice", "num_selected_experts": 1, "batch_priority": True},
    {"name": "sinkhorn_token_choice"},
    {"name": "expert_choice"},
    {"name": "sinkhorn_expert_choice"},
    {"name": "sparse_expert_choice", "sparse_steps": 3},  # 3 steps compile faster
]


@pytest.mark.parametrize("router", ROUTERS, ids=lambda r: r["name"])
@pytest.mark.heavy
def test_a_nan_image_does_not_change_the_others(router):
    # One group of 3 images x 8 tokens; an explicit capacity makes the
    # routing of the clean images independent of the group size, so their
    # outputs must equal those of a batch without the bad image.
    x = np.random.default_rng(6).normal(size=(3, 8, 16)).astype("float32")
    layer = MoeLayer(4, 16, router={**router, "capacity": 3}, identical_init=False)
    layer(x)
    call = _jit_layer(layer)
    bad = x.copy()
    bad[1, :, ::3] = np.nan
    outputs = call(bad)
    np.testing.assert_allclose(outputs[[0, 2]], call(x[[0, 2]]), atol=1e-6)


@pytest.mark.parametrize("router", ROUTERS[2:], ids=lambda r: r["name"])
def test_an_infinite_logit_does_not_win_routing(router):
    # Tokens 8..15 have an infinite logit for expert 0: they must be
    # dropped and the others routed as if those tokens were absent.
    logits = np.random.default_rng(7).normal(size=(1, 24, 4)).astype("float32")
    bad = logits.copy()
    bad[0, 8:16, 0] = np.inf

    def make():
        return get_router({**router, "capacity": 3}, 4)

    routing = _route(make(), bad)
    clean = np.asarray(_route(make(), np.delete(logits, np.s_[8:16], axis=1)).buffer_token)
    expected = np.where(clean >= 8, clean + 8, clean)  # indices in the 24 tokens
    np.testing.assert_array_equal(routing.buffer_token, expected)


# --- The shared test base (tests/testing.py) --------------------------------

GROUPS = np.random.default_rng(0).normal(size=(2, 8, 16)).astype("float32")  # (G, S, D)


def _routing_arrays(names):
    def arrays(routing):
        return {name: getattr(routing, name) for name in names}

    return arrays


def _name(value):
    return getattr(value, "__name__", "")


SHARED_BASE_ROUTERS = [
    (layers.TokenChoiceRouter, dict(num_experts=4, num_selected_experts=2,
                                    capacity_factor=1.0),
     {"buffer_token": (2, 4, 4), "buffer_weight": (2, 4, 4),
      "token_expert": (2, 8, 2)}),
    # Capacity 8·1.0/4 = 2, rounded up to a multiple of 4.
    (layers.ExpertChoiceRouter, dict(num_experts=4, capacity_factor=1.0),
     {"buffer_token": (2, 4, 4), "buffer_weight": (2, 4, 4)}),
    (layers.SoftRouter, dict(num_experts=4, num_slots=2),
     {"combine_weights": (2, 8, 4, 2)}),
    (layers.RenormalizedTokenChoiceRouter, dict(num_experts=4, num_selected_experts=2,
                                                capacity_factor=1.0),
     {"buffer_token": (2, 4, 4), "token_weight": (2, 8, 2)}),
    # 2 members of 2 experts each, one choice per token.
    (layers.PartitionedTokenChoiceRouter, dict(num_experts=4, num_partitions=2,
                                               capacity_factor=1.0),
     {"buffer_token": (2, 4, 4), "token_expert": (2, 8, 1)}),
]


@pytest.mark.heavy
@pytest.mark.parametrize("cls,kwargs,shapes", SHARED_BASE_ROUTERS, ids=_name)
def test_routers_through_the_shared_base(cls, kwargs, shapes):
    testing.run_layer_test(
        cls, kwargs, GROUPS, shapes, call_kwargs={"training": False},
        output_fn=_routing_arrays(sorted(shapes)), run_mixed_precision=False,
    )




BAD_NOISE_STDS = [math.nan, math.inf, "abc", True, -0.5]


BAD_COUNTS = [math.nan, 1.5, True, "2", 0]  # num_selected_experts, group_size


def _check(entry_point, value, setting):
    with pytest.raises((ValueError, TypeError), match=setting):
        entry_point(value)


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
