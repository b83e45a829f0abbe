"""Exported graphs reproduce the Keras logits on the upstream fixtures.

Marker `export` (converts graphs, slow; .ci/run runs the group). Every
task kind: V-MoE (Token Choice), V-MoE with Expert Choice, E³ ensemble,
Soft MoE. The SavedModel is exported once with a dynamic batch and run
with TensorFlow at batch 1 and 8; ONNX is exported at batch 8 (and 1 for
V-MoE, whose routing group of 2 images the static batch cuts to 1: compared
with the model routing one image per group) and run with onnxruntime.
Bound: max abs diff <= 1e-5 (f32). Soft
MoE rounds its dispatched tokens to bfloat16 inside the model (as
upstream), so a 1e-7 f32 difference can move one value by a bf16 step:
its bound is 1e-3, the tolerance the conversion tests use for bf16.
The measured figure is in every assertion message.
"""

import io
import json

import numpy as np
import pytest

pytestmark = pytest.mark.export

tf = pytest.importorskip("tensorflow")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("jax2onnx")

from keras_vmoe.conversion import build_model_from_upstream  # noqa: E402
from keras_vmoe.conversion import routing_from_upstream_config  # noqa: E402
from keras_vmoe.deploy import export_model  # noqa: E402

# fixture -> variant (the routing is read from its config.json).
FIXTURES = {"vmoe_tiny": "f32dispatch", "vmoe_tiny_ec": "f32dispatch",
            "eee_tiny": "f32dispatch", "softmoe_tiny": "main"}
F32_BOUND, BF16_BOUND = 1e-5, 1e-3


def _routing(upstream_dir, fixture):
    config = json.loads((upstream_dir / fixture / "config.json").read_text())
    model_config = config["variants"][FIXTURES[fixture]]["model_config"]
    return routing_from_upstream_config(model_config, image_size=32)


@pytest.fixture(scope="module")
def case(upstream_dir):
    cache = {}

    def get(fixture):
        if fixture not in cache:
            model = build_model_from_upstream(
                str(upstream_dir / fixture / "checkpoint"), **_routing(upstream_dir, fixture))
            x = np.load(upstream_dir / fixture / "inputs.npy")
            batches = {1: x[:1], 8: np.concatenate([x, x[::-1]])}
            logits = {b: np.asarray(model.predict_on_batch(v)) for b, v in batches.items()}
            cache[fixture] = model, batches, logits
        return cache[fixture]

    return get


def _bound(fixture):
    return BF16_BOUND if fixture == "softmoe_tiny" else F32_BOUND


def _check(fixture, fmt, batch, actual, expected):
    diff = float(np.max(np.abs(actual - expected)))
    bound = _bound(fixture)
    assert actual.shape == expected.shape
    assert diff <= bound, f"{fixture} {fmt} batch {batch}: max abs diff {diff:.3g} > {bound}"
    print(f"{fixture} {fmt} batch {batch}: max abs diff {diff:.3g} (bound {bound})")


@pytest.mark.parametrize("fixture", list(FIXTURES))
def test_saved_model_reproduces_keras_logits_batch_1_and_8(case, fixture, tmp_path):
    model, batches, logits = case(fixture)
    export_model(model, tmp_path / "sm", "tf_saved_model", image_bytes=False)
    loaded = tf.saved_model.load(str(tmp_path / "sm"))
    for batch, x in batches.items():  # one graph, dynamic batch
        _check(fixture, "tf_saved_model", batch, loaded.serve(x).numpy(), logits[batch])


@pytest.mark.parametrize("fixture,batch", [(f, 8) for f in FIXTURES] + [("vmoe_tiny", 1)])
def test_onnx_reproduces_keras_logits(case, fixture, batch, tmp_path, upstream_dir):
    model, batches, logits = case(fixture)
    expected = logits[batch]
    routing = _routing(upstream_dir, fixture)
    if (routing.get("images_per_group") or 0) > batch:
        # A static batch smaller than the routing group is routed as one
        # group of the batch (`deploy/export.py`, with a warning): the Keras
        # model that routes groups of `batch` images gives the same logits.
        cut = build_model_from_upstream(str(upstream_dir / fixture / "checkpoint"),
                                        **{**routing, "images_per_group": batch})
        expected = np.asarray(cut.predict_on_batch(batches[batch]))
        with pytest.warns(UserWarning, match="routed as one group of the batch"):
            path = export_model(model, tmp_path / "m.onnx", "onnx", batch_size=batch)
    else:
        path = export_model(model, tmp_path / "m.onnx", "onnx", batch_size=batch)
    session = ort.InferenceSession(str(path))
    name = session.get_inputs()[0].name
    _check(fixture, "onnx", batch, session.run(None, {name: batches[batch]})[0], expected)


def test_saved_model_serves_raw_image_bytes(case, tmp_path):
    from PIL import Image

    model, _, _ = case("vmoe_tiny")
    export_model(model, tmp_path / "sm", "tf_saved_model")
    served = tf.saved_model.load(str(tmp_path / "sm"))
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (40 + 7 * i, 50, 3), dtype=np.uint8) for i in range(3)]
    encoded = []
    for image in images:
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="PNG")
        encoded.append(buffer.getvalue())
    out = served.signatures["serve_image_bytes"](tf.constant(encoded))
    actual = next(iter(out.values())).numpy()
    converter = model.preprocessor.image_converter
    converted = np.concatenate([np.asarray(converter(im[None])) for im in images])
    expected = np.asarray(model.predict_on_batch(converted))
    diff = float(np.max(np.abs(actual - expected)))
    # Resizing runs in TF here and in Keras(JAX) there: a looser bound.
    assert diff <= 1e-4, f"serve_image_bytes vs Keras converter + model: {diff:.3g}"


def test_cli_export_writes_a_servable_onnx(case, tmp_path, capsys):
    from keras_vmoe.cli import main
    from keras_vmoe.presets import save_to_preset

    model, batches, logits = case("vmoe_tiny")
    save_to_preset(model, str(tmp_path / "preset"))
    out = tmp_path / "out" / "m.onnx"
    assert main(["export", "--preset", str(tmp_path / "preset"), "--format", "onnx",
                 "--output", str(out), "--batch-size", "8"]) == 0
    session = ort.InferenceSession(str(out))
    name = session.get_inputs()[0].name
    _check("vmoe_tiny", "onnx (cli)", 8, session.run(None, {name: batches[8]})[0], logits[8])
