"""Export a task model to a TensorFlow SavedModel or an ONNX file.

Both formats hold the model's forward pass at inference (`training=False`)
with the routing settings of the model at export time baked in (the
evaluation routing: capacity factor, groups, Batch Prioritized Routing).
Routing is traced under `exportable_routing()` (sorts and gathers instead
of TopK and scatter, identical outputs; see `keras_vmoe.layers.allocation`).

* `"tf_saved_model"`: JAX -> StableHLO inside a TensorFlow `XlaCallModule`
  (Keras' jax2tf path), with a dynamic batch dimension. Endpoints: `serve`
  (float32 images `(B, H, W, 3)` in [-1, 1] -> logits) and, unless
  `image_bytes=False`, `serve_image_bytes` (a batch of encoded JPEG/PNG/GIF/
  BMP strings -> logits): TensorFlow decodes each image, the model's
  `ImageConverter` (resize/crop to the model size, [0, 255] -> [-1, 1]) runs
  in the graph, then `serve`.
* `"onnx"`: jax2onnx, with a static batch size (`batch_size`, default 1):
  jax2onnx cannot yet lower the routing's group arithmetic on a symbolic
  batch (ceil division of the token count by the group size). The input
  is float32 `(B, H, W, 3)` in [-1, 1]; decode and convert images outside
  (`serving_inputs` does it with the model's converter in NumPy).

The converters are imported lazily; without them `ExportError` names the
`keras-vmoe[export]` extra.
"""

import os
import re
import shutil
import tempfile

import keras
import numpy as np

from keras_vmoe.layers.allocation import exportable_routing

FORMATS = ("tf_saved_model", "onnx")
EXTRA_HINT = 'pip install "keras-vmoe[export]"'


class ExportError(RuntimeError):
    """A model (or one of its layers) that cannot be exported."""


def _require(module, what):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as error:
        raise ExportError(
            f"Exporting to {what} needs the `{module}` package ({error}). "
            f"Install the export extra: {EXTRA_HINT}"
        ) from error


def _image_shape(model):
    shape = tuple(model.inputs[0].shape[1:]) if getattr(model, "inputs", None) else None
    if not shape or len(shape) != 3 or None in shape:
        raise ExportError(
            f"Model {model.name!r} has no fixed (height, width, channels) image "
            f"input (input shape {shape}); only keras_vmoe task models "
            "(ImageClassifier, EnsembleClassifier) can be exported."
        )
    return shape


def _failing_layer(model, error):
    """Name and class of the innermost layer a conversion error came from."""
    text = str(error)
    classes = re.findall(r"when calling (\w+)\.call\(\)", text)
    if not classes:
        return None
    cls = classes[-1]
    from keras_vmoe.keras_internals import flatten_layers

    for layer in flatten_layers(model):
        if layer is not model and type(layer).__name__ == cls:
            return f"{layer.path or layer.name} ({cls})"
    return cls


def _conversion_error(model, fmt, error):
    layer = _failing_layer(model, error)
    where = f"layer {layer}" if layer else f"a layer of model {model.name!r}"
    first = (str(error).strip().splitlines() or [type(error).__name__])[-1]
    return ExportError(
        f"Cannot export {where} to {fmt}: {type(error).__name__}: {first[:500]}"
    )


