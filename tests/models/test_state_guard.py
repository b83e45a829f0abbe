"""keras_vmoe.models.state_guard: Keras' progress bar is plain lines when
stdout is not a terminal (a pipe, a log), and a bar on a terminal."""

import io

import numpy as np
import pytest
import tiny_configs

from keras_vmoe import models
from keras_vmoe.models import state_guard


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture
def no_notebook(monkeypatch):
    monkeypatch.delitem(__import__("sys").modules, "ipykernel", raising=False)
    monkeypatch.delenv("PYCHARM_HOSTED", raising=False)


def test_auto_verbosity_is_plain_off_a_terminal(monkeypatch, no_notebook):
    monkeypatch.setattr("sys.stdout", io.StringIO())
    assert state_guard.plain_progress("fit", ("x",), {}) == (("x",), {"verbose": 2})
    assert state_guard.plain_progress("fit", (), {"verbose": "auto"})[1] == {"verbose": 2}
    assert state_guard.plain_progress("fit", (), {"verbose": 1})[1] == {"verbose": 1}
    # Positional: predict(x, batch_size, verbose), evaluate(x, y, batch_size, verbose).
    assert state_guard.plain_progress("predict", ("x", 4, "auto"), {}) == (("x", 4, 2), {})
    assert state_guard.plain_progress("evaluate", ("x", "y", 4, 0), {}) == (
        ("x", "y", 4, 0), {})
    monkeypatch.setattr("sys.stdout", _Terminal())
    assert state_guard.plain_progress("fit", ("x",), {}) == (("x",), {})


def test_evaluate_and_predict_print_plain_lines_into_a_pipe(capsys, no_notebook):
    model = models.ImageClassifier(
        models.VisionTransformerBackbone(**tiny_configs.vmoe_8px_micro()), num_classes=3)
    images = np.zeros((4, 8, 8, 3), "float32")
    capsys.readouterr()
    model.evaluate(images, np.array([0, 1, 2, 0]))
    model.predict(images)
    out = capsys.readouterr().out
    assert not set(out) & {"\x1b", "\r", "\b"}, repr(out)
    lines = out.splitlines()
    assert len(lines) == 2 and all(line.startswith("1/1 - ") for line in lines), lines
    assert "loss: " in lines[0]
