"""Auxiliary load-balancing losses of V-MoE, one value per group `(G,)` as upstream.

An optional `(G, S)` boolean `mask` leaves tokens (padding) out of every sum and mean.
"""

import math

from keras import ops

from keras_vmoe.layers.allocation import partition_friendly_top_k


def _masked_mean(x, mask, axis=1):
    """Mean of `x` `(G, S, ...)` over the tokens of `mask` `(G, S)` (all if None)."""
    if mask is None:
        return ops.mean(x, axis=axis)
    weight = ops.cast(mask, x.dtype)
    weight = ops.reshape(weight, ops.shape(weight) + (1,) * (len(x.shape) - 2))
    count = ops.maximum(ops.sum(weight, axis=axis), 1.0)
    return ops.sum(x * weight, axis=axis) / count


def _squared_coefficient_of_variation(x):
    """(std / mean)² over the last axis with the population std. (G, E) -> (G,)."""
    mean = ops.mean(x, axis=-1)
    std = ops.std(x, axis=-1)
    return ops.square(std / mean)


def importance_loss(gates, mask=None):
    """Importance loss: CV² over experts of the summed clean gates `(G, S, E)`."""
    if mask is not None:
        gates = gates * ops.cast(mask, gates.dtype)[..., None]
    importance = ops.sum(gates, axis=1)  # (G, E)
    loss = _squared_coefficient_of_variation(importance)
    if mask is None:
        return loss
    return ops.where(ops.any(mask, axis=1), loss, ops.zeros_like(loss))


def load_loss(logits, logits_noisy, noise_std, num_selected_experts, mask=None):
    """Load loss: CV² of the probability that each expert is selected.

    Expert e is selected with probability `1 - Φ((threshold - logits[e]) /
    noise_std)`, the threshold being the token's k-th largest noisy logit.
    """
    num_experts = ops.shape(logits)[-1]
    _, top_index = partition_friendly_top_k(logits_noisy, num_selected_experts)  # (G, S, K)
    # A one-hot product, not a gather, as upstream (the same gradient).
    threshold_onehot = ops.one_hot(top_index[..., -1], num_experts, dtype=logits.dtype)
    threshold = ops.sum(threshold_onehot * logits_noisy, axis=-1, keepdims=True)
    z = (threshold - logits) / noise_std  # (G, S, E)
    prob = 1.0 - 0.5 * (1.0 + ops.erf(z / math.sqrt(2.0)))
    prob_mean = _masked_mean(prob, mask)  # (G, E)
    loss = _squared_coefficient_of_variation(prob_mean)
    if mask is None:
        return loss
    return ops.where(ops.any(mask, axis=1), loss, ops.zeros_like(loss))


def gshard_loss(gates, mask=None):
    """GShard loss of the routing gates: `E² · mean_e(fraction_top1 · mean_gate)`."""
    num_experts = ops.shape(gates)[-1]
    top1 = ops.one_hot(ops.argmax(gates, axis=-1), num_experts, dtype=gates.dtype)
    fraction_top1 = _masked_mean(top1, mask)  # (G, E)
    mean_gates = _masked_mean(gates, mask)  # (G, E)
    return ops.mean(fraction_top1 * mean_gates, axis=-1) * float(num_experts**2)
