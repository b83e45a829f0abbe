"""Runs the code cells of every notebook in notebooks/ (tiny settings).

Shell (`!`) and magic (`%`) lines are skipped; the notebooks read
`KERAS_VMOE_NOTEBOOK_TINY=1` to shrink their loops.
"""

import json
import pathlib

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))


def _code(notebook):
    cells = json.loads(notebook.read_text())["cells"]
    for cell in cells:
        if cell["cell_type"] != "code":
            continue
        lines = [
            line for line in "".join(cell["source"]).splitlines()
            if not line.lstrip().startswith(("!", "%"))
        ]
        yield "\n".join(lines)


def test_there_are_notebooks():
    assert NOTEBOOKS


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(notebook, monkeypatch, capsys):
    monkeypatch.setenv("KERAS_VMOE_NOTEBOOK_TINY", "1")
    namespace = {"__name__": "__notebook__"}
    for index, source in enumerate(_code(notebook)):
        exec(compile(source, f"{notebook.name}[cell {index}]", "exec"), namespace)
    assert "restored outputs equal: True" in capsys.readouterr().out
