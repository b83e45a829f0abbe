"""`keras_vmoe.deploy.export` and `keras-vmoe export`: defaults, destinations,
checked serving inputs.

Marker `export` (converts graphs, slow; .ci/run runs the group). One tiny
V-MoE preset written as `keras-vmoe finetune` writes it (default routing
groups, `central_crop` converter) is exported once per module through the
command line and shared.
"""

import io
import os
import struct
import subprocess
import zlib

import numpy as np
import pytest
import tiny_configs

pytestmark = pytest.mark.export

tf = pytest.importorskip("tensorflow")

from keras_vmoe.cli import main  # noqa: E402
from keras_vmoe.deploy import export_model  # noqa: E402
from keras_vmoe.deploy.export import MAX_PIXELS  # noqa: E402
from keras_vmoe.deploy.export import ExportError  # noqa: E402

SIZE = 16


def _finetune_style_model():
    """As `keras-vmoe finetune` builds its model: no routing groups set (all
    the tokens of a call are one group) and a `central_crop` converter."""
    import keras

    from keras_vmoe import models
    from keras_vmoe.preprocessing import ImageConverter

    keras.utils.set_random_seed(0)
    config = tiny_configs.vmoe_8px(router={"capacity_factor": 1.05}, image_size=SIZE,
                                   patch_size=8)
    model = models.ImageClassifier(models.VisionTransformerBackbone(**config),
                                   num_classes=3,
                                   preprocessor=models.ImageClassifierPreprocessor(
                                       ImageConverter(SIZE, crop="central_crop")))
    rng = np.random.default_rng(0)
    model.set_weights([rng.normal(0, 0.5, w.shape).astype(w.dtype)
                       for w in model.get_weights()])
    return model


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from keras_vmoe.presets import save_to_preset

    root = tmp_path_factory.mktemp("export")
    model = _finetune_style_model()
    layer = model.backbone.get_moe_layers()[0]
    assert layer.group_size is None and layer.images_per_group is None
    save_to_preset(model, str(root / "preset"))
    out = root / "served"
    assert main(["export", "--preset", str(root / "preset"), "--format",
                 "tf_saved_model", "--output", str(out)]) == 0
    return model, root, tf.saved_model.load(str(out))


def _images(n, size=SIZE):
    return np.random.default_rng(1).uniform(-1, 1, (n, size, size, 3)).astype("float32")


def test_cli_exports_a_finetune_preset_with_default_groups(exported):
    model, _, served = exported
    x = _images(4)
    # A dynamic batch routes each image as its own group: the prediction of
    # one image at a time, whatever else is in the batch.
    alone = np.concatenate([np.asarray(model.predict_on_batch(x[i:i + 1]))
                            for i in range(4)])
    for batch in (1, 4):
        diff = float(np.max(np.abs(served.serve(x[:batch]).numpy() - alone[:batch])))
        assert diff <= 1e-5, f"batch {batch}: {diff:.3g}"
    # The model's own routing is unchanged by the export.
    assert model.backbone.get_moe_layers()[0].eval_routing == {}


def test_serve_image_bytes_applies_the_central_crop_converter(exported):
    from PIL import Image

    model, _, served = exported
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (20 + 9 * i, 30, 3), dtype=np.uint8) for i in range(3)]
    encoded = []
    for image in images:
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="PNG")
        encoded.append(buffer.getvalue())
    actual = served.signatures["serve_image_bytes"](tf.constant(encoded))
    actual = next(iter(actual.values())).numpy()
    converted = [np.asarray(model.preprocessor.image_converter(im[None])) for im in images]
    expected = np.concatenate([np.asarray(model.predict_on_batch(c)) for c in converted])
    diff = float(np.max(np.abs(actual - expected)))
    assert diff <= 1e-4, f"serve_image_bytes vs Keras converter + model: {diff:.3g}"


def _png_header_only(width, height):
    """A PNG whose IHDR says width x height, with one tiny (truncated) IDAT."""
    def chunk(kind, data):
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(b"\0" * 1024)) + chunk(b"IEND", b""))


def _gif_header_only(width, height, frames=1):
    """A GIF of `frames` (empty) frames on a width x height screen."""
    frame = (b"\x2c" + struct.pack("<HHHH", 0, 0, width, height) + b"\x00"
             + b"\x02\x00")  # descriptor, LZW minimum code size, terminator
    return (b"GIF89a" + struct.pack("<HH", width, height) + b"\x00\x00\x00"
            + frame * frames + b";")


