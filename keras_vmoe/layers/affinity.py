"""Token-expert affinity matrices of the sparse routers: Sinkhorn and k-sparse OT.

All functions take and return `(G, S, E)` float32 tensors.
"""

from keras import ops

from keras_vmoe.layers import allocation

# Log-mass / utility of excluded tokens: finite, so an all-invalid group has no NaN.
_EXCLUDED = -1e30


def _valid_tokens(shape, valid):
    """`(G, S)` float mask (1 = valid token) and `(G, 1, 1)` valid count."""
    if valid is None:
        mask = ops.ones(shape[:2], dtype="float32")
    else:
        mask = ops.cast(valid, "float32")
    return mask, ops.sum(mask, axis=1)[:, None, None]


def sinkhorn(logits, num_iterations=20, valid=None):
    """Entropy-regularised OT plan with row sums 1 and column sums S/E.

    The reference's Sinkhorn (`ott`, `epsilon=1`) in the log domain: each
    iteration rescales the columns, then the rows (exact row sums).

    `valid` `(G, S)` (optional): invalid tokens get zero mass.
    """
    num_experts = ops.shape(logits)[2]
    mask, count = _valid_tokens(ops.shape(logits), valid)
    log_a = ops.where(mask > 0, 0.0, _EXCLUDED)[..., None]  # (G, S, 1)
    log_b = ops.log(ops.maximum(count, 1.0) / num_experts)  # (G, 1, 1)
    f = ops.zeros_like(logits[..., :1])  # (G, S, 1) token potentials
    g = ops.zeros_like(logits[:, :1, :])  # (G, 1, E) expert potentials
    for _ in range(num_iterations):
        g = log_b - ops.logsumexp(logits + f, axis=1, keepdims=True)  # columns
        f = log_a - ops.logsumexp(logits + g, axis=2, keepdims=True)  # rows
    return ops.exp(logits + f + g)


def _sparse_simplex_projection(values, k):
    """Projects each row of `(..., S)` onto the simplex, at most `k` non-zeros."""
    top, _ = allocation.top_k(values, k)  # (..., k), descending
    cumulative = ops.cumsum(top, axis=-1) - 1.0
    rank = ops.arange(1, k + 1, dtype=top.dtype)
    support = ops.cast(top - cumulative / rank > 0, top.dtype)
    rho = ops.sum(support, axis=-1, keepdims=True)  # (..., 1), >= 1
    tau = ops.take_along_axis(cumulative, ops.cast(rho, "int32") - 1, axis=-1) / rho
    return ops.where(_top_k_mask(values, top), ops.maximum(values - tau, 0.0), 0.0)


def _top_k_mask(values, top):
    """`(..., S)` mask of exactly the `k` entries `top_k` returns (values `top`)."""
    k = ops.shape(top)[-1]
    threshold = top[..., -1:]
    above = values > threshold
    tied = values == threshold
    room = k - ops.sum(ops.cast(above, "int32"), axis=-1, keepdims=True)
    tied_rank = ops.cumsum(ops.cast(tied, "int32"), axis=-1)  # 1-based
    return ops.logical_or(above, ops.logical_and(tied, tied_rank <= room))


def sparsity_constrained(gates, capacity, num_steps=20, learning_rate=1e-2,
                         gamma=1.0, valid=None):
    """k-sparse regularised OT plan (Liu, Puigcerver and Blondel, 2023).

    Maximises `<Π, gates> - ½‖Π‖²` with at most `capacity` tokens per expert
    through the tokens' semi-dual potentials, with Adam as the reference.

    `gamma` is the regularisation strength; invalid tokens (`valid` False)
    get no mass. Each column of the plan sums to S/E, rows to about 1.
    """
    num_experts = ops.shape(gates)[2]
    mask, count = _valid_tokens(ops.shape(gates), valid)
    mass = ops.maximum(count, 1.0) / num_experts  # b_r, (G, 1, 1)
    scale = gamma * mass
    utility = ops.transpose(ops.stop_gradient(gates), (0, 2, 1))  # (G, E, S)
    if valid is not None:  # excluded tokens can never enter a column's top-k
        utility = ops.where(mask[:, None, :] > 0, utility, _EXCLUDED)

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
