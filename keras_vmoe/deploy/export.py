"""Export a task model to a TensorFlow SavedModel or an ONNX file.

The graph is the inference pass with the model's evaluation routing baked
in, traced under `exportable_routing()`. A SavedModel has a dynamic batch
and checked `serve` / `serve_image_bytes` endpoints; ONNX needs a static
`batch_size`. Nothing existing is replaced (see docs/guides/serving.md).
"""

import contextlib
import errno
import logging
import os
import re
import shutil
import tempfile
import warnings

import keras
import numpy as np

from keras_vmoe.deploy.quantize import quantized_layers
from keras_vmoe.layers.allocation import exportable_routing
from keras_vmoe.preprocessing.image_converter import resize_small_central_crop_tf
from keras_vmoe.utils.keras_internals import flatten_layers
from keras_vmoe.utils.validation import check_int
from keras_vmoe.utils.validation import check_one_of

FORMATS = ("tf_saved_model", "onnx")
QUANTIZATIONS = (None, "dynamic_int8")
# Decoded pixels `serve_image_bytes` accepts per image (as `predict`).
MAX_PIXELS = 1 << 28
# Largest ONNX export written as one file: protobuf's 2 GiB, less some room.
ONNX_SINGLE_FILE_BYTES = 2**31 - 2**26
# Most tokens an exported batch may hold: the routing counts them in int32.
MAX_TOKENS = 2**31 - 1
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


def _last_line(error):
    return (str(error).strip().splitlines() or [type(error).__name__])[-1]


def _conversion_error(model, fmt, error):
    """An `ExportError` naming the innermost layer the error came from."""
    where = f"a layer of model {model.name!r}"
    classes = re.findall(r"when calling (\w+)\.call\(\)", str(error))
    if classes:
        where = f"layer {classes[-1]}"
        for layer in flatten_layers(model):
            if layer is not model and type(layer).__name__ == classes[-1]:
                where = f"layer {layer.path or layer.name} ({classes[-1]})"
                break
    return ExportError(f"Cannot export {where} to {fmt}: {type(error).__name__}: "
                       f"{_last_line(error)[:500]}")


def _check_destination(path):
    """Refuses a destination that holds anything (nothing is ever deleted)."""
    if os.path.islink(path) or (os.path.exists(path) and not os.path.isdir(path)):
        what = "already exists (a file or link)"
    elif os.path.isdir(path) and os.listdir(path):
        what = "is a folder that is not empty"
    else:
        return
    raise ExportError(
        f"The export destination {path!r} {what}; choose a new path, or remove "
        "it yourself first. An export never replaces or deletes existing files.")


def _tokens_per_image(model):
    """Tokens one image gives an MoE layer (E³: with its N copies), or 1."""
    backbone = getattr(model, "backbone", None)
    tokens = getattr(backbone, "num_tokens", 1)
    return int(tokens) * int(getattr(backbone, "ensemble_size", 1) or 1)


@contextlib.contextmanager
def _export_routing(model, batch):
    """Dynamic batch: one image per group when the model routes a whole call
    as one group (its capacity would depend on the batch); static batch:
    routing groups cut to the batch, with a warning."""
    backbone = getattr(model, "backbone", None)
    layers = backbone.get_moe_layers() if hasattr(backbone, "get_moe_layers") else []
    if not layers or backbone.moe_type == "soft":
        yield
        return
    groups = [(layer, layer.routing_phase(False).images_per_group,
               layer.routing_phase(False).group_size) for layer in layers]
    if batch is None:
        grouped = any(images is not None or size is not None
                      for _, images, size in groups)
        cut = [] if grouped else groups
    else:
        tokens = _tokens_per_image(model)
        cut = [(layer, images, size) for layer, images, size in groups
               if (images is not None and images > batch)
               or (size is not None and size > batch * tokens)]
    saved = [layer.eval_routing for layer in layers]
    try:
        for layer, _, _ in cut:
            layer.eval_routing = {**layer.eval_routing, "group_size": None,
                                  "images_per_group": batch or 1}
        if batch is not None and cut:
            where = "; ".join(f"{layer.path}: images_per_group={images}, "
                              f"group_size={size}" for layer, images, size in cut)
            warnings.warn(
                f"Routing groups larger than the export's batch_size={batch} are "
                f"routed as one group of the batch's {batch} image(s) in the "
                f"exported graph ({where}); a larger group would only "
                "add masked padding images to every call. The capacity follows "
                "the batch's tokens.", UserWarning, stacklevel=4)
        yield
    finally:
        for layer, routing in zip(layers, saved, strict=True):
            layer.eval_routing = routing


