"""Routing parity with the real upstream code and the papers' test vectors."""

import json

import keras
import numpy as np
import pytest
from keras import ops

from keras_vmoe.layers import ExpertChoiceRouter
from keras_vmoe.layers import TokenChoiceRouter
from keras_vmoe.layers import compute_capacity
from keras_vmoe.layers import losses
from keras_vmoe.layers.allocation import token_choice_allocation
from keras_vmoe.layers.dispatch import dense_dispatch_tensors


def _router_from_logits(router, logits):
    """Runs `router` so that its logits equal `logits` (identity kernel)."""
    num_experts = logits.shape[-1]
    router.build((None, None, num_experts))
    router.kernel.assign(np.eye(num_experts, dtype="float32"))
    return router(ops.convert_to_tensor(logits), training=False)


def _slot_and_combine(routing, group_size, num_experts):
    """Dense (G, S, E) slot (-1 if not dispatched) and combine gate."""
    buffer_token = np.asarray(routing.buffer_token)
    buffer_weight = np.asarray(routing.buffer_weight)
    g_, e_, c_ = buffer_token.shape
    slot = -np.ones((g_, group_size, num_experts), np.int64)
    combine = np.zeros((g_, group_size, num_experts), np.float32)
    for g in range(g_):
        for e in range(e_):
            for c in range(c_):
                s = buffer_token[g, e, c]
                if s < group_size:
                    slot[g, s, e] = c
                    combine[g, s, e] = buffer_weight[g, e, c]
    return slot, combine


TOKEN_CHOICE_CASES = [
    # fixture, variant, capacity computed by upstream
    ("vmoe_tiny", "f32dispatch", 20),
    ("vmoe_tiny", "bf16dispatch", 20),
]
EXPERT_CHOICE_CASES = [
    ("vmoe_tiny_ec", "f32dispatch", {}, 12),
    ("vmoe_tiny_ec", "bf16dispatch", {}, 12),
    (
        "vmoe_tiny_ec",
        "round1_bf16dispatch",
        {"capacity_ceil_or_round": "round", "capacity_multiple_of": 1},
        8,
    ),
]
MOE_BLOCKS = ("encoderblock_1", "encoderblock_3")


def _load(upstream_dir, fixture, variant):
    inter = np.load(upstream_dir / fixture / f"intermediates_{variant}.npz")
    config = json.loads((upstream_dir / fixture / "config.json").read_text())
    return inter, config["variants"][variant]["model_config"]["encoder"]["moe"]


@pytest.mark.parametrize("fixture,variant,capacity", TOKEN_CHOICE_CASES)
@pytest.mark.parametrize("block", MOE_BLOCKS)
def test_token_choice_matches_upstream(upstream_dir, fixture, variant, capacity, block):
    inter, moe = _load(upstream_dir, fixture, variant)
    prefix = f"Encoder/{block}/Moe/Router/"
    logits = inter[prefix + "dense"]
    num_groups, group_size, num_experts = logits.shape
    dispatcher = moe["router"]["dispatcher"]
    router = TokenChoiceRouter(
        num_experts,
        num_selected_experts=moe["router"]["num_selected_experts"],
        capacity_factor=dispatcher["capacity_factor"],
        batch_priority=dispatcher["batch_priority"],
    )
    routing = _router_from_logits(router, logits)
    assert routing.capacity == capacity
    slot, combine = _slot_and_combine(routing, group_size, num_experts)
    np.testing.assert_array_equal(slot, inter[prefix + "slot"])
    np.testing.assert_array_equal(combine, inter[prefix + "combine_gate"])


@pytest.mark.parametrize("fixture,variant,kwargs,capacity", EXPERT_CHOICE_CASES)
@pytest.mark.parametrize("block", MOE_BLOCKS)
def test_expert_choice_matches_upstream(upstream_dir, fixture, variant, kwargs,
                                       capacity, block):
    inter, moe = _load(upstream_dir, fixture, variant)
    prefix = f"Encoder/{block}/Moe/Router/"
    logits = inter[prefix + "dense"]
    _, group_size, num_experts = logits.shape
    router = ExpertChoiceRouter(
        num_experts,
        capacity_factor=moe["router"]["dispatcher"]["capacity_factor"],
        **kwargs,
    )
    routing = _router_from_logits(router, logits)
    assert routing.capacity == capacity
    slot, combine = _slot_and_combine(routing, group_size, num_experts)
    np.testing.assert_array_equal(slot, inter[prefix + "slot"])
    np.testing.assert_array_equal(combine, inter[prefix + "combine_gate"])


