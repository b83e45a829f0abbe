"""Integrity of the preset catalog (data only; no model is run)."""

import math
import re

import pytest

from keras_vmoe.catalog import ALIASES
from keras_vmoe.catalog import PRESETS
from keras_vmoe.models import configs
from keras_vmoe.presets import get_preset_info
from keras_vmoe.presets import list_presets
from keras_vmoe.presets.load import catalog_backbone_config

# google-research/vmoe released checkpoints (upstream reference §3.8).
RELEASED = (
    "vmoe_s32_last2_ilsvrc2012_randaug_light1",
    "vmoe_s32_last2_ilsvrc2012_randaug_light1_ft_ilsvrc2012",
    "vmoe_s32_last2_ilsvrc2012_randaug_medium",
    "vmoe_b16_imagenet21k_randaug_strong",
    "vmoe_b16_imagenet21k_randaug_strong_ft_ilsvrc2012",
    "vmoe_b16_imagenet21k_randaug_strong_ft_cifar10",
    "eee_s32_last2_ilsvrc2012",
    "eee_s32_last2_ilsvrc2012_ft_cifar100",
)
# Models of the papers' tables.
PAPER_MODELS = (
    *(
        f"vmoe_{v}_{layout}"
        for v in ("s32", "b32", "b16", "l32", "l16")
        for layout in ("last2", "every2")
    ),
    "vmoe_h14_last5",
    "vmoe_h14_every2",
    "vmoe_15b",
    *(f"vmoe_dense_{v}" for v in ("s32", "b32", "b16", "l32", "l16", "h14")),
    "soft_moe_s16_128e",
    "soft_moe_s14_256e",
    "soft_moe_b16_128e",
    "soft_moe_l16_128e",
    "soft_moe_h14_256e",
    "soft_moe_h14_128e",
    *(f"soft_moe_dense_{v}" for v in ("s16", "b16", "l16", "h14")),
    *(f"eee_{v}_last2" for v in ("s32", "b32", "b16", "l32", "l16")),
    "eee_h14_last5",
)
SHORT_ALIASES = {
    "vmoe_s32": "vmoe_s32_last2",
    "vmoe_b32": "vmoe_b32_last2",
    "vmoe_h14": "vmoe_h14_last5",
    "soft_moe_b16": "soft_moe_b16_128e",
    "soft_moe_s14": "soft_moe_s14_256e",
    "eee_s32": "eee_s32_last2",
    "eee_h14": "eee_h14_last5",
}
ENTRY_KEYS = {
    "description",
    "family",
    "variant",
    "overrides",
    "image_size",
    "task",
    "routing",
    "weights",
    "metadata",
}
ROUTING_KEYS = {
    "num_selected_experts",
    "capacity_factor",
    "images_per_group",
    "batch_priority",
}
# A fast subset for the exact parameter counts (the full sweep is slow).
FAST_COUNTS = (
    *RELEASED,
    "vmoe_b32_last2",
    "soft_moe_s16_128e",
    "eee_s32_last2",
    "vit_b16_augreg_imagenet21k",
)


def _pair(value):
    return tuple(value) if isinstance(value, (list, tuple)) else (value, value)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_entry_schema(name):
    entry = PRESETS[name]
    assert set(entry) - {"eval_routing"} == ENTRY_KEYS, name
    assert set(entry.get("eval_routing", {})) <= ROUTING_KEYS
    assert re.fullmatch(r"[a-z0-9_]+", name)
    assert entry["family"] in configs.FAMILIES
    assert isinstance(entry["description"], str) and entry["description"]
    assert entry["task"]["class"] in ("ImageClassifier", "EnsembleImageClassifier")
    assert isinstance(entry["task"]["num_classes"], int)
    assert isinstance(entry["task"]["head_bias_init"], float)
    assert set(entry["routing"]) <= ROUTING_KEYS
    assert isinstance(entry["metadata"]["params"], int)
    assert entry["metadata"]["paper"].startswith("arXiv:")
    weights = entry["weights"]
    if weights is not None:
        assert set(weights) == {"format", "upstream"}
        assert weights["format"] in ("vmoe_partitioned", "vit_npz")
        assert weights["upstream"].startswith("gs://")
        if weights["format"] == "vit_npz":
            assert weights["upstream"].startswith("gs://vit_models/")
            assert weights["upstream"].endswith(".npz")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_entry_builds_a_backbone_config(name):
    entry = PRESETS[name]
    config = catalog_backbone_config(entry)
    image, patch = _pair(config["image_size"]), _pair(config["patch_size"])
    assert image[0] % patch[0] == 0 and image[1] % patch[1] == 0
    assert all(0 <= i < config["num_layers"] for i in config["moe_layers"])
    assert config["hidden_dim"] % config["num_heads"] == 0
    ensemble = config.get("ensemble_size", 1)
    assert (entry["task"]["class"] == "EnsembleImageClassifier") == (ensemble > 1)
    if entry["family"] == "vit" or entry["overrides"].get("layout") == "none":
        assert config["moe"] is None and entry["routing"] == {}
    else:
        assert config["moe_layers"]
        if config["moe"]["type"] != "soft":
            router = config["moe"]["router"]
            for key in ("num_selected_experts", "capacity_factor", "batch_priority"):
                assert router[key] == entry["routing"][key]


