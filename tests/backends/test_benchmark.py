"""`benchmarks/backends.py` runs every backend and reports ratios to JAX."""

import importlib.util
import json
import pathlib

import pytest

pytestmark = pytest.mark.backends
ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_backend_benchmark_reports_ratios_to_jax(tmp_path):
    pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location(
        "_bench_backends", ROOT / "benchmarks" / "backends.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "backends.json"
    module.main(["--quick", "--reps", "1", "--warmup", "1", "--machine", "test",
                 "--allow-loaded", "--output", str(out)])
    report = json.loads(out.read_text())
    names = {"layer_forward", "layer_train_step", "model_forward", "model_train_step"}
    for backend in ("jax", "torch", "tensorflow"):
        assert "error" not in report["results"][backend], report["results"][backend]
        assert set(report["results"][backend]) == names
        assert set(report["ratio_to_jax"][backend]) == names
    assert report["ratio_to_jax"]["jax"] == dict.fromkeys(names, 1.0)