@contextlib.contextmanager
def _float_integer_products():
    """Within it, `ops.einsum`/`ops.matmul` of two int8 operands run in float32.

    ONNX Runtime has no integer Einsum; the int8 products are exact in
    float32 while their sums stay below 2^24.
    """
    from keras.src import ops as keras_ops

    saved = keras_ops.einsum, keras_ops.matmul

    def is_integer(x):  # int8 only: other integer products stay as they are
        return str(getattr(x, "dtype", "")) == "int8"

    def einsum(subscripts, *operands, **kwargs):
        if len(operands) == 2 and all(map(is_integer, operands)):
            operands = [keras_ops.cast(x, "float32") for x in operands]
        return saved[0](subscripts, *operands, **kwargs)

    def matmul(x1, x2):
        if is_integer(x1) and is_integer(x2):
            x1, x2 = keras_ops.cast(x1, "float32"), keras_ops.cast(x2, "float32")
        return saved[1](x1, x2)

    keras_ops.einsum, keras_ops.matmul = einsum, matmul
    try:
        yield
    finally:
        keras_ops.einsum, keras_ops.matmul = saved


def export_model(model, path, format="tf_saved_model", *, batch_size=None,
                 image_bytes=True, quantization=None, verbose=False):
    """Exports a task model for serving.

    Args:
        model: an `ImageClassifier` or `EnsembleClassifier`.
        path: output folder (`"tf_saved_model"`) or `.onnx` file (`"onnx"`);
            it must not exist (or be an empty folder).
        format: `"tf_saved_model"` or `"onnx"`.
        batch_size: `None` (dynamic batch; SavedModel only) or a positive
            int, the batch the graph is exported for. Required for ONNX.
        image_bytes: bool, also add the `serve_image_bytes` endpoint to a
            SavedModel (decoding and the image converter in the graph).
        quantization: `None`, or `"dynamic_int8"` (ONNX only): ONNX
            Runtime's dynamic int8 quantization of the float32 export's
            `MatMul` weights. Refused for a model already quantized with
            `model.quantize("int8")`.
        verbose: bool, Keras' export messages.

    Returns:
        `path`.

    Raises:
        ExportError: a missing converter package (naming the extra), a
            destination that exists, a full disk, or a layer the converter
            cannot handle (naming the layer).

    Examples:

        export_model(model, "served/", "tf_saved_model")
        export_model(model, "model.onnx", "onnx", batch_size=8)
        export_model(model, "int8.onnx", "onnx", batch_size=1,
                     quantization="dynamic_int8")
    """
    check_one_of(format, "format", FORMATS)
    batch = check_int(batch_size, "batch_size", allow_none=True,
                      maximum=MAX_TOKENS // _tokens_per_image(model))
    if format == "onnx" and batch is None:
        raise ValueError(
            "ONNX export needs a static batch: pass `batch_size` (the number of "
            "images every call of the ONNX graph will take; pad smaller batches). "
            "Received: batch_size=None")
    check_one_of(quantization, "quantization", QUANTIZATIONS)
    if quantization is not None and format != "onnx":
        raise ValueError(f"quantization={quantization!r} applies to format='onnx' only. "
                         f"Received: format={format!r}")
    if quantization is not None and quantized_layers(model):
        raise ExportError(
            f"quantization={quantization!r} quantizes the float32 export; this model "
            "already has int8 layers (model.quantize('int8')). Export the float "
            "model with quantization, or this one without it.")
    if keras.backend.backend() != "jax":
        raise ExportError(
            "keras_vmoe exports from the JAX backend (KERAS_BACKEND=jax). "
            f"Current backend: {keras.backend.backend()!r}."
        )
    shape = _image_shape(model)
    path = os.fspath(path)
    if not path:
        raise ValueError("`path` must be a file or folder name. Received: path=''")
    _check_destination(path)
    if format == "onnx":
        _check_destination(path + ".data")
        _require("jax2onnx", "ONNX")
        _require("onnx", "ONNX")
        if quantization is not None:
            _require("onnxruntime", "ONNX Runtime's quantization")
    else:
        _require("tensorflow", "a TensorFlow SavedModel")
        if image_bytes:
            _check_converter(model)
    spec = keras.InputSpec(shape=(batch, *shape), dtype="float32", name="images")
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".export-", dir=parent)
    except OSError as error:
        raise _write_error(path, error) from error
    try:
        target = os.path.join(staging, "model.onnx" if format == "onnx" else "saved_model")
        try:
            products = (_float_integer_products() if format == "onnx"
                        else contextlib.nullcontext())
            # jax2onnx leaves a few intermediate value types unset; onnx_ir
            # warns once per value, but ONNX Runtime infers those shapes.
            quiet = _dropped_messages("onnx_ir.serde", "The value type for shape")
            # A serving graph needs no custom gradient (its load would warn).
            kwargs = ({"jax2tf_kwargs": {"with_gradient": False}}
                      if format == "tf_saved_model" else {})
            with exportable_routing(), _export_routing(model, batch), products, quiet:
                keras.Model.export(model, target, format=format, verbose=verbose,
                                   input_signature=[spec], **kwargs)
            if format == "onnx":
                _drop_unused_initializers(target)
                if quantization is not None:
                    target = _quantize_onnx(target)
                moves = _pack_onnx(target, path)
            else:
                _add_checked_endpoints(model, target, os.path.join(staging, "served"),
                                       image_bytes)
                moves = [(os.path.join(staging, "served"), path)]
        except ExportError:
            raise
        except Exception as error:
            if isinstance(error, OSError) or _is_disk_full(error):
                raise _write_error(path, error) from error
            raise _conversion_error(model, format, error) from error
        _move_into_place(moves)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


