"""Image folders that are not what they seem: hidden, empty and mismatched classes."""

import os

import numpy as np
import pytest
from PIL import Image

from keras_vmoe.data import sources


def _images(folder, n=3):
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(
            os.path.join(folder, f"{i}.png"))


def test_hidden_and_archive_folders_are_not_classes(tmp_path):
    for cls in ("cat", "dog", "__MACOSX", ".git", ".ipynb_checkpoints"):
        _images(tmp_path / "train" / cls)
    _images(tmp_path / "train" / "cat" / ".thumbnails")
    files, labels, classes, _ = sources.folder_files(tmp_path, "train")
    assert classes == ["cat", "dog"] and len(files) == 6
    assert not any(".thumbnails" in f for f in files)


def test_an_empty_class_folder_is_refused_naming_it(tmp_path):
    _images(tmp_path / "cat")
    _images(tmp_path / "dog")
    os.makedirs(tmp_path / "emu")
    with pytest.raises(ValueError, match=r"class folder\(s\) \['emu'\] hold no usable"):
        sources.folder_files(tmp_path, "train")


def test_a_class_of_unusable_files_is_refused_naming_it(tmp_path):
    _images(tmp_path / "cat")
    _images(tmp_path / "dog")
    os.makedirs(tmp_path / "emu")
    (tmp_path / "emu" / "a.jpg").write_bytes(b"not an image")
    with pytest.raises(ValueError, match=r"\['emu'\] hold no usable"):
        sources.folder_files(tmp_path, "train")


def test_splits_with_other_class_sets_are_refused(tmp_path):
    for split, cls in (("train", "a"), ("train", "b"), ("test", "a"), ("test", "c")):
        _images(tmp_path / split / cls)
    with pytest.raises(ValueError, match=r"only in 'test': \['c'\]"):
        sources.folder_files(tmp_path, "test")
    with pytest.raises(ValueError, match=r"only in 'train': \['b'\]"):
        sources.folder_files(tmp_path, "train")


def test_new_files_are_seen_by_the_next_listing(tmp_path):
    _images(tmp_path / "cat")
    _images(tmp_path / "dog")
    assert len(sources.folder_files(tmp_path, "train")[0]) == 4
    _images(tmp_path / "dog", n=8)
    assert len(sources.folder_files(tmp_path, "train")[0]) == 2 + 6  # 80 % of 3 and 8


def test_16_bit_png_keeps_its_range_like_tf_data(tmp_path):
    from keras_vmoe.data import images

    values = (np.arange(64).reshape(8, 8) * 1000).astype("uint16")
    path = tmp_path / "deep.png"
    Image.fromarray(values).save(path)
    image = images.read_image(str(path))
    assert image.shape == (8, 8, 3)
    np.testing.assert_array_equal(image[..., 0], values >> 8)


def test_exif_orientation_is_applied(tmp_path):
    from keras_vmoe.data import images

    pixels = np.zeros((4, 8, 3), np.uint8)
    pixels[0, 0] = 255  # top-left marker
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to view"
    path = tmp_path / "phone.jpg"
    Image.fromarray(pixels).save(path, exif=exif, quality=100)
    image = images.read_image(str(path))
    assert image.shape == (8, 4, 3)  # upright: portrait
    assert image[0, -1].mean() > 128  # the marker moved to the top-right


@pytest.mark.parametrize("orientation", range(1, 9))
def test_both_pipelines_orient_photos_alike(tmp_path, orientation):
    from keras_vmoe.data import images

    tf = pytest.importorskip("tensorflow")
    pixels = np.random.default_rng(orientation).integers(0, 255, (4, 6, 3), np.uint8)
    exif = Image.Exif()
    exif[0x0112] = orientation
    path = tmp_path / "photo.png"
    Image.fromarray(pixels).save(path, exif=exif)
    assert sources.exif_orientation(str(path)) == orientation
    decoded = tf.io.decode_image(tf.io.read_file(str(path)), channels=3)
    oriented = sources.orient(decoded, tf.constant(orientation)).numpy()
    np.testing.assert_array_equal(oriented, images.read_image(str(path)))
