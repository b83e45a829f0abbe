"""Sinkhorn and sparsity-constrained affinities against direct numpy formulas."""

import numpy as np

from keras_vmoe.layers import affinity


def _np_sparse_projection(v, k):
    out = np.zeros_like(v)
    for row in np.ndindex(v.shape[:-1]):
        x = v[row]
        idx = np.argsort(-x)[:k]
        u = x[idx]
        css = np.cumsum(u) - 1
        rho = np.nonzero(u - css / np.arange(1, k + 1) > 0)[0][-1] + 1
        out[row][idx] = np.maximum(u - css[rho - 1] / rho, 0)
    return out


def test_sparse_simplex_projection_matches_numpy():
    v = np.random.default_rng(0).normal(size=(2, 3, 11)).astype("float32")
    for k in (1, 3, 11):
        p = np.asarray(affinity._sparse_simplex_projection(v, k))
        np.testing.assert_allclose(p, _np_sparse_projection(v, k), atol=1e-6)
        np.testing.assert_allclose(p.sum(-1), 1.0, atol=1e-5)
        assert ((p > 0).sum(-1) <= k).all()


def test_sinkhorn_marginals():
    logits = np.random.default_rng(1).normal(size=(2, 12, 4)).astype("float32") * 3
    plan = np.asarray(affinity.sinkhorn(logits, num_iterations=200))
    np.testing.assert_allclose(plan.sum(-1), 1.0, atol=1e-4)
    np.testing.assert_allclose(plan.sum(1), 3.0, atol=1e-4)


def test_sparsity_constrained_plan_columns():
    gates = np.random.default_rng(2).dirichlet(np.ones(4), size=(2, 16)).astype("float32")
    plan = np.asarray(affinity.sparsity_constrained(gates, capacity=5))
    np.testing.assert_allclose(plan.sum(1), 4.0, atol=1e-4)  # S/E per expert
    assert ((plan > 0).sum(1) <= 5).all()
