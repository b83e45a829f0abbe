"""Expert buffer capacity, computed exactly as upstream `vmoe.moe.compute_capacity`.

Axis letters used across `keras_vmoe.layers`: G groups, S tokens per group
(group size), E experts, C capacity (buffer slots per expert and group),
K choices per token, D hidden size, M expert MLP size, P slots per expert
(Soft MoE), N ensemble members / partitions.
"""

import math

CEIL_OR_ROUND = ("ceil", "round")


def compute_capacity(
    num_tokens,
    num_experts,
    capacity_factor,
    ceil_or_round="ceil",
    multiple_of=4,
):
    """Returns the number of buffer slots per expert.

    Follows upstream: `C = ceil(num_tokens * capacity_factor / num_experts)`
    (or Python's `round`, which rounds half to even), then rounded up to a
    multiple of `multiple_of`. For Token Choice routing upstream passes
    `num_tokens = group_size * num_selected_experts`.

    Args:
        num_tokens: int, tokens competing for the experts (already multiplied
            by the number of choices per token for Token Choice).
        num_experts: int, number of experts E.
        capacity_factor: float, the target ratio of total slots to tokens.
        ceil_or_round: `"ceil"` (upstream default) or `"round"`.
        multiple_of: int, round the capacity up to a multiple of this value.
            `1` (or `None`) disables it. Upstream default is 4.

    Returns:
        The capacity, an `int >= 1`.

    Examples:

    >>> compute_capacity(400 * 2, 8, 1.05)
    108
    >>> compute_capacity(34, 4, 1.0, ceil_or_round="round", multiple_of=1)
    8
    """
    if ceil_or_round not in CEIL_OR_ROUND:
        raise ValueError(
            f"`capacity_ceil_or_round` must be one of {CEIL_OR_ROUND}. "
            f"Received: capacity_ceil_or_round={ceil_or_round!r}"
        )
    if capacity_factor is None or capacity_factor <= 0:
        raise ValueError(
            "`capacity_factor` must be a positive number. "
            f"Received: capacity_factor={capacity_factor!r}"
        )
    raw = num_tokens * capacity_factor / num_experts
    capacity = math.ceil(raw) if ceil_or_round == "ceil" else int(round(raw))
    if multiple_of and multiple_of > 1:
        capacity = -(-capacity // multiple_of) * multiple_of
    if capacity < 1:
        raise ValueError(
            f"The expert capacity must be >= 1, but num_tokens={num_tokens}, "
            f"num_experts={num_experts}, capacity_factor={capacity_factor} and "
            f"capacity_ceil_or_round={ceil_or_round!r} give capacity={capacity}. "
            "Increase `capacity_factor` or the group size, or use "
            "`capacity_ceil_or_round='ceil'`."
        )
    return capacity
