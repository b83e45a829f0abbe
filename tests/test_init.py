"""keras_vmoe/__init__.py: importing the package after a failed `import keras`."""

import json
import os
import subprocess
import sys

import pytest


def test_keras_failed_on_its_configured_backend_is_explained(tmp_path):
    # keras.json names a backend that is not installed: `import keras` fails;
    # keras_vmoe imported next says why, chooses JAX, and Keras then imports.
    import importlib.util

    absent = [name for name in ("torch", "tensorflow")
              if importlib.util.find_spec(name) is None]
    if not absent:
        pytest.skip("torch and tensorflow are both installed")
    missing = absent[0]
    (tmp_path / ".keras").mkdir()
    (tmp_path / ".keras" / "keras.json").write_text(json.dumps(
        {"backend": missing, "floatx": "float32", "epsilon": 1e-07,
         "image_data_format": "channels_last"}))
    code = (
        "import warnings\n"
        "try:\n    import keras\nexcept ImportError as error:\n    print('failed:', error)\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import keras_vmoe\n"
        "print('warned:', ' '.join(str(w.message) for w in caught))\n"
        "import keras\nprint('backend:', keras.config.backend())\n")
    env = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "KERAS_HOME")}
    env["HOME"] = str(tmp_path)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    assert f"No module named '{missing}'" in result.stdout
    assert f"names the '{missing}' backend, which is not installed" in result.stdout
    assert "backend: jax" in result.stdout