@pytest.mark.parametrize("variant", ["f32dispatch", "bf16dispatch"])
def test_auxiliary_losses_match_upstream_metrics(upstream_dir, variant):
    inter, _ = _load(upstream_dir, "vmoe_tiny", variant)
    metrics = np.load(upstream_dir / "vmoe_tiny" / f"metrics_{variant}.npz")
    for block in MOE_BLOCKS:
        logits = inter[f"Encoder/{block}/Moe/Router/dense"]
        gates = ops.softmax(logits, axis=-1)
        np.testing.assert_allclose(
            losses.importance_loss(gates), metrics[f"{block}/importance_loss"],
            rtol=1e-5, atol=1e-7,
        )
        np.testing.assert_allclose(
            losses.gshard_loss(gates), metrics[f"{block}/gshard_loss"],
            rtol=1e-5, atol=1e-7,
        )


# vmoe.md §1.7 (upstream moe_test.py): gates (S=3, E=3), k=2, capacity=2.
GOLDEN_GATES = np.array([[0.4, 0.0, 0.2], [0.5, 0.1, 0.4], [0.3, 0.2, 0.6]], np.float32)
GOLDEN_VANILLA = [
    [[0.4, 0], [0, 0], [0, 0.2]],
    [[0, 0.5], [0, 0], [0, 0]],
    [[0, 0], [0, 0], [0.6, 0]],
]
GOLDEN_BPR = [
    [[0, 0.4], [0, 0], [0, 0]],
    [[0.5, 0], [0, 0], [0, 0.4]],
    [[0, 0], [0, 0], [0.6, 0]],
]


@pytest.mark.parametrize("bpr,expected", [(False, GOLDEN_VANILLA), (True, GOLDEN_BPR)])
def test_golden_combine_weights(bpr, expected):
    gates = ops.convert_to_tensor(GOLDEN_GATES[None])
    alloc = token_choice_allocation(gates, gates, 2, 2, batch_priority=bpr)
    _, combine = dense_dispatch_tensors(alloc["buffer_token"], alloc["buffer_weight"], 3)
    np.testing.assert_allclose(np.asarray(combine)[0], np.array(expected), atol=1e-7)


@pytest.mark.parametrize(
    "num_tokens,num_experts,cf,expected",
    [(400 * 2, 8, 1.05, 108), (1160 * 2, 8, 1.5, 436), (4616 * 2, 8, 1.5, 1732),
     (4352 * 1, 8, 1.5, 816), (34 * 2, 4, 1.0, 20), (68, 4, 1.5, 28)],
)
def test_capacity_worked_values(num_tokens, num_experts, cf, expected):
    assert compute_capacity(num_tokens, num_experts, cf) == expected


def test_capacity_round_half_to_even_and_errors():
    assert compute_capacity(34, 4, 1.0, "round", 1) == 8  # 8.5 -> 8
    assert compute_capacity(34, 4, 1.0, "ceil", 1) == 9
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        compute_capacity(4, 64, 0.1, "round", 1)
    with pytest.raises(ValueError, match="capacity_ceil_or_round"):
        compute_capacity(4, 4, 1.0, "floor")


def test_router_setting_changes_capacity():
    router = TokenChoiceRouter(8, num_selected_experts=2, capacity_factor=1.05)
    assert router.get_capacity(400) == 108
    router.num_selected_experts = 1
    assert router.get_capacity(400) == 56
    with pytest.raises(ValueError, match="num_selected_experts"):
        router.num_selected_experts = 9


@pytest.mark.heavy
def test_keras_tensor_inputs_are_float32_logits():
    router = TokenChoiceRouter(4, num_selected_experts=2)
    routing = router(keras.random.normal((2, 8, 16)))
    assert routing.token_expert.shape == (2, 8, 2)
