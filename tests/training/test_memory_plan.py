"""Memory plan (XLA memory analysis on a virtual mesh) and its CLI."""

import json
import math

import jax
import pytest
import tiny_configs
from testing import cli_argument_error as _argument_error

from keras_vmoe.cli import main
from keras_vmoe.training import memory_plan as plan

CONFIG = tiny_configs.expert_parallel_8px()


@pytest.mark.multi_device
@pytest.mark.slow  # one sharded train-step compile (tens of seconds on 2 cores)
def test_memory_plan_of_expert_layout():
    if len(jax.devices()) != 8:
        pytest.skip("needs 8 (virtual) devices")
    result = plan.memory_plan(CONFIG, {"data": 2, "expert": 4}, batch_size=16,
                              num_classes=3)
    sizes = result["bytes"]
    # Computed from the layout: the expert weights (8 experts over 4 devices)
    # are 1/4 per device, everything else is replicated; float32.
    expert = 2 * 8 * 16 * 32 + 8 * 32 + 8 * 16
    total = result["num_parameters"]
    # (+ a few bytes of non-trainable state: seed generators, step counters)
    weights = 4 * (total - expert + expert // 4)
    assert weights <= sizes["parameters"] <= weights + 64
    assert 2 * weights <= sizes["optimizer_slots"] <= 2 * weights + 64  # Adam m, v
    assert sizes["gradients"] == weights
    # Measured by XLA: the donated state and the batch shard are arguments.
    batch_shard = (16 // 8) * 8 * 8 * 3 * 4 + (16 // 8) * 4
    assert sizes["xla_arguments"] >= sizes["parameters"] + sizes["optimizer_slots"]
    assert sizes["xla_arguments"] <= sizes["parameters"] + sizes["optimizer_slots"] + \
        batch_shard + 1024
    assert sizes["peak"] >= sizes["xla_arguments"] + sizes["xla_temporaries"] - \
        sizes["parameters"] - sizes["optimizer_slots"]
    assert "peak" in result["measured"] and "parameters" in result["computed"]
    assert "full 2-block model" in plan.format_plan(result)


def test_plan_extrapolates_deep_models_from_slices():
    config = dict(CONFIG, num_layers=8, moe_layers=(1, 3, 5, 7))
    assert plan._periodic(config)
    assert not plan._periodic(dict(config, moe_layers=(6, 7)))
    assert plan._slice_config(config, 4)["moe_layers"] == (1, 3)
    assert math.prod(plan._mesh_shape({"expert": 8}).values()) == 8


def test_the_printed_15b_plan_command_validates_and_reaches_the_compile(monkeypatch,
                                                                        capsys):
    # The catalog routes 8 images per group: a batch of 16 on 8 expert
    # devices makes 2 groups, which the mesh cannot split. The command the
    # docs and `--help` print sets one group of 2 images per device.
    with pytest.raises(ValueError, match="--images-per-group"):
        plan.memory_plan("vmoe_15b", {"expert": 8}, batch_size=16)
    requests = []

    def measure(request):  # stands in for the 10-minute compile
        requests.append(request)
        return {"bytes": {"peak": 70 * plan.GIB}, "measured": [], "computed": []}

    monkeypatch.setattr(plan, "_measure_in_subprocess", measure)
    monkeypatch.setattr(plan, "_measure", lambda **request: measure(request))
    argv = ["plan", "vmoe_15b", "--mesh", "expert=8", "--batch", "16",
            "--images-per-group", "2", "--device-memory", "80", "--json"]
    assert main(argv) == 0, capsys.readouterr().err
    (request,) = requests
    assert request["config"]["moe"]["images_per_group"] == 2
    with pytest.raises(ValueError, match="images_per_group` must be an integer >= 1"):
        plan.memory_plan("vmoe_15b", {"expert": 8}, batch_size=16, images_per_group=0)


def test_plan_rejects_bad_input_before_building(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "vmoe_15b", "--mesh", "data=2,experts=4", "--batch", "8"])
    assert exit_info.value.code == 2
    assert "invalid mesh item 'experts=4'" in capsys.readouterr().err
    assert main(["plan", "no_such_preset", "--mesh", "expert=8", "--batch", "8"]) == 1
    assert "Unknown preset 'no_such_preset'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="num_experts=32 is not divisible by the 'expert'"):
        plan.memory_plan("vmoe_15b", {"expert": 3}, batch_size=48)
    with pytest.raises(ValueError, match="Unknown mesh axes"):
        plan.memory_plan(CONFIG, {"tensor": 2}, batch_size=8)


@pytest.mark.parametrize(
    "flag, value, expected",
    [
        ("--batch", 10**12, "between 1 and 1048576"),
        ("--dtype", "float7", "invalid choice: 'float7'"),
        ("--optimizer", "os.system", "invalid choice: 'os.system'"),
    ],
)
def test_plan_refuses_bad_settings(capsys, flag, value, expected):
    argv = ["plan", "vmoe_s32", "--mesh", "data=1", "--batch", 2, flag, value]
    err = _argument_error(argv, capsys)
    assert expected in err and "Traceback" not in err


def test_plan_suggests_remat_when_a_model_does_not_fit(monkeypatch, capsys):
    requests = []

    def measure(request):  # stands in for the compile: remat halves the peak
        requests.append(request)
        peak = (40 if request["config"].get("remat") else 100) * plan.GIB
        return {"bytes": {"peak": peak}, "measured": [], "computed": []}

    monkeypatch.setattr(plan, "_measure_in_subprocess", measure)
    monkeypatch.setattr(plan, "_measure", lambda **request: measure(request))
    monkeypatch.setattr(plan, "format_plan", lambda result, memory: json.dumps(result))
    argv = ["plan", "vmoe_s32", "--mesh", "data=1", "--batch", "64",
            "--device-memory", "80"]
    assert main(argv) == 0, capsys.readouterr().err
    printed = json.loads(capsys.readouterr().out)
    assert [r["config"].get("remat", False) for r in requests] == [False, True]
    assert printed["fits"] is False and printed["remat"] is False
    assert printed["with_remat"] == {"peak": 40 * plan.GIB, "fits": True}
    requests.clear()
    assert main([*argv, "--remat"]) == 0
    assert [r["config"]["remat"] for r in requests] == [True]  # fits: no second plan
    assert json.loads(capsys.readouterr().out)["fits"] is True
    with pytest.raises(ValueError, match="`remat` must be True or False"):
        plan.memory_plan(CONFIG, {"data": 1}, batch_size=2, remat="yes")


def test_plan_compiles_with_scan_when_asked(monkeypatch, capsys):
    requests = []

    def measure(request):  # stands in for the compile
        requests.append(request)
        return {"bytes": {"peak": 100 * plan.GIB}, "measured": [], "computed": []}

    monkeypatch.setattr(plan, "_measure_in_subprocess", measure)
    monkeypatch.setattr(plan, "_measure", lambda **request: measure(request))
    monkeypatch.setattr(plan, "format_plan", lambda result, memory: json.dumps(result))
    argv = ["plan", "vmoe_s32", "--mesh", "data=1", "--batch", "64"]
    assert main([*argv, "--scan"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["scan"] is True
    # Not fitting: the second compile (with remat) keeps the scan.
    assert main([*argv, "--scan", "--device-memory", "80"]) == 0
    assert json.loads(capsys.readouterr().out)["with_remat"]["fits"] is False
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["scan"] is False
    assert [(r["config"].get("scan", False), r["config"].get("remat", False))
            for r in requests] == [(True, False), (True, False), (True, True),
                                   (False, False)]
    with pytest.raises(ValueError, match="`scan` must be True or False"):
        plan.memory_plan(CONFIG, {"data": 1}, batch_size=2, scan="yes")


def test_the_printed_plan_names_remat_and_the_suggestion():
    result = {"preset": "vit_b16", "num_parameters": 10, "layout": "data", "remat": False,
              "mesh_shape": {"data": 1, "expert": 1, "model": 1}, "devices": 1,
              "batch_size": 64, "optimizer": "adam", "group_size": None,
              "bytes": dict.fromkeys(("parameters", "optimizer_slots", "gradients",
                                      "activations", "xla_arguments",
                                      "xla_temporaries"), 0) | {"peak": 100 * plan.GIB},
              "with_remat": {"peak": 40 * plan.GIB, "fits": True}}
    text = plan.format_plan(result, 80)
    assert "Does NOT fit in 80 GiB" in text
    assert "With --remat (rematerialised encoder blocks) the peak is 40.00 GiB: it fits" \
        in text
    assert "rematerialised blocks" in plan.format_plan(dict(result, remat=True), None)
    assert "scanned blocks" in plan.format_plan(dict(result, scan=True), None)
    assert "scanned blocks" not in text
