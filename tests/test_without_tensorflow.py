"""TensorFlow is optional: the main job, `predict`, `convert` and released
weights downloaded over HTTP (from a server on 127.0.0.1) run without it.

Each command runs in a child process (`without_tensorflow_child.py`) whose
`import tensorflow` (and TensorFlow Datasets, scikit-learn, scikit-image)
fails, as after a plain `pip install keras-vmoe`. Marked `without_tf`
(deselected by default, about 3 min on 2 cores: three processes compile
their models; `.ci/run` runs the group, and also installs the package in a
fresh virtualenv without TensorFlow and runs the main job there).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from keras_vmoe.utils.extras import MissingDependencyError
from keras_vmoe.utils.extras import require

CHILD = os.path.join(os.path.dirname(__file__), "without_tensorflow_child.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, cwd, **extra_env):
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="2", **extra_env)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, CHILD, *args], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "error: loaded" not in result.stderr
    return result


@pytest.mark.without_tf
def test_main_job_predict_and_convert_without_tensorflow(tmp_path, upstream_dir):
    from PIL import Image

    # The main job (digits, the NumPy pipeline), one short epoch.
    _run(["finetune", "--epochs", "1", "--train-split", "train[:128]",
          "--test-split", "test[:64]", "--output", "out"], tmp_path)
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["completed"] and metrics["train_examples"] == 128
    assert 0.0 <= metrics["test_accuracy"] <= 1.0
    assert (tmp_path / "out" / "preset" / "config.json").exists()

    # `predict` on a folder of image files (PNG and JPEG of other sizes).
    rng = np.random.default_rng(0)
    folder = tmp_path / "photos"
    folder.mkdir()
    for i, ext in enumerate(["png", "jpg", "png"]):
        image = rng.integers(0, 256, (20 + 9 * i, 30, 3), dtype="uint8")
        Image.fromarray(image).save(folder / f"{i}.{ext}")
    result = _run(["predict", str(folder), "--preset", "out/preset", "--top-k", "2",
                   "--json"], tmp_path)
    answers = json.loads(result.stdout)
    assert len(answers["predictions"]) == 3, result.stdout

    # The converter on a local upstream checkpoint, validated against the
    # upstream logits.
    fixture = upstream_dir / "softmoe_tiny"
    _run(["convert", "--upstream", str(fixture / "checkpoint"), "--output", "conv",
          "--validate-inputs", str(fixture / "inputs.npy"),
          "--validate-logits", str(fixture / "logits.npy"), "--atol", "1e-3"], tmp_path)
    assert (tmp_path / "conv" / "model.weights.h5").exists()


@pytest.mark.without_tf
def test_released_weights_over_http_without_tensorflow(tmp_path, upstream_dir):
    """A released preset downloaded from a server on 127.0.0.1 (killed, then
    resumed), and a checkpoint converted straight from its URL."""
    import shutil
    import time

    from http_server import Server
    from PIL import Image

    name = "vmoe_s32_last2_ilsvrc2012_randaug_light1"
    fixture = upstream_dir / "vmoe_tiny"
    bucket = tmp_path / "served" / "vmoe_checkpoints"
    bucket.mkdir(parents=True)
    for suffix in (".index", ".data-00000-of-00001"):
        shutil.copy(fixture / f"checkpoint{suffix}", bucket / f"{name}{suffix}")
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    data = f"vmoe_checkpoints/{name}.data-00000-of-00001"
    # Converted straight from its URL (Range reads), checked against the
    # upstream logits.
    soft = upstream_dir / "softmoe_tiny"
    with Server(upstream_dir) as server:
        _run(["convert", "--upstream", server.url("softmoe_tiny/checkpoint"),
              "--output", "conv", "--validate-inputs", str(soft / "inputs.npy"),
              "--validate-logits", str(soft / "logits.npy"), "--atol", "1e-3"], tmp_path)
    assert (tmp_path / "conv" / "model.weights.h5").exists()
    with Server(tmp_path / "served") as server:
        # The built-in name: downloaded (killed half-way, then resumed), converted.
        env = dict(os.environ, KERAS_BACKEND="jax", KERAS_HOME=str(tmp_path / "home"),
                   KERAS_VMOE_CHECKPOINT_ROOT=server.base)
        env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
        server.delay = 0.3
        child = subprocess.Popen([sys.executable, CHILD, "predict", "a.png",
                                  "--preset", name], cwd=tmp_path, env=env)
        partial = (tmp_path / "home" / "keras_vmoe" / ".downloads" / "vmoe_checkpoints"
                   / f".{name}.data-00000-of-00001.584835.part")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (
                partial.exists() and partial.stat().st_size > 0):
            time.sleep(0.05)
        child.kill()
        child.wait()
        have = partial.stat().st_size
        server.delay = 0.0
        server.drops[data] = 50_000
        server.requests.clear()
        result = _run(["predict", "a.png", "--preset", name, "--json"], tmp_path,
                      KERAS_HOME=str(tmp_path / "home"),
                      KERAS_VMOE_CHECKPOINT_ROOT=server.base)
    assert len(json.loads(result.stdout)["predictions"]) == 1
    ranges = [r for m, p, r in server.requests if p == data and m == "GET"]
    assert ranges == [f"bytes={have}-", f"bytes={have + 50_000}-"]
    assert (tmp_path / "home" / "keras_vmoe" / name / "config.json").exists()


def test_a_missing_extra_names_the_pip_command():
    with pytest.raises(MissingDependencyError,
                       match=r"tf.data pipelines needs tensorflow.*keras-vmoe\[tensorflow\]"):
        require("tensorflow.not_a_module_25", "tf.data pipelines")
    with pytest.raises(MissingDependencyError, match=r"keras-vmoe\[data\]"):
        require("tensorflow_datasets.not_a_module_25", "TFDS")
    assert require("numpy", "anything") is np
