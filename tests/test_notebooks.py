"""The notebooks: stored clean, set-up cell, and executed in a real kernel.

The execution tests are marked `notebooks` (run by `.ci/run` as its own
step: `pytest -m notebooks`). Each notebook runs top to bottom in a fresh
kernel with `KERAS_VMOE_NOTEBOOK_SMALL=1` (small settings), offline:

* `checkout-1dev` (every notebook but the quick start): inside the checkout (working directory
  `notebooks/`, the checkout's `keras_vmoe`), on 1 CPU device, training
  for 1 epoch (`KERAS_VMOE_NOTEBOOK_EPOCHS=1`);
* `installed-8dev` (the notebooks in `INSTALLED_8DEV`: the quick start, which
  reads the package data a wheel must carry, and scaling out, whose mesh
  follows the device count): in an empty folder outside the checkout, with
  `keras_vmoe` as installed from the wheel (in CI: `pip install .`; with
  an editable install, a wheel-equivalent copy: the package's `.py` files
  and the package data `pyproject.toml` declares), on 8 virtual devices,
  training for 1 epoch (`KERAS_VMOE_NOTEBOOK_EPOCHS=1`).

`KERAS_VMOE_NOTEBOOK_OUTPUTS=DIR` keeps the executed notebooks there.
A run fails if a cell raises, if a notebook that draws produces no image,
or if a cell's output carries TensorFlow/absl start-up noise.
"""

import importlib.metadata
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import tomllib

import pytest

from keras_vmoe.distribution.launch import xla_flags_for_cpu_devices

nbformat = pytest.importorskip("nbformat")

ROOT = pathlib.Path(__file__).parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# Notebooks that must show at least this many figures.
MIN_IMAGES = {
    "01_quickstart": 1,
    "02_finetuning": 1,
    "03_what_the_experts_do": 3,
    "04_capacity_tradeoff": 1,
    "05_soft_moe": 2,
    "06_e3_ensembles": 1,
    "07_convert_upstream_checkpoint": 1,
    "08_scaling_out": 1,
    "09_upcycling": 2,
}
# Log lines a user cannot act on.
NOISE = ("absl::InitializeLog", "oneDNN", "cpu_feature_guard", "TF_ENABLE_ONEDNN_OPTS")


def _setup_source(path):
    notebook = nbformat.read(str(path), as_version=4)
    return next(c for c in notebook.cells if c.cell_type == "code").source


def test_there_are_notebooks():
    assert NOTEBOOKS
    assert {p.stem for p in NOTEBOOKS} <= set(MIN_IMAGES), "add new notebooks to MIN_IMAGES"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_valid_and_stored_without_outputs(path):
    notebook = nbformat.read(str(path), as_version=4)
    nbformat.validate(notebook)  # cell ids included (nbformat >= 4.5)
    assert all("id" in cell for cell in notebook.cells)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert not cell.outputs, f"{path.name}: stored with outputs"
    first_code = _setup_source(path)
    assert "PIP_SPEC" in first_code and "SMALL" in first_code
    text = path.read_text()
    assert "colab.research.google.com/\"" not in text and "colab.research.google.com/)" not in text


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_commands_parse(path):
    """Every `keras-vmoe ...` command a notebook's text gives is accepted."""
    from keras_vmoe.cli import build_parser

    notebook = nbformat.read(str(path), as_version=4)
    text = " ".join(c.source for c in notebook.cells if c.cell_type == "markdown")
    commands = re.findall(r"`(keras-vmoe [^`]+)`", text.replace("\n", " "))
    parser = build_parser()
    for command in commands:
        argv = command.split()[1:]
        if argv[0] == "convert":  # parsed by the converter's own parser
            from keras_vmoe.cli.convert_cmd import build_parser as convert_parser

            convert_parser().parse_args(argv[1:])
            continue
        parser.parse_args(argv)


# Notebooks that save their figures (to KERAS_VMOE_NOTEBOOK_FIGURES when set,
# else to a temporary folder); the documentation's figures come from them.
SAVE_FIGURES = ("01_quickstart", "03_what_the_experts_do", "04_capacity_tradeoff",
                "06_e3_ensembles", "09_upcycling")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_figures_folder_is_respected_and_holds_only_figures(path):
    notebook = nbformat.read(str(path), as_version=4)
    code = "\n".join(c.source for c in notebook.cells if c.cell_type == "code")
    if path.stem in SAVE_FIGURES:
        assert 'os.environ.get("KERAS_VMOE_NOTEBOOK_FIGURES")' in code
    written = re.findall(r'FIGURES / "([^"]+)"', code)
    assert all(name.endswith(".png") for name in written), (
        f"{path.name} writes other files than figures into the figures folder: {written}")


