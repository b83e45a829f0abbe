"""E expert MLPs stored as fused, expert-major weights."""

import math
import random

import keras
import ml_dtypes
import numpy as np
from keras import ops

from keras_vmoe.distribution.sharding import constrain_expert_major
from keras_vmoe.distribution.sharding import constrain_groups
from keras_vmoe.distribution.validation import mesh_sizes
from keras_vmoe.layers.dropout import apply_dropout
from keras_vmoe.layers.lora_einsum import lora_a_initializer
from keras_vmoe.utils import initialization
from keras_vmoe.utils import keras_internals
from keras_vmoe.utils.backend import compute_platform
from keras_vmoe.utils.validation import check_one_of

# Upstream's tanh-approximated GELU and PyTorch's exact (erf) GELU.
ACTIVATIONS = ("gelu_tanh", "gelu")


def check_activation(activation, name="mlp_activation"):
    """`activation` if it is one of `ACTIVATIONS`, else a `ValueError` naming `name`."""
    return check_one_of(activation, name, ACTIVATIONS)


def mlp_activation(x, activation):
    """The hidden activation of an MLP: `"gelu_tanh"` or `"gelu"` (exact, erf)."""
    return keras.activations.gelu(x, approximate=activation == "gelu_tanh")


@keras.saving.register_keras_serializable(package="keras_vmoe")
class ExpertsInitializer(keras.initializers.Initializer):
    """Initialises an `(E, ...)` stacked weight with the fans of one expert.

    Args:
        initializer: initializer of one expert's weight.
        identical: bool, give every expert the same values (upstream default).
        seed: int, base seed of the independent draws.
    """

    def __init__(self, initializer="glorot_uniform", identical=True, seed=None):
        self.initializer = keras.initializers.get(initializer)
        self.identical = identical
        self.seed = seed

    def __call__(self, shape, dtype=None):
        num_experts, expert_shape = shape[0], tuple(shape[1:])
        if self.identical:
            one = self.initializer(expert_shape, dtype=dtype)
            # Not a broadcast view: PyTorch's stride-0 view refuses `assign`.
            return ops.tile(one[None], (num_experts,) + (1,) * len(expert_shape))
        base = self.seed if self.seed is not None else random.randint(0, 2**30)
        slices = [seeded_copy(self.initializer, base + index)(expert_shape, dtype=dtype)
                  for index in range(num_experts)]
        return ops.stack(slices, axis=0)

    def batched_draw(self, shape, dtype):
        """`__call__`'s draw, deferred (`utils.initialization.Draw`), or None."""
        num_experts, expert_shape = shape[0], tuple(shape[1:])
        one = initialization.draw_of(self.initializer, expert_shape, dtype)
        if one is None:
            return None
        if self.identical:
            return one.tile(num_experts)
        base = self.seed if self.seed is not None else random.randint(0, 2**30)
        return initialization.Draw.stack([
            initialization.draw_of(seeded_copy(self.initializer, base + index),
                                   expert_shape, dtype)
            for index in range(num_experts)])

    def get_config(self):
        return {"initializer": keras.initializers.serialize(self.initializer),
                "identical": self.identical, "seed": self.seed}


def seeded_copy(initializer, seed):
    """A fresh copy of a Keras initializer that draws with `seed`."""
    # Not `keras.initializers.serialize`: it imports TensorFlow when installed.
    fresh = type(initializer).from_config(initializer.get_config())
    if hasattr(fresh, "seed"):
        fresh.seed = seed
    return fresh


def quantize_expert_bank(kernel):
    """`(int8 (E, in, out), float32 scales (E, out))`, abs-max per output channel."""
    kernel = np.asarray(kernel, dtype=np.float32)
    scale = np.max(np.abs(kernel), axis=1) / 127.0  # (E, out)
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = np.clip(np.round(kernel / scale[:, None, :]), -127, 127).astype(np.int8)
    return q, scale


IMPLEMENTATIONS = ("auto", "loop", "batched")
# When `implementation="auto"` loops (`Experts.uses_loop`); from the
# measurements in benchmarks/README.md, "Expert path by shape".
LOOP_MIN_ROWS = 128
LOOP_MIN_HIDDEN_BYTES = 24 * 2**20
LOOP_PLATFORMS = ("cpu",)


