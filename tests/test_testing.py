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


# Each public layer, backbone and task class, and the test file (named after
# its module) that runs it through the shared base.
SHARED_BASE_FILES = {
    "ExpertChoiceRouter": "layers/test_routing.py",
    "PartitionedTokenChoiceRouter": "layers/test_routing.py",
    "RenormalizedTokenChoiceRouter": "layers/test_routing.py",
    "SoftRouter": "layers/test_routing.py",
    "TokenChoiceRouter": "layers/test_routing.py",
    "Experts": "layers/test_experts.py",
    "MoeLayer": "layers/test_moe_layer.py",
    "PartitionedMoE": "layers/test_moe_layer.py",
    "SoftMoE": "layers/test_moe_layer.py",
    "Backbone": "models/test_backbone.py",
    "Task": "models/test_task.py",
    "VisionTransformerBackbone": "models/test_vit_backbone.py",
    "ImageClassifier": "models/test_image_classifier.py",
    "ImageClassifierPreprocessor": "models/test_image_classifier_preprocessor.py",
    "EnsembleImageClassifier": "models/test_ensemble_classifier.py",
    "ImageConverter": "preprocessing/test_image_converter.py",
}
# `Router` is abstract (its routers above are its tests); the classes that
# load presets run `run_preset_test` in presets/test_load.py.
NO_SHARED_BASE_RUN = {"Router"}
SHARED_BASE_CALL = re.compile(r"\brun_(layer|backbone|task|preset)_test\(")


def _public_layer_classes():
    import importlib

    names = set()
    for package in ("layers", "models", "presets", "preprocessing"):
        module = importlib.import_module(f"keras_vmoe.{package}")
        for name in module.__all__:
            value = getattr(module, name)
            if isinstance(value, type) and issubclass(value, keras.layers.Layer):
                names.add(name)
    return names


def test_every_public_layer_class_runs_through_the_shared_base():
    public = _public_layer_classes()
    assert public - NO_SHARED_BASE_RUN == set(SHARED_BASE_FILES), (
        "Public layer/model classes without a shared-base test file: "
        f"{sorted(public - NO_SHARED_BASE_RUN - set(SHARED_BASE_FILES))}")
    missing = []
    for name, file in sorted(SHARED_BASE_FILES.items()):
        text = (TESTS / file).read_text()
        if name not in text or not SHARED_BASE_CALL.search(text):
            missing.append(f"{name} ({file})")
    assert not missing, f"No shared-base run in the class's own test file: {missing}"
    presets = (TESTS / "presets" / "test_load.py").read_text()
    assert "run_preset_test(" in presets


# Marked groups that `.ci/run` runs from one file (a whole-suite collection
# to select them would cost as much as their tests).
SINGLE_FILE_GROUPS = {"without_tf": "test_without_tensorflow.py",
                      "multi_host": "test_multi_host.py"}


@pytest.mark.parametrize("marker", sorted(SINGLE_FILE_GROUPS))
def test_single_file_groups_stay_in_their_file(marker):
    tests = pathlib.Path(__file__).parent
    home = tests / SINGLE_FILE_GROUPS[marker]
    assert f"mark.{marker}" in home.read_text()
    assert f"tests/{home.name}" in (tests.parent / ".ci" / "run").read_text()
    elsewhere = [str(p.relative_to(tests)) for p in sorted(tests.rglob("*.py"))
                 if p != home and f"mark.{marker}" in p.read_text()]
    assert elsewhere == [], f"`.ci/run` runs -m {marker} from {home.name} only"


def test_loadgroup_keeps_a_group_on_one_worker(tmp_path):
    """`--dist loadgroup` sends the tests of one `xdist_group` to one worker
    (the docs and backend groups of `.ci/run` start one process per group)."""
    import subprocess
    import sys

    (tmp_path / "test_grouped.py").write_text(
        "import os\nimport pytest\n\n\n"
        "@pytest.mark.xdist_group('one')\n"
        "@pytest.mark.parametrize('i', range(6))\n"
        "def test_grouped(i):\n"
        "    with open(f'worker_{i}', 'w') as f:\n"
        "        f.write(os.environ['PYTEST_XDIST_WORKER'])\n")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup",
         "-p", "no:cacheprovider", "test_grouped.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    workers = {(tmp_path / f"worker_{i}").read_text() for i in range(6)}
    assert len(workers) == 1, f"one group ran on {sorted(workers)}"
