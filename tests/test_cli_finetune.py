"""`keras-vmoe finetune` and `keras-vmoe predict` (tiny settings)."""

import argparse
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import tiny_configs

from keras_vmoe import cli
from keras_vmoe.cli import finetune
from keras_vmoe.cli import predict

TINY = tiny_configs.vmoe_8px(router={"capacity_factor": 1.05})


def test_finetune_is_the_default_command():
    assert cli.DEFAULT_COMMAND == "finetune"


def test_the_default_job_follows_the_digits_recipe():
    from keras_vmoe import training

    recipe = training.get_recipe("digits")
    defaults = finetune.DIGITS_DEFAULTS
    steps = 1437 // defaults["batch_size"]  # the digits' training split, full batches
    assert recipe.train_steps == defaults["epochs"] * steps
    assert (recipe.learning_rate, recipe.batch_size, recipe.mixup) == (
        defaults["learning_rate"], defaults["batch_size"], defaults["mixup"])
    assert recipe.end_learning_rate == 0.0 and recipe.label_smoothing == 0.1
    parser = argparse.ArgumentParser()
    finetune.add_arguments(parser)

    def resolved(*argv):
        args = parser.parse_args(list(argv))
        return finetune._epochs(args), finetune._mixup(args)

    assert resolved() == (defaults["epochs"], 0.2)
    assert resolved("--mixup", "0") == resolved("--mixup", "0e0") == (defaults["epochs"], None)
    assert resolved("--mixup", "0.4", "--epochs", "3") == (3, 0.4)
    assert resolved("--preset", "vmoe_s32") == (finetune.DEFAULT_EPOCHS, None)


@pytest.mark.heavy  # a CLI fine-tune of a few steps
def test_finetune_with_mixup_and_the_recipes_label_smoothing(tmp_path, monkeypatch, capsys):
    # MixUp's one-hot labels meet the digits recipe's label smoothing, and
    # the final evaluation reads the test split with one-hot labels too.
    monkeypatch.setattr(finetune, "SMALL_VMOE", TINY)
    argv = ["finetune", "--epochs", "1", "--batch-size", "32", "--mixup", "0.2",
            "--train-split", "train[:64]", "--test-split", "test[:32]",
            "--output", str(tmp_path / "run"), "--json"]
    assert cli.main(argv) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert 0.0 <= metrics["test_accuracy"] <= 1.0 and metrics["test_examples"] == 32
    assert len(metrics["history"]["val_accuracy"]) == 1


