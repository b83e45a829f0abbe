"""`keras-vmoe presets NAME`: what a preset holds and what predict returns."""

from keras_vmoe import cli


def test_presets_name_says_what_predict_returns(capsys):
    assert cli.main(["presets", "vmoe_b16_every2"]) == 0
    text = capsys.readouterr().out
    assert "18,291 (JFT-300M classes)" in text and "logits" in text
    assert "architecture only" in text
    assert cli.main(["presets", "eee_s32_last2_ilsvrc2012_ft_cifar100"]) == 0
    assert "predict_members" in capsys.readouterr().out
