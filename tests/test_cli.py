"""The `keras-vmoe` command line (default job: offline routing demo)."""

import json

import numpy as np
import pytest

from keras_vmoe import cli


def test_skimage_photos_are_real_and_in_range():
    images = cli.load_skimage_photos(["chelsea", "rocket"], 32)
    assert images.shape == (2, 32, 32, 3)
    assert -1.0 <= images.min() < 0 < images.max() <= 1.0
    assert not np.allclose(images[0], images[1])
    with pytest.raises(ValueError, match="Unknown scikit-image photo"):
        cli.load_skimage_photos(["not_a_photo"], 32)


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
