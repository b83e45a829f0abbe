"""keras_vmoe.distribution.launch: `keras-vmoe launch` and `launch()` refuse
out-of-range settings with their name, the value and the valid range."""

import pytest
from testing import cli_argument_error as _argument_error

from keras_vmoe.distribution.launch import launch


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