def test_released_checkpoints_point_at_the_vmoe_bucket():
    for name in RELEASED:
        weights = PRESETS[name]["weights"]
        assert weights == {
            "format": "vmoe_partitioned",
            "upstream": f"gs://vmoe_checkpoints/{name}",
        }
    released = [
        n
        for n, e in PRESETS.items()
        if (e["weights"] or {}).get("format") == "vmoe_partitioned"
    ]
    assert sorted(released) == sorted(RELEASED)


def test_released_checkpoint_architectures():
    light1 = catalog_backbone_config(PRESETS[RELEASED[0]])
    assert (light1["hidden_dim"], light1["num_layers"], light1["patch_size"]) == (
        512,
        8,
        32,
    )
    assert light1["moe_layers"] == (5, 7)
    assert light1["moe"]["num_experts"] == 8
    assert light1["representation_size"] == 512
    b16 = catalog_backbone_config(PRESETS["vmoe_b16_imagenet21k_randaug_strong"])
    assert b16["moe_layers"] == (1, 3, 5, 7, 9, 11)
    assert b16["representation_size"] is None
    eee = catalog_backbone_config(PRESETS["eee_s32_last2_ilsvrc2012_ft_cifar100"])
    assert eee["ensemble_size"] == 2 and eee["image_size"] == 128
    assert eee["moe"]["router"]["num_selected_experts"] == 1


def test_every_paper_model_is_present():
    missing = [name for name in PAPER_MODELS if name not in PRESETS]
    assert not missing
    for name in PAPER_MODELS:
        assert PRESETS[name]["weights"] is None, name


def test_dense_vit_presets_have_npz_weights():
    vit = list_presets("vit")
    assert len(vit) >= 20
    assert all(PRESETS[n]["weights"]["format"] == "vit_npz" for n in vit)
    assert "vit_b16_augreg_imagenet21k_ft_imagenet2012" in vit


def test_aliases_resolve():
    for alias, target in SHORT_ALIASES.items():
        assert ALIASES[alias] == target
    for alias, target in ALIASES.items():
        assert alias not in PRESETS, alias
        assert target in PRESETS, alias
        assert get_preset_info(alias)["name"] == target
    assert "vmoe_b32" in get_preset_info("vmoe_b32_last2")["aliases"]


def test_list_presets_by_family():
    names = list_presets()
    assert names == sorted(PRESETS)
    for family in configs.FAMILIES:
        subset = list_presets(family)
        assert subset and all(PRESETS[n]["family"] == family for n in subset)
    assert "soft_moe_b16_128e" in list_presets("soft_moe")
    with pytest.raises(ValueError, match=r"`family` must be one of .*family=.moe."):
        list_presets("moe")


def _parse_count(text):
    value, unit = re.fullmatch(r"([\d.]+)([MB])", text.split()[0]).groups()
    digits = len(value.split(".")[1]) if "." in value else 0
    return float(value), (1e6 if unit == "M" else 1e9), digits


@pytest.mark.parametrize(
    "name", [n for n in PRESETS if "paper_params" in PRESETS[n]["metadata"]]
)
def test_paper_parameter_counts(name):
    """The catalog count reproduces the paper's printed count (to its last digit)."""
    entry = PRESETS[name]
    text = entry["metadata"]["paper_params"]
    if "upstream" in text or name == "vmoe_15b":
        pytest.skip("the preset is not the model the paper counts")
    value, unit, digits = _parse_count(text)
    assert abs(entry["metadata"]["params"] / unit - value) < 10.0**-digits


