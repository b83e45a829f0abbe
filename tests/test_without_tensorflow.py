"""TensorFlow is optional: the main job, `predict` and `convert` run without it.

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

from keras_vmoe.extras import MissingDependencyError
from keras_vmoe.extras import require

CHILD = os.path.join(os.path.dirname(__file__), "without_tensorflow_child.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, cwd):
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="2")
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


def test_a_missing_extra_names_the_pip_command():
    with pytest.raises(MissingDependencyError,
                       match=r"tf.data pipelines needs tensorflow.*keras-vmoe\[tensorflow\]"):
        require("tensorflow.not_a_module_25", "tf.data pipelines")
    with pytest.raises(MissingDependencyError, match=r"keras-vmoe\[data\]"):
        require("tensorflow_datasets.not_a_module_25", "TFDS")
    assert require("numpy", "anything") is np
