"""`keras-vmoe finetune` and `keras-vmoe predict` (tiny settings)."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from keras_vmoe import cli
from keras_vmoe.cli import finetune
from keras_vmoe.cli import predict

TINY = {
    "image_size": 8, "patch_size": 4, "hidden_dim": 16, "num_layers": 2,
    "num_heads": 2, "mlp_dim": 32, "classifier": "token", "moe_layers": (1,),
    "moe": {"num_experts": 4, "identical_init": False,
            "router": {"name": "token_choice", "num_selected_experts": 2,
                       "capacity_factor": 1.05}},
}


def test_finetune_is_the_default_command():
    assert cli.DEFAULT_COMMAND == "finetune"


@pytest.mark.heavy  # ~20-30 s on 2 cores (a CLI fine-tune); .ci/run runs the group
def test_finetune_then_predict_tiny(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(finetune, "SMALL_VMOE", TINY)
    out = tmp_path / "run"
    argv = ["finetune", "--epochs", "1", "--batch-size", "32",
            "--train-split", "train[:64]", "--test-split", "test[:32]",
            "--output", str(out), "--json"]
    assert cli.main(argv) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert 0.0 <= metrics["test_accuracy"] <= 1.0 and metrics["num_classes"] == 10
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["test_accuracy"] == metrics["test_accuracy"]
    assert (out / "routing_heatmap.png").read_bytes()[:4] == b"\x89PNG"
    meta = json.loads((out / "preset" / "metadata.json").read_text())
    assert meta["class_names"] == [str(i) for i in range(10)]

    from skimage import io

    from keras_vmoe import data

    images, labels = data.load_digits_arrays("test[:3]")
    folder = tmp_path / "pngs"
    folder.mkdir()
    for i, image in enumerate(images):
        io.imsave(str(folder / f"digit{i}.png"), np.kron(image, np.ones((4, 4, 1),
                                                                         "uint8")),
                  check_contrast=False)
    argv = ["predict", str(folder), "--preset", str(out / "preset"), "--top-k", "3",
            "--json"]
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["predictions"]) == 3
    top = result["predictions"][0]["top_k"]
    assert len(top) == 3 and {c["class_name"] for c in top} <= set("0123456789")


def test_predict_knows_imagenet_names():
    names = predict.imagenet_class_names()
    assert len(names) == 1000 and names[0].startswith("tench")
    assert predict.preset_class_names("vmoe_b16_ilsvrc2012", 1000) == names


@pytest.mark.parametrize("argv, message", [
    (["finetune", "--data", "no_such_folder"], "unknown dataset"),
    (["finetune", "--epochs", "0"], "expected an integer >= 1"),
    (["finetune", "--learning-rate", "nan"], "finite number"),
    (["finetune", "--randaugment", "2"], "NUM_OPS,MAGNITUDE"),
    (["finetune", "--randaugment", "101,10"], "NUM_OPS <= 100"),
    (["predict", "--top-k", "x", "a.png"], "expected an integer"),
])
def test_argument_errors_are_fast(argv, message):
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "keras_vmoe.cli", *argv],
                          capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.returncode == 2 and message in proc.stderr
    assert time.time() - start < 10  # < 1 s on an idle machine; the CI box is shared


def test_predict_errors(tmp_path, capsys):
    assert cli.main(["predict", str(tmp_path / "missing.png")]) == 1
    assert "No such image file or folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli.main(["predict", str(tmp_path / "empty")]) == 1
    assert "No image files" in capsys.readouterr().err


@pytest.mark.slow
def test_default_finetune_reaches_95_percent(tmp_path, capsys):
    assert cli.main(["finetune", "--output", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["test_accuracy"] >= 0.95


@pytest.mark.faults
def test_ctrl_c_through_the_command_line_then_resume(tmp_path):
    """A real Ctrl-C (SIGINT to the process) after the first epoch line."""
    import signal

    out = tmp_path / "run"
    argv = [sys.executable, "-m", "keras_vmoe.cli", "finetune", "--epochs", "3",
            "--train-split", "train[:128]", "--test-split", "test[:64]",
            "--batch-size", "32", "--output", str(out)]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env=env)
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if line.startswith("[keras-vmoe] epoch 1/3"):
            proc.send_signal(signal.SIGINT)
    proc.wait(timeout=600)
    err = "".join(lines)
    assert proc.returncode == 130, err[-3000:]
    assert "to resume, run the same command again: keras-vmoe finetune --epochs 3" in err
    assert "Traceback" not in err
    again = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from epoch" in again.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    assert len(metrics["history"]["loss"]) == 3 and metrics["resumed_from"]