def _check_count(name):
    entry = PRESETS[name]
    count = configs.count_parameters(
        catalog_backbone_config(entry), num_classes=entry["task"]["num_classes"]
    )
    assert count == entry["metadata"]["params"], name


@pytest.mark.parametrize("name", FAST_COUNTS)
def test_parameter_counts(name):
    _check_count(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(PRESETS) - set(FAST_COUNTS)))
def test_parameter_counts_all(name):
    _check_count(name)


def test_upstream_reference_sizes():
    # vmoe_reference §2.1: 57.0M / 56.8M / 301.0M / 285.2M.
    expected = {
        "vmoe_s32_last2_ilsvrc2012_randaug_light1": 57.0,
        "vmoe_s32_last2_ilsvrc2012_randaug_light1_ft_ilsvrc2012": 56.8,
        "vmoe_b16_imagenet21k_randaug_strong": 301.0,
        "vmoe_b16_imagenet21k_randaug_strong_ft_ilsvrc2012": 285.2,
    }
    for name, millions in expected.items():
        assert math.isclose(
            PRESETS[name]["metadata"]["params"] / 1e6, millions, abs_tol=0.05
        )


# ---------------------------------------------------------------------------
# The catalog as data files, the table and the `keras-vmoe presets` command.
# ---------------------------------------------------------------------------


def test_catalog_is_one_data_file_per_family():
    import json
    import pathlib

    from keras_vmoe import catalog

    folder = pathlib.Path(catalog.__file__).parent
    files = sorted(p.stem for p in folder.glob("*.json"))
    assert files == sorted(configs.FAMILIES) == sorted(catalog.FAMILY_FILES)
    merged, aliases = {}, {}
    for family in files:
        data = json.loads((folder / f"{family}.json").read_text())
        assert all(e["family"] == family for e in data["presets"].values())
        assert all(PRESETS[t]["family"] == family for t in data["aliases"].values())
        merged.update(data["presets"])
        aliases.update(data["aliases"])
    assert merged == PRESETS and aliases == ALIASES


def test_lookup_ignores_case_and_suggests():
    from keras_vmoe.catalog import names

    assert names.resolve_preset_name("VMOE_S32") == "vmoe_s32_last2"
    assert names.resolve_preset_name(" Vmoe-B32 ") == "vmoe_b32_last2"
    assert names.resolve_preset_name("vmoe_s23") is None
    assert names.suggest_preset_names("vmoe_s23")[0] == "vmoe_s32"
    assert names.suggest_preset_names("VMOE_S23")[0] == "vmoe_s32"
    assert get_preset_info("EEE_S32")["name"] == "eee_s32_last2"


def test_suggestions_include_the_names_that_hold_every_part():
    from keras_vmoe.catalog import names

    # A shortened released name finds the released presets it abbreviates.
    light1 = names.suggest_preset_names("vmoe_s32_light1")
    assert light1[:2] == ["vmoe_s32_last2_ilsvrc2012_randaug_light1",
                          "vmoe_s32_last2_ilsvrc2012_randaug_light1_ft_ilsvrc2012"]
    assert "vmoe_b16_imagenet21k_randaug_strong_ft_ilsvrc2012" in (
        names.suggest_preset_names("VMOE-B16-ILSVRC2012"))
    assert len(names.suggest_preset_names("vmoe_s32_light1", n=3)) == 3


def test_list_presets_filters_and_details(monkeypatch, tmp_path):
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    monkeypatch.delenv("KERAS_VMOE_CHECKPOINT_ROOT", raising=False)
    with_weights = list_presets(with_weights=True)
    without = list_presets(with_weights=False)
    assert sorted(with_weights + without) == list_presets()
    assert all(PRESETS[n]["weights"] for n in with_weights)
    assert not any(PRESETS[n]["weights"] for n in without)
    assert list_presets("eee", with_weights=True) == list(RELEASED[-2:])
    with pytest.raises(ValueError, match="with_weights"):
        list_presets(with_weights="yes")
    rows = {row["name"]: row for row in list_presets(details=True)}
    light1 = rows[RELEASED[0]]
    assert light1["parameters"] == PRESETS[RELEASED[0]]["metadata"]["params"]
    assert light1["image_size"] == 224 and light1["weights"] == "downloadable"
    assert light1["accuracy"]["test"] == 73.1
    assert light1["accuracy_summary"] == "73.1 (ILSVRC2012 test)"
    assert rows["vmoe_s32_last2"]["aliases"] == ["vmoe_s32"]
    assert rows["vmoe_s32_last2"]["weights"] == "none"
    # A converted preset in the cache counts as available here.
    cached = tmp_path / "keras_vmoe" / RELEASED[0]
    cached.mkdir(parents=True)
    (cached / "config.json").write_text("{}")
    assert list_presets(details=True)[list_presets().index(RELEASED[0])][
        "weights"] == "here"


