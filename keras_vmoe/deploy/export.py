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
  BMP strings -> logits): TensorFlow reads each image's size from its
  header and refuses more than `MAX_PIXELS` (2^28, as `predict` and the
  folder pipelines; for a GIF, summed over an upper bound on its frames)
  before decoding, then the model's `ImageConverter`
  (resize or crop to the model size, [0, 255] -> [-1, 1]) runs in the
  graph, then `serve`. Both endpoints check their input in the graph: an
  empty batch, a wrong image shape and values outside [-1, 1] (with the
  slack `predict` allows) or not finite fail with a clear
  `InvalidArgumentError`, not inside the routing.
  A model whose evaluation routes all the tokens of a call as one group
  (no `group_size`/`images_per_group`) cannot be traced for a batch of
  unknown size (the capacity depends on it); with a dynamic batch the
  SavedModel routes each image as its own group (`images_per_group=1`),
  which is what the model gives for one image at a time: a prediction that
  does not depend on the rest of the batch. A static `batch_size` keeps
  the model's grouping, except that a routing group larger than the batch
  (`images_per_group` or `group_size` over `batch_size` images) is cut to
  the batch: the graph would otherwise carry (and every call allocate) a
  group of masked padding images. The capacity then follows the batch's
  tokens, as for a model routing all the tokens of a call as one group;
  a `UserWarning` says so.
