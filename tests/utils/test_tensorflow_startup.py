"""keras_vmoe.utils.tensorflow_startup: TensorFlow's start-up lines stay off
stderr wherever TensorFlow is imported after keras_vmoe; other lines pass."""

import importlib.util
import os
import subprocess
import sys

import pytest

from keras_vmoe.utils import tensorflow_startup

STARTUP = (
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "I0000 00:00:1796391628.896096   30525 port.cc:153] oneDNN custom operations are on. "
    "You may see slightly different numerical results due to floating-point round-off "
    "errors from different computation orders. To turn them off, set the environment "
    "variable `TF_ENABLE_ONEDNN_OPTS=0`.",
    "I0000 00:00:1796391636.316860   30550 cpu_feature_guard.cc:227] This TensorFlow binary "
    "is optimized to use available CPU instructions in performance-critical operations.",
    "To enable the following instructions: AVX2 AVX512F AVX512_VNNI AVX512_BF16 AVX_VNNI FMA, "
    "in other operations, rebuild TensorFlow with the appropriate compiler flags.",
    "E0000 00:00:1796391636.316860   30550 cpu_utils.cc:12] AVX-512 is not used here.",
)


def test_the_startup_lines_are_recognised_and_others_are_not():
    assert all(tensorflow_startup.is_startup_line(line) for line in STARTUP)
    for line in ("E0000 00:00:1.5   1 op_kernel.cc:1] OP_REQUIRES failed: out of memory",
                 "Traceback (most recent call last):", "WARNING: something else", ""):
        assert not tensorflow_startup.is_startup_line(line), line


def test_only_the_startup_lines_are_dropped(capfd):
    def execute(module):
        os.write(2, ("\n".join(STARTUP[:2]) + "\nkept: a real error\n").encode())
        os.write(2, (STARTUP[2] + "\n" + STARTUP[3] + "\nno newline at the end").encode())
        module.append("ran")

    ran = []
    tensorflow_startup.without_startup_lines(execute, ran)
    assert ran == ["ran"]
    assert capfd.readouterr().err == "kept: a real error\nno newline at the end"


def test_information_wanted_leaves_stderr_alone(monkeypatch):
    monkeypatch.delitem(sys.modules, "tensorflow", raising=False)
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path
                                           if getattr(f, "key", "") != "tensorflow_startup"])
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "0")
    tensorflow_startup.quiet_imports()
    assert not any(getattr(f, "key", "") == "tensorflow_startup" for f in sys.meta_path)
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    tensorflow_startup.quiet_imports()
    assert any(getattr(f, "key", "") == "tensorflow_startup" for f in sys.meta_path)


@pytest.mark.heavy
@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None,
                    reason="TensorFlow is not installed")
def test_predict_and_a_tf_data_pipeline_print_no_tensorflow_startup_lines(tmp_path):
    env = {**os.environ}
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    control = subprocess.run([sys.executable, "-c", "import tensorflow"], env=env,
                             capture_output=True, text=True, check=True)
    if not any(tensorflow_startup.is_startup_line(line)
               for line in control.stderr.splitlines()):
        pytest.skip("this TensorFlow prints no start-up lines")
    code = (
        "import sys\nsys.path.insert(0, sys.argv[1])\n"
        "import numpy as np, tiny_configs, keras_vmoe\n"
        "from keras_vmoe import models\n"
        "from keras_vmoe.utils import keras_internals\n"
        "keras_internals.set_random_seed(0)\n"
        "model = models.ImageClassifier(models.VisionTransformerBackbone(\n"
        "    **tiny_configs.vmoe_8px_micro()), num_classes=3)\n"
        "model.predict(np.zeros((2, 8, 8, 3), 'uint8'), verbose=0)\n"
        "print('tensorflow' in sys.modules)\n"
        "images = np.zeros((4, 8, 8, 3), 'uint8')\n"
        "data = keras_vmoe.data.load_dataset((images, np.arange(4) % 2), 'train',\n"
        "    image_size=8, batch_size=2, pipeline='tf')\n"
        "print(len(list(data)), 'tensorflow' in sys.modules)\n"
        "print('a line of our own', file=sys.stderr)\n")
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", code, tests], env=env,
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["False", "2", "True"]
    assert result.stderr == "a line of our own\n", result.stderr
