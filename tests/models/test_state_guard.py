"""keras_vmoe.models.state_guard: a model stays usable after `predict` or
`evaluate` raise part-way through; Keras' progress bar is plain lines when
stdout is not a terminal (a pipe, a log), and a bar on a terminal."""

import io

import numpy as np
import pytest
import tiny_configs

from keras_vmoe import models
from keras_vmoe.models import ImageClassifier
from keras_vmoe.models import VisionTransformerBackbone
from keras_vmoe.models import state_guard


@pytest.mark.parametrize("method", ["predict", "evaluate"])
def test_a_failing_predict_or_evaluate_keeps_the_model_usable(images, method):
    # Keras' JAX trainer detaches the variables during predict/evaluate and
    # only reattaches them on success: a batch that fails part-way through
    # the loop (here the input's second batch) would leave the model broken
    # ("'NoneType' object is not callable") for every later call.
    model = ImageClassifier(VisionTransformerBackbone(**tiny_configs.vmoe()), num_classes=3)
    before = model.predict(images[:2], verbose=0)

    def batches():
        yield (images[:2],) if method == "predict" else (images[:2], np.zeros(2))
        raise ValueError("a broken second batch")

    with pytest.raises(ValueError, match="broken second batch"):
        getattr(model, method)(batches(), verbose=0)
    np.testing.assert_array_equal(model.predict(images[:2], verbose=0), before)
    with pytest.raises(ValueError, match="image_size"):
        model.backbone.predict(np.zeros((1, 16, 16, 3)), verbose=0)
    assert model.backbone.predict(images[:2], verbose=0).shape == (2, 32)


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
