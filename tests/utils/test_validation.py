"""keras_vmoe.utils.validation: one message shape for every argument check."""

import pathlib
import re

import numpy as np
import pytest

from keras_vmoe.utils import validation


@pytest.mark.parametrize("value", [0, -1, 1.0, True, "2", None, np.float32(3)])
def test_check_int_rejects_with_name_and_value(value):
    with pytest.raises(ValueError, match=r"`width` must be an integer >= 1\. "
                                         r"Received: width="):
        validation.check_int(value, "width")


def test_check_int_normalises_and_bounds():
    assert type(validation.check_int(np.int64(3), "n")) is int
    assert validation.check_int(None, "n", allow_none=True) is None
    assert validation.check_int(0, "seed", minimum=0) == 0
    with pytest.raises(ValueError, match="between 1 and 4"):
        validation.check_int(5, "k", maximum=4)


def test_check_int_without_a_minimum():
    assert validation.check_int(-5, "seed", minimum=None) == -5
    with pytest.raises(ValueError, match=r"`seed` must be an integer\. Received: seed=True"):
        validation.check_int(True, "seed", minimum=None)
    with pytest.raises(ValueError, match=r"`seed` must be an integer <= 3\. Received: seed=4"):
        validation.check_int(4, "seed", minimum=None, maximum=3)


_INTEGER_TYPES = r"(int|numbers\.Integral|\(int, np\.integer\))"
_HAND_WRITTEN_INT_CHECK = re.compile(
    rf"isinstance\((\w+), bool\) or not isinstance\(\1, {_INTEGER_TYPES}\)"
    rf"|not isinstance\((\w+), {_INTEGER_TYPES}\) or isinstance\(\3, bool\)")


def test_integer_arguments_are_checked_by_check_int():
    root = pathlib.Path(validation.__file__).parents[1]
    found = [
        f"{path.relative_to(root)}:{number}"
        for path in sorted(root.rglob("*.py")) if path.name != "validation.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if _HAND_WRITTEN_INT_CHECK.search(line)
    ]
    assert not found, f"integer checks outside check_int: {found}"


def test_check_pair():
    assert validation.check_pair(3, "size") == (3, 3)
    assert validation.check_pair([2, np.int32(4)], "size") == (2, 4)
    for bad in [(1, 2, 3), (1.0, 2), "16", True]:
        with pytest.raises(ValueError, match="`size` must be an int or a pair"):
            validation.check_pair(bad, "size")


def test_check_probability():
    assert validation.check_probability(np.float32(0.5), "p") == 0.5
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        validation.check_probability(1.0, "p", include_one=False)
    for bad in [-0.1, 1.5, True, "0.5", float("nan")]:
        with pytest.raises(ValueError, match="`p` must be a number"):
            validation.check_probability(bad, "p")


def test_check_group_rule():
    assert validation.check_group(group_size="all") == (None, None)
    assert validation.check_group(group_size=np.int64(8), ensemble_size=2) == (8, None)
    assert validation.check_group(images_per_group=4) == (None, 4)
    with pytest.raises(ValueError, match="at most one"):
        validation.check_group(group_size=8, images_per_group=2)
    with pytest.raises(ValueError, match="divisible by ensemble_size=4"):
        validation.check_group(group_size=6, ensemble_size=4)
    with pytest.raises(ValueError, match="`images_per_group` must be"):
        validation.check_group(images_per_group=0)


def test_plain_copies_containers_and_scalars():
    value = {"a": [1, (2, {"b": 3})]}
    copied = validation.plain(value)
    assert copied == value and copied["a"] is not value["a"]
    assert type(validation.python_scalar(np.float32(0.5))) is float


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0, True, "x", None])
def test_check_number_refuses_non_finite_negative_and_non_numbers(value):
    with pytest.raises(ValueError, match=r"`rate` must be a finite number >= 0"):
        validation.check_number(value, "rate")


def test_check_number_and_check_bool_normalise():
    assert validation.check_number(np.float32(0.5), "rate") == 0.5
    assert validation.check_number(0, "rate") == 0.0
    with pytest.raises(ValueError, match=r"> 0"):
        validation.check_number(0, "rate", inclusive=False)
    assert validation.check_bool(np.bool_(True), "flag") is True
    for value in ("false", "no", 0, None):
        with pytest.raises(ValueError, match=r"`flag` must be True or False"):
            validation.check_bool(value, "flag")


def test_check_model_kwargs_names_the_unknown_and_the_valid_arguments():
    class Model:
        def __init__(self, width=1, depth=2, **kwargs):
            pass

    validation.check_model_kwargs(Model, {"name": "m", "trainable": False})
    with pytest.raises(TypeError, match=r"Model got unexpected keyword arguments "
                                        r"\['remat'\]\. Valid arguments: \['width', "
                                        r"'depth', 'name', 'trainable'\]"):
        validation.check_model_kwargs(Model, {"remat": True})


def test_patch_grid():
    assert validation.patch_grid(224, 16) == (14, 14)
    assert validation.patch_grid([384, np.int64(224)], (32, 16)) == (12, 14)
    # The border that makes no whole patch is dropped, unless refused.
    assert validation.patch_grid(230, 16) == (14, 14)
    with pytest.raises(ValueError, match=r"multiple of the patch size \(16, 16\)\. "
                                         r"Received: image_size=230\. .* 224 or 240"):
        validation.patch_grid(230, 16, require_multiple=True)
    with pytest.raises(ValueError, match=r"`patch_size` must be an integer >= 1.*"
                                         r"Received: patch_size=\(0, 16\)"):
        validation.patch_grid(224, (0, 16))
    with pytest.raises(ValueError, match="`image_size` must be an int or a pair"):
        validation.patch_grid("224", 16)
