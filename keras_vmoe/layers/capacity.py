"""Expert buffer capacity, computed exactly as upstream `vmoe.moe.compute_capacity`.

Axis letters used across `keras_vmoe.layers`: G groups, S tokens per group
(group size), E experts, C capacity (buffer slots per expert and group),
K choices per token, D hidden size, M expert MLP size, P slots per expert
(Soft MoE), N ensemble members / partitions.
"""

import math
import numbers

from keras import ops

from keras_vmoe.layers import symbolic_sizes
from keras_vmoe.utils.validation import check_one_of

CEIL_OR_ROUND = ("ceil", "round")


def validate_real(value, name, minimum=0.0, allow_minimum=False):
    """Returns `value` as a finite Python float above `minimum`, or raises.

    The one check of the real-valued routing settings (`capacity_factor`,
    `noise_std`): booleans, strings, `None`, NaN and infinities are refused
    with a `ValueError` naming the argument, the value and the valid range.

    Args:
        value: the value to check.
        name: the argument name used in the error message.
        minimum: float, the lower bound.
        allow_minimum: bool, whether `value == minimum` is valid.

    Returns:
        `float(value)`.
    """
    bound = f">= {minimum:g}" if allow_minimum else f"> {minimum:g}"
    valid = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if valid:
        value = float(value)
        valid = math.isfinite(value) and (
            value >= minimum if allow_minimum else value > minimum
        )
    if not valid:
        raise ValueError(
            f"`{name}` must be a finite number {bound}. Received: {name}={value!r}"
        )
    return value


def validate_capacity_factor(value, name="capacity_factor"):
    """Returns a valid capacity factor as a float: finite and > 0.

    Used by the routers, `MoeLayer`, `set_routing`, preset overrides and the
    command line, so that every entry point refuses the same values.

    Args:
        value: the candidate capacity factor.
        name: the argument name used in the error message.

    Returns:
        `float(value)`.

    Raises:
        ValueError: for booleans, non-numbers, NaN, infinities and values
            <= 0.

    Examples:

    >>> validate_capacity_factor(2)
    2.0
    """
    return validate_real(value, name, minimum=0.0)


def compute_capacity(
    num_tokens,
    num_experts,
    capacity_factor,
    ceil_or_round="ceil",
    multiple_of=4,
    max_capacity=None,
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
        max_capacity: int or `None`, upper bound of the result (the routers
            pass the group size S: an expert can never receive more than S
            tokens, so larger buffers would only hold empty slots).

    Returns:
        The capacity, an `int >= 1`.

    Examples:

    >>> compute_capacity(400 * 2, 8, 1.05)
    108
    >>> compute_capacity(34, 4, 1.0, ceil_or_round="round", multiple_of=1)
    8
    """
    check_one_of(ceil_or_round, "capacity_ceil_or_round", CEIL_OR_ROUND)
    capacity_factor = validate_capacity_factor(capacity_factor)
    if not symbolic_sizes.is_static(num_tokens, 1 if max_capacity is None else max_capacity):
        return _symbolic_capacity(
            num_tokens, num_experts, capacity_factor, ceil_or_round, multiple_of,
            max_capacity,
        )
    raw = num_tokens * capacity_factor / num_experts
    if max_capacity is not None:
        raw = min(raw, max_capacity)  # also keeps huge factors from overflowing
    capacity = math.ceil(raw) if ceil_or_round == "ceil" else int(round(raw))
    if multiple_of and multiple_of > 1:
        capacity = -(-capacity // multiple_of) * multiple_of
    if max_capacity is not None:
        capacity = min(capacity, max_capacity)
    if capacity < 1:
        raise ValueError(
            f"The expert capacity must be >= 1, but num_tokens={num_tokens}, "
            f"num_experts={num_experts}, capacity_factor={capacity_factor} and "
            f"capacity_ceil_or_round={ceil_or_round!r} give capacity={capacity}. "
            "Increase `capacity_factor` or the group size, or use "
            "`capacity_ceil_or_round='ceil'`."
        )
    return capacity


def _symbolic_capacity(num_tokens, num_experts, capacity_factor, ceil_or_round,
                       multiple_of, max_capacity):
    """`compute_capacity` of a symbolic token count (a TensorFlow graph with
    an unknown batch size), as an int32 scalar tensor.

    The same float64 operations as the Python path (`int * float / int`,
    `ceil` or round-half-to-even), so the result is the same number.
    """
    raw = ops.cast(num_tokens, "float64") * capacity_factor / float(num_experts)
    if max_capacity is not None:
        raw = ops.minimum(raw, ops.cast(max_capacity, "float64"))
    capacity = ops.ceil(raw) if ceil_or_round == "ceil" else ops.round(raw)
    capacity = ops.cast(capacity, "int32")
    if multiple_of and multiple_of > 1:
        capacity = -(-capacity // multiple_of) * multiple_of
    if max_capacity is not None:
        capacity = ops.minimum(capacity, ops.cast(max_capacity, "int32"))
    # A group has at least one token, so the capacity is at least 1 whenever
    # the static checks of the settings passed.
    return ops.maximum(capacity, 1)
