"""Expert buffer capacity, computed exactly as upstream `vmoe.moe.compute_capacity`."""

import math
import numbers

from keras import ops

from keras_vmoe.layers import symbolic_sizes
from keras_vmoe.utils.validation import check_one_of

CEIL_OR_ROUND = ("ceil", "round")


def validate_real(value, name, minimum=0.0, allow_minimum=False):
    """`value` as a finite float above `minimum` (or equal, with `allow_minimum`).

    Booleans, strings, `None`, NaN and infinities are refused.
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
    """`value` as a float, finite and > 0, else a `ValueError` naming `name`.

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

    As upstream: `ceil(num_tokens * capacity_factor / num_experts)` (or
    `round`, half to even), rounded up to a multiple of `multiple_of`.

    Args:
        num_tokens: int, tokens competing for the experts (times K).
        num_experts: int, number of experts E.
        capacity_factor: float, the target ratio of total slots to tokens.
        ceil_or_round: `"ceil"` (upstream default) or `"round"`.
        multiple_of: int, round up to a multiple of it; `1` or `None`: no.
        max_capacity: int or `None`, upper bound of the result.

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
        return _symbolic_capacity(num_tokens, num_experts, capacity_factor,
                                  ceil_or_round, multiple_of, max_capacity)
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
    """`compute_capacity` of a symbolic token count, an int32 scalar tensor.

    The same float64 operations as the Python path, so the same number.
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
    return ops.maximum(capacity, 1)