def _jpeg_claiming(width, height):
    """A real small JPEG whose frame header (SOF0) is patched to claim
    width x height."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(buffer, format="JPEG")
    data = bytearray(buffer.getvalue())
    sof = data.index(b"\xff\xc0")
    data[sof + 5:sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def test_serve_image_bytes_refuses_too_many_pixels_before_decoding(exported):
    _, _, served = exported
    endpoint = served.signatures["serve_image_bytes"]
    # 1000 x 1000 is allowed for one frame, not for 300 (all are decoded).
    for data in (_png_header_only(20000, 20000), _gif_header_only(65535, 65535),
                 _gif_header_only(1000, 1000, frames=300),
                 _jpeg_claiming(60000, 60000)):
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=f"more than {MAX_PIXELS} pixels"):
            endpoint(tf.constant([data]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="empty"):
        endpoint(tf.constant([], tf.string))
    # A real animated GIF within the bound is served (its first frame).
    from PIL import Image

    frames = [Image.fromarray(np.full((20, 30, 3), 40 * i, np.uint8)) for i in range(3)]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:])
    logits = next(iter(endpoint(tf.constant([buffer.getvalue()])).values())).numpy()
    assert logits.shape == (1, 3) and np.all(np.isfinite(logits))


@pytest.mark.parametrize("bad,match", [
    (_images(2) * 255, r"must be in \[-1, 1\]"),
    (np.full((1, SIZE, SIZE, 3), np.nan, "float32"), "NaN or inf"),
    (np.zeros((0, SIZE, SIZE, 3), "float32"), "empty"),
    (_images(2, size=8), r"batch of shape \(batch, 16, 16, 3\)"),
    (np.zeros((SIZE, SIZE, 3), "float32"), "batch of shape"),
])
def test_serve_refuses_what_predict_refuses(exported, bad, match):
    _, _, served = exported
    with pytest.raises(tf.errors.InvalidArgumentError, match=match):
        served.signatures["serve"](tf.constant(bad))
    # 1e-3 of the range of slack, as predict.
    served.serve(np.clip(_images(1) * 1.0005, -1.0005, 1.0005))


def _tree(folder):
    return sorted((os.path.relpath(os.path.join(d, f), folder),
                   open(os.path.join(d, f), "rb").read())
                  for d, _, files in os.walk(folder) for f in files)


def test_export_never_deletes_what_is_at_the_destination(exported, tmp_path, capsys):
    model, root, _ = exported
    preset = str(root / "preset")
    user = tmp_path / "user"
    user.mkdir()
    (user / "thesis.txt").write_text("four years")
    lone = tmp_path / "notes.txt"
    lone.write_text("keep me")
    before = _tree(preset)
    for output in (str(user), str(lone), preset, os.path.join(preset, "sub"),
                   str(root)):
        assert main(["export", "--preset", preset, "--format", "tf_saved_model",
                     "--output", output]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: --output") and len(err.strip().splitlines()) == 1
    assert (user / "thesis.txt").read_text() == "four years"
    assert lone.read_text() == "keep me"
    assert _tree(preset) == before
    for output in (user, lone):
        with pytest.raises(ExportError, match="never"):
            export_model(model, output, "tf_saved_model")
    assert (user / "thesis.txt").read_text() == "four years"
    assert lone.read_text() == "keep me"
    # An empty folder is a valid destination.
    (tmp_path / "empty").mkdir()
    export_model(model, tmp_path / "empty", "tf_saved_model", image_bytes=False)
    assert (tmp_path / "empty" / "saved_model.pb").is_file()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".export-")]


def test_onnx_needs_a_named_batch_size(exported, tmp_path, capsys):
    model, root, _ = exported
    with pytest.raises(ValueError, match="batch_size"):
        export_model(model, tmp_path / "m.onnx", "onnx")
    assert main(["export", "--preset", str(root / "preset"), "--format", "onnx",
                 "--output", str(tmp_path / "m.onnx")]) == 1
    err = capsys.readouterr().err
    assert "--batch-size" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "m.onnx").exists()
    assert main(["export", "--preset", str(root / "preset"), "--format",
                 "tf_saved_model", "--quantization", "dynamic_int8",
                 "--output", str(tmp_path / "served")]) == 1
    err = capsys.readouterr().err
    assert "--quantization dynamic_int8 needs --format onnx" in err
    assert not (tmp_path / "served").exists()


def test_a_full_disk_is_one_clear_line(exported, tmp_path, capsys):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "small"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs",
                             str(mount)], capture_output=True, text=True)
    if result.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    try:
        _, root, _ = exported
        assert main(["export", "--preset", str(root / "preset"), "--format",
                     "tf_saved_model", "--output", str(mount / "served")]) == 1
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        assert "disk is full" in err and "Traceback" not in err
        assert os.listdir(mount) == []
    finally:
        subprocess.run(["umount", str(mount)], check=False)


@pytest.mark.parametrize("batch", [1, 4])
def test_an_int8_model_exported_to_onnx_runs_in_onnxruntime(batch, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("jax2onnx")
    model = _finetune_style_model()
    model.quantize("int8")  # int8 Dense/EinsumDense: int8 x int8 products
    x = _images(batch)
    path = export_model(model, tmp_path / "m.onnx", "onnx", batch_size=batch)
    session = ort.InferenceSession(str(path))
    actual = session.run(None, {session.get_inputs()[0].name: x})[0]
    diff = float(np.max(np.abs(actual - np.asarray(model.predict_on_batch(x)))))
    assert diff <= 1e-5, f"int8 onnx batch {batch}: {diff:.3g}"


def _staged_matmul_graph(tmp_path):
    """A staged ONNX export whose weights the exporter wrote beside it."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto
    from onnx import helper
    from onnx import numpy_helper

    weight = np.arange(1024, dtype="float32").reshape(32, 32)  # over 1 KiB: stored apart
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32])],
        [numpy_helper.from_array(weight, "w")])
    staging = tmp_path / "staging"
    staging.mkdir()
    target = str(staging / "model.onnx")
    onnx.save_model(helper.make_model(graph), target, save_as_external_data=True,
                    location="model.onnx.data", size_threshold=0)
    assert sorted(os.listdir(staging)) == ["model.onnx", "model.onnx.data"]
    return target, weight