class _Installs:
    """Runs a set-up cell with keras_vmoe missing and pip recorded."""

    def __init__(self, monkeypatch, cwd):
        self.calls = []
        real_find_spec = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
            None if name == "keras_vmoe" else real_find_spec(name, *a)))
        monkeypatch.setattr(subprocess, "check_call", self.calls.append)
        monkeypatch.setattr(os, "environ", dict(os.environ))
        os.environ.pop("KERAS_VMOE_PIP_SPEC", None)
        monkeypatch.chdir(cwd)

    def run(self, source, pip_spec=None):
        if pip_spec is not None:
            source = source.replace('PIP_SPEC = ""', f"PIP_SPEC = {pip_spec!r}", 1)
        exec(compile(source, "<set-up cell>", "exec"), {"__name__": "__main__"})
        return self.calls[-1][-1] if self.calls else None


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_setup_cell_installs_a_version_that_exists(path, monkeypatch, tmp_path):
    source = _setup_source(path)
    assert re.search(r'^PIP_SPEC = ""$', source, re.M), "PIP_SPEC must default to empty"
    # Inside a checkout (the notebooks/ folder): installs that checkout.
    installs = _Installs(monkeypatch, ROOT / "notebooks")
    assert installs.run(source) == str(ROOT)
    # Outside a checkout, with PIP_SPEC set: installs what the user set.
    installs = _Installs(monkeypatch, tmp_path)
    url = "git+https://github.com/someone/keras_vmoe"
    assert installs.run(source, pip_spec=url) == url
    # Neither: a clear message naming what to set, and no pip call at all
    # (never the bare `keras-vmoe`, which is not on PyPI).
    installs = _Installs(monkeypatch, tmp_path)
    with pytest.raises(RuntimeError, match=r"Set PIP_SPEC .*git\+https://github.com/"):
        installs.run(source)
    assert installs.calls == []


def _editable_or_missing():
    try:
        files = importlib.metadata.distribution("keras-vmoe").files or []
    except importlib.metadata.PackageNotFoundError:
        return True
    init = [f for f in files if str(f).replace("\\", "/") == "keras_vmoe/__init__.py"]
    if not init:
        return True
    return ROOT / "keras_vmoe" in pathlib.Path(init[0].locate()).resolve().parents


@pytest.fixture(scope="session")
def installed_pythonpath(tmp_path_factory):
    """PYTHONPATH for the installed-package runs: '' when keras_vmoe is
    installed from a wheel (CI), else a wheel-equivalent copy of it."""
    if not _editable_or_missing():
        return ""
    site = tmp_path_factory.mktemp("site")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_data = config.get("package-data", {})
    for init in sorted((ROOT / "keras_vmoe").rglob("__init__.py")):
        package_dir = init.parent
        package = ".".join(package_dir.relative_to(ROOT).parts)
        patterns = ["*.py", *package_data.get(package, [])]
        target = site / package_dir.relative_to(ROOT)
        target.mkdir(parents=True, exist_ok=True)
        for pattern in patterns:
            for file in package_dir.glob(pattern):
                shutil.copy2(file, target / file.name)
    return str(site)


def _images(notebook):
    count = 0
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            if "image/png" in output.get("data", {}):
                count += 1
    return count


def _text_outputs(notebook):
    texts = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            texts.append(output.get("text", ""))
            texts.append(output.get("data", {}).get("text/plain", ""))
    return "\n".join(texts)


# The notebooks that run in the `installed-8dev` mode: the quick start reads
# the package data a wheel must carry (it uses no device count, and the
# other notebooks run from the checkout, so it runs in this mode only);
# scaling out follows the device count: 8 virtual devices on a CPU, one on
# a GPU (Colab), so it runs in both modes. The others use neither.
INSTALLED_8DEV = ("01_quickstart", "08_scaling_out")
INSTALLED_ONLY = ("01_quickstart",)

