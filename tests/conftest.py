"""Test configuration: JAX backend and 8 virtual CPU devices."""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# XLA flags for the test processes (and the processes they start, which
# inherit the environment):
# - 8 virtual CPU devices, for the distribution tests;
# - LLVM's optimisation of the compiled CPU kernels turned down. The suite
#   compiles thousands of small programs (every eager op of a new shape is
#   one), and optimising their machine code is a large part of each compile
#   while their tensors are too small for it to pay back. XLA's own passes
#   (fusion, layout, buffer assignment) run as usual, so the programs and
#   their memory analysis are the ones users get. A test process can ask
#   for another level by setting the flag itself.
_TEST_XLA_FLAGS = {
    "--xla_force_host_platform_device_count": "8",
    "--xla_backend_optimization_level": "0",
}
_flags = os.environ.get("XLA_FLAGS", "").split()
for _name, _value in _TEST_XLA_FLAGS.items():
    if not any(f.split("=")[0] == _name for f in _flags):
        _flags.append(f"{_name}={_value}")
os.environ["XLA_FLAGS"] = " ".join(_flags)

import atexit  # noqa: E402
import pathlib  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

# One JAX compilation cache for the whole run: the xdist workers and every
# process a test starts (CLI runs, kill tests, notebook kernels) inherit it,
# so a program compiled once is loaded, not compiled, by the next process.
# `.ci/run` sets one folder for all its groups; otherwise the run makes its
# own and removes it at exit. The cached programs are the compiled ones, so
# results are the same bit for bit.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="keras_vmoe_jax_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import pytest  # noqa: E402

# The shared test helpers (`testing`, `tiny_configs`) import by name.
sys.path.insert(0, str(pathlib.Path(__file__).parent))

DATA_DIR = pathlib.Path(__file__).parent / "data"
UPSTREAM_DIR = DATA_DIR / "upstream_vmoe"


@pytest.fixture(scope="session")
def upstream_dir():
    """Folder of the upstream reference fixtures (see tests/data/README.md)."""
    return UPSTREAM_DIR


@pytest.fixture(autouse=True)
def _no_public_bucket(monkeypatch):
    """Public-bucket URLs point at a closed port on 127.0.0.1: no test reaches
    the network (downloads of released weights fail at once, as offline)."""
    from keras_vmoe.formats import remote

    monkeypatch.setattr(remote, "GCS_BASE", "http://127.0.0.1:9")


# The marked groups whose tests each run for tens of seconds to minutes (a
# notebook, a benchmark script, a fault test's processes), in the order they
# are handed out: longest kinds first, so that the short tests come last and
# fill the two xdist workers' ends (`--dist worksteal`, pyproject.toml,
# rebalances the queued tests, not a running one).
LONG_TEST_MARKERS = ("notebooks", "faults", "benchmarks")


def pytest_collection_modifyitems(config, items):
    def rank(item):
        return next((i for i, name in enumerate(LONG_TEST_MARKERS)
                     if item.get_closest_marker(name)), len(LONG_TEST_MARKERS))

    items.sort(key=rank)  # stable: each kind keeps its collection order
