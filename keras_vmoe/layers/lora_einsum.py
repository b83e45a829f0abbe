"""`EinsumDense` whose LoRA update has rank r over the whole projection."""

import contextlib
import math

import keras
from keras import ops

from keras_vmoe.utils import keras_internals

# loralib's Kaiming-uniform (a = √5, bound 1/√fan_in): VarianceScaling, scale 1/3.
LORA_A_INITIALIZER = {"class_name": "VarianceScaling",
                      "config": {"scale": 1.0 / 3.0, "mode": "fan_in",
                                 "distribution": "uniform"}}
LORA_MODES = (None, "int8")
# Equations that are a plain tensordot (one dot_general, no transposes).
_TENSORDOT_AXES = {"btd,dnk->btnk": ([2], [0]), "btnk,nkd->btd": ([2, 3], [0, 1])}


def lora_a_initializer():
    """A fresh loralib-style initializer of the LoRA factor A."""
    return keras.initializers.get(LORA_A_INITIALIZER)


def _free_letter(equation):
    for letter in "zyxwvutsrqponmlkjihgfedcba":
        if letter not in equation:
            return letter
    raise ValueError(f"No free einsum letter in {equation!r}.")  # pragma: no cover


@keras.saving.register_keras_serializable(package="keras_vmoe")
class LoraEinsumDense(keras.layers.EinsumDense):
    """`EinsumDense` with a LoRA update of rank r on the whole projection.

    Keras' own LoRA update has rank up to N·r on a `(D, N, K)` kernel. Here
    the kernel is read as the matrix `(contracted axes) × (output axes)`, with
    factors `A (contracted..., r)` and `B (r, output...)`, as in Hu et al.
    (2021). Works on float and int8 kernels; saving writes the merged kernel.

    Overrides Keras internals (checked against Keras 3.15.1): `kernel`,
    `_int8_call` and `_get_kernel_with_merged_lora`.
    """

    def quantize(self, mode=None, type_check=True, config=None):
        """Keras' `EinsumDense.quantize`; refused while LoRA is enabled."""
        if self.lora_enabled:
            raise ValueError(
                f"Cannot quantize {self.path!r} with LoRA enabled. Save the model "
                "(save_to_preset writes the merged kernels), reload it and quantize "
                "that; or quantize first and enable LoRA on the int8 model.")
        return super().quantize(mode, type_check=False, config=config)

    def _lora_axes(self):
        """`(input spec, contracted kernel axes, output kernel axes, output spec)`."""
        inputs, output = self.equation.split("->")
        input_spec, kernel_spec = inputs.split(",")
        contracted = "".join(a for a in kernel_spec if a not in output)
        kept = "".join(a for a in kernel_spec if a in output)
        return input_spec, contracted, kept, output

    def lora_fans(self):
        """`(fan_in, fan_out)` of the kernel read as a matrix."""
        _, contracted, kept, _ = self._lora_axes()
        shape = dict(zip(self.equation.split("->")[0].split(",")[1],
                         self._kernel.shape, strict=True))
        return (math.prod(int(shape[axis]) for axis in contracted),
                math.prod(int(shape[axis]) for axis in kept))

    def lora_factor_shapes(self, rank):
        """`{"lora_kernel_a": shape, "lora_kernel_b": shape}` at `rank`."""
        _, contracted, _, _ = self._lora_axes()
        shape = tuple(int(n) for n in self._kernel.shape)
        return {"lora_kernel_a": shape[:len(contracted)] + (rank,),
                "lora_kernel_b": (rank,) + shape[len(contracted):]}

    def enable_lora(self, rank, lora_alpha=None, a_initializer=None,
                    b_initializer="zeros"):
        """Adds `lora_kernel_a` and `lora_kernel_b` and freezes the kernel.

        Args:
            rank: int r, 1 ≤ r ≤ min(fan_in, fan_out).
            lora_alpha: float, scale numerator (default `rank`).
            a_initializer: initializer of A (default loralib's).
            b_initializer: initializer of B (default zeros).
        """
        if not self.built:
            raise ValueError("Cannot enable LoRA on a layer that is not built.")
        if self.lora_enabled:
            raise ValueError(f"LoRA is already enabled on {self.path!r}.")
        if self.quantization_mode not in LORA_MODES:
            raise NotImplementedError(
                f"LoRA on {self.path!r} supports float and int8 kernels; this one is "
                f"{self.quantization_mode!r}.")
        if (self.activation not in (None, keras.activations.linear)
                or self.kernel_constraint is not None):
            raise ValueError(
                f"LoRA on {self.path!r} needs a layer without activation or kernel "
                "constraint.")
        _, contracted, kept, _ = self._lora_axes()
        kernel_spec = self.equation.split("->")[0].split(",")[1]
        if kernel_spec != contracted + kept:
            raise NotImplementedError(
                f"LoRA on {self.path!r}: kernel axes {kernel_spec!r} must list the "
                "contracted axes before the output axes.")
        fan_in, fan_out = self.lora_fans()
        if not 1 <= rank <= min(fan_in, fan_out):
            raise ValueError(
                f"`rank` must be between 1 and min(fan_in, fan_out) = "
                f"{min(fan_in, fan_out)} for {self.path!r} (a {fan_in} × {fan_out} "
                f"projection). Received: rank={rank!r}")
        shapes = self.lora_factor_shapes(rank)
        with keras_internals.tracking_unlocked(self):
            self.lora_kernel_a = self.add_weight(
                name="lora_kernel_a", shape=shapes["lora_kernel_a"],
                initializer=(lora_a_initializer() if a_initializer is None
                             else keras.initializers.get(a_initializer)),
                dtype="float32")
            self.lora_kernel_b = self.add_weight(
                name="lora_kernel_b", shape=shapes["lora_kernel_b"],
                initializer=keras.initializers.get(b_initializer), dtype="float32")
            self._kernel.trainable = False
        self.lora_enabled = True
        self.lora_rank = rank
        self.lora_alpha = rank if lora_alpha is None else lora_alpha

    @contextlib.contextmanager
    def _parent_lora_off(self):
        """Runs the parent's code without its own (N·r) LoRA path."""
        enabled = self.lora_enabled
        self.lora_enabled = False
        try:
            yield
        finally:
            self.lora_enabled = enabled

    def lora_delta(self):
        """`(alpha/r) · A @ B`, float32 in the kernel's shape."""
        a = ops.convert_to_tensor(self.lora_kernel_a)
        b = ops.convert_to_tensor(self.lora_kernel_b)
        return (self.lora_alpha / self.lora_rank) * ops.tensordot(a, b, axes=1)

    @property
    def kernel(self):
        if not self.lora_enabled:
            return super().kernel
        with self._parent_lora_off():
            kernel = super().kernel
        return ops.cast(ops.cast(kernel, "float32") + self.lora_delta(), self.compute_dtype)

    def call(self, inputs, training=None):
        axes = _TENSORDOT_AXES.get(self.equation)
        if axes is None or self.quantization_mode is not None:
            return super().call(inputs, training=training)
        x = ops.tensordot(inputs, self.kernel, axes=axes)
        if self.bias is not None:
            x = ops.add(x, self.bias)
        if self.activation is not None:
            x = self.activation(x)
        return x

    def _int8_call(self, inputs, training=None):
        with self._parent_lora_off():
            x = super()._int8_call(inputs, training=training)
        if not self.lora_enabled:
            return x
        input_spec, contracted, kept, output = self._lora_axes()
        r = _free_letter(self.equation)
        middle = "".join(a for a in input_spec if a not in contracted) + r
        a = ops.cast(self.lora_kernel_a, self.compute_dtype)
        b = ops.cast(self.lora_kernel_b, self.compute_dtype)
        low = ops.einsum(f"{input_spec},{contracted}{r}->{middle}", inputs, a)  # (..., r)
        update = ops.einsum(f"{middle},{r}{kept}->{output}", low, b)  # the output
        return ops.cast(x + (self.lora_alpha / self.lora_rank) * update, self.compute_dtype)

    def _get_kernel_with_merged_lora(self):
        if not self.lora_enabled:
            return super()._get_kernel_with_merged_lora()
        if self.quantization_mode is None:
            return self.kernel, None, None
        scale = self._adjust_scale_for_dequant(self.kernel_scale)
        merged = ops.divide(ops.cast(self._kernel, "float32"), scale) + self.lora_delta()
        kernel, new_scale = keras.quantizers.abs_max_quantize(
            merged, axis=self._kernel_reduced_axes, to_numpy=True)
        return kernel, self._adjust_scale_for_quant(new_scale, "kernel"), None
