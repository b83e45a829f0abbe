"""Allocation algorithms: turn token-expert affinities into buffer indices.

Both return indices, never the O(S·E·C) one-hot tensors: Token Choice (each
token its top-K experts, k-major, optionally Batch Prioritized) and Expert
Choice (each expert its top-C tokens).

Axis letters: G groups, S tokens per group, E experts, C capacity, K choices.
"""

import contextlib
import contextvars

import keras
from keras import ops

from keras_vmoe.layers import symbolic_sizes

_EXPORTABLE = contextvars.ContextVar("keras_vmoe_exportable_routing", default=False)


@contextlib.contextmanager
def exportable_routing():
    """Within this context, routing is built from sorts and gathers only.

    jax2tf and jax2onnx cannot take `lax.top_k` and the batched scatter; the
    sort formulations give identical outputs.
    """
    token = _EXPORTABLE.set(True)
    try:
        yield
    finally:
        _EXPORTABLE.reset(token)


def is_exportable_routing():
    """Whether `exportable_routing()` is active."""
    return _EXPORTABLE.get()


def top_k(x, k):
    """`ops.top_k` over the last axis, or its sort formulation when exporting."""
    if not _EXPORTABLE.get():
        return ops.top_k(x, k)
    # Stable argsort of -x: ties go to the lowest index, as XLA's TopK.
    index = ops.argsort(-x, axis=-1)[..., :k]
    return ops.take_along_axis(x, index, axis=-1), index


def _one_hot_int32(index, depth):
    """`ops.one_hot(..., dtype="int32")`; a comparison when exporting (for ONNX)."""
    if not _EXPORTABLE.get():
        return ops.one_hot(index, depth, dtype="int32")
    return ops.cast(ops.equal(index[..., None], ops.arange(0, depth, dtype=index.dtype)),
                    "int32")


def partition_friendly_top_k(x, k):
    """`ops.top_k` over the last axis; under a distribution, K argmaxes.

    XLA all-gathers a TopK over sharded axes; the argmaxes stay local.
    """
    if keras.distribution.distribution() is None:
        return top_k(x, k)
    values, indices = [], []
    for _ in range(k):
        index = ops.argmax(x, axis=-1)[..., None]  # (..., 1)
        values.append(ops.take_along_axis(x, index, axis=-1))
        indices.append(index)
        hit = ops.equal(ops.arange(x.shape[-1], dtype=index.dtype), index)
        x = ops.where(hit, ops.full_like(x, float("-inf")), x)
    return ops.concatenate(values, axis=-1), ops.concatenate(indices, axis=-1)