@contextlib.contextmanager
def _dropped_messages(logger_name, *prefixes):
    """Within it, logger `logger_name` drops records starting with `prefixes`."""
    logger = logging.getLogger(logger_name)

    def keep(record):
        return not str(record.msg).startswith(prefixes)

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def _used_names(graph, used):
    """Adds to `used` the outputs of `graph` and every name its nodes (and
    their subgraphs) read."""
    import onnx

    used.update(output.name for output in graph.output)
    for node in graph.node:
        used.update(node.input)
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                _used_names(attribute.g, used)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for subgraph in attribute.graphs:
                    _used_names(subgraph, used)
    return used


def _drop_unused_initializers(target):
    """Removes the staged graph's unread initializers (ONNX Runtime would warn
    about each in every session)."""
    import onnx

    model = onnx.load(target, load_external_data=False)
    names = {tensor.name for tensor in model.graph.initializer} - _used_names(
        model.graph, set())
    if not names:
        return
    kept = [tensor for tensor in model.graph.initializer if tensor.name not in names]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    # An initializer may also be listed as a graph input (older IR versions).
    inputs = [value for value in model.graph.input if value.name not in names]
    del model.graph.input[:]
    model.graph.input.extend(inputs)
    onnx.save_model(model, target)


def _quantize_onnx(target):
    """ONNX Runtime's dynamic int8 quantization; returns the staged graph."""
    from onnxruntime.quantization import QuantType
    from onnxruntime.quantization import quantize_dynamic

    staging = os.path.dirname(target)
    external = len(os.listdir(staging)) > 1
    folder = os.path.join(staging, "quantized")
    os.mkdir(folder)
    quantized = os.path.join(folder, "model.onnx")
    # Its notes on the integer routing tensors and on pre-processing (for
    # static calibration) are expected here.
    with _dropped_messages(
            "", "Please consider to run pre-processing before quantization",
            "Inference failed or unsupported type to quantize for tensor"):
        quantize_dynamic(target, quantized, weight_type=QuantType.QInt8,
                         use_external_data_format=external)
    return quantized


def _move_into_place(moves):
    """Renames staged files into place, the graph last; undoes it on failure."""
    for _, final in moves:
        _check_destination(final)
    done = []
    try:
        for staged, final in moves:
            if os.path.isdir(final):
                os.rmdir(final)  # empty (checked just above)
            os.rename(staged, final)
            done.append(final)
    except OSError as error:
        for final in done:
            with contextlib.suppress(OSError):
                os.remove(final)
        raise _write_error(moves[-1][1], error) from error


def _pack_onnx(target, path):
    """`[(staged, destination)]`: one file up to `ONNX_SINGLE_FILE_BYTES`,
    else the graph (last) and its weights in `path + ".data"`."""
    staging = os.path.dirname(target)
    others = [name for name in os.listdir(staging) if name != os.path.basename(target)]
    total = sum(os.path.getsize(os.path.join(staging, name))
                for name in [*others, os.path.basename(target)])
    if total <= ONNX_SINGLE_FILE_BYTES and not others:
        return [(target, path)]
    import onnx

    graph = onnx.load(target)  # reads the external data from `staging`
    if total <= ONNX_SINGLE_FILE_BYTES:
        onnx.save_model(graph, target, save_as_external_data=False)
        return [(target, path)]
    for name in others:
        os.remove(os.path.join(staging, name))
    data_name = os.path.basename(path) + ".data"
    # Small tensors (shapes, scalars) stay in the graph, where ONNX Runtime's
    # shape inference reads them.
    onnx.save_model(graph, target, save_as_external_data=True,
                    all_tensors_to_one_file=True, location=data_name)
    staged_data = os.path.join(staging, data_name)
    if not os.path.exists(staged_data):
        return [(target, path)]
    return [(staged_data, path + ".data"), (target, path)]