def test_presets_command_table_json_and_lookup(capsys, monkeypatch, tmp_path):
    import json
    import time

    from keras_vmoe import cli

    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    monkeypatch.delenv("COLUMNS", raising=False)  # a pipe: the full table
    start = time.perf_counter()
    assert cli.main(["presets", "--family", "vmoe", "--with-weights"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert time.perf_counter() - start < 3
    header, rule, *lines = table
    assert header.split()[:6] == ["name", "aliases", "family", "params", "res", "weights"]
    assert len(lines) == 6 and all("downloadable" in line for line in lines)
    # Aligned: every column starts where its header does.
    column = header.index("weights")
    assert all(line[column:].startswith("downloadable") for line in lines)
    assert cli.main(["presets", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [row["name"] for row in data["presets"]] == list_presets()
    assert data["aliases"] == ALIASES
    assert {"parameters", "image_size", "weights", "accuracy", "description"} <= set(
        data["presets"][0])
    assert cli.main(["presets", "VMOE_S32", "--json"]) == 0
    assert [r["name"] for r in json.loads(capsys.readouterr().out)["presets"]] == [
        "vmoe_s32_last2"]
    assert cli.main(["presets", "vmoe_s23"]) == 1
    assert "Did you mean: vmoe_s32" in capsys.readouterr().err


def test_presets_command_imports_no_keras():
    import os
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from keras_vmoe import cli\n"
        "assert cli.main(['presets', '--json']) == 0\n"
        "assert 'keras' not in sys.modules and 'jax' not in sys.modules\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env,
                   capture_output=True, timeout=120)


# Training and evaluation routing, upstream groups.
# light1: configs/vmoe_paper/vmoe_s32_last2_ilsvrc2012_randaug_light1.py
# evaluates at capacity factor 4.0; its fine-tuning config
# (..._light1_ft_ilsvrc2012.py) trains at 1.5. E³ paper App. A.3 / Tables
# 20, 23, 25: fine-tuned at capacity factor 1.5, evaluated at 8.
TRAIN_EVAL_CAPACITY = {
    "vmoe_s32_last2_ilsvrc2012_randaug_light1": (1.5, 4.0),
    "vmoe_s32_last2_ilsvrc2012_randaug_light1_ft_ilsvrc2012": (1.5, 1.5),
    "eee_s32_last2_ilsvrc2012_ft_cifar100": (1.5, 1.5),
    **{f"eee_{v}_last{n}": (1.5, 8.0)
       for v, n in (("s32", 2), ("b32", 2), ("b16", 2), ("l32", 2), ("l16", 2),
                    ("h14", 5))},
}


@pytest.mark.parametrize("name", sorted(TRAIN_EVAL_CAPACITY))
def test_presets_train_and_evaluate_at_upstream_capacity(name):
    train, evaluate = TRAIN_EVAL_CAPACITY[name]
    entry = PRESETS[name]
    config = catalog_backbone_config(entry)
    assert config["moe"]["router"]["capacity_factor"] == train
    eval_routing = config["moe"].get("eval_routing") or {}
    assert eval_routing.get("capacity_factor", train) == evaluate


@pytest.mark.parametrize("name", sorted(
    n for n, e in PRESETS.items() if e["metadata"].get("upstream_group_size")))
def test_presets_route_upstream_images_per_group(name):
    entry = PRESETS[name]
    config = catalog_backbone_config(entry)
    image, patch = _pair(config["image_size"]), _pair(config["patch_size"])
    tokens = (image[0] // patch[0]) * (image[1] // patch[1]) + 1  # class token
    members = config.get("ensemble_size", 1)
    assert config["moe"]["images_per_group"] * tokens * members == \
        entry["metadata"]["upstream_group_size"]
    assert config["moe"].get("group_size") is None
