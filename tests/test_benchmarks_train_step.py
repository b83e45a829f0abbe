"""`benchmarks/train_step.py`: the raw jitted step is the step `fit` takes, and
`fit` adds no per-step host sync, compile or keras_vmoe Python work (counts,
not times, so they hold on a loaded machine). Marked `benchmarks` with the
scripts' quick modes."""

import importlib.util
import os

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bench():
    path = os.path.join(ROOT, "benchmarks", "train_step.py")
    spec = importlib.util.spec_from_file_location("_bench_train_step", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.benchmarks  # compiles the step twice (Keras' and the raw one)
def test_raw_step_takes_the_same_steps_as_train_on_batch(bench):
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "jax":
        pytest.skip("the raw step is a jax.jit step")
    model = bench.build(bench.QUICK)
    x, y = bench.data(model, 2, 3)
    step, state = bench.raw_step(model)
    raw_losses = []
    for i in range(3):
        loss, *state = step(*state, x[2 * i:2 * i + 2], y[2 * i:2 * i + 2])
        raw_losses.append(float(loss))
    keras_losses = []
    for i in range(3):
        logs = model.train_on_batch(x[2 * i:2 * i + 2], y[2 * i:2 * i + 2],
                                    return_dict=True)
        keras_losses.append(logs["loss"])
    # `train_on_batch` resets the metrics each call: its loss is the step's.
    np.testing.assert_allclose(keras_losses, raw_losses, rtol=1e-5)
    for variable, value in zip(model.trainable_variables, state[0], strict=True):
        np.testing.assert_allclose(np.asarray(variable.value), np.asarray(value),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.benchmarks  # compiles train_on_batch, fit and the raw step
def test_fit_has_no_per_step_sync_compile_or_library_python(bench):
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "jax":
        pytest.skip("counts JAX compilations")
    counters = bench.Counters()
    result = bench.jax_paths(bench.QUICK, 2, reps=1, fit_steps=4, counters=counters)
    fit = result["fit_per_step"]
    long, short = fit["counts_fit_4_steps"], fit["counts_fit_1_step"]
    # Warm calls compile and trace nothing.
    for counts in (long, short, result["train_on_batch"], result["raw_jit"]):
        assert counts["compiles"] == 0 and counts["traces"] == 0
    # The logs are read synchronously per call (epoch and train end), not per step.
    assert long["sync_log_reads"] == short["sync_log_reads"]
    assert long["host_reads"] == short["host_reads"] == 0
    assert fit["keras_vmoe_python_calls"] == 0
    assert result["raw_jit"]["python_calls"] < 50
