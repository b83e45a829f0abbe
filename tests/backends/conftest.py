"""Backend-parity fixtures: the driver run once per backend, in parallel.

Keras picks its backend once per process, so each backend runs
`driver.py` in its own subprocess (`KERAS_BACKEND=torch|tensorflow`); they
start together and the tests compare their JSON results with the JAX
results in `jax_reference.json`, written by the same driver on JAX (about
20 minutes of compiles on a loaded 2-core machine, so CI reads them):

    KERAS_BACKEND=jax python tests/backends/driver.py \
        tests/backends/jax_reference.json

`test_jax_reference.py` (default suite) checks that file against the
upstream fixtures; `KERAS_VMOE_LIVE_JAX=1` recomputes it in the run.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BACKENDS = ("torch", "tensorflow")
JAX_REFERENCE = HERE / "jax_reference.json"
TIMEOUT_S = 1500


def backend_env(backend):
    """Environment of a subprocess on `backend` (one CPU device, quiet TF)."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env.update(KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2",
               XLA_FLAGS=" ".join(flags),
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    return env


def _run_script(backend, code, timeout=600):
    """Runs Python `code` on `backend`; returns the JSON of its last line."""
    done = subprocess.run([sys.executable, "-c", code], env=backend_env(backend),
                          capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, f"{backend}:\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def _installed(backend):
    module = {"torch": "torch", "tensorflow": "tensorflow", "jax": "jax"}[backend]
    import importlib.util

    return importlib.util.find_spec(module) is not None


@pytest.fixture(scope="session")
def driver_results(tmp_path_factory):
    """`{backend: driver JSON}` for JAX and every installed other backend."""
    out_dir = tmp_path_factory.mktemp("backends")
    running = {}
    live_jax = os.environ.get("KERAS_VMOE_LIVE_JAX") == "1"
    for backend in ("jax", *BACKENDS):
        if not _installed(backend) or (backend == "jax" and not live_jax):
            continue
        path = out_dir / f"{backend}.json"
        log = open(out_dir / f"{backend}.log", "w")  # noqa: SIM115
        running[backend] = (path, log, subprocess.Popen(
            [sys.executable, str(HERE / "driver.py"), str(path)],
            env=backend_env(backend), stdout=log, stderr=subprocess.STDOUT))
    results = {} if live_jax else {"jax": json.loads(JAX_REFERENCE.read_text())}
    for backend, (path, log, process) in running.items():
        try:
            process.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
        if process.returncode == 0:
            results[backend] = json.loads(path.read_text())
        else:
            text = (out_dir / f"{backend}.log").read_text()
            results[backend] = {"error": text[-6000:]}
    return results


@pytest.fixture(scope="session")
def run_script():
    """`run_script(backend, code)`: runs Python `code` on `backend` and
    returns the JSON its last output line holds."""
    return _run_script


@pytest.fixture(params=BACKENDS)
def backend(request):
    if not _installed(request.param):
        pytest.skip(f"{request.param} is not installed (pip install -e '.[torch]')")
    return request.param
