"""Dispatchers: move tokens into per-expert buffers and back.

The gather/scatter path works on buffer indices (O(G·E·C·D)); the one-hot
einsums over `(G, S, E, C)` are the reference.

Axis letters: G groups, S tokens per group, E experts, C capacity, D hidden,
K choices per token, P slots per expert.
"""

from keras import ops


def round_to_bfloat16(x):
    """Rounds to bfloat16 and back (upstream's `bfloat16` dispatcher flag)."""
    return ops.cast(ops.cast(x, "bfloat16"), x.dtype)


def gather_dispatch(x, buffer_token):
    """Tokens x `(G, S, D)` into buffers `(G, E, C, D)`, zeros in empty slots.

    `buffer_token` `(G, E, C)` holds the token of each slot, S for empty.
    """
    num_groups, group_size, hidden = ops.shape(x)
    _, num_experts, capacity = ops.shape(buffer_token)
    index = ops.reshape(buffer_token, (num_groups, num_experts * capacity, 1))
    # Empty slots gather token S-1, zeroed after (padding x would copy it).
    buffers = ops.take_along_axis(x, ops.minimum(index, group_size - 1), axis=1)
    buffers = ops.where(index < group_size, buffers, 0.0)  # (G, E·C, D)
    return ops.reshape(buffers, (num_groups, num_experts, capacity, hidden))


def gather_combine(y, token_expert, token_slot, token_weight):
    """Expert outputs y `(G, E, C, D)` -> `(G, S, D)`, gathering each token's K slots.

    `token_*` are `(G, S, K)`; a dropped choice (slot C) adds exactly zero.
    """
    num_groups, num_experts, capacity, hidden = ops.shape(y)
    y_flat = ops.reshape(y, (num_groups, num_experts * capacity, hidden))
    kept = token_slot < capacity  # (G, S, K)
    flat_slot = ops.where(kept, token_expert * capacity + token_slot, 0)  # (G, S, K)
    weight = ops.cast(token_weight, y.dtype)
    # One gather and multiply-add per choice: fuses best on XLA:CPU.
    combined = None
    for choice in range(ops.shape(token_slot)[-1]):
        index = flat_slot[:, :, choice, None]  # (G, S, 1)
        gathered = ops.take_along_axis(y_flat, index, axis=1)  # (G, S, D)
        term = ops.where(
            kept[:, :, choice, None], gathered * weight[:, :, choice, None], 0.0
        )
        combined = term if combined is None else combined + term
    return combined


def scatter_combine(y, buffer_token, buffer_weight, group_size):
    """Expert outputs y `(G, E, C, D)` -> `(G, S, D)`, scatter-adding every slot."""
    num_groups, num_experts, capacity, hidden = ops.shape(y)
    weighted = y * ops.cast(buffer_weight, y.dtype)[..., None]  # (G, E, C, D)
    offset = ops.arange(0, num_groups, dtype="int32")[:, None, None] * (group_size + 1)
    segment = ops.reshape(buffer_token + offset, (-1,))
    out = ops.segment_sum(
        ops.reshape(weighted, (-1, hidden)), segment,
        num_segments=num_groups * (group_size + 1),
    )  # (G·(S+1), D)
    return ops.reshape(out, (num_groups, group_size + 1, hidden))[:, :group_size]


def dense_dispatch_tensors(buffer_token, buffer_weight, group_size):
    """Reference one-hot `(dispatch, combine)` tensors `(G, S, E, C)`."""
    onehot = ops.one_hot(buffer_token, group_size + 1, dtype=buffer_weight.dtype)
    dispatch = ops.transpose(onehot[..., :group_size], (0, 3, 1, 2))  # (G, S, E, C)
    combine = dispatch * buffer_weight[:, None, :, :]
    return dispatch, combine


def _non_finite(x):
    """`(..., D) -> (...)` float: 1 where a vector holds NaN or inf."""
    return ops.cast(ops.logical_not(ops.all(ops.isfinite(x), axis=-1)), "float32")


def einsum_dispatch(x, dispatch):
    """Reference dispatch. x (G, S, D), dispatch (G, S, E, C) -> (G, E, C, D).

    A NaN/inf token only reaches its own slots, as on the gather path.
    """
    finite = ops.where(ops.isfinite(x), x, ops.zeros_like(x))
    buffers = ops.einsum("gsec,gsd->gecd", ops.cast(dispatch, x.dtype), finite)
    bad_slot = ops.einsum("gsec,gs->gec", ops.cast(dispatch, "float32"), _non_finite(x))
    return ops.where(bad_slot[..., None] > 0, float("nan"), buffers)


def einsum_combine(y, combine, dispatch=None):
    """Reference combine. y (G, E, C, D), combine (G, S, E, C) -> (G, S, D).

    With `dispatch`, only tokens whose slots hold NaN/inf get NaN.
    """
    if dispatch is None:
        return ops.einsum("gsec,gecd->gsd", ops.cast(combine, y.dtype), y)
    finite = ops.where(ops.isfinite(y), y, ops.zeros_like(y))
    out = ops.einsum("gsec,gecd->gsd", ops.cast(combine, y.dtype), finite)
    bad_token = ops.einsum(
        "gsec,gec->gs", ops.cast(dispatch, "float32"), _non_finite(y))
    return ops.where(bad_token[..., None] > 0, float("nan"), out)
