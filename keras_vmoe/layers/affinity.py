"""Token-expert affinity matrices used by the sparse routers.

- `sinkhorn`: entropy-regularised optimal transport (each token has unit
  mass, each expert receives S/E), solved with log-domain Sinkhorn
  iterations for float32 stability.
- `sparsity_constrained`: the k-sparse quadratic OT plan of the routers
  study (semi-dual solved by Adam, each expert column has at most C
  non-zeros).

All functions take and return `(G, S, E)` float32 tensors.
"""

import math

from keras import ops


def sinkhorn(logits, num_iterations=20):
    """Entropy-regularised OT plan with row sums 1 and column sums S/E.

    Equivalent to the reference's kernel-mode Sinkhorn with epsilon 1
    (`K = exp(logits)`, `u = a / (K v)`, `v = b / (Kᵀ u)`), computed with
    log-domain updates.

    Args:
        logits: `(G, S, E)` router logits.
        num_iterations: int, fixed number of row/column normalisations.

    Returns:
        `(G, S, E)` transport plan.
    """
    _, group_size, num_experts = ops.shape(logits)
    log_b = math.log(group_size / num_experts)
    f = ops.zeros_like(logits[..., :1])  # (G, S, 1) token potentials
    g = ops.zeros_like(logits[:, :1, :])  # (G, 1, E) expert potentials
    for _ in range(num_iterations):
        f = -ops.logsumexp(logits + g, axis=2, keepdims=True)
        g = log_b - ops.logsumexp(logits + f, axis=1, keepdims=True)
    return ops.exp(logits + f + g)


def _sparse_simplex_projection(values, k):
    """Projects each row onto the simplex keeping at most `k` non-zeros.

    Args:
        values: `(..., S)` tensor.
        k: int, number of entries allowed to be non-zero.

    Returns:
        `(..., S)` tensor of non-negative rows summing to 1.
    """
    top, _ = ops.top_k(values, k)  # (..., k), descending
    cumulative = ops.cumsum(top, axis=-1) - 1.0
    rank = ops.arange(1, k + 1, dtype=top.dtype)
    support = ops.cast(top - cumulative / rank > 0, top.dtype)
    rho = ops.sum(support, axis=-1, keepdims=True)  # (..., 1), >= 1
    tau = ops.take_along_axis(cumulative, ops.cast(rho, "int32") - 1, axis=-1) / rho
    # Keep the k largest entries (those >= the k-th largest value) in place,
    # without materialising a (..., k, S) one-hot scatter.
    kept = values >= top[..., -1:]
    return ops.where(kept, ops.maximum(values - tau, 0.0), 0.0)


def sparsity_constrained(gates, capacity, num_steps=20, learning_rate=1e-2,
                         gamma=1.0):
    """k-sparse regularised OT plan (Liu, Puigcerver and Blondel, 2023).

    Maximises `<Π, gates> - ½‖Π‖²` with unit token mass, `S/E` expert mass
    and at most `capacity` tokens per expert, through the semi-dual
    potentials of the tokens, optimised with `num_steps` Adam steps
    (b1=0.9, b2=0.999, eps=1e-8), as the reference solver does. The gradient
    of the semi-dual is closed form (row sums of the plan minus one).

    Args:
        gates: `(G, S, E)` softmax gates (the positive utility).
        capacity: int C, non-zeros allowed per expert.
        num_steps: int, Adam steps.
        learning_rate: float, Adam learning rate.
        gamma: float, regularisation strength.

    Returns:
        `(G, S, E)` plan (each column sums to S/E; rows sum to about 1).
    """
    _, group_size, num_experts = ops.shape(gates)
    mass = group_size / num_experts  # b_r
    scale = gamma * mass
    utility = ops.transpose(ops.stop_gradient(gates), (0, 2, 1))  # (G, E, S)

    def plan_of(alpha):  # alpha (G, 1, S) -> plan (G, E, S)
        return mass * _sparse_simplex_projection((alpha + utility) / scale, capacity)

    alpha = ops.zeros_like(utility[:, :1, :])
    m = ops.zeros_like(alpha)
    v = ops.zeros_like(alpha)
    b1, b2, eps = 0.9, 0.999, 1e-8
    for step in range(1, num_steps + 1):
        grad = ops.sum(plan_of(alpha), axis=1, keepdims=True) - 1.0
        m = b1 * m + (1 - b1) * grad
        v = b2 * v + (1 - b2) * ops.square(grad)
        m_hat = m / (1 - b1**step)
        v_hat = v / (1 - b2**step)
        alpha = alpha - learning_rate * m_hat / (ops.sqrt(v_hat) + eps)
    return ops.stop_gradient(ops.transpose(plan_of(alpha), (0, 2, 1)))
