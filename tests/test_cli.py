"""The `keras-vmoe` command line (default job: offline routing demo)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tiny_configs

from keras_vmoe import cli
from keras_vmoe.cli import demo


def test_skimage_photos_are_real_and_in_range():
    images = demo.load_skimage_photos(["chelsea", "rocket"], 32)
    assert images.shape == (2, 32, 32, 3)
    assert -1.0 <= images.min() < 0 < images.max() <= 1.0
    assert not np.allclose(images[0], images[1])
    with pytest.raises(ValueError, match="Unknown scikit-image photo"):
        demo.load_skimage_photos(["not_a_photo"], 32)


@pytest.mark.slow  # keeps the default suite under 10 min; run with -m slow
def test_demo_prints_routing_report(capsys):
    assert cli.main(["demo", "--images", "chelsea,coffee", "--capacity-factors", "1.05,0.2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["images"] == ["chelsea", "coffee"]
    assert len(report["runs"]) == 4
    low_vanilla, low_bpr = report["runs"][2:]
    layer = "encoderblock_1"
    assert low_vanilla["layers"][layer]["capacity"] == low_bpr["layers"][layer]["capacity"]
    # Low capacity drops tokens.
    assert low_vanilla["layers"][layer]["tokens_dropped_fraction"] > 0.3


def _tiny_backbone(family, **overrides):
    """`tiny_configs.<family>` at 16 px (4 patches + class token), built."""
    from keras_vmoe import models

    config = getattr(tiny_configs, family)(px=16, representation_size=None, **overrides)
    return models.VisionTransformerBackbone(**config)


@pytest.mark.heavy  # ~20-30 s on 2 cores (two demo runs); .ci/run runs the group
def test_demo_on_soft_moe_and_e3_presets(monkeypatch, capsys):
    # Soft MoE has no routing settings: one run, no set_routing crash. E³
    # routes both ensemble copies of the batch as one group.
    monkeypatch.setattr(demo, "_demo_model", lambda args: _tiny_backbone(
        "soft_moe", num_experts=2))
    argv = ["demo", "--preset", "soft_moe_s16", "--no-weights", "--images", "chelsea"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert len(report["runs"]) == 1 and "capacity_factor" not in report["runs"][0]
    # It says that the weights are random, and shows progress on stderr.
    assert report["weights"] == "random" and "random weights" in captured.err
    assert "[keras-vmoe] routing 1 photos" in captured.err
    backbone = _tiny_backbone("e3")
    monkeypatch.setattr(demo, "_demo_model", lambda args: backbone)
    assert cli.main([*argv, "--capacity-factors", "1.0"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert "[2/2] routing 1 photos at capacity factor 1, BPR on" in captured.err
    assert [run["batch_priority"] for run in report["runs"]] == [False, True]
    assert backbone.get_moe_layers()[0].group_size == 5 * 2


def test_demo_errors_are_messages_not_tracebacks(monkeypatch, capsys):
    monkeypatch.setattr(demo, "_demo_model", lambda args: _tiny_backbone("vit_s16"))
    assert cli.main(["demo", "--preset", "vit_s16", "--no-weights"]) == 2
    assert "dense ViT" in capsys.readouterr().err
    monkeypatch.undo()
    assert cli.main(["demo", "--preset", "not_a_preset"]) == 1
    assert "Unknown preset 'not_a_preset'" in capsys.readouterr().err


def test_presets_command_filters_by_family(capsys):
    assert cli.main(["presets", "--family", "eee", "--names"]) == 0
    names = capsys.readouterr().out.split()
    assert names and all(name.startswith("eee_") for name in names)


def test_help_and_version_do_not_import_keras():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from keras_vmoe import cli\n"
        "try:\n"
        "    cli.main(sys.argv[1:])\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = [m for m in ('keras', 'jax', 'tensorflow') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    for argv in (["--help"], ["--version"], ["demo", "--help"], ["presets", "--help"],
                 ["convert", "--help"]):
        result = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True,
                                text=True, timeout=60, check=True)
        assert "HEAVY []" in result.stdout, (argv, result.stdout, result.stderr)


def test_bad_arguments_fail_before_any_model_is_built(capsys):
    with pytest.raises(SystemExit) as error:
        cli.main(["demo", "--capacity-factors", "nan"])
    assert error.value.code == 2
    assert "capacity factors must be finite" in capsys.readouterr().err


@pytest.mark.parametrize("argv, typed, meant", [
    (["predict", "a.png", "--topk", "3"], "--topk", "--top-k"),
    (["finetune", "--epoch", "3"], "--epoch", "--epochs"),
    (["finetune", "--learning_rate", "0.1"], "--learning_rate", "--learning-rate"),
])
def test_options_are_not_abbreviated_and_close_names_are_suggested(argv, typed, meant,
                                                                   capsys):
    with pytest.raises(SystemExit) as exit:
        cli.build_parser().parse_args(argv)
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert f"unrecognized arguments: {typed}" in err
    assert f"{typed}: did you mean {meant}?" in err


def test_options_without_a_command_are_the_default_commands(monkeypatch):
    from keras_vmoe.cli import finetune

    seen = {}
    monkeypatch.setattr(finetune, "run", lambda args: seen.update(vars(args)) or 0)
    assert cli.main(["--json", "--epochs", "2"]) == 0
    assert seen["command"] == "finetune" and seen["json"] and seen["epochs"] == 2


@pytest.mark.parametrize("argv, option, owner", [
    (["predict", "x.png", "--epochs", "3"], "--epochs", "finetune"),
    (["evaluate", "--preset", "p", "--top-k", "3"], "--top-k", "predict"),
])
def test_an_option_of_another_command_is_not_suggested(argv, option, owner, capsys):
    with pytest.raises(SystemExit) as exit:
        cli.build_parser().parse_args(argv)
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "did you mean" not in err
    assert (f"{option} is an option of `keras-vmoe {owner}`, not of "
            f"`keras-vmoe {argv[0]}`") in err


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