MODES = {
    # mode: (devices, inside the checkout, training epochs). The runs check
    # that every cell runs and draws, not the numbers (no cell asserts on
    # them): 1 epoch instead of the small setting's 8 runs the same code.
    # The figures of the documentation come from the small setting
    # (`KERAS_VMOE_NOTEBOOK_FIGURES`, see docs/guides/evaluation.md).
    "checkout-1dev": (1, True, 1),
    "installed-8dev": (8, False, 1),
}


RUNS = [(path, mode) for path in NOTEBOOKS for mode in sorted(MODES)
        if (mode == "checkout-1dev" and path.stem not in INSTALLED_ONLY)
        or (mode == "installed-8dev" and path.stem in INSTALLED_8DEV)]


def test_each_notebook_runs_once_and_scaling_out_twice():
    assert {p.stem for p in NOTEBOOKS} >= set(INSTALLED_8DEV) >= set(INSTALLED_ONLY)
    runs = [(path.stem, mode) for path, mode in RUNS]
    assert {stem for stem, _ in runs} == {p.stem for p in NOTEBOOKS}
    assert len(runs) == len(NOTEBOOKS) + len(INSTALLED_8DEV) - len(INSTALLED_ONLY)
    assert ("08_scaling_out", "checkout-1dev") in runs
    assert ("01_quickstart", "installed-8dev") in runs


@pytest.mark.notebooks
@pytest.mark.parametrize("path,mode", RUNS, ids=[f"{p.stem}-{m}" for p, m in RUNS])
def test_notebook_runs_and_draws(path, mode, tmp_path, request):
    nbclient = pytest.importorskip("nbclient")
    devices, in_checkout, epochs = MODES[mode]
    notebook = nbformat.read(str(path), as_version=4)
    # Reports where keras_vmoe and how many devices the kernel had.
    notebook.cells.append(nbformat.v4.new_code_cell(
        "import jax as _jax, keras_vmoe as _kv\n"
        "print('KV_FILE', _kv.__file__, 'KV_DEVICES', len(_jax.devices()))"))
    env_before = dict(os.environ)
    os.environ["KERAS_VMOE_NOTEBOOK_SMALL"] = "1"
    os.environ["KERAS_VMOE_NOTEBOOK_OFFLINE"] = "1"
    os.environ["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    os.environ["XLA_FLAGS"] = xla_flags_for_cpu_devices(devices)
    os.environ.pop("TF_CPP_MIN_LOG_LEVEL", None)  # the notebooks must quieten TF
    os.environ.pop("KERAS_VMOE_NOTEBOOK_EPOCHS", None)
    if epochs:
        os.environ["KERAS_VMOE_NOTEBOOK_EPOCHS"] = str(epochs)
    if in_checkout:
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT), *filter(None, [env_before.get("PYTHONPATH")])])
        cwd = ROOT / "notebooks"
    else:
        site = request.getfixturevalue("installed_pythonpath")
        os.environ["PYTHONPATH"] = site
        cwd = tmp_path
    files_before = sorted(os.listdir(cwd))
    try:
        client = nbclient.NotebookClient(
            notebook, timeout=600, kernel_name="python3",
            resources={"metadata": {"path": str(cwd)}},
        )
        client.execute()
    finally:
        os.environ.clear()
        os.environ.update(env_before)
        keep = os.environ.get("KERAS_VMOE_NOTEBOOK_OUTPUTS")  # to look at them
        if keep:
            pathlib.Path(keep).mkdir(parents=True, exist_ok=True)
            nbformat.write(notebook, str(pathlib.Path(keep) / f"{path.stem}-{mode}.ipynb"))
    assert sorted(os.listdir(cwd)) == files_before, "the notebook wrote into its folder"
    drawn = _images(notebook)
    assert drawn >= MIN_IMAGES.get(path.stem, 1), (
        f"{path.name} drew {drawn} images, expected at least {MIN_IMAGES[path.stem]}")
    text = _text_outputs(notebook)
    where = re.search(r"KV_FILE (\S+) KV_DEVICES (\d+)", text)
    assert int(where.group(2)) == devices
    kv_file = pathlib.Path(where.group(1)).resolve()
    assert (ROOT / "keras_vmoe" in kv_file.parents) == in_checkout, kv_file
    noise = [n for n in NOISE if n in text]
    assert not noise, f"{path.name}: log noise in the outputs: {noise}"
    if path.stem == "01_quickstart":
        assert "RANDOM WEIGHTS" in text and "tench" not in text
    if path.stem == "08_scaling_out":
        assert f"'data': 1, 'expert': {devices}" in text  # mesh from the devices