def token_choice_allocation(dispatch_gates, combine_gates, num_selected_experts,
                            capacity, batch_priority=False, valid=None):
    """Token Choice allocation with capacity, as upstream `moe.py`.

    Args:
        dispatch_gates: `(G, S, E)` affinities used to choose experts (and,
            with BPR, token priorities).
        combine_gates: `(G, S, E)` combine weights at the chosen positions.
        num_selected_experts: int K.
        capacity: int C.
        batch_priority: bool, Batch Prioritized Routing.
        valid: optional `(G, S)` bool mask; invalid tokens take no capacity.

    Returns:
        A dict with `token_expert` `(G, S, K)` int32, `token_slot` `(G, S, K)`
        int32 (`C` when the choice was dropped), `token_weight` `(G, S, K)`
        (0 when dropped), `buffer_token` `(G, E, C)` int32 (`S` for an empty
        slot) and `buffer_weight` `(G, E, C)`.
    """
    num_groups, group_size, num_experts = ops.shape(dispatch_gates)
    k = num_selected_experts
    top_gate, top_expert = partition_friendly_top_k(dispatch_gates, k)  # (G, S, K)
    top_expert = ops.cast(top_expert, "int32")
    if batch_priority:
        # Stable sort of tokens by their top-1 gate, descending.
        order = ops.argsort(-top_gate[..., 0], axis=-1)  # (G, S)
        sorted_expert = ops.take_along_axis(top_expert, order[..., None], axis=1)
    else:
        sorted_expert = top_expert
    # k-major flattening: all first choices, then all second choices, ...
    flat_expert = ops.reshape(
        ops.transpose(sorted_expert, (0, 2, 1)), (num_groups, k * group_size)
    )  # (G, K·S)
    onehot = _one_hot_int32(flat_expert, num_experts)  # (G, K·S, E)
    if valid is not None:
        sorted_valid = valid
        if batch_priority:
            sorted_valid = ops.take_along_axis(valid, order, axis=1)
        flat_valid = ops.tile(ops.cast(sorted_valid, "int32"), (1, k))  # (G, K·S)
        onehot = onehot * flat_valid[..., None]
    position = ops.sum(ops.cumsum(onehot, axis=1) * onehot, axis=-1) - 1  # (G, K·S)
    position = ops.transpose(
        ops.reshape(position, (num_groups, k, group_size)), (0, 2, 1)
    )  # (G, S, K), in priority order
    if batch_priority:
        inverse = ops.argsort(order, axis=-1)
        position = ops.take_along_axis(position, inverse[..., None], axis=1)
    kept = position < capacity  # (G, S, K)
    if valid is not None:
        kept = ops.logical_and(kept, valid[..., None])
    token_slot = ops.where(kept, position, capacity)
    if combine_gates is dispatch_gates:
        weight = top_gate
    else:
        weight = ops.take_along_axis(combine_gates, top_expert, axis=-1)
    token_weight = ops.where(kept, weight, ops.zeros_like(weight))
    buffer_token, buffer_weight = _token_to_buffer(
        top_expert, token_slot, token_weight, kept, num_experts, capacity
    )
    return {
        "token_expert": top_expert,
        "token_slot": ops.cast(token_slot, "int32"),
        "token_weight": token_weight,
        "buffer_token": buffer_token,
        "buffer_weight": buffer_weight,
    }


def _token_to_buffer(token_expert, token_slot, token_weight, kept, num_experts,
                     capacity):
    """Inverts the token -> (expert, slot) map into (expert, slot) -> token."""
    if _EXPORTABLE.get():
        return _token_to_buffer_by_sort(
            token_expert, token_slot, token_weight, kept, num_experts, capacity)
    num_groups, group_size, k = ops.shape(token_expert)
    num_buffer = num_experts * capacity
    # One extra slot per group receives every dropped choice.
    flat_slot = ops.where(kept, token_expert * capacity + token_slot, num_buffer)
    token_id = ops.broadcast_to(
        ops.arange(0, group_size, dtype="int32")[None, :, None], ops.shape(token_expert)
    )

    if keras.config.backend() != "jax":
        return _token_to_buffer_flat(flat_slot, token_id, token_weight, num_experts,
                                     capacity)

    def per_group(args):  # one group: (S·K,) slots -> (E·C + 1,) buffers
        slot, token, weight = args
        index = slot[:, None]
        return (
            ops.scatter_update(ops.full((num_buffer + 1,), group_size, "int32"),
                               index, token),
            ops.scatter_update(ops.zeros((num_buffer + 1,), weight.dtype), index, weight),
        )

    # Mapped over G: a distribution keeps the scatter local to each device.
    buffer_token, buffer_weight = ops.vectorized_map(per_group, tuple(
        ops.reshape(t, (num_groups, -1)) for t in (flat_slot, token_id, token_weight)
    ))  # (G, E·C + 1) each
    shape = (num_groups, num_experts, capacity)
    return (ops.reshape(buffer_token[:, :num_buffer], shape),
            ops.reshape(buffer_weight[:, :num_buffer], shape))