@pytest.mark.heavy  # ~20-30 s on 2 cores (a CLI fine-tune); .ci/run runs the group
def test_finetune_then_predict_tiny(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(finetune, "SMALL_VMOE", TINY)
    out = tmp_path / "run"
    argv = ["finetune", "--epochs", "1", "--batch-size", "32",
            "--train-split", "train[:64]", "--test-split", "test[:32]",
            "--output", str(out), "--json"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    metrics = json.loads(captured.out)
    assert 0.0 <= metrics["test_accuracy"] <= 1.0 and metrics["num_classes"] == 10
    # Plain lines into a pipe or log: no progress bar's escapes or backspaces.
    assert not set(captured.out + captured.err) & {"\x1b", "\r", "\b"}
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
    from keras_vmoe.data import imagenet_class_names

    names = imagenet_class_names()
    assert len(names) == 1000 and names[0].startswith("tench")
    names.append("mine")  # a new list each time: callers may change theirs
    assert len(imagenet_class_names()) == 1000
    names.pop()
    assert predict.preset_class_names("vmoe_b16_ilsvrc2012", 1000) == names


ARGUMENT_ERRORS = [
    (["finetune", "--data", "no_such_folder"], "unknown dataset"),
    (["finetune", "--epochs", "0"], "expected an integer >= 1"),
    (["finetune", "--learning-rate", "nan"], "finite number"),
    (["finetune", "--randaugment", "2"], "NUM_OPS,MAGNITUDE"),
    (["finetune", "--randaugment", "101,10"], "NUM_OPS <= 100"),
    (["finetune", "--randaugment", "1000000,10"], "0 <= NUM_OPS <= 100"),
    (["predict", "--top-k", "x", "a.png"], "expected an integer"),
]


@pytest.fixture(scope="module")
def argument_error_runs():
    """One child process parses every argv of ARGUMENT_ERRORS in turn; for
    each it records the exit code, the error text and whether TensorFlow or
    torch had been imported by then (one Python start for all the cases)."""
    code = ("import contextlib, io, json, sys\n"
            "from keras_vmoe import cli\n"
            "runs = []\n"
            "for argv in json.loads(sys.argv[1]):\n"
            "    err = io.StringIO()\n"
            "    try:\n"
            "        with contextlib.redirect_stderr(err):\n"
            "            cli.main(argv)\n"
            "        runs.append([None, err.getvalue(), None, None])\n"
            "    except SystemExit as exit:\n"
            "        runs.append([exit.code, err.getvalue(), 'tensorflow' in sys.modules,\n"
            "                     'torch' in sys.modules])\n"
            "print(json.dumps(runs))\n")
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps([argv for argv, _ in ARGUMENT_ERRORS])],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("case", range(len(ARGUMENT_ERRORS)),
                         ids=[" ".join(argv) for argv, _ in ARGUMENT_ERRORS])
def test_argument_errors_come_before_tensorflow_is_imported(case, argument_error_runs):
    # Fast means the parser refuses the argument before the slow imports
    # (TensorFlow, several seconds); a wall-clock bound would flake on a
    # loaded machine.
    code, err, tensorflow, torch = argument_error_runs[case]
    assert ARGUMENT_ERRORS[case][1] in err
    assert [code, tensorflow, torch] == [2, False, False], err


def test_missing_released_weights_fail_before_keras_tensorflow_and_the_data(tmp_path):
    # Offline (a closed port for the server), the released preset not cached:
    # the command answers from the catalog and one refused connection, before
    # it loads the data or imports Keras (so builds no model) or TensorFlow.
    code = ("import contextlib, io, json, sys\n"
            "from keras_vmoe import cli, data\n"
            "data.load_dataset = lambda *a, **k: sys.exit('the data was loaded')\n"
            "err = io.StringIO()\n"
            "with contextlib.redirect_stderr(err):\n"
            "    code = cli.main(sys.argv[1:])\n"
            "print(json.dumps([code, err.getvalue(), sorted(\n"
            "    m for m in ('keras', 'jax', 'tensorflow') if m in sys.modules)]))\n")
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "KERAS_HOME": str(tmp_path / "home"),
           "KERAS_VMOE_CHECKPOINT_ROOT": "http://127.0.0.1:9"}
    proc = subprocess.run(
        [sys.executable, "-c", code, "finetune", "--preset",
         "vmoe_s32_last2_ilsvrc2012_randaug_light1", "--output", str(tmp_path / "out")],
        capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    code, err, imported = json.loads(proc.stdout.splitlines()[-1])
    assert code == 1 and imported == [], (imported, err)
    assert err.startswith("error: The pretrained weights of preset "
                          "'vmoe_s32_last2_ilsvrc2012_randaug_light1' are not available")
    assert "no connection to the server" in err and "Traceback" not in err
    assert "`keras-vmoe finetune --no-weights ...`" in err
    assert not (tmp_path / "out").exists()


def test_predict_errors(tmp_path, capsys):
    assert cli.main(["predict", str(tmp_path / "missing.png")]) == 1
    assert "No such image file or folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli.main(["predict", str(tmp_path / "empty")]) == 1
    assert "No image files" in capsys.readouterr().err


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


def test_a_one_class_folder_is_refused_before_any_model_is_built(tmp_path, capsys,
                                                                 monkeypatch):
    from PIL import Image


    (tmp_path / "photos" / "cat").mkdir(parents=True)
    for i in range(10):
        Image.new("RGB", (8, 8), (i * 20, 0, 0)).save(tmp_path / "photos" / "cat" / f"{i}.png")
    monkeypatch.setattr(finetune, "_build_model",
                        lambda *a: pytest.fail("the model was built"))
    argv = ["finetune", "--data", str(tmp_path / "photos"), "--epochs", "1", "--pipeline", "numpy",
            "--output", str(tmp_path / "out")]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "has 1 class ('cat')" in err and "at least two" in err


def test_a_run_that_diverged_or_learned_nothing_says_so_with_a_hint():
    diverged = finetune.training_advice([1.16, 2.4, 3.57], 0.25, 4, pretrained=False)
    assert len(diverged) == 2
    assert "rose from 1.16 to 3.57: the run diverged" in diverged[0]
    assert "lower --learning-rate" in diverged[0] and "--preset" in diverged[0]
    assert "near chance (1/4 = 0.250)" in diverged[1]
    # From a preset, the hint does not suggest one.
    nan = finetune.training_advice([1.0, float("nan")], 0.9, 4, pretrained=True)
    assert len(nan) == 1 and "nan or inf" in nan[0] and "--preset" not in nan[0]
    assert finetune.training_advice([2.3, 0.4], 0.96, 10, pretrained=False) == []


def test_the_advice_follows_the_loss_and_says_chance_only_near_it():
    # A loss falling steadily: more epochs or images, not the learning rate.
    falling = finetune.training_advice([1.10, 1.05, 0.97, 0.9], 1 / 3, 3, pretrained=True)
    assert len(falling) == 1 and "--epochs" in falling[0] and "more images" in falling[0]
    assert "fell from 1.1 to 0.9" in falling[0] and "learning-rate" not in falling[0]
    # Flat: the learning rate.
    flat = finetune.training_advice([1.10, 1.11, 1.09, 1.08], 0.3, 3, pretrained=True)
    assert len(flat) == 1 and "stayed flat" in flat[0] and "--learning-rate" in flat[0]
    # Flat after a handful of steps (24 images, one batch an epoch): more steps.
    few = finetune.training_advice([1.108, 1.1, 1.09, 1.086, 1.086], 1 / 3, 3,
                                   pretrained=True, steps=5)
    assert "only 5 optimizer steps" in few[0] and "--batch-size" in few[0]
    assert "learning-rate" not in few[0]
    # 0.500 on 3 classes is not chance; 0.39 (under 1.2 times chance) is.
    assert finetune.training_advice([1.1, 0.8], 0.5, 3, pretrained=True) == []
    assert "near chance" in finetune.training_advice([1.1, 0.8], 0.39, 3, pretrained=True)[0]


def test_output_that_is_empty_or_inside_the_data_is_refused(tmp_path, capsys):
    assert cli.main(["finetune", "--output", ""]) == 1
    assert "--output is empty" in capsys.readouterr().err
    data = tmp_path / "photos"
    (data / "cats").mkdir(parents=True)
    assert cli.main(["finetune", "--data", str(data), "--output",
                     str(data / "results")]) == 1
    err = capsys.readouterr().err
    assert "is inside --data" in err and not (data / "results").exists()


def _recorded_run(out, **data):
    """A checkpoint index recording a run's settings (no checkpoint needed)."""
    folder = out / "checkpoints"
    folder.mkdir(parents=True)
    settings = {"epochs": 30, "data": {"source": "digits", "split": "train", "seed": 0,
                                       "flip": False, "randaugment": None,
                                       "mixup": None, **data}}
    (folder / "checkpoint.json").write_text(json.dumps(
        {"checkpoints": [], "settings": settings}))


def test_resuming_with_other_data_settings_is_refused_before_loading(tmp_path, capsys,
                                                                    monkeypatch):
    import keras_vmoe.data

    def no_loading(*args, **kwargs):
        raise AssertionError("data loaded before the checkpoint check")

    monkeypatch.setattr(keras_vmoe.data, "load_dataset", no_loading)
    _recorded_run(tmp_path)
    assert cli.main(["finetune", "--output", str(tmp_path), "--seed", "1",
                     "--randaugment", "2,10"]) == 1
    err = capsys.readouterr().err
    assert "data.seed: 0 -> 1" in err and "data.randaugment: None -> [2, 10.0]" in err
    assert "--overwrite" in err


def _with_timeout(seconds):
    import signal

    def expire(signum, frame):
        raise TimeoutError(f"blocked for more than {seconds} s")

    signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)


