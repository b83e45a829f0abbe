"""LayerNorm computed as upstream's (flax `nn.LayerNorm`) computes it."""

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="keras_vmoe")
class LayerNorm(keras.layers.LayerNormalization):
    """`keras.layers.LayerNormalization` over the last axis, in flax's form.

    The statistics are `E[x]` and `E[x²]` in float32 (at least), with
    `var = max(E[x²] - E[x]², 0)`, and the output is
    `(x - E[x]) · (rsqrt(var + ε) · γ) + β`: the same operations, in the
    same order, as flax's `LayerNorm` (`use_fast_variance=True`), the one
    upstream's checkpoints were trained with. Keras' own layer takes the
    variance around the mean and folds the mean into an offset, which
    gives the gradient more to compute. Weights, config and the other
    axes/options are Keras' (those fall back to the parent's call).
    """

    def call(self, inputs):
        axes = self.axis if isinstance(self.axis, list) else [self.axis]
        last = len(inputs.shape) - 1
        if self.rms_scaling or [a % len(inputs.shape) for a in axes] != [last]:
            return super().call(inputs)
        x = inputs
        if keras.backend.standardize_dtype(x.dtype) in ("float16", "bfloat16"):
            x = ops.cast(x, "float32")
        # `x²` first, then the means: flax's order, which is also the order
        # in which the gradient sums its terms.
        squares = ops.square(x)
        mean = ops.mean(x, axis=-1)
        mean_of_squares = ops.mean(squares, axis=-1)
        variance = ops.maximum(mean_of_squares - ops.square(mean), 0.0)
        mean = ops.expand_dims(mean, -1)
        variance = ops.expand_dims(variance, -1)
        mul = ops.rsqrt(variance + self.epsilon)
        if self.gamma is not None:
            mul = mul * ops.cast(self.gamma, mul.dtype)
        outputs = (x - mean) * mul
        if self.beta is not None:
            outputs = outputs + ops.cast(self.beta, outputs.dtype)
        return ops.cast(outputs, self.compute_dtype)