def _is_disk_full(error):
    text = str(error)
    return "No space left on device" in text or "ENOSPC" in text or (
        "Disk quota exceeded" in text)


def _write_error(path, error):
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT) or (
            _is_disk_full(error)):
        reason = "the disk is full (no space left on device)"
    else:
        reason = _last_line(error)[:300]
    return ExportError(f"Cannot write the export to {path!r}: {reason}. Nothing was "
                       "written there.")


def _check_converter(model):
    converter = getattr(getattr(model, "preprocessor", None), "image_converter", None)
    if converter is None or getattr(converter, "crop", None) not in (
            "resize", "central_crop", "resize_small_central_crop"):
        raise ExportError(
            "serve_image_bytes needs the model's ImageConverter (crop 'resize', "
            "'central_crop' or 'resize_small_central_crop'); this model has "
            f"{type(converter).__name__}. Export without the endpoint "
            "(image_bytes=False) and convert images outside the graph.")


def _converter_tf(model, images):
    """The model's `ImageConverter` on one uint8 `(H, W, 3)` TF image."""
    import tensorflow as tf

    converter = model.preprocessor.image_converter
    size = tuple(converter._size)
    x = tf.cast(images[None], tf.float32)
    if converter.crop == "resize_small_central_crop":
        x = resize_small_central_crop_tf(
            x, size, method=converter.interpolation, antialias=converter.antialias)
    else:
        if converter.crop == "central_crop":
            # The largest central window of the target aspect ratio (Keras'
            # `Resizing(crop_to_aspect_ratio=True)`), then the resize.
            height = tf.cast(tf.shape(x)[1], tf.float64)
            width = tf.cast(tf.shape(x)[2], tf.float64)
            crop_h = tf.cast(width * size[0] / size[1], tf.int32)
            crop_h = tf.maximum(tf.minimum(tf.shape(x)[1], crop_h), 1)
            crop_w = tf.cast(height * size[1] / size[0], tf.int32)
            crop_w = tf.maximum(tf.minimum(tf.shape(x)[2], crop_w), 1)
            top = (tf.shape(x)[1] - crop_h) // 2
            left = (tf.shape(x)[2] - crop_w) // 2
            x = x[:, top:top + crop_h, left:left + crop_w]
        x = tf.image.resize(x, size, method=converter.interpolation,
                            antialias=converter.antialias,
                            preserve_aspect_ratio=False)
        if converter.crop == "resize" and getattr(converter, "upstream_resize", False):
            # Upstream's resize casts back to the decoded uint8 (floor).
            x = tf.floor(tf.clip_by_value(x, 0.0, 255.0))
    return x[0] * (2.0 / 255.0) - 1.0  # [0, 255] -> [-1, 1], as int_rescale


def _header_pixels(data):
    """Width x height (x GIF frames, an upper bound) from an encoded image's
    header; 0 for other formats (the decoder reports them)."""
    import tensorflow as tf

    def field(offset, length, dtype, little_endian):
        raw = tf.strings.substr(data, offset, length)
        padded = tf.strings.join([raw, tf.constant(b"\0" * 8)])
        value = tf.io.decode_raw(tf.strings.substr(padded, 0, length), dtype,
                                 little_endian=little_endian)[0]
        return tf.abs(tf.cast(value, tf.int64))

    magic = tf.strings.substr(data, 0, 4)

    def jpeg():
        shape = tf.cast(tf.image.extract_jpeg_shape(data), tf.int64)
        return shape[0] * shape[1]

    def png():
        return field(16, 4, tf.int32, False) * field(20, 4, tf.int32, False)

    def gif():
        # Each frame after the first starts with an image separator (0x2C)
        # right after a block terminator (0x00).
        separators = tf.size(tf.strings.split(data, sep=b"\x00\x2c")) - 1
        frames = tf.cast(tf.maximum(separators, 0) + 1, tf.int64)
        return field(6, 2, tf.uint16, True) * field(8, 2, tf.uint16, True) * frames

    def bmp():
        return field(18, 4, tf.int32, True) * field(22, 4, tf.int32, True)

    return tf.case([
        (tf.equal(tf.strings.substr(data, 0, 3), b"\xff\xd8\xff"), jpeg),
        (tf.equal(magic, b"\x89PNG"), png),
        (tf.equal(magic, b"GIF8"), gif),
        (tf.equal(tf.strings.substr(data, 0, 2), b"BM"), bmp),
    ], default=lambda: tf.constant(0, tf.int64), exclusive=False)