def _token_to_buffer_flat(flat_slot, token_id, token_weight, num_experts, capacity):
    """`_token_to_buffer` as one scatter over all the groups (PyTorch's `vmap`
    refuses the in-place scatter)."""
    num_groups, group_size, _ = ops.shape(flat_slot)
    per_group = num_experts * capacity + 1  # E·C slots and the dump slot
    offset = ops.arange(num_groups, dtype="int32")[:, None, None] * per_group
    index = ops.reshape(flat_slot + offset, (-1, 1))
    size = (num_groups * per_group,)
    buffer_token = ops.scatter_update(
        ops.full(size, group_size, "int32"), index, ops.reshape(token_id, (-1,))
    )
    buffer_weight = ops.scatter_update(
        ops.zeros(size, token_weight.dtype), index, ops.reshape(token_weight, (-1,))
    )
    shape = (num_groups, num_experts, capacity)

    def unflatten(t):
        return ops.reshape(ops.reshape(t, (num_groups, per_group))[:, :-1], shape)

    return unflatten(buffer_token), unflatten(buffer_weight)


def _token_to_buffer_by_sort(token_expert, token_slot, token_weight, kept,
                             num_experts, capacity):
    """`_token_to_buffer` without a scatter: a sort and gathers.

    Sorted by `e·C + slot`, slot c of expert e is choice `n_0 + ... + n_{e-1} + c`.
    """
    num_groups, group_size, k = ops.shape(token_expert)
    flat_slot = ops.where(kept, token_expert * capacity + token_slot,
                          num_experts * capacity)
    flat_slot = ops.reshape(flat_slot, (num_groups, group_size * k))  # (G, S·K)
    order = ops.cast(ops.argsort(flat_slot, axis=-1), "int32")  # (G, S·K)
    chosen = ops.where(kept, token_expert, num_experts)  # (G, S, K)
    counts = ops.sum(
        _one_hot_int32(ops.reshape(chosen, (num_groups, group_size * k)), num_experts),
        axis=1,
    )  # (G, E), dropped choices (index E) count nowhere
    start = ops.cumsum(counts, axis=-1) - counts  # (G, E)
    slots = ops.arange(0, capacity, dtype="int32")
    filled = slots[None, None, :] < counts[..., None]  # (G, E, C)
    index = ops.minimum(start[..., None] + slots[None, None, :], group_size * k - 1)
    index = ops.reshape(index, (num_groups, num_experts * capacity))
    choice = ops.take_along_axis(order, index, axis=-1)  # (G, E·C), s·K + k
    weight = ops.take_along_axis(
        ops.reshape(token_weight, (num_groups, group_size * k)), choice, axis=-1
    )
    shape = (num_groups, num_experts, capacity)
    buffer_token = ops.where(filled, ops.reshape(choice // k, shape), group_size)
    buffer_weight = ops.where(filled, ops.reshape(weight, shape), 0.0)
    return ops.cast(buffer_token, "int32"), ops.cast(buffer_weight, token_weight.dtype)


def expert_choice_allocation(dispatch_affinity, combine_gates, capacity):
    """Expert Choice allocation: each expert takes its top-C tokens (C <= S).

    Returns `buffer_token` `(G, E, C)` int32 (ranked by `dispatch_affinity`)
    and `buffer_weight` `(G, E, C)` (from `combine_gates`), as a dict.
    """
    group_size = ops.shape(dispatch_affinity)[1]
    if symbolic_sizes.is_static(capacity, group_size) and capacity > group_size:
        raise ValueError(
            f"Expert Choice capacity ({capacity}) cannot exceed the group size "
            f"({group_size}). Lower `capacity_factor`/`capacity` or increase "
            "`group_size`."
        )
    affinity_t = ops.transpose(dispatch_affinity, (0, 2, 1))  # (G, E, S)
    top_value, buffer_token = top_k(affinity_t, capacity)  # (G, E, C)
    buffer_token = ops.cast(buffer_token, "int32")
    if combine_gates is dispatch_affinity:
        buffer_weight = top_value
    else:
        buffer_weight = ops.take_along_axis(
            ops.transpose(combine_gates, (0, 2, 1)), buffer_token, axis=-1
        )
    return {"buffer_token": buffer_token, "buffer_weight": buffer_weight}
