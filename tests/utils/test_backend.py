"""keras_vmoe/utils/backend.py: the backend `import keras_vmoe` chooses.

Each case runs in a fresh interpreter with no `KERAS_BACKEND` and its own
`HOME` (so its own `~/.keras/keras.json`).
"""

import json
import os
import subprocess
import sys

REPORT = (
    "import json, os, warnings\n"
    "{before}\n"
    "with warnings.catch_warnings(record=True) as caught:\n"
    "    warnings.simplefilter('always')\n"
    "    {imports}\n"
    "import keras\n"
    "print(json.dumps({{'backend': keras.config.backend(),\n"
    "                  'env': os.environ['KERAS_BACKEND'],\n"
    "                  'warnings': [str(w.message) for w in caught\n"
    "                               if 'backend' in str(w.message)]}}))\n"
)


# As if PyTorch were not installed: its import (and `find_spec`) fails.
NO_TORCH = (
    "import sys\n"
    "class NoTorch:\n"
    "    def find_spec(self, name, *args):\n"
    "        if name.split('.')[0] == 'torch':\n"
    "            raise ModuleNotFoundError(\"No module named 'torch'\")\n"
    "sys.meta_path.insert(0, NoTorch())\n"
)


def _run(home, imports="import keras_vmoe", before="", configured=None):
    if configured is not None:
        (home / ".keras").mkdir(parents=True, exist_ok=True)
        (home / ".keras" / "keras.json").write_text(json.dumps(
            {"backend": configured, "floatx": "float32", "epsilon": 1e-07,
             "image_data_format": "channels_last"}))
    env = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "KERAS_HOME")}
    env["HOME"] = str(home)
    result = subprocess.run(
        [sys.executable, "-c", REPORT.format(before=before, imports=imports)],
        capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_without_a_keras_json_jax_is_chosen_and_kept_for_the_next_process(tmp_path):
    assert _run(tmp_path) == {"backend": "jax", "env": "jax", "warnings": []}
    written = json.loads((tmp_path / ".keras" / "keras.json").read_text())
    assert written["backend"] == "jax"
    # Keras imported first now reads the same file: the same backend.
    assert _run(tmp_path, imports="import keras; import keras_vmoe")["backend"] == "jax"


def test_the_backend_keras_json_names_is_followed(tmp_path):
    # Keras' NumPy backend: installed everywhere, and quick to import.
    out = _run(tmp_path, configured="numpy")
    assert out == {"backend": "numpy", "env": "numpy", "warnings": []}
    # Imported after Keras: the same backend, quietly.
    again = _run(tmp_path, imports="import keras; import keras_vmoe")
    assert again == out


def test_a_configured_backend_that_is_not_installed_falls_back_to_jax_and_says_so(tmp_path):
    out = _run(tmp_path, configured="torch",
               before=NO_TORCH)
    assert out["backend"] == out["env"] == "jax"
    [message] = out["warnings"]
    assert "names the 'torch' backend, which is not installed" in message
    assert "KERAS_BACKEND" in message and "keras.json" in message


def test_keras_failed_on_its_configured_backend_is_explained(tmp_path):
    # keras.json names a backend that is not installed: `import keras` fails;
    # keras_vmoe imported next says why, chooses JAX, and Keras then imports.
    before = (NO_TORCH + "try:\n    import keras\nexcept ImportError as error:\n"
              "    print('failed:', error)")
    out = _run(tmp_path, configured="torch", before=before)
    assert out["backend"] == "jax"
    [message] = out["warnings"]
    assert "an earlier `import keras` failed" in message


def test_the_environment_comes_first(tmp_path):
    out = _run(tmp_path, configured="tensorflow",
               before="import os; os.environ['KERAS_BACKEND'] = 'jax'")
    assert out == {"backend": "jax", "env": "jax", "warnings": []}
