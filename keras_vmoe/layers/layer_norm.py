"""LayerNorm computed as upstream's (flax `nn.LayerNorm`) computes it."""

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="keras_vmoe")
class LayerNorm(keras.layers.LayerNormalization):
    """`keras.layers.LayerNormalization` over the last axis, in flax's form.

    `(x - E[x]) · (rsqrt(max(E[x²] - E[x]², 0) + ε) · γ) + β` in float32 (at
    least): flax's operations in flax's order (`use_fast_variance=True`).
    Other axes and options fall back to Keras' call.
    """

    def call(self, inputs):
        axes = self.axis if isinstance(self.axis, list) else [self.axis]
        last = len(inputs.shape) - 1
        if self.rms_scaling or [a % len(inputs.shape) for a in axes] != [last]:
            return super().call(inputs)
        x = inputs
        if keras.backend.standardize_dtype(x.dtype) in ("float16", "bfloat16"):
            x = ops.cast(x, "float32")
        # `x²` first, then the means: flax's order.
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
