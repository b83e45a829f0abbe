"""keras_vmoe.presets.table: preset tables that fit the terminal and keep
whole names."""

import pytest

from keras_vmoe import cli
from keras_vmoe.presets import table


@pytest.mark.parametrize("width", [250, 160, 120, 100, 80, 60])
def test_presets_table_fits_the_width_and_keeps_whole_names(width):
    rows = table.list_presets(details=True)
    lines = table.format_table(rows, width=width).splitlines()
    assert max(len(line) for line in lines) <= width
    words = {word for line in lines for word in line.split()}
    assert {row["name"] for row in rows} <= words  # names are never cut


def test_presets_table_follows_columns_even_when_piped(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    assert cli.main(["presets", "--family", "vmoe"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines and max(len(line) for line in lines) <= 80
    monkeypatch.delenv("COLUMNS")
    assert table.terminal_width(None) is None  # a pipe: no limit