* `"onnx"`: jax2onnx, with a static batch size: `batch_size` is required
  (jax2onnx cannot yet lower the routing's group arithmetic on a symbolic
  batch). The input is float32 `(batch_size, H, W, 3)` in [-1, 1]; decode
  and convert images outside (`serving_inputs` does it with the model's
  converter in NumPy); pad a smaller batch. In an int8 model the integer
  products of Keras' int8 Dense/EinsumDense layers run as float32 ONNX ops
  (ONNX Runtime has no integer Einsum), with the same values. A model of
  up to `ONNX_SINGLE_FILE_BYTES` is one `.onnx` file; a larger one (ONNX
  files are protobufs, limited to 2 GiB) is the graph at `path` and its
  weights beside it in `path + ".data"` (ONNX external data, which ONNX
  Runtime reads from the graph's folder): keep the two together.

The destination (and, for ONNX, `path + ".data"`) must not exist (or be an
empty folder): an export never deletes or replaces anything. It is written
to a temporary name beside it and renamed when complete (an ONNX weights
file first, then the graph that refers to it).

The converters are imported lazily; without them `ExportError` names the
`keras-vmoe[export]` extra.
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
# Decoded pixels `serve_image_bytes` accepts per image (as `predict` and the
# folder pipelines: keras_vmoe.data.images.MAX_PIXELS).
MAX_PIXELS = 1 << 28
# Largest ONNX export written as one file: protobuf's 2 GiB limit, less
# room for the graph's own messages.
ONNX_SINGLE_FILE_BYTES = 2**31 - 2**26
# Most tokens (batch x tokens per image) an exported batch may hold: the
# routing counts them in int32.
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


def _failing_layer(model, error):
    """Name and class of the innermost layer a conversion error came from."""
    text = str(error)
    classes = re.findall(r"when calling (\w+)\.call\(\)", text)
    if not classes:
        return None
    cls = classes[-1]

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


def _check_destination(path):
    """Refuses a destination that holds anything (nothing is ever deleted)."""
    if os.path.islink(path) or (os.path.exists(path) and not os.path.isdir(path)):
        raise ExportError(
            f"The export destination {path!r} already exists (a file or link); "
            "choose a new path, or remove it yourself first. An export never "
            "replaces existing files.")
    if os.path.isdir(path) and os.listdir(path):
        raise ExportError(
            f"The export destination {path!r} is a folder that is not empty; "
            "choose a new path, or remove it yourself first. An export never "
            "deletes existing files.")


def _group_setting(layer, name):
    return getattr(layer.routing_phase(False), name)


def _tokens_per_image(model):
    """Tokens one image gives an MoE layer (E³: with its N copies), or 1."""
    backbone = getattr(model, "backbone", None)
    tokens = getattr(backbone, "num_tokens", 1)
    return int(tokens) * int(getattr(backbone, "ensemble_size", 1) or 1)


@contextlib.contextmanager
def _export_routing(model, batch):
    """One image per group for a dynamic batch when the model routes all
    the tokens of a call together; with a static batch, routing groups cut
    to the batch (see the module docstring)."""
    backbone = getattr(model, "backbone", None)
    layers = backbone.get_moe_layers() if hasattr(backbone, "get_moe_layers") else []
    if batch is not None and layers and backbone.moe_type != "soft":
        with _groups_within_batch(model, layers, batch):
            yield
        return
    if (batch is not None or not layers or backbone.moe_type == "soft"
            or any(_group_setting(layer, "group_size") is not None
                   or _group_setting(layer, "images_per_group") is not None
                   for layer in layers)):
        yield
        return
    saved = [layer.eval_routing for layer in layers]
    try:
        for layer, routing in zip(layers, saved, strict=True):
            layer.eval_routing = {**routing, "group_size": None, "images_per_group": 1}
        yield
    finally:
        for layer, routing in zip(layers, saved, strict=True):
            layer.eval_routing = routing


@contextlib.contextmanager
def _groups_within_batch(model, layers, batch):
    """Evaluation groups of at most `batch` images while exporting."""
    tokens = _tokens_per_image(model)
    saved = [layer.eval_routing for layer in layers]
    cut = []
    try:
        for layer, routing in zip(layers, saved, strict=True):
            images = _group_setting(layer, "images_per_group")
            group_size = _group_setting(layer, "group_size")
            if (images is not None and images > batch) or (
                    group_size is not None and group_size > batch * tokens):
                cut.append(f"{layer.path}: images_per_group={images}, "
                           f"group_size={group_size}")
                layer.eval_routing = {**routing, "group_size": None,
                                      "images_per_group": batch}
        if cut:
            warnings.warn(
                f"Routing groups larger than the export's batch_size={batch} are "
                f"routed as one group of the batch's {batch} image(s) in the "
                f"exported graph ({'; '.join(cut)}); a larger group would only "
                "add masked padding images to every call. The capacity follows "
                "the batch's tokens.", UserWarning, stacklevel=4)
        yield
    finally:
        for layer, routing in zip(layers, saved, strict=True):
            layer.eval_routing = routing


@contextlib.contextmanager
def _float_integer_products():
    """Within it, `ops.einsum`/`ops.matmul` of two int8 operands run in
    float32 (ONNX export only).

    Keras' int8 `Dense`/`EinsumDense` multiply int8 activations by int8
    kernels; ONNX Runtime has no integer `Einsum` (nor `MatMul` for int8).
    The products of int8 values are integers below 2^14, so float32 gives
    the same sums exactly while they stay below 2^24 (contractions of up to
    1,040 terms at full scale) and to float32 rounding beyond: the values
    of the int8 model, not a dequantized float model.
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
            it must not exist (or be an empty folder). Written to a
            temporary name beside it and renamed when complete.
        format: `"tf_saved_model"` or `"onnx"`.
        batch_size: `None` (dynamic batch; SavedModel only) or a positive
            int, the batch the graph is exported for. Required for ONNX.
            With `None`, a model that routes all the tokens of a call as
            one group is exported with one image per group.
        image_bytes: bool, also add the `serve_image_bytes` endpoint to a
            SavedModel (decoding and the image converter in the graph).
        quantization: `None`, or `"dynamic_int8"` (ONNX only): ONNX
            Runtime's dynamic quantization of the float32 export. The
            weights of its `MatMul` ops (the dense layers and the expert
            banks) are stored as int8 and multiplied by ONNX Runtime's
            integer kernels, the activations quantized on every call. On a
            weight-bound model this is the fast CPU path
            (`benchmarks/int8_weight_bound.py`). Export the float model: a
            model already quantized with `model.quantize("int8")` is
            refused.
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
    # The routing counts the batch's tokens in int32.
    batch_size = check_int(batch_size, "batch_size", maximum=MAX_TOKENS // _tokens_per_image(model),
              allow_none=True)
    if format == "onnx" and batch_size is None:
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
    batch = batch_size
    spec = keras.InputSpec(shape=(batch, *shape), dtype="float32", name="images")
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".export-", dir=parent)
    except OSError as error:
        raise _write_error(path, error) from error
    try:
        target = os.path.join(staging, "model.onnx" if format == "onnx" else "saved_model")
        moves = [(target, path)]
        try:
            products = (_float_integer_products() if format == "onnx"
                        else contextlib.nullcontext())
            with exportable_routing(), _export_routing(model, batch), products, \
                    _quiet_onnx_serializer():
                keras.Model.export(model, target, format=format, verbose=verbose,
                                   input_signature=[spec], **_converter_kwargs(format))
            if format == "onnx":
                _drop_unused_initializers(target)
            if format == "onnx" and quantization is not None:
                target = _quantize_onnx(target)
            if format == "onnx":
                moves = _pack_onnx(target, path)
            if format == "tf_saved_model":
                _add_checked_endpoints(model, target, os.path.join(staging, "served"),
                                       image_bytes)
                moves = [(os.path.join(staging, "served"), path)]
        except ExportError:
            raise
        except OSError as error:
            raise _write_error(path, error) from error
        except Exception as error:
            if _is_disk_full(error):
                raise _write_error(path, error) from error
            raise _conversion_error(model, format, error) from error
        _move_into_place(moves)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def _converter_kwargs(format):
    """Keyword arguments of `keras.Model.export` for `format`.

    A SavedModel serves inference only: jax2tf converts the forward pass
    without a `tf.custom_gradient` (`with_gradient=False`). With one, every
    `tf.saved_model.load` of the export warned about "unsaved custom
    gradients", which a serving graph never computes.
    """
    if format == "tf_saved_model":
        return {"jax2tf_kwargs": {"with_gradient": False}}
    return {}


class _DropMessages(logging.Filter):
    """Drops log records whose message starts with one of `prefixes`."""

    def __init__(self, prefixes):
        super().__init__()
        self.prefixes = tuple(prefixes)

    def filter(self, record):
        return not str(record.msg).startswith(self.prefixes)


@contextlib.contextmanager
def _dropped_messages(logger_name, *prefixes):
    """Within it, logger `logger_name` drops the records whose message
    starts with one of `prefixes` (nothing else; the filter is removed on
    exit)."""
    logger = logging.getLogger(logger_name)
    quiet = _DropMessages(prefixes)
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _quiet_onnx_serializer():
    """The ONNX serializer's warnings about intermediate values without a
    type, dropped (only those, only from `onnx_ir.serde`).

    jax2onnx leaves the element type of a few intermediate values unset;
    onnx_ir then leaves their shape annotation (`value_info`) out of the
    file and warns once per value. The graph's nodes, inputs and outputs
    are complete: ONNX Runtime infers those shapes itself.
    """
    return _dropped_messages("onnx_ir.serde", "The value type for shape")


def _quiet_onnx_quantizer():
    """ONNX Runtime's quantizer's notes on what it leaves in float, dropped
    (only those two; it logs them on the root logger).

    It notes each integer tensor of the routing (positions, counts) as a
    tensor it cannot quantize, which is right: only float `MatMul` weights
    are quantized. Its advice to pre-process the graph first (symbolic
    shape inference and graph optimizations, `onnxruntime.quantization.
    preprocess`) is for static quantization's calibration; the dynamic
    quantization here does not need it.
    """
    return _dropped_messages(
        "", "Please consider to run pre-processing before quantization",
        "Inference failed or unsupported type to quantize for tensor")


def _used_names(graph, used):
    """Adds to `used` every value name the nodes of `graph` (and of their
    subgraphs: `If` branches, `Loop`/`Scan` bodies) read, and its outputs."""
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
    """Removes the staged ONNX graph's initializers that no node reads.

    The converter keeps a few constants it folded away; ONNX Runtime would
    remove them again, with a warning each, in every `InferenceSession`.
    Weights stored beside the graph stay where they are (the graph is
    re-read without them; `_pack_onnx` repacks what is still referenced).
    """
    import onnx

    model = onnx.load(target, load_external_data=False)
    used = _used_names(model.graph, set())
    unused = [tensor for tensor in model.graph.initializer if tensor.name not in used]
    if not unused:
        return
    names = {tensor.name for tensor in unused}
    kept = [tensor for tensor in model.graph.initializer if tensor.name not in names]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    # An initializer may also be listed as a graph input (older IR versions).
    inputs = [value for value in model.graph.input if value.name not in names]
    del model.graph.input[:]
    model.graph.input.extend(inputs)
    onnx.save_model(model, target)


def _quantize_onnx(target):
    """ONNX Runtime's dynamic int8 quantization of the staged float export.

    Returns:
        The staged quantized graph, in a folder of its own beside `target`
        (weights beside it when the float export has them).
    """
    from onnxruntime.quantization import QuantType
    from onnxruntime.quantization import quantize_dynamic

    staging = os.path.dirname(target)
    external = len(os.listdir(staging)) > 1
    folder = os.path.join(staging, "quantized")
    os.mkdir(folder)
    quantized = os.path.join(folder, "model.onnx")
    with _quiet_onnx_quantizer():
        quantize_dynamic(target, quantized, weight_type=QuantType.QInt8,
                         use_external_data_format=external)
    return quantized


def _move_into_place(moves):
    """Renames staged files to their destinations, the last one (the file
    that refers to the others) last; on failure removes what it moved."""
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
    """The staged ONNX export as one file, or a graph and one weights file.

    The ONNX exporter may store large initializers in files beside the
    graph. An export of up to `ONNX_SINGLE_FILE_BYTES` is folded into the
    graph file; a larger one gets all its weights in one file named after
    the destination (`path + ".data"`), which the graph refers to.

    Returns:
        `[(staged file, destination)]`, the graph last.
    """
    staging = os.path.dirname(target)
    others = [name for name in os.listdir(staging) if name != os.path.basename(target)]
    total = sum(os.path.getsize(os.path.join(staging, name))
                for name in [*others, os.path.basename(target)])
    if total <= ONNX_SINGLE_FILE_BYTES:
        if others:
            import onnx

            graph = onnx.load(target)  # reads the external data from `staging`
            onnx.save_model(graph, target, save_as_external_data=False)
        return [(target, path)]
    import onnx

    graph = onnx.load(target)
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
        reason = (str(error).strip().splitlines() or [type(error).__name__])[-1][:300]
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
    """Width x height from an encoded image's header, without decoding it.

    JPEG: `extract_jpeg_shape`; PNG: the IHDR chunk (big-endian, bytes
    16-24); GIF: the logical screen (little-endian, bytes 6-10) times an
    upper bound on the number of frames (all are decoded); BMP: the
    info header (little-endian int32, bytes 18-26). Other data: 0 (the
    decoder reports it).
    """
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
        # TensorFlow decodes every frame of a GIF: the screen size times an
        # upper bound on the frames. Each frame after the first starts with
        # an image separator (0x2C) right after a block terminator (0x00).
        separators = tf.size(tf.strings.split(data, sep=b"\x00\x2c")) - 1
        frames = tf.cast(tf.maximum(separators, 0) + 1, tf.int64)
        return field(6, 2, tf.uint16, True) * field(8, 2, tf.uint16, True) * frames

    def bmp():
        return field(18, 4, tf.int32, True) * field(22, 4, tf.int32, True)

    def other():
        return tf.constant(0, tf.int64)

    prefix3 = tf.strings.substr(data, 0, 3)
    prefix2 = tf.strings.substr(data, 0, 2)
    return tf.case([
        (tf.equal(prefix3, b"\xff\xd8\xff"), jpeg),
        (tf.equal(magic, b"\x89PNG"), png),
        (tf.equal(magic, b"GIF8"), gif),
        (tf.equal(prefix2, b"BM"), bmp),
    ], default=other, exclusive=False)


def _check_images_tf(images, float_range=(-1.0, 1.0)):
    """In-graph checks of a `serve` batch (as `predict`'s NumPy checks)."""
    import tensorflow as tf

    low, high = float_range
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

        # Any rank and size: the shape is checked here, with a clear message.
        @tf.function(input_signature=[tf.TensorSpec(None, tf.float32)])
        def serve(self, images):
            # Rank and sizes in one check (the shape padded to 4 entries, so
            # that a wrong rank cannot fail inside the comparison).
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
