"""What users feed the fine-tuning job: folders, broken files, value ranges, TFDS."""

import json
import os

import numpy as np
import pytest
import tiny_configs
from PIL import Image

from keras_vmoe import cli
from keras_vmoe import data
from keras_vmoe.cli import finetune as finetune_cmd
from keras_vmoe.data import images as image_files
from keras_vmoe.data import sources

TINY = tiny_configs.vmoe_8px_micro()


def _folder(root, per_class=10, classes=("cat", "dog"), size=12):
    rng = np.random.default_rng(0)
    for c in classes:
        os.makedirs(root / c, exist_ok=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (size, size + 3, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / c / f"{c}{i:02d}.png")
    return root


def _labels(ds):
    return np.concatenate([np.asarray(y) for _, y in ds])


# -- folders without split sub-folders ------------------------------------


def test_folder_without_splits_holds_out_a_fixed_part(tmp_path):
    root = _folder(tmp_path / "pets")
    train = data.load_dataset(root, "train", image_size=8, batch_size=4)
    test = data.load_dataset(root, "test", image_size=8, batch_size=4)
    assert (train.num_examples, test.num_examples) == (16, 4)
    assert "held-out 20% of each class" in test.split_note
    assert sorted(np.bincount(_labels(test))) == [2, 2]
    train_files = set(sources.folder_files(root, "train")[0])
    test_files = set(sources.folder_files(root, "test")[0])
    assert not train_files & test_files and len(train_files | test_files) == 20
    # Fixed: the same files whatever the seed.
    assert set(sources.folder_files(str(root) + "/", "test")[0]) == test_files
    with pytest.raises(ValueError, match="splits are 'train'.*'test'"):
        data.load_dataset(root, "validation", image_size=8, batch_size=4)


def test_folder_with_split_folders_uses_them(tmp_path):
    _folder(tmp_path / "d" / "train", per_class=3)
    _folder(tmp_path / "d" / "test", per_class=2)
    assert data.load_dataset(tmp_path / "d", "test", image_size=8,
                             batch_size=4).num_examples == 4
    with pytest.raises(ValueError, match=r"split sub-folders \['test', 'train'\] but "
                                         "no 'val'"):
        data.load_dataset(tmp_path / "d", "val", image_size=8, batch_size=4)


# -- unreadable images (item 7) -----------------------------------------------


def _broken_files(folder):
    good = folder / "good.jpg"
    Image.fromarray(np.full((20, 20, 3), 128, np.uint8)).save(good)
    body = good.read_bytes()
    (folder / "truncated.jpg").write_bytes(body[: len(body) * 2 // 3])
    (folder / "text.png").write_bytes(b"this is not a PNG")
    (folder / "empty.png").write_bytes(b"")
    # A PNG header that declares 30000 x 30000 pixels.
    import struct
    import zlib

    ihdr = struct.pack(">IIBBBBB", 30000, 30000, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    (folder / "bomb.png").write_bytes(
        b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(ihdr)) + chunk
        + struct.pack(">I", zlib.crc32(chunk)) + b"\x00\x00\x00\x00IEND\xaeB`\x82")
    return {"truncated.jpg": "truncated JPEG", "text.png": "not a readable image",
            "empty.png": "empty file", "bomb.png": "900000000 pixels"}


def test_unreadable_images_are_named_and_skipped(tmp_path, capsys):
    root = _folder(tmp_path / "pets", per_class=5)
    expected = _broken_files(root / "cat")
    sources._folder_files.cache_clear()
    train = data.load_dataset(root, "train", image_size=8, batch_size=2)
    test = data.load_dataset(root, "test", image_size=8, batch_size=2)
    err = capsys.readouterr().err
    for name, reason in expected.items():
        line = next(line for line in err.splitlines() if name in line)
        assert line.startswith("warning: skipping ") and reason in line, line
    assert train.num_examples + test.num_examples == 11  # 10 + good.jpg
    assert len(_labels(train)) == train.num_examples  # decodes, no error


@pytest.mark.heavy
def test_predict_answers_for_the_good_files(tmp_path, capsys):
    import keras

    from keras_vmoe import models
    from keras_vmoe import presets

    keras.utils.set_random_seed(0)
    model = models.ImageClassifier(models.VisionTransformerBackbone(**TINY),
                                   num_classes=2)
    model.class_names = ["cat", "dog"]
    presets.save_to_preset(model, tmp_path / "preset")
    folder = tmp_path / "photos"
    folder.mkdir()
    expected = _broken_files(folder)
    assert cli.main(["predict", str(folder), "--preset", str(tmp_path / "preset"),
                     "--json"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert [os.path.basename(p["path"]) for p in result["predictions"]] == ["good.jpg"]
    assert result["predictions"][0]["top_k"][0]["class_name"] in ("cat", "dog")
    assert result["skipped"] == len(expected)
    assert "Traceback" not in err and "imageio" not in err


# -- value ranges (item 11) ----------------------------------------------------


@pytest.mark.parametrize("images, kwargs, match", [
    (np.full((4, 8, 8, 3), 200.0, "float32"), {},
     r"float_range=\(-1.0, 1.0\); received values in \[200, 200\]\. They look like "
     r"\[0, 255\] values"),
    (np.full((4, 8, 8, 3), 30000, "int16"), {}, r"must be in \[0, 255\].*\[30000, 30000\]"),
    (np.zeros((4, 8, 8, 3), "float32"), {"float_range": (1, 0)}, "low < high"),
    (np.zeros((4, 8, 8, 3), "float32"), {"float_range": (1, 1)}, "low < high"),
    (np.where(np.arange(4)[:, None, None, None] == 2, np.nan,
              np.zeros((4, 8, 8, 3), "float32")), {}, r"NaN or inf .*first in image 2"),
])
def test_values_outside_the_declared_range_are_refused(images, kwargs, match):
    with pytest.raises(ValueError, match=match):
        data.load_dataset((images, np.zeros(4, "int32")), "train", image_size=8,
                          batch_size=2, **kwargs)


def test_declared_ranges_are_honoured():
    images = np.full((2, 8, 8, 3), 255.0, "float32")
    ds = data.load_dataset((images, np.zeros(2, "int32")), "train", image_size=8,
                           batch_size=2, float_range=(0, 255))
    x, _ = next(iter(ds))
    np.testing.assert_allclose(np.asarray(x), 1.0, atol=1e-5)


# -- the command line (items 5, 8, 9, 10) ---------------------------------------


# 25 s (a whole CLI fine-tune): the heavy group (.ci/run).
@pytest.mark.heavy
def test_small_folder_json_and_class_names(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(finetune_cmd, "SMALL_VMOE", TINY)
    root = _folder(tmp_path / "pets", per_class=5)
    out = tmp_path / "run"
    argv = ["finetune", "--data", str(root), "--epochs", "1", "--output", str(out),
            "--json"]
    assert cli.main(argv) == 0
    stdout, err = capsys.readouterr()
    metrics = json.loads(stdout)  # stdout is the JSON alone
    assert "using batch size 8" in err and "only 8 training images" in err
    assert (metrics["train_examples"], metrics["test_examples"]) == (8, 2)
    assert metrics["class_names"] == ["cat", "dog"] and metrics["completed"]
    meta = json.loads((out / "preset" / "metadata.json").read_text())
    assert meta["class_names"] == ["cat", "dog"]
    # Run again: finished, not redone.
    assert cli.main(argv) == 0
    stdout, err = capsys.readouterr()
    assert "already finished" in err and json.loads(stdout) == metrics


def test_read_only_output_is_a_clear_error(tmp_path, capsys):
    if os.geteuid() == 0:
        # root writes anywhere: point --output below a file instead.
        (tmp_path / "file").write_text("x")
        target = tmp_path / "file" / "out"
    else:  # pragma: no cover - CI and developers run as root here
        os.chmod(tmp_path, 0o500)
        target = tmp_path / "out"
    assert cli.main(["finetune", "--output", str(target)]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("error: --output ")
    assert "not writable" in err and "Traceback" not in err


@pytest.mark.heavy
def test_api_trained_class_names_reach_the_preset(tmp_path):
    import keras

    from keras_vmoe import models
    from keras_vmoe import presets
    from keras_vmoe import training

    root = _folder(tmp_path / "pets", per_class=4)
    train = data.load_dataset(root, "train", image_size=8, batch_size=2, training=True)
    keras.utils.set_random_seed(0)
    model = models.ImageClassifier(models.VisionTransformerBackbone(**TINY),
                                   num_classes=2)
    training.finetune(model, train, epochs=1, verbose=0)
    assert model.class_names == ["cat", "dog"]
    presets.save_to_preset(model, tmp_path / "preset")
    assert presets.from_preset(str(tmp_path / "preset")).class_names == ["cat", "dog"]


# -- TFDS (item 12) ---------------------------------------------------------------


def test_tfds_builder_offline_and_a_clear_error_before_downloading(tmp_path):
    pytest.importorskip("tensorflow_datasets")
    # TFDS imports importlib_resources lazily when it prepares a dataset.
    from tensorflow_datasets.core import dataset_builder

    assert dataset_builder.importlib_resources.files is not None
    builder, names = sources.tfds_builder("cifar10", data_dir=str(tmp_path))
    assert len(names) == 10
    with pytest.raises(ValueError, match=r"not prepared in .*tfds build cifar10"):
        data.load_dataset("tfds:cifar10", "train", image_size=8, batch_size=2,
                          data_dir=str(tmp_path))


def test_inspect_image_accepts_good_files(tmp_path):
    path = tmp_path / "ok.png"
    Image.fromarray(np.zeros((5, 5, 3), np.uint8)).save(path)
    assert image_files.inspect_image(path, decode=True) is None
    assert image_files.read_image(path).shape == (5, 5, 3)


# -- a full disk (item 5): a real 3 MB file system -----------------------------


@pytest.fixture
def tiny_filesystem(tmp_path):
    import subprocess

    mount = tmp_path / "tiny_fs"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs",
                             str(mount)], capture_output=True)
    if result.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.mark.faults
def test_full_disk_is_a_clear_error_with_nothing_half_written(tiny_filesystem):
    import subprocess
    import sys

    out = tiny_filesystem / "run"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    # The default model's checkpoint (weights + momentum, ~13 MB) cannot fit.
    proc = subprocess.run(
        [sys.executable, "-m", "keras_vmoe.cli", "finetune", "--epochs", "1",
         "--train-split", "train[:64]", "--test-split", "test[:32]",
         "--output", str(out)], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "disk space" in last, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    leftovers = [os.path.join(d, f) for d, _, files in os.walk(out) for f in files]
    assert not [f for f in leftovers if f.endswith(".tmp") or "preset" in f], leftovers


def test_predict_refuses_float_photos_in_0_255():
    import keras

    from keras_vmoe import models

    keras.utils.set_random_seed(0)
    model = models.ImageClassifier(models.VisionTransformerBackbone(**TINY),
                                   num_classes=2)
    photo = np.full((1, 8, 8, 3), 180.0, "float32")
    with pytest.raises(ValueError, match=r"float_range=\(-1.0, 1.0\).*\[180, 180\]"):
        model.predict(photo, verbose=0)
    assert model.predict(photo.astype("uint8"), verbose=0).shape == (1, 2)
