"""The benchmark scripts run (tiny shapes, `--quick`) and emit their JSON keys.

Timings are not checked: only that the scripts work and report the floor,
model and README-table fields the README's performance section is built from.
"""

import argparse
import json
import math
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from testing import load_benchmark as _load  # noqa: E402


@pytest.fixture(scope="module")
def layer_json(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "layer.json"
    _load("moe_layer").main(
        ["--quick", "--reps", "2", "--warmup", "0",
         "--shape", "16,8,16,4,2,1.0", "--allow-loaded", "--output", str(out)]
    )
    return json.loads(out.read_text()), out


@pytest.fixture(scope="module")
def models_json(tmp_path_factory):
    pytest.importorskip("matplotlib")
    tmp = tmp_path_factory.mktemp("bench")
    out, png = tmp / "models.json", tmp / "sweep.png"
    _load("models").main(
        ["--quick", "--models", "vit_s32,vmoe_s32_last2_e8", "--batches", "1",
         "--reps", "1", "--train-steps", "1", "--train-rounds", "1",
         "--group-size-sweep", str(png), "--sweep-sizes", "16,32",
         "--allow-loaded", "--output", str(out)]
    )
    return json.loads(out.read_text()), out, png


def test_floor_work_counts_routed_flops_and_weight_bytes():
    module = _load("moe_layer")
    # S=10, D=4, M=6, E=2, K=2, cf=1 -> C=10: all 20 pairs fit.
    flops, bytes_ = module.floor_work((10, 4, 6, 2, 2, 1.0), 1, "fwd", moe=True)
    assert flops == 2 * 2 * 20 * 4 * 6
    weights = 2 * (2 * 4 * 6 + 6 + 4)
    assert bytes_ == (weights + 2 * 10 * 4) * 4
    flops_bwd, bytes_bwd = module.floor_work(
        (10, 4, 6, 2, 2, 1.0), 1, "fwd_bwd", moe=True
    )
    assert flops_bwd == 3 * flops
    assert bytes_bwd == (2 * weights + 3 * 10 * 4) * 4
    # cf=0.5: only the E·C < K·S pairs that fit are routed.
    capacity = module.compute_capacity(20, 2, 0.5)
    assert 2 * capacity < 20
    flops_cf, _ = module.floor_work((10, 4, 6, 2, 2, 0.5), 1, "fwd", moe=True)
    assert flops_cf == 2 * 2 * 2 * capacity * 4 * 6


@pytest.mark.heavy
def test_moe_layer_benchmark_reports_floor_and_targets(layer_json):
    result, _ = layer_json
    shape = result["shapes"][0]
    machine = shape["machine"]
    assert machine["matmul_gflops"] > 0 and machine["stream_read_gbytes_per_s"] > 0
    assert machine["expert_matmuls_fwd"]["median_ms"] > 0
    assert machine["expert_matmuls_fwd_numpy"]["gflops"] > 0
    assert result["settings"]["calls_per_sample"] == 1  # on a CPU
    for mode in ("fwd", "fwd_bwd"):
        for probe in (f"expert_matmuls_{mode}", f"expert_matmuls_{mode}_resident"):
            assert machine[probe]["gflops"] > 0
        for variant in ("dense", "index", "index_alt", "einsum"):
            entry = shape[mode][variant]
            assert entry["floor_ms"] == max(
                entry["compute_floor_ms"], entry["memory_floor_ms"]
            )
            assert entry[f"time_ratio_vs_expert_matmuls_{mode}"] > 0
            if variant == "dense":
                assert entry["small_row_floor_ms"] is None
            else:
                # FLOPs at the resident small-row rate, or the memory floor.
                flops_ms = entry["floor_flops"] / (
                    machine[f"expert_matmuls_{mode}_resident"]["gflops"] * 1e6
                )
                assert math.isclose(entry["small_row_floor_ms"],
                                    max(flops_ms, entry["memory_floor_ms"]))
            assert math.isclose(
                entry["time_ratio_vs_floor"], entry["median_ms"] / entry["floor_ms"]
            )
            assert entry["floor_bound"] in ("compute", "memory")
            assert entry["time_ratio_vs_dense"] > 0
            assert entry["temp_bytes"] is not None
    # The default expert path: batched for these tiny hidden activations and
    # in training; `index_alt` runs the loop.
    for mode in ("fwd", "fwd_bwd"):
        assert shape[mode]["index"]["experts_implementation"] == "batched"
        assert shape[mode]["index_alt"]["experts_implementation"] == "loop"
    assert shape["index_vs_einsum_max_abs_diff"] < 1e-4
    assert "index_fwd_time_ratio_vs_floor_most_experts" in result["target_values"]
    assert set(result["environment"]) >= {"date_utc", "jax_version", "keras_version"}


@pytest.mark.slow  # ~1 min of CPU: six model compiles (fit, raw step, sweep)
def test_models_benchmark_reports_inference_train_and_sweep(models_json):
    result, _, png = models_json
    inference = result["inference"]["1"]
    assert set(inference) == {"vit_s32", "vmoe_s32_last2_e8"}
    moe = inference["vmoe_s32_last2_e8"]
    assert moe["images_per_s"] > 0 and moe["temp_bytes"] is not None
    assert 0.0 <= moe["tokens_dropped_fraction"] <= 1.0
    assert inference["vit_s32"]["tokens_dropped_fraction"] is None
    assert moe["vs"]["vit_s32"]["time_ratio"] > 0
    floor = moe["vs"]["vit_s32"]
    assert floor["bare_experts_ms"] > 0 and floor["bare_dense_mlps_ms"] > 0
    assert floor["bare_matmul_floor_ms"] == pytest.approx(
        inference["vit_s32"]["median_ms"] - floor["bare_dense_mlps_ms"]
        + floor["bare_experts_ms"]
    )
    assert "bare_matmul_floor_ratio" not in inference["vit_s32"].get("vs", {})
    assert result["settings"]["experts_implementation"] == "auto"
    train = result["train"]["vmoe_s32_last2_e8"]
    assert train["fit_images_per_s"] > 0 and train["raw_images_per_s"] > 0
    assert train["vs"]["vit_s32"]["raw_time_ratio"] > 0
    rows = result["group_size_sweep"]["rows"]
    assert [r["group_size"] for r in rows] == [16, 32]
    assert rows[0]["einsum"]["temp_bytes"] is not None
    assert png.stat().st_size > 0


def test_expert_shapes_are_groups_times_capacity_and_batch_times_slots():
    models = _load("models")
    configs = models.model_configs(quick=True)
    sparse = models.build_task(configs["vmoe_s32_last2_e32"], seed=0)
    # 3 images of 17 tokens in one group: C = ceil(2 * 51 * 1.05 / 32) = 4.
    assert models.expert_shapes(sparse, 3) == [(32, 4, 32, 64)] * 2
    soft = models.build_task(configs["soft_moe_s16"], seed=0)
    # One group per image, 1 slot per expert: 3 rows per expert.
    assert models.expert_shapes(soft, 3) == [(16, 3, 32, 64)] * len(
        configs["soft_moe_s16"]["moe_layers"]
    )


def _readme(tmp_path, report):
    readme = tmp_path / "README.md"
    readme.write_text(
        f"# T\n\n## Speed and memory\n\n{report.START_MARKER}\nold\n"
        f"{report.END_MARKER}\n\n## Next\n"
    )
    return readme


@pytest.mark.heavy
def test_report_writes_layer_table_between_readme_markers(layer_json, tmp_path):
    report = _load("report")
    _, layer_path = layer_json
    readme = _readme(tmp_path, report)
    report.main(
        ["--layer", str(layer_path), str(layer_path), "--write-readme", str(readme)]
    )
    text = readme.read_text()
    assert "old" not in text and text.endswith("## Next\n")
    assert "index (default;" in text and "index, other experts path" in text
    assert "GFLOP/s" in text and "vs bare expert matmuls" in text and "(NumPy/" in text
    assert "vs small-row floor" in text and "Small-row kernels" in text
    assert "2 run(s)" in text and "jax " in text and "keras " in text
    # The run's XLA flags (the test processes' own) are named after the
    # allocator setting.
    setting = report.run_setting(json.loads(layer_path.read_text()))
    assert setting.startswith("glibc defaults") and f"Memory: {setting}." in text


@pytest.mark.heavy
def test_report_never_mixes_allocator_settings_in_a_cell(layer_json, tmp_path):
    report = _load("report")
    result, layer_path = layer_json
    reused = dict(result, environment=dict(result["environment"], reuse_freed_memory=True))
    reused_path = tmp_path / "reused.json"
    reused_path.write_text(json.dumps(reused))
    body = report.render(report.load([str(layer_path), str(reused_path)]), [])
    assert body.count("1 run(s)") == 2
    plain, with_reuse = report.run_setting(result), report.run_setting(reused)
    assert plain.startswith("glibc defaults")
    assert with_reuse.startswith("`reuse_freed_memory()`")
    assert body.index(f"Memory: {plain}.") < body.index(f"Memory: {with_reuse}.")
    # Other XLA flags (another kernel library) get a table of their own,
    # and a table of runs from two commits names both.
    flagged = dict(result, environment=dict(
        result["environment"], xla_flags="--xla_cpu_experimental_ynn_fusion_type="))
    other_commit = dict(result, environment=dict(result["environment"], git_commit="f" * 40))
    paths = []
    for name, run in (("flagged", flagged), ("other_commit", other_commit)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(run))
    body = report.render(report.load([str(layer_path), *map(str, paths)]), [])
    assert "2 run(s)" in body and "1 run(s)" in body
    assert "Memory: glibc defaults; `XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=`." in body
    assert ", `ffffffff`, " in body and "commits `" in body
    with pytest.raises(ValueError, match="marker"):
        report.replace_between_markers("no markers", "x")


@pytest.mark.heavy
def test_report_never_mixes_machines_in_a_cell(layer_json, tmp_path):
    report = _load("report")
    result, layer_path = layer_json
    gpu = dict(result, environment=dict(
        result["environment"], platform="gpu", device_kind="NVIDIA H100 80GB HBM3"))
    gpu_path = tmp_path / "gpu.json"
    gpu_path.write_text(json.dumps(gpu))
    body = report.render(report.load([str(layer_path), str(gpu_path), str(layer_path)]), [])
    assert body.count("1 run(s)") == 1 and body.count("2 run(s)") == 1
    assert body.index("device `cpu`") < body.index("device `NVIDIA H100 80GB HBM3`")
    # A run with another --batch times other shapes: a table of its own.
    batched = dict(result, settings=dict(result["settings"], batch=32))
    batched_path = tmp_path / "batch32.json"
    batched_path.write_text(json.dumps(batched))
    body = report.render(report.load([str(layer_path), str(batched_path)]), [])
    assert body.count("1 run(s)") == 2


@pytest.mark.slow
def test_report_writes_models_table(models_json, tmp_path):
    report = _load("report")
    _, models_path, _ = models_json
    readme = _readme(tmp_path, report)
    report.main(["--models", str(models_path), "--write-readme", str(readme)])
    text = readme.read_text()
    assert "vmoe_s32_last2_e8 | vit_s32 | 1" in text
    assert "| bare-matmul floor vs baseline | time vs floor |" in text
    row = next(line for line in text.splitlines()
               if line.startswith("| vmoe_s32_last2_e8 | vit_s32 | 1 "))
    floor_cell, vs_floor_cell = row.split("|")[7:9]
    assert floor_cell.strip().endswith("×") and vs_floor_cell.strip().endswith("×")
    assert "Bare-matmul floor:" in text
    assert "fit images/s" in text


@pytest.mark.slow  # shares the models run
def test_report_models_table_takes_old_runs_and_training_from_any_run(models_json):
    report = _load("report")
    result, _, _ = models_json
    inference_only = json.loads(json.dumps(result))
    del inference_only["train"]
    old = json.loads(json.dumps(result))  # made before the floor existed
    for per_model in old["inference"].values():
        for model in per_model.values():
            for versus in model.get("vs", {}).values():
                for key in [k for k in versus if "floor" in k or k.startswith("bare_")]:
                    del versus[key]
    text = report.models_table([inference_only, result])
    assert "Training: 1 of the 2 run(s)." in text
    old_text = report.models_table([old])
    row = next(line for line in old_text.splitlines()
               if line.startswith("| vmoe_s32_last2_e8 | vit_s32 | 1 "))
    assert row.split("|")[7:9] == [" – ", " – "]
    assert "Bare-matmul floor:" not in old_text


@pytest.fixture(scope="module")
def soft_moe_json(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "soft_moe.json"
    _load("soft_moe_layer").main(
        ["--quick", "--reps", "2", "--warmup", "0", "--allow-loaded", "--output", str(out)]
    )
    return json.loads(out.read_text()), out


@pytest.mark.heavy
def test_soft_moe_benchmark_matches_the_reference_order(soft_moe_json):
    result, _ = soft_moe_json
    # The plain-jnp transcription of the reference and SoftMoE agree (both
    # expert paths), so the timings compare the same computation.
    assert result["outputs_match_reference_order"]
    assert max(result["max_abs_diff_vs_reference_order"].values()) < 1e-2
    assert result["default_experts_implementation"] == "batched"
    for mode in ("fwd", "fwd_bwd"):
        assert set(result[mode]) == {"dense", "default", "loop", "batched",
                                     "reference_order", "bare_experts"}
        assert result[mode]["reference_order"]["time_ratio_vs_reference_order"] == 1.0
        assert result[mode]["default"]["median_ms"] > 0
        assert result[mode]["bare_experts"]["time_ratio_vs_bare_experts"] == 1.0
        assert result[mode]["default"]["time_ratio_vs_bare_experts"] > 0
    # The floor runs the layer's own experts (same weights, same outputs).
    assert result["bare_experts_vs_layer_experts_max_abs_diff"] < 1e-5
    same = result["same_optimized_program_as_reference_order"]
    assert set(same) == {"default_fwd", "default_fwd_bwd", "batched_fwd", "batched_fwd_bwd"}
    assert all(isinstance(v, bool) for v in same.values())


def test_entry_program_ignores_names_but_not_ops_or_shapes():
    import jax
    import jax.numpy as jnp

    soft = _load("soft_moe_layer")

    def program(fn, *shapes):
        args = [jnp.ones(s) for s in shapes]
        return soft.entry_program(jax.jit(fn).lower(*args).compile())

    def double(a):
        return a * 2.0

    def double_renamed(b):
        return b * 2.0

    assert program(double, (4, 8)) == program(double_renamed, (4, 8))
    assert program(double, (4, 8)) != program(double, (4, 9))
    assert program(double, (4, 8)) != program(jnp.tanh, (4, 8))


@pytest.mark.heavy
def test_report_writes_soft_moe_table(soft_moe_json, tmp_path):
    report = _load("report")
    _, path = soft_moe_json
    readme = _readme(tmp_path, report)
    report.main(["--soft-moe", str(path), "--write-readme", str(readme)])
    text = readme.read_text()
    assert "benchmarks/soft_moe_layer.py" in text
    assert "| default (experts: batched) |" in text and "reference order" in text
    assert "in every run: yes" in text
    assert "| bare experts (the floor" in text and "vs bare experts fwd / fwd+bwd" in text
    # Runs made before the floor existed print dashes in its column.
    old = json.loads(path.read_text())
    for mode in ("fwd", "fwd_bwd"):
        del old[mode]["bare_experts"]
        for entry in old[mode].values():
            del entry["time_ratio_vs_bare_experts"]
    assert "| – / – |" in report.soft_moe_table([old])


@pytest.mark.heavy
def test_expert_paths_sweep_reports_both_paths_and_the_auto_choice(tmp_path):
    out = tmp_path / "paths.json"
    result = _load("expert_paths").main(
        ["--quick", "--reps", "2", "--warmup", "0", "--allow-loaded", "--output", str(out)])
    assert json.loads(out.read_text())["shapes"] == result["shapes"]
    assert [(r["num_experts_E"], r["rows"]) for r in result["shapes"]] == [(4, 8), (2, 16)]
    for row in result["shapes"]:
        assert row["loop_ms"]["median_ms"] > 0 and row["batched_ms"]["median_ms"] > 0
        assert row["faster"] in ("loop", "batched")
        assert row["auto_picks"] == "batched"  # tiny hidden activations
    assert 0 <= result["auto_picks_faster"] <= 2


@pytest.mark.heavy
def test_ragged_dot_probe_times_all_paths_on_the_same_math(tmp_path):
    out = tmp_path / "ragged.json"
    result = _load("ragged_dot_probe").main(
        ["--quick", "--reps", "2", "--warmup", "0", "--dtype", "float32",
         "--dtype", "bfloat16", "--allow-loaded", "--output", str(out)])
    assert json.loads(out.read_text())["shapes"] == result["shapes"]
    assert [r["dtype"] for r in result["shapes"]] == ["float32", "bfloat16"]
    for row in result["shapes"]:
        # ragged_dot over full groups computes what the batched path does.
        tolerance = 1e-5 if row["dtype"] == "float32" else 5e-2
        assert row["ragged_all_vs_batched_max_abs_diff"] < tolerance
        assert 0 < row["filled_fraction"] <= 1.0  # 60-100% of each group, floored
        for mode in ("fwd", "fwd_bwd"):
            assert row[mode]["batched"]["time_ratio_vs_batched"] == 1.0
            assert row[mode]["ragged_all"]["median_ms"] > 0
            assert row[mode]["ragged_filled"]["median_ms"] > 0
    assert isinstance(result["ragged_faster_anywhere"], bool)


@pytest.mark.heavy  # ~20-30 s on 2 cores (one process per XLA flag set); .ci/run runs the group
def test_xla_cpu_kernels_probe_runs_each_flag_set_in_its_own_process(tmp_path):
    probe = _load("xla_cpu_kernels_probe")
    probe.FLAG_SETS["bogus"] = "--xla_cpu_no_such_flag_for_this_test=1"
    try:
        result = probe.main(["--quick", "--flag-sets", "eigen,bogus",
                             "--allow-loaded", "--output", str(tmp_path / "kernels.json")])
    finally:
        del probe.FLAG_SETS["bogus"]
    runs = result["flag_sets"]
    assert list(runs) == ["default", "eigen", "bogus"]  # default is always measured
    assert "error" in runs["bogus"] and "no_such_flag" in runs["bogus"]["error"]
    default = runs["default"][0]
    assert isinstance(default["fwd"]["library_fusions"], list)
    assert default["fwd_bwd"]["time_ratio_vs_default"] == 1.0
    assert default["fwd"]["gflops"] > 0
    if "error" not in runs["eigen"]:  # a later jaxlib may not know the flag
        eigen = runs["eigen"][0]
        # The flags reached the child: its dots are in no library fusion.
        assert eigen["fwd"]["library_fusions"] == []
        assert eigen["fwd_max_abs_diff_vs_default"] < 1e-4
        assert eigen["fwd"]["time_ratio_vs_default"] > 0
    assert {row["fastest"] for row in result["fastest"]} <= {"default", "eigen"}
    assert json.loads((tmp_path / "kernels.json").read_text())["flag_sets"].keys() == runs.keys()
    with pytest.raises(SystemExit):
        probe.main(["--quick", "--flag-sets", "nonsense"])
    with pytest.raises(SystemExit):
        probe.main(["--quick", "--reps", "-1"])


def test_shape_arguments_name_what_is_expected():
    parse = _load("moe_layer").positive_ints(("E", "ROWS"))
    assert parse("4,8") == (4, 8)
    for bad in ("4", "4,0", "4,x", "1,2,3"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"2 positive ints E,ROWS.*"):
            parse(bad)


def test_vit_benchmark_matches_the_reference_order(tmp_path):
    out = tmp_path / "vit.json"
    result = _load("vit_reference_order").main(
        ["--quick", "--batch", "2", "--reps", "2", "--warmup", "0", "--allow-loaded",
         "--output", str(out)])
    assert json.loads(out.read_text())["max_abs_diff_logits"] == result["max_abs_diff_logits"]
    # The transcription and the Keras model compute the same logits, so the
    # timings compare the same computation.
    assert result["outputs_match_reference_order"]
    assert result["max_abs_diff_logits"] < 1e-4
    assert result["config"]["classifier"] == "gap" and result["config"]["qk_norm"]
    assert result["inference"]["keras_vmoe"]["median_ms"] > 0
    assert result["time_ratio_vs_reference_order"] > 0


def test_readme_figures_reports_seeds_spread_machine_and_commit(monkeypatch, tmp_path,
                                                               capsys):
    """`benchmarks/readme_figures.py` (the README's headline figures), with
    the main job and the suite replaced by stand-ins that take no time."""
    import sys

    module = _load("readme_figures")
    fake_job = (
        "import json, os, sys\n"
        "out = sys.argv[sys.argv.index('--output') + 1]\n"
        "os.makedirs(out)\n"
        "seed = int(sys.argv[sys.argv.index('--seed') + 1]) if '--seed' in sys.argv else 0\n"
        "accuracy = 0.95 + 0.01 * seed if '--epochs' in sys.argv else 0.9\n"
        "json.dump({'test_accuracy': accuracy, 'fit_seconds': 1.0},"
        " open(os.path.join(out, 'metrics.json'), 'w'))\n")
    monkeypatch.setattr(module, "MAIN_JOB", [sys.executable, "-c", fake_job])
    monkeypatch.setattr(module, "SUITE", [
        sys.executable, "-c", "print('12 passed, 3 deselected in 1.00s')"])
    out = tmp_path / "figures.json"
    assert module.main(["--seeds", "0,2", "--main-job-args", "--epochs 1",
                        "--allow-loaded", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == report
    job, suite = report["main_job"], report["suite"]
    assert [(r["seed"], r["test_accuracy"]) for r in job["runs"]] == [(0, 0.95), (2, 0.97)]
    assert job["wall_s"]["runs"] == 2 and job["wall_s"]["min"] <= job["wall_s"]["max"]
    assert suite["runs"][0]["passed"] == 12 and suite["passed"]["median"] == 12
    assert report["machine"]["usable_cores"] >= 1 and report["machine"]["cpu"]
    assert report["git"]["commit"] and isinstance(report["git"]["dirty"], bool)
    sentence = report["readme_sentence"]
    assert "(2 runs)" in sentence and "12 tests" in sentence
    assert f"{report['machine']['usable_cores']} cores" in sentence
    quotes = report["readme_quotes"]
    assert quotes["accuracy"] == "95.0 %" and quotes["seed_range"] == "95.0 % to 97.0 %"
    assert quotes["seeds"] == "seeds 0-2" and quotes["commit"] == report["git"]["commit"]


def test_readme_quotes_the_newest_main_job_figures():
    """The README's main-job paragraph quotes the newest result file of
    `readme_figures.py` (accuracy, seed range, time, memory, commit,
    machine) and names that file."""
    module = _load("readme_figures")
    path, report = module.latest_result()
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    front = " ".join(readme[:readme.index("\n## ")].split())  # lines joined
    relative = os.path.relpath(path, ROOT)
    assert f"`{relative}`" in front, f"the README does not name {relative}"
    assert not report["git"]["dirty"], f"{relative} was measured on a changed checkout"
    assert report["load"]["quiet"], f"{relative} was measured on a loaded machine"
    missing = {k: v for k, v in module.readme_quotes(report).items() if v not in front}
    assert not missing, f"the README's first section lacks these figures of {relative}: {missing}"
    # Every seed measured meets the minimum the landing guard enforces.
    minimum = module.readme_minimum_accuracy()
    assert report["main_job"]["test_accuracy"]["min"] >= minimum


def test_landing_guard_refuses_a_main_job_below_the_readme_minimum(tmp_path, capsys):
    module = _load("readme_figures")
    readme = tmp_path / "README.md"
    readme.write_text("CI refuses a change whose main job falls below **97.0 %** here.")
    assert module.readme_minimum_accuracy(readme) == 0.97
    metrics = tmp_path / "metrics.json"

    def guard(accuracy, epochs=3, ran=3, completed=True):
        metrics.write_text(json.dumps({
            "test_accuracy": accuracy, "epochs": epochs, "completed": completed,
            "history": {"loss": [1.0] * ran}}))
        return module.check_main_job(str(metrics), readme)

    assert guard(0.975) == 0
    assert guard(0.9694) == 1
    assert "below the README's minimum of 97.0 %" in capsys.readouterr().err
    assert guard(float("nan")) == 1 and guard(None) == 1
    assert guard(0.99, epochs=30, ran=1) == 1  # a shortened run proves nothing
    assert "not a finished run (1 of 30 epochs)" in capsys.readouterr().err
    assert guard(0.99, completed=False) == 1
    readme.write_text("no minimum here")
    with pytest.raises(ValueError, match="states no minimum accuracy"):
        module.readme_minimum_accuracy(readme)
