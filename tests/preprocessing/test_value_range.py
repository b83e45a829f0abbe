"""keras_vmoe.preprocessing.value_range: images outside their declared range
are refused, and the advice of each error works as written: every
suggestion in backticks (an expression of `images`, or a keyword argument
of the call that failed) is run and passes."""

import re

import numpy as np
import pytest
import tiny_configs

import keras_vmoe
from keras_vmoe import models
from keras_vmoe.preprocessing import ImageConverter
from keras_vmoe.preprocessing.value_range import check_pixel_values

PHOTOS = np.random.default_rng(0).uniform(0, 255, (2, 8, 8, 3)).astype("float32")


def _run_the_advice(call, images):
    """Runs `call(images)`, which must fail, then each suggestion of its
    message; returns how many ran (each must pass)."""
    with pytest.raises(ValueError) as caught:
        call(images)
    message = str(caught.value)
    ran = 0
    for code in re.findall(r"`([^`]+)`", message):
        keyword = re.fullmatch(r"(\w+)=(.+)", code)
        if keyword:
            call(images, **{keyword[1]: eval(keyword[2], {"keras_vmoe": keras_vmoe})})
        elif "images" in code:
            call(eval(code, {"images": images}))
        else:  # a name (an argument, a class), not a suggestion
            assert re.fullmatch(r"\w+", code), (code, message)
            continue
        ran += 1
    return ran, message


@pytest.fixture(scope="module")
def classifier():
    return models.ImageClassifier(
        models.VisionTransformerBackbone(**tiny_configs.vmoe_8px_micro()), num_classes=3)


def test_predict_advice_on_0_255_floats_works_as_written(classifier):
    ran, message = _run_the_advice(
        lambda images: classifier.predict(images, verbose=0), PHOTOS)
    assert ran == 2 and "pass float_range" not in message, message


@pytest.mark.parametrize("float_range", [(-1, 1), (0, 1)])
def test_extract_features_advice_on_0_255_floats_works_as_written(classifier, float_range):
    converter = ImageConverter(8, float_range=float_range)

    def call(images, image_converter=converter):
        classifier.extract_features(images, blocks=0, image_converter=image_converter)

    ran, message = _run_the_advice(call, PHOTOS)
    assert ran == 3, message
    assert "image_converter=keras_vmoe.preprocessing.ImageConverter(8, float_range=(0, 255))" \
        in message


def test_load_dataset_advice_on_0_255_floats_works_as_written():
    labels = np.array([0, 1])

    def call(images, **kwargs):
        keras_vmoe.data.load_dataset((images, labels), "train", image_size=8, batch_size=2,
                                     pipeline="numpy", **kwargs)

    ran, message = _run_the_advice(call, PHOTOS)
    assert ran == 3 and "`float_range=(0, 255)`" in message, message


def test_other_ranges_say_how_to_declare_theirs():
    standardized = np.linspace(-3, 3, 2 * 8 * 8 * 3, dtype="float32").reshape(2, 8, 8, 3)
    with pytest.raises(ValueError, match=r"\[-3, 3\]\. Scale them to \(-1\.0, 1\.0\), or "
                       r"declare their range with float_range=\(low, high\)\."):
        check_pixel_values(standardized, declare="float_range=({low}, {high})")
    with pytest.raises(ValueError, match=r"give the model an image converter of their range"):
        check_pixel_values(standardized)
    with pytest.raises(ValueError, match=r"\[0, 1000\].*uint8, or pass float images in "
                       r"\(-1\.0, 1\.0\)\.$"):
        check_pixel_values(np.array([[0, 1000]]))
    with pytest.raises(ValueError, match=r"NaN or inf.*image 1"):
        check_pixel_values(np.stack([PHOTOS[0] / 255, PHOTOS[1] * np.nan]))
    check_pixel_values(PHOTOS, (0, 255))