def _check_images_tf(images, low=-1.0, high=1.0):
    """In-graph checks of a `serve` batch (as `predict`'s NumPy checks)."""
    import tensorflow as tf

    slack = 1e-3 * (high - low)
    checks = [
        tf.debugging.assert_positive(
            tf.shape(images)[0],
            message="serve: the batch is empty; send at least one image"),
        tf.debugging.assert_equal(
            tf.reduce_all(tf.math.is_finite(images)), True,
            message="serve: images contain NaN or inf pixel values"),
        tf.debugging.assert_equal(
            tf.reduce_all((images >= low - slack) & (images <= high + slack)), True,
            message=(f"serve: float images must be in [{low:g}, {high:g}] (the "
                     "model's converted input; [0, 255] images go through "
                     "serve_image_bytes or keras_vmoe.deploy.serving_inputs)")),
    ]
    with tf.control_dependencies(checks):
        return tf.identity(images)


def _add_checked_endpoints(model, saved, out, image_bytes):
    """Re-saves `saved` with checked `serve` (and `serve_image_bytes`)."""
    import tensorflow as tf

    loaded = tf.saved_model.load(saved)
    image_shape = _image_shape(model)

    class Served(tf.Module):
        def __init__(self):
            super().__init__()
            self.model = loaded

        # Any shape: checked here with a clear message (the shape padded to
        # 4 entries so that a wrong rank cannot fail inside the comparison).
        @tf.function(input_signature=[tf.TensorSpec(None, tf.float32)])
        def serve(self, images):
            dims = tf.concat([tf.shape(images), tf.zeros(4, tf.int32)], 0)[:4]
            expected = tf.constant(image_shape, tf.int32)
            shape = tf.debugging.assert_equal(
                tf.logical_and(tf.equal(tf.rank(images), 4),
                               tf.reduce_all(tf.equal(dims[1:], expected))), True,
                message=(f"serve: images must be a float32 batch of shape (batch, "
                         f"{', '.join(map(str, image_shape))}): each image of shape "
                         f"{image_shape} (height, width, channels); resize and crop "
                         "first (or use serve_image_bytes)"))
            with tf.control_dependencies([shape]):
                images = tf.ensure_shape(images, (None, *image_shape))
            return self.model.serve(_check_images_tf(images))

        @tf.function(input_signature=[tf.TensorSpec((None,), tf.string)])
        def serve_image_bytes(self, encoded):
            tf.debugging.assert_positive(
                tf.size(encoded),
                message="serve_image_bytes: the batch is empty; send at least one image")

            def one(data):
                pixels = _header_pixels(data)
                check = tf.debugging.assert_less_equal(
                    pixels, tf.constant(MAX_PIXELS, tf.int64),
                    message=(f"serve_image_bytes: an image has more than {MAX_PIXELS} "
                             "pixels (width x height read from its header, times "
                             "the frames of a GIF); downscale it before sending"))
                with tf.control_dependencies([check]):
                    image = tf.io.decode_image(data, channels=3, expand_animations=False)
                return _converter_tf(model, image)

            images = tf.map_fn(one, encoded,
                               fn_output_signature=tf.TensorSpec(image_shape, tf.float32))
            return self.model.serve(images)

    module = Served()
    signatures = {"serving_default": module.serve.get_concrete_function(),
                  "serve": module.serve.get_concrete_function()}
    if image_bytes:
        signatures["serve_image_bytes"] = module.serve_image_bytes.get_concrete_function()
    tf.saved_model.save(module, out, signatures=signatures,
                        options=tf.saved_model.SaveOptions(
                            experimental_custom_gradients=False))


def serving_inputs(model, images):
    """Images (uint8 `(B, H, W, 3)` or a list of such arrays) -> the float32
    `(B, H, W, 3)` input of an exported graph, with the model's converter."""
    if isinstance(images, (list, tuple)):
        return np.concatenate([serving_inputs(model, im[None]) for im in images])
    converter = model.preprocessor.image_converter
    return np.asarray(converter(np.asarray(images)), dtype="float32")
