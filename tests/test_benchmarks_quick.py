"""Every benchmark script's quick mode runs, as a user runs it, and writes its
result with the load record (`benchmarks/harness.py`).

Marked `benchmarks` (deselected by default; CI runs the group): each script
starts its own process and compiles its models, a few minutes in all.
`upstream_step.py` needs upstream's Flax code, absent here: the unmarked tests
check, in well under a second each, that its `--help` works and that it
exits with status 2 and says what is missing.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Each script's quick command line (after `python benchmarks/<name>.py`).
QUICK = {
    "backends": ["--quick", "--reps", "1", "--warmup", "1", "--backends", "jax,torch,tensorflow"],
    "expert_paths": ["--quick", "--reps", "1", "--warmup", "0"],
    "http_checkpoint": ["--quick"],
    "int8": ["--quick"],
    "int8_weight_bound": ["--quick"],
    "lora_memory": ["--quick"],
    "models": ["--quick", "--models", "vit_s32,vmoe_s32_last2_e8", "--batches", "1",
               "--reps", "1", "--train-steps", "1", "--train-rounds", "1"],
    "moe_layer": ["--quick", "--reps", "1", "--warmup", "0", "--shape", "16,8,16,4,2,1.0"],
    "ragged_dot_probe": ["--quick", "--reps", "1", "--warmup", "0"],
    "readme_figures": ["--quick"],
    "remat": ["--quick"],
    "scan": ["--quick"],
    "soft_moe_layer": ["--quick", "--reps", "1", "--warmup", "0"],
    "start_up": ["--quick"],
    "torch_ops": ["--quick"],
    "train_step": ["--quick"],
    "upcycling_digits": ["--quick"],
    "vit_reference_order": ["--quick", "--batch", "2", "--reps", "1", "--warmup", "0"],
    # The default flag set only: tests/test_benchmarks.py runs the others.
    "xla_cpu_kernels_probe": ["--quick", "--reps", "1", "--flag-sets", "default"],
}
# Scripts whose quick mode needs code that is not installed here (upstream's
# Flax checkouts and flax itself): without it, `--quick` exits with status 2
# and says what is missing, which the tests below check.
NEEDS_UPSTREAM = {"upstream_step": ["--quick"]}
# Not benchmarks: the shared harness and the README table writer (tested in
# tests/test_benchmarks.py on the scripts' results).
NOT_SCRIPTS = {"harness", "report"}


def test_every_script_has_a_quick_command():
    names = {f[:-3] for f in os.listdir(os.path.join(ROOT, "benchmarks"))
             if f.endswith(".py") and not f.startswith("_")}
    assert names - NOT_SCRIPTS == set(QUICK) | set(NEEDS_UPSTREAM)
    assert not set(QUICK) & set(NEEDS_UPSTREAM)


def _upstream_step(*argv, cwd):
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "upstream_step.py"), *argv],
        cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


def test_upstream_step_help_needs_neither_upstream_nor_flax(tmp_path):
    done = _upstream_step("--help", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "--upstream-src" in done.stdout and "--dispatcher" in done.stdout
    assert "git clone https://github.com/google-research/vmoe" in done.stdout


@pytest.mark.parametrize("argv", [[], NEEDS_UPSTREAM["upstream_step"]])
def test_upstream_step_without_upstream_exits_2_saying_what_is_missing(argv, tmp_path):
    done = _upstream_step(*argv, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "no --upstream-src was given" in done.stderr
    assert "https://github.com/google-research/vision_transformer" in done.stderr
    assert done.stdout == ""


def test_upstream_step_with_a_path_lacking_the_checkouts_exits_2(tmp_path):
    (tmp_path / "vmoe").mkdir()
    done = _upstream_step("--upstream-src", str(tmp_path), cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert os.path.join(str(tmp_path), "vmoe", "vmoe", "moe.py") in done.stderr
    assert "vision_transformer checkout" in done.stderr


@pytest.mark.benchmarks
@pytest.mark.parametrize("name", sorted(QUICK))
def test_quick_mode_runs_and_records_the_load(name, tmp_path):
    if name in ("backends", "torch_ops"):
        pytest.importorskip("torch")
    if name == "backends":
        pytest.importorskip("tensorflow")
    out = tmp_path / f"{name}.json"
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", f"{name}.py"),
         *QUICK[name], "--allow-loaded", "--output", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
        check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    load = result["load"]
    assert load["allowed_loaded"] is True and load["usable_cores"] >= 1
    assert load["before"] is not None and load["after"] is not None
