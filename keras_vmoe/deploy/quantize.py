"""int8 weights of a keras_vmoe model: sizes, the plan, and the change.

`weight_bytes` measures real variables, `int8_plan` predicts the bytes after
`model.quantize("int8")` from shapes alone (abstract weights work too), and
`quantize_model` quantizes and reports (see docs/guides/serving.md).
"""

import numpy as np

from keras_vmoe.layers.experts import Experts
from keras_vmoe.utils.arrays import nbytes
from keras_vmoe.utils.keras_internals import flatten_layers
from keras_vmoe.utils.validation import check_one_of

MODES = ("int8",)


def layers_by_path(model):
    """`{layer.path: layer}` of the layers inside `model`."""
    # Layers outside the model's graph (the image converter's) have no path.
    return {layer.path: layer for layer in flatten_layers(model)
            if layer is not model and layer.path}


def quantized_layers(model):
    """`{layer path: mode}` of the quantized layers of `model` (may be empty)."""
    return {path: layer.quantization_mode
            for path, layer in sorted(layers_by_path(model).items())
            if layer.quantization_mode is not None}


def weight_bytes(model):
    """Bytes of the model's variables, split by storage kind.

    Returns:
        `{"total": int, "int8": int, "float": int, "parameters": int}`
        (`parameters` counts values, int8 and float alike).
    """
    total = int8 = values = 0
    for variable in model.weights:
        count = int(np.prod(variable.shape, dtype=np.int64))
        size = count * np.dtype(str(variable.dtype)).itemsize
        total += size
        values += count
        if str(variable.dtype) == "int8":
            int8 += size
    return {"total": total, "int8": int8, "float": total - int8, "parameters": values}


def _scale_values(layer, kernel):
    """Number of float32 scales Keras' int8 keeps for `kernel` of `layer`."""
    shape = tuple(kernel.shape)
    if isinstance(layer, Experts):
        return shape[0] * shape[-1]  # (E, out)
    equation = getattr(layer, "equation", None)
    if equation:  # EinsumDense: one scale per kernel axis kept in the output
        inputs, output = equation.split("->")
        kernel_axes = inputs.split(",")[1]
        return int(np.prod([n for axis, n in zip(kernel_axes, shape, strict=True)
                            if axis in output], dtype=np.int64))
    return shape[-1]  # Dense: (out,)


def _quantizable_kernels(model):
    """`(layer, kernel variable)` pairs that `model.quantize("int8")` changes."""
    import keras

    for layer in layers_by_path(model).values():
        if isinstance(layer, Experts):
            for name in ("kernel_0", "kernel_1"):
                yield layer, getattr(layer, name)
        elif isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense)):
            yield layer, layer.kernel


def int8_plan(model):
    """Bytes of `model`'s weights after `quantize("int8")`, from shapes alone.

    Dense, attention and expert kernels become 1 byte per value plus their
    float32 scales; the other variables keep their bytes.

    Args:
        model: a float keras_vmoe model, built with real or abstract weights.

    Returns:
        `{"float32_bytes", "int8_bytes", "ratio", "quantized_values",
        "parameters"}`.
    """
    before = weight_bytes(model)
    saved = quantized = 0
    for layer, kernel in _quantizable_kernels(model):
        values = int(np.prod(kernel.shape, dtype=np.int64))
        quantized += values
        saved += nbytes(kernel) - values - 4 * _scale_values(layer, kernel)
    after = before["total"] - saved
    return {"float32_bytes": before["total"], "int8_bytes": after,
            "ratio": round(before["total"] / after, 3),
            "quantized_values": quantized, "parameters": before["parameters"]}


def quantize_model(model, mode="int8"):
    """Quantizes `model` in place and reports what changed.

    Args:
        model: a built keras_vmoe task (`ImageClassifier`,
            `EnsembleImageClassifier`).
        mode: `"int8"`: W8A8 in the dense and attention layers and the
            head, int8 weights with float activations in the expert banks.

    Returns:
        `{"mode", "layers", "bytes_before", "bytes_after", "ratio"}`.

    Raises:
        ValueError: an unsupported `mode`, or a model already quantized.

    Examples:

    ```python
    from keras_vmoe.deploy import quantize_model
    from keras_vmoe.models import ImageClassifier, VisionTransformerBackbone

    backbone = VisionTransformerBackbone(
        image_size=16, patch_size=8, hidden_dim=16, num_layers=2, num_heads=2,
        mlp_dim=32, moe_layers=(1,), moe={"num_experts": 4})
    report = quantize_model(ImageClassifier(backbone, num_classes=3))
    assert report["layers"] > 0 and report["bytes_after"] < report["bytes_before"]
    ```
    """
    check_one_of(mode, "mode", MODES)
    already = quantized_layers(model)
    if already:
        raise ValueError(
            f"Model {model.name!r} is already quantized ({len(already)} layers); "
            "quantize the float model.")
    before = weight_bytes(model)["total"]
    model.quantize(mode)
    after = weight_bytes(model)["total"]
    return {"mode": mode, "layers": len(quantized_layers(model)),
            "bytes_before": before, "bytes_after": after,
            "ratio": round(before / after, 3)}