def export_model(model, path, format="tf_saved_model", *, batch_size=None,
                 image_bytes=True, verbose=False):
    """Exports a task model for serving.

    Args:
        model: an `ImageClassifier` or `EnsembleClassifier`.
        path: output folder (`"tf_saved_model"`) or `.onnx` file (`"onnx"`).
            Written to a temporary name and renamed when complete.
        format: `"tf_saved_model"` or `"onnx"`.
        batch_size: `None` (dynamic batch; SavedModel only) or a positive
            int, the batch the graph is exported for. ONNX defaults to 1.
        image_bytes: bool, also add the `serve_image_bytes` endpoint to a
            SavedModel (decoding and the image converter in the graph).
        verbose: bool, Keras' export messages.

    Returns:
        `path`.

    Raises:
        ExportError: a missing converter package (naming the extra), or a
            layer the converter cannot handle (naming the layer).

    Examples:

        export_model(model, "served/", "tf_saved_model")
        export_model(model, "model.onnx", "onnx", batch_size=8)
    """
    if format not in FORMATS:
        raise ValueError(f"`format` must be one of {FORMATS}. Received: format={format!r}")
    if batch_size is not None and (
        isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1
    ):
        raise ValueError(
            f"`batch_size` must be None or a positive int. Received: batch_size={batch_size!r}"
        )
    if keras.backend.backend() != "jax":
        raise ExportError(
            "keras_vmoe exports from the JAX backend (KERAS_BACKEND=jax). "
            f"Current backend: {keras.backend.backend()!r}."
        )
    shape = _image_shape(model)
    path = os.fspath(path)
    if format == "onnx":
        _require("jax2onnx", "ONNX")
        _require("onnx", "ONNX")
        batch = batch_size or 1
    else:
        _require("tensorflow", "a TensorFlow SavedModel")
        batch = batch_size
    spec = keras.InputSpec(shape=(batch, *shape), dtype="float32", name="images")
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".export-", dir=parent)
    try:
        target = os.path.join(staging, "model.onnx" if format == "onnx" else "saved_model")
        try:
            with exportable_routing():
                keras.Model.export(model, target, format=format, verbose=verbose,
                                   input_signature=[spec])
        except ExportError:
            raise
        except Exception as error:
            raise _conversion_error(model, format, error) from error
        if format == "tf_saved_model" and image_bytes:
            _add_image_bytes_endpoint(model, target, os.path.join(staging, "with_bytes"))
            target = os.path.join(staging, "with_bytes")
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
        os.replace(target, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def _converter_tf(model, images):
    """The model's `ImageConverter` on one uint8 `(H, W, 3)` TF image."""
    import tensorflow as tf

    from keras_vmoe.preprocessing.image_converter import resize_small_central_crop_tf

    converter = model.image_converter
    size = tuple(converter._size)
    x = tf.cast(images[None], tf.float32)
    if converter.crop == "resize_small_central_crop":
        x = resize_small_central_crop_tf(
            x, size, method=converter.interpolation, antialias=converter.antialias)
    else:
        x = tf.image.resize(x, size, method=converter.interpolation,
                            antialias=converter.antialias,
                            preserve_aspect_ratio=False)
        if converter.crop == "central_crop":
            raise ExportError(
                "serve_image_bytes supports the 'resize' and "
                "'resize_small_central_crop' converter crops; this model's "
                "converter uses crop='central_crop'. Export with "
                "image_bytes=False and convert images outside the graph."
            )
    return x[0] * (2.0 / 255.0) - 1.0  # [0, 255] -> [-1, 1], as int_rescale


def _add_image_bytes_endpoint(model, saved, out):
    """Re-saves `saved` with a `serve_image_bytes` endpoint (TF decoding)."""
    import tensorflow as tf

    loaded = tf.saved_model.load(saved)
    image_shape = _image_shape(model)

    class Served(tf.Module):
        def __init__(self):
            super().__init__()
            self.model = loaded

        @tf.function(input_signature=[tf.TensorSpec((None, *image_shape), tf.float32)])
        def serve(self, images):
            return self.model.serve(images)

        @tf.function(input_signature=[tf.TensorSpec((None,), tf.string)])
        def serve_image_bytes(self, encoded):
            def one(data):
                image = tf.io.decode_image(data, channels=3, expand_animations=False)
                return _converter_tf(model, image)

            images = tf.map_fn(one, encoded,
                               fn_output_signature=tf.TensorSpec(image_shape, tf.float32))
            return self.model.serve(images)

    module = Served()
    tf.saved_model.save(module, out, signatures={
        "serving_default": module.serve.get_concrete_function(),
        "serve": module.serve.get_concrete_function(),
        "serve_image_bytes": module.serve_image_bytes.get_concrete_function(),
    }, options=tf.saved_model.SaveOptions(experimental_custom_gradients=False))


def serving_inputs(model, images):
    """Images (uint8 `(B, H, W, 3)` or a list of such arrays) -> the float32
    `(B, H, W, 3)` input of an exported graph, with the model's converter."""
    if isinstance(images, (list, tuple)):
        return np.concatenate([serving_inputs(model, im[None]) for im in images])
    return np.asarray(model.image_converter(np.asarray(images)), dtype="float32")
