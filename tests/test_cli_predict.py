"""`keras-vmoe predict`: unknown and architecture-only presets are refused
before anything loads."""

from keras_vmoe import cli


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
