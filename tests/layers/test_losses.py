"""Auxiliary losses against the papers' vectors and direct numpy formulas."""

import jax
import numpy as np
from keras import ops
from scipy.stats import norm

from keras_vmoe.layers import losses

IMPORTANCE_GATES = np.array(
    [[0.5, 0.4, 0.1], [0.3, 0.3, 0.4], [0.1, 0.2, 0.7], [0.8, 0.2, 0.0]], np.float32
)
LOAD_LOGITS = np.array([[0.9, 0.06, 0.04], [0.7, 0.18, 0.12], [0.85, 0.05, 0.1]], np.float32)
LOAD_NOISE = np.array(
    [[-0.037, 0.026, -0.018], [-0.074, 0.045, -0.015], [-0.067, -0.059, 0.073]], np.float32
)


def _np_cv2(x):
    return (x.std(-1) / x.mean(-1)) ** 2


def _np_load(logits, noisy, sigma, k):
    threshold = np.sort(noisy, -1)[..., -k][..., None]
    prob = 1 - norm.cdf((threshold - logits) / sigma)
    return _np_cv2(prob.mean(-2)), prob.mean(-2)


def test_importance_loss_vector():
    value = losses.importance_loss(IMPORTANCE_GATES[None])
    np.testing.assert_allclose(value, [0.03875], rtol=1e-5)


def test_gshard_loss_vector():
    np.testing.assert_allclose(losses.gshard_loss(IMPORTANCE_GATES[None]), [1.0875], rtol=1e-5)


def test_load_loss_vector():
    value = losses.load_loss(
        LOAD_LOGITS[None], (LOAD_LOGITS + LOAD_NOISE)[None], 0.1, 2
    )
    np.testing.assert_allclose(value, [0.4857386], atol=1e-6)
    _, prob_mean = _np_load(LOAD_LOGITS, LOAD_LOGITS + LOAD_NOISE, 0.1, 2)
    np.testing.assert_allclose(prob_mean, [0.99999966, 0.27771, 0.23410], atol=1e-5)


def _finite_difference(f, x, eps=1e-3):
    grad = np.zeros_like(x, dtype=np.float64)
    for idx in np.ndindex(x.shape):
        plus, minus = x.astype(np.float64).copy(), x.astype(np.float64).copy()
        plus[idx] += eps
        minus[idx] -= eps
        grad[idx] = (f(plus) - f(minus)) / (2 * eps)
    return grad


def test_loss_values_and_gradients_match_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 6, 4)).astype(np.float32)
    noise = (0.25 * rng.normal(size=logits.shape)).astype(np.float32)

    def np_importance(z):
        e = np.exp(z - z.max(-1, keepdims=True))
        return _np_cv2((e / e.sum(-1, keepdims=True)).sum(-2)).sum()

    def np_load(z):
        return _np_load(z, z + noise, 0.25, 2)[0].sum()

    def keras_importance(z):
        return ops.sum(losses.importance_loss(ops.softmax(z, axis=-1)))

    def keras_load(z):
        return ops.sum(losses.load_loss(z, z + noise, 0.25, 2))

    for keras_fn, np_fn in [(keras_importance, np_importance), (keras_load, np_load)]:
        np.testing.assert_allclose(keras_fn(logits), np_fn(logits), rtol=1e-5)
        grad = jax.grad(keras_fn)(logits)
        np.testing.assert_allclose(grad, _finite_difference(np_fn, logits), atol=2e-4, rtol=2e-3)
