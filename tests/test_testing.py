"""The shared test base (tests/testing.py) fails where it must, and the
test files take their models from tests/tiny_configs.py."""

import pathlib
import re

import keras
import numpy as np
import pytest
import testing

TOKENS = np.random.default_rng(0).normal(size=(2, 8, 16)).astype("float32")


def test_the_base_catches_a_broken_round_trip():
    @keras.saving.register_keras_serializable(package="keras_vmoe_tests")
    class Forgetful(keras.layers.Dense):
        """Forgets its activation in `get_config`."""

        def get_config(self):
            return {**super().get_config(), "activation": "linear"}

    with pytest.raises(AssertionError):
        testing.run_layer_test(Forgetful, {"units": 3, "activation": "relu"}, TOKENS,
                               (2, 8, 3), run_mixed_precision=False)


# A backbone config written out in a test: literal sizes (`hidden_dim`), a
# call of the library's config builder, or an MoE block with its expert count.
HAND_BUILT_CONFIG = re.compile(
    r"""\bhidden_dim\s*=\s*\d|["']hidden_dim["']\s*:\s*\d"""
    r"""|(?<![\w])backbone_config\(|\.backbone_config\("""
    r"""|\bmoe\s*=\s*(\{|dict\()\s*["']?num_experts|["']moe["']\s*:\s*\{\s*["']num_experts"""
)
# Files whose subject is building configs may do it by hand, at most this
# many, each with a "# Hand-built configs: <why>" line near its top.
MAX_HAND_BUILT_FILES = 6
REASON = "# Hand-built configs:"
TESTS = pathlib.Path(__file__).parent
# The configs themselves, and this file's samples of what the check sees.
NOT_TESTS = ("tiny_configs.py", "test_testing.py")


def _builds_configs_by_hand(text):
    return HAND_BUILT_CONFIG.search(text) is not None


def test_the_hand_built_config_check_sees_configs():
    assert _builds_configs_by_hand("VisionTransformerBackbone(image_size=8, hidden_dim=16)")
    assert _builds_configs_by_hand('TINY = {"image_size": 8, "hidden_dim": 16}')
    assert _builds_configs_by_hand('models.backbone_config("vmoe", "S/32", **tiny)')
    assert _builds_configs_by_hand('dict(VIT, moe={"num_experts": 4})')
    assert _builds_configs_by_hand('{"moe": {"num_experts": 4, "router": {}}}')
    assert not _builds_configs_by_hand("VisionTransformerBackbone(**tiny_configs.vmoe())")
    assert not _builds_configs_by_hand("catalog_backbone_config(entry)")
    assert not _builds_configs_by_hand("MoeLayer(num_experts=4, mlp_dim=8)")


def test_few_test_files_build_backbone_configs_by_hand():
    by_hand = sorted(
        str(path.relative_to(TESTS)) for path in TESTS.rglob("*.py")
        if path.name not in NOT_TESTS and _builds_configs_by_hand(path.read_text())
    )
    assert len(by_hand) <= MAX_HAND_BUILT_FILES, (
        f"{len(by_hand)} test files build backbone configs by hand (at most "
        f"{MAX_HAND_BUILT_FILES}); take them from tests/tiny_configs.py: {by_hand}")
    unexplained = [name for name in by_hand
                   if REASON not in "\n".join((TESTS / name).read_text().splitlines()[:10])]
    assert not unexplained, (
        f"Test files that build configs by hand without a {REASON!r} line near their "
        f"top: {unexplained}")