def _run_matmul(path, weight):
    ort = pytest.importorskip("onnxruntime")
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    x = np.ones((1, 32), "float32")
    np.testing.assert_allclose(session.run(None, {"x": x})[0], x @ weight)


def test_weights_written_beside_an_onnx_graph_are_folded_into_it(tmp_path):
    from keras_vmoe.deploy.export import _move_into_place
    from keras_vmoe.deploy.export import _pack_onnx

    target, weight = _staged_matmul_graph(tmp_path)
    moved = str(tmp_path / "alone.onnx")
    moves = _pack_onnx(target, moved)
    assert moves == [(target, moved)]
    _move_into_place(moves)  # the graph file alone reaches the destination
    assert sorted(os.listdir(tmp_path)) == ["alone.onnx", "staging"]
    _run_matmul(moved, weight)


def test_an_onnx_export_over_the_single_file_limit_keeps_its_weights_beside_it(
        tmp_path, monkeypatch):
    from keras_vmoe.deploy import export as export_lib

    monkeypatch.setattr(export_lib, "ONNX_SINGLE_FILE_BYTES", 64)
    target, weight = _staged_matmul_graph(tmp_path)
    final = str(tmp_path / "big.onnx")
    moves = export_lib._pack_onnx(target, final)
    assert [m[1] for m in moves] == [final + ".data", final]  # the graph last
    export_lib._move_into_place(moves)
    assert sorted(os.listdir(tmp_path)) == ["big.onnx", "big.onnx.data", "staging"]
    assert os.listdir(tmp_path / "staging") == []
    _run_matmul(final, weight)


def test_a_large_onnx_export_never_replaces_a_weights_file(tmp_path, monkeypatch):
    pytest.importorskip("jax2onnx")
    from keras_vmoe.deploy import export as export_lib

    monkeypatch.setattr(export_lib, "ONNX_SINGLE_FILE_BYTES", 1024)
    model = _finetune_style_model()
    x = _images(2)
    path = str(tmp_path / "m.onnx")
    (tmp_path / "m.onnx.data").write_bytes(b"keep")
    with pytest.raises(ExportError, match=r"m\.onnx\.data.*already exists"):
        export_model(model, path, "onnx", batch_size=2)
    assert (tmp_path / "m.onnx.data").read_bytes() == b"keep"
    assert sorted(os.listdir(tmp_path)) == ["m.onnx.data"]
    os.remove(tmp_path / "m.onnx.data")
    assert export_model(model, path, "onnx", batch_size=2) == path
    assert sorted(os.listdir(tmp_path)) == ["m.onnx", "m.onnx.data"]
    ort = pytest.importorskip("onnxruntime")
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    actual = session.run(None, {session.get_inputs()[0].name: x})[0]
    np.testing.assert_allclose(actual, np.asarray(model.predict_on_batch(x)), atol=1e-5)


# What the converters and runtimes printed before the export quieted or
# avoided it: onnx_ir's untyped intermediate values, ONNX Runtime removing
# unused initializers (one line each, in colour), its quantizer's notes on
# integer tensors, and TensorFlow loading jax2tf's unsaved custom gradients.
NOISE = ("is not known. Please set type for the value", "Removing initializer",
         "Please consider to run pre-processing before quantization",
         "Inference failed or unsupported type to quantize",
         "unsaved custom gradients")


def _noise(capfd, caplog):
    captured = capfd.readouterr()
    printed = captured.out + captured.err + caplog.text
    return [line for line in printed.splitlines() if any(n in line for n in NOISE)]