def test_a_fifo_as_metrics_json_is_refused_naming_it(tmp_path, capsys):
    import signal

    os.mkfifo(tmp_path / "metrics.json")
    _with_timeout(10)
    try:
        assert cli.main(["finetune", "--output", str(tmp_path)]) == 1
    finally:
        signal.alarm(0)
    err = capsys.readouterr().err
    assert "metrics.json is not a regular file" in err


@pytest.mark.parametrize("payload", [
    {"completed": True, "test_accuracy": "high"},
    "[" * 100_000 + "]" * 100_000,
])
def test_a_damaged_finished_run_is_done_again(tmp_path, payload):
    args = cli.build_parser().parse_args(["finetune", "--output", str(tmp_path)])
    (tmp_path / "metrics.json").write_text(
        payload if isinstance(payload, str) else json.dumps(
            {**payload, "arguments": finetune._arguments_record(args)}))
    (tmp_path / "preset").mkdir()
    (tmp_path / "preset" / "config.json").write_text("{}")
    assert finetune._finished(str(tmp_path), args) is None


def test_learning_rate_flag_overrides_the_recipe(tmp_path, monkeypatch, capsys):
    from keras_vmoe import training

    used = {}

    def capture(model, train, test, **kwargs):
        used.update(kwargs)
        raise ValueError("stop here")

    monkeypatch.setattr(training, "finetune", capture)
    monkeypatch.setattr(finetune, "SMALL_VMOE", TINY)
    assert cli.main(["finetune", "--recipe", "digits", "--learning-rate", "7.5",
                     "--epochs", "1", "--train-split", "train[:64]",
                     "--test-split", "test[:32]", "--output", str(tmp_path)]) == 1
    assert used["recipe"].learning_rate == 7.5 and used["learning_rate"] == 7.5
    assert "learning_rate=7.5" in capsys.readouterr().err


