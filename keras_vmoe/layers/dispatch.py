"""Dispatchers: move tokens into per-expert buffers and back.

The fast path (`gather_dispatch` + `gather_combine`/`scatter_combine`)
works on buffer indices and costs O(G·E·C·D). The one-hot einsum over a
`(G, S, E, C)` tensor (`einsum_dispatch`/`einsum_combine`) is kept only as
the reference implementation used by tests and benchmarks.

Axis letters: G groups, S tokens per group, E experts, C capacity, D hidden,
K choices per token, P slots per expert.
"""

from keras import ops


def round_to_bfloat16(x):
    """Rounds to bfloat16 and back (upstream's `bfloat16` dispatcher flag)."""
    return ops.cast(ops.cast(x, "bfloat16"), x.dtype)


def gather_dispatch(x, buffer_token):
    """Gathers tokens into expert buffers.

    Args:
        x: `(G, S, D)` tokens.
        buffer_token: `(G, E, C)` int token index per slot, S for empty.

    Returns:
        `(G, E, C, D)` buffers, zeros in empty slots.
    """
    num_groups, group_size, hidden = ops.shape(x)
    _, num_experts, capacity = ops.shape(buffer_token)
    index = ops.reshape(buffer_token, (num_groups, num_experts * capacity, 1))
    # Empty slots gather token S-1 and are zeroed after the gather, which XLA
    # fuses; padding x with a zero row first would copy all of x
    # (benchmarks/README.md, "Measurements behind the code").
    buffers = ops.take_along_axis(x, ops.minimum(index, group_size - 1), axis=1)
    buffers = ops.where(index < group_size, buffers, 0.0)  # (G, E·C, D)
    return ops.reshape(buffers, (num_groups, num_experts, capacity, hidden))


def gather_combine(y, token_expert, token_slot, token_weight):
    """Combines expert outputs by gathering each token's K slots.

    Args:
        y: `(G, E, C, D)` expert outputs.
        token_expert: `(G, S, K)` chosen experts.
        token_slot: `(G, S, K)` slots, C when dropped.
        token_weight: `(G, S, K)` combine weights (0 when dropped).

    Returns:
        `(G, S, D)` combined outputs; a dropped choice adds exactly zero.
    """
    num_groups, num_experts, capacity, hidden = ops.shape(y)
    y_flat = ops.reshape(y, (num_groups, num_experts * capacity, hidden))
    kept = token_slot < capacity  # (G, S, K)
    flat_slot = ops.where(kept, token_expert * capacity + token_slot, 0)  # (G, S, K)
    weight = ops.cast(token_weight, y.dtype)
    # One gather and a fused multiply-add per choice: an einsum over K (a
    # batched dot with a contraction of K) or a reduction over a gathered
    # (G, S, K, D) tensor fuses worse and is much slower on XLA:CPU
    # (benchmarks/README.md, "Measurements behind the code").
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
    """Combines expert outputs by scatter-adding every slot into its token.

    Used for Expert Choice, where a token may sit in any number of slots.

    Args:
        y: `(G, E, C, D)` expert outputs.
        buffer_token: `(G, E, C)` token per slot, S for empty.
        buffer_weight: `(G, E, C)` combine weight per slot.
        group_size: int S.

    Returns:
        `(G, S, D)` combined outputs.
    """
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
    """Reference one-hot tensors `(G, S, E, C)` from buffer indices.

    Returns:
        `(dispatch, combine)`, both `(G, S, E, C)`.
    """
    onehot = ops.one_hot(buffer_token, group_size + 1, dtype=buffer_weight.dtype)
    dispatch = ops.transpose(onehot[..., :group_size], (0, 3, 1, 2))  # (G, S, E, C)
    combine = dispatch * buffer_weight[:, None, :, :]
    return dispatch, combine


def _non_finite(x):
    """`(..., D) -> (...)` float: 1 where a vector holds NaN or inf."""
    return ops.cast(ops.logical_not(ops.all(ops.isfinite(x), axis=-1)), "float32")


def einsum_dispatch(x, dispatch):
    """Reference dispatch. x (G, S, D), dispatch (G, S, E, C) -> (G, E, C, D).

    As the gather path, a token with NaN/inf values only reaches the slots
    it is dispatched to: the einsum runs on finite values (`0 · NaN` would
    spread it to every slot of the group) and the slots holding a
    non-finite token are set to NaN.
    """
    finite = ops.where(ops.isfinite(x), x, ops.zeros_like(x))
    buffers = ops.einsum("gsec,gsd->gecd", ops.cast(dispatch, x.dtype), finite)
    bad_slot = ops.einsum(
        "gsec,gs->gec", ops.cast(dispatch, "float32"), _non_finite(x)
    )  # (G, E, C)
    return ops.where(bad_slot[..., None] > 0, float("nan"), buffers)


def einsum_combine(y, combine, dispatch=None):
    """Reference combine. y (G, E, C, D), combine (G, S, E, C) -> (G, S, D).

    Args:
        y: `(G, E, C, D)` expert outputs.
        combine: `(G, S, E, C)` combine weights.
        dispatch: optional `(G, S, E, C)` one-hot dispatch: a token whose
            slot holds NaN/inf outputs gets NaN, as on the gather path, and
            no other token does. Without it, non-finite outputs reach every
            token of the group (`0 · NaN`).
    """
    if dispatch is None:
        return ops.einsum("gsec,gecd->gsd", ops.cast(combine, y.dtype), y)
    finite = ops.where(ops.isfinite(y), y, ops.zeros_like(y))
    out = ops.einsum("gsec,gecd->gsd", ops.cast(combine, y.dtype), finite)
    bad_token = ops.einsum(
        "gsec,gec->gs", ops.cast(dispatch, "float32"), _non_finite(y)
    )  # (G, S)
    return ops.where(bad_token[..., None] > 0, float("nan"), out)
