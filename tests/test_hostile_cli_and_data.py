"""Settings nobody checked on the command line and in the data path: each
is refused with its name, the value and the valid
range, never with a traceback.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from keras_vmoe import cli
from keras_vmoe import data
from keras_vmoe.distribution.launch import launch


def _argument_error(argv, capsys):
    """Runs the CLI; returns argparse's error text (exit status 2)."""
    with pytest.raises(SystemExit) as info:
        cli.main([str(a) for a in argv])
    assert info.value.code == 2
    return capsys.readouterr().err


# ----------------------------------------------------------------------
# Item 10: launch.
# ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "flag, value, expected",
    [
        ("--port", 70000, "between 1 and 65535, got '70000'"),
        ("--port", 0, "between 1 and 65535, got '0'"),
        ("--num-processes", 1000, "between 1 and 64, got '1000'"),
        ("--devices-per-process", 10**6, "between 1 and 512"),
        ("--timeout", "nan", "finite number > 0"),
    ],
)
def test_launch_refuses_out_of_range_settings(capsys, flag, value, expected):
    err = _argument_error(["launch", flag, value, "--", "true"], capsys)
    assert flag in err and expected in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "kwargs, name",
    [({"port": 70000}, "port"), ({"num_processes": 1000}, "num_processes"),
     ({"timeout": float("inf")}, "timeout")],
)
def test_launch_function_refuses_out_of_range_settings(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}` must be"):
        launch(["true"], **kwargs)


# ----------------------------------------------------------------------
# Item 11: plan, backend, float_range.
# ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "flag, value, expected",
    [
        ("--batch", 10**12, "between 1 and 1048576"),
        ("--dtype", "float7", "invalid choice: 'float7'"),
        ("--optimizer", "os.system", "invalid choice: 'os.system'"),
    ],
)
def test_plan_refuses_bad_settings(capsys, flag, value, expected):
    argv = ["plan", "vmoe_s32", "--mesh", "data=1", "--batch", 2, flag, value]
    err = _argument_error(argv, capsys)
    assert expected in err and "Traceback" not in err


def test_missing_backend_is_one_error_line(tmp_path):
    pytest.importorskip("jax")
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("torch is installed")
    env = {**os.environ, "KERAS_BACKEND": "torch"}
    result = subprocess.run(
        [sys.executable, "-m", "keras_vmoe.cli", "plan", "vmoe_s32", "--mesh",
         "data=1", "--batch", "1"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "KERAS_BACKEND=torch" in result.stderr and "'torch'" in result.stderr


def test_empty_float_range_is_refused():
    images = np.zeros((2, 8, 8, 3), "float32")
    with pytest.raises(ValueError, match=r"`float_range`.*low < high.*\(1, 1\)"):
        data.load_dataset((images, np.array([0, 1])), image_size=8, batch_size=2,
                          float_range=(1, 1))


# ----------------------------------------------------------------------
# Items 3 and 11: labels without class names.
# ----------------------------------------------------------------------


@pytest.mark.parametrize("largest", [10**9, 2**40])
def test_one_huge_label_does_not_build_a_giant_name_list(largest):
    images = np.zeros((2, 8, 8, 3), "uint8")
    with pytest.raises(ValueError) as info:
        data.load_dataset((images, np.array([0, largest])), image_size=8,
                          batch_size=2)
    message = str(info.value)
    assert f"largest label is {largest}" in message and "class_names" in message


def test_string_labels_are_a_clear_error():
    images = np.zeros((2, 8, 8, 3), "uint8")
    with pytest.raises(ValueError, match="integer class ids.*dtype <U3.*'cat'"):
        data.load_dataset((images, np.array(["cat", "dog"])), image_size=8,
                          batch_size=2)


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