def test_class_names_with_terminal_escapes_are_printed_escaped():
    assert predict.printable("cat\x1b[2J\nrm -rf") == "cat\\x1b[2J\\nrm -rf"
    assert predict.printable("café") == "café"


@pytest.mark.parametrize("argv", [["quantize", "--seed", "-1", "vmoe_s32"],
                                  ["finetune", "--seed", "-1"]])
def test_a_negative_seed_names_the_flag(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--seed" in err and "between 0 and 4294967295" in err


@pytest.mark.heavy
def test_predict_says_it_compiles_once(tmp_path, capsys):
    import keras
    from skimage import io
    from tiny_configs import composition_model

    from keras_vmoe.presets import save_to_preset

    preset = save_to_preset(composition_model("sparse"), str(tmp_path / "preset"))
    folder = tmp_path / "images"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(3):
        io.imsave(str(folder / f"image{i}.png"),
                  rng.integers(0, 256, (20 + i, 24, 3)).astype("uint8"),
                  check_contrast=False)
    argv = ["predict", str(folder), "--preset", str(preset), "--batch-size", "2",
            "--json"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert len(json.loads(captured.out)["predictions"]) == 3
    compiling = captured.err.count("compiling the model (first call)")
    assert compiling == (1 if keras.backend.backend() in ("jax", "tensorflow") else 0)


@pytest.mark.heavy
def test_remat_and_scan_flags_reach_finetune(tmp_path, monkeypatch):
    from keras_vmoe import training

    used = []

    def capture(model, train, test, **kwargs):
        used.append((kwargs["remat"], kwargs["scan"]))
        raise ValueError("stop here")

    monkeypatch.setattr(training, "finetune", capture)
    common = ["finetune", "--epochs", "1", "--train-split", "train[:64]",
              "--test-split", "test[:32]", "--overwrite"]
    assert cli.main([*common, "--remat", "--output", str(tmp_path / "a")]) == 1
    assert cli.main([*common, "--output", str(tmp_path / "b")]) == 1
    assert cli.main([*common, "--scan", "--output", str(tmp_path / "c")]) == 1
    # Without a flag, the model's own setting.
    assert used == [(True, None), (None, None), (None, True)]


def _readme_folder_recipe():
    """The flags of the README's `keras-vmoe finetune --data path/to/photos`
    command, less `--data`, `--preset`, `--image-size` and `--output`."""
    import shlex

    lines = (pathlib.Path(__file__).parents[1] / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines)
                 if line.startswith("keras-vmoe finetune --data path/to/photos"))
    command = lines[start]
    while command.endswith("\\"):
        start += 1
        command = command[:-1] + lines[start]
    words = shlex.split(command)[2:]
    recipe = []
    for flag, value in zip(words, words[1:] + [None], strict=True):
        if flag.startswith("--") and flag not in ("--data", "--preset", "--image-size",
                                                  "--output"):
            recipe += [flag] if value is None or value.startswith("--") else [flag, value]
    return recipe


def _digit_photos(path, digits=(0, 1, 7), per_class=10):
    """A folder of `per_class` 64x64 RGB photos of each of `digits` (the
    digits' test split: images the pretrained stand-in never saw)."""
    from PIL import Image

    from keras_vmoe.data import load_digits_arrays

    images, labels = load_digits_arrays("test")
    for digit in digits:
        (path / f"digit_{digit}").mkdir(parents=True)
        for i, image in enumerate(images[labels == digit][:per_class]):
            Image.fromarray(image).resize((64, 64), Image.BILINEAR).save(
                path / f"digit_{digit}" / f"{i}.png")


@pytest.mark.heavy  # two CLI fine-tunes (a short pretraining, then the recipe)
def test_the_readmes_folder_recipe_learns_three_classes_from_thirty_images(tmp_path,
                                                                           capsys):
    # The README's recipe (the head only, batches of 8) from a preset whose
    # features suit the images, as ImageNet's suit photos: a stand-in
    # pretrained for 10 epochs on the digits, then a folder of 30 photos of
    # three digits it never saw (6 held out for the test).
    recipe = _readme_folder_recipe()
    assert "--freeze-backbone" in recipe and recipe[recipe.index("--batch-size") + 1] == "8"
    assert cli.main(["finetune", "--epochs", "10", "--output", str(tmp_path / "pretrained"),
                     "--json"]) == 0
    capsys.readouterr()
    _digit_photos(tmp_path / "photos")
    argv = ["finetune", "--data", str(tmp_path / "photos"), "--preset",
            str(tmp_path / "pretrained" / "preset"), *recipe,
            "--output", str(tmp_path / "run"), "--json"]
    assert cli.main(argv) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert (metrics["train_examples"], metrics["test_examples"]) == (24, 6)
    assert round(metrics["test_accuracy"] * 6) >= 5, metrics["history"]  # 5 of 6
    assert metrics["warnings"] == []

