"""Token-expert affinity matrices used by the sparse routers.

- `sinkhorn`: entropy-regularised optimal transport (each token has unit
  mass, each expert receives S/E), solved with log-domain Sinkhorn
  iterations for float32 stability.
- `sparsity_constrained`: the k-sparse quadratic OT plan of the routers
  study (semi-dual solved by Adam, each expert column has at most C
  non-zeros).

All functions take and return `(G, S, E)` float32 tensors.
"""

from keras import ops

from keras_vmoe.layers import allocation

# Log-mass (Sinkhorn) and utility (sparse OT) of the tokens excluded from the
# plans (non-finite router logits):
# finite, so that a group without any valid token stays NaN-free.
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

    The reference's Sinkhorn (`ott` with `epsilon=1`, kernel mode, fixed
    `num_iterations`, sequential updates) computed with log-domain updates:
    starting from `u = v = 1`, every iteration first rescales the columns
    (`v = b / (Kᵀ u)`, each expert receives S/E) and then the rows
    (`u = a / (K v)`, each token has unit mass), so the returned plan has
    exact row sums and approximate column sums.

    Args:
        logits: `(G, S, E)` router logits (finite).
        num_iterations: int, fixed number of column/row normalisations.
        valid: optional `(G, S)` bool mask; invalid tokens get zero mass
            and the experts share the mass of the valid tokens only, so the
            plan of the valid tokens is the one computed without them.

    Returns:
        `(G, S, E)` transport plan.
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
    """Projects each row onto the simplex keeping at most `k` non-zeros.

    Args:
        values: `(..., S)` tensor.
        k: int, number of entries allowed to be non-zero.

    Returns:
        `(..., S)` tensor of non-negative rows summing to 1.
    """
    top, _ = allocation.top_k(values, k)  # (..., k), descending
    cumulative = ops.cumsum(top, axis=-1) - 1.0
    rank = ops.arange(1, k + 1, dtype=top.dtype)
    support = ops.cast(top - cumulative / rank > 0, top.dtype)
    rho = ops.sum(support, axis=-1, keepdims=True)  # (..., 1), >= 1
    tau = ops.take_along_axis(cumulative, ops.cast(rho, "int32") - 1, axis=-1) / rho
    return ops.where(_top_k_mask(values, top), ops.maximum(values - tau, 0.0), 0.0)


def _top_k_mask(values, top):
    """Marks exactly the `k` entries `ops.top_k` returns, in place.

    Entries above the k-th largest value are kept, and entries tied with it
    are kept in index order until `k` entries are marked (the lower index
    first, as `top_k` breaks ties), without materialising a `(..., k, S)`
    one-hot scatter.

    Args:
        values: `(..., S)` tensor.
        top: `(..., k)` its `top_k` values, descending.

    Returns:
        `(..., S)` bool mask with exactly `k` true entries per row.
    """
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
        valid: optional `(G, S)` bool mask; invalid tokens are kept out of
            every column and the experts share the mass of the valid tokens
            only.

    Returns:
        `(G, S, E)` plan (each column sums to S/E; rows sum to about 1).
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