def test_exports_and_their_runtimes_print_no_converter_noise(exported, tmp_path, capfd,
                                                              caplog):
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("jax2onnx")
    model, root, _ = exported
    x = _images(2)
    capfd.readouterr()
    path = export_model(model, tmp_path / "m.onnx", "onnx", batch_size=2)
    session = ort.InferenceSession(str(path))
    onnx_logits = session.run(None, {session.get_inputs()[0].name: x})[0]
    export_model(model, tmp_path / "sm", "tf_saved_model", image_bytes=False)
    served = tf.saved_model.load(str(tmp_path / "sm"))
    tf.saved_model.load(str(root / "served"))  # the fixture's, with serve_image_bytes
    assert _noise(capfd, caplog) == []
    np.testing.assert_allclose(onnx_logits, model.predict_on_batch(x), atol=1e-5)
    # The SavedModel routes each image as its own group: one image gives predict's logits.
    np.testing.assert_allclose(served.serve(tf.constant(x[:1])).numpy(),
                               model.predict_on_batch(x[:1]), atol=1e-5)


def test_onnx_dynamic_int8_export_runs_integer_matmuls(tmp_path, capfd, caplog):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("jax2onnx")
    model = _finetune_style_model()
    x = _images(2)
    path = str(tmp_path / "q.onnx")
    assert export_model(model, path, "onnx", batch_size=2,
                        quantization="dynamic_int8") == path
    assert os.listdir(tmp_path) == ["q.onnx"]
    op_types = {node.op_type for node in onnx.load(path).graph.node}
    assert "MatMulInteger" in op_types and "DynamicQuantizeLinear" in op_types
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    assert _noise(capfd, caplog) == []
    actual = session.run(None, {session.get_inputs()[0].name: x})[0]
    expected = np.asarray(model.predict_on_batch(x))
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(actual, expected, atol=0.1 * scale)


def test_dynamic_int8_needs_onnx_and_a_float_model(tmp_path):
    model = _finetune_style_model()
    with pytest.raises(ValueError, match="format='onnx' only"):
        export_model(model, str(tmp_path / "s"), "tf_saved_model",
                     quantization="dynamic_int8")
    with pytest.raises(ValueError, match="`quantization` must be one of"):
        export_model(model, str(tmp_path / "q.onnx"), "onnx", batch_size=1,
                     quantization="int4")
    model.quantize("int8")
    with pytest.raises(ExportError, match="already has int8 layers"):
        export_model(model, str(tmp_path / "q.onnx"), "onnx", batch_size=1,
                     quantization="dynamic_int8")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("routing", [{"images_per_group": 1_000_000},
                                     {"group_size": 10**6}])
def test_a_routing_group_larger_than_the_batch_is_cut_to_the_batch(routing):
    from keras_vmoe.deploy import export as export_lib

    model = _finetune_style_model()
    layer = model.backbone.get_moe_layers()[0]
    model.set_routing(**routing, phase="eval")
    before = dict(layer.eval_routing)
    x = _images(2)
    with pytest.warns(UserWarning, match=r"batch_size=2.*masked padding"):
        with export_lib._export_routing(model, 2):
            assert layer.eval_routing["images_per_group"] == 2
            assert layer.eval_routing["group_size"] is None
            inside = np.asarray(model.predict_on_batch(x))
    assert layer.eval_routing == before
    # The same as routing the two images as one group.
    model.set_routing(images_per_group=2, phase="eval")
    np.testing.assert_allclose(inside, np.asarray(model.predict_on_batch(x)), atol=1e-6)
    # A group within the batch is kept as it is.
    model.set_routing(images_per_group=1, phase="eval")
    with export_lib._export_routing(model, 2):
        assert layer.eval_routing["images_per_group"] == 1


@pytest.mark.parametrize("batch_size", [10**20, 2**31])
def test_a_batch_size_beyond_the_routing_counts_is_refused(batch_size, tmp_path):
    model = _finetune_style_model()
    with pytest.raises(ValueError, match=rf"batch_size.*between 1 and .*{batch_size}"):
        export_model(model, tmp_path / "m.onnx", "onnx", batch_size=batch_size)
    assert not os.listdir(tmp_path)


def test_the_serving_graph_converts_images_as_the_default_converter():
    from keras_vmoe import models
    from keras_vmoe.deploy.export import _converter_tf

    backbone = models.VisionTransformerBackbone(**tiny_configs.vit(
        px=16, image_size=SIZE, num_layers=1))
    model = models.ImageClassifier(backbone, num_classes=2)
    converter = model.preprocessor.image_converter
    assert converter.upstream_resize
    image = np.random.default_rng(0).integers(0, 256, (37, 23, 3), "uint8")
    served = _converter_tf(model, tf.constant(image)).numpy()
    np.testing.assert_allclose(served, np.asarray(converter(image[None]))[0],
                               rtol=0, atol=1e-6)
