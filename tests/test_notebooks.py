"""Executes every notebook in notebooks/ in a real Jupyter kernel.

Marked `notebooks` (run by `.ci/run` as its own step: `pytest -m notebooks`).
Each notebook runs top to bottom with `KERAS_VMOE_NOTEBOOK_SMALL=1` (small
settings) from the installed package, offline. The test fails if a cell
raises, if a notebook that draws produces no image, or if a stored
notebook is invalid or carries outputs.
"""

import os
import pathlib

import pytest

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
    "08_scaling_out": 0,
}


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
    first_code = next(c for c in notebook.cells if c.cell_type == "code")
    assert "PIP_SPEC" in first_code.source and "SMALL" in first_code.source
    text = path.read_text()
    assert "colab.research.google.com/\"" not in text and "colab.research.google.com/)" not in text


def _images(notebook):
    count = 0
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            if "image/png" in output.get("data", {}):
                count += 1
    return count


@pytest.mark.notebooks
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_and_draws(path, tmp_path):
    nbclient = pytest.importorskip("nbclient")
    notebook = nbformat.read(str(path), as_version=4)
    env_before = dict(os.environ)
    os.environ["KERAS_VMOE_NOTEBOOK_SMALL"] = "1"
    os.environ["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    os.environ.pop("XLA_FLAGS", None)  # the notebooks set their own
    try:
        client = nbclient.NotebookClient(
            notebook, timeout=600, kernel_name="python3",
            resources={"metadata": {"path": str(ROOT)}},
        )
        client.execute()
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    drawn = _images(notebook)
    assert drawn >= MIN_IMAGES.get(path.stem, 1), (
        f"{path.name} drew {drawn} images, expected at least {MIN_IMAGES[path.stem]}")
