"""Rematerialised encoder blocks on PyTorch and TensorFlow.

Each backend's process builds `tiny_configs.vmoe_16px_stochastic()`
(dropout and router noise on, so seeds advance and the MoE layer adds its
auxiliary loss) with and without `remat`, with equal variables, and takes
the gradient of the same loss with the backend's own autodiff
(`torch.autograd`: the backward pass really reruns the blocks, with
the global random state restored for Keras' unseeded PyTorch dropout;
`tf.GradientTape`: `tf.recompute_grad`). Outputs, auxiliary losses (one per
MoE block: the recomputation must not add them again), gradients and the
seed states after the step must equal the model's without remat. Marker
`backends`.
"""

import json

import numpy as np
import pytest
import tiny_configs

pytestmark = pytest.mark.backends

SCRIPT = r"""
import json
import keras
import numpy as np
from keras_vmoe import models

config = json.loads(__CONFIG__)
images = np.random.default_rng(0).uniform(-1, 1, (4, 16, 16, 3)).astype("float32")
keras.utils.set_random_seed(0)
plain = models.ImageClassifier(models.VisionTransformerBackbone(**config), num_classes=3)
remat = models.ImageClassifier(models.VisionTransformerBackbone(**config, remat=True),
                               num_classes=3)
rng = np.random.default_rng(1)
for a, b in zip(plain.variables, remat.variables, strict=True):
    if "seed_generator" not in a.path:
        a.assign(rng.normal(0, 0.3, a.shape).astype(a.dtype))
    b.assign(keras.ops.convert_to_numpy(a.value))


def step(model):
    backend = keras.config.backend()
    if backend == "torch":
        import torch

        # Keras' unseeded dropout draws from torch's global generator: the
        # same state for both models (checkpointing restores it to recompute).
        torch.manual_seed(0)
        logits = model(images, training=True)
        losses = list(model.losses)
        loss = keras.ops.mean(keras.ops.square(logits)) + sum(losses)
        loss.backward()
        grads = [v.value.grad for v in model.trainable_variables]
    else:
        import tensorflow as tf

        with tf.GradientTape() as tape:
            logits = model(images, training=True)
            losses = list(model.losses)
            loss = keras.ops.mean(keras.ops.square(logits)) + sum(losses)
        grads = tape.gradient(loss, [v.value for v in model.trainable_variables])
    as_list = lambda x: keras.ops.convert_to_numpy(x).tolist()
    return {"logits": as_list(logits), "losses": [as_list(x) for x in losses],
            "losses_after": len(model.losses),
            "grads": [as_list(g) for g in grads],
            "seeds": [as_list(v.value) for v in model.non_trainable_variables]}


print(json.dumps({"plain": step(plain), "remat": step(remat)}))
"""


def test_remat_matches_the_model_without_it(backend, run_script):
    config = json.dumps(tiny_configs.vmoe_16px_stochastic())
    result = run_script(backend, SCRIPT.replace("__CONFIG__", repr(config)))
    plain, remat = result["plain"], result["remat"]
    np.testing.assert_allclose(remat["logits"], plain["logits"], rtol=0, atol=1e-6)
    assert len(remat["losses"]) == len(plain["losses"]) == 1
    assert remat["losses_after"] == 1  # the backward pass added none
    np.testing.assert_allclose(remat["losses"], plain["losses"], rtol=0, atol=1e-6)
    assert len(remat["grads"]) == len(plain["grads"])
    for grad, reference in zip(remat["grads"], plain["grads"], strict=True):
        np.testing.assert_allclose(grad, reference, rtol=0, atol=1e-5)
    assert remat["seeds"] == plain["seeds"]
