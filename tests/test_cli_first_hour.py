"""The command line as a new user meets it: tables that
fit the terminal, suggestions for unknown presets, architecture-only presets
refused before anything loads, and offline `gs://` errors as one line."""

import pytest

from keras_vmoe import cli
from keras_vmoe.presets import table


@pytest.mark.parametrize("width", [250, 160, 120, 100, 80, 60])
def test_presets_table_fits_the_width_and_keeps_whole_names(width):
    rows = table.list_presets(details=True)
    lines = table.format_table(rows, width=width).splitlines()
    assert max(len(line) for line in lines) <= width
    words = {word for line in lines for word in line.split()}
    assert {row["name"] for row in rows} <= words  # names are never cut


def test_presets_table_follows_columns_even_when_piped(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    assert cli.main(["presets", "--family", "vmoe"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines and max(len(line) for line in lines) <= 80
    monkeypatch.delenv("COLUMNS")
    assert table.terminal_width(None) is None  # a pipe: no limit


def test_presets_name_says_what_predict_returns(capsys):
    assert cli.main(["presets", "vmoe_b16_every2"]) == 0
    text = capsys.readouterr().out
    assert "18,291 (JFT-300M classes)" in text and "logits" in text
    assert "architecture only" in text
    assert cli.main(["presets", "eee_s32_last2_ilsvrc2012_ft_cifar100"]) == 0
    assert "predict_members" in capsys.readouterr().out


def test_predict_suggests_preset_names(tmp_path, capsys):
    image = tmp_path / "a.png"
    image.write_bytes(b"")
    assert cli.main(["predict", str(image), "--preset", "vmoe_b99"]) == 1
    err = capsys.readouterr().err
    assert "Unknown preset 'vmoe_b99'" in err and "Did you mean: " in err
    assert "vmoe_b16" in err.split("Did you mean: ")[1]


def test_predict_refuses_architecture_only_presets_before_loading(
        tmp_path, capsys, monkeypatch):
    from keras_vmoe import presets

    def no_load(*args, **kwargs):
        raise AssertionError("the model must not be loaded")

    monkeypatch.setattr(presets, "from_preset", no_load)
    image = tmp_path / "a.png"
    image.write_bytes(b"")
    assert cli.main(["predict", str(image), "--preset", "soft_moe_s16"]) == 1
    err = capsys.readouterr().err
    assert "architecture only" in err and "29,593" in err and "--with-weights" in err


def test_convert_offline_gs_error_is_one_line(monkeypatch, capsys):
    from keras_vmoe.cli import convert_cmd

    # The class TensorFlow raises (tf.errors.FailedPreconditionError), faked
    # without TensorFlow: the check goes by module and base-class name.
    OpError = type("OpError", (Exception,),
                   {"__module__": "tensorflow.python.framework.errors_impl"})
    Failed = type("FailedPreconditionError", (OpError,), {
        "__module__": "tensorflow.python.framework.errors_impl"})

    def offline(argv, prog=None):
        raise Failed("Error executing an HTTP request: libcurl code 6 meaning "
                     "'Couldn't resolve host name'\n\twhen reading gs://vmoe/x")

    monkeypatch.setattr(convert_cmd, "run", offline)
    argv = ["convert", "--upstream", "gs://vmoe_checkpoints/x", "--output", "out"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: cannot read gs://vmoe_checkpoints/x (FailedPrecondition")
    assert "network access" in err and "Traceback" not in err and err.count("\n") == 1
    monkeypatch.setattr(convert_cmd, "run", lambda argv, prog=None: 1 / 0)
    with pytest.raises(ZeroDivisionError):  # other errors are bugs: not hidden
        cli.main(argv)


@pytest.mark.parametrize("command, advice", [
    ("evaluate", "Pass --no-weights to build the architecture with random weights"),
    ("demo", "Pass --no-weights to build the architecture with random weights"),
    ("predict", "`keras-vmoe predict` needs the weights."),
])
def test_missing_weights_advice_fits_the_command(command, advice, monkeypatch, tmp_path,
                                                 capsys):
    name = "vmoe_s32_last2_ilsvrc2012_randaug_light1"
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras_home"))
    monkeypatch.delenv("KERAS_VMOE_CHECKPOINT_ROOT", raising=False)
    # The download fails at once (a closed port on 127.0.0.1 in tests).
    image = tmp_path / "a.png"
    from PIL import Image

    Image.new("RGB", (8, 8)).save(image)
    argv = {"evaluate": ["evaluate", "--preset", name, "--data", "digits"],
            "demo": ["demo", "--preset", name],
            "predict": ["predict", str(image), "--preset", name]}[command]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "The pretrained weights of preset" in err
    assert advice in err and "load_weights=False" not in err