@keras.saving.register_keras_serializable(package="keras_vmoe")
class Experts(keras.layers.Layer):
    """E two-layer MLPs applied to per-expert buffers, expert by expert or batched.

    Weights `kernel_0` `(E, D, M)`, `bias_0` `(E, M)`, `kernel_1` `(E, M, D)`,
    `bias_1` `(E, D)`; each expert is upstream's `MlpBlock`.

    Args:
        num_experts: int E.
        mlp_dim: int M, the expert MLP size.
        dropout_rate: float, expert dropout.
        identical_init: bool, all experts start from the same weights.
        kernel_initializer: initializer of one expert's kernels.
        bias_initializer: initializer of one expert's biases.
        activation: `"gelu_tanh"` (upstream's, the default) or `"gelu"` (exact).
        implementation: `"loop"` (one expert at a time, `ops.scan`),
            `"batched"` (batched matmuls over all experts) or `"auto"`
            (default: see `uses_loop`). Both give the same numbers.
        **kwargs: base layer arguments.

    Call arguments:
        x: `(..., E, C, D)` buffers.

    Examples:

    >>> experts = Experts(num_experts=4, mlp_dim=96)
    >>> experts(keras.random.normal((2, 4, 12, 48))).shape
    (2, 4, 12, 48)
    """

    def __init__(
        self,
        num_experts,
        mlp_dim=None,
        dropout_rate=0.0,
        identical_init=True,
        kernel_initializer="glorot_uniform",
        bias_initializer=None,
        implementation="auto",
        activation="gelu_tanh",
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.activation = check_activation(activation, "activation")
        check_one_of(implementation, "implementation", IMPLEMENTATIONS)
        self.implementation = implementation
        self.num_experts = num_experts
        self.mlp_dim = mlp_dim
        self.dropout_rate = dropout_rate
        self.identical_init = identical_init
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(
            bias_initializer or keras.initializers.RandomNormal(stddev=1e-6))
        # An int8 bank ("int8_from_float32") keeps a float dropout.
        float_policy = self.dtype_policy.name.split("_from_")[-1]
        self.dropout = keras.layers.Dropout(dropout_rate, name="dropout", dtype=float_policy)

    def expert_sharding(self):
        """`(mesh_axis, mesh)` the active distribution shards experts over, or None."""
        dist = keras.distribution.distribution()
        layout_map = keras_internals.distribution_layout_map(dist)
        if layout_map is None:
            return None
        layout = layout_map[f"{self.path}/kernel_0"]
        if layout is None or not layout.axes or layout.axes[0] is None:
            return None
        return layout.axes[0], layout_map.device_mesh

    def _constrain_to_experts(self, x):
        """Shards an expert-major `(E, G·C, D)` tensor like the expert weights."""
        sharding = self.expert_sharding()
        if sharding is None:
            return x
        return constrain_expert_major(x, *sharding)

    def build(self, input_shape):
        hidden = input_shape[-1]
        e, m = self.num_experts, self.mlp_dim
        sharding = self.expert_sharding()
        size = mesh_sizes(sharding[1])[sharding[0]] if sharding else 1
        if e % size:
            raise ValueError(
                f"Layer {self.path!r} has num_experts={e}, which is not divisible "
                f"by the '{sharding[0]}' mesh axis of size {size} that the layout "
                f"map shards experts over. Use a number of experts that is a "
                f"multiple of {size}, or a smaller expert mesh axis.")

        def init(base):
            # A Keras initializer instance draws the same values on every call.
            fresh = seeded_copy(base, random.randint(0, 2**30))
            return ExpertsInitializer(fresh, identical=self.identical_init)

        if self.quantization_mode == "int8":
            self._int8_build(hidden)
            return
        for name, shape, base in (
                ("kernel_0", (e, hidden, m), self.kernel_initializer),
                ("bias_0", (e, m), self.bias_initializer),
                ("kernel_1", (e, m, hidden), self.kernel_initializer),
                ("bias_1", (e, hidden), self.bias_initializer)):
            setattr(self, name, self.add_weight(name=name, shape=shape,
                                                initializer=init(base)))

    def _int8_build(self, hidden):
        """int8 `kernel_i` `(E, in, out)` with float32 `kernel_i_scale` `(E, out)`."""
        # The same variable order (saved by index) whether loaded or quantized.
        e, m = self.num_experts, self.mlp_dim
        for index, shape in ((0, (e, hidden, m)), (1, (e, m, hidden))):
            name = f"kernel_{index}"
            setattr(self, name, self.add_weight(
                name=name, shape=shape, initializer="zeros", dtype="int8",
                trainable=False))
            setattr(self, f"{name}_scale", self.add_weight(
                name=f"{name}_scale", shape=(e, shape[-1]), initializer="ones",
                trainable=False))
            setattr(self, f"bias_{index}", self.add_weight(
                name=f"bias_{index}", shape=(e, shape[-1]), initializer="zeros"))

    def quantize(self, mode=None, type_check=True, config=None):
        """Weight-only int8 expert kernels, abs-max per expert and output channel.

        Args:
            mode: `"int8"` (the only mode supported here).
            type_check: unused (Keras' signature).
            config: ignored.
        """
        if mode != "int8":
            raise NotImplementedError(
                f"Layer {self.name!r} (Experts) supports quantize('int8') only. "
                f"Received: mode={mode!r}")
        keras_internals.check_quantize_args(self, mode, self.compute_dtype)
        hidden = self.kernel_0.shape[1]
        values = {}
        for index in (0, 1):
            name = f"kernel_{index}"
            values[name] = quantize_expert_bank(ops.convert_to_numpy(getattr(self, name)))
            values[f"bias_{index}"] = ops.convert_to_numpy(getattr(self, f"bias_{index}"))
        for name in ("kernel_0", "bias_0", "kernel_1", "bias_1"):
            delattr(self, name)
        with keras_internals.tracking_unlocked(self):
            self._int8_build(hidden)
        for index in (0, 1):
            q, scale = values[f"kernel_{index}"]
            getattr(self, f"kernel_{index}").assign(q)
            getattr(self, f"kernel_{index}_scale").assign(scale)
            getattr(self, f"bias_{index}").assign(values[f"bias_{index}"])
        self._is_quantized = True  # before the policy: its setter would quantize again
        self.dtype_policy = keras.dtype_policies.get(f"int8_from_{self.dtype_policy.name}")

    def _dequantize(self, q, scale):
        """An int8 kernel `(..., in, out)` and its scales in the compute dtype."""
        q = ops.cast(q, self.compute_dtype)
        return q * ops.expand_dims(ops.cast(scale, self.compute_dtype), -2)  # (..., in, out)

    def _float_kernels(self):
        """`(kernel_0, kernel_1)` in the compute dtype (dequantized if int8)."""
        if self.quantization_mode != "int8":
            return self.kernel_0, self.kernel_1
        return tuple(self._dequantize(getattr(self, name), getattr(self, f"{name}_scale"))
                     for name in ("kernel_0", "kernel_1"))

    def quantized_call(self, *args, **kwargs):
        return self.call(*args, **kwargs)

    def uses_loop(self, training, rows=None):
        """Whether a call with this `training` flag and `rows` (`G·C` or None)
        loops over the experts.

        `"auto"` loops only at inference on a CPU with unsharded experts, for
        an int8 bank without LoRA or when each expert has `LOOP_MIN_ROWS` rows
        and the hidden activations `(E, rows, M)` take `LOOP_MIN_HIDDEN_BYTES`
        (then the loop keeps one expert's activations in cache).
        """
        if training and self.dropout_rate > 0:
            return False  # dropout draws its mask once for all experts
        if keras.backend.backend() == "tensorflow":
            # Keras' TensorFlow `scan` needs outputs shaped like the carry.
            return False
        if self.implementation != "auto":
            return self.implementation == "loop"
        if (training or self.expert_sharding() is not None
                or compute_platform() not in LOOP_PLATFORMS):
            return False
        if self._loops_over_int8():
            return True
        if rows is None:
            return False
        # ml_dtypes names the dtypes NumPy lacks (bfloat16, float8_*).
        itemsize = np.dtype(getattr(ml_dtypes, self.compute_dtype, self.compute_dtype)).itemsize
        hidden_bytes = self.num_experts * rows * self.mlp_dim * itemsize
        return rows >= LOOP_MIN_ROWS and hidden_bytes >= LOOP_MIN_HIDDEN_BYTES

    def _loops_over_int8(self):
        """Whether the loop reads the int8 kernels themselves (no LoRA)."""
        return self.quantization_mode == "int8" and not self.lora_enabled

    def _loop_step_weights(self):
        """What `ops.scan` slices per expert."""
        if not self._loops_over_int8():
            return self._effective_weights()
        return (self.kernel_0, self.kernel_0_scale, self.bias_0,
                self.kernel_1, self.kernel_1_scale, self.bias_1)

    def _loop_step(self, xe, *weights, training=None):
        """One expert's MLP from its slices of `_loop_step_weights`."""
        if self._loops_over_int8():
            q_0, scale_0, bias_0, q_1, scale_1, bias_1 = weights
            weights = (self._dequantize(q_0, scale_0), bias_0,
                       self._dequantize(q_1, scale_1), bias_1)
        return self._mlp(xe, *weights, training=training)

    def _mlp(self, xe, kernel_0, bias_0, kernel_1, bias_1, training):
        """One or all experts: `(..., rows, D)` -> `(..., rows, D)`."""
        h = ops.matmul(xe, kernel_0) + ops.expand_dims(bias_0, -2)  # (..., rows, M)
        h = mlp_activation(h, self.activation)
        h = apply_dropout(self.dropout, h, training)
        y = ops.matmul(h, kernel_1) + ops.expand_dims(bias_1, -2)  # (..., rows, D)
        return apply_dropout(self.dropout, y, training)

    def call(self, x, training=None):
        # Expert-major: XLA:CPU runs it faster than an einsum with E second.
        shape = ops.shape(x)
        lead = len(shape) - 3  # axes before (E, C, D), e.g. G
        if lead == 1 and self.expert_sharding() is not None:
            x = constrain_groups(x)  # (G, E, C, D), G over the batch axes
        e, d = shape[-3], shape[-1]
        perm = (lead, *range(lead), lead + 1, lead + 2)
        xe = ops.reshape(ops.transpose(x, perm), (e, -1, d))  # (E, G·C, D)
        known = all(isinstance(n, int) for n in shape[:lead + 2])
        rows = math.prod(shape[:lead + 2]) // e if known else None  # G·C
        if self.uses_loop(training, rows=rows):
            def step(carry, slices):
                return carry, self._loop_step(*slices, training=training)

            weights = [ops.convert_to_tensor(w) for w in self._loop_step_weights()]
            _, y = ops.scan(step, 0, (xe, *weights))  # (E, G·C, D)
        else:
            xe = self._constrain_to_experts(xe)
            weights = self._effective_weights()
            y = self._mlp(xe, *weights, training=training)  # (E, G·C, D)
            y = self._constrain_to_experts(y)
        transposed = tuple(shape[i] for i in perm)
        inverse = (*range(1, lead + 1), 0, lead + 1, lead + 2)
        y = ops.transpose(ops.reshape(y, transposed), inverse)  # (G, E, C, D)
        if lead == 1 and self.expert_sharding() is not None:
            # Back to G over the batch axes: the combine's gathers stay local.
            y = constrain_groups(y)
        return y

    # --- LoRA (keras_vmoe.models.lora) ----------------------------------

    lora_enabled = False

    def lora_max_rank(self):
        """Largest LoRA rank: min(D, M), the smaller side of each expert kernel."""
        return int(min(self.kernel_0.shape[1], self.kernel_0.shape[2]))

    def lora_factor_shapes(self, rank):
        """`{name: shape}` of the LoRA factors at `rank`."""
        shapes = {}
        for index, kernel in ((0, self.kernel_0), (1, self.kernel_1)):
            e, n_in, n_out = (int(n) for n in kernel.shape)
            shapes[f"lora_kernel_{index}_a"] = (e, n_in, rank)
            shapes[f"lora_kernel_{index}_b"] = (e, rank, n_out)
        return shapes

    def enable_lora(self, rank, lora_alpha=None):
        """Adds per-expert low-rank updates to both expert kernels.

        Expert e's kernels become `W_e + (alpha/rank) · A_e @ B_e` (A drawn
        per expert as loralib, B zeros); the base kernels, int8 included,
        are frozen. Saving writes the merged kernels (re-quantized for int8),
        so a saved model loads into a layer without LoRA.

        Args:
            rank: int r, 1 ≤ r ≤ min(D, M).
            lora_alpha: float, scale numerator (default `rank`).
        """
        if not self.built:
            raise ValueError("Cannot enable LoRA on an Experts layer that is not built.")
        if self.lora_enabled:
            raise ValueError(f"LoRA is already enabled on {self.path!r}.")
        if not 1 <= rank <= self.lora_max_rank():
            raise ValueError(
                f"`rank` must be between 1 and min(D, M) = {self.lora_max_rank()} for "
                f"the experts {self.path!r}. Received: rank={rank!r}")
        with keras_internals.tracking_unlocked(self):
            for index, kernel in ((0, self.kernel_0), (1, self.kernel_1)):
                e, n_in, n_out = kernel.shape
                setattr(self, f"lora_kernel_{index}_a", self.add_weight(
                    name=f"lora_kernel_{index}_a", shape=(e, n_in, rank),
                    initializer=ExpertsInitializer(lora_a_initializer(), identical=False),
                    dtype="float32"))
                setattr(self, f"lora_kernel_{index}_b", self.add_weight(
                    name=f"lora_kernel_{index}_b", shape=(e, rank, n_out),
                    initializer="zeros", dtype="float32"))
                kernel.trainable = False
        self.lora_enabled = True
        self.lora_rank = rank
        self.lora_alpha = rank if lora_alpha is None else lora_alpha

    def lora_delta(self, index):
        """`(alpha/r) · A @ B` of kernel `index` (0 or 1), float32 `(E, ., .)`."""
        a = getattr(self, f"lora_kernel_{index}_a")
        b = getattr(self, f"lora_kernel_{index}_b")
        return (self.lora_alpha / self.lora_rank) * ops.matmul(
            ops.convert_to_tensor(a), ops.convert_to_tensor(b))

    def _effective_weights(self):
        """`(kernel_0, bias_0, kernel_1, bias_1)` with any LoRA update added."""
        kernel_0, kernel_1 = self._float_kernels()
        weights = [ops.convert_to_tensor(w) for w in (
            kernel_0, self.bias_0, kernel_1, self.bias_1)]
        if self.lora_enabled:
            for slot, index in ((0, 0), (2, 1)):
                kernel = weights[slot]
                weights[slot] = ops.cast(
                    ops.cast(kernel, "float32") + self.lora_delta(index), kernel.dtype)
        return tuple(weights)

    def _base_variables(self):
        """The variables a layer without LoRA saves, in its order."""
        return [v for v in self._trainable_variables + self._non_trainable_variables
                if not v.name.startswith("lora_kernel")]

    def save_own_variables(self, store):
        if not self.lora_enabled:
            return super().save_own_variables(store)
        values = {}
        for index in (0, 1):
            kernel = getattr(self, f"kernel_{index}")
            if self.quantization_mode == "int8":
                merged = self._float_kernels()[index]
                merged = ops.convert_to_numpy(
                    ops.cast(merged, "float32") + self.lora_delta(index))
                values[kernel.name], values[f"{kernel.name}_scale"] = (
                    quantize_expert_bank(merged))
            else:
                values[kernel.name] = ops.cast(
                    ops.cast(kernel, "float32") + self.lora_delta(index), kernel.dtype)
        for i, variable in enumerate(self._base_variables()):
            store[f"{i}"] = values.get(variable.name, variable)

    def load_own_variables(self, store):
        if not self.lora_enabled:
            return super().load_own_variables(store)
        for i, variable in enumerate(self._base_variables()):
            variable.assign(store[f"{i}"])
        for index in (0, 1):  # the loaded kernels hold the merged update
            b = getattr(self, f"lora_kernel_{index}_b")
            b.assign(ops.zeros(b.shape, b.dtype))

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update({"num_experts": self.num_experts, "mlp_dim": self.mlp_dim,
                       "dropout_rate": self.dropout_rate, "identical_init": self.identical_init,
                       "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                       "bias_initializer": keras.initializers.serialize(self.bias_initializer),
                       "implementation": self.implementation, "activation": self.activation})
        return config
