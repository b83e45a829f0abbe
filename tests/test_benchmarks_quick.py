"""Every benchmark script's quick mode runs, as a user runs it, and writes its
result with the load record (`benchmarks/harness.py`).

Marked `benchmarks` (deselected by default; CI runs the group): each script
starts its own process and compiles its models, a few minutes in all.
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
    "torch_ops": ["--quick"],
    "train_step": ["--quick"],
    "upcycling_digits": ["--quick"],
    "vit_reference_order": ["--quick", "--batch", "2", "--reps", "1", "--warmup", "0"],
    # The default flag set only: tests/test_benchmarks.py runs the others.
    "xla_cpu_kernels_probe": ["--quick", "--reps", "1", "--flag-sets", "default"],
}
# Not benchmarks: the shared harness and the README table writer (tested in
# tests/test_benchmarks.py on the scripts' results).
NOT_SCRIPTS = {"harness", "report"}


def test_every_script_has_a_quick_command():
    names = {f[:-3] for f in os.listdir(os.path.join(ROOT, "benchmarks"))
             if f.endswith(".py") and not f.startswith("_")}
    assert names - NOT_SCRIPTS == set(QUICK)


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
